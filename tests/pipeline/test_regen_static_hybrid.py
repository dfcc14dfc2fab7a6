"""The hf backend's static decode on Gated-DeltaNet hybrids (Qwen3.5/3.6 layout): attention K/V in the slot buffers,
each Gated-DeltaNet layer's conv window and recurrent state in fixed stacked buffers advanced in place by HF's decode
step. Greedy output equals `model.generate` token for token (different prompt lengths, stops and limits), every
step's logits equal HF's own unpadded forward, batch compaction keeps both, sampling is seeded, and the regen backend
picks this path for hybrids."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from pipeline.config import RegenConfig, TargetConfig
from pipeline.regen.conversation import end_of_turn_ids, prompt_ids
from pipeline.regen.generator import Sampling
from pipeline.regen.hf import HFGenerator
from pipeline.regen.static_decode import StaticDecoder, supports_static_decode
from pipeline.target import load_target, load_tokenizer, materialize_target, random_target_config
from tests.conftest import CACHE

TEXTS = ["hello there", "What is 2+2? Explain in detail, step by step.", "x",
         "Write a short poem about the sea, the sky and the birds that fly between them.",
         "Summarize: the quick brown fox jumps over the lazy dog."]
# A larger init than the default: the random hybrid's next token then depends on its context (its Gated-DeltaNet
# states included), so a row decoded from a wrong state shows in the logits and, in places, in the tokens.
INIT = dict(initializer_range=0.5)
HYBRIDS = {"text": TargetConfig(model="random:qwen3_5_text", device="cpu", dtype="float32", random_init=INIT),
           "multimodal": TargetConfig(model="random:qwen3_5", device="cpu", dtype="float32", random_init=INIT)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _open(tcfg: TargetConfig):
    location = materialize_target(tcfg, CACHE)
    tok = load_tokenizer(location, tcfg)
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}], enable_thinking=False) for t in TEXTS]
    return load_target(location, tcfg), tok, end_of_turn_ids(tok, location), prompts


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    """The qwen3_5_text hybrid, and the same language model in the multimodal checkpoint layout Qwen3.5/3.6 ship
    in (`random:qwen3_5`, loaded as its causal LM)."""
    return _open(HYBRIDS[request.param])


def _gen(target, decode: str, batch_size: int, sampling=Sampling(), stop=None, **kwargs) -> HFGenerator:
    model, tok, eot, _ = target
    return HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop or eot,
                       sampling=sampling, batch_size=batch_size, decode=decode, **kwargs)


def test_a_hybrid_target_gets_the_static_decode_path_also_where_continuous_is_asked(hybrid):
    """The regen backend runs a Gated-DeltaNet hybrid on the fast path when asked ('static'; 'auto' on CUDA),
    from the run config as the stage loads it, instead of falling back to `model.generate`."""
    model, tok, eot, _ = hybrid
    assert supports_static_decode(model.config)
    gen = HFGenerator.load(model.name_or_path, HYBRIDS["text"], RegenConfig(hf_decode="static", batch_size=4),
                           tokenizer=tok, stop_ids=eot, sampling=Sampling())
    assert gen.decode == "static" and isinstance(gen.static, StaticDecoder) and gen.static.linear
    sliding = random_target_config("qwen3", {"use_sliding_window": True, "sliding_window": 16})
    assert not supports_static_decode(sliding)
    asked = HFGenerator.load(model.name_or_path, HYBRIDS["text"], RegenConfig(hf_decode="continuous", batch_size=4),
                             tokenizer=tok, stop_ids=eot, sampling=Sampling())
    assert asked.decode == "static" and asked.continuous is None  # the continuous loop takes attention-only targets


def test_hybrid_static_decode_equals_generate_token_for_token_with_stops_limits_and_padding(hybrid):
    """Five prompts of different lengths (left padding up to 5x), per-prompt limits, and a second stop id taken
    from the reference's own output so that rows stop at different steps: static decode at batch 5, 2 and 1, with
    8-slot key buckets and with a prefill cut into 8-token chunks (crossing the padding), equals `model.generate`
    on each prompt alone."""
    _, _, eot, prompts = hybrid
    limits = [40, 40, 12, 40, 33]
    probe = _gen(hybrid, "generate", 1, stop=[len(hybrid[1]) + 1]).generate(prompts, limits)  # no stop id
    stop = [*eot, varied_stop(probe, limits, eot)]
    reference = _gen(hybrid, "generate", 1, stop=stop).generate(prompts, limits)
    assert {r.finish_reason for r in reference} == {"stop", "length"}
    assert len({len(r.token_ids) for r in reference}) >= 3
    for batch_size, kwargs in [(5, {}), (2, {}), (1, {}), (5, {"length_bucket": 8})]:
        outs = _gen(hybrid, "static", batch_size, stop=stop, **kwargs).generate(prompts, limits)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (batch_size, kwargs)
        assert [o.finish_reason for o in outs] == [r.finish_reason for r in reference]
    chunked = _gen(hybrid, "static", 5, stop=stop)
    chunked.static.prefill_chunk = 8
    assert [o.token_ids for o in chunked.generate(prompts, limits)] == [r.token_ids for r in reference]
    assert [o.token_ids for o in _gen(hybrid, "generate", 5, stop=stop).generate(prompts, limits)] == \
        [r.token_ids for r in reference]  # generate's own padded batch agrees too


def varied_stop(streams, limits, stops) -> int:
    """A token of the greedy streams that, as a stop id beside `stops`, ends them at the most different lengths
    while one still runs to its limit (so both endings and several lengths are exercised)."""
    def score(t):
        ends = [next((i + 1 for i, x in enumerate(s.token_ids[:lim]) if x in {t, *stops}), None)
                for s, lim in zip(streams, limits)]
        return len({e for e in ends}) if None in ends else 0

    return max(sorted({t for s in streams for t in s.token_ids}), key=score)


def hf_step_logits(model, prompt: list[int], steps: int, vocab: int) -> list[torch.Tensor]:
    """HF's own forward on one unpadded prompt with its DynamicCache, greedy over the first `vocab` ids (the
    tokenizer's; the rows past it are padding): the logits [V] of each of `steps` tokens (stop ids ignored)."""
    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            out.append(logits)
            ids = logits[:vocab].argmax().reshape(1, 1)
    return out


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """fp32 logits equal up to rounding: every entry within 1e-4 of the row's largest magnitude (the random
    target's logits are ~5e2; padding, batching and chunking move them by up to ~1e-2, a wrong state by units to hundreds)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()), msg=msg)


def static_step_logits(model, prompts, limits: list[int], vocab: int, monkeypatch, **kwargs) -> list[torch.Tensor]:
    """StaticDecoder's logits [B', V] at each step for the batch, rows in the given order (no stop id: row i decodes
    limits[i] tokens; B' shrinks where the batch is compacted)."""
    import pipeline.regen.static_decode as static_decode

    seen, sample_next = [], static_decode.sample_next

    def recording(logits, *args, **kw):
        seen.append(logits.clone())
        return sample_next(logits, *args, **kw)

    monkeypatch.setattr(static_decode, "sample_next", recording)
    decoder = StaticDecoder(model, vocab_limit=vocab, stop_ids=[], sampling=Sampling(), **kwargs)
    decoder.generate(prompts, limits)
    monkeypatch.undo()
    return seen


def test_every_static_step_of_a_hybrid_has_the_logits_of_hfs_own_unpadded_forward(hybrid, monkeypatch):
    """The strong check behind token equality: at every one of 24 steps, every row's logits (padded batch of 5,
    the states in the stacked buffers, a prefill in chunks of 8) equal HF's forward on that prompt alone. A row
    decoded from a wrong or stale conv window / recurrent state differs here even where its argmax does not."""
    model, tok, _, prompts = hybrid
    want = [hf_step_logits(model, p, 24, len(tok)) for p in prompts]
    for kwargs in ({}, {"prefill_chunk": 8, "length_bucket": 8}):
        got = static_step_logits(model, prompts, [24] * 5, len(tok), monkeypatch, **kwargs)
        assert len(got) == 24
        for k, step in enumerate(got):
            for b in range(len(prompts)):
                assert_rounding_close(step[b, : len(tok)], want[b][k][: len(tok)], f"{kwargs} step {k} row {b}")


def test_hf_cache_entries_are_views_of_the_stacked_states_the_step_advances(hybrid):
    """After a batch, every Gated-DeltaNet layer's HF conv window and recurrent state is row-for-row a view of the
    stacked buffers [NL, B, ...] (one per (batch, cache length) shape, reused by the next batch at the same
    address): what a captured step reads and writes."""
    model, tok, eot, prompts = hybrid
    gen = _gen(hybrid, "static", 5)
    gen.generate(prompts, [6] * 5)
    state = gen.static._state
    assert state.conv.shape[:2] == state.recurrent.shape[:2] == (len(gen.static.linear), 5)
    assert state.recurrent.dtype == torch.float32
    for j, i in enumerate(gen.static.linear):
        assert state.cache.layers[i].conv_states[0].data_ptr() == state.conv[j].data_ptr()
        assert state.cache.layers[i].recurrent_states[0].data_ptr() == state.recurrent[j].data_ptr()
    addresses, before = (state.conv.data_ptr(), state.recurrent.data_ptr()), state.recurrent.clone()
    gen.generate([p[1:] for p in prompts], [6] * 5)  # other prompts, the same (batch, cache length) shape
    assert (gen.static._state.conv.data_ptr(), gen.static._state.recurrent.data_ptr()) == addresses
    assert not torch.equal(before, gen.static._state.recurrent)


def test_a_prefill_writes_its_states_into_the_prebound_buffers_equal_to_hfs_own_cache(hybrid):
    """pipeline.recurrent_cache: buffers made from the config (linear_state_buffers) have the shapes and dtypes of HF's
    own states, and handed to HF's cache before a prefill (prebind_linear_states) they receive the prefill's states
    in place (no second set of states is allocated: each HF entry still points into the buffers afterwards), equal
    to what HF's own cache holds after the same prefill; stack_linear_states then keeps those buffers without a copy."""
    from pipeline.recurrent_cache import linear_attention_layers, linear_state_buffers, prebind_linear_states, \
        stack_linear_states

    model, tok, eot, prompts = hybrid
    ids = torch.tensor([prompts[1][:12], prompts[3][:12]])
    linear = linear_attention_layers(model.config)
    own = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=own, use_cache=True)
    conv, recurrent = linear_state_buffers(model.config, linear, 2, torch.float32, "cpu")
    for j, i in enumerate(linear):
        assert conv[j].shape == own.layers[i].conv_states[0].shape and conv.dtype == own.layers[i].conv_states[0].dtype
        assert recurrent[j].shape == own.layers[i].recurrent_states[0].shape
        assert recurrent.dtype == own.layers[i].recurrent_states[0].dtype
    cache = DynamicCache(config=model.config)
    assert prebind_linear_states(cache, linear, conv, recurrent)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    for j, i in enumerate(linear):
        assert cache.layers[i].conv_states[0].data_ptr() == conv[j].data_ptr()
        assert cache.layers[i].recurrent_states[0].data_ptr() == recurrent[j].data_ptr()
        torch.testing.assert_close(conv[j], own.layers[i].conv_states[0], rtol=0, atol=0)
        torch.testing.assert_close(recurrent[j], own.layers[i].recurrent_states[0], rtol=1e-6, atol=1e-6)
    assert recurrent.abs().sum() > 0
    kept = stack_linear_states(cache, linear, conv, recurrent)
    assert kept[0] is conv and kept[1] is recurrent


def test_a_compacted_hybrid_batch_decodes_what_the_full_batch_would_and_sampling_repeats(hybrid, monkeypatch):
    """Three of five rows end at 9 tokens: at the check after step 16 the two others move, with their conv windows
    and recurrent states, to the first rows of the buffers and decode on at batch 2. Greedy output equals
    `model.generate`'s, every compacted step's logits equal HF's unpadded forward; sampled output is seeded and every
    row keeps its own stream. A second call on the same decoder (the state and its compacted views kept) decodes the
    same answers."""
    model, tok, eot, prompts = hybrid
    limits = [40, 9, 9, 9, 40]
    reference = _gen(hybrid, "generate", 1, stop=[len(tok) + 1]).generate(prompts, limits)
    gen = _gen(hybrid, "static", 5, stop=[len(tok) + 1], min_compact_batch=1)
    assert [o.token_ids for o in gen.generate(prompts, limits)] == [r.token_ids for r in reference]
    assert 2 in gen.static._state.compact, "the batch was not compacted"
    state = gen.static._state  # the next call (a regen stage's next shard) decodes on it, compacted views included
    assert [o.token_ids for o in gen.generate(prompts[::-1], limits[::-1])] == [r.token_ids for r in reference[::-1]]
    assert gen.static._state is state

    seen = static_step_logits(model, prompts, limits, len(tok), monkeypatch, min_compact_batch=1)
    assert [s.shape[0] for s in seen] == [5] * 16 + [2] * 24
    want = {b: hf_step_logits(model, prompts[b], 40, len(tok)) for b in (0, 4)}
    for k in range(40):  # from step 16 on, prompts 0 and 4 are rows 0 and 1
        for row, b in enumerate((0, 4)):
            assert_rounding_close(seen[k][row if k >= 16 else b, : len(tok)], want[b][k][: len(tok)],
                                  f"step {k} prompt {b}")

    hot = Sampling(temperature=50.0, top_p=0.9, top_k=50)  # the random target's logits are ~5e2 apart: T=1 is argmax
    a, b = (_gen(hybrid, "static", 5, hot, min_compact_batch=1).generate(prompts, limits, seeds=[3] * 5)
            for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) <= lim for o, lim in zip(a, limits))
    assert a[0].token_ids != a[4].token_ids
    top1 = _gen(hybrid, "static", 5, Sampling(temperature=0.7, top_k=1)).generate(prompts, [20] * 5, seeds=[1] * 5)
    assert [o.token_ids for o in top1] == [o.token_ids for o in _gen(hybrid, "static", 5).generate(prompts, [20] * 5)]


def test_a_hybrid_batch_smaller_than_the_state_decodes_on_views_of_its_first_rows(hybrid):
    """A run's long tail comes first and is small: the decoder's state is made for the full batch (K/V slots and the
    stacked Gated-DeltaNet states, before any forward), and the small batch decodes on views of its first rows; the
    full batches after it decode on the whole state, and a small one after them on the same views. Nothing else is
    allocated, and greedy output equals `model.generate`'s in every call."""
    _, tok, _, prompts = hybrid
    stop = [len(tok) + 1]
    reference = _gen(hybrid, "generate", 1, stop=stop)
    decoder = _gen(hybrid, "static", 4, stop=stop).static
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    for batch, limits in [([prompts[longest]], [24]), (prompts[:4], [24, 12, 24, 20]), (prompts[1:3], [16, 16])]:
        streams = decoder.generate(batch, limits, pad_to=4)
        assert [s[:n] for s, n in zip(streams, limits)] == [r.token_ids for r in reference.generate(batch, limits)]
    root = decoder._state
    assert decoder._key[0] == 4 and set(root.compact) == {1, 2}
    for size, view in root.compact.items():
        assert view.conv.data_ptr() == root.conv.data_ptr() and view.recurrent.data_ptr() == root.recurrent.data_ptr()
        assert view.slots.keys[-1].data_ptr() == root.slots.keys[-1].data_ptr() and view.ids.shape[0] == size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_hybrid_static_decode_on_cuda_replays_its_checked_graphs_and_equals_generate():
    """On CUDA the hybrid's one-token step (HF's decode step: fla's fused recurrent kernel where fla-core is
    installed) runs as a pipeline.cuda_graphs.CudaGraphFn per key bucket and batch size (captured with the stacked
    states restored between its runs, checked against eager on its first replay, never disabled), through a
    compaction and on the first rows of a larger state, and greedy output equals model.generate token for token
    (fp32)."""
    tcfg = HYBRIDS["text"]
    location = materialize_target(tcfg, CACHE)
    tok = load_tokenizer(location, tcfg)
    model = load_target(location, tcfg, device="cuda")
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}], enable_thinking=False) for t in TEXTS]
    target = (model, tok, end_of_turn_ids(tok, location), prompts)
    limits = [40, 9, 9, 9, 40]
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    gen = _gen(target, "static", 5, min_compact_batch=1, length_bucket=16)
    outs = gen.generate(prompts, limits)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert gen.static.on_graphs(), "the hybrid decode step fell back to eager (capture or self-check failed)"
    state = gen.static._state  # the batch of 5 ran on the root state, then (after the compaction) on its first rows
    assert state.compact, "no compaction happened"
    captured = [(size, live) for size, st in [(5, state), *state.compact.items()] for live in st.steps]
    assert len({live for _, live in captured}) >= 2, captured  # several key buckets captured
    # a batch of 5 on a state of 16 rows runs on its first 8 (the tail or last batch of a run): views, graphed
    wide = _gen(target, "static", 16, min_compact_batch=1, length_bucket=16)
    assert [o.token_ids for o in wide.generate(prompts, limits)] == [r.token_ids for r in reference]
    assert wide.static._key[0] == 16 and 8 in wide.static._state.compact and wide.static.on_graphs()


@pytest.mark.slow
def test_bench_regen_times_a_hybrid_shape_beside_generate_and_its_rooflines(tmp_path):
    """`benchmarks/bench_regen.py --shape tiny` (the command the GPU runs at the Qwen3.6-27B shape) builds the random
    hybrid, times `generate` and the static loop at two batch sizes on the demo config's real prompts (the mirror),
    gives identical greedy output, and records every row's compute / memory roofline and the summary keys of the
    hybrid results."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, mirror_file

    mirror = mirror_file("gsm8k_train.jsonl").parent
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_regen.py", "--shape", "tiny", "--num-prompts", "8", "--max-new-tokens",
           "12", "--batch-size", "4,8", "--modes", "generate,static-nograph", "--threads", "1", "--json", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600,
                   env={**os.environ, "DRAFTER_DATA_DIR": str(mirror), "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("generate", 4), ("generate", 8), ("static-nograph", 4),
                                                        ("static-nograph", 8)]
    assert all(r["gen_tokens"] == 8 * 12 and r["stopped"] == 0 for r in rows)  # every row runs to its limit
    assert [r["same_as_ref"] for r in rows[1:]] == ["8/8"] * 3
    assert all(r["compute_roofline_tok_s"] > 0 and r["memory_roofline_tok_s"] > 0 for r in rows)
    assert rows[1]["memory_roofline_tok_s"] > rows[0]["memory_roofline_tok_s"]  # weights shared by more rows
    assert set(result["summary"]["regen_tok_s"]) == {"generate", "static-nograph"}
    assert result["env"]["shape"] == "tiny" and result["env"]["gated_delta_kernels"] == "torch"
