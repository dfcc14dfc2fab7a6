"""Benchmark of the drafter training step: tokens/s, ms per sequence, MFU on useful FLOPs, peak memory, largest
micro-batch.

    .venv/bin/python benchmarks/bench_train.py --shape tiny                                  (CPU, here)
    .venv/bin/python benchmarks/bench_train.py --shape tiny --variants smollm2               (CPU: the SmolLM2 set, tiny)
    python benchmarks/bench_train.py --device cuda --shape smollm2                           (H200: the SmolLM2 table)
    python benchmarks/bench_train.py --device cuda --shape qwen3-8b --variants trainer-flex-compile,bare-flex-compile
    .venv/bin/python benchmarks/bench_train.py --shape tiny-hybrid --variants trainer-dense-online --engine torch
        --max-batch trainer-dense-online --max-batch-limit 2                                  (CPU: the same, a toy)
    python benchmarks/bench_train.py --device cuda --shape qwen3.6-27b --variants qwen3.6-27b \
        --max-batch trainer-flex-compile-ac-online --max-batch-limit 32 --json $OUT/bench_train_27b.json
                                                                      (H200: online, the 27B target resident)

Shape qwen3.6-27b: the drafter of configs/qwen3.6-27b.yaml ([S,S,S,S,F], window 2048, D=5120, ~1.73B trainable,
block 16, seq 3072, 512 anchors) trained online against a random-init Qwen3.6-27B-shape hybrid target held on the
same GPU (benchmarks/bench_hybrid.py HYBRID_SHAPES, ~54 GB in bf16). Its variant set "qwen3.6-27b": the config as
configured (4 sequences = micro_batch_tokens 12288 per row, activation checkpointing, compiled, flex) and the same
without activation checkpointing. An online variant's result also splits its step into the target's forward (timed
alone over the same micro-batches right after the timed steps: `target_forward_ms`) and the rest
(`drafter_step_ms`: the drafter's forward, backward and update), and gives the target forward's FLOPs
(`target_flops`: 2 x the parameters of layers 0..deepest tap + attention, bench_extract.flops_per_token) and the
utilisation counting both (`mfu_with_target`); `mfu` stays the drafter's useful FLOPs alone. `tiny-hybrid` is the
same layout at toy size (CPU).

Shape smollm2: the SmolLM2-135M-Instruct recipe's drafter (configs/smollm2-135m-h200.yaml: 3 layers, D=576, 9/3
heads of 64, intermediate 1536, 5 taps of the 30-layer target, vocab 49152, block 16, 256 anchors per sequence) on
100 sequences of 320 tokens (one 32K-token micro-batch) per optimizer step; online variants run a random-init
SmolLM2-shaped target (30 layers) in the step. Its default variant set ("smollm2") measures each speed option of
`drafter train` against the recipe as configured (online, eager, CE chunks of 2048 rows) and prints tokens/s with
the speed-up over that first row.

Shape qwen3-8b: the Qwen3-8B drafter (5 layers, D=4096, 32/8 heads, head_dim 128, intermediate 12288, 5 taps,
~1.05B trainable) with a random-init frozen embedding + LM head (vocab 151936), block 16, seq 3072, 512 anchors
per sequence, 16 sequences per optimizer step, synthetic bf16 features. Nothing is downloaded.

Paths:
  trainer  train.step.train_step with the features as train.trainer.features_fn makes them: the real engine
           (--engine: DeepSpeed ZeRO --zero-stage, or the torch engine; 'auto' = DeepSpeed when installed; bf16 +
           fp32 master weights, grad clip 1.0, AdamW), exactly what `drafter train` runs per optimizer step;
           offline features are copied from pinned host memory every step, like the trainer's loader delivers them;
  bare     plain PyTorch: bf16 parameters, forward_train + dflash_loss + backward + clip + fused AdamW, synthetic
           features already on the device.
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
                    block=16, seq_len=320, anchors=256, seqs=100, target_layers=30, mask_id=49151,
                    target=dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536)),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=320, taps=3,
                 block=8, seq_len=256, anchors=16, seqs=4, target_layers=8, mask_id=300,
                 target=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)),
    # The Qwen3.6-27B drafter of configs/qwen3.6-27b.yaml: 5 layers [S,S,S,S,F] with a 2048-token window, D=5120,
    # 32/8 heads of 128, intermediate 17408, 5 taps of the 64-layer hybrid, vocab 248320, block 16, seq 3072, 512
    # anchors; online variants run the random-init Gated-DeltaNet hybrid of that shape (bench_hybrid.py
    # HYBRID_SHAPES["qwen3.6-27b"], ~54 GB in bf16) in the step (train/online.py: one target row per sequence).
    "qwen3.6-27b": dict(hidden=5120, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408, vocab=248320,
                        taps=5, block=16, seq_len=3072, anchors=512, seqs=16, target_layers=64, mask_id=248070,
                        layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                        hybrid_target="qwen3.6-27b"),
    # the same layout at toy size (CPU): the tiny hybrid target (bench_hybrid.py HYBRID_SHAPES["tiny"])
    "tiny-hybrid": dict(hidden=64, layers=5, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=320, taps=3,
                        block=8, seq_len=256, anchors=16, seqs=4, target_layers=8, mask_id=300,
                        layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=64,
                        hybrid_target="tiny"),
}

# A variant name is <path>-<attention>[-compile][-ac][-ce<rows>][-row<n>][-anc<n>][-online][-ahead][-kl], e.g.
# trainer-flex-compile-row4: path trainer|bare, attention flex|dense, torch.compile of the training forward (fusion,
# every layer step with its context K/V, final norm: train.compile), activation checkpointing, the rows per chunk of
# the chunked LM-head loss (train.ce_chunk_tokens; default 4096, 1k = 1024), sequences packed per micro-batch row
# (default: all of them for flex, 1 for dense; the rest is gradient accumulation; more than --seqs makes the step
# that big: a bigger micro-batch), anchors per sequence (train.num_anchors; default the shape's), the target's
# features computed in the step (train.online; its layers compiled on
# CUDA as extract.compile=auto does), the next micro-batch's features made on a side stream (train.features_ahead),
# and logit distillation (train.loss=ce+kl: one more tap and the target's logits). row4 = the qwen3-8b config's
# micro_batch_tokens 12288 at seq 3072.
GPU_DEFAULT = ["trainer-flex-compile", "trainer-flex-compile-row4", "bare-flex-compile", "trainer-dense",
               "bare-dense"]
CPU_DEFAULT = ["trainer-dense", "bare-dense", "trainer-dense-ac", "trainer-dense-ce1k", "trainer-dense-row2"]
# The SmolLM2 recipe's options, first row = today's recipe (online, eager, 16K-token micro-batches).
SMOLLM2 = ["trainer-flex-online-ce2k", "trainer-flex-compile-online-ce2k", "trainer-flex-compile-online",
           "trainer-flex-compile-online-ce8k", "trainer-flex-compile-online-ahead", "trainer-flex-compile",
           "trainer-flex-compile-online-row200", "trainer-flex-compile-online-kl", "trainer-flex-compile-online-anc64",
           "bare-flex-compile"]
# Online training with the Qwen3.6-27B target resident: the config as configured first (row4 = micro_batch_tokens
# 12288 at seq 3072, activation checkpointing on), then without activation checkpointing.
QWEN36_27B = ["trainer-flex-compile-ac-online-row4", "trainer-flex-compile-online-row4"]
VARIANT_SETS = {"smollm2": SMOLLM2, "qwen3.6-27b": QWEN36_27B}
DEFAULT_SET = {"smollm2": "smollm2", "qwen3.6-27b": "qwen3.6-27b", "tiny-hybrid": "qwen3.6-27b"}  # else per device


@dataclass(frozen=True)
class Variant:
    path: str
    attention: str
    compile: bool = False
    ac: bool = False
    ce_chunk: int = 4096
    per_row: int | None = None
    anchors: int | None = None
    online: bool = False
    ahead: bool = False
    kl: bool = False

    @classmethod
    def parse(cls, name: str) -> "Variant":
        parts = name.split("-")
        if len(parts) < 2 or parts[0] not in ("trainer", "bare") or parts[1] not in ("flex", "dense"):
            raise ValueError(f"variant {name!r}: expected <trainer|bare>-<flex|dense>[-compile][-ac][-ce<rows>]"
                             "[-row<n>][-online][-ahead][-kl]")
        v = dict(path=parts[0], attention=parts[1])
        for flag in parts[2:]:
            if flag in ("compile", "ac", "online", "ahead", "kl"):
                v[flag] = True
            elif flag.startswith("row"):
                v["per_row"] = int(flag[3:])
            elif flag.startswith("anc"):
                v["anchors"] = int(flag[3:])
            elif flag.startswith("ce"):
                v["ce_chunk"] = int(flag[2:].replace("k", "")) * (1024 if flag.endswith("k") else 1)
            else:
                raise ValueError(f"variant {name!r}: unknown flag {flag!r}")
        if parts[0] == "bare" and any(v.get(f) for f in ("online", "ahead", "kl")):
            raise ValueError(f"variant {name!r}: online/ahead/kl are trainer-path options")
        return cls(**v)


@dataclass
class Result:
    variant: str
    seqs: int
    tokens_per_s: float
    ms_per_seq: float
    tflops_per_s: float
    mfu: float | None
    peak_mem_gib: float | None
    loss: float
    ok: bool = True
    error: str = ""
    target_forward_ms: float | None = None  # online: the target's forward over one step's micro-batches, timed alone
    drafter_step_ms: float | None = None  # online: the step minus that forward (the drafter's forward, backward, update)
    target_flops: float | None = None  # online: the target forward's FLOPs per step (layers 0..deepest tap)
    mfu_with_target: float | None = None  # online: (drafter useful FLOPs + target_flops) / step time / peak


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def make_args(shape: dict):
    from dflash_model.model import DrafterArgs

    n = shape["taps"]
    L = shape["target_layers"]
    return DrafterArgs(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                       num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                       head_dim=shape["head_dim"], intermediate_size=shape["intermediate"], rms_norm_eps=1e-6,
                       rope_theta=1e6, vocab_size=shape["vocab"], block_size=shape["block"],
                       mask_token_id=shape["mask_id"], target_layer_ids=[round(1 + i * (L - 4) / (n - 1)) for i in range(n)],
                       num_target_layers=L, layer_types=list(shape.get("layer_types", [])),
                       sliding_window=shape.get("sliding_window"))


def make_drafter(args, device, dtype, *, attach: bool = True):
    from dflash_model.model import DFlashDrafter

    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(args)
        if attach:  # random-init frozen target embedding and LM head (buffers, not trained)
            emb = torch.randn(args.vocab_size, args.hidden_size, dtype=dtype) * 0.02
            head = torch.randn(args.vocab_size, args.hidden_size, dtype=dtype) * 0.02
            drafter.attach_target_head(emb, head)
    return drafter


def make_micro_batches(shape: dict, seqs: int, per_row: int, seed: int = 0, anchors: int | None = None,
                       width: int | None = None, dtype=torch.float32) -> list[dict]:
    """Collated micro-batches (train/data.py::collate) of `seqs` synthetic sequences, `per_row` packed per row.
    Loss on the last 90% of every sequence (the response). With `width`, every sequence carries stand-in target
    features [S, width] (seeded per sequence: a packed row holds exactly its sequences' features)."""
    from train.data import collate

    g = torch.Generator().manual_seed(seed)
    S = shape["seq_len"]
    samples = []
    for i in range(seqs):
        mask = torch.ones(S, dtype=torch.bool)
        mask[: S // 10] = False
        ids = torch.randint(0, shape["mask_id"], (S,), generator=g)
        samples.append({"id": f"bench/{i}", "input_ids": ids, "loss_mask": mask})
        if width:
            samples[-1]["features"] = torch.randn(S, width, generator=g).to(dtype)
    kw = dict(block_size=shape["block"], num_anchors=anchors or shape["anchors"], mask_token_id=shape["mask_id"], seed=0,
              epoch=0)
    return [collate(samples[i : i + per_row], **kw) for i in range(0, seqs, per_row)]


def device_features_fn(args, device, dtype):
    """features_of for the bare path and the multi-GPU benchmark: the micro-batch's features moved to the device
    once (no host-to-device copy per step), or random ones of the row's length when it carries none."""
    width = args.num_taps * args.hidden_size
    cache: dict = {}

    def features_of(mb):
        key = id(mb["batch"])
        if key not in cache:
            f = mb["features"] if mb.get("features") is not None else torch.randn(1, mb["batch"].seq_len, width)
            cache[key] = f[..., :width].to(device, dtype)
        return cache[key], mb["batch"].to(device)

    return features_of


def make_target(shape: dict, device, dtype):
    """A random-init target of the shape's size (a Llama decoder, SDPA) for the online variants: hidden size, layer
    count and vocabulary of the drafter's target; its embedding and LM head tied, as SmolLM2's. A shape with a
    `hybrid_target` gets that Gated-DeltaNet hybrid instead (built on the device in `dtype`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.get("hybrid_target"):
        from benchmarks.bench_hybrid import hybrid_config, random_model

        return random_model(hybrid_config(shape["hybrid_target"]), device, dtype)

    cfg = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["target_layers"], vocab_size=shape["vocab"],
                      tie_word_embeddings=True, max_position_embeddings=8192, **shape["target"])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


def target_forward_flops(target, taps: list[int], micro_batches) -> float:
    """FLOPs of the online target's forward over the micro-batches' sequences: layers 0..max(taps) of `target`
    (bench_extract.flops_per_token at each sequence's mean causal context) x its tokens."""
    from benchmarks.bench_extract import flops_per_token

    return sum(flops_per_token(target, taps, n / 2, upto=max(taps)) * n for mb in micro_batches for n in mb["seq_lens"])


def step_flops(args, micro_batches) -> float:
    from train.step import micro_batch_flops
    from train.metrics import DrafterShape

    shape = DrafterShape.from_args(args)
    return sum(micro_batch_flops(shape, mb["batch"]) for mb in micro_batches)


# ----------------------------------------------------------------------------------------------
# One variant
# ----------------------------------------------------------------------------------------------


def _trainer_step(spec: Variant, shape: dict, args, mbs: list[dict], device, dtype, engine_setting: str,
                  zero_stage: int, total_steps: int):
    """`step() -> StepStats` of the trainer path: the engine, features as `drafter train` makes them (offline:
    from pinned host memory; online: the target's compiled forward), optionally one micro-batch ahead."""
    import itertools

    from extract.layers import stored_tap_ids
    from pipeline.config import TrainConfig
    from train.distributed import init_distributed
    from train.engine import TrainForward, build_engine, compile_layers
    from train.inputs import frozen_pieces_of
    from train.step import train_step
    from train.trainer import FeaturesAhead, features_fn

    init_distributed()
    taps = stored_tap_ids(args.target_layer_ids, shape["target_layers"], spec.kl)
    target, final_norm = None, None
    if spec.online:
        target = make_target(shape, device, dtype)
        final_norm = frozen_pieces_of(target, final_norm=True).final_norm if spec.kl else None
    else:
        for mb in mbs:  # stored features, delivered in (pinned) host memory like the trainer's loader does
            if device.type == "cuda":
                mb["features"], mb["batch"] = mb["features"].pin_memory(), mb["batch"].pin_memory()
        if spec.kl:
            final_norm = torch.nn.RMSNorm(args.hidden_size, eps=1e-5, device=device, dtype=dtype).requires_grad_(False)
    features_of = features_fn(target, taps, args.hidden_size, device, dtype, "auto")
    train_cfg = TrainConfig(zero_stage=zero_stage, precision="bf16" if dtype == torch.bfloat16 else "fp32",
                            grad_accum=len(mbs), ce_chunk_tokens=spec.ce_chunk, activation_checkpointing=spec.ac,
                            lr=6e-4, engine=engine_setting)
    drafter = make_drafter(args, device, dtype)
    drafter.gradient_checkpointing = spec.ac
    if spec.compile:
        compile_layers(drafter)
    engine, _, _ = build_engine(TrainForward(drafter), train_cfg, total_steps=total_steps, world_size=1,
                                device=device)
    gamma = 7.0 if args.block_size == 16 else 4.0
    ahead = FeaturesAhead(features_of, device) if spec.ahead and device.type == "cuda" else None
    stream = (dict(mb) for mb in itertools.cycle(mbs))  # fresh dicts: the ahead launcher writes into them
    stream = ahead.launch(stream) if ahead is not None else stream

    def step():
        batch = [next(stream) for _ in mbs]
        return train_step(engine, batch, ahead or features_of, gamma=gamma, chunk_rows=spec.ce_chunk,
                          attention=spec.attention, world_size=1, device=device, kl=0.5 if spec.kl else 0.0,
                          final_norm=final_norm)[0]

    def features_only():  # the target's share of a step (online): its forward over the step's micro-batches
        for mb in mbs:
            features_of(dict(mb))

    step.features_only = features_only
    step.target_flops = target_forward_flops(target, taps, mbs) if spec.online else None
    return step


def _bare_step(spec: Variant, args, mbs: list[dict], device, dtype):
    """`step() -> loss` of plain PyTorch: bf16 parameters, synthetic features already on the device."""
    from train.engine import compile_layers
    from train.loss import dflash_loss, label_weights

    drafter = make_drafter(args, device, dtype)
    drafter.to(dtype)
    drafter.gradient_checkpointing = spec.ac
    if spec.compile:
        compile_layers(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    features_of = device_features_fn(args, device, dtype)
    gamma = 7.0 if args.block_size == 16 else 4.0

    def step():
        total_w = float(sum(label_weights(mb["batch"], gamma).sum() for mb in mbs))
        loss_sum = 0.0
        for mb in mbs:
            features, batch = features_of(mb)
            hidden = drafter.forward_train(features, batch, spec.attention)
            loss, _ = dflash_loss(hidden, drafter.lm_head_weight, batch, gamma, spec.ce_chunk, normalizer=total_w)
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum

    return step


def run_variant(name: str, shape: dict, seqs: int, device: torch.device, steps: int, warmup: int, zero_stage: int,
                peak: float | None, profile: bool = False, engine: str = "auto") -> Result:
    spec = Variant.parse(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = make_args(shape)
    per_row = spec.per_row or (seqs if spec.attention == "flex" else 1)
    seqs = max(seqs, per_row)  # a row bigger than the step makes the step that big
    from extract.layers import stored_tap_ids

    width = len(stored_tap_ids(args.target_layer_ids, shape["target_layers"], spec.kl)) * args.hidden_size
    mbs = make_micro_batches(shape, seqs, per_row, anchors=spec.anchors, width=None if spec.online else width,
                             dtype=dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if spec.path == "trainer":
        step = _trainer_step(spec, shape, args, mbs, device, dtype, engine, zero_stage, steps + warmup)
    else:
        step = _bare_step(spec, args, mbs, device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()  # the statistics stay on the device: nothing here waits for it
    sync()
    dt = (time.perf_counter() - t0) / steps
    loss = last.loss if spec.path == "trainer" else float(last)
    split = None
    if spec.online:  # the step's split: the target's forward alone, the same micro-batches, after the timed steps
        with torch.no_grad():
            step.features_only()
            sync()
            t1 = time.perf_counter()
            for _ in range(steps):
                step.features_only()
            sync()
        split = (time.perf_counter() - t1) / steps
    if profile:
        print_profile(step, sync, device)
    flops = step_flops(args, mbs)
    tokens = sum(mb["tokens"] for mb in mbs)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    target_flops = getattr(step, "target_flops", None)
    return Result(name, seqs, tokens / dt, 1e3 * dt / seqs, flops / dt / 1e12, (flops / dt / peak) if peak else None,
                  mem, loss, target_forward_ms=None if split is None else 1e3 * split,
                  drafter_step_ms=None if split is None else 1e3 * (dt - split), target_flops=target_flops,
                  mfu_with_target=(flops + target_flops) / dt / peak if peak and target_flops else None)


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
    """One row per variant; "x first" = tokens/s over the first row's (the recipe as it stood, for a variant set)."""
    base = next((r["tokens_per_s"] for r in results if r.get("ok") and "tokens_per_s" in r), None)
    print(f"\n{'variant':44s} {'seqs':>5s} {'tok/s':>10s} {'x first':>8s} {'ms/seq':>8s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'peak GiB':>9s} {'loss':>8s}")
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:44s} {r.get('seqs', ''):>5} FAILED: {r.get('error', '')}")
            continue
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        split = "" if r.get("target_forward_ms") is None else \
            f"   step = target forward {r['target_forward_ms']:.1f} ms + drafter {r['drafter_step_ms']:.1f} ms"
        if r.get("mfu_with_target") is not None:
            split += f", MFU with the target's forward {r['mfu_with_target']:.3f}"
        print(f"{r['variant']:44s} {r['seqs']:5d} {r['tokens_per_s']:10.0f} {r['tokens_per_s'] / base:8.2f} "
              f"{r['ms_per_seq']:8.2f} {r['tflops_per_s']:8.3f} {mfu:>6s} {mem:>9s} {r['loss']:8.4f}{split}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--variants", default=None,
                   help="comma list of <trainer|bare>-<flex|dense>[-compile][-ac][-ce<rows>][-row<n>][-online][-ahead]"
                        "[-kl], or a set name (smollm2, qwen3.6-27b); default: the shape's set (smollm2; qwen3.6-27b "
                        "for it and tiny-hybrid), else a set per device")
    p.add_argument("--seqs", type=int, default=None, help="sequences per optimizer step (default: the shape's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5 on cuda, 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (compile; default 3 / 1)")
    p.add_argument("--zero-stage", type=int, default=2, help="trainer path: DeepSpeed ZeRO stage")
    p.add_argument("--engine", default="auto", choices=["auto", "deepspeed", "torch"],
                   help="trainer path: train.engine (auto = DeepSpeed when installed, else the torch engine)")
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
    if a.variants is None:
        a.variants = DEFAULT_SET.get(a.shape) or ",".join(GPU_DEFAULT if a.device == "cuda" else CPU_DEFAULT)
    variants = [v for name in a.variants.split(",") for v in VARIANT_SETS.get(name, [name])]
    if a.device == "cpu" and any("-flex" in v for v in variants + (a.max_batch or "").split(",")):
        print("cpu: flex attention has no backward on CPU, the flex variants run with dense attention", flush=True)
        variants = [v.replace("-flex", "-dense") for v in variants]
        a.max_batch = a.max_batch and a.max_batch.replace("-flex", "-dense")
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
                r = run_variant(v, shape, seqs, device, steps, warmup, a.zero_stage, peak, a.profile, a.engine).__dict__
            except torch.cuda.OutOfMemoryError as e:
                r = {"variant": v, "seqs": seqs, "ok": False, "error": "OOM: " + str(e).splitlines()[0]}
            results.append(r)
            if a.child:
                print("RESULT " + json.dumps(r), flush=True)
                return 0
            gc.collect()
    else:
        base = ["--device", a.device, "--shape", a.shape, "--zero-stage", str(a.zero_stage), "--engine", a.engine]
        if a.peak_tflops:
            base += ["--peak-tflops", str(a.peak_tflops)]
        results = []
        for v in variants:
            r = _child(base + ["--variants", v, "--seqs", str(seqs), "--steps", str(steps), "--warmup", str(warmup)],
                       a.timeout)
            r.setdefault("variant", v)
            r.setdefault("seqs", seqs)
            results.append(r)
            print(f"  {v}: {'%.0f tok/s' % r['tokens_per_s'] if r.get('ok') else r.get('error')}", flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    from train.engine import engine_kind

    print(f"\nshape {a.shape} on {name}: seq {shape['seq_len']}, {shape['anchors']} anchors, block {shape['block']}, "
          f"{seqs} sequences per step, timed {steps} steps after {warmup} warm-up; trainer engine "
          f"{engine_kind(a.engine, 1)}")
    print_table(results)

    if a.max_batch:
        base = ["--device", a.device, "--shape", a.shape, "--zero-stage", str(a.zero_stage), "--engine", a.engine]
        if a.peak_tflops:
            base += ["--peak-tflops", str(a.peak_tflops)]
        print("\nlargest micro-batch that fits (sequences packed in one row):")
        for v in a.max_batch.split(","):
            n, r = largest_micro_batch(base, v, start=max(1, seqs // 4), limit=a.max_batch_limit, timeout=a.timeout)
            extra = f", {r['ms_per_seq']:.2f} ms/seq, {r['peak_mem_gib']:.1f} GiB" if r and r.get("peak_mem_gib") else ""
            print(f"  {v}: {n} sequences{extra}")
            results.append({**(r or {}), "variant": v, "max_batch": n})
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
