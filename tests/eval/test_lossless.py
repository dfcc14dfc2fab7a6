"""The lossless check: the first divergence from AR is found, recomputed in fp32 and classified — a planted
divergence to a low-probability token is flagged as a bug, a near-tie as rounding, identical output as identical."""

from __future__ import annotations

import pytest
import torch

from eval.lossless import NEAR_TIE_MARGIN, classify, first_divergence, fp32_logits_at, lossless_summary
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
    assert d.gap > 1.0 and not d.near_tie
    s = lossless_summary(4, [d])
    assert s["identical"] == 0.75 and s["identical_or_near_tie"] == 0.75 and s["not_near_tie"] == 1


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
