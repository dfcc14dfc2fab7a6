"""Data-parallel scaling of the drafter trainer: one row per (world size, ZeRO stage) run, launched by torchrun.

    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu_train.py --device cpu --shape tiny --steps 2   (CPU, gloo)
    torchrun --nproc-per-node 8 benchmarks/bench_multi_gpu_train.py --device cuda --shape qwen3-8b --zero-stage 3 \\
        --json out/train.jsonl
    python benchmarks/bench_multi_gpu_train.py --summarize out/train.jsonl      (table + scaling efficiency)

Every rank runs what `drafter train` runs per optimizer step: `train.distributed.init_distributed` (the same
torchrun / SLURM environment handling a multi-node `srun` job uses), `build_engine` (DeepSpeed ZeRO-`stage`,
bf16 + fp32 master weights on GPU) and `train_step` (global loss normalisation, one all-reduce of the
statistics). Shapes, synthetic batches, features and the useful-FLOPs count come from benchmarks/bench_train.py
and train/metrics.py. Weak scaling: each rank takes `--seqs` sequences per optimizer step (its own random data,
seeded by rank), so tokens/s per GPU stays flat under perfect scaling.

Row: world size, ZeRO stage, ms per optimizer step, tokens/s per GPU, TFLOP/s and MFU per GPU, peak allocated
memory (max over ranks), and whether every rank ends with bit-identical weights (train.stage's replica check:
the sha256 of the full weights, gathered under ZeRO-3). Scaling efficiency (from --summarize) =
tokens/s at N / (N x tokens/s at 1) = tokens/s per GPU at N / tokens/s per GPU at 1, same stage and mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# NVLink multicast (NVLS) stays off on the lent H200 hosts; harmless elsewhere.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

from benchmarks.bench_train import SHAPES, device_features_fn, make_args, make_drafter, make_micro_batches, step_flops  # noqa: E402


def run(a) -> dict | None:
    """Build the engine, time `a.steps` optimizer steps after `a.warmup`, check replicas. The row (rank 0) or None."""
    from pipeline.config import TrainConfig
    from pipeline.errors import StageError
    from train.distributed import barrier, init_distributed
    from train.engine import TrainForward, build_engine, compile_layers
    from train.loss import default_gamma
    from train.metrics import peak_flops
    from train.step import train_step
    from train.trainer import replica_digests

    dist, device = init_distributed()
    world = dist.world_size
    shape = dict(SHAPES[a.shape])
    seqs = a.seqs or shape["seqs"]
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    attention = a.attention or ("flex" if gpu else "dense")
    per_row = min(a.per_row or (4 if gpu else 1), seqs)  # 4 x 3072 = the qwen3-8b config's micro_batch_tokens
    args = make_args(shape)
    mbs = make_micro_batches(shape, seqs, per_row, seed=dist.rank)  # each rank its own data
    features_of = device_features_fn(args, device, dtype)
    train_cfg = TrainConfig(zero_stage=a.zero_stage, precision="bf16" if gpu else "fp32", grad_accum=len(mbs),
                       ce_chunk_tokens=a.ce_chunk, lr=6e-4)
    drafter = make_drafter(args, device, dtype)
    if a.compile:
        compile_layers(drafter)
    engine, _, _ = build_engine(TrainForward(drafter), train_cfg, total_steps=a.steps + a.warmup, world_size=world,
                                device=device)
    gamma = default_gamma(args.block_size)

    def step():
        return train_step(engine, mbs, features_of, gamma=gamma, chunk_rows=a.ce_chunk, attention=attention,
                          world_size=world, device=device)[0]

    def sync():
        if gpu:
            torch.cuda.synchronize(device)
        barrier()

    stats = None
    for _ in range(a.warmup):
        stats = step()
    sync()
    t0 = time.perf_counter()
    tokens = 0.0
    for _ in range(a.steps):
        stats = step()
        tokens += stats.sums["tokens"]  # real tokens of the step, summed over ranks
    sync()
    dt = (time.perf_counter() - t0) / a.steps

    mem = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if gpu else 0.0,
                        torch.cuda.max_memory_reserved(device) / 2**30 if gpu else 0.0], dtype=torch.float64,
                       device=device)
    if world > 1:
        torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MAX)
    with tempfile.TemporaryDirectory() as scratch:  # the stage writes per-rank digest files; not kept here
        try:
            digests = replica_digests(drafter, Path(scratch), dist.rank, world, a.zero_stage == 3)
            identical = True
        except StageError as e:
            digests, identical = [str(e)], False
    if not dist.is_main:
        return None
    flops = step_flops(args, mbs)  # this rank's micro-batches; every rank has the same shapes
    peak = peak_flops(device, "bf16" if gpu else "fp32")
    return {
        "world_size": world, "zero_stage": a.zero_stage, "compile": bool(a.compile), "attention": attention,
        "launcher": dist.source, "device": torch.cuda.get_device_name(device) if gpu else "cpu", "shape": a.shape,
        "seqs_per_gpu": seqs, "seqs_per_row": per_row, "seq_len": shape["seq_len"], "anchors": shape["anchors"],
        "steps": a.steps, "warmup": a.warmup, "ms_per_step": 1e3 * dt,
        "tokens_per_s_per_gpu": tokens / a.steps / world / dt, "tflops_per_gpu": flops / dt / 1e12,
        "mfu": flops / dt / peak if peak else None,
        "peak_alloc_gib": float(mem[0]) if gpu else None, "peak_reserved_gib": float(mem[1]) if gpu else None,
        "weights_identical": identical, "weights_sha256": digests[0], "loss": stats.loss if stats else None,
    }


# ----------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------

HEADER = (f"{'GPUs':>4s} {'ZeRO':>4s} {'mode':>7s} {'ms/step':>9s} {'tok/s/GPU':>10s} {'TFLOP/s/GPU':>11s} "
          f"{'MFU':>6s} {'peak GiB':>8s} {'identical':>9s} {'efficiency':>10s}")


def mode(r: dict) -> str:
    return "compile" if r["compile"] else "eager"


def format_row(r: dict, efficiency: float | None = None) -> str:
    if not r.get("ok", True):
        return f"{r['world_size']:4d} {r['zero_stage']:4d} {r.get('mode', '-'):>7s} FAILED: {r.get('error', '')}"
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
    mem = f"{r['peak_alloc_gib']:.1f}" if r["peak_alloc_gib"] is not None else "-"
    eff = f"{100 * efficiency:.1f}%" if efficiency is not None else "-"
    return (f"{r['world_size']:4d} {r['zero_stage']:4d} {mode(r):>7s} {r['ms_per_step']:9.1f} "
            f"{r['tokens_per_s_per_gpu']:10.0f} {r['tflops_per_gpu']:11.2f} {mfu:>6s} {mem:>8s} "
            f"{'yes' if r['weights_identical'] else 'NO':>9s} {eff:>10s}")


def scaling_efficiency(rows: list[dict], r: dict) -> float | None:
    """tokens/s at N / (N x tokens/s at 1) for the 1-rank row of the same stage, mode and per-GPU batch."""
    if not r.get("ok", True):
        return None
    key = lambda x: (x["zero_stage"], x["compile"], x["attention"], x["shape"], x["seqs_per_gpu"], x["seqs_per_row"])  # noqa: E731
    base = [x for x in rows if x.get("ok", True) and x["world_size"] == 1 and key(x) == key(r)]
    if not base:
        return None
    return r["tokens_per_s_per_gpu"] / base[-1]["tokens_per_s_per_gpu"]


def summarize(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ok = [r for r in rows if r.get("ok", True)]
    lines = []
    if ok:
        r = ok[0]
        lines.append(f"drafter training, shape {r['shape']} on {r['device']}: seq {r['seq_len']}, {r['anchors']} anchors, "
                     f"{r['seqs_per_gpu']} sequences per GPU per step ({r['seqs_per_row']} per micro-batch), "
                     f"{r['attention']} attention, timed {r['steps']} steps after {r['warmup']}")
    lines.append(HEADER)
    lines += [format_row(r, scaling_efficiency(rows, r)) for r in rows]
    lines.append("efficiency = tokens/s at N / (N x tokens/s at 1 GPU), same ZeRO stage and mode")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--seqs", type=int, default=None, help="sequences per GPU per optimizer step (default: the shape's)")
    p.add_argument("--per-row", type=int, default=None,
                   help="sequences packed per micro-batch (default 4 on cuda = micro_batch_tokens 12288; 1 on cpu)")
    p.add_argument("--attention", default=None, choices=["flex", "dense"], help="default: flex on cuda, dense on cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the draft layers (default: on for cuda)")
    p.add_argument("--ce-chunk", type=int, default=4096, help="rows per chunk of the LM-head cross-entropy")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator)")
    p.add_argument("--json", default=None, help="rank 0 appends its row here (JSON lines)")
    p.add_argument("--summarize", default=None, metavar="JSONL", help="print the table of a results file and exit")
    a = p.parse_args()
    if a.summarize:
        print(summarize(Path(a.summarize)))
        return 0
    if a.compile is None:
        a.compile = a.device == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", a.device)
    row = run(a)
    if row is not None:
        row["ok"] = True
        print(HEADER)
        print(format_row(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
