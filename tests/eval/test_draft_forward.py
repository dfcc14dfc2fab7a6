"""eval/engine/draft_forward.py: the drafter's decode-time forward on its static context cache computes what the reference
`DFlashDrafter.draft_logits` (growing per-layer caches) computes, round after round and across key buckets, and
the scratch rows it writes past the context never reach the logits. On the GPU its CUDA-graph replay equals eager
and stays on graphs, and a warm-up leaves nothing to capture for timed decoding."""

from __future__ import annotations

import pytest
import torch

from eval.engine.draft_forward import DRAFT_BUCKET, DraftForward, draft_forward
from pipeline.cuda_graphs import relative_error, rounding_tolerance
from dflash_model.blocks import FULL, SLIDING
from dflash_model.model import DFlashDrafter, DrafterArgs

B, D, V, TAPS = 8, 64, 320, 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def drafter(layer_types=(FULL, FULL), window=None, device="cpu", dtype=torch.float32, seed=0) -> DFlashDrafter:
    args = DrafterArgs(hidden_size=D, num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V,
                       block_size=B, mask_token_id=V - 1, target_layer_ids=[1, 3, 5], num_target_layers=8,
                       layer_types=list(layer_types), sliding_window=window)
    torch.manual_seed(seed)
    d = DFlashDrafter(args).to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    d.attach_target_head(torch.randn(V, D, generator=gen).to(device, dtype),
                         torch.randn(V, D, generator=gen).to(device, dtype))
    return d


def rounds(prompt_len: int, total: int, seed: int) -> list[tuple[int, int]]:
    """(start, new rows) per round: the first round adds nothing after the prefill, later ones 1..B rows."""
    gen = torch.Generator().manual_seed(seed)
    out, start, new = [], prompt_len, 0
    while start + B < total:
        out.append((start, new))
        new = int(torch.randint(1, B + 1, (1,), generator=gen))
        start += new
    return out


def compare_with_reference(d: DFlashDrafter, prompt_len: int, total: int, seed: int, graphs=False,
                           compile=None) -> int:
    """Run both forwards over one decode-like sequence of rounds; return the rounds compared."""
    device, dtype = d.fc.weight.device, d.fc.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(total + B, TAPS * D, generator=gen).to(device, dtype)
    tokens = torch.randint(0, V - 1, (total + B,), generator=gen)
    fast = DraftForward(d, graphs=graphs, compile=compile)
    fast.reset(total)
    fast.prefill(feats[:prompt_len])
    ref_cache, n = d.new_cache(), 0
    d.append_context(ref_cache, feats[None, :prompt_len])
    for start, new in rounds(prompt_len, total, seed):
        bonus = int(tokens[start])
        ref = d.draft_logits(ref_cache, feats[None, start - new:start], bonus, start)
        # the walk's L+1 = B path rows: the first `new` are the committed rows, the rest are whatever the walk
        # gathered there (here: noise), which must never reach the logits
        rows = torch.randn(B, TAPS * D, generator=gen).to(device, dtype)
        rows[:new] = feats[start - new:start]
        got = fast(rows if start != prompt_len else None, torch.tensor([bonus], device=device), start)
        if dtype == torch.float32:  # summation order only
            tol = 1e-5 if device.type == "cpu" else 1e-4
            assert torch.allclose(got, ref, atol=tol, rtol=tol), (start, (got - ref).abs().max())
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
        else:  # 16-bit: each kernel rounds differently
            assert relative_error(got, ref) <= rounding_tolerance(dtype), (start, relative_error(got, ref))
        n += 1
    assert ("compiled" in fast.describe()) == (compile is not None), fast.describe()  # no silent fallback
    return n


def test_static_draft_step_equals_draft_logits_round_after_round_across_key_buckets():
    d = drafter()
    n = compare_with_reference(d, prompt_len=5, total=2 * DRAFT_BUCKET + 40, seed=0)  # three key buckets
    assert n > 30


def test_sliding_window_layers_see_the_same_window_as_the_reference():
    d = drafter(layer_types=(SLIDING, FULL, SLIDING), window=6)
    assert compare_with_reference(d, prompt_len=3, total=DRAFT_BUCKET + 30, seed=1) > 10


def test_compiled_step_pieces_equal_the_reference_and_a_failing_compiler_keeps_the_plain_ones():
    """torch.compile traces every piece (one graph for every layer; 'aot_eager' on CPU, inductor on the GPU); a
    backend that fails leaves the plain pieces in place and the logits unchanged."""
    d = drafter(layer_types=(SLIDING, FULL), window=6)
    assert compare_with_reference(d, prompt_len=4, total=DRAFT_BUCKET + 20, seed=3, compile="aot_eager") > 10

    def broken(gm, example_inputs):
        raise RuntimeError("ptxas fatal: unsupported GPU")

    feats = torch.randn(6, TAPS * D)
    outs = []
    for compile in (broken, None):
        fast = DraftForward(d, compile=compile)
        fast.reset(64)
        fast.prefill(feats)
        outs.append(fast(None, torch.tensor([5]), 6).clone())
        assert fast.describe() == "static context, eager"  # not "compiled": the plain pieces run
    assert torch.equal(outs[0], outs[1])


def test_context_buffer_grows_on_reset_and_keeps_its_steps_otherwise():
    d = drafter()
    fast = DraftForward(d)
    fast.reset(100)
    first = fast.capacity
    fast.prefill(torch.randn(20, TAPS * D))
    fast(None, torch.tensor([3]), 20)
    steps = dict(fast._steps)
    fast.reset(50)  # smaller: same buffer, same steps
    assert fast.capacity == first and fast._steps == steps and fast.length == 0
    fast.reset(first + 1)  # larger: a new buffer, and the steps captured on the old one are dropped
    assert fast.capacity > first and not fast._steps
    with pytest.raises(ValueError, match="needs 9 of 8 new rows"):
        fast.prefill(torch.randn(4, TAPS * D))
        fast(torch.randn(B, TAPS * D), torch.tensor([1]), 13)


def test_bucket_lengths_visit_every_key_bucket_once():
    fast = DraftForward(drafter())
    fast.reset(4 * DRAFT_BUCKET)
    for max_length in (1, 40, DRAFT_BUCKET - B, DRAFT_BUCKET - B + 1, 3 * DRAFT_BUCKET + 17):
        lengths = fast.bucket_lengths(max_length)
        assert all(1 <= n <= max_length for n in lengths)
        reached = {fast.key_rows(n) for n in range(1, max_length + 1)}
        assert sorted(fast.key_rows(n) for n in lengths) == sorted(reached), max_length


def test_the_factory_keeps_one_forward_per_drafter_and_passes_other_drafters_through():
    d = drafter()
    assert draft_forward(d) is draft_forward(d) and draft_forward(d) is not draft_forward(drafter(seed=3))
    other = object()
    assert draft_forward(other) is other


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_cuda_graph_draft_steps_equal_the_reference_and_never_fall_back():
    """Plain and inductor-compiled pieces (what decoding uses on the GPU), fp32 and bf16, three key buckets each."""
    from pipeline.cuda_graphs import GRAPH_LOG

    before, fallbacks = GRAPH_LOG.captured, len(GRAPH_LOG.fallbacks)
    for dtype, compile in ((torch.float32, None), (torch.float32, "inductor"), (torch.bfloat16, "inductor")):
        d = drafter(layer_types=(SLIDING, FULL), window=6, device="cuda", dtype=dtype)
        assert compare_with_reference(d, prompt_len=5, total=2 * DRAFT_BUCKET + 40, seed=2, graphs=True,
                                      compile=compile) > 30
    assert GRAPH_LOG.captured >= before + 9, "each run's three key buckets capture one graph"
    assert GRAPH_LOG.fallbacks[fallbacks:] == [], "a draft step graph failed its capture or its check against eager"
