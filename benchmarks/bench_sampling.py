"""The sampled regen step's draw alone: top-p sampling of a [batch, vocab] logits block, the way the static decoder
calls it once per generated position (`pipeline.regen.generator.sample_next`), timed per call.

Rows, per batch size, each a median over `--iters` calls between two syncs:

  greedy       argmax (what a greedy run pays)
  sorted       `sample_sorted`: the whole vocabulary sorted, cumulative mass, multinomial (the former top-p path)
  sort-free    `sample_nucleus`: candidates drawn from the softmax, a binary search over them for the nucleus's
               edge (the top-p path of `sample_next` where top_p allows it, in torch)
  kernel       the same draw as one Triton kernel over the bf16 logits (`sample_next` on CUDA; CUDA only)

Both are timed from the logits, temperature and the sort-free path's softmax included, as `sample_next` runs them.

The logits are random (`--scale` sets how peaked: the median nucleus size is printed); the sort and the passes of
the sort-free draw cost the same whatever the distribution. Each row's draws are checked against the other path's
distribution on one row repeated (`--check` draws, 4,096 rows at a time): the largest difference of frequency by
decile of the nucleus.

    python benchmarks/bench_sampling.py --device cuda --json $OUT/sampling.json
    python benchmarks/bench_sampling.py --device cpu --batches 8 --vocab 512 --iters 2 --check 2000   # a smoke run
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
from pipeline.regen.generator import (  # noqa: E402
    Sampling, nucleus_candidates, nucleus_probs, sample_next, sample_nucleus, sample_sorted,
)


def timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of fn() over `iters` calls, each between two syncs, after one untimed call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def draws(draw, n: int, chunk: int = 4096) -> torch.Tensor:
    """n ids from draw(rows) -> ids [rows], `chunk` rows at a time (a [200K, 49,152] block would not fit)."""
    return torch.cat([draw(min(chunk, n - i)) for i in range(0, n, chunk)])


def decile_gap(draws: torch.Tensor, want: torch.Tensor) -> float:
    """draws [N] ids, want [V] the nucleus distribution -> the largest |frequency - mass| over the nucleus's
    ids split into ten groups by probability (1.0 when a draw fell outside the nucleus)."""
    freq = torch.bincount(draws, minlength=want.numel()).double() / draws.numel()
    if (freq[want == 0] > 0).any():
        return 1.0
    kept = want.nonzero().flatten()
    groups = kept[want[kept].argsort(descending=True)].tensor_split(10)
    return max(abs(float(freq[g].sum() - want[g].sum())) for g in groups)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check", type=int, default=200_000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p)
    candidates = nucleus_candidates(args.top_p)
    if not candidates:
        sys.exit(f"top_p {args.top_p}: too small for the sort-free draw (it sorts); pick >= 0.35")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = torch.randn(batch, args.vocab, device=device, generator=gen) * args.scale
        scaled = logits / sampling.temperature
        t = sampling.temperature  # each path timed from the logits, as `sample_next` runs it (temperature, softmax)
        nucleus = int((nucleus_probs(logits[:64], sampling) > 0).sum(-1).float().median())
        row = {
            "batch": batch, "vocab": args.vocab, "nucleus_ids_median": nucleus, "candidates": candidates,
            "greedy_ms": timed(lambda: logits.argmax(-1), device, args.iters),
            "sorted_ms": timed(lambda: sample_sorted(logits / t, sampling, gen), device, args.iters),
            "sort_free_ms": timed(lambda: sample_nucleus((logits / t).softmax(-1), sampling.top_p, candidates, gen),
                                  device, args.iters),
        }
        kernel = triton_runtime.available(device)
        if kernel:  # from the logits in the model's dtype, as a decode step hands them over
            half = logits.to(torch.bfloat16)
            row["kernel_ms"] = timed(lambda: sample_next(half, sampling, gen), device, args.iters)
        want = nucleus_probs(logits[:1], sampling)[0].double()
        one = scaled[:1]
        row["sorted_gap"] = decile_gap(draws(lambda n: sample_sorted(one.expand(n, -1), sampling, gen), args.check),
                                       want)
        row["sort_free_gap"] = decile_gap(draws(lambda n: sample_nucleus(
            one.softmax(-1).expand(n, -1), sampling.top_p, candidates, gen), args.check), want)
        if kernel:  # checked on fp32 logits: bf16 ties at the nucleus's edge are all inside for the sort-free
            # rule, where the sorted reference keeps those its sort puts first
            row["kernel_gap"] = decile_gap(draws(lambda n: sample_next(logits[:1].expand(n, -1).contiguous(),
                                                                       sampling, gen), args.check), want)
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"top-p {args.top_p}, temperature {args.temperature}, vocab {args.vocab}, {candidates} candidates, {name}")
    print("| batch | nucleus ids (median) | greedy ms | sorted ms | sort-free ms | kernel ms | sorted / sort-free "
          "| decile gap sorted / sort-free / kernel |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        kernel_ms = f"{r['kernel_ms']:.3f}" if "kernel_ms" in r else "-"
        kernel_gap = f"{r['kernel_gap']:.4f}" if "kernel_gap" in r else "-"
        print(f"| {r['batch']} | {r['nucleus_ids_median']} | {r['greedy_ms']:.3f} | {r['sorted_ms']:.3f} "
              f"| {r['sort_free_ms']:.3f} | {kernel_ms} | {r['sorted_ms'] / r['sort_free_ms']:.2f}x "
              f"| {r['sorted_gap']:.4f} / {r['sort_free_gap']:.4f} / {kernel_gap} |")
    result = {"device": name, "top_p": args.top_p, "temperature": args.temperature, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
