"""The Triton tree-attention kernel of the fused verify forward: attention of the tree's query rows over the
committed keys and the tree's own keys under the eval/engine/verify.py visibility (past visible, tree ancestors only),
equal to eval/engine/target_forward.py's torch attention under the same mask; it reads the [N, N] ancestor matrix
instead of a [N, past + N] mask and splits the keys over programs (merged by `target_forward.merge_splits`).

eval/engine/target_forward.py calls it (attention mode 'triton', CUDA only). tests/eval/test_triton_kernels.py
compares it with the torch attention in Triton's CPU interpreter and, on the GPU machine, compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.triton_runtime import tl, triton

if triton is not None:

    @triton.jit
    def _tree_attention_kernel(q, k, v, vis, past_ptr, out, lse, N, GN, stride_kh, stride_kt, kv_chunk, scale,
                               HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """Program (query tile, KV head, key split): online softmax over keys [s*kv_chunk, (s+1)*kv_chunk) that
        exist (< past + N). Key column c is visible to folded row m (token i = m % N) iff c < past, or
        c - past is i or an ancestor of i (vis[i, c - past])."""
        pid_m, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        past = tl.load(past_ptr).to(tl.int32)
        total = past + N
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < GN
        tok = rows % N
        d = tl.arange(0, HD)
        qt = tl.load(q + h * GN * HD + rows[:, None] * HD + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HD], tl.float32)
        lo = s * kv_chunk
        hi = tl.minimum(total, lo + kv_chunk)
        kbase = k + h.to(tl.int64) * stride_kh
        vbase = v + h.to(tl.int64) * stride_kh
        for start in range(lo, hi, BN):
            cols = start + tl.arange(0, BN)
            col_ok = cols < hi
            kt = tl.load(kbase + cols[:, None] * stride_kt + d[None, :], mask=col_ok[:, None], other=0.0)
            sc = tl.dot(qt, tl.trans(kt)) * scale
            in_tree = col_ok & (cols >= past)
            tv = tl.load(vis + tok[:, None] * N + (cols - past)[None, :], mask=row_ok[:, None] & in_tree[None, :],
                         other=0)
            visible = ((cols < past)[None, :] | (tv != 0)) & col_ok[None, :]
            sc = tl.where(visible, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)
            p = tl.exp2((sc - m_safe[:, None]) * 1.4426950408889634)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(vbase + cols[:, None] * stride_kt + d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        base = (s * tl.num_programs(1) + h) * GN
        tl.store(out + (base + rows[:, None]) * HD + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + base + rows, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=row_ok)


ATTENTION_CONFIG = (64, 64, 4, 2)  # BLOCK_M, BLOCK_N, warps, stages


def tree_attention(q: Tensor, keys: Tensor, values: Tensor, visibility: Tensor, past: Tensor, scale: float,
                   splits: int, config: tuple[int, int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """q [KVH, M, hd] (folded: row m is tree token m % N), keys/values [KVH, kv_len, hd] (row stride free, last dim
    contiguous), visibility bool [N, N] (eval/engine/verify.py ancestor matrix), past 0-dim device int -> per-split outputs
    [S, KVH, M, hd] (q dtype) and log-sum-exps [S, KVH, M] fp32 (-inf where a split saw no key); S = splits, and
    kv_len % (BLOCK_N * S) == 0. Keys at or beyond past + N are never read."""
    H, M, hd = q.shape
    N = visibility.shape[0]
    kv_len = keys.shape[1]
    out = torch.empty(splits, H, M, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(splits, H, M, dtype=torch.float32, device=q.device)
    BM, BN, warps, stages = config or ATTENTION_CONFIG
    _tree_attention_kernel[(triton.cdiv(M, BM), H, splits)](
        q.contiguous(), keys, values, visibility.view(torch.uint8), past, out, lse, N, M, keys.stride(0),
        keys.stride(1), kv_len // splits, scale, HD=hd, BM=BM, BN=BN, num_warps=warps, num_stages=stages)
    return out, lse
