"""The lossless check: the first divergence from AR is found, recomputed in fp32 and classified — a planted
divergence to a low-probability token lies beyond the near-tie margin, a near-tie is rounding, and a divergence
beyond the margin is decided by the fp32 replay (rounding if AR and the method agree there, a bug if not)."""

from __future__ import annotations

import pytest
import torch

from eval.lossless import NEAR_TIE_MARGIN, classify, first_divergence, fp32_logits_at, fp32_replay, lossless_summary
from pipeline.config import TargetConfig
from pipeline.target import load_target, materialize_target
from tests.conftest import CACHE


def test_first_divergence_is_the_first_differing_index_or_the_shorter_length():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [7]) == 0


@pytest.fixture(scope="module")
def tiny_target():
    location = materialize_target(TargetConfig(), CACHE)
    return load_target(location, TargetConfig(), device="cpu", dtype=torch.float32).eval()


def greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_planted_divergence_to_an_unlikely_token_is_not_a_near_tie(tiny_target):
    logits_at = fp32_logits_at(tiny_target)
    prompt = [5, 17, 42, 99, 3]
    ar = greedy(tiny_target, prompt, 12)
    assert classify("p", 0, prompt, ar, list(ar), logits_at) is None
    bad = list(ar)
    worst = int(logits_at(prompt + ar[:6]).argmin())  # the least likely token at position 6
    bad[6] = worst
    d = classify("p", 0, prompt, ar, bad, logits_at)
    assert d.position == 6 and d.ar_token == ar[6] and d.method_token == worst and d.argmax_token == ar[6]
    assert d.gap > 1.0 and not d.near_tie and d.fp32_replay is None and not d.rounding  # no replay: a bug
    s = lossless_summary(4, [d])
    assert s["identical"] == 0.75 and s["identical_or_near_tie"] == 0.75 and s["not_near_tie"] == 1
    assert s["identical_or_rounding"] == 0.75 and s["bugs"] == 1 and s["bug_examples"][0]["position"] == 6


def test_a_divergence_beyond_the_margin_is_rounding_only_if_the_fp32_replay_agrees_with_ar(tiny_target):
    logits_at = fp32_logits_at(tiny_target)
    prompt = [5, 17, 42, 99, 3]
    ar = greedy(tiny_target, prompt, 8)
    bad = list(ar)
    bad[4] = int(logits_at(prompt + ar[:4]).argmin())
    calls = []

    def replay_says(verdict):
        def replay(prompt_ids, n):
            calls.append((prompt_ids, n))
            return verdict
        return replay

    agrees = classify("p", 0, prompt, ar, bad, logits_at, replay=replay_says("identical"))
    assert calls == [(prompt, 5)]  # decode through the divergence at position 4
    assert not agrees.near_tie and agrees.fp32_replay == "identical" and agrees.rounding
    differs = classify("p", 0, prompt, ar, bad, logits_at, replay=replay_says("differs"))
    failed = classify("p", 0, prompt, ar, bad, logits_at, replay=replay_says("failed: RuntimeError: x"))
    assert not differs.rounding and not failed.rounding
    s = lossless_summary(10, [agrees, differs, failed])
    assert s["not_near_tie"] == 3 and s["fp32_replay_identical"] == 1 and s["bugs"] == 2
    assert s["identical_or_near_tie"] == 0.7 and s["identical_or_rounding"] == 0.8
    assert [e["fp32_replay"] for e in s["bug_examples"]] == ["differs", "failed: RuntimeError: x"]
    calls.clear()
    near = classify("p", 0, [1], [4, 3], [4, 7], lambda prefix: torch.tensor([0.0, 0, 0, 1.0, 0, 0, 0, 1.0]),
                    replay=replay_says("differs"))
    assert near.near_tie and near.rounding and near.fp32_replay is None and calls == []  # a near-tie is not replayed


def test_fp32_replay_compares_ar_and_the_method_token_for_token_and_reports_a_replay_that_fails(tiny_target):
    """fp32_replay runs eval.engine.decode.decode's calls: AR and the method through n tokens; equal outputs -> identical."""
    from eval.engine.decode import decode

    prompt = [5, 17, 42, 99, 3]
    seen = []

    def decode_with_a_wrong_method_token(method, target, drafter, ids, **kw):
        seen.append((method, kw["max_new_tokens"], kw.get("budget")))
        out = decode("ar", target, None, ids, max_new_tokens=kw["max_new_tokens"], phase_timing=False)
        if method != "ar":
            out.output_ids[-1] = (out.output_ids[-1] + 1) % 100
        return out

    assert fp32_replay(decode, tiny_target, None, "ar", None)(prompt, 6) == "identical"
    assert fp32_replay(decode_with_a_wrong_method_token, tiny_target, None, "ddtree", 8)(prompt, 6) == "differs"
    assert seen == [("ar", 6, None), ("ddtree", 6, 8)]
    assert fp32_replay(decode, tiny_target, None, "chain", None)(prompt, 6).startswith("failed: ValueError: method "
                                                                                       "'chain' needs a drafter")


def test_a_divergence_between_two_almost_equal_logits_is_a_near_tie():
    def logits_at(prefix):
        logits = torch.full((10,), -5.0)
        logits[3], logits[7] = 2.0, 2.0 - NEAR_TIE_MARGIN / 10  # 3 and 7 nearly tied
        return logits

    d = classify("p", 1, [1, 2], [4, 3, 0], [4, 7, 0], logits_at)
    assert d.position == 1 and d.near_tie and d.gap == pytest.approx(NEAR_TIE_MARGIN / 10)
    s = lossless_summary(2, [d])
    assert s["identical"] == 0.5 and s["identical_or_near_tie"] == 1.0 and s["not_near_tie_examples"] == []


def test_a_response_that_stops_early_is_judged_by_whether_its_last_choice_was_the_argmax():
    def logits_at(prefix):
        logits = torch.zeros(10)
        logits[8] = 3.0
        return logits

    assert classify("p", 0, [1], [8, 8], [8], logits_at).near_tie       # AR continued with the argmax
    assert not classify("p", 0, [1], [8, 2], [8], logits_at).near_tie   # AR continued with a non-argmax token
