"""One decode step's attention of ONE layer over rows of different lengths in a static K/V cache: what each way of
computing it costs, against the K/V bytes the rows actually hold.

Shape (default SmolLM2-135M's attention: Hk 3 KV heads, G 3 query heads per KV head, head dim 64), a slot buffer of
L 1536 slots per row, row b holding slots [0, end[b]) with end[b] uniform in --lengths (default [64, 640], a mean
context near 350: a continuous-batching decoder's rows at different points of their answers). Rows of the table:

  torch reference   `varlen_decode_attention_reference`: masked attention over all L slots (the CPU path)
  triton kernel     `varlen_decode_attention_triton`: each row reads its own slots only (CUDA; one row per
                    `--configs` entry as "triton BLxWxS" when given); "(bf16 dot)": the same with the products
                    on bf16 operands (`dot_fp32=False`) instead of fp32 ones
  shared-live bmm   `static_decode.decode_attention` (two batched GEMMs) over the first max(end) slots of every row
                    with an additive mask: what attending over one shared live length costs

Columns: time per call (median of --iters after --warmup calls; CUDA events on CUDA, wall clock on CPU), the K/V
bytes the method reads, "useful GB/s" = the rows' own K/V bytes (sum over rows of end - start, x Hk x D x 2 tensors
x element size) per second, and the largest difference from the reference.

    python benchmarks/bench_decode_attention.py --json $OUT/decode_attention.json
    python benchmarks/bench_decode_attention.py --device cpu --batches 4 --length 64 --lengths 4,40 --d 16 --iters 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import triton_runtime  # noqa: E402
from pipeline.regen.static_decode import decode_attention  # noqa: E402
from pipeline.regen.varlen_attention import varlen_decode_attention_reference, \
    varlen_decode_attention_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_us(device: torch.device, fn, warmup: int, iters: int) -> float:
    """Median microseconds of one fn() call: CUDA events around each call on CUDA, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            finish.record()
            finish.synchronize()
            times.append(begin.elapsed_time(finish) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def bench_batch(args, device: torch.device, batch: int, gen: torch.Generator) -> list[dict]:
    """The rows of one batch size: [B, Hk, L, D] K/V (a view of a buffer with spare rows, as the slot buffers are),
    query [B, Hk, G, D], ranges [0, end[b])."""
    dtype = DTYPES[args.dtype]
    hk, g, d, length = args.hk, args.g, args.d, args.length
    lo, hi = (int(x) for x in args.lengths.split(","))
    assert 0 < lo <= hi <= length, (lo, hi, length)
    end = torch.randint(lo, hi + 1, (batch,), generator=gen)
    start = torch.zeros_like(end)
    buf = torch.randn(2, batch + 1, hk, length, d, generator=gen).to(device=device, dtype=dtype)
    key, value = buf[0, :batch], buf[1, :batch]
    query = torch.randn(batch, hk, g, d, generator=gen).to(device=device, dtype=dtype)
    scale = d ** -0.5
    live = int(end.max())
    slots = torch.arange(live)
    mask = torch.where((slots >= start[:, None]) & (slots < end[:, None]), 0.0, float("-inf"))
    mask = mask.view(batch, 1, 1, live).to(device)
    start, end = start.to(device), end.to(device)

    per_slot = hk * d * 2 * buf.element_size()  # K and V bytes of one slot of one row
    useful = int((end - start).sum()) * per_slot
    methods = [("torch reference", batch * length * per_slot,
                lambda: varlen_decode_attention_reference(query, key, value, start, end, scale))]
    if triton_runtime.available(device):
        configs = [None] + [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
        for config in configs:
            name = "triton kernel" if config is None else "triton " + "x".join(map(str, config))
            for fp32 in (True, False) if dtype != torch.float32 else (True,):
                methods.append((name + ("" if fp32 else f" ({args.dtype} dot)"), useful,
                                lambda c=config, f=fp32: varlen_decode_attention_triton(query, key, value, start, end,
                                                                                        scale, c, f)))
    methods.append(("shared-live bmm", batch * live * per_slot,
                    lambda: decode_attention(query, key[:, :, :live], value[:, :, :live], mask, scale)))

    ref = methods[0][2]().float()
    rows = []
    for name, read, fn in methods:
        diff = float((fn().float() - ref).abs().max())
        us = time_us(device, fn, args.warmup, args.iters)
        rows.append(dict(method=name, batch=batch, live=live, mean_len=float((end - start).float().mean()), us=us,
                         read_mb=read / 1e6, useful_mb=useful / 1e6, useful_gbs=useful / us / 1e3,
                         max_abs_diff=diff))
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="256,1024", help="comma-separated batch sizes")
    parser.add_argument("--length", type=int, default=1536, help="L: slots per row of the buffer")
    parser.add_argument("--lengths", default="64,640", help="min,max of a row's end (uniform, inclusive)")
    parser.add_argument("--hk", type=int, default=3, help="KV heads")
    parser.add_argument("--g", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--d", type=int, default=64, help="head dim")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--configs", default="", help="extra Triton configs BLOCK_LxWARPSxSTAGES, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows and the environment here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    rows = [row for batch in (int(b) for b in args.batches.split(",")) for row in bench_batch(args, device, batch, gen)]

    print(f"one layer: Hk {args.hk}, G {args.g}, D {args.d}, L {args.length}, {args.dtype}, row lengths uniform in "
          f"[{args.lengths}], {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print()
    print("| method | B | live | mean len | us / call | K/V read (MB) | useful GB/s | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['live']} | {r['mean_len']:.0f} | {r['us']:.1f} | "
              f"{r['read_mb']:.1f} | {r['useful_gbs']:.1f} | {r['max_abs_diff']:.2e} |")
    if args.json:
        env = dict(device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   torch=torch.__version__, triton=getattr(triton_runtime.triton, "__version__", None),
                   hk=args.hk, g=args.g, d=args.d, length=args.length, lengths=args.lengths, dtype=args.dtype,
                   iters=args.iters, warmup=args.warmup)
        args.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
