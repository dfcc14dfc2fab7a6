"""The round record: what a decode round copies to the host, its ONE device-to-host read (docs/tree.md, "Walk").

    record  int64 [HEAD + 2(L+1)] = [accepted, bonus, depth, path[0..L], tokens[path[0..L]]]

    accepted   drafted nodes accepted this round (tau - 1)
    bonus      the target's token after the last accepted node (the next round's root)
    depth      the deepest drafted depth the tree offered (AR 0, chain L, DDTree the tree's depth)
    path[d]    the accepted node at depth d for d <= accepted (path[0] = 0, the root; later entries 0)
    tokens     the tokens of those nodes (tokens[0] = the root = the previous bonus)

Packed on the device by `pack_record` (torch) or, at T = 0 on CUDA, inside eval/engine/walk_triton.py's walk kernel at
the same offsets (`HEAD`); read on the host by `parse_record`. Nothing else indexes the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

HEAD = 3  # accepted, bonus, depth; then the path (L+1 entries), then its tokens (L+1 entries)


def record_size(depth_limit: int) -> int:
    """Entries of the record of a round whose trees are at most `depth_limit` (L) deep."""
    return HEAD + 2 * (depth_limit + 1)


def pack_record(accepted: Tensor, bonus: Tensor, depth: Tensor, path: Tensor, tokens: Tensor) -> Tensor:
    """The record [HEAD + 2(L+1)] from 0-dim accepted/bonus/depth, path [L+1] and the tree's tokens [N] (no host
    read: fixed shapes, CUDA-graph safe)."""
    return torch.cat([torch.stack([accepted, bonus, depth]), path, tokens[path]])


@dataclass(frozen=True)
class RoundRecord:
    """A round's record on the host."""

    accepted: int  # drafted tokens accepted (tau - 1)
    bonus: int  # the next round's root token
    depth: int  # deepest drafted depth offered
    path: list[int]  # accepted+1 node indices, root first
    accepted_tokens: list[int]  # the accepted drafted tokens in order (the root excluded): len == accepted

    @property
    def contiguous(self) -> bool:
        """The accepted nodes are rows 0..accepted of the verify (a chain prefix): committing moves no K/V row."""
        return self.path == list(range(self.accepted + 1))


def parse_record(values: Sequence[int], depth_limit: int) -> RoundRecord:
    """The host view of a record read as a list of ints (layout in the module docstring)."""
    if len(values) != record_size(depth_limit):
        raise ValueError(f"round record has {len(values)} entries, expected {record_size(depth_limit)}")
    accepted, bonus, depth = (int(v) for v in values[:HEAD])
    path = values[HEAD: HEAD + depth_limit + 1]
    tokens = values[HEAD + depth_limit + 1:]
    return RoundRecord(accepted, bonus, depth, [int(p) for p in path[: accepted + 1]],
                       [int(t) for t in tokens[1: accepted + 1]])
