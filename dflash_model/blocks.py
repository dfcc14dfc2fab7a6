"""THE anchor sampling, block construction, training attention mask and labels of DFlash.

Training packs N blocks of B slots into one query sequence of Q = N*B rows (docs/drafter.md, "Training: anchors, packed layout and mask"):

    block n    = [x[a_n], MASK x (B-1)]             slot 0 is the real (anchor) token, never a target
    positions  = a_n - doc_start_n + j               RoPE position of slot j (absolute within its sequence)
    label      = x[a_n + j]                          same position (not shifted); valid iff j >= 1,
                                                     a_n + j inside the sequence, loss_mask[a_n + j]
    target row = a_n + j - 1                         the packed-row position whose target output is the
                                                     target's distribution for that label (logit distillation)
    keys       = [context rows 0..S-1] ++ [the Q block rows]

Visibility of key `t` for query (n, j) -- `block_visibility`, the ONE predicate that the dense mask, the flex
mask and the inference path (`dflash_model/model.py::DFlashDrafter.draft_logits`) all use:

    context key t < S   : doc_start_n <= t < a_n                  (STRICT: the anchor's own target state is
                                                                    not available at inference)
    block key  S + n'B + j' : n' == n                              (bidirectional inside the own block)
    sliding layers add  : t >= a_n + j - (W-1) on context keys, j' <= j and j - j' <= W-1 on block keys
                          (causal sliding window on absolute positions; the window on block keys only matters
                           when W < B)
    padded blocks (block_valid False) see nothing.

Several sequences may be packed into one row (`seq_lens`): anchors are then indices into the packed row, a block
never sees another sequence's context, and positions restart at 0 for every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
from torch import Tensor

FULL = "full_attention"
SLIDING = "sliding_attention"


def sample_anchors(loss_mask: Tensor, block_size: int, num_anchors: int, generator: torch.Generator) -> Tensor:
    """Draw up to `num_anchors` distinct anchors uniformly without replacement, sorted ascending.

    loss_mask: Bool[S] of ONE sequence. Candidates are positions p with loss_mask[p] and p <= S - B (no partial tail
    blocks). Returns Long[N], N = min(num_anchors, #candidates), on loss_mask's device; deterministic given the
    generator state (the permutation is drawn on the generator's device).
    """
    seq_len = loss_mask.shape[0]
    last = seq_len - block_size  # the last anchor whose block fits entirely
    if last < 0:
        return torch.zeros(0, dtype=torch.long, device=loss_mask.device)
    candidates = torch.nonzero(loss_mask[: last + 1].bool(), as_tuple=False).flatten()
    count = min(num_anchors, candidates.numel())
    order = torch.randperm(candidates.numel(), generator=generator, device=generator.device)[:count]
    return candidates[order.to(candidates.device)].sort().values


@dataclass
class BlockBatch:
    """The packed training blocks of one row (one sequence or several packed ones).

    Q = N*B query rows, S context rows. Block n occupies rows n*B .. n*B+B-1; slot j = row % B.
    """

    block_ids: Tensor  # Long[Q]  [x[a_n], MASK x (B-1)] per block (all MASK in padded blocks)
    block_positions: Tensor  # Long[Q]  RoPE position a_n - doc_start_n + j
    labels: Tensor  # Long[Q]  x[a_n + j] (0 where out of the sequence)
    label_mask: Tensor  # Bool[Q]  j >= 1 & loss_mask[a_n + j] & a_n + j inside the sequence & block valid
    anchors: Tensor  # Long[N]  index of slot 0 in the packed row
    block_valid: Tensor  # Bool[N]  False for padding blocks
    doc_start: Tensor  # Long[N]  first packed-row index of the anchor's sequence
    context_positions: Tensor  # Long[S]  RoPE position of each context row (t - start of its sequence)
    label_rows: Tensor  # Long[R]  the rows with a valid label, ascending (nonzero(label_mask), made on the host)
    seq_len: int  # S, context rows in the packed row
    block_size: int  # B

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[0]

    @property
    def slots(self) -> Tensor:
        """Long[Q]: slot j of every query row."""
        return torch.arange(self.block_ids.shape[0], device=self.block_ids.device) % self.block_size

    @property
    def target_rows(self) -> Tensor:
        """Long[Q]: the packed-row index a_n + j - 1 whose target output (its last hidden state through the final
        norm and LM head) is the target's next-token distribution for the label of row (n, j). It lies inside the
        label's sequence wherever the label is valid (j >= 1); slot 0 and padded blocks get a clamped, unused row."""
        rows = self.anchors.repeat_interleave(self.block_size) + self.slots - 1
        return rows.clamp(min=0, max=self.seq_len - 1)

    def to(self, device, non_blocking: bool = False) -> "BlockBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return BlockBatch(**{k: (v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v)
                             for k, v in moved.items()})

    def pin_memory(self) -> "BlockBatch":
        """The same batch in page-locked host memory (the DataLoader's pin_memory calls this), so `to(device,
        non_blocking=True)` copies without stalling the host."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return BlockBatch(**{k: (v.pin_memory() if isinstance(v, Tensor) else v) for k, v in moved.items()})


def build_block_batch(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    block_size: int,
    mask_token_id: int,
    *,
    seq_lens: Optional[Sequence[int]] = None,
    pad_to: Optional[int] = None,
) -> BlockBatch:
    """Blocks, positions and labels for the given anchors (see the module docstring for the rules).

    input_ids: Long[S], loss_mask: Bool[S] (one row; several sequences when `seq_lens` is given, sum = S),
    anchors: Long[N] indices into the row (sample each sequence with `sample_anchors` and add its offset).
    pad_to: append padding blocks (valid False: they see nothing and carry no label) up to this many blocks,
    for fixed shapes across steps.
    """
    device = input_ids.device
    seq_len = input_ids.shape[0]
    anchors = anchors.to(device=device, dtype=torch.long).flatten()
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= seq_len):
        raise ValueError(f"anchors must lie in [0, {seq_len}), got min {int(anchors.min())} max {int(anchors.max())}")
    lens = [seq_len] if seq_lens is None else [int(n) for n in seq_lens]
    if sum(lens) != seq_len or min(lens) < 1:
        raise ValueError(f"seq_lens {lens} must be positive and sum to the row length {seq_len}")
    ends = torch.tensor(lens, device=device).cumsum(0)  # exclusive end of each sequence
    starts = ends - torch.tensor(lens, device=device)
    doc_of_anchor = torch.searchsorted(ends, anchors, right=True)
    doc_start, doc_end = starts[doc_of_anchor], ends[doc_of_anchor]
    doc_of_row = torch.searchsorted(ends, torch.arange(seq_len, device=device), right=True)
    context_positions = torch.arange(seq_len, device=device) - starts[doc_of_row]

    num_blocks = anchors.numel()
    if pad_to is not None:
        if pad_to < num_blocks:
            raise ValueError(f"pad_to={pad_to} is smaller than the {num_blocks} anchors")
        pad = pad_to - num_blocks
        zeros = torch.zeros(pad, dtype=torch.long, device=device)
        anchors, doc_start = torch.cat([anchors, zeros]), torch.cat([doc_start, zeros])
        doc_end = torch.cat([doc_end, zeros + lens[0]])
        block_valid = torch.arange(pad_to, device=device) < num_blocks
    else:
        block_valid = torch.ones(num_blocks, dtype=torch.bool, device=device)

    slot = torch.arange(block_size, device=device)
    index = anchors[:, None] + slot[None, :]  # [N, B] packed-row index of each slot's token
    inside = index < doc_end[:, None]
    safe = index.clamp(max=seq_len - 1)
    block_ids = torch.full_like(index, mask_token_id)
    block_ids[:, 0] = torch.where(block_valid, input_ids[anchors], mask_token_id)
    labels = torch.where(inside, input_ids[safe], 0)
    label_mask = (slot[None, :] >= 1) & inside & loss_mask.bool()[safe] & block_valid[:, None]
    return BlockBatch(
        block_ids=block_ids.flatten(),
        block_positions=(index - doc_start[:, None]).flatten(),
        labels=labels.flatten(),
        label_mask=label_mask.flatten(),
        anchors=anchors,
        block_valid=block_valid,
        doc_start=doc_start,
        context_positions=context_positions,
        label_rows=torch.nonzero(label_mask.flatten(), as_tuple=False).flatten(),
        seq_len=seq_len,
        block_size=block_size,
    )


def block_visibility(
    q_idx: Tensor,
    kv_idx: Tensor,
    anchors: Tensor,
    block_valid: Tensor,
    doc_start: Tensor,
    seq_len: int,
    block_size: int,
    window: Optional[int],
) -> Tensor:
    """THE predicate: may query row `q_idx` (block n = q//B, slot j = q%B) see key `kv_idx`?

    Keys are [context 0..S-1] ++ [block rows]. Works elementwise on broadcastable index tensors (dense masks) and
    on the scalar tensors of a flex `mask_mod`. `window` is None for full-attention layers.
    """
    num_blocks = anchors.shape[0]
    block = (q_idx // block_size).clamp(max=num_blocks - 1)  # clamp: flex may probe padded query rows
    slot = q_idx % block_size
    anchor = anchors[block]
    is_context = kv_idx < seq_len
    context_ok = is_context & (kv_idx < anchor) & (kv_idx >= doc_start[block])
    key_row = kv_idx - seq_len
    key_slot = key_row % block_size
    block_ok = ~is_context & (key_row // block_size == block)
    if window is not None:
        context_ok = context_ok & (kv_idx >= anchor + slot - (window - 1))
        block_ok = block_ok & (key_slot <= slot) & (slot - key_slot <= window - 1)
    return (context_ok | block_ok) & block_valid[block] & (q_idx < num_blocks * block_size)


def _layer_window(layer_type: str, sliding_window: Optional[int]) -> Optional[int]:
    if layer_type == FULL:
        return None
    if layer_type == SLIDING:
        if not sliding_window or sliding_window < 1:
            raise ValueError("a sliding_attention layer needs sliding_window >= 1")
        return int(sliding_window)
    raise ValueError(f"layer_type {layer_type!r} is not {FULL!r} or {SLIDING!r}")


def _defaults(anchors: Tensor, block_valid: Optional[Tensor], doc_start: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    if block_valid is None:
        block_valid = torch.ones_like(anchors, dtype=torch.bool)
    if doc_start is None:
        doc_start = torch.zeros_like(anchors)
    return block_valid, doc_start


def dense_block_mask(
    anchors: Tensor,
    seq_len: int,
    block_size: int,
    layer_type: str,
    sliding_window: Optional[int],
    *,
    block_valid: Optional[Tensor] = None,
    doc_start: Optional[Tensor] = None,
) -> Tensor:
    """Exact Bool[Q, S+Q] mask (True = may attend) of `block_visibility`, Q = N*B.

    Rows of padded blocks are all False: SDPA turns such rows into NaN, so the model adds a self-edge for them
    (`dflash_model/model.py`) and zeroes their outputs.
    """
    block_valid, doc_start = _defaults(anchors, block_valid, doc_start)
    num_queries = anchors.shape[0] * block_size
    q_idx = torch.arange(num_queries, device=anchors.device)[:, None]
    kv_idx = torch.arange(seq_len + num_queries, device=anchors.device)[None, :]
    window = _layer_window(layer_type, sliding_window)
    return block_visibility(q_idx, kv_idx, anchors, block_valid, doc_start, seq_len, block_size, window)


def flex_block_mask(
    anchors: Tensor,
    seq_len: int,
    block_size: int,
    layer_type: str,
    sliding_window: Optional[int],
    *,
    block_valid: Optional[Tensor] = None,
    doc_start: Optional[Tensor] = None,
    tile: int = 128,
):
    """FlexAttention BlockMask of `block_visibility` (same predicate as `dense_block_mask`), on anchors' device.

    The tile-level sparsity is computed from the block structure (`_tile_cover`), never from a dense [Q, S+Q]
    mask, so many packed sequences (Q ~ 1e5 rows) cost O(Q/tile * KV/tile) memory, not O(Q * KV).
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_valid, doc_start = _defaults(anchors, block_valid, doc_start)
    window = _layer_window(layer_type, sliding_window)
    num_queries = anchors.shape[0] * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return block_visibility(q_idx, kv_idx, anchors, block_valid, doc_start, seq_len, block_size, window)

    partial, full = _tile_cover(anchors, block_valid, doc_start, seq_len, block_size, window, tile)
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
        seq_lengths=(num_queries, seq_len + num_queries),
    )


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Bool[nq, nkv] tile matrix -> (count Int32[1, 1, nq], kv tile indices Int32[1, 1, nq, nkv], listed first)."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None].contiguous(), order[None, None].contiguous()


def _tile_cover(
    anchors: Tensor, block_valid: Tensor, doc_start: Tensor, seq_len: int, block_size: int,
    window: Optional[int], tile: int,
) -> tuple[Tensor, Tensor]:
    """(partial, full) Bool[nq, nkv] tiles of `block_visibility`: every visible pair lies in a listed tile, and
    every pair of a full tile is visible. Per query row the visible keys are one context range
    [ctx_lo, anchor) and one range of its own block's rows; per query tile we take the hull of the rows' ranges
    (partial) and their intersection (full, context only)."""
    device = anchors.device
    num_blocks = anchors.shape[0]
    Q = num_blocks * block_size
    KV = seq_len + Q
    nq, nkv = -(-Q // tile), -(-KV // tile)
    rows = torch.arange(nq * tile, device=device)
    block = (rows // block_size).clamp(max=max(num_blocks - 1, 0))
    slot = rows % block_size
    anchor, start = anchors[block], doc_start[block]
    live = (rows < Q) & block_valid[block]
    ctx_lo = start if window is None else torch.maximum(start, anchor + slot - (window - 1))
    ctx_hi = anchor
    has_ctx = live & (ctx_hi > ctx_lo)
    base = seq_len + block * block_size
    blk_lo = base if window is None else base + (slot - (window - 1)).clamp(min=0)
    blk_hi = base + block_size if window is None else base + slot + 1

    def hull_lo(x, keep):
        return torch.where(keep, x, KV + 1).view(nq, tile).amin(dim=1)

    def hull_hi(x, keep):
        return torch.where(keep, x, -1).view(nq, tile).amax(dim=1)

    kv_start = torch.arange(nkv, device=device) * tile
    kv_end = (kv_start + tile).clamp(max=KV)

    def overlaps(lo, hi):
        return (kv_start[None, :] < hi[:, None]) & (kv_end[None, :] > lo[:, None])

    touched = overlaps(hull_lo(ctx_lo, has_ctx), hull_hi(ctx_hi, has_ctx)) | overlaps(
        hull_lo(blk_lo, live), hull_hi(blk_hi, live)
    )
    every_row = has_ctx.view(nq, tile).all(dim=1)
    inner_lo, inner_hi = ctx_lo.view(nq, tile).amax(dim=1), ctx_hi.view(nq, tile).amin(dim=1)
    full = every_row[:, None] & (kv_start[None, :] >= inner_lo[:, None]) & (kv_end[None, :] <= inner_hi[:, None])
    return touched & ~full, full
