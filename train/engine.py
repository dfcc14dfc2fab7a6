"""DeepSpeed setup for the drafter: process-group environment (torchrun / SLURM / single process),
the DeepSpeed config built from `TrainConfig`, AdamW + cosine-with-warmup, and `deepspeed.initialize`.

Launch modes, all through `drafter train` / `python -m drafter.cli train`:
  * torchrun (one node):  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set by torchrun;
  * srun (many nodes):    only SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODELIST are set; we derive
                          the torch variables from them (MASTER_ADDR = first host of the node list, MASTER_PORT
                          from the job id so every task agrees without talking);
  * plain `python`:       a single process on a free local port.
On CPU the backend is gloo (DeepSpeed's automatic fallback), on GPU nccl.

Precision: "bf16" keeps bf16 weights/activations in the module and fp32 master weights + optimizer state in
DeepSpeed's optimizer wrapper (ZeRO 1-3 partitions, FP16_Optimizer-style wrapper for stage 0); "fp32" is plain.
The optimizer is a torch AdamW handed to DeepSpeed (no DeepSpeed C++/CUDA op to compile).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch

from pipeline.config import TrainConfig
from pipeline.log import get_logger

log = get_logger("train.engine")


# ----------------------------------------------------------------------------------------------
# Process-group environment
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port nobody listens on right now (for single-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM node list: 'gpu[003-005,010],cpu1' -> 'gpu003'.

    Uses `scontrol show hostnames` when available (it knows every SLURM syntax), else parses the common forms.
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # split on commas outside brackets
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", first)
    if not m:
        return first
    prefix, ranges, suffix = m.groups()
    lo = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{lo}{suffix}"


def resolve_dist_env(environ: dict | None = None) -> DistEnv:
    """Who am I and where is rank 0, from torchrun's variables, else SLURM's, else a single local process.

    Pure function of `environ` (default: os.environ) except for picking a free port in the single-process case.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)) or free_port(), source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env.get("MASTER_PORT", 0)) or (20000 + job % 20000)
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)), master_addr=addr, master_port=port, source="slurm",
        )
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                   source="single")


def export_dist_env(d: DistEnv) -> None:
    """Write the torch variables so `torch.distributed`'s env:// rendezvous (and DeepSpeed) find them."""
    os.environ.update({"RANK": str(d.rank), "WORLD_SIZE": str(d.world_size), "LOCAL_RANK": str(d.local_rank),
                       "MASTER_ADDR": d.master_addr, "MASTER_PORT": str(d.master_port)})


def init_distributed(timeout_minutes: int = 30) -> tuple[DistEnv, torch.device]:
    """Resolve the environment, export it, pick this rank's device and initialize the process group."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    d = resolve_dist_env()
    export_dist_env(d)
    if torch.cuda.is_available():
        device = torch.device("cuda", d.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes), verbose=False)
        if d.is_main:
            log.info("process group: %d rank(s) from %s, rendezvous %s:%d, backend %s, device %s", d.world_size,
                     d.source, d.master_addr, d.master_port, torch.distributed.get_backend(), device)
    return d, device


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op with one process). Returns `t`."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


# ----------------------------------------------------------------------------------------------
# Optimizer and schedule
# ----------------------------------------------------------------------------------------------


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return max(1, math.ceil(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier for optimizer step s (0-based): linear warmup to 1 over `ceil(ratio*total)` steps, then
    cosine decay to 0 at `total_steps`. Step 0 already gets a non-zero rate (1/warmup)."""
    warm = warmup_steps(total_steps, warmup_ratio)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(params: Iterable[torch.nn.Parameter], tcfg: TrainConfig, device: torch.device):
    """AdamW (torch defaults for betas/eps), fused kernels on GPU. Weight decay per config (0 in the recipe)."""
    params = list(params)
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, **kwargs)


# ----------------------------------------------------------------------------------------------
# DeepSpeed
# ----------------------------------------------------------------------------------------------


def deepspeed_config(tcfg: TrainConfig, *, world_size: int, device: torch.device) -> dict:
    """The DeepSpeed JSON config implied by `TrainConfig` (micro-batches are packed rows: size 1 nominal)."""
    zero: dict = {"stage": tcfg.zero_stage}
    if tcfg.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=device.type == "cuda",
                    reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8))
    if tcfg.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": tcfg.grad_accum,
        "train_batch_size": tcfg.grad_accum * world_size,
        "gradient_clipping": tcfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": tcfg.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "dump_state": False,
    }
    if tcfg.precision == "bf16" and tcfg.zero_stage in (1, 2, 3):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # accumulate/reduce grads in fp32 like the master weights
    return cfg


def build_engine(model: torch.nn.Module, tcfg: TrainConfig, *, total_steps: int, world_size: int,
                 device: torch.device):
    """`deepspeed.initialize` over the drafter's trainable parameters (frozen embed/head stay out of the
    optimizer). Returns (engine, optimizer, lr_scheduler); the scheduler is stepped by `engine.step()` at
    each gradient-accumulation boundary and saved in DeepSpeed checkpoints."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    model.to(device)
    if tcfg.precision == "bf16":
        _cast_float_buffers(model, torch.bfloat16)  # DeepSpeed casts parameters only; the frozen head is a buffer
    optimizer = build_optimizer(trainable, tcfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(total_steps, tcfg.warmup_ratio))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(tcfg, world_size=world_size, device=device), dist_init_required=False,
    )
    return engine, optimizer, scheduler


def compile_layers(drafter: torch.nn.Module) -> None:
    """torch.compile the drafter's training forward (`DFlashDrafter.compile_training`: feature fusion, every layer
    step including its context K/V, final norm). Automatic dynamic shapes: the varying packed-row lengths
    recompile once, not once per shape. The modules are not replaced, so parameter names, checkpoints and ZeRO
    hooks are unchanged."""
    drafter.compile_training()


def _cast_float_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)


def current_lr(engine) -> float:
    return float(engine.get_lr()[0])


class TrainForward(torch.nn.Module):
    """What DeepSpeed wraps: `module(features, batch, attention)` runs `DFlashDrafter.forward_train` (the drafter
    has no plain `forward`). The frozen target embedding/LM head are non-persistent buffers of the drafter, so
    they are neither optimized, partitioned by ZeRO, nor checkpointed."""

    def __init__(self, drafter: torch.nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, features: torch.Tensor, batch, attention: str) -> torch.Tensor:
        return self.drafter.forward_train(features, batch, attention)


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------

# Summable statistics of train/loss.py::dflash_loss that are reduced over micro-batches and ranks.
SCALAR_STATS = ("weighted_ce_sum", "weight_sum", "ce_sum", "num_labels", "accept_len_sum", "num_blocks")


@dataclass
class StepStats:
    """Statistics of one optimizer step (or one evaluation), summed over micro-batches and ALL ranks."""

    sums: dict  # name -> float, SCALAR_STATS + "tokens" + "flops"
    correct_per_pos: torch.Tensor  # [B-1]
    count_per_pos: torch.Tensor  # [B-1]

    @property
    def loss(self) -> float:
        return self.sums["weighted_ce_sum"] / max(self.sums["weight_sum"], 1e-12)

    @property
    def acc_per_pos(self) -> list[float]:
        return (self.correct_per_pos / self.count_per_pos.clamp_min(1)).tolist()

    def metrics(self) -> dict:
        """Loss, mean unweighted CE, per-position accuracy, tau_hat (formula) and block acceptance (simulated)."""
        from train.loss import tau_hat

        out = {"loss": self.loss, "ce": self.sums["ce_sum"] / max(self.sums["num_labels"], 1.0),
               "acc": float(self.correct_per_pos.sum() / self.count_per_pos.sum().clamp_min(1)),
               "tau_hat": tau_hat(self.correct_per_pos, self.count_per_pos),
               "accept_len": self.sums["accept_len_sum"] / max(self.sums["num_blocks"], 1.0),
               "labels": self.sums["num_labels"], "tokens": self.sums["tokens"]}
        out.update({f"acc_{k + 1}": a for k, a in enumerate(self.acc_per_pos)})
        return out


def _reduce(per_mb: list[tuple[dict, int, float]], block_size: int, device: torch.device) -> StepStats:
    """Sum (stats, tokens, flops) of this rank's micro-batches on the device, then over ranks: one all-reduce
    and one host sync per step."""
    rows = []
    for stats, tokens, flops in per_mb:
        scalars = torch.stack([torch.as_tensor(stats[k], device=device).double() for k in SCALAR_STATS])
        host = torch.tensor([tokens, flops], dtype=torch.float64, device=device)
        rows.append(torch.cat([scalars, host, stats["correct_per_pos"].double().to(device),
                               stats["count_per_pos"].double().to(device)]))
    vec = torch.stack(rows).sum(0)
    all_reduce_sum(vec)
    vec = vec.cpu()
    n = len(SCALAR_STATS)
    sums = {k: float(vec[i]) for i, k in enumerate(SCALAR_STATS)}
    sums["tokens"], sums["flops"] = float(vec[n]), float(vec[n + 1])
    return StepStats(sums, vec[n + 2 : n + 1 + block_size].clone(), vec[n + 1 + block_size :].clone())


def micro_batch_flops(shape, batch) -> float:
    """Useful FLOPs (train/metrics.py::train_flops) of one micro-batch's BlockBatch (pass the host copy: no sync)."""
    from train.metrics import train_flops

    valid = batch.block_valid
    offsets = (batch.anchors - batch.doc_start)[valid].cpu()
    return train_flops(shape, context_rows=batch.seq_len if bool(valid.any()) else 0, anchor_offsets=offsets,
                       label_rows=int(batch.label_mask.sum()))


def train_step(engine, micro_batches: list[dict], features_of: Callable, *, gamma: float | None, chunk_rows: int,
               attention: str, world_size: int, device: torch.device, flops_shape=None) -> tuple[StepStats, float]:
    """One optimizer step over this rank's `grad_accum` collated micro-batches (train/data.py::collate).

    The loss is normalised GLOBALLY: sum over all ranks and micro-batches of w*CE divided by the sum of w over
    all of them (computed before the forward from the labels), so a micro-batch counts by its label weight,
    not by its count. DeepSpeed averages gradients over ranks, hence the `* world_size`, and `scale_wrt_gas=False`
    because the normaliser already spans the accumulation steps. Returns (stats summed over ranks, grad norm).
    """
    from train.loss import dflash_loss, label_weights

    drafter = engine.module.drafter
    local_w = sum(float(label_weights(mb["batch"], gamma).sum()) for mb in micro_batches)
    normalizer = all_reduce_sum(torch.tensor([local_w], dtype=torch.float64, device=device)).item()
    per_mb = []
    grad_norm = None
    for k, mb in enumerate(micro_batches):
        features, batch = features_of(mb)
        hidden = engine(features, batch, attention)
        loss, stats = dflash_loss(hidden, drafter.lm_head_weight, batch, gamma, chunk_rows, normalizer=max(normalizer, 1e-12))
        engine.backward(loss * world_size, scale_wrt_gas=False)
        if k == len(micro_batches) - 1 and _needs_manual_grad_norm(engine):
            grad_norm = _grad_norm(engine)
        engine.step()
        flops = micro_batch_flops(flops_shape, mb["batch"]) if flops_shape is not None else 0.0
        per_mb.append((stats, 0 if mb.get("padding") else mb["tokens"], flops))
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    return _reduce(per_mb, engine.module.drafter.args.block_size, device), float(grad_norm if grad_norm is not None else float("nan"))


@torch.no_grad()
def eval_step(engine, micro_batches: Iterable[dict], features_of: Callable, *, gamma: float | None, chunk_rows: int,
              attention: str, device: torch.device) -> StepStats:
    """Loss/accuracy statistics of held-out micro-batches (any iterable, consumed lazily; no gradient), summed
    over ranks. Every rank must pass the same number of micro-batches (train/data.py::plan_eval pads)."""
    from train.loss import dflash_loss

    drafter = engine.module.drafter
    per_mb = []
    for mb in micro_batches:
        features, batch = features_of(mb)
        hidden = engine(features, batch, attention)
        _, stats = dflash_loss(hidden, drafter.lm_head_weight, batch, gamma, chunk_rows)
        per_mb.append((stats, 0 if mb.get("padding") else mb["tokens"], 0.0))
    return _reduce(per_mb, drafter.args.block_size, device)


def _needs_manual_grad_norm(engine) -> bool:
    """Plain fp32 without ZeRO: DeepSpeed clips but does not record the norm."""
    return not engine.zero_optimization() and not engine.bfloat16_enabled() and not engine.fp16_enabled()


def _grad_norm(engine) -> float:
    grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0
