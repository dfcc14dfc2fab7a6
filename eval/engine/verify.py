"""Tree verification inputs (docs/tree.md, "Verify: positions and mask"): position ids and the 4-D attention mask, built on the device.

One target forward verifies every node of a `eval.engine.tree.Tree`:

    input ids     [bonus, node_1 .. node_n]                     (1 + n rows, tree index order)
    position ids  start + depth                                 siblings share a position (docs/tree.md, "Verify: positions and mask")
    mask          [1, 1, 1+n, kv_len] additive (0 = visible, finfo.min = hidden), in the target dtype:
                  key columns [0, past)           committed past: fully visible (every query is after it)
                  key columns [past, past+1+n)    this tree: row i sees column past+j iff j is i or an ancestor of i
                  key columns >= past+1+n         hidden (unused rows of a preallocated static cache)
                  sliding-attention layers additionally hide keys whose *real* position is >= window behind
                  the query's (docs/tree.md, "Verify: positions and mask").

`past` is the committed cache length, which equals `start` (the bonus token's position).  It may be a host int
(dynamic cache) or a 0-dim device tensor (static cache under CUDA graphs); nothing here reads it on the host.
Work is a fixed number of tensor ops (no per-node host work): the ancestor table is built by pointer doubling.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eval.engine import verify_triton
from pipeline import triton_runtime
from eval.engine.tree import Tree


def verify_positions(tree: Tree, start) -> Tensor:
    """Position ids [1, 1+n] = start + depth (start: int or 0-dim device tensor)."""
    return (tree.depths + start).unsqueeze(0)


def ancestor_table(parents: Tensor, depth_limit: int) -> Tensor:
    """[N, 2^k] node ids: column m = the ancestor m steps up (the root's self-loop absorbs overshoot), k =
    ceil(log2(L+1)), so columns cover distances 0..L. Built by doubling: k gathers, no loop over nodes."""
    rounds = max(1, math.ceil(math.log2(depth_limit + 1)))
    if triton_runtime.available(parents.device):  # the same table in one launch
        table = triton_runtime.run(verify_triton.ancestor_table, parents, 1 << rounds)
        if table is not None:
            return table
    table = torch.arange(parents.shape[0], device=parents.device).unsqueeze(1)
    jump = parents
    for _ in range(rounds):
        table = torch.cat([table, jump[table]], dim=1)
        jump = jump[jump]
    return table


def ancestor_matrix(tree: Tree, ancestors: Tensor | None = None) -> Tensor:
    """Bool [N, N]: vis[i, j] iff node j is node i or one of its ancestors (diagonal included; row 0 = {0}).
    ancestors: `ancestor_table(tree.parents, tree.depth_limit)` if already computed."""
    N = tree.size
    table = ancestor_table(tree.parents, tree.depth_limit) if ancestors is None else ancestors
    if triton_runtime.available(table.device):
        vis = triton_runtime.run(verify_triton.ancestor_matrix, table)
        if vis is not None:
            return vis
    vis = torch.zeros(N, N, dtype=torch.bool, device=tree.parents.device)
    return vis.scatter_(1, table, True)


def tree_attention_mask(tree: Tree, past, kv_len: int, dtype: torch.dtype, *,
                        sliding_window: int | None = None, ancestors: Tensor | None = None) -> Tensor:
    """Additive mask [1, 1, 1+n, kv_len] for verifying `tree` on top of `past` committed rows (layout above).

    kv_len: key columns the attention sees (dynamic cache: past + 1 + n; static cache: its capacity).
    sliding_window: if set, also hide keys at real position <= query position - window.
    ancestors: the tree's `ancestor_table`, if the caller already has it (the walk reuses it).
    """
    return visibility_attention_mask(ancestor_matrix(tree, ancestors), verify_positions(tree, past), past, kv_len,
                                     dtype, sliding_window=sliding_window)


def visibility_attention_mask(vis: Tensor, positions: Tensor, past, kv_len: int, dtype: torch.dtype, *,
                              sliding_window: int | None = None) -> Tensor:
    """The additive tree mask [1, 1, N, kv_len] (layout above) from the tree's ancestor matrix vis [N, N] and its
    position ids [1, N] (= past + depth). A fixed number of device ops over [N, kv_len]; `past` may be a 0-dim
    device tensor (no host read), so the static cache builds this inside its verify CUDA graph."""
    N = vis.shape[0]
    rel = torch.arange(kv_len, device=vis.device) - past  # tree index of each key column (past rows: < 0)
    idx = rel.clamp(0, N - 1)
    visible = (rel < 0) | (vis.index_select(1, idx) & (rel < N))
    if sliding_window is not None:
        pos = positions.reshape(-1)
        key_pos = torch.where(rel < 0, rel + past, pos.index_select(0, idx))  # real position of each key column
        visible = visible & (key_pos.unsqueeze(0) > pos.unsqueeze(1) - sliding_window)
    return _additive(visible, dtype)


def causal_attention_mask(q_len: int, past, kv_len: int, dtype: torch.dtype, device, *,
                          sliding_window: int | None = None) -> Tensor:
    """Additive causal mask [1, 1, q_len, kv_len] for q_len new rows at positions past.. (e.g. a static-cache
    prefill): query i sees key columns 0..past+i (and, with a window, only the last `sliding_window` of them)."""
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + past
    col = torch.arange(kv_len, device=device).unsqueeze(0)
    visible = col <= q_pos
    if sliding_window is not None:
        visible = visible & (col > q_pos - sliding_window)
    return _additive(visible, dtype)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return torch.where(visible, zero, hidden)[None, None]
