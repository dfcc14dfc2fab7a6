"""Triton kernels of the walk: each computes exactly what a torch function of eval/engine/walk.py defines.

    greedy_choices     `target_choices` at T = 0 (the first argmax of each row)
    greedy_walk        `target_choices` at T = 0 + `walk_tree` + `Walk.host_record`, in three launches, the round
                       record packed by the walk kernel at eval/engine/round_record.py's offsets
    compact_path_rows  `compact_path_rows` (the static cache's move of the path's K/V rows), in place, one launch

eval/engine/walk.py and eval/engine/decode.py call these through `triton_runtime` (CUDA only).
tests/eval/test_triton_kernels.py compares them with the torch versions in Triton's CPU interpreter and, on the GPU
machine, compiled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eval.engine import round_record
from pipeline.triton_runtime import pow2, tl, triton

if triton is not None:

    @triton.jit
    def _argmax_partial_kernel(logits, V, chunk, best, where, BLOCK: tl.constexpr):
        """Row r, chunk c: max and first argmax of logits[r, c*chunk : (c+1)*chunk] -> best/where [r, c]."""
        r, c = tl.program_id(0), tl.program_id(1)
        chunks = tl.num_programs(1)
        lo = c * chunk
        run_max = float("-inf")
        run_idx = lo
        for start in range(lo, tl.minimum(lo + chunk, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits + r.to(tl.int64) * V + cols, mask=cols < tl.minimum(lo + chunk, V),
                        other=float("-inf")).to(tl.float32)
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            take = m > run_max  # strict: an equal later maximum keeps the first index
            run_idx = tl.where(take, start + i, run_idx)
            run_max = tl.where(take, m, run_max)
        tl.store(best + r * chunks + c, run_max)
        tl.store(where + r * chunks + c, run_idx.to(tl.int64))

    @triton.jit
    def _argmax_final_kernel(best, where, CH, choices, CHP: tl.constexpr):
        """Row r: the first chunk holding the row maximum gives the row's first argmax."""
        r = tl.program_id(0)
        c = tl.arange(0, CHP)
        part = tl.load(best + r * CH + c, mask=c < CH, other=float("-inf"))
        _, first = tl.max(part, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(choices + r, tl.load(where + r * CH + first))

    @triton.jit
    def _walk_kernel(tokens, parents, depths, ancestors, W, N, L, choices, match_buf,
                     path, accepted_out, bonus_out, last_out, record,
                     NP: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr, HEAD: tl.constexpr):
        i = tl.arange(0, NP)
        node = i < N
        lp = tl.arange(0, LP)
        tl.store(path + lp, tl.zeros([LP], tl.int64), mask=lp <= L)
        tl.debug_barrier()
        par = tl.load(parents + i, mask=node, other=0)
        tok = tl.load(tokens + i, mask=node, other=0)
        match = (tok == tl.load(choices + par, mask=node, other=-1, volatile=True)) | (i == 0)
        tl.store(match_buf + i, match.to(tl.int8), mask=node)
        tl.debug_barrier()
        w = tl.arange(0, WP)
        anc = tl.load(ancestors + i[:, None] * W + w[None, :], mask=node[:, None] & (w[None, :] < W), other=0)
        ok = tl.min(tl.load(match_buf + anc, mask=node[:, None] & (w[None, :] < W), other=1, volatile=True),
                    axis=1) > 0
        ok = ok & node
        depth = tl.load(depths + i, mask=node, other=0)
        accepted = tl.max(tl.where(ok, depth, 0), axis=0)
        tl.store(path + depth, i.to(tl.int64), mask=ok)
        tl.debug_barrier()
        last = tl.load(path + accepted, volatile=True)
        bonus = tl.load(choices + last, volatile=True)
        tl.store(accepted_out, accepted.to(tl.int64))
        tl.store(bonus_out, bonus)
        tl.store(last_out, last)
        tl.store(record, accepted.to(tl.int64))
        tl.store(record + 1, bonus)
        tl.store(record + 2, tl.max(tl.where(node, depth, 0), axis=0).to(tl.int64))
        steps = tl.load(path + lp, mask=lp <= L, other=0, volatile=True)
        tl.store(record + HEAD + lp, steps, mask=lp <= L)
        tl.store(record + HEAD + 1 + L + lp, tl.load(tokens + steps, mask=lp <= L, other=0), mask=lp <= L)


def greedy_choices(logits: Tensor) -> Tensor:
    """eval/engine/walk.py `target_choices` at T = 0: the first argmax of each row of logits [N, V] -> int64 [N]."""
    N, V = logits.shape
    chunk = 4096  # one load of 4096 values per program: memory-parallel, not a serial loop
    chunks = triton.cdiv(V, chunk)
    best = torch.empty(N, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(N, chunks, dtype=torch.long, device=logits.device)
    _argmax_partial_kernel[(N, chunks)](logits.contiguous(), V, chunk, best, where, BLOCK=chunk, num_warps=8)
    choices = torch.empty(N, dtype=torch.long, device=logits.device)
    _argmax_final_kernel[(N,)](best, where, chunks, choices, CHP=pow2(chunks))
    return choices


def greedy_walk(tokens: Tensor, parents: Tensor, depths: Tensor, ancestors: Tensor, logits: Tensor,
                depth_limit: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """eval/engine/walk.py at T = 0 in three launches: (accepted, path [L+1], bonus, last, the round record of
    eval/engine/round_record.py, packed by the walk kernel at its offsets); accepted/bonus/last are 0-dim int64.
    ancestors: eval/engine/verify.py `ancestor_table` [N, W]."""
    N = tokens.shape[0]
    L = depth_limit
    choices = greedy_choices(logits)
    device = tokens.device
    match = torch.empty(N, dtype=torch.int8, device=device)
    path = torch.empty(L + 1, dtype=torch.long, device=device)
    accepted, bonus, last = (torch.empty((), dtype=torch.long, device=device) for _ in range(3))
    record = torch.empty(round_record.record_size(L), dtype=torch.long, device=device)
    W = ancestors.shape[1]
    _walk_kernel[(1,)](tokens, parents, depths, ancestors.contiguous(), W, N, L, choices, match, path, accepted,
                       bonus, last, record, NP=pow2(N), WP=pow2(W), LP=pow2(L + 1), HEAD=round_record.HEAD,
                       num_warps=4 if N <= 256 else 8)
    return accepted, path, bonus, last, record



if triton is not None:

    @triton.jit
    def _compact_path_kernel(x, R, C, past_ptr, path, LP1, LP: tl.constexpr, BLOCK_C: tl.constexpr):
        """Slice p, columns chunk c of x viewed [P, R, C]: rows past + path[j] -> past + j for j < LP1, all rows
        read before any is written (so no order between the rows is assumed)."""
        p, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        past = tl.load(past_ptr)
        j = tl.arange(0, LP)
        ok = j < LP1
        cols = c * BLOCK_C + tl.arange(0, BLOCK_C)
        m = ok[:, None] & (cols < C)[None, :]
        src = past + tl.load(path + j, mask=ok, other=0)
        base = x + p * R * C
        rows = tl.load(base + src[:, None] * C + cols[None, :], mask=m)
        tl.debug_barrier()
        tl.store(base + (past + j)[:, None] * C + cols[None, :], rows, mask=m)


def compact_path_rows(x: Tensor, dim: int, past: Tensor, path: Tensor) -> Tensor:
    """eval/engine/walk.py `compact_path_rows` for a contiguous x, in place, one launch; returns x."""
    P, R = math.prod(x.shape[:dim]), x.shape[dim]
    C = x.numel() // (P * R)
    block_c = min(pow2(C), 128)
    LP1 = path.shape[0]
    _compact_path_kernel[(P, triton.cdiv(C, block_c))](x, R, C, past.reshape(1), path, LP1, LP=pow2(LP1),
                                                       BLOCK_C=block_c)
    return x
