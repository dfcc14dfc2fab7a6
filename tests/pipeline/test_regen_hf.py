"""The hf backend: the static-cache fast path equals model.generate for greedy decoding, padded vocab rows
are never generated, per-request limits and stop ids hold, sampling is seeded."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from pipeline.config import TargetConfig
from pipeline.regen.conversation import end_of_turn_ids, prompt_ids, strip_reasoning
from pipeline.regen.generator import Sampling, cut_at_stop
from pipeline.regen.hf import HFGenerator, longest_first_batches
from pipeline.target import build_byte_tokenizer, load_target, load_tokenizer, materialize_target
from tests.conftest import CACHE

TEXTS = ["hello there", "What is 2+2? Explain in detail, step by step.", "x",
         "Write a short poem about the sea, the sky and the birds that fly between them.",
         "Summarize: the quick brown fox jumps over the lazy dog."]
TINY_QWEN3 = TargetConfig(model="random:qwen3", device="cpu", dtype="float32",
                          random_init=dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           intermediate_size=256, num_hidden_layers=4))


# The same shape with 10x the init scale: at the default (0.02) the random model's greedy answers barely depend on
# their prompts, so a row decoded from another row's cache would go unnoticed.
CONTEXT_SENSITIVE = dataclasses.replace(TINY_QWEN3, random_init={**TINY_QWEN3.random_init, "initializer_range": 0.2})


def _open(tcfg):
    location = materialize_target(tcfg, CACHE)
    tok = load_tokenizer(location, tcfg)
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}], enable_thinking=False) for t in TEXTS]
    return load_target(location, tcfg), tok, end_of_turn_ids(tok, location), prompts


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # overhead-bound tiny model on a shared 2-core machine
    yield _open(TINY_QWEN3)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sensitive_target(target):  # (inside `target`'s one-thread setting)
    return _open(CONTEXT_SENSITIVE)


def _gen(target, decode: str, batch_size: int, sampling=Sampling(), length_bucket: int = 128,
         min_compact_batch: int = 8):
    model, tok, stop, _ = target
    return HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=sampling,
                       batch_size=batch_size, decode=decode, length_bucket=length_bucket,
                       min_compact_batch=min_compact_batch)


def test_static_cache_decode_equals_generate_token_for_token_for_greedy(target):
    """Also with 8-slot buckets: the step attends over the filled buckets only, and crosses several of them."""
    prompts = target[3]
    limits = [40, 40, 12, 40, 33]
    reference = _gen(target, "generate", 1).generate(prompts, limits)  # unbatched: no padding at all
    for decode, batch_size, bucket in [("generate", 5, 128), ("static", 5, 128), ("static", 2, 128),
                                       ("static", 1, 128), ("static", 5, 8), ("static", 2, 8)]:
        outs = _gen(target, decode, batch_size, length_bucket=bucket).generate(prompts, limits)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (decode, batch_size, bucket)
        assert [o.finish_reason for o in outs] == [r.finish_reason for r in reference]
    assert {r.finish_reason for r in reference} == {"stop", "length"}  # both endings are exercised
    assert len({len(r.token_ids) for r in reference}) > 2


def test_static_decode_attending_over_filled_buckets_gives_the_full_cache_logits_at_every_step(target, monkeypatch):
    """Every step's logits with 8-slot buckets (the step reads the buckets written so far, crossing a bucket edge
    every 8 tokens) equal those over the whole preallocated cache. Greedy tokens alone would not show a step that
    lost its own key at a bucket edge: a random tiny model's argmax rarely moves."""
    import pipeline.regen.static_decode as static_decode

    def logits_per_step(bucket: int) -> list[torch.Tensor]:
        seen = []

        def recording(logits, *args, **kwargs):
            seen.append(logits.clone())
            return sample_next(logits, *args, **kwargs)

        monkeypatch.setattr(static_decode, "sample_next", recording)
        _gen(target, "static", 5, length_bucket=bucket).generate(target[3], [40, 40, 12, 40, 33])
        return seen

    sample_next = static_decode.sample_next
    whole, bucketed = logits_per_step(1024), logits_per_step(8)
    assert len(whole) == len(bucketed) == 40
    for k, (a, b) in enumerate(zip(whole, bucketed)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {k}")


def test_a_batch_compacted_to_its_unfinished_rows_decodes_what_the_full_batch_would(sensitive_target):
    """Three of five rows end at 9 tokens: at the check after step 16 the others (two, or one where an answer
    stopped early) move to a smaller batch. Greedy output equals model.generate's; sampled output is seeded, within
    its limits, and every row gets its own tokens (a row written by another row's stream would show as a copy)."""
    prompts = sensitive_target[3]
    limits = [40, 9, 9, 9, 40]
    reference = _gen(sensitive_target, "generate", 1).generate(prompts, limits)
    for bucket in (128, 8):
        gen = _gen(sensitive_target, "static", 5, length_bucket=bucket, min_compact_batch=1)
        outs = gen.generate(prompts, limits)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], bucket
        assert gen.static._state.compact, "the batch was not compacted"
    hot = Sampling(temperature=1.0, top_p=0.9, top_k=50)
    a, b = (_gen(sensitive_target, "static", 5, hot, min_compact_batch=1).generate(prompts, limits, seeds=[3] * 5)
            for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) <= lim for o, lim in zip(a, limits))
    assert a[0].token_ids != a[4].token_ids


def slot_cache_lengths(monkeypatch) -> list[int]:
    """The K/V slot count of every SlotCache the static decoder allocates from now on (in order)."""
    import pipeline.regen.static_decode as static_decode

    allocated = []

    class CountingSlotCache(static_decode.SlotCache):
        def __init__(self, max_len, device):
            super().__init__(max_len, device)
            allocated.append(max_len)

    monkeypatch.setattr(static_decode, "SlotCache", CountingSlotCache)
    return allocated


def test_every_batch_of_a_run_decodes_on_one_static_state(target, monkeypatch):
    """Batches of different widths (8-slot buckets: the longest prompts need more slots than the rest) reuse the
    first batch's K/V slots instead of allocating their own: on a GPU one state means its step graphs are captured
    once per run, not once per batch shape. Greedy output still equals model.generate's."""
    allocated = slot_cache_lengths(monkeypatch)
    prompts = sorted(target[3], key=len)[1:]  # four prompts of four different lengths: two batches of two
    assert len({len(p) for p in prompts}) == 4 and len(prompts[-1]) - len(prompts[0]) > 8
    limits = [20] * 4
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    outs = _gen(target, "static", 2, length_bucket=8).generate(prompts, limits)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert allocated == [-(-(len(prompts[-1]) + 20) // 8) * 8], allocated


def test_later_calls_decode_on_the_state_in_hand_while_it_holds_them_and_a_longer_call_allocates_once(target,
                                                                                                      monkeypatch):
    """A regen stage calls its generator once per shard, each with its own longest prompt. The decoder keeps its
    state (K/V slots, on a GPU its captured step graphs) for every later call of the same batch size whose K/V length
    fits it: a shorter call allocates nothing, a longer one allocates once, and the one after it reuses that. Greedy
    output equals model.generate's in every call."""
    allocated = slot_cache_lengths(monkeypatch)
    prompts = sorted(target[3], key=len)[1:]  # two short, two long: two calls of one batch each
    gen, reference = _gen(target, "static", 2, length_bucket=8), _gen(target, "generate", 1)
    bucket = lambda n: -(-n // 8) * 8  # noqa: E731
    first, longer = bucket(len(prompts[3]) + 12), bucket(len(prompts[3]) + 24)
    assert bucket(len(prompts[1]) + 12) < first < longer
    calls = [(prompts[2:], [12, 12]), (prompts[:2], [12, 12]), (prompts[2:], [24, 24]), (prompts[:2], [20, 20])]
    for batch, limits in calls:
        got = gen.generate(batch, limits)
        assert [o.token_ids for o in got] == [r.token_ids for r in reference.generate(batch, limits)]
    assert allocated == [first, longer], allocated


def test_a_wide_batch_prefills_in_narrower_chunks_within_its_token_budget_and_decodes_the_same(target, monkeypatch):
    """`prefill_tokens` bounds rows x positions of one prefill forward: the batch of 5 with a budget of 20 prefills
    4 positions at a time (1 at a budget of 3), each forward within the budget, and greedy output equals
    model.generate's, as with the default one-chunk prefill."""
    model = target[0]
    prompts, limits = target[3], [12] * 5
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    widths, in_prefill = [], [False]
    forward = type(model).forward

    def recording(self, *args, input_ids=None, **kwargs):
        if in_prefill[0]:
            widths.append(tuple(input_ids.shape))
        return forward(self, *args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording)
    width = max(map(len, prompts))
    for budget, positions in ((16384, 512), (20, 4), (3, 1)):
        gen = _gen(target, "static", 5)
        gen.static.prefill_tokens = budget
        assert gen.static.chunk_positions(5) == positions
        prefill = gen.static._prefill

        def marked(*args, **kwargs):
            in_prefill[0] = True
            try:
                return prefill(*args, **kwargs)
            finally:
                in_prefill[0] = False

        gen.static._prefill = marked
        widths.clear()
        outs = gen.generate(prompts, limits)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], budget
        assert sum(w[1] for w in widths) == width and len(widths) == -(-width // positions), (budget, widths)
        assert all(rows * q <= max(budget, rows) for rows, q in widths), (budget, widths)


def test_padded_vocab_rows_are_never_generated(target):
    model, tok, _, prompts = target
    assert model.config.vocab_size > len(tok)
    free = HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=model.config.vocab_size, stop_ids=target[2],
                       sampling=Sampling(), batch_size=5, decode="generate")
    unrestricted = free.generate(prompts, [40] * len(prompts))  # the random target does pick padded rows
    assert max(t for o in unrestricted for t in o.token_ids) >= len(tok)
    for decode in ("generate", "static"):
        outs = _gen(target, decode, 5).generate(prompts, [40] * len(prompts))
        assert max(t for o in outs for t in o.token_ids) < len(tok)


def test_limits_stop_ids_and_seeded_sampling(target):
    prompts = target[3]
    stop = set(target[2])
    outs = _gen(target, "static", 5).generate(prompts, [1, 5, 9, 3, 7])
    for o, limit in zip(outs, [1, 5, 9, 3, 7]):
        assert len(o.token_ids) <= limit
        assert (o.finish_reason == "stop") == (o.token_ids[-1] in stop)
        assert not stop & set(o.token_ids[:-1])
    hot = Sampling(temperature=1.0, top_p=0.9, top_k=50)
    a = _gen(target, "static", 5, hot).generate(prompts, [20] * 5, seeds=[7] * 5)
    b = _gen(target, "static", 5, hot).generate(prompts, [20] * 5, seeds=[7] * 5)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(t for o in a for t in o.token_ids) < len(target[1])
    greedy = _gen(target, "static", 5).generate(prompts, [20] * 5)
    top1 = _gen(target, "static", 5, Sampling(temperature=0.7, top_k=1)).generate(prompts, [20] * 5, seeds=[1] * 5)
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_thinking_flag_reaches_the_chat_template_and_reasoning_can_be_stripped():
    tok = build_byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m.role + ': ' + m.content + '<|im_end|>' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}"
                         "{% if not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.decode(prompt_ids(tok, msgs, enable_thinking=False))
    on = tok.decode(prompt_ids(tok, msgs, enable_thinking=True))
    assert off.endswith("assistant: <think></think>") and on.endswith("assistant: ")
    assert strip_reasoning("<think>\nplan\n</think>\n\nThe answer is 4.") == "The answer is 4."
    assert strip_reasoning("<think>cut off by max_new_tokens") == ""
    assert strip_reasoning("no reasoning") == "no reasoning"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_static_decode_on_cuda_replays_its_checked_graph_and_equals_generate(target):
    """The static decode step runs as a pipeline.cuda_graphs.CudaGraphFn (captured, checked against eager on its
    first replay, never disabled) and greedy output still equals model.generate token for token, also where the
    batch runs on the first rows of a larger state (views at a power-of-two size, their own graphs)."""
    _, tok, stop, prompts = target
    cuda = load_target(materialize_target(TINY_QWEN3, CACHE), TINY_QWEN3, device="cuda")
    limits = [40, 40, 12, 40, 33]
    gens = {d: HFGenerator(cuda, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=Sampling(),
                           batch_size=5, decode=d) for d in ("generate", "static")}
    reference = gens["generate"].generate(prompts, limits)
    outs = gens["static"].generate(prompts, limits)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert gens["static"].static.on_graphs(), "the decode step fell back to eager (capture or self-check failed)"
    # a batch of 5 on a state of 16 rows runs on its first 8 (the tail or last batch of a run): views, graphed
    wide = HFGenerator(cuda, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=Sampling(),
                       batch_size=16, decode="static")
    assert [o.token_ids for o in wide.generate(prompts, limits)] == [r.token_ids for r in reference]
    assert wide.static._key[0] == 16 and set(wide.static._state.compact) >= {8} and wide.static.on_graphs()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on CUDA only (run on the GPU machine)")
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_p=0.95)], ids=["greedy", "top_p"])
def test_static_decode_on_cuda_waits_for_the_gpu_only_at_its_stop_checks(target, sampling):
    """Once its graphs are captured, a batch's decode loop lets the host run ahead of the GPU: it waits on it only at
    each finished-rows check (every STOP_CHECK_EVERY steps) and once to read the batch's answers back, never once per
    step or per row, nor to move the prompts in (pinned, asynchronous copies), nor to draw a top-p token. A per-step
    sync leaves the GPU idle while the host prepares the next step; the failure lists where each sync happened."""
    from pipeline.cuda_graphs import host_syncs
    from pipeline.regen.static_decode import STOP_CHECK_EVERY

    _, tok, _, prompts = target
    cuda = load_target(materialize_target(TINY_QWEN3, CACHE), TINY_QWEN3, device="cuda")
    gen = HFGenerator(cuda, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=[len(tok) + 1],
                      sampling=sampling, batch_size=5, decode="static")
    limits = [64] * 5
    gen.generate(prompts, limits)  # captures the step graphs
    syncs, outs = host_syncs(lambda: gen.generate(prompts, limits))
    assert all(len(o.token_ids) == 64 for o in outs)
    allowed = (64 // STOP_CHECK_EVERY - 1) + 1 + 1  # the checks at steps 8 .. 56, the read-back, one spare
    assert len(syncs) <= allowed, f"{len(syncs)} host syncs for 64 decode steps:\n" + "\n".join(syncs)


def test_a_long_tail_decodes_in_small_batches_of_its_own_and_every_prompt_exactly_once(target):
    """A few long prompts among many short ones (a real prompt mix: 1,350 tokens at the head, ~80 typical) no longer
    set the width of a whole batch of short ones: `longest_first_batches` keeps each batch's padding to at most half
    its K/V slots, so the long tail decodes in a small batch of its own and the others in full batches of their own
    width, reading a fraction of the K/V slots fixed batches read. Every prompt is in exactly one batch, longest
    first; prompts of one length still make full batches. The static decoder batches so; `model.generate` (the CPU
    path, whose time is per-step overhead) keeps full batches."""
    lengths = [1350] * 4 + [410] * 4 + [300] * 8 + [260 - i for i in range(40)] + [120 - (i % 80) for i in range(1000)]
    prompts, answer = [[1] * n for n in lengths], [256] * len(lengths)
    batches = longest_first_batches(prompts, 512, answer)
    order = [i for b in batches for i in b]
    assert sorted(order) == list(range(len(prompts))) and [len(prompts[i]) for i in order] == sorted(lengths)[::-1]
    for b in batches:
        assert len(b) <= 512 and len(b) * (len(prompts[b[0]]) + 256) <= 2 * sum(len(prompts[i]) + 256 for i in b)
    assert len(batches[0]) < 32 and {len(prompts[i]) for i in batches[0]} >= {1350}
    assert max(map(len, batches)) == 512
    slots = lambda bs: sum(len(b) * (len(prompts[b[0]]) + 256) for b in bs)  # noqa: E731
    fixed = [order[i:i + 512] for i in range(0, len(order), 512)]
    assert slots(batches) < 0.5 * slots(fixed)
    assert [len(b) for b in longest_first_batches([[1] * 50] * 1000, 512, [256] * 1000)] == [512, 488]
    # the longest answer in the batch counts, not only its first prompt's: beside a 200-token answer, a third row
    # with a 1-token one would leave more than half the slots padding
    assert [len(b) for b in longest_first_batches([[1] * 10] * 3, 8, [1, 200, 1])] == [2, 1]
    # without answer limits (model.generate's batches): batch_size at a time, the long tail included
    assert [len(b) for b in longest_first_batches([[1] * 1350] + [[1] * 50] * 9, 4)] == [4, 4, 2]
    assert [len(b) for b in _gen(target, "static", 512).batches(prompts, answer)] == [len(b) for b in batches]
    assert [len(b) for b in _gen(target, "generate", 512).batches(prompts, answer)] == [512, 512, 32]


def test_a_smaller_batch_decodes_on_the_first_rows_of_the_state_in_hand(target, monkeypatch):
    """A batch with fewer rows than the decoder's state (the long tail's, a run's last) decodes on a view of the
    state's first rows, allocating nothing: greedy output equals model.generate's, and the view is the one kept
    for its size (on a GPU its captured graphs serve every later batch of that size). With graphs, a batch runs at
    the power of two that holds it (not below min_compact_batch) where that is at most half the state's rows."""
    allocated = slot_cache_lengths(monkeypatch)
    prompts, limits = target[3], [20, 20, 12, 20, 16]
    gen, reference = _gen(target, "static", 4), _gen(target, "generate", 1)
    outs = gen.generate(prompts, limits)  # batches of 4 and 1
    assert [len(b) for b in longest_first_batches(prompts, 4, limits)] == [4, 1]
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference.generate(prompts, limits)]
    assert len(allocated) == 1 and set(gen.static._state.compact) == {1}
    view = gen.static._state.compact[1]
    assert view.slots.keys[0].data_ptr() == gen.static._state.slots.keys[0].data_ptr()
    # a run whose first batch is its small one (the long tail) starts on a view of a state no forward has filled yet
    fresh, allocated[:] = _gen(target, "static", 4).static, []
    longest = max(range(5), key=lambda i: len(prompts[i]))
    calls = [([prompts[longest]], [20]), (prompts[:4], limits[:4])]
    for batch, lims in calls:
        streams = fresh.generate(batch, lims, pad_to=4)
        got = [cut_at_stop(stream, n, set(target[2])).token_ids for stream, n in zip(streams, lims)]
        assert got == [r.token_ids for r in reference.generate(batch, lims)]
    assert len(allocated) == 1 and fresh._state.compact[1].slots.keys[0].data_ptr() == \
        fresh._state.slots.keys[0].data_ptr()
    decoder = gen.static
    decoder.use_graphs = True  # (rows_to_run alone: nothing is captured here)
    assert [decoder.rows_to_run(n, 512) for n in (1, 8, 9, 27, 256, 257, 512)] == [8, 8, 16, 32, 256, 512, 512]
    decoder.use_graphs = False
    assert decoder.rows_to_run(27, 512) == 27


def test_bench_regen_recipe_answer_lengths_match_the_recipe_run_s_answers():
    """`bench_regen --answer-lengths recipe`: per-prompt answer lengths within each limit, their mean and the share
    at the limit those of the 100K-prompt recipe run (ANSWER_MIX), the same for the same seed, and scaled with a
    shorter limit."""
    from benchmarks.bench_regen import ANSWER_MIX, recipe_answer_lengths

    limits = [384] * 20000 + [40] * 20000
    lengths = recipe_answer_lengths(limits)
    assert lengths == recipe_answer_lengths(limits) and lengths != recipe_answer_lengths(limits, seed=1)
    assert all(1 <= n <= limit for n, limit in zip(lengths, limits))
    full, short = lengths[:20000], lengths[20000:]
    assert sum(full) / len(full) == pytest.approx(ANSWER_MIX["mean"], rel=0.03)
    assert sum(n == 384 for n in full) / len(full) == pytest.approx(ANSWER_MIX["at_limit"], abs=0.015)
    assert sum(short) / len(short) == pytest.approx(ANSWER_MIX["mean"] * 40 / 384, rel=0.06)


def test_bench_regen_warm_up_sizes_the_decoder_state_for_the_whole_timed_run(target, monkeypatch):
    """bench_regen's untimed warm-up decodes the run's longest batch first, so the timed run decodes every batch on
    the state it made (one allocation; on a GPU: no state, and no graph of its live lengths, built on the clock),
    not on a new one sized for prompts longer than the warm-up's."""
    from benchmarks.bench_regen import run_hf

    model, tok, stop, prompts = target
    prompts = prompts[:4]  # two full batches of two (on a GPU every batch is padded to the batch size)
    allocated = slot_cache_lengths(monkeypatch)
    limits = [40] * len(prompts)  # the first two prompts (64 + 40) fit 128 slots, the longest (97 + 40) needs 256
    assert max(map(len, prompts[:2])) + 40 <= 128 < max(map(len, prompts)) + 40
    outs = run_hf("static-nograph", model, tok, stop, prompts, limits, 2, torch.device("cpu"))[0]
    assert len(outs) == len(prompts) and allocated == [256], allocated


def test_bench_regen_names_the_logit_gap_where_two_greedy_outputs_part(target):
    """benchmarks/bench_regen.py's divergence report: an output that takes the runner-up token at position 3 parts
    there with the gap top-1 minus runner-up of the reference's logits; one that agrees until it ends early is
    counted apart; identical outputs are not reported."""
    from benchmarks.bench_regen import first_divergences

    model, _, _, prompts = target
    prompts = prompts[:3]
    ref = [o.token_ids for o in _gen(target, "generate", 1).generate(prompts, [8, 8, 8])]
    assert all(len(r) == 8 for r in ref)
    logits = model(torch.tensor([prompts[0] + ref[0][:3]])).logits[0, -1]
    top2 = logits.topk(2)
    assert int(top2.indices[0]) == ref[0][3]
    swapped = ref[0][:3] + [int(top2.indices[1])] + ref[0][4:]
    got = first_divergences(model, prompts, [swapped, ref[1][:5], ref[2]], ref)
    assert got["ended_apart"] == 1 and len(got["divergences"]) == 1
    d = got["divergences"][0]
    assert d["prompt"] == 0 and d["position"] == 3
    assert d["gap"] == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5) and d["gap"] > 0
    assert got["max_gap"] == d["gap"] and d["logit_scale"] == pytest.approx(float(logits.abs().max()), abs=1e-3)


def test_bench_regen_profile_counts_every_decode_step_and_leaves_the_decoder_as_it_was(target):
    """benchmarks/bench_regen.py --profile: one batch decoded again under torch.profiler, its steps counted at the
    decoder's step (limit 9 -> 8 one-token steps after the prefill), per-step wall and host ops reported (no kernel
    time on the CPU); afterwards the decoder steps through its own method again and decodes the same tokens."""
    from benchmarks.bench_regen import profile_batch

    prompts = target[3][:3]
    gen = _gen(target, "static", 3)
    before = [o.token_ids for o in gen.generate(prompts, [9, 9, 9])]
    found = profile_batch(gen, prompts, [9, 9, 9], torch.device("cpu"))
    assert found["batch"] == 3 and found["decode_steps"] == 8
    assert found["wall_ms_per_step"] > 0 and found["kernel_ms_per_step"] is None and found["kernels"] == []
    assert found["host_ops"] and all(op["us_per_step"] > 0 for op in found["host_ops"])
    assert "_step" not in vars(gen.static)
    assert [o.token_ids for o in gen.generate(prompts, [9, 9, 9])] == before


def test_bench_regen_keeps_the_stages_context_limit_and_profiles_a_middle_batch_of_the_longest_first_order(target):
    """bench_regen leaves out a prompt of --max-model-len tokens or more and caps the others' new tokens at the room
    left, as the regen stage does; its profile decodes the middle batch of the run's longest-first order, not the
    input's first prompts (which may hold the longest one)."""
    from benchmarks.bench_regen import middle_batch, within_context

    kept, limits, over = within_context([[1] * 3, [1] * 10, [1] * 5, [1] * 8], 4, 8)
    assert [len(p) for p in kept] == [3, 5] and limits == [4, 3] and over == 2
    prompts = [[7] * n for n in range(1, 11)]
    batch, lims = middle_batch(_gen(target, "static", 3), prompts, list(range(1, 11)))
    assert [len(p) for p in batch] == [4, 3, 2] and lims == [4, 3, 2]  # batches [10 9 8] [7 6 5] [4 3 2] [1]


def test_bench_regen_shape_tokenizes_with_a_real_tokenizer_and_refuses_one_larger_than_its_vocab(smollm2_dir,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """`--shape smollm2-135m --tokenizer DIR`: the random-init shape decodes prompts of the real tokenizer's
    lengths (far shorter than the byte tokenizer's), each within --max-model-len, sampled as the recipe samples when
    asked; the tiny shape (320 ids) refuses SmolLM2's 49,152-id tokenizer in one line."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.conftest import REPO, mirror_file

    env = {**os.environ, "DRAFTER_DATA_DIR": str(mirror_file("gsm8k_train.jsonl").parent), "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "benchmarks/bench_regen.py", "--num-prompts", "6", "--max-new-tokens", "4",
            "--batch-size", "6", "--modes", "static-nograph", "--threads", "1"]
    refused = subprocess.run(base + ["--shape", "tiny", "--tokenizer", smollm2_dir], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("more than --shape tiny's vocabulary of 320")
    out = tmp_path / "real.json"
    subprocess.run(base + ["--shape", "smollm2-135m", "--max-model-len", "160", "--tokenizer", smollm2_dir, "--json",
                           str(out), "--temperature", "0.7", "--top-p", "0.95"],  # (the recipe's sampling)
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    logged = json.loads(out.read_text())
    real = logged["env"], logged["rows"][0]
    assert logged["args"]["tokenizer"] == logged["env"]["tokenizer"]  # (the args it records name it the same way)
    assert [b["rows"] for b in real[1]["batches"]] and sum(b["rows"] for b in real[1]["batches"]) == real[1]["prompts"]
    from benchmarks.bench_regen import real_prompts
    from pipeline.target import build_byte_tokenizer

    monkeypatch.setenv("DRAFTER_DATA_DIR", env["DRAFTER_DATA_DIR"])
    byte = [len(prompt_ids(build_byte_tokenizer(), c, enable_thinking=False)) for c in real_prompts(6)]
    (info, row) = real
    assert info["tokenizer"] == str(Path(smollm2_dir).resolve().relative_to(REPO))  # (a committed log names no
    assert info["prompt_tokens_max"] < 160                                          # path outside the repository)
    assert info["sampling"] == {"temperature": 0.7, "top_p": 0.95, "top_k": 0} and row["gen_tokens"] > 0
    assert info["prompts_over_max_model_len"] < sum(n >= 160 for n in byte)  # the byte lengths pass the limit more
    kept = [n for n in byte if n < 160]
    assert info["prompt_tokens_mean"] < sum(kept) / len(kept)  # shorter even than the byte prompts that fit
    assert row["prompts"] == 6 - info["prompts_over_max_model_len"] and row["gen_tokens"] == 4 * row["prompts"]


def _slot_slices(device, dtype, b=5, hk=2, g=3, d=16, max_len=40, live=24, seed=0):
    """query [b, hk, g, d]; key / value: the first `live` slots of [b, hk, max_len, d] buffers (strided rows, as
    the static decode step sees them); additive mask [b, 1, 1, live] hiding each row's left padding."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    q, kbuf, vbuf = make(b, hk, g, d), make(b, hk, max_len, d), make(b, hk, max_len, d)
    pad = torch.tensor([0, 3, 7, 1, 20][:b])
    slots = torch.arange(live)
    mask = torch.where(slots[None, :] >= pad[:, None], 0.0, torch.finfo(dtype).min)[:, None, None, :]
    return q, kbuf[:, :, :live], vbuf[:, :, :live], mask.to(device, dtype)


def test_decode_attention_as_two_gemms_equals_sdpa_over_slot_buffer_slices():
    """pipeline.regen.static_decode.decode_attention (the one-token step's attention as two batched GEMMs) equals
    torch's SDPA on the same folded queries, strided K/V slices and padding mask (fp32), reads the slices without
    copying them, and the padded slots get no weight: changing them changes nothing."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from pipeline.regen.static_decode import decode_attention

    q, k, v, mask = _slot_slices("cpu", torch.float32)
    assert not k.is_contiguous() and k.reshape(-1, k.shape[2], k.shape[3]).data_ptr() == k.data_ptr()
    got = decode_attention(q, k, v, mask, 0.25)
    want = sdpa(q, k, v, attn_mask=mask, scale=0.25)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[4, :, :20], v2[4, :, :20] = 1e3, -1e3  # row 4's padding slots
    torch.testing.assert_close(decode_attention(q, k2, v2, mask, 0.25)[4], got[4], rtol=0, atol=0)


def test_static_decode_on_the_fused_sdpa_kernel_equals_generate_too(target):
    """decode_gemm=False (the one-token step on torch's fused SDPA kernel, bench_regen's static-sdpa mode) decodes the
    same greedy tokens as model.generate, as the default GEMM step does."""
    prompts = target[3]
    limits = [20, 20, 12, 20, 17]
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    model, tok, stop, _ = target
    outs = HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=Sampling(),
                       batch_size=5, decode="static", decode_gemm=False, length_bucket=8).generate(prompts, limits)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_attention_on_cuda_in_bf16_stays_within_rounding_of_fp32():
    """On CUDA, bf16 inputs take the fp32-output GEMM (torch.bmm out_dtype): the result is within bf16 rounding of the
    fp32 computation and no farther from it than SDPA's bf16 kernel is."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from pipeline.regen.static_decode import decode_attention, fp32_scores_available

    assert fp32_scores_available(torch.device("cuda"), torch.bfloat16)  # else regen keeps the fused kernel
    q, k, v, mask = _slot_slices("cuda", torch.bfloat16)
    exact = decode_attention(q.float(), k.float(), v.float(), mask.float(), 0.25)
    got = decode_attention(q, k, v, mask, 0.25).float()
    fused = sdpa(q, k, v, attn_mask=mask, scale=0.25).float()
    err, err_fused = (got - exact).abs().max().item(), (fused - exact).abs().max().item()
    assert err <= max(2 * err_fused, 1e-2), (err, err_fused)


@pytest.mark.slow
def test_static_decode_with_compiled_norms_and_mlps_equals_generate_and_close_restores_the_model(target):
    """compile_pointwise (bench_regen's static-compiled mode): the decoder layers' RMSNorms and MLPs and the final norm
    run torch.compile'd, one compiled graph for all layers, and the attention's rotary embedding is its compiled
    self; greedy output still equals model.generate token for token (fp32, through a batch-size change); close()
    leaves every module eager again and puts the modeling module's own function back."""
    import torch._dynamo

    from pipeline.target import POINTWISE_MODULES

    model, tok, stop, prompts = target
    limits = [16, 16, 6, 16, 11]
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    torch._dynamo.reset()
    gen = HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=Sampling(),
                      batch_size=5, decode="static", compile_pointwise=True, min_compact_batch=1)
    modules = [getattr(layer, n) for layer in model.model.layers for n in POINTWISE_MODULES] + [model.model.norm]
    *compiled, rotary = gen.static.compiled
    assert compiled == modules and all(m._compiled_call_impl is not None for m in modules)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    assert rotary.namespace is modeling and modeling.apply_rotary_pos_emb is not rotary.original
    outs = gen.generate(prompts, limits)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert gen.generate(prompts[:2], limits[:2])[1].token_ids == reference[1].token_ids  # another batch shape
    gen.close()
    assert all(m._compiled_call_impl is None for m in modules)
    assert modeling.apply_rotary_pos_emb is rotary.original


def test_regen_compile_decides_whether_the_stage_s_static_decoder_compiles_its_pointwise_modules():
    """`regen.compile` reaches the stage's generator (`HFGenerator.load`): 'on' compiles the static decoder's norms,
    MLPs and rotary embedding (bench_regen's fastest mode, static-compiled), 'off' does not, and 'auto' does on CUDA
    only (here, a CPU: not). Nothing is compiled until a step runs, so loading is cheap; close() undoes it."""
    from pipeline.config import RegenConfig

    location = materialize_target(TINY_QWEN3, CACHE)
    tok = load_tokenizer(location, TINY_QWEN3)
    for setting, compiled in (("on", True), ("off", False), ("auto", False)):
        rcfg = RegenConfig(hf_decode="static", compile=setting)
        gen = HFGenerator.load(location, TINY_QWEN3, rcfg, tokenizer=tok, stop_ids=end_of_turn_ids(tok, location),
                               sampling=Sampling())
        assert gen.static is not None and bool(gen.static.compiled) is compiled, setting
        modules = [m for m in gen.static.compiled if isinstance(m, torch.nn.Module)]
        gen.close()
        assert all(m._compiled_call_impl is None for m in modules)


def test_a_sampled_token_is_drawn_from_the_nucleus_distribution():
    """`sample_next` draws among the candidates in descending order and maps the pick back; its draws follow
    `nucleus_probs` (temperature, top-k, top-p in vocabulary order) within sampling noise, and never an id that
    distribution excludes: beyond the top-k, past the nucleus, or a padded vocabulary row."""
    from pipeline.regen.generator import nucleus_probs, sample_next

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen)
    logits[2, 30:] = float("-inf")  # padded vocabulary rows
    n = 20000
    for sampling in (Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.3, top_k=5),
                     Sampling(temperature=0.7, top_p=0.8, top_k=8), Sampling(temperature=1.0)):
        want = nucleus_probs(logits, sampling)
        draws = sample_next(logits.repeat_interleave(n, dim=0), sampling, gen).view(3, n)
        freq = torch.stack([torch.bincount(row, minlength=40).float() / n for row in draws])
        assert (freq[want == 0] == 0).all(), sampling  # nothing outside the distribution
        assert (freq - want).abs().max() < 0.02, (sampling, (freq - want).abs().max())
        assert (want > 0).sum(-1).min() > 1  # each case keeps several ids


def test_the_sort_free_nucleus_draw_follows_the_nucleus_where_it_holds_thousands_of_ids():
    """With top_p alone `sample_next` draws by rejection (`sample_nucleus`): over a flat distribution whose nucleus
    holds ~1,800 of 2,048 ids, its draws never leave the nucleus and match `nucleus_probs` by probability decile
    of the nucleus, its least probable ids (those a top-k prefilter would drop) included. A top_p too small for the
    sort-free draw's miss bound sorts, with the same distribution."""
    from pipeline.regen.generator import NUCLEUS_MISS, nucleus_candidates, nucleus_probs, sample_next

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 2048, generator=gen) * 0.5
    for sampling, n, tolerance in ((Sampling(temperature=1.0, top_p=0.95), 60_000, 0.007),
                                   (Sampling(temperature=1.0, top_p=0.2), 20_000, 0.012)):
        want = nucleus_probs(logits, sampling)[0]
        draws = sample_next(logits.expand(n, -1), sampling, gen)
        freq = torch.bincount(draws, minlength=2048).float() / n
        assert (freq[want == 0] == 0).all(), sampling
        kept = want.nonzero().flatten()
        assert len(kept) > (1700 if sampling.top_p > 0.9 else 150), len(kept)
        by_rank = kept[want[kept].argsort(descending=True)].tensor_split(10)  # deciles of the nucleus by probability
        got = torch.stack([freq[ids].sum() for ids in by_rank])
        expected = torch.stack([want[ids].sum() for ids in by_rank])
        assert (got - expected).abs().max() < tolerance, (sampling, got, expected)
    assert nucleus_candidates(0.95) > 0 and 0.05 ** nucleus_candidates(0.95) <= NUCLEUS_MISS
    assert nucleus_candidates(0.2) == nucleus_candidates(0.0) == nucleus_candidates(1.0) == 0  # sorts (or no nucleus)


def test_bench_sampling_times_both_draws_and_finds_them_on_the_nucleus_distribution():
    """benchmarks/bench_sampling.py: a row per batch size with the greedy, sorted and sort-free times, and each
    path's draws within sampling noise of `nucleus_probs` by decile of a nucleus of hundreds of ids."""
    from benchmarks.bench_sampling import main

    result = main(["--device", "cpu", "--batches", "4,16", "--vocab", "1024", "--iters", "1", "--check", "20000",
                   "--scale", "1"])
    assert [r["batch"] for r in result["rows"]] == [4, 16]
    for r in result["rows"]:
        assert r["nucleus_ids_median"] > 300 and r["candidates"] == 10
        assert min(r["greedy_ms"], r["sorted_ms"], r["sort_free_ms"]) > 0
        assert r["sorted_gap"] < 0.015 and r["sort_free_gap"] < 0.015, r


def test_a_row_with_no_candidate_inside_the_nucleus_takes_its_most_probable_id():
    """`sample_nucleus` with one candidate: a draw outside the nucleus (here every draw of id 1, p 0.4, where the
    nucleus at top_p 0.5 is id 0 alone) falls back to the row's most probable id, never to an id outside."""
    from pipeline.regen.generator import sample_nucleus

    probs = torch.tensor([[0.6, 0.4]]).expand(4000, -1)
    draws = sample_nucleus(probs, 0.5, 1, torch.Generator().manual_seed(0))
    assert (draws == 0).all()
    draws = sample_nucleus(torch.tensor([[0.6, 0.4]]).expand(4000, -1), 0.7, 1, torch.Generator().manual_seed(0))
    assert 0.35 < (draws == 1).float().mean() < 0.45  # both inside at 0.7: the draw itself, unchanged
