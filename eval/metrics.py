"""Speculative-decoding metrics over decoded responses (definitions: docs/tree.md, "Metrics").

One `ResponseRecord` per generated response (one per MT-Bench turn). Per verify round it holds

    accept_lengths[r] = τ_r = 1 + accepted drafted tokens   (the bonus/root token counts: 1 <= τ_r <= B)
    draft_depths[r]   = deepest drafted depth offered that round (chain: B-1; DDTree: the tree's depth)

Every function here is pure: lists of records in, numbers out.

    τ per-response mean  = mean_responses( mean_rounds τ_r )        (the papers' number, make_latex_table.py)
    τ pooled             = Σ τ_r / #rounds over all responses        (long responses weigh more)
    per-depth acceptance = P(depth k accepted | depth k reached and offered)   (conditional)
                           and accepted_k / drafting rounds                  (unconditional, as vLLM reports it)
    time per output token (TPOT) = mean_responses( decode_seconds / num_new_tokens )  (prefill excluded)
    speedup              = TPOT(AR) / TPOT(method), AR measured in the same run
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Sequence

PHASES = ("draft", "tree_build", "verify", "walk_commit")


@dataclass
class ResponseRecord:
    """What the eval stage keeps of one decoded response (JSON-serialisable, one line per response)."""

    prompt_id: str
    turn: int  # 0-based user turn (MT-Bench has 2)
    prompt_tokens: int
    num_new_tokens: int
    num_rounds: int
    accept_lengths: list[int]  # τ per round, bonus included
    draft_depths: list[int]  # drafted depth offered per round (0 for AR)
    decode_seconds: float  # decode wall time after prefill
    prefill_seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds, summed over rounds
    output_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ResponseRecord":
        """The record of `d` (its own keys; others, of a newer writer, are left out)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def tau_per_response_mean(records: Iterable[ResponseRecord]) -> float:
    """Mean over responses of each response's mean τ (responses without rounds are left out)."""
    return _mean([_mean(r.accept_lengths) for r in records if r.accept_lengths])


def tau_pooled(records: Iterable[ResponseRecord]) -> float:
    """Σ τ over every round of every response ÷ number of rounds."""
    taus = [t for r in records for t in r.accept_lengths]
    return _mean(taus)


def accepted_length_histogram(records: Iterable[ResponseRecord], max_tau: int) -> list[int]:
    """counts[t] = rounds with τ = t, for t in 0..max_tau (counts[0] is always 0: τ >= 1).

    τ above `max_tau` is a caller bug (τ <= block size), so it raises instead of being clipped.
    """
    counts = [0] * (max_tau + 1)
    for r in records:
        for t in r.accept_lengths:
            if not 1 <= t <= max_tau:
                raise ValueError(f"{r.prompt_id}: τ={t} outside 1..{max_tau}")
            counts[t] += 1
    return counts


def per_depth_acceptance(records: Iterable[ResponseRecord], max_depth: int) -> list[dict]:
    """Acceptance at draft depth k = 1..max_depth, both ways.

    A round with a accepted drafts (τ = a + 1) and offered depth d *reached* depth k iff a >= k-1 and d >= k
    (the walk stood at depth k-1 and a depth-k draft existed); it *accepted* depth k iff a >= k.
    rate_k = accepted_k / reached_k: conditional, P(accept k | reached k) (NaN when no round reached depth k).
    unconditional_k = accepted_k / drafting rounds (rounds that offered depth >= 1): the share of rounds whose
    accepted length reached k — vLLM's spec_decode_num_accepted_tokens_per_pos[k-1] / spec_decode_num_drafts.
    """
    reached = [0] * (max_depth + 1)
    accepted = [0] * (max_depth + 1)
    rounds = 0
    for r in records:
        for tau, depth in zip(r.accept_lengths, r.draft_depths):
            a = tau - 1
            rounds += depth >= 1
            for k in range(1, min(depth, max_depth) + 1):
                if a >= k - 1:
                    reached[k] += 1
                    accepted[k] += a >= k
    return [
        {"depth": k, "reached": reached[k], "accepted": accepted[k],
         "rate": accepted[k] / reached[k] if reached[k] else math.nan,
         "unconditional": accepted[k] / rounds if rounds else math.nan}
        for k in range(1, max_depth + 1)
    ]


def time_per_output_token(records: Iterable[ResponseRecord]) -> float:
    """Mean over responses of decode seconds per generated token (prefill excluded)."""
    return _mean([r.decode_seconds / r.num_new_tokens for r in records if r.num_new_tokens > 0])


def tokens_per_second(records: Iterable[ResponseRecord]) -> float:
    tpot = time_per_output_token(records)
    return 1.0 / tpot if tpot and not math.isnan(tpot) else math.nan


def speedup(ar_records: Iterable[ResponseRecord], method_records: Iterable[ResponseRecord]) -> float:
    """AR time per output token ÷ method time per output token (> 1 means the method is faster)."""
    ar, m = time_per_output_token(ar_records), time_per_output_token(method_records)
    return ar / m if m and not (math.isnan(ar) or math.isnan(m)) else math.nan


def phase_split(records: Iterable[ResponseRecord]) -> dict[str, dict[str, float]] | None:
    """Seconds per decode phase summed over all rounds, and each phase's share of their sum; None when no record
    was timed per phase (eval.phase_timing off): an unmeasured split is left out, never reported as zeros."""
    records = [r for r in records if r.phase_seconds]
    if not records:
        return None
    seconds = {p: float(sum(r.phase_seconds.get(p, 0.0) for r in records)) for p in PHASES}
    total = sum(seconds.values())
    return {p: {"seconds": s, "share": s / total if total > 0 else math.nan} for p, s in seconds.items()}


def summarize(records: Sequence[ResponseRecord], *, max_tau: int) -> dict:
    """Every number of one (benchmark, method, budget) cell, JSON-ready (NaN for undefined values)."""
    records = list(records)
    return {
        "responses": len(records),
        "rounds": sum(r.num_rounds for r in records),
        "new_tokens": sum(r.num_new_tokens for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "tau_mean": tau_per_response_mean(records),
        "tau_pooled": tau_pooled(records),
        "histogram": accepted_length_histogram(records, max_tau),
        "per_depth": per_depth_acceptance(records, max_tau - 1),
        "decode_seconds": float(sum(r.decode_seconds for r in records)),
        "prefill_seconds": float(sum(r.prefill_seconds for r in records)),
        "time_per_output_token": time_per_output_token(records),
        "tokens_per_second": tokens_per_second(records),
        "phases": phase_split(records),
    }


def tau_vs_budget(cells: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    """benchmark -> [(budget, τ per-response mean)] sorted by budget, from summary cells of DDTree runs.

    Each cell is a dict with `benchmark`, `method`, `budget` and `tau_mean` (as in report.json `cells`).
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for c in cells:
        if c["method"] == "ddtree" and c.get("budget") is not None:
            out.setdefault(c["benchmark"], []).append((int(c["budget"]), float(c["tau_mean"])))
    return {b: sorted(v) for b, v in out.items()}
