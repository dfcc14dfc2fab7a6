"""pipeline/regen/varlen_attention.py: one decode step's attention over each row's own range of slots.

The torch reference equals plain softmax attention computed row by row in fp64 from the slices, and reads no host
value (it runs on meta tensors); the Triton kernel equals the reference in Triton's CPU interpreter (slots outside
each row's range hold NaN: it never reads them), compiles for an sm_90 GPU without one, and, on the GPU machine,
equals the reference at the regen decoder's sizes and replays in a CUDA graph with new ranges.
`benchmarks/bench_decode_attention.py` runs on the CPU with tiny sizes and prints its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.regen.varlen_attention import varlen_decode_attention, varlen_decode_attention_reference
from pipeline.triton_runtime import triton
from tests.conftest import REPO

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def per_row_attention(query, key, value, start, end, scale):
    """The oracle: for each row and KV head, softmax(q k^T * scale) v over the slice [start, end) in fp64; zeros for
    an empty row. query [B, Hk, G, D], key / value [B, Hk, L, D] -> fp64 [B, Hk, G, D]."""
    B, Hk, G, D = query.shape
    out = torch.zeros(B, Hk, G, D, dtype=torch.float64)
    for b in range(B):
        s, e = int(start[b]), int(end[b])
        if s == e:
            continue
        for h in range(Hk):
            q = query[b, h].double()
            k, v = key[b, h, s:e].double(), value[b, h, s:e].double()
            out[b, h] = torch.softmax(q @ k.T * scale, dim=-1) @ v
    return out


def random_ranges(gen, B, L, index_dtype=torch.long):
    """start / end [B] with 0 <= start <= end <= L: random, plus the edge cases on the first rows: empty in the
    middle, the whole row, start > 0 with end == L, empty at slot 0, empty at L, one slot."""
    ends = torch.randint(0, L + 1, (2, B), generator=gen).sort(dim=0).values
    start, end = ends[0].clone(), ends[1].clone()
    edges = [(L // 2, L // 2), (0, L), (L // 3 + 1, L), (0, 0), (L, L), (L - 1, L)]
    for b, (s, e) in enumerate(edges[:B]):
        start[b], end[b] = s, e
    return start.to(index_dtype), end.to(index_dtype)


def random_case(gen, B, Hk, G, D, L, dtype, index_dtype=torch.long, dead=None, device="cpu"):
    """query [B, Hk, G, D] and key / value as strided views `buf[k_or_v, :B, :, :L]` of one [2, B + 3, Hk, L + 7, D]
    buffer (the slot buffers' layout: rows and heads strided, a row's slots contiguous), with random ranges. Slots
    outside a row's range (and the buffer's extra rows and slots) are set to `dead` when given."""
    start, end = random_ranges(gen, B, L, index_dtype)
    buf = torch.randn(2, B + 3, Hk, L + 7, D, generator=gen)
    query = torch.randn(B, Hk, G, D, generator=gen)
    if dead is not None:
        slots = torch.arange(L + 7)
        rows = torch.arange(B + 3)
        live = torch.zeros(B + 3, L + 7, dtype=torch.bool)
        live[:B] = (slots >= start[:, None].long()) & (slots < end[:, None].long())
        live &= (rows < B)[:, None]
        buf = torch.where(live[None, :, None, :, None], buf, torch.tensor(dead))
    buf = buf.to(device=device, dtype=dtype)
    key, value = buf[0, :B, :, :L], buf[1, :B, :, :L]
    return query.to(device=device, dtype=dtype), key, value, start.to(device), end.to(device)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_reference_equals_per_row_softmax_attention_in_fp64(G, dtype, index_dtype):
    gen = torch.Generator().manual_seed(G * 10 + (dtype == torch.bfloat16) + (index_dtype == torch.int32) * 100)
    for trial in range(4):
        B, Hk, D, L = 9, 2, 16, int(torch.randint(1, 50, (1,), generator=gen))
        query, key, value, start, end = random_case(gen, B, Hk, G, D, L, dtype, index_dtype)
        assert not key.is_contiguous()  # a view of the bigger slot buffer
        scale = D ** -0.5
        got = varlen_decode_attention_reference(query, key, value, start, end, scale)
        assert got.shape == (B, Hk, G, D) and got.dtype == dtype
        assert torch.isfinite(got).all()
        want = per_row_attention(query, key, value, start, end, scale)
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype], msg=f"trial {trial}")
        empty = (start == end).tolist()
        assert all(bool((got[b] == 0).all()) for b in range(B) if empty[b])


def test_reference_reads_no_host_value_of_start_and_end():
    """The reference runs on meta tensors (shapes, no data): a `.item()` / `.tolist()` of start / end or a
    data-dependent shape (boolean indexing, nonzero) raises there. So it launches the same work whatever the ranges
    hold, with no sync: a CUDA graph captures it and replays it with new ranges written into the same tensors."""
    gen = torch.Generator().manual_seed(7)
    for dtype, index_dtype in ((torch.bfloat16, torch.int32), (torch.float32, torch.int64)):
        query, key, value, start, end = (t.to("meta") for t in random_case(gen, 6, 2, 3, 16, 30, dtype, index_dtype))
        out = varlen_decode_attention_reference(query, key, value, start, end, 0.25)
        assert out.device.type == "meta" and out.shape == (6, 2, 3, 16) and out.dtype == dtype
    with pytest.raises((RuntimeError, NotImplementedError)):  # what the meta device does with a host read
        start.max().item()


def test_dispatch_off_cuda_is_the_reference():
    gen = torch.Generator().manual_seed(3)
    query, key, value, start, end = random_case(gen, 5, 2, 3, 16, 20, torch.bfloat16)
    torch.testing.assert_close(varlen_decode_attention(query, key, value, start, end, 0.3),
                               varlen_decode_attention_reference(query, key, value, start, end, 0.3), atol=0, rtol=0)


def check_kernel_equals_reference(device: str = "cpu"):
    """The kernel equals the reference with NaN in every slot outside the rows' ranges (the reference gets the same
    tensors with zeros there): it reads only [start, end) of each row. CPU (interpreter): small shapes and a small
    BLOCK_L, so rows span several blocks; CUDA: the regen decoder's sizes (SmolLM2-135M's heads, L 1536)."""
    from pipeline.regen import varlen_attention

    gen = torch.Generator().manual_seed(11)
    cases = [  # B, Hk, G, D, L, dtype, index dtype, config, fp32 dot operands
        (7, 2, 3, 16, 40, torch.float32, torch.int64, (16, 1, 1), True),
        (7, 2, 3, 16, 40, torch.bfloat16, torch.int32, (16, 1, 1), True),
        (6, 1, 1, 32, 33, torch.bfloat16, torch.int64, (8, 1, 1), True),
        (6, 2, 4, 16, 20, torch.float32, torch.int32, None, True),
    ] if device == "cpu" else [
        (256, 3, 3, 64, 1536, torch.bfloat16, torch.int64, None, True),
        (256, 3, 3, 64, 1536, torch.bfloat16, torch.int32, None, False),
        (256, 3, 3, 64, 1536, torch.float32, torch.int64, None, True),
        (64, 2, 4, 128, 700, torch.float16, torch.int32, None, True),
        (64, 2, 4, 128, 700, torch.float16, torch.int32, None, False),
        (64, 3, 1, 64, 1536, torch.bfloat16, torch.int64, (32, 2, 2), True),
        (64, 3, 3, 64, 1536, torch.bfloat16, torch.int64, (128, 4, 3), False),
    ]
    for B, Hk, G, D, L, dtype, index_dtype, config, dot_fp32 in cases:
        query, key, value, start, end = random_case(gen, B, Hk, G, D, L, dtype, index_dtype, dead=float("nan"),
                                                    device=device)
        clean_k, clean_v = torch.nan_to_num(key, nan=0.0), torch.nan_to_num(value, nan=0.0)
        scale = D ** -0.5
        got = varlen_attention.varlen_decode_attention_triton(query, key, value, start, end, scale, config, dot_fp32)
        want = varlen_decode_attention_reference(query, clean_k, clean_v, start, end, scale)
        assert got.dtype == dtype and torch.isfinite(got).all(), (B, G, dtype)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=f"{(B, Hk, G, D, L, dtype, index_dtype, config, dot_fp32)}")
        empty = start == end
        assert (got[empty] == 0).all()


CHECKS = ["check_kernel_equals_reference"]


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernel is checked compiled (below); the "
                    "GPU image's Triton 3.6 interpreter cannot run loops with a runtime bound under NumPy 2.4")
@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_equals_reference_in_the_interpreter(check):
    from tests.eval.test_triton_kernels import run_interpreted

    run_interpreted(check, module="tests.pipeline.test_varlen_attention", group=tuple(CHECKS))


I, F = "i32", "fp32"
STRIDES = dict(stride_qb=I, stride_qh=I, stride_qg=I, stride_kb=I, stride_kh=I, stride_kl=I, stride_vb=I, stride_vh=I,
               stride_vl=I)
COMPILED = [  # (cache dtype, index dtype, G, constants): the launcher's argument types; G = 1 is compiled as a constant
    ("*bf16", "*i64", I, dict(D=64, GP=16, BLOCK_L=64, PRECISION="tf32", DOT_FP32=True)),
    ("*bf16", "*i32", "1", dict(D=64, GP=16, BLOCK_L=64, PRECISION="tf32", DOT_FP32=True)),
    ("*fp16", "*i32", I, dict(D=128, GP=16, BLOCK_L=32, PRECISION="tf32", DOT_FP32=True)),
    ("*fp32", "*i64", I, dict(D=64, GP=16, BLOCK_L=64, PRECISION="ieee", DOT_FP32=True)),
    ("*bf16", "*i64", I, dict(D=64, GP=16, BLOCK_L=64, PRECISION="tf32", DOT_FP32=False)),
    ("*fp16", "*i32", I, dict(D=128, GP=16, BLOCK_L=128, PRECISION="tf32", DOT_FP32=False)),
]


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.parametrize("cache,index,G,constants", COMPILED, ids=[f"{c[0][1:]}-{c[1][1:]}-G{c[2]}-D{c[3]['D']}-{i}"
                                                                   for i, c in enumerate(COMPILED)])
def test_kernel_compiles_for_an_sm90_gpu_without_one(cache, index, G, constants):
    from pipeline.regen import varlen_attention
    from tests.eval.test_triton_kernels import compile_for_sm90

    signature = dict(q=cache, k=cache, v=cache, start_ptr=index, end_ptr=index, out=cache, G=G, **STRIDES, scale=F)
    if G != I:
        constants = {**constants, "G": int(G)}
    compile_for_sm90(varlen_attention._varlen_decode_attention_kernel, signature, constants)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA (run on the GPU machine)")
def test_kernel_equals_reference_on_cuda():
    check_kernel_equals_reference(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA (run on the GPU machine)")
def test_dispatch_replays_in_a_cuda_graph_with_new_ranges():
    """`varlen_decode_attention` (the kernel on CUDA) captured once, replayed after new start / end are written into
    the same tensors: equals the reference for each new range, as the decoder's captured step needs."""
    from pipeline import triton_runtime

    assert triton_runtime.available("cuda")
    gen = torch.Generator().manual_seed(5)
    query, key, value, start, end = random_case(gen, 256, 3, 3, 64, 1536, torch.bfloat16, device="cuda")
    varlen_decode_attention(query, key, value, start, end, 0.125)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = varlen_decode_attention(query, key, value, start, end, 0.125)
    for trial in range(3):
        new_start, new_end = random_ranges(gen, 256, 1536)
        start.copy_(new_start.roll(trial))
        end.copy_(new_end.roll(trial))
        graph.replay()
        torch.testing.assert_close(out.float(), varlen_decode_attention_reference(query, key, value, start, end,
                                                                                  0.125).float(), atol=2e-2, rtol=2e-2)
    assert triton_runtime.available("cuda")  # the kernel ran, no fallback


@pytest.mark.slow
def test_decode_attention_benchmark_prints_its_table_on_cpu(tmp_path):
    """`benchmarks/bench_decode_attention.py --device cpu` with tiny sizes: a row per (method, batch) for the reference
    and the shared-live bmm's (no Triton off CUDA), the same answer from both, and the JSON record."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_decode_attention.py", "--device", "cpu", "--batches", "3,5", "--length",
           "48", "--lengths", "4,30", "--hk", "2", "--g", "3", "--d", "16", "--iters", "2", "--warmup", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "method" and set(table[1]) <= set("|-: ")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table[2:]]
    assert [(r[0], r[1]) for r in rows] == [("torch reference", "3"), ("shared-live bmm", "3"),
                                            ("torch reference", "5"), ("shared-live bmm", "5")]
    record = json.loads(out.read_text())
    assert [(r["method"], r["batch"]) for r in record["rows"]] == [(r[0], int(r[1])) for r in rows]
    assert all(r["us"] > 0 and r["useful_gbs"] > 0 and r["max_abs_diff"] < 1e-2 for r in record["rows"])
