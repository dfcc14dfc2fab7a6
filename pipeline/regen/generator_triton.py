"""The top-p draw of `pipeline.regen.generator.nucleus_from_uniforms` as one Triton kernel over the raw logits.

    logits    [B, V]   the step's logits, any float dtype, rows strided; only ids < vocab_limit are considered
    uniforms  [B, C]   fp32 in [0, 1): candidate c of row b is the inverse CDF of softmax(logits / T) at it
    ->        [B]      int64 ids

One program per row streams the row three times, never writing a [B, V] tensor: (1) the maximum, its first id and
the softmax's normalizer of x = logit * log2(e) / T (online, exp2); (2) each candidate's id, the first whose
cumulative mass passes uniform_c x normalizer (a running sum over blocks, `tl.cumsum` inside one); (3) each
candidate's mass of strictly more probable ids. A candidate lies inside the nucleus iff that mass is at most top_p of
the normalizer; the row's draw is its first candidate inside, in column order, else its most probable id. The same
rule and the same inverse CDF as the torch reference: where a uniform lands within rounding of a cumulative sum's
edge the two may pick neighbouring ids (tests/pipeline/test_sampling_triton.py bounds how often).

Replaces, per decode step, the logits' fp32 copy, the padded-vocab mask, the temperature's division, the softmax,
the cumulative sum and the search passes of the torch path: ~20 passes over [B, V] in fp32 become 3 reads of the
logits in their own dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.triton_runtime import pow2, tl, triton

BLOCK_V = 512  # vocabulary ids per loop step (a [C, BLOCK_V] comparison per step in passes 2 and 3)

if triton is not None:

    @triton.jit
    def _nucleus_kernel(logits, stride_b, V, uniforms, stride_u, out, C, scale, top_p,
                        BLOCK: tl.constexpr, CP: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride_b
        offs = tl.arange(0, BLOCK)
        # (1) maximum m, its first id, normalizer s = sum exp2(x - m)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        best = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
        for start in range(0, V, BLOCK):
            ids = start + offs
            x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) * scale
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, ids, V), 0)
            m_new = tl.maximum(m, bm)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2(m - m_safe) + tl.sum(tl.exp2(x - m_safe), 0)
            best = tl.where(bm > m, bi, best)
            m = m_new
        # (2) candidate ids by the inverse CDF: the first id whose cumulative mass passes u_c * s
        cand = tl.arange(0, CP)
        u = tl.load(uniforms + row.to(tl.int64) * stride_u + cand, mask=cand < C, other=2.0)
        target = u * s
        picked = tl.full([CP], -1, tl.int32)
        running = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        for start in range(0, V, BLOCK):
            ids = start + offs
            x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) * scale
            e = tl.exp2(x - m)
            cum = tl.cumsum(e, 0) + running
            first = tl.min(tl.where(cum[None, :] > target[:, None], ids[None, :], V), 1)  # [CP]; V: not here
            picked = tl.where((picked < 0) & (first < V), first, picked)
            running = running + tl.sum(e, 0)
        picked = tl.where(picked < 0, best, picked)  # a uniform past the last sum's rounding: the most probable id
        # (3) each candidate's mass of strictly more probable ids
        p_c = tl.exp2(tl.load(base + picked).to(tl.float32) * scale - m)
        above = tl.zeros([CP], tl.float32)
        for start in range(0, V, BLOCK):
            ids = start + offs
            x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32) * scale
            e = tl.exp2(x - m)
            above += tl.sum(tl.where(e[None, :] > p_c[:, None], e[None, :], 0.0), 1)
        inside = (above <= top_p * s) & (cand < C)
        first_inside = tl.min(tl.where(inside, cand, CP), 0)
        pick = tl.sum(tl.where(cand == first_inside, picked, 0), 0)
        pick = tl.where(first_inside < CP, pick, best)
        tl.store(out + row, pick.to(tl.int64))


def nucleus_from_logits(logits: Tensor, temperature: float, top_p: float, uniforms: Tensor,
                        vocab_limit: int | None = None) -> Tensor:
    """logits [B, V], uniforms [B, C] fp32 -> ids [B] (int64): `generator.nucleus_from_uniforms` of
    softmax(logits[:, :vocab_limit] / temperature) in one launch. No host sync."""
    b, v = logits.shape
    v = min(v, vocab_limit or v)
    c = uniforms.shape[1]
    assert logits.stride(1) == 1 and uniforms.stride(1) == 1 and uniforms.shape[0] == b, (logits.stride(),
                                                                                           uniforms.shape)
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    _nucleus_kernel[(b,)](logits, logits.stride(0), v, uniforms, uniforms.stride(0), out, c,
                          math.log2(math.e) / temperature, top_p, BLOCK=BLOCK_V, CP=max(2, pow2(c)), num_warps=8)
    return out
