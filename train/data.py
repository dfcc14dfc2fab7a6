"""Training data: held-out split, length-balanced micro-batches over ranks, anchors per epoch, prefetching.

A *source* is anything with `ids: list[str]`, `lengths: np.ndarray[int64]` and `sample(i) -> {"id", "input_ids",
"loss_mask"[, "features"]}`: `extract.store.FeatureReader` (offline) or `train.online.TokenizedReader` (online).

The plan of an epoch is a pure function of (lengths, train indices, seed, epoch, token budget, world size,
grad_accum), so every rank computes the same plan without talking, and a resumed run recomputes it and skips to
(epoch, step in epoch):

    order     = permutation(seed, epoch) of the train indices
    bins      = best-fit-decreasing packing of windows of `order` into micro-batches of <= micro_batch_tokens
                tokens (a sample longer than the budget gets a micro-batch of its own), bins shuffled
    steps     = consecutive groups of world_size * grad_accum bins; inside a step, bins go to ranks
                longest-processing-time first (each rank gets grad_accum of them, token totals balanced)
    tail      = if the bin count is not a multiple of world_size * grad_accum, the fullest bins are split;
                if that is not enough, *padding* micro-batches (no valid block, loss weight 0) fill the last
                step so every rank runs the same number of forwards (collectives stay matched)

Every train sample appears in exactly one non-padding micro-batch of one rank per epoch (disjoint, complete).
Anchors are drawn per sample from a generator seeded by (seed, epoch, sample id): re-drawn every epoch,
identical on resume and independent of which rank or worker loads the sample.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from pipeline.sample_ids import prompt_id
from dflash_model.blocks import BlockBatch, build_block_batch, sample_anchors
from train.preempt import ignore_in_worker

EVAL_EPOCH = -1  # the anchor "epoch" of held-out evaluation: the same anchors at every eval


# ----------------------------------------------------------------------------------------------
# Held-out split and seeds
# ----------------------------------------------------------------------------------------------


def _unit_hash(text: str) -> float:
    """A stable uniform number in [0, 1) from a string (sha256; independent of process and platform)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def _prompt_hashes(ids: Sequence[str], salt: str) -> np.ndarray:
    """float64 [len(ids)]: `_unit_hash` of each sample's prompt (`prompt_id`) under `salt`: every sample of one
    prompt gets the same number, and each salt draws independently of the others."""
    return np.array([_unit_hash(f"{salt}/{prompt_id(i)}") for i in ids], dtype=np.float64)


def heldout_split(ids: Sequence[str], fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices): sample i is held out iff hash(prompt_id(id)) < fraction.

    Depends only on the id, so the split is the same for offline and online mode and for any data order; every
    sample made from one curated conversation (its repeats, its sampled responses, its turn splits:
    pipeline/sample_ids.py) shares that hash, so no held-out sample shares its prompt with a training sample.
    With fraction > 0 and at least two samples, at least one sample is held out (the smallest hash).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"train.eval_fraction must be in [0, 1), got {fraction}")
    h = _prompt_hashes(ids, "heldout")
    held = h < fraction
    if fraction > 0 and not held.any() and len(ids) >= 2:
        held[int(np.argmin(h))] = True
    idx = np.arange(len(ids))
    return idx[~held], idx[held]


def data_subset(ids: Sequence[str], train_idx: np.ndarray, fraction: float) -> tuple[np.ndarray, int]:
    """(the training indices kept, how many were left out) for `train.data_fraction`: sample i stays iff
    hash(prompt_id(id)) < fraction, under a hash of its own (independent of the held-out split, which it never
    touches). Every sample of one prompt stays or goes together, the subset of a smaller fraction lies inside that
    of a larger one (a data-size curve trains on nested sets), and fraction 1 keeps everything."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"train.data_fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0:
        return train_idx, 0
    keep = _prompt_hashes([ids[i] for i in train_idx], "subset") < fraction
    return train_idx[keep], int((~keep).sum())


def anchor_seed(seed: int, epoch: int, sample_id: str) -> int:
    """Seed of the anchor generator of one sample in one epoch."""
    return int.from_bytes(hashlib.sha256(f"anchors/{seed}/{epoch}/{sample_id}".encode()).digest()[:8], "big") >> 1


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    indices: tuple[int, ...]  # source indices packed into this micro-batch (empty for padding)
    tokens: int  # sum of their lengths

    @property
    def padding(self) -> bool:
        return not self.indices


Step = tuple[tuple[MicroBatch, ...], ...]  # [rank][accumulation index]
PADDING = MicroBatch((), 0)
PACK_WINDOW = 4096  # samples sorted and packed together (long enough to pair long with short samples)


def pack(lengths: np.ndarray, order: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit decreasing: pack `order` (source indices) into bins of total length <= budget, in windows of
    PACK_WINDOW samples. A sample longer than `budget` gets its own bin."""
    bins: list[list[int]] = []
    order = list(order)
    for w in range(0, len(order), PACK_WINDOW):
        window = sorted(order[w : w + PACK_WINDOW], key=lambda i: (-int(lengths[i]), i))
        room: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id) of bins opened in this window
        for i in window:
            n = int(lengths[i])
            k = bisect.bisect_left(room, (n, -1))
            if k < len(room):
                cap, b = room.pop(k)
                bins[b].append(i)
                if cap - n > 0:
                    bisect.insort(room, (cap - n, b))
            else:
                bins.append([i])
                if budget - n > 0:
                    bisect.insort(room, (budget - n, len(bins) - 1))
    return bins


def _split_to_multiple(bins: list[list[int]], multiple: int) -> list[list[int]]:
    """Split the bins holding the most samples until the count is a multiple of `multiple` (if possible)."""
    bins = [list(b) for b in bins]
    while len(bins) % multiple:
        k = max(range(len(bins)), key=lambda j: (len(bins[j]), -j), default=None)
        if k is None or len(bins[k]) < 2:
            break
        b = bins.pop(k)
        bins[k:k] = [b[0::2], b[1::2]]
    return bins


def _assign(bins: list[list[int]], lengths: np.ndarray, world_size: int, per_rank: int) -> list[Step]:
    """Group bins into steps of world_size*per_rank; inside a step, longest-first to the least-loaded rank."""
    mbs = [MicroBatch(tuple(int(i) for i in b), int(sum(int(lengths[i]) for i in b))) for b in bins]
    size = world_size * per_rank
    if len(mbs) % size:
        mbs += [PADDING] * (size - len(mbs) % size)
    steps = []
    for s in range(0, len(mbs), size):
        group = sorted(mbs[s : s + size], key=lambda m: -m.tokens)
        ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
        load = [0] * world_size
        for mb in group:
            r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
            ranks[r].append(mb)
            load[r] += mb.tokens
        steps.append(tuple(tuple(r) for r in ranks))
    return steps


def plan_epoch(lengths: np.ndarray, train_idx: np.ndarray, *, budget: int, world_size: int, grad_accum: int,
               seed: int, epoch: int) -> list[Step]:
    """The optimizer steps of one epoch (module docstring): steps[s][rank] = grad_accum micro-batches."""
    if budget < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {budget}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(np.asarray(train_idx, dtype=np.int64))
    bins = pack(lengths, order, budget)
    bins = [bins[k] for k in rng.permutation(len(bins))]
    bins = _split_to_multiple(bins, world_size * grad_accum)
    return _assign(bins, lengths, world_size, grad_accum)


def plan_eval(lengths: np.ndarray, eval_idx: np.ndarray, *, budget: int, world_size: int) -> list[Step]:
    """Held-out micro-batches, one per rank per eval step (padding where ranks run out)."""
    bins = pack(lengths, sorted(int(i) for i in eval_idx), budget)
    return _assign(_split_to_multiple(bins, world_size), lengths, world_size, 1)


def total_steps(plan_len: Callable[[int], int], epochs: float, max_steps: int | None) -> int:
    """Optimizer steps of the whole run: `max_steps`, else full epochs plus the fraction of the last one."""
    if max_steps is not None:
        return int(max_steps)
    whole = int(math.floor(epochs))
    total = sum(plan_len(e) for e in range(whole))
    if epochs > whole:
        total += int(math.floor((epochs - whole) * plan_len(whole)))
    return max(total, 1)


def rank_micro_batches(plan: list[Step], rank: int, start_step: int = 0) -> list[MicroBatch]:
    """This rank's micro-batches from `start_step` on, flattened (step-major, accumulation-minor)."""
    return [mb for step in plan[start_step:] for mb in step[rank]]


@dataclass
class RunPlan:
    """The data side of one training run, computed identically on every rank from the sample ids and lengths:
    which samples train and which are held out, every epoch's steps, the total step count and the held-out steps.

    Samples no longer than one block (`<= block_size` tokens: no anchor fits) are dropped from both sides and
    counted in `too_short`; so are samples with fewer supervised tokens than `min_loss_tokens`
    (`RunConfig.min_loss_tokens`: two drafter blocks unless `tokenize.min_loss_tokens` says otherwise), counted in
    `too_few_loss_tokens`. With `data_fraction` < 1 the training side keeps that share of its prompts
    (`data_subset`; the rest counted in `left_out`) and the held-out side stays as it is, so runs at several data
    sizes are scored on the same samples. That rule lives here, not in tokenize, so that a drafter setting never
    changes the data stages' outputs. `state()` holds the fields a checkpoint must match to resume exactly
    (train/checkpoint.py RESUME_FIELDS)."""

    lengths: np.ndarray  # int64 [num samples] tokens per sample
    train_idx: np.ndarray  # source indices trained on
    eval_idx: np.ndarray  # held-out source indices (never trained on)
    too_short: int
    too_few_loss_tokens: int
    left_out: int  # training samples outside `data_fraction`
    budget: int
    world_size: int
    grad_accum: int
    seed: int
    total_steps: int = 0
    eval_steps: list = field(default_factory=list)
    _epochs: dict = field(default_factory=dict, repr=False)  # the last two epochs' plans

    @classmethod
    def build(cls, ids: Sequence[str], lengths: np.ndarray, loss_tokens: np.ndarray, *, block_size: int,
              min_loss_tokens: int, budget: int, world_size: int, grad_accum: int, seed: int, epochs: float,
              max_steps: int | None, eval_fraction: float, eval_max_samples: int | None,
              data_fraction: float = 1.0) -> "RunPlan":
        """ids [N]; lengths, loss_tokens: int [N] tokens and supervised tokens per sample."""
        lengths = np.asarray(lengths, dtype=np.int64)
        loss_tokens = np.asarray(loss_tokens, dtype=np.int64)
        train_idx, eval_idx = heldout_split(ids, eval_fraction)
        short = lengths[train_idx] <= block_size
        few = ~short & (loss_tokens[train_idx] < min_loss_tokens)
        train_idx = train_idx[~(short | few)]
        train_idx, left_out = data_subset(ids, train_idx, data_fraction)
        usable = (lengths[eval_idx] > block_size) & (loss_tokens[eval_idx] >= min_loss_tokens)
        eval_idx = eval_idx[usable][:eval_max_samples]  # never trained on, either way
        if len(train_idx) == 0:
            raise ValueError(f"no training sample is longer than block_size={block_size} tokens with at least "
                             f"{min_loss_tokens} supervised tokens (RunConfig.min_loss_tokens)"
                             + (f" inside train.data_fraction={data_fraction}" if left_out else ""))
        plan = cls(lengths, train_idx, eval_idx, int(short.sum()), int(few.sum()), left_out, budget, world_size,
                   grad_accum, seed)
        plan.total_steps = total_steps(lambda e: len(plan.epoch(e)), epochs, max_steps)
        if len(eval_idx):
            plan.eval_steps = plan_eval(lengths, eval_idx, budget=budget, world_size=world_size)
        return plan

    def epoch(self, e: int) -> list[Step]:
        """The optimizer steps of epoch `e` (the last two epochs asked for are kept)."""
        if e not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[e] = plan_epoch(self.lengths, self.train_idx, budget=self.budget, world_size=self.world_size,
                                         grad_accum=self.grad_accum, seed=self.seed, epoch=e)
        return self._epochs[e]

    def state(self) -> dict:
        return {"world_size": self.world_size, "micro_batch_tokens": self.budget, "grad_accum": self.grad_accum,
                "seed": self.seed, "num_train_samples": int(len(self.train_idx))}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def collate(samples: list[dict], *, block_size: int, num_anchors: int, mask_token_id: int, seed: int,
            epoch: int, tile: int | None = None) -> dict:
    """Pack samples into one row and build its blocks.

    Returns {"ids": [str], "seq_lens": [int], "input_ids": Long[S], "loss_mask": Bool[S],
    "features": [1, S, n*D] or None (online), "batch": BlockBatch, "tokens": real tokens, "pad_tokens": int}.
    With `tile` (GPU flex attention: 128) the row length S and the query rows N*B are padded up to multiples of
    it, with a trailing dummy sequence (zero features, no loss, no anchors: no block ever sees it) and padding
    blocks (see nothing, weight 0): the loss is unchanged, kernel tiles are aligned and few shapes recompile.
    A padding micro-batch (no samples) is one token with one padding block: it sees nothing and carries no label.
    """
    if not samples:
        ids = torch.zeros(1, dtype=torch.long)
        batch = build_block_batch(ids, torch.zeros(1, dtype=torch.bool), torch.zeros(0, dtype=torch.long),
                                  block_size, mask_token_id, pad_to=1)
        return {"ids": [], "seq_lens": [1], "input_ids": ids, "loss_mask": torch.zeros(1, dtype=torch.bool),
                "features": None, "batch": batch, "tokens": 0, "pad_tokens": 1, "padding": True}
    anchors, offset = [], 0
    for s in samples:
        g = torch.Generator().manual_seed(anchor_seed(seed, epoch, s["id"]))
        anchors.append(sample_anchors(s["loss_mask"], block_size, num_anchors, g) + offset)
        offset += len(s["input_ids"])
    anchors = torch.cat(anchors)
    parts = {k: [s[k] for s in samples] for k in ("input_ids", "loss_mask")}
    if "features" in samples[0]:
        parts["features"] = [s["features"] for s in samples]
    seq_lens = [len(s["input_ids"]) for s in samples]
    num_blocks = max(1, anchors.numel())
    pad_tokens = (-offset) % tile if tile else 0
    if pad_tokens:
        parts["input_ids"].append(torch.zeros(pad_tokens, dtype=torch.long))
        parts["loss_mask"].append(torch.zeros(pad_tokens, dtype=torch.bool))
        if "features" in parts:
            f = parts["features"][0]
            parts["features"].append(torch.zeros(pad_tokens, f.shape[1], dtype=f.dtype))
        seq_lens.append(pad_tokens)
    if tile:
        per = tile // math.gcd(tile, block_size)  # blocks per multiple of `tile` query rows
        num_blocks = -(-num_blocks // per) * per
    input_ids, loss_mask = torch.cat(parts["input_ids"]), torch.cat(parts["loss_mask"])
    batch = build_block_batch(input_ids, loss_mask, anchors, block_size, mask_token_id, seq_lens=seq_lens,
                              pad_to=num_blocks)
    features = torch.cat(parts["features"])[None] if "features" in parts else None
    return {"ids": [s["id"] for s in samples], "seq_lens": seq_lens, "input_ids": input_ids, "loss_mask": loss_mask,
            "features": features, "batch": batch, "tokens": int(offset), "pad_tokens": pad_tokens, "padding": False}


class MicroBatchDataset(torch.utils.data.Dataset):
    """Item k = this rank's k-th micro-batch, collated. The source is opened lazily in each worker process
    (`open_source()`, e.g. `functools.partial(FeatureReader, path)`): memory maps are not shared across forks."""

    def __init__(self, open_source: Callable[[], object], micro_batches: list[MicroBatch], *, block_size: int,
                 num_anchors: int, mask_token_id: int, seed: int, epoch: int, tile: int | None = None):
        self.open_source = open_source
        self.micro_batches = micro_batches
        self.kw = dict(block_size=block_size, num_anchors=num_anchors, mask_token_id=mask_token_id, seed=seed,
                       epoch=epoch, tile=tile)
        self._source = None

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, k: int) -> dict:
        if self._source is None:
            self._source = self.open_source()
        samples = [self._source.sample(i) for i in self.micro_batches[k].indices]
        return collate(samples, **self.kw)


def make_loader(dataset: MicroBatchDataset, num_workers: int, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """Ordered prefetching DataLoader (one collated micro-batch per item; workers build blocks too). With
    `pin_memory` (GPU training) the features arrive in page-locked memory for a fast host-to-device copy. Workers
    ignore the stop signals (train/preempt.py): the main process stops the run."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=num_workers,
        prefetch_factor=4 if num_workers > 0 else None, persistent_workers=False, pin_memory=pin_memory,
        worker_init_fn=ignore_in_worker if num_workers > 0 else None,
    )


def batch_to(mb: dict, device: torch.device, dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, BlockBatch]:
    """(features [1, S, n*D] on device in `dtype`, BlockBatch on device) of a collated micro-batch."""
    features = mb["features"]
    if features is not None:
        features = features.to(device, non_blocking=True)
        if dtype is not None:
            features = features.to(dtype)
    return features, mb["batch"].to(device, non_blocking=True)
