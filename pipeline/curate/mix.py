"""Held-out split and mixture: which unique conversations go to eval, which to train and how often.

Shares: with `curate.total` set, source i's share is weight_i / sum(weights); without it (keep
everything) the share is its number of unique conversations. Counts are apportioned with the largest
remainder method, so they sum exactly to the requested size.

1. eval: `eval_size` conversations, apportioned by share (a source never gives more than it has),
   drawn at random from each source's unique conversations -- before mixing, so no eval conversation
   (nor any copy of it) is ever trained on.
2. train: the rest. With `total` unset, all of it. Otherwise source i contributes round(total * share_i):
   fewer than it has -> a random subset (down-sampling); more -> every conversation q times plus a random
   r more (up-sampling, q, r = divmod(target, available)); copy k > 0 gets id `<id>#r<k>`. Sources with
   nothing left give their share to the others.
3. the train and eval lists are shuffled.

Every random draw comes from `rng(seed, purpose, source)`: the same config and seed give the same
selection, another seed another one, and adding a source does not change the draws of the others.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np


def rng(seed: int, *tags: str) -> np.random.Generator:
    """A generator keyed by the run seed and string tags (stable across processes and runs)."""
    return np.random.default_rng([seed, *(zlib.crc32(t.encode()) for t in tags)])


def apportion(total: int, shares: list[float], caps: list[int] | None = None) -> list[int]:
    """Integers proportional to `shares` summing to `total` (largest remainder, ties to the earlier
    source). With `caps`, no count exceeds its cap; what a capped source cannot take goes to the
    others by the same rule. The sum is min(total, sum(caps)) when capped."""
    n = len(shares)
    counts = [0] * n
    caps = list(caps) if caps is not None else [None] * n
    open_ = [i for i in range(n) if shares[i] > 0 and (caps[i] is None or caps[i] > 0)]
    remaining = total
    while remaining > 0 and open_:
        weight = sum(shares[i] for i in open_)
        exact = [remaining * shares[i] / weight for i in open_]
        base = [int(x) for x in exact]
        left = remaining - sum(base)
        order = sorted(range(len(open_)), key=lambda j: (-(exact[j] - base[j]), j))
        for j in order[:left]:
            base[j] += 1
        overflow = False
        for j, i in enumerate(open_):
            room = None if caps[i] is None else caps[i] - counts[i]
            give = base[j] if room is None else min(base[j], room)
            overflow |= give < base[j]
            counts[i] += give
        remaining = total - sum(counts)
        open_ = [i for i in open_ if caps[i] is None or counts[i] < caps[i]]
        if not overflow:
            break
    return counts


@dataclass
class SourceMix:
    """What the mixture did with one source (reported per source)."""

    name: str
    unique: int = 0           # unique conversations after cleaning and dedup
    eval: int = 0             # held out
    available: int = 0        # unique - eval
    target: int = 0           # train rows asked of this source
    selected_unique: int = 0  # distinct conversations in train
    repeats: int = 0          # extra copies (up-sampling)
    not_selected: int = 0     # left out (down-sampling)

    @property
    def factor(self) -> float:
        return self.target / self.available if self.available else 0.0


@dataclass
class Selection:
    """Rows of the work pool chosen for train and eval, in output order.

    train_rows/eval_rows: global work-row indices; train_copy: copy number (0 = original, k -> `#r<k>`).
    """

    train_rows: np.ndarray
    train_copy: np.ndarray
    eval_rows: np.ndarray
    sources: list[SourceMix] = field(default_factory=list)


def select(pools: list[np.ndarray], names: list[str], weights: list[float], *, total: int | None,
           eval_size: int, seed: int) -> Selection:
    """Eval split, then mixture, then shuffle. `pools[i]`: global row indices of source i's unique
    conversations (ascending)."""
    unique = [len(p) for p in pools]
    mixes = [SourceMix(name=n, unique=u) for n, u in zip(names, unique)]
    if total is None:
        shares = [float(u) for u in unique]
    else:
        shares = [w if u > 0 else 0.0 for w, u in zip(weights, unique)]

    eval_counts = apportion(eval_size, shares, caps=unique)
    eval_parts, rest = [], []
    for i, pool in enumerate(pools):
        pick = np.zeros(len(pool), dtype=bool)
        pick[rng(seed, "eval", names[i]).choice(len(pool), eval_counts[i], replace=False)] = True
        eval_parts.append(pool[pick])
        rest.append(pool[~pick])
        mixes[i].eval = eval_counts[i]
        mixes[i].available = len(pool) - eval_counts[i]

    available = [len(r) for r in rest]
    if total is None:
        targets = available
    else:
        targets = apportion(total, [s if a > 0 else 0.0 for s, a in zip(shares, available)])
    rows, copies = [], []
    for i, pool in enumerate(rest):
        r, c = _sample(pool, targets[i], rng(seed, "mix", names[i]))
        rows.append(r)
        copies.append(c)
        m = mixes[i]
        m.target = targets[i]
        m.selected_unique = int((c == 0).sum())
        m.repeats = int((c > 0).sum())
        m.not_selected = m.available - m.selected_unique

    train_rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    train_copy = np.concatenate(copies) if copies else np.zeros(0, np.int64)
    order = rng(seed, "shuffle", "train").permutation(len(train_rows))
    eval_rows = np.concatenate(eval_parts) if eval_parts else np.zeros(0, np.int64)
    eval_rows = eval_rows[rng(seed, "shuffle", "eval").permutation(len(eval_rows))]
    return Selection(train_rows[order], train_copy[order], eval_rows, mixes)


def _sample(pool: np.ndarray, target: int, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(rows, copy numbers) of `target` draws from `pool`: without replacement while target <= len(pool),
    else every row q times plus r distinct extra rows."""
    n = len(pool)
    if target <= n:
        keep = np.sort(gen.choice(n, target, replace=False))
        return pool[keep], np.zeros(target, dtype=np.int64)
    q, r = divmod(target, n)
    extra = np.sort(gen.choice(n, r, replace=False))
    rows = np.concatenate([np.tile(pool, q), pool[extra]])
    copy = np.concatenate([np.repeat(np.arange(q, dtype=np.int64), n), np.full(r, q, dtype=np.int64)])
    return rows, copy
