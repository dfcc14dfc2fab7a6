"""eval/engine/decode.py at T=0: chain and DDTree are token-for-token identical to AR greedy decoding.

Targets are tiny random HF models (fp32, CPU). Drafters: D's random-init DFlashDrafter (accepts almost nothing)
and an oracle drafter whose logits rank the target's own greedy continuation first, second (behind a decoy) or
not at all, so walks accept deep paths through siblings (non-contiguous KV compaction). The oracle also checks,
every round, that the context features it receives are the target's taps at exactly the committed positions.
"""

from __future__ import annotations

import pytest
import torch

from eval.engine.cache.interface import tree_unsupported_reason
from eval.engine.decode import decode
from extract.layers import forward_taps
from pipeline.config import TargetConfig
from pipeline.target import load_target, materialize_target
from dflash_model.model import DFlashDrafter, DrafterArgs

from tests.conftest import CACHE

BLOCK = 8
TAPS = [1, 3, 5]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_target(model_type: str, device: str = "cpu", **overrides):
    tcfg = TargetConfig(model=f"random:{model_type}", random_init=overrides, device=device, dtype="float32")
    return load_target(materialize_target(tcfg, CACHE), tcfg)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def random_drafter(target, seed: int = 0) -> DFlashDrafter:
    cfg = target.config
    args = DrafterArgs(hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6,
                       vocab_size=cfg.vocab_size, block_size=BLOCK, mask_token_id=259, target_layer_ids=TAPS,
                       num_target_layers=cfg.num_hidden_layers)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(args).to(target.get_input_embeddings().weight.device).eval()
    drafter.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter


class OracleDrafter:
    """A drafter implementing eval.engine.draft_forward.DraftForward's calls that drafts from the target's known greedy
    continuation, and checks on the host that its context is the target's taps at exactly the committed rows."""

    def __init__(self, target, prompt: list[int], greedy: list[int], seed: int, decoy: float = 0.25, miss: float = 0.1,
                 host_checks: bool = True):
        self.seq = prompt + greedy
        self.args = random_drafter(target).args
        self.vocab = target.config.vocab_size
        self.device = target.get_input_embeddings().weight.device
        self.features = forward_taps(target, torch.tensor([self.seq], device=self.device), TAPS)[0]
        self.seed, self.decoy, self.miss = seed, decoy, miss
        self.host_checks = host_checks  # False: no host reads and a pinned async upload (for sync counting)
        self.context_rows_checked = 0
        self.length = 0  # context rows received

    def describe(self) -> str:
        return "oracle"

    def reset(self, capacity: int) -> None:
        self.length = 0

    def prefill(self, features):
        self._check_context(features, features.shape[0])
        self.length = features.shape[0]

    def _check_context(self, rows, n: int) -> None:
        """rows[:n] must be the target's taps of the committed rows length..length+n-1."""
        if self.host_checks:
            ref = self.features[self.length: self.length + n]
            assert torch.allclose(rows[:n], ref, atol=1e-4), "context must be the committed rows' taps"
            self.context_rows_checked += n

    def __call__(self, new_rows, bonus, start):
        if self.host_checks:
            assert int(bonus) == self.seq[start], "the bonus token is the committed token at `start`"
            assert new_rows is not None or start == self.length, "rows were committed but none were passed"
        if new_rows is not None:
            assert new_rows.shape[0] == BLOCK and start - self.length <= BLOCK
            self._check_context(new_rows, start - self.length)
        self.length = start
        gen = torch.Generator().manual_seed(self.seed * 100003 + start)
        logits = torch.randn(BLOCK - 1, self.vocab, generator=gen) * 0.5
        for k in range(1, BLOCK):
            if start + k >= len(self.seq):
                continue
            u = float(torch.rand((), generator=gen))
            true = self.seq[start + k]
            if u < self.miss:
                continue
            logits[k - 1, true] = 8.0
            if u < self.miss + self.decoy:
                logits[k - 1, (true + 1 + int(torch.randint(50, (1,), generator=gen))) % self.vocab] = 9.0
        if not self.host_checks and self.device.type == "cuda":
            return logits.pin_memory().to(self.device, non_blocking=True)
        return logits.to(self.device)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def naive_greedy(target, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    device = target.get_input_embeddings().weight.device
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_ar_equals_naive_greedy_without_cache(qwen3):
    prompt = prompts(1, 5)[0]
    ar = decode("ar", qwen3, None, prompt, max_new_tokens=24)
    assert ar.output_ids == naive_greedy(qwen3, prompt, 24)
    assert ar.accept_lengths == [1] * 23 and ar.num_rounds == 23 and ar.num_new_tokens == 24
    assert ar.draft_depths == [0] * 23 and ar.timings["decode"] > 0 and ar.timings["prefill"] > 0


@pytest.mark.parametrize("target_name", ["qwen3", "llama"])
def test_chain_and_ddtree_equal_ar_greedy_with_random_drafter(target_name, request):
    target = request.getfixturevalue(target_name)
    drafter = random_drafter(target)
    for prompt in prompts(3, 1):
        ar = decode("ar", target, None, prompt, max_new_tokens=32).output_ids
        assert decode("chain", target, drafter, prompt, max_new_tokens=32).output_ids == ar
        for budget in (1, 2, 16, 64):
            res = decode("ddtree", target, drafter, prompt, max_new_tokens=32, budget=budget)
            assert res.output_ids == ar, (prompt, budget)
            assert all(1 <= t <= BLOCK for t in res.accept_lengths)
            assert all(s == min(budget, 320 ** 7) for s in res.tree_sizes)


@pytest.mark.parametrize("target_name", ["qwen3", "llama"])
def test_chain_and_ddtree_equal_ar_greedy_with_deep_acceptance(target_name, request):
    target = request.getfixturevalue(target_name)
    for i, prompt in enumerate(prompts(4, 2)):
        ar = decode("ar", target, None, prompt, max_new_tokens=40).output_ids
        oracle = OracleDrafter(target, prompt, naive_greedy(target, prompt, 40 + BLOCK), seed=i)
        assert ar == oracle.seq[len(prompt): len(prompt) + 40]
        chain = decode("chain", target, oracle, prompt, max_new_tokens=40)
        assert chain.output_ids == ar and max(chain.accept_lengths) > 2
        for budget in (1, 2, 16, 64):
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=budget)
            assert res.output_ids == ar, (prompt, budget)
            assert res.num_new_tokens == 40 and res.stop_reason == "max_new_tokens"
            assert 1 + sum(res.accept_lengths) >= 40 and res.accepted_drafts == [t - 1 for t in res.accept_lengths]
            if budget >= 16:  # decoys at rank 0 push the true token to a later sibling: deep, non-contiguous paths
                assert sum(res.accept_lengths) / res.num_rounds > sum(chain.accept_lengths) / chain.num_rounds
                assert max(res.accept_lengths) == BLOCK and all(d <= BLOCK - 1 for d in res.draft_depths)
        assert oracle.context_rows_checked > 0


def test_sliding_window_target_tree_masks_use_real_positions():
    """Qwen3 with sliding-attention layers (window 5 < prompt): the per-layer-type masks keep DDTree lossless."""
    target = tiny_target("qwen3", use_sliding_window=True, sliding_window=5, max_window_layers=2)
    assert "sliding_attention" in target.config.layer_types
    for i, prompt in enumerate(prompts(2, 21)):
        greedy = naive_greedy(target, prompt, 30 + BLOCK)
        oracle = OracleDrafter(target, prompt, greedy, seed=i)
        for impl in ("dynamic", "static"):
            assert decode("ar", target, None, prompt, max_new_tokens=30, cache_impl=impl).output_ids == greedy[:30]
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=30, budget=32, cache_impl=impl)
            assert res.output_ids == greedy[:30] and max(res.accept_lengths) > 3


def test_heap_builder_static_cache_and_dynamic_cache_decode_identically(qwen3):
    prompt = prompts(1, 3)[0]
    oracle = OracleDrafter(qwen3, prompt, naive_greedy(qwen3, prompt, 30 + BLOCK), seed=7)
    runs = [decode("ddtree", qwen3, oracle, prompt, max_new_tokens=30, budget=24, tree_builder=b, cache_impl=c)
            for b, c in [("device", "dynamic"), ("heap", "dynamic"), ("device", "static"), ("heap", "static")]]
    ref = runs[0]
    for r in runs[1:]:
        assert (r.output_ids, r.accept_lengths, r.draft_depths) == (ref.output_ids, ref.accept_lengths, ref.draft_depths)
    chain_static = decode("chain", qwen3, oracle, prompt, max_new_tokens=30, cache_impl="static")
    assert chain_static.output_ids == ref.output_ids


def test_stop_token_in_the_middle_of_an_accepted_path_truncates_after_it(qwen3):
    prompt = prompts(1, 4)[0]
    greedy = naive_greedy(qwen3, prompt, 40 + BLOCK)
    oracle = OracleDrafter(qwen3, prompt, greedy, seed=3, decoy=0.0, miss=0.0)
    full = decode("ddtree", qwen3, oracle, prompt, max_new_tokens=40, budget=16)
    # a token emitted mid-round (not the round's last) that does not occur earlier in the output
    emitted = 1
    for tau in full.accept_lengths:
        if tau >= 3:
            idx = emitted + 1  # second token of this round's accepted path
            tok = full.output_ids[idx]
            if tok not in full.output_ids[:idx]:
                break
        emitted += tau
    else:
        pytest.fail("no round accepted a path of >= 3 tokens")
    res = decode("ddtree", qwen3, oracle, prompt, max_new_tokens=40, budget=16, stop_token_ids=[tok])
    assert res.output_ids == full.output_ids[: idx + 1] and res.stop_reason == "stop_token"
    chain = decode("chain", qwen3, oracle, prompt, max_new_tokens=40, stop_token_ids=[tok])
    assert chain.output_ids == res.output_ids
    first = decode("ar", qwen3, None, prompt, max_new_tokens=40, stop_token_ids=[full.output_ids[0]])
    assert first.output_ids == full.output_ids[:1] and first.num_rounds == 0


def test_hybrid_target_ar_chain_and_ddtree_equal_greedy_tree_aware_and_path_batched():
    """Gated-DeltaNet hybrid: the default cache walks the recurrent layers along the tree in one forward and commits
    the accepted node's state from the kept rows (a cut chain commits a prefix); the path-batched reference
    verifies each root->leaf path as its own row and re-runs the accepted path. Both give AR's greedy output, with
    budgets up to 64 (trees branching at several depths) and deep accepted paths through siblings."""
    hybrid = tiny_target("qwen3_5_text")
    assert tree_unsupported_reason(hybrid.config) is None
    for i, prompt in enumerate(prompts(2, 6)):
        greedy = naive_greedy(hybrid, prompt, 24 + BLOCK)
        ar = decode("ar", hybrid, None, prompt, max_new_tokens=24)
        assert ar.output_ids == greedy[:24]
        assert ar.verify_path.startswith("hybrid: dynamic KV under the tree mask")
        oracle = OracleDrafter(hybrid, prompt, greedy, seed=i)
        chain = decode("chain", hybrid, oracle, prompt, max_new_tokens=24)
        assert chain.output_ids == greedy[:24]
        assert any(1 < t < BLOCK for t in chain.accept_lengths)  # partial acceptances: a prefix committed
        static_ar = decode("ar", hybrid, None, prompt, max_new_tokens=24, cache_impl="static")
        assert static_ar.verify_path.startswith("hybrid: static KV under the tree mask")
        for impl in ("static", "dynamic"):  # AR and chain on the static K/V cache too
            assert decode("ar", hybrid, None, prompt, max_new_tokens=24, cache_impl=impl).output_ids == greedy[:24]
            assert decode("chain", hybrid, oracle, prompt, max_new_tokens=24, cache_impl=impl).output_ids == \
                greedy[:24]
        for impl in ("auto", "static", "paths"):
            for budget in (2, 16, 64):
                tree = decode("ddtree", hybrid, oracle, prompt, max_new_tokens=24, budget=budget, cache_impl=impl)
                assert tree.output_ids == greedy[:24], (impl, budget)
            assert max(tree.accept_lengths) > 3  # deep paths through siblings (decoys): non-chain paths committed
        assert oracle.context_rows_checked > 0  # the drafter got the taps of exactly the committed rows


def test_bad_arguments_are_refused_with_clear_messages(qwen3):
    with pytest.raises(ValueError, match="method"):
        decode("beam", qwen3, None, [5, 6], max_new_tokens=4)
    with pytest.raises(ValueError, match="budget"):
        decode("ddtree", qwen3, random_drafter(qwen3), [5, 6], max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter"):
        decode("chain", qwen3, None, [5, 6], max_new_tokens=4)


def test_drafter_loaded_from_the_zlab_layout_decodes_like_the_original(qwen3, tmp_path):
    from dflash_model.export import export_zlab, load_zlab

    drafter = random_drafter(qwen3, seed=3)
    export_zlab(drafter, drafter.args, tmp_path / "export")
    loaded, args = load_zlab(tmp_path / "export")
    loaded.eval().attach_target_head(qwen3.get_input_embeddings().weight, qwen3.get_output_embeddings().weight)
    assert args.block_size == BLOCK and args.target_layer_ids == TAPS
    prompt = prompts(1, 9)[0]
    ar = decode("ar", qwen3, None, prompt, max_new_tokens=20).output_ids
    for method, budget in (("chain", None), ("ddtree", 16)):
        a = decode(method, qwen3, drafter, prompt, max_new_tokens=20, budget=budget)
        b = decode(method, qwen3, loaded, prompt, max_new_tokens=20, budget=budget)
        assert a.output_ids == b.output_ids == ar and a.accept_lengths == b.accept_lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_cuda_graph_rounds_equal_ar_greedy_stay_on_graphs_and_sync_once_per_round():
    from eval.engine.cache.factory import target_cache
    from pipeline.cuda_graphs import GRAPH_LOG, host_syncs

    target = tiny_target("qwen3", device="cuda")
    captured, fallbacks = GRAPH_LOG.captured, len(GRAPH_LOG.fallbacks)
    for i, prompt in enumerate(prompts(3, 11)):
        greedy = naive_greedy(target, prompt, 40 + BLOCK)
        oracle = OracleDrafter(target, prompt, greedy, seed=i)
        ar = decode("ar", target, None, prompt, max_new_tokens=40, cache_impl="graphs")
        assert ar.output_ids == greedy[:40]
        assert decode("chain", target, oracle, prompt, max_new_tokens=40, cache_impl="graphs").output_ids == ar.output_ids
        for budget in (1, 16, 64):
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=budget, cache_impl="graphs")
            assert res.output_ids == ar.output_ids, (i, budget)
    cache = target_cache(target, TAPS, "graphs")
    assert GRAPH_LOG.captured > captured, "no CUDA graph was captured"
    assert GRAPH_LOG.fallbacks[fallbacks:] == [], "CUDA graphs that failed capture or their self-check"
    assert cache.fused is not None, "the fused verify forward was dropped (it disagreed with HF's forward)"
    # host syncs of a whole decode: the prefill read, one read per round, the two timer syncs (an oracle that
    # reads nothing on the host, so every sync counted is the decoder's)
    oracle = OracleDrafter(target, prompt, greedy, seed=0, host_checks=False)
    syncs, res = host_syncs(lambda: decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=16,
                                           cache_impl="graphs", phase_timing=False))
    assert len(syncs) <= res.num_rounds + 3, syncs[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_warm_up_captures_every_graph_timed_decoding_uses_and_a_drafter_round_syncs_once():
    """After `warm_up(max_length)`, decoding prompts up to that length (the random DFlash drafter, every method)
    captures no new CUDA graph, nothing falls back to eager, the output is AR's, and a round with the drafter's
    graph step still reads the host once."""
    from eval.engine.decode import warm_up
    from pipeline.cuda_graphs import GRAPH_LOG, host_syncs

    target = tiny_target("qwen3", device="cuda")
    drafter = random_drafter(target)
    gen = torch.Generator().manual_seed(5)
    batch = prompts(3, 12) + [torch.randint(3, 259, (300,), generator=gen).tolist()]  # spans several key buckets
    max_new = 40
    max_length = max(len(p) for p in batch) + max_new
    fallbacks = len(GRAPH_LOG.fallbacks)
    ar = {}
    for method, budget in (("ar", None), ("chain", None), ("ddtree", 16)):
        assert warm_up(method, target, drafter, max_length=max_length, budget=budget) >= 3
        captured = GRAPH_LOG.captured
        for i, prompt in enumerate(batch):
            res = decode(method, target, drafter, prompt, max_new_tokens=max_new, budget=budget)
            assert res.output_ids == ar.setdefault(i, res.output_ids), (method, i)
            assert res.draft_path == ("" if method == "ar" else "static context, compiled, CUDA graphs")
        assert GRAPH_LOG.captured == captured, f"{method}: timed decoding captured a graph the warm-up missed"
    assert GRAPH_LOG.fallbacks[fallbacks:] == []
    syncs, res = host_syncs(lambda: decode("ddtree", target, drafter, batch[-1], max_new_tokens=max_new, budget=16,
                                           phase_timing=False))
    assert len(syncs) <= res.num_rounds + 3, syncs[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton tree walk runs on CUDA (GPU machine)")
def test_hybrid_rounds_on_cuda_equal_ar_greedy_and_sync_once_per_round():
    """A hybrid on CUDA (fp32): the tree-aware verify (Triton conv + walk) and commit (one launch for every
    Gated-DeltaNet layer) give AR's greedy output, and a DDTree round reads the device once (the walk's record)."""
    from pipeline.cuda_graphs import host_syncs

    target = tiny_target("qwen3_5_text", device="cuda")
    for i, prompt in enumerate(prompts(2, 12)):
        greedy = naive_greedy(target, prompt, 40 + BLOCK)
        oracle = OracleDrafter(target, prompt, greedy, seed=i)
        ar = decode("ar", target, None, prompt, max_new_tokens=40)
        assert ar.output_ids == greedy[:40]
        assert decode("chain", target, oracle, prompt, max_new_tokens=40).output_ids == ar.output_ids
        for budget in (16, 64):
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=budget)
            assert res.output_ids == ar.output_ids, (i, budget)
    oracle = OracleDrafter(target, prompt, greedy, seed=0, host_checks=False)
    syncs, res = host_syncs(lambda: decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=16,
                                           phase_timing=False))
    # the prefill (HF's forward and the first bonus token) and the timers may sync a few times; a round once
    assert len(syncs) <= res.num_rounds + 5, syncs[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_hybrid_rounds_on_cuda_graphs_equal_ar_greedy_and_never_fall_back():
    """The static hybrid cache under CUDA graphs (cache impl 'graphs'): every verify (AR steps, chains, trees) a
    captured graph checked against eager on its first replay, the output AR's greedy one, no graph falling back."""
    from pipeline.cuda_graphs import GRAPH_LOG

    target = tiny_target("qwen3_5_text", device="cuda")
    fallbacks = len(GRAPH_LOG.fallbacks)
    for i, prompt in enumerate(prompts(2, 12)):
        greedy = naive_greedy(target, prompt, 40 + BLOCK)
        oracle = OracleDrafter(target, prompt, greedy, seed=i)
        ar = decode("ar", target, None, prompt, max_new_tokens=40, cache_impl="graphs")
        assert ar.output_ids == greedy[:40] and ar.verify_path.endswith("CUDA graphs"), ar.verify_path
        chain = decode("chain", target, oracle, prompt, max_new_tokens=40, cache_impl="graphs")
        assert chain.output_ids == ar.output_ids
        for budget in (16, 64):
            res = decode("ddtree", target, oracle, prompt, max_new_tokens=40, budget=budget, cache_impl="graphs")
            assert res.output_ids == ar.output_ids, (i, budget)
    assert GRAPH_LOG.fallbacks[fallbacks:] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_a_prompt_that_grows_the_buffers_gets_round_graphs_of_the_new_buffers():
    """A prompt past the KV capacity reallocates the static buffers: the round's graphs (walk compaction on the old
    buffer) are rebuilt for the new ones, and the output still equals the dynamic-cache reference."""
    target = tiny_target("qwen3", device="cuda")
    drafter = random_drafter(target)
    gen = torch.Generator().manual_seed(9)
    short, long = prompts(1, 14)[0], torch.randint(3, 259, (2100,), generator=gen).tolist()  # capacity 2048 -> 4096
    for prompt in (short, long):
        ref = decode("ar", target, None, prompt, max_new_tokens=24, cache_impl="dynamic").output_ids
        for method, budget in (("chain", None), ("ddtree", 16)):
            assert decode(method, target, drafter, prompt, max_new_tokens=24, budget=budget).output_ids == ref
