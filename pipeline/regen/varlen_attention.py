"""One decode step's attention over a per-row range of slots of a static K/V cache.

    query   [B, Hk, G, D]   the G query heads that share each of the Hk KV heads (bf16 / fp16 / fp32)
    key     [B, Hk, L, D]   slot buffers (views allowed: a row's L slots contiguous D-vectors, rows / heads strided)
    value   [B, Hk, L, D]
    start   [B] int         row b attends over slots start[b] .. end[b]-1 only; 0 <= start <= end <= L
    end     [B] int         (int32 or int64, on the device)
    ->      [B, Hk, G, D]   in query's dtype; softmax(q . k * scale) @ v over the row's slots, zeros for an empty row

Why: a continuous-batching decoder keeps sequences of very different lengths in one slot buffer (a new request
takes the rows a finished one freed). Attention over a shared live length (the first `live` slots of every row,
`static_decode.decode_attention`) reads every row up to the longest one; this reads each row's own slots only, so a
step's K/V traffic is the sum of the rows' lengths instead of B x the longest.

Invariants (tests/pipeline/test_varlen_attention.py):
  - `varlen_decode_attention_triton` equals `varlen_decode_attention_reference` (scores, softmax and the P@V
    accumulation in fp32; the probabilities meet V in V's dtype in both);
  - the Triton kernel reads only slots [start[b], end[b]) of row b, each once per (row, KV head): slots outside
    may hold anything, NaN included. The reference reads all L slots (masked), so for it they must be finite;
  - neither reads a host value of start / end (no sync, fixed shapes): both can be captured in a CUDA graph and
    replayed with new start / end written into the same tensors.

`varlen_decode_attention` takes the kernel on CUDA (`pipeline.triton_runtime`: off after any kernel failure, and
on installs without Triton) and the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pipeline import triton_runtime
from pipeline.triton_runtime import tl, triton

# BLOCK_L (slots per loop step), warps, pipeline stages: one program per (row, KV head) streams its slots
CONFIG = (64, 4, 3)


@functools.cache
def bmm_has_fp32_output(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.bmm(a, b, out_dtype=torch.float32)` works for `dtype` inputs on this device type (fp32 scores
    from bf16 / fp16 K without copying it)."""
    try:
        a = torch.ones(1, 1, 8, device=device_type, dtype=dtype)
        return torch.bmm(a, a.mT, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _bmm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for [N, M, K] x [N, K, P] with an fp32 result accumulated in fp32, without upcasting the (large) b
    where CUDA's bmm takes `out_dtype`."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda and a.dtype == b.dtype and bmm_has_fp32_output(a.device.type, a.dtype):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def varlen_decode_attention_reference(query: Tensor, key: Tensor, value: Tensor, start: Tensor, end: Tensor,
                                      scale: float) -> Tensor:
    """query [B, Hk, G, D], key / value [B, Hk, L, D], start / end int [B] -> [B, Hk, G, D] (query's dtype): row b
    attends over slots [start[b], end[b]) only; an empty row gives zeros.

    Torch only, fixed shapes, no host read of start / end (the mask is `arange(L)` compared with them): capturable
    in a CUDA graph. Reads all L slots of every row (masked), so slots outside the ranges must be finite. Scores
    and softmax in fp32, probabilities cast to V's dtype, P@V accumulated in fp32."""
    b, hk, g, d = query.shape
    length = key.shape[2]
    q = query.reshape(b * hk, g, d)
    k = key.reshape(b * hk, length, d)  # a view for slot-buffer slices (their batch and head strides merge)
    v = value.reshape(b * hk, length, d)
    slots = torch.arange(length, device=query.device)
    live = (slots >= start.reshape(b, 1)) & (slots < end.reshape(b, 1))  # [B, L]
    scores = _bmm_fp32(q.to(k.dtype), k.mT).view(b, hk, g, length).mul_(scale)
    scores = scores.masked_fill_(~live.view(b, 1, 1, length), float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # empty rows: exp(-inf - 0) = 0
    probs = torch.exp(scores.sub_(top))
    total = probs.sum(dim=-1, keepdim=True)
    probs = probs.div_(torch.where(total > 0, total, torch.ones_like(total)))
    out = _bmm_fp32(probs.to(value.dtype).view(b * hk, g, length), v)
    return out.view(b, hk, g, d).to(query.dtype)


if triton is not None:

    @triton.jit
    def _varlen_decode_attention_kernel(q, k, v, start_ptr, end_ptr, out, G,
                                        stride_qb, stride_qh, stride_qg,
                                        stride_kb, stride_kh, stride_kl,
                                        stride_vb, stride_vh, stride_vl,
                                        scale, D: tl.constexpr, GP: tl.constexpr, BLOCK_L: tl.constexpr,
                                        PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """Program (row b, KV head h): online softmax of the G query rows (padded to GP >= 16 for tl.dot, padding
        rows zero and never stored) over slots [start[b], end[b]) in blocks of BLOCK_L; out [B, Hk, G, D]
        contiguous. Slots outside the range are never loaded. DOT_FP32: both products take fp32 operands (bf16 and
        fp16 convert exactly to TF32, so PRECISION "tf32" gives the same products as a bf16 / fp16 MMA); else the
        operands stay in the cache dtype (the probabilities rounded to it either way)."""
        b, h = tl.program_id(0), tl.program_id(1)
        lo = tl.load(start_ptr + b).to(tl.int32)
        hi = tl.load(end_ptr + b).to(tl.int32)
        rows = tl.arange(0, GP)
        row_ok = rows < G
        d = tl.arange(0, D)
        qt = tl.load(q + b.to(tl.int64) * stride_qb + h * stride_qh + rows[:, None] * stride_qg + d[None, :],
                     mask=row_ok[:, None], other=0.0)
        kbase = k + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        vbase = v + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 of log2-scaled scores
        for first in range(lo, hi, BLOCK_L):
            slots = first + tl.arange(0, BLOCK_L)
            slot_ok = slots < hi
            kt = tl.load(kbase + slots[None, :] * stride_kl + d[:, None], mask=slot_ok[None, :], other=0.0)
            if DOT_FP32:
                sc = tl.dot(qt.to(tl.float32), kt.to(tl.float32), input_precision=PRECISION) * qk_scale
            else:
                sc = tl.dot(qt.to(kt.dtype), kt, input_precision=PRECISION) * qk_scale  # [GP, BLOCK_L] fp32
            sc = tl.where(slot_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(vbase + slots[:, None] * stride_vl + d[None, :], mask=slot_ok[:, None], other=0.0)
            if DOT_FP32:
                pv = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision=PRECISION)
            else:
                pv = tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty row: acc = 0, l = 0 -> zeros
        obase = (b.to(tl.int64) * tl.num_programs(1) + h) * G * D
        tl.store(out + obase + rows[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])


def varlen_decode_attention_triton(query: Tensor, key: Tensor, value: Tensor, start: Tensor, end: Tensor,
                                   scale: float, config: tuple[int, int, int] | None = None,
                                   dot_fp32: bool = True) -> Tensor:
    """`varlen_decode_attention_reference` as one launch of `_varlen_decode_attention_kernel` on a (B, Hk) grid.
    key / value: any batch / head / slot strides, D contiguous; D a power of two. config: (BLOCK_L, warps, stages),
    default `CONFIG`. No host read of start / end.

    dot_fp32 (default): the products on fp32 operands, the one path that also runs in Triton's interpreter (whose
    tl.dot multiplies bf16 bit patterns as integers: it keeps bf16 as uint16). False: bf16 / fp16 operands straight
    into the MMA, the same products (benchmarks/bench_decode_attention.py times both), compiled GPUs only."""
    b, hk, g, d = query.shape
    assert key.shape[:2] == (b, hk) and key.shape[3] == d and value.shape == key.shape, (query.shape, key.shape)
    assert d >= 16 and d & (d - 1) == 0, f"head dim {d} is not a power of two >= 16"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key / value must be contiguous in D"
    assert start.shape == (b,) and end.shape == (b,), (start.shape, end.shape)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(b, hk, g, d, dtype=query.dtype, device=query.device)
    block_l, warps, stages = config or CONFIG
    precision = "ieee" if key.dtype == torch.float32 else "tf32"  # fp32 inputs: exact products, not TF32
    _varlen_decode_attention_kernel[(b, hk)](
        query, key, value, start, end, out, g,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        scale, D=d, GP=max(16, triton_runtime.pow2(g)), BLOCK_L=block_l, PRECISION=precision, DOT_FP32=dot_fp32,
        num_warps=warps, num_stages=stages)
    return out


def varlen_decode_attention(query: Tensor, key: Tensor, value: Tensor, start: Tensor, end: Tensor,
                            scale: float) -> Tensor:
    """query [B, Hk, G, D], key / value [B, Hk, L, D], start / end int [B] -> [B, Hk, G, D]: the Triton kernel on
    CUDA (reads only each row's slots), the torch reference elsewhere or after a kernel failure."""
    if triton_runtime.available(query.device):
        out = triton_runtime.run(varlen_decode_attention_triton, query, key, value, start, end, scale)
        if out is not None:
            return out
    return varlen_decode_attention_reference(query, key, value, start, end, scale)
