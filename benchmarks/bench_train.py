"""Benchmark of the drafter training step: ms per sequence, MFU on useful FLOPs, peak memory, largest micro-batch.

    .venv/bin/python benchmarks/bench_train.py --shape tiny                                  (CPU, here)
    python benchmarks/bench_train.py --device cuda --shape qwen3-8b --variants trainer-flex-compile,bare-flex-compile

Shape qwen3-8b: the Qwen3-8B drafter (5 layers, D=4096, 32/8 heads, head_dim 128, intermediate 12288, 5 taps,
~1.05B trainable) with a random-init frozen embedding + LM head (vocab 151936), block 16, seq 3072, 512 anchors
per sequence, 16 sequences per optimizer step, synthetic bf16 features. Nothing is downloaded.

Paths:
  trainer  train.step.train_step: the real DeepSpeed engine (ZeRO stage --zero-stage, bf16 + fp32 master
           weights, grad clip 1.0, AdamW), exactly what `drafter train` runs per optimizer step;
  bare     plain PyTorch: bf16 parameters, forward_train + dflash_loss + backward + clip + fused AdamW.
Attention: flex packs all sequences of a step into one row (one BlockMask) unless -row<n> says otherwise; dense
(exact SDPA with a boolean mask, quadratic in the row) runs one sequence per row; the rows of a step are
gradient-accumulation micro-batches.

Useful FLOPs (train/metrics.py::train_flops), per micro-batch, a multiply-add = 2 FLOPs:
  fc         2*S*(n*D)*D                      forward + weight gradient                         x2
  per layer  2*Q*D*(2*q_dim) [q,o] + 2*(Q+S)*D*(2*kv_dim) [k,v on block + context rows]
             + 2*Q*3*D*I [SwiGLU]             forward + input gradient + weight gradient       x3
  attention  4*q_dim*sum_q(visible keys of q) (masked keys not counted)                          x3
  LM head    2*R*D*V over the R labelled rows forward + input gradient (frozen: no weight grad) x2
             (the work done too: train/loss.py computes the input gradient in the forward, no recompute)
  (Q = anchors*B query rows, S = context rows; norms/RoPE/softmax/CE not counted.)
MFU = useful FLOPs / step time / peak (H100/H200 dense bf16 989 TFLOP/s; --peak-tflops to override).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    "qwen3-8b": dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                     taps=5, block=16, seq_len=3072, anchors=512, seqs=16, target_layers=36, mask_id=151669),
    # SmolLM2-135M-Instruct's drafter as the H200 recipe trains it: 3 layers, 9/3 heads of 64, 5 taps of the 30-layer
    # target, block 16; ~50 regenerated samples of ~320 tokens per 16K-token step, every loss position an anchor
    "smollm2": dict(hidden=576, layers=3, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, taps=5,
                    block=16, seq_len=320, anchors=512, seqs=50, target_layers=30, mask_id=49151),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=320, taps=3,
                 block=8, seq_len=256, anchors=16, seqs=4, target_layers=8, mask_id=300),
}

# A variant name is <path>-<attention>[-compile][-ac][-ce<rows>][-row<n>], e.g. trainer-flex-compile-row4:
# path trainer|bare, attention flex|dense, torch.compile of the training forward (fusion, every layer step with its
# context K/V, final norm: train.engine.compile_layers), activation checkpointing, the rows
# per chunk of the chunked LM-head cross-entropy (default 4096; 1k = 1024), and sequences packed per micro-batch
# row (default: all of them for flex, 1 for dense; the rest is gradient accumulation). row4 = the qwen3-8b
# config's micro_batch_tokens 12288 at seq 3072.
GPU_DEFAULT = ["trainer-flex-compile", "trainer-flex-compile-row4", "bare-flex-compile", "trainer-dense",
               "bare-dense"]
CPU_DEFAULT = ["trainer-dense", "bare-dense", "trainer-dense-ac", "trainer-dense-ce1k", "trainer-dense-row2"]


@dataclass(frozen=True)
class Variant:
    path: str
    attention: str
    compile: bool = False
    ac: bool = False
    ce_chunk: int = 4096
    per_row: int | None = None

    @classmethod
    def parse(cls, name: str) -> "Variant":
        parts = name.split("-")
        if len(parts) < 2 or parts[0] not in ("trainer", "bare") or parts[1] not in ("flex", "dense"):
            raise ValueError(f"variant {name!r}: expected <trainer|bare>-<flex|dense>[-compile][-ac][-ce<rows>][-row<n>]")
        v = dict(path=parts[0], attention=parts[1])
        for flag in parts[2:]:
            if flag == "compile":
                v["compile"] = True
            elif flag == "ac":
                v["ac"] = True
            elif flag.startswith("row"):
                v["per_row"] = int(flag[3:])
            elif flag.startswith("ce"):
                v["ce_chunk"] = int(flag[2:].replace("k", "")) * (1024 if flag.endswith("k") else 1)
            else:
                raise ValueError(f"variant {name!r}: unknown flag {flag!r}")
        return cls(**v)


@dataclass
class Result:
    variant: str
    seqs: int
    ms_per_seq: float
    tflops_per_s: float
    mfu: float | None
    peak_mem_gib: float | None
    loss: float
    ok: bool = True
    error: str = ""


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def make_args(shape: dict):
    from train.model import DrafterArgs

    n = shape["taps"]
    L = shape["target_layers"]
    return DrafterArgs(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                       num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                       head_dim=shape["head_dim"], intermediate_size=shape["intermediate"], rms_norm_eps=1e-6,
                       rope_theta=1e6, vocab_size=shape["vocab"], block_size=shape["block"],
                       mask_token_id=shape["mask_id"], target_layer_ids=[round(1 + i * (L - 4) / (n - 1)) for i in range(n)],
                       num_target_layers=L)


def make_drafter(args, device, dtype, *, attach: bool = True):
    from train.model import DFlashDrafter

    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(args)
        if attach:  # random-init frozen target embedding and LM head (buffers, not trained)
            emb = torch.randn(args.vocab_size, args.hidden_size, dtype=dtype) * 0.02
            head = torch.randn(args.vocab_size, args.hidden_size, dtype=dtype) * 0.02
            drafter.attach_target_head(emb, head)
    return drafter


def make_micro_batches(shape: dict, seqs: int, per_row: int, seed: int = 0) -> list[dict]:
    """Collated micro-batches (train/data.py::collate) of `seqs` synthetic sequences, `per_row` packed per row.
    Loss on the last 90% of every sequence (the response); features are made on the device later."""
    from train.data import collate

    g = torch.Generator().manual_seed(seed)
    S = shape["seq_len"]
    samples = []
    for i in range(seqs):
        mask = torch.ones(S, dtype=torch.bool)
        mask[: S // 10] = False
        ids = torch.randint(0, shape["mask_id"], (S,), generator=g)
        samples.append({"id": f"bench/{i}", "input_ids": ids, "loss_mask": mask})
    kw = dict(block_size=shape["block"], num_anchors=shape["anchors"], mask_token_id=shape["mask_id"], seed=0, epoch=0)
    return [collate(samples[i : i + per_row], **kw) for i in range(0, seqs, per_row)]


def features_fn(args, device, dtype):
    width = args.num_taps * args.hidden_size
    cache: dict = {}

    def features_of(mb):
        S = mb["batch"].seq_len
        if S not in cache:  # synthetic target features, made once per row length (no host->device copy per step)
            cache[S] = torch.randn(1, S, width, device=device, dtype=dtype)
        return cache[S], mb["batch"].to(device)

    return features_of


def step_flops(args, micro_batches) -> float:
    from train.step import micro_batch_flops
    from train.metrics import DrafterShape

    shape = DrafterShape.from_args(args)
    return sum(micro_batch_flops(shape, mb["batch"]) for mb in micro_batches)


# ----------------------------------------------------------------------------------------------
# One variant
# ----------------------------------------------------------------------------------------------


def run_variant(name: str, shape: dict, seqs: int, device: torch.device, steps: int, warmup: int, zero_stage: int,
                peak: float | None, profile: bool = False) -> Result:
    from pipeline.config import TrainConfig
    from train.distributed import init_distributed
    from train.engine import TrainForward, build_engine, compile_layers
    from train.step import train_step
    from train.loss import dflash_loss, label_weights

    spec = Variant.parse(name)
    path, attention, compiled, chunk, ac = spec.path, spec.attention, spec.compile, spec.ce_chunk, spec.ac
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = make_args(shape)
    per_row = min(spec.per_row or (seqs if attention == "flex" else 1), seqs)
    mbs = make_micro_batches(shape, seqs, per_row)
    features_of = features_fn(args, device, dtype)
    gamma = 7.0 if args.block_size == 16 else 4.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    if path == "trainer":
        init_distributed()
        train_cfg = TrainConfig(zero_stage=zero_stage, precision="bf16" if dtype == torch.bfloat16 else "fp32",
                           grad_accum=len(mbs), ce_chunk_tokens=chunk, activation_checkpointing=ac, lr=6e-4)
        drafter = make_drafter(args, device, dtype)
        drafter.gradient_checkpointing = ac
        if compiled:
            compile_layers(drafter)
        engine, _, _ = build_engine(TrainForward(drafter), train_cfg, total_steps=steps + warmup, world_size=1,
                                    device=device)

        def step() -> float:
            stats, _ = train_step(engine, mbs, features_of, gamma=gamma, chunk_rows=chunk, attention=attention,
                                  world_size=1, device=device)
            return stats.loss
    else:
        drafter = make_drafter(args, device, dtype)
        drafter.to(dtype)
        drafter.gradient_checkpointing = ac
        if compiled:
            compile_layers(drafter)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0,
                                **({"fused": True} if device.type == "cuda" else {"foreach": True}))

        def step() -> float:
            total_w = float(sum(label_weights(mb["batch"], gamma).sum() for mb in mbs))
            loss_sum = 0.0
            for mb in mbs:
                features, batch = features_of(mb)
                hidden = drafter.forward_train(features, batch, attention)
                loss, _ = dflash_loss(hidden, drafter.lm_head_weight, batch, gamma, chunk, normalizer=total_w)
                loss.backward()
                loss_sum += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss_sum

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loss = float("nan")
    for _ in range(warmup):
        loss = step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    if profile:
        print_profile(step, sync, device)
    flops = step_flops(args, mbs)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return Result(name, seqs, 1e3 * dt / seqs, flops / dt / 1e12, (flops / dt / peak) if peak else None, mem, loss)


def print_profile(step, sync, device: torch.device, rows: int = 30) -> None:
    """One more step under torch.profiler: the ops with the most device (CUDA) or CPU self time, and the totals."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync()
    wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=rows), flush=True)
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
    print(f"profiled step: {1e3 * wall:.1f} ms wall, {1e3 * busy:.1f} ms device busy", flush=True)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _child(argv: list[str], timeout: int) -> dict:
    """Run one measurement in a fresh process (a clean GPU and allocator per variant; OOM cannot leak)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, __file__, *argv, "--child"], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=REPO)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (out.stderr or out.stdout)[-600:]
    oom = "out of memory" in (out.stderr + out.stdout).lower()
    return {"ok": False, "error": "OOM" if oom else tail.strip().splitlines()[-1] if tail.strip() else f"rc {out.returncode}"}


def largest_micro_batch(base: list[str], variant: str, start: int, limit: int, timeout: int) -> tuple[int, dict | None]:
    """Double the sequences packed in ONE micro-batch row until it fails (OOM), then bisect; a fresh process per
    trial."""
    import re

    stem = re.sub(r"-row\d+", "", variant)

    def trial(n: int) -> dict:
        return _child(base + ["--variants", f"{stem}-row{n}", "--seqs", str(n), "--steps", "2", "--warmup", "1"],
                      timeout)

    good, best, bad = 0, None, None
    n = start
    while n <= limit:
        r = trial(n)
        print(f"  {variant} seqs={n}: {'ok' if r.get('ok') else r.get('error')}", flush=True)
        if not r.get("ok"):
            bad = n
            break
        good, best, n = n, r, n * 2
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        r = trial(mid)
        print(f"  {variant} seqs={mid}: {'ok' if r.get('ok') else r.get('error')}", flush=True)
        if r.get("ok"):
            good, best = mid, r
        else:
            bad = mid
    return good, best


def print_table(results: list[dict]) -> None:
    print(f"\n{'variant':30s} {'seqs':>5s} {'ms/seq':>9s} {'TFLOP/s':>9s} {'MFU':>6s} {'peak GiB':>9s} {'loss':>9s}")
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:30s} {r.get('seqs', ''):>5} FAILED: {r.get('error', '')}")
            continue
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['variant']:30s} {r['seqs']:5d} {r['ms_per_seq']:9.2f} {r['tflops_per_s']:9.3f} {mfu:>6s} {mem:>9s} "
              f"{r['loss']:9.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--variants", default=None,
                   help="comma list of <trainer|bare>-<flex|dense>[-compile][-ac][-ce<rows>][-row<n>] (default: a set "
                        "per device)")
    p.add_argument("--seqs", type=int, default=None, help="sequences per optimizer step (default: the shape's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5 on cuda, 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (compile; default 3 / 1)")
    p.add_argument("--zero-stage", type=int, default=2, help="trainer path: DeepSpeed ZeRO stage")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOP/s for MFU (default: by GPU name)")
    p.add_argument("--max-batch", default=None, help="comma list of variants to search the largest micro-batch for")
    p.add_argument("--max-batch-limit", type=int, default=128)
    p.add_argument("--in-process", action="store_true", help="no subprocess per variant (default on CPU)")
    p.add_argument("--profile", action="store_true", help="profile one more step per variant (torch.profiler table)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant subprocess")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if a.device == "cpu" else "cuda")
    device = torch.device(a.device)
    shape = dict(SHAPES[a.shape])
    seqs = a.seqs or shape["seqs"]
    steps = a.steps if a.steps is not None else (5 if a.device == "cuda" else 3)
    warmup = a.warmup if a.warmup is not None else (3 if a.device == "cuda" else 1)
    variants = a.variants.split(",") if a.variants else (GPU_DEFAULT if a.device == "cuda" else CPU_DEFAULT)
    variants = [] if variants == ["none"] else variants  # e.g. only the --max-batch search
    for v in variants:
        try:
            Variant.parse(v)
        except ValueError as e:
            p.error(str(e))
    peak = a.peak_tflops * 1e12 if a.peak_tflops else None
    if peak is None and device.type == "cuda":
        from train.metrics import peak_flops

        peak = peak_flops(device, "bf16")

    if a.child or a.in_process or a.device == "cpu":
        results = []
        for v in variants:
            try:
                r = run_variant(v, shape, seqs, device, steps, warmup, a.zero_stage, peak, a.profile).__dict__
            except torch.cuda.OutOfMemoryError as e:
                r = {"variant": v, "seqs": seqs, "ok": False, "error": "OOM: " + str(e).splitlines()[0]}
            results.append(r)
            if a.child:
                print("RESULT " + json.dumps(r), flush=True)
                return 0
            gc.collect()
    else:
        base = ["--device", a.device, "--shape", a.shape, "--zero-stage", str(a.zero_stage)]
        if a.peak_tflops:
            base += ["--peak-tflops", str(a.peak_tflops)]
        results = []
        for v in variants:
            r = _child(base + ["--variants", v, "--seqs", str(seqs), "--steps", str(steps), "--warmup", str(warmup)],
                       a.timeout)
            r.setdefault("variant", v)
            r.setdefault("seqs", seqs)
            results.append(r)
            print(f"  {v}: {'%.2f ms/seq' % r['ms_per_seq'] if r.get('ok') else r.get('error')}", flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nshape {a.shape} on {name}: seq {shape['seq_len']}, {shape['anchors']} anchors, block {shape['block']}, "
          f"{seqs} sequences per step, timed {steps} steps after {warmup} warm-up")
    print_table(results)

    if a.max_batch:
        base = ["--device", a.device, "--shape", a.shape, "--zero-stage", str(a.zero_stage)]
        print("\nlargest micro-batch that fits (sequences packed in one row):")
        for v in a.max_batch.split(","):
            n, r = largest_micro_batch(base, v, start=max(1, seqs // 4), limit=a.max_batch_limit, timeout=a.timeout)
            extra = f", {r['ms_per_seq']:.2f} ms/seq, {r['peak_mem_gib']:.1f} GiB" if r and r.get("peak_mem_gib") else ""
            print(f"  {v}: {n} sequences{extra}")
            results.append({"variant": v, "max_batch": n, **(r or {})})
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
