"""Overlap between evaluation prompts and the training set: exact and near-duplicate contamination.

A drafter trained on the very prompts it is scored on reports a τ no user will see. Each eval prompt's content
(its user turns without the benchmark's format wrapper such as GSM8K's "put your final answer within \\boxed{}",
normalized as curate's dedup does it) is cut into curate's word 3-gram shingles (`pipeline.curate.dedup`). For a
training conversation t (its system + user turns, as curate's dedup text), the containment of eval prompt e is

    c(e, t) = |S_e ∩ S_t| / |S_e|        S = set of 3-gram shingle hashes

i.e. the share of the eval prompt's word 3-grams that also occur in the training prompt (containment, not Jaccard:
a training prompt that wraps the eval question in extra text — as `regen.prompt_formats` does — still contains it).
    exact  c = 1   (every 3-gram of the eval content occurs in one training prompt)
    near   NEAR_CONTAINMENT <= c < 1
The training side is streamed shard by shard; only conversations that share enough shingles with some eval prompt
are compared exactly, so the cost is one shingle pass over the training prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow.parquet as pq

from pipeline.curate.dedup import dedup_text, normalize, shingle_hashes
from pipeline.stage_dir import StageDir

NEAR_CONTAINMENT = 0.8
BATCH_ROWS = 8192  # training conversations shingled at once


@dataclass(frozen=True)
class OverlapHit:
    eval_id: str
    train_id: str
    containment: float

    @property
    def kind(self) -> str:
        return "exact" if self.containment >= 1.0 else "near"


def shingle_set(text: str) -> set[int]:
    hashes, _ = shingle_hashes([text])
    return set(hashes.tolist())


def eval_shingles(content_turns: Iterable[str]) -> set[int]:
    """The shingles of an eval prompt's content (its user turns without the benchmark's format wrapper,
    `eval.prompts.format_content`), normalized as curate's dedup text."""
    return shingle_set("\n".join(normalize(t) for t in content_turns))


def training_prompts(curate: StageDir, shards: Iterable[Path]) -> Iterator[tuple[list[str], list[str]]]:
    """(ids, dedup texts) of the training conversations in `curate`'s `shards`, in batches of at most BATCH_ROWS
    (a damaged shard: a DamagedFile naming it)."""
    for shard in shards:
        with curate.reading_shard(shard):
            batches = pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["id", "messages"])
        while True:
            with curate.reading_shard(shard):
                batch = next(batches, None)
                rows = batch.to_pylist() if batch is not None else None
            if rows is None:
                break
            yield [r["id"] for r in rows], [dedup_text(r["messages"] or []) for r in rows]


def find_overlap(eval_sets: dict[str, set[int]], train_batches: Iterable[tuple[list[str], list[str]]],
                 threshold: float = NEAR_CONTAINMENT) -> list[OverlapHit]:
    """Every (eval prompt, training conversation) pair with containment >= threshold, best first per eval prompt.

    eval_sets: eval prompt id -> content shingles (`eval_shingles`); prompts without shingles are skipped.
    A training conversation that shares fewer shingles with all eval prompts together than the threshold asks of
    the smallest eval prompt is passed over; for the others, an inverted index (shingle -> eval prompts holding it)
    counts |S_e ∩ S_t| for just the eval prompts the conversation touches. `find_overlap_reference` is the same
    result by intersecting every pair."""
    eval_sets = {k: v for k, v in eval_sets.items() if v}
    if not eval_sets:
        return []
    index: dict[int, list[str]] = {}
    for eval_id, s in eval_sets.items():
        for h in s:
            index.setdefault(h, []).append(eval_id)
    every = np.fromiter(index, dtype=np.uint32)
    every.sort()
    need = max(1, int(np.ceil(threshold * min(len(v) for v in eval_sets.values()))))
    hits: list[OverlapHit] = []
    for ids, texts in train_batches:
        hashes, offsets = shingle_hashes(texts)
        shared = np.isin(hashes, every, assume_unique=False)
        per_doc = np.add.reduceat(shared.astype(np.int64), offsets[:-1]) if len(texts) else np.zeros(0)
        for d in np.flatnonzero(per_doc >= need):
            lo, hi = offsets[d], offsets[d + 1]
            counts: dict[str, int] = {}
            for h in set(hashes[lo:hi][shared[lo:hi]].tolist()):  # each shared shingle once: S_t is a set
                for eval_id in index[h]:
                    counts[eval_id] = counts.get(eval_id, 0) + 1
            for eval_id, n in counts.items():
                c = n / len(eval_sets[eval_id])
                if c >= threshold:
                    hits.append(OverlapHit(eval_id, ids[d], round(c, 4)))
    hits.sort(key=lambda h: (h.eval_id, -h.containment, h.train_id))
    return hits


def find_overlap_reference(eval_sets: dict[str, set[int]], train_batches: Iterable[tuple[list[str], list[str]]],
                           threshold: float = NEAR_CONTAINMENT) -> list[OverlapHit]:
    """`find_overlap` by its definition: c(e, t) = |S_e ∩ S_t| / |S_e| for every pair (tests, small inputs)."""
    hits = []
    for ids, texts in train_batches:
        hashes, offsets = shingle_hashes(texts)
        for d, train_id in enumerate(ids):
            train = set(hashes[offsets[d]:offsets[d + 1]].tolist())
            for eval_id, s in eval_sets.items():
                c = len(s & train) / len(s) if s else 0.0
                if s and c >= threshold:
                    hits.append(OverlapHit(eval_id, train_id, round(c, 4)))
    hits.sort(key=lambda h: (h.eval_id, -h.containment, h.train_id))
    return hits


def summarize_overlap(hits: list[OverlapHit], *, eval_prompts: int, train_conversations: int | None,
                      against: str, examples: int = 10) -> dict:
    """report.json's `overlap` block: eval prompts with an exact / near duplicate in the training set."""
    best: dict[str, OverlapHit] = {}
    for h in hits:
        if h.eval_id not in best or h.containment > best[h.eval_id].containment:
            best[h.eval_id] = h
    exact = sorted(k for k, h in best.items() if h.kind == "exact")
    near = sorted(k for k, h in best.items() if h.kind == "near")
    return {
        "against": against, "train_conversations": train_conversations, "eval_prompts": eval_prompts,
        "threshold": NEAR_CONTAINMENT, "exact": len(exact), "near": len(near),
        "examples": [{"eval_id": h.eval_id, "train_id": h.train_id, "containment": h.containment, "kind": h.kind}
                     for h in sorted(best.values(), key=lambda h: -h.containment)[:examples]],
    }
