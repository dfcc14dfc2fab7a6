"""eval.metrics on hand-built responses: every expected number below is computed by hand in the comment."""

from __future__ import annotations

import math

import pytest

from eval.metrics import (
    ResponseRecord,
    accepted_length_histogram,
    per_depth_acceptance,
    phase_split,
    speedup,
    summarize,
    tau_per_response_mean,
    tau_pooled,
    tau_vs_budget,
    time_per_output_token,
    tokens_per_second,
)


def rec(taus, *, depth=7, tokens=None, decode=1.0, phases=None, pid="p"):
    tokens = sum(taus) if tokens is None else tokens
    return ResponseRecord(
        prompt_id=pid, turn=0, prompt_tokens=10, num_new_tokens=tokens, num_rounds=len(taus),
        accept_lengths=list(taus), draft_depths=[depth] * len(taus), decode_seconds=decode,
        prefill_seconds=0.1, phase_seconds=phases or {},
    )


def test_pooled_tau_weighs_long_responses_more_than_the_per_response_mean():
    # response A: 4 rounds of τ=2 (mean 2); response B: 1 round of τ=8 (mean 8)
    a, b = rec([2, 2, 2, 2]), rec([8])
    assert tau_per_response_mean([a, b]) == pytest.approx((2 + 8) / 2)  # 5.0
    assert tau_pooled([a, b]) == pytest.approx((2 * 4 + 8) / 5)  # 16 / 5 = 3.2


def test_taus_agree_when_every_response_has_the_same_number_of_rounds():
    a, b = rec([1, 3]), rec([5, 7])
    assert tau_per_response_mean([a, b]) == pytest.approx(4.0)
    assert tau_pooled([a, b]) == pytest.approx(4.0)


def test_response_without_rounds_is_left_out_of_tau():
    assert tau_per_response_mean([rec([3]), rec([], tokens=0)]) == pytest.approx(3.0)
    assert math.isnan(tau_pooled([]))


def test_histogram_counts_rounds_per_tau_with_slot_zero_empty():
    h = accepted_length_histogram([rec([1, 3, 3]), rec([8, 1])], max_tau=8)
    assert h == [0, 2, 0, 2, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="outside 1..8"):
        accepted_length_histogram([rec([9])], max_tau=8)


def test_per_depth_acceptance_is_conditional_on_reaching_the_depth():
    # chain, offered depth 3. rounds: a = τ-1 = 0, 1, 3, 3
    # depth 1: reached by all 4, accepted by a>=1: 3        -> 3/4
    # depth 2: reached by a>=1: 3, accepted by a>=2: 2      -> 2/3
    # depth 3: reached by a>=2: 2, accepted by a>=3: 2      -> 1
    rows = per_depth_acceptance([rec([1, 2, 4, 4], depth=3)], max_depth=3)
    assert [(r["reached"], r["accepted"]) for r in rows] == [(4, 3), (3, 2), (2, 2)]
    assert [r["rate"] for r in rows] == pytest.approx([0.75, 2 / 3, 1.0])


def test_per_depth_acceptance_ignores_depths_the_draft_did_not_offer():
    # one round with a tree of depth 2 fully accepted (τ=3), one chain round of depth 4 with a=1
    r1 = rec([3], depth=2)
    r2 = rec([2], depth=4)
    rows = per_depth_acceptance([r1, r2], max_depth=4)
    # depth1: reached 2, accepted 2; depth2: reached 2, accepted 1 (r1); depth3: reached 0 (r1 offered none,
    # r2 stopped at depth 1) -> NaN; depth4: NaN
    assert [(r["reached"], r["accepted"]) for r in rows] == [(2, 2), (2, 1), (0, 0), (0, 0)]
    assert math.isnan(rows[2]["rate"]) and math.isnan(rows[3]["rate"])


def test_speedup_is_ar_time_per_token_over_method_time_per_token():
    # AR: 100 tokens in 2.0 s and 50 tokens in 1.5 s -> TPOT mean(0.02, 0.03) = 0.025
    ar = [rec([1] * 100, decode=2.0), rec([1] * 50, decode=1.5)]
    # method: 100 tokens in 0.5 s, 50 tokens in 0.5 s -> TPOT mean(0.005, 0.01) = 0.0075
    m = [rec([4] * 25, decode=0.5), rec([5] * 10, decode=0.5)]
    assert time_per_output_token(ar) == pytest.approx(0.025)
    assert tokens_per_second(m) == pytest.approx(1 / 0.0075)
    assert speedup(ar, m) == pytest.approx(0.025 / 0.0075)  # 3.333...
    assert math.isnan(speedup([], m))


def test_phase_split_sums_rounds_and_gives_shares():
    ph1 = {"draft": 1.0, "tree_build": 0.5, "verify": 2.0, "walk_commit": 0.5}
    ph2 = {"draft": 1.0, "tree_build": 0.5, "verify": 2.0, "walk_commit": 0.5}
    split = phase_split([rec([2], phases=ph1), rec([2], phases=ph2)])
    assert split["verify"]["seconds"] == pytest.approx(4.0)
    assert split["verify"]["share"] == pytest.approx(0.5)
    assert split["tree_build"]["share"] == pytest.approx(0.125)
    assert sum(v["share"] for v in split.values()) == pytest.approx(1.0)
    assert phase_split([rec([2]), rec([3])]) is None  # phase timing off: no split at all, not a split of zeros


def test_summarize_reports_every_number_of_a_cell():
    s = summarize([rec([2, 2, 2, 2], decode=0.8), rec([8], decode=0.8)], max_tau=8)
    assert s["responses"] == 2 and s["rounds"] == 5 and s["new_tokens"] == 16
    assert s["tau_mean"] == pytest.approx(5.0) and s["tau_pooled"] == pytest.approx(3.2)
    assert s["histogram"][2] == 4 and s["histogram"][8] == 1
    assert len(s["per_depth"]) == 7
    assert s["time_per_output_token"] == pytest.approx(0.1)


def test_tau_vs_budget_orders_ddtree_cells_by_budget():
    cells = [
        {"benchmark": "gsm8k", "method": "ddtree", "budget": 64, "tau_mean": 3.0},
        {"benchmark": "gsm8k", "method": "chain", "budget": None, "tau_mean": 2.0},
        {"benchmark": "gsm8k", "method": "ddtree", "budget": 16, "tau_mean": 2.5},
    ]
    assert tau_vs_budget(cells) == {"gsm8k": [(16, 2.5), (64, 3.0)]}
