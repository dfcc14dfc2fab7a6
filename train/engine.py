"""DeepSpeed setup for the drafter: the DeepSpeed config built from `TrainConfig`, AdamW + cosine-with-warmup,
and `deepspeed.initialize` (the process group itself is train/distributed.py's).

Precision: "bf16" keeps bf16 weights/activations in the module and fp32 master weights + optimizer state in
DeepSpeed's optimizer wrapper (ZeRO 1-3 partitions, FP16_Optimizer-style wrapper for stage 0); "fp32" is plain.
The optimizer is a torch AdamW handed to DeepSpeed (no DeepSpeed C++/CUDA op to compile).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable

import torch

from pipeline.config import TrainConfig
from pipeline.log import get_logger

log = get_logger("train.engine")


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


def build_optimizer(params: Iterable[torch.nn.Parameter], train_cfg: TrainConfig, device: torch.device):
    """AdamW (torch defaults for betas/eps), fused kernels on GPU. Weight decay per config (0 in the recipe)."""
    params = list(params)
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, **kwargs)


# ----------------------------------------------------------------------------------------------
# DeepSpeed
# ----------------------------------------------------------------------------------------------


def deepspeed_config(train_cfg: TrainConfig, *, world_size: int, device: torch.device) -> dict:
    """The DeepSpeed JSON config implied by `TrainConfig` (micro-batches are packed rows: size 1 nominal)."""
    zero: dict = {"stage": train_cfg.zero_stage}
    if train_cfg.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=device.type == "cuda",
                    reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8))
    if train_cfg.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train_cfg.grad_accum,
        "train_batch_size": train_cfg.grad_accum * world_size,
        "gradient_clipping": train_cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": train_cfg.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "dump_state": False,
    }
    if train_cfg.precision == "bf16" and train_cfg.zero_stage in (1, 2, 3):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # accumulate/reduce grads in fp32 like the master weights
    return cfg


def build_engine(model: torch.nn.Module, train_cfg: TrainConfig, *, total_steps: int, world_size: int,
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
    if train_cfg.precision == "bf16":
        _cast_float_buffers(model, torch.bfloat16)  # DeepSpeed casts parameters only; the frozen head is a buffer
    optimizer = build_optimizer(trainable, train_cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(total_steps, train_cfg.warmup_ratio))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(train_cfg, world_size=world_size, device=device), dist_init_required=False,
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
