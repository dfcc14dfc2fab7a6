"""The round's device work (tree build + mask, static-cache verify forward, walk, compaction) can be captured in a
CUDA graph and has no hidden host sync: run on the 'meta' device (no data, so any data-dependent host read
raises), under a dispatch checker that also fails on every op that would read device data on the host or copy
host data to the device on CUDA (e.g. `x[0] = True` on a CUDA tensor is a blocking H2D copy, illegal in capture)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM

from eval.engine.cache.kv import KV_BUCKET
from eval.engine.cache.factory import target_cache
from eval.engine.decode import round_ops
from eval.engine.round_record import record_size

HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique", "_unique2",
              "unique_consecutive", "equal", "is_nonzero", "lift_fresh", "lift_fresh_copy"}


class HostTrafficChecker(TorchDispatchMode):
    """Records ops that sync with or copy from the host when the inputs live on a device ('meta' here)."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if name in HOST_READS:
            self.bad.append(f"{func}: host read / host data")
        elif any(t.device.type != "meta" for t in tensors):
            self.bad.append(f"{func}: CPU tensor argument (an H2D copy or a host constant on CUDA)")
        elif name in ("copy_", "index_put_", "index_put") and len(tensors) >= 2 and tensors[-1].dim() == 0:
            self.bad.append(f"{func}: element assignment from a host scalar (CPU scalar tensor -> H2D on CUDA)")
        elif name == "repeat_interleave" and tensors:
            self.bad.append(f"{func}: tensor repeats (output size read on the host)")
        elif name == "index" and any(t.dtype == torch.bool for t in tensors[1:]):
            self.bad.append(f"{func}: boolean-mask indexing (nonzero)")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def meta_cache():
    cfg = AutoConfig.for_model("qwen3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=320,
                               tie_word_embeddings=False)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    cache = target_cache(target, (1, 3), "static")
    cache.reset(3000)
    return cache


@pytest.mark.parametrize("method,budget", [("ddtree", 64), ("ddtree", 1), ("chain", None), ("ar", None)])
def test_round_ops_have_no_host_read_and_no_host_to_device_copy(meta_cache, method, budget):
    cache, L, V, dev = meta_cache, 7, 320, torch.device("meta")
    ops = round_ops(method, budget, "device", cache, 0.0, L, V, dev)
    logits = torch.empty(L, V, device=dev)
    bonus = torch.empty(1, dtype=torch.long, device=dev)
    cache._set_length(700)
    ops.build(logits, bonus)  # warm-up (per-shape device constants), as CudaGraphFn does before capturing
    with torch.no_grad(), HostTrafficChecker() as checker:
        tree, vin, ancestors = ops.build(logits, bonus)
        out = cache.verify(tree, vin)  # the whole target forward: mask, every layer, head, taps
        walk, record, _ = ops.walk(tree, ancestors, out.logits, None, out.features)  # + compaction, context
        cache.commit(walk.path, 3 if method != "ar" else 1, contiguous=False)  # the dynamic cache's compaction
        out.features.index_select(0, walk.path[:1])
    assert checker.ops > 100 and not checker.bad, checker.bad[:10]
    assert record.shape == (record_size(ops.depth_limit),)
    # the verify attended to a key bucket near past + N, not to the whole capacity
    assert cache.kv.kv_len == -(-(700 + tree.size) // KV_BUCKET) * KV_BUCKET < cache.kv.capacity


def test_checker_catches_the_patterns_it_guards_against():
    x = torch.zeros(5, dtype=torch.bool, device="meta")
    for bad in (lambda: x.__setitem__(0, True), lambda: x[x], lambda: torch.tensor([1, 2]).to("meta")):
        with HostTrafficChecker() as checker:
            try:
                bad()
            except Exception:  # meta raises on data-dependent output sizes after the checker has seen the op
                pass
        assert checker.bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_a_graphs_first_call_leaves_in_place_state_as_one_run_does():
    """The first call runs fn four times (two warm-ups, the replay, the eager check); a walk that compacts the KV
    rows and advances the length in place must still look like one run (its `state` is restored in between)."""
    from pipeline.cuda_graphs import CudaGraphFn

    x = torch.zeros(4, device="cuda")

    def advance(step):
        x.add_(step)
        return x * 2

    graph = CudaGraphFn(advance, "advance", state=lambda: [x])
    out = graph(torch.ones(4, device="cuda"))
    assert torch.equal(x, torch.ones(4, device="cuda")) and torch.equal(out, x * 2)
    graph(torch.full((4,), 3.0, device="cuda"))
    assert not graph.disabled and torch.equal(x, torch.full((4,), 4.0, device="cuda"))


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_draft_step_has_no_host_read_and_no_host_to_device_copy(layer_types):
    """The drafter's step (eval/engine/draft_forward.py: context append + block, every layer, LM head) on 'meta'."""
    from eval.engine.draft_forward import DraftForward
    from dflash_model.model import DFlashDrafter, DrafterArgs

    D, V, B = 64, 320, 8
    args = DrafterArgs(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, block_size=B,
                       mask_token_id=V - 1, target_layer_ids=[1, 3], num_target_layers=4, layer_types=layer_types,
                       sliding_window=16)
    dev = torch.device("meta")
    with dev:
        drafter = DFlashDrafter(args).eval()
    drafter.attach_target_head(torch.empty(V, D, device=dev), torch.empty(V, D, device=dev))
    step = DraftForward(drafter)
    step.reset(3000)
    bonus = torch.empty(1, dtype=torch.long, device=dev)
    with torch.no_grad():
        step.prefill(torch.empty(700, 2 * D, device=dev))
        step(None, bonus, 700)  # warm-up (per-shape device constants)
        with HostTrafficChecker() as checker:
            logits = step(torch.empty(B, 2 * D, device=dev), bonus, 705)
    assert checker.ops > 50 and not checker.bad, checker.bad[:10]
    assert logits.shape == (B - 1, V)
