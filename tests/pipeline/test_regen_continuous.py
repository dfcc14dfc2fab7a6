"""The continuous-batching decode loop (pipeline/regen/continuous_decode.py): rows refilled with the next prompt as
their answers end write, for greedy decoding, the same tokens as `model.generate` on each prompt alone; a run takes
about as many steps as its longest answer, not the sum of its batches' longest; sampling is seeded and within limits."""

from __future__ import annotations

import pytest
import torch

from pipeline.regen.continuous_decode import ContinuousDecoder, supports_continuous_decode
from pipeline.regen.generator import Sampling
from pipeline.regen.hf import HFGenerator
from pipeline.target import load_target, materialize_target
from tests.conftest import CACHE
from tests.pipeline.test_regen_hf import CONTEXT_SENSITIVE, _open


@pytest.fixture(scope="module")
def sensitive_target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # overhead-bound tiny model on a shared 2-core machine
    yield _open(CONTEXT_SENSITIVE)
    torch.set_num_threads(threads)


def _gen(target, decode: str, batch_size: int, sampling=Sampling(), **kwargs) -> HFGenerator:
    model, tok, stop, _ = target
    return HFGenerator(model, pad_id=tok.pad_token_id, vocab_limit=len(tok), stop_ids=stop, sampling=sampling,
                       batch_size=batch_size, decode=decode, **kwargs)


def _decoder(target, rows: int, sampling=Sampling(), **kwargs) -> ContinuousDecoder:
    model, tok, stop, _ = target
    return ContinuousDecoder(model, vocab_limit=len(tok), stop_ids=stop, sampling=sampling, rows=rows, **kwargs)


def _prompts(target) -> list[list[int]]:
    """Nine prompts of different lengths: the five chat prompts and four more made of their pieces."""
    base = target[3]
    return base + [base[1] + base[0][-5:], base[3][:9], base[4] + base[2], base[0][:4]]


def test_refilled_rows_decode_every_prompt_as_generate_does_alone(sensitive_target):
    """Greedy, on the context-sensitive model (a row reading another sequence's K/V would change its tokens): with
    fewer rows than prompts each row takes several prompts in turn, over slots an earlier, longer sequence wrote;
    compaction moves the last live rows down; the outputs equal model.generate's on each prompt alone, in input
    order, at every row count, refill threshold and check interval."""
    prompts = _prompts(sensitive_target)
    limits = [30, 7, 18, 3, 25, 11, 1, 16, 9]
    reference = _gen(sensitive_target, "generate", 1).generate(prompts, limits)
    for rows, check_every, refill_rows in [(2, 8, 1), (2, 1, 1), (4, 3, 2), (8, 8, None), (16, 8, None)]:
        dec = _decoder(sensitive_target, rows, check_every=check_every, refill_rows=refill_rows, min_compact_batch=1)
        streams = dec.generate(prompts, limits)
        assert streams == [r.token_ids for r in reference], (rows, check_every, refill_rows)
        assert dec.stats["prefills"] >= (2 if rows < len(prompts) else 1)
        if rows >= 8:  # the last live rows moved down to a smaller row count
            assert len(dec._views) > 1, rows
    assert {r.finish_reason for r in reference} == {"length"} or len({len(r.token_ids) for r in reference}) > 3


def test_a_run_takes_about_as_many_steps_as_its_longest_answer_not_the_sum_of_its_batches(sensitive_target):
    """Two rows, one answer of 40 tokens and eight of 3: the short ones pass through the other row while the long
    one decodes (39 steps after its prefill); static batches of two would take 40 + 4 x 2 steps."""
    prompts = _prompts(sensitive_target)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # the first prefilled
    limits = [40 if i == longest else 3 for i in range(len(prompts))]
    dec = _decoder(sensitive_target, 2, check_every=1, refill_rows=1, min_compact_batch=1)
    streams = dec.generate(prompts, limits)
    reference = _gen(sensitive_target, "generate", 1).generate(prompts, limits)
    assert streams == [r.token_ids for r in reference]
    assert dec.stats["steps"] <= 40, dec.stats
    assert dec.stats["tokens"] == sum(len(s) for s in streams)


def test_the_hf_backend_in_continuous_mode_equals_generate_and_keeps_one_state_across_calls(sensitive_target):
    """Through HFGenerator (what the stage calls): results in input order, cut at stop ids / limits exactly as
    generate's; a second, shorter call decodes on the buffers in hand (same K/V tensor)."""
    prompts = _prompts(sensitive_target)
    limits = [12, 30, 5, 20, 8, 14, 2, 25, 6]
    reference = _gen(sensitive_target, "generate", 1).generate(prompts, limits)
    gen = _gen(sensitive_target, "continuous", 3, min_compact_batch=1, max_model_len=256)
    assert gen.decode == "continuous"
    outs = gen.generate(prompts, limits)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(r.token_ids, r.finish_reason) for r in reference]
    buffer = gen.continuous._root.slots.keys[0]
    assert buffer.shape[2] == 256
    again = gen.generate(prompts[:4], limits[:4])
    assert [o.token_ids for o in again] == [r.token_ids for r in reference[:4]]
    assert gen.continuous._root.slots.keys[0] is buffer


def test_a_long_prompt_with_little_room_is_not_padded_into_a_group_whose_answers_would_pass_the_slots(
        sensitive_target):
    """Prompt + answer fit the context (as the stage's limits make them: min(max_new_tokens, room)), but the longest
    prompt's width + the longest answer would not: refill groups stop before a prompt that would, so the buffers hold
    exactly the longest prompt + answer, and the outputs still equal model.generate's."""
    prompts = _prompts(sensitive_target)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    context = len(prompts[longest]) + 2
    limits = [2 if i == longest else min(24, context - len(p)) for i, p in enumerate(prompts)]
    assert max(len(p) for p in prompts) + max(limits) > context == max(len(p) + m for p, m in zip(prompts, limits))
    dec = _decoder(sensitive_target, 4, min_compact_batch=1)
    streams = dec.generate(prompts, limits)
    assert dec._root.slots.keys[0].shape[2] == context
    assert streams == [r.token_ids for r in _gen(sensitive_target, "generate", 1).generate(prompts, limits)]


def test_sampled_continuous_decoding_is_seeded_and_within_each_limit(sensitive_target):
    hot = Sampling(temperature=1.0, top_p=0.9)
    prompts = _prompts(sensitive_target)
    limits = [20, 3, 12, 20, 1, 9, 15, 4, 20]
    a, b = (_gen(sensitive_target, "continuous", 4, hot, min_compact_batch=1).generate(prompts, limits, seeds=[7] * 9)
            for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(1 <= len(o.token_ids) <= lim for o, lim in zip(a, limits))
    assert len({tuple(o.token_ids) for o in a}) == len(a)  # each prompt its own answer


def test_continuous_decode_takes_all_full_attention_targets_only():
    from transformers import Qwen3Config

    plain = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    windowed = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert supports_continuous_decode(plain)
    assert not supports_continuous_decode(windowed)


def test_an_empty_call_returns_nothing(sensitive_target):
    assert _decoder(sensitive_target, 2).generate([], []) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
def test_continuous_decode_on_cuda_replays_checked_graphs_and_equals_generate(sensitive_target):
    """On CUDA the step of every row count replays a CUDA graph (captured, checked against eager, never disabled),
    the attention runs the Triton kernel where it builds, and greedy output equals model.generate's on each prompt."""
    _, tok, stop, _ = sensitive_target
    cuda = load_target(materialize_target(CONTEXT_SENSITIVE, CACHE), CONTEXT_SENSITIVE, device="cuda")
    prompts = _prompts(sensitive_target)
    limits = [30, 7, 18, 3, 25, 11, 1, 16, 9]
    target = (cuda, tok, stop, prompts)
    reference = _gen(target, "generate", 1).generate(prompts, limits)
    dec = _decoder(target, 4, min_compact_batch=1)
    assert dec.generate(prompts, limits) == [r.token_ids for r in reference]
    assert dec.on_graphs() and len(dec._views) > 1, "a step fell back to eager (capture or self-check failed)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on CUDA only (run on the GPU machine)")
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_p=0.95)], ids=["greedy", "top_p"])
def test_continuous_decode_on_cuda_waits_for_the_gpu_only_at_its_checks(sensitive_target, sampling):
    """Once its graphs are captured, the loop waits on the GPU only at each check (every `check_every` steps: the
    finished flags) and once per check that hands answers back, never per step, per row, or to move prompts in."""
    from pipeline.cuda_graphs import host_syncs
    from pipeline.regen.static_decode import STOP_CHECK_EVERY

    _, tok, _, _ = sensitive_target
    cuda = load_target(materialize_target(CONTEXT_SENSITIVE, CACHE), CONTEXT_SENSITIVE, device="cuda")
    prompts = _prompts(sensitive_target)[:4]
    dec = ContinuousDecoder(cuda, vocab_limit=len(tok), stop_ids=[len(tok) + 1], sampling=sampling, rows=4)
    limits = [64] * 4
    dec.generate(prompts, limits)  # captures the step graph
    syncs, streams = host_syncs(lambda: dec.generate(prompts, limits))
    assert all(len(s) == 64 for s in streams)
    allowed = 64 // STOP_CHECK_EVERY + 1 + 1  # the checks, the one read-back of the answers, one spare
    assert len(syncs) <= allowed, f"{len(syncs)} host syncs for 64 decode steps:\n" + "\n".join(syncs)
