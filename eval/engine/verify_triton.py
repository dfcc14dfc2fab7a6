"""Triton kernels of the verify inputs: each computes exactly what the eval/engine/verify.py function of the same
name defines (walking up the parents instead of pointer doubling + concatenation + scatter), in one launch each.

    ancestor_table   `ancestor_table` with a power-of-two width
    ancestor_matrix  `ancestor_matrix` from the table

eval/engine/verify.py calls these through `triton_runtime` (CUDA only). tests/eval/test_triton_kernels.py compares
them with the torch versions in Triton's CPU interpreter and, on the GPU machine, compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.triton_runtime import tl, triton

if triton is not None:

    @triton.jit
    def _ancestor_table_kernel(parents, N, W, table, BLOCK: tl.constexpr):
        """table[i, m] = the ancestor m steps above node i (the root's self-loop absorbs overshoot)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        node = i < N
        cur = i.to(tl.int64)
        for m in range(W):
            tl.store(table + i * W + m, cur, mask=node)
            cur = tl.load(parents + cur, mask=node, other=0)

    @triton.jit
    def _ancestor_matrix_kernel(table, N, W, vis, BLOCK: tl.constexpr):
        """vis[i, table[i, m]] = True for every m (vis zeroed by the caller)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        node = i < N
        for m in range(W):
            a = tl.load(table + i * W + m, mask=node, other=0)
            tl.store(vis + i.to(tl.int64) * N + a, tl.full([BLOCK], 1, tl.int8), mask=node)


def ancestor_table(parents: Tensor, width: int) -> Tensor:
    """eval/engine/verify.py `ancestor_table` with `width` = 2^k columns: int64 [N, width], one launch."""
    N = parents.shape[0]
    table = torch.empty(N, width, dtype=torch.long, device=parents.device)
    _ancestor_table_kernel[(triton.cdiv(N, 128),)](parents, N, width, table, BLOCK=128)
    return table


def ancestor_matrix(table: Tensor) -> Tensor:
    """eval/engine/verify.py `ancestor_matrix` from the table: bool [N, N], a memset and one launch."""
    N, W = table.shape
    vis = torch.zeros(N, N, dtype=torch.bool, device=table.device)
    _ancestor_matrix_kernel[(triton.cdiv(N, 128),)](table, N, W, vis.view(torch.int8), BLOCK=128)
    return vis
