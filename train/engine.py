"""The training engine of the drafter: AdamW + cosine-with-warmup, and either DeepSpeed (the DeepSpeed config built
from `TrainConfig`, `deepspeed.initialize`; ZeRO 0-3, any number of ranks) or `TorchEngine` (plain PyTorch, one
process, no DeepSpeed installed). The process group itself is train/distributed.py's.

Precision: "bf16" keeps bf16 weights/activations in the module and fp32 master weights + optimizer state in
DeepSpeed's optimizer wrapper (ZeRO 1-3 partitions, FP16_Optimizer-style wrapper for stage 0); "fp32" is plain.
The optimizer is a torch AdamW handed to DeepSpeed (no DeepSpeed C++/CUDA op to compile).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from pipeline.config import ConfigError, TrainConfig
from pipeline.log import get_logger
from pipeline.files import atomic_write_json, read_json

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


def engine_kind(setting: str, world_size: int) -> str:
    """`train.engine` resolved: 'deepspeed' or 'torch' ('auto' = deepspeed when it is installed, else torch).
    The torch engine runs one process; several ranks need DeepSpeed."""
    if setting == "auto":
        setting = "deepspeed" if importlib.util.find_spec("deepspeed") is not None else "torch"
    if setting not in ("deepspeed", "torch"):
        raise ConfigError(f"train.engine: {setting!r} is not 'auto', 'deepspeed' or 'torch'")
    if setting == "torch" and world_size > 1:
        raise ConfigError(f"train.engine: the torch engine runs one process, this job has {world_size} ranks; "
                          "install DeepSpeed (pip install -e '.[train]') for data-parallel training")
    return setting


def build_engine(model: torch.nn.Module, train_cfg: TrainConfig, *, total_steps: int, world_size: int,
                 device: torch.device):
    """The training engine over the drafter's trainable parameters (frozen embed/head stay out of the optimizer):
    `deepspeed.initialize`, or `TorchEngine` (train.engine, see `engine_kind`). Returns (engine, optimizer,
    lr_scheduler); the scheduler is stepped by `engine.step()` at each gradient-accumulation boundary and saved
    in the engine's checkpoints."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    model.to(device)
    if train_cfg.precision == "bf16":
        _cast_float_buffers(model, torch.bfloat16)  # the engines cast parameters only; the frozen head is a buffer
    if engine_kind(train_cfg.engine, world_size) == "torch":
        engine = TorchEngine(model, train_cfg, total_steps=total_steps, device=device)
        return engine, engine.optimizer, engine.scheduler
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if device.type == "cpu":
        skip_shared_memory_op()
    optimizer = build_optimizer(trainable, train_cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(total_steps, train_cfg.warmup_ratio))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(train_cfg, world_size=world_size, device=device), dist_init_required=False,
    )
    return engine, optimizer, scheduler


def skip_shared_memory_op() -> None:
    """On the CPU, DeepSpeed's communication backend JIT-compiles a C++ shared-memory all-reduce op when it starts
    (a C++ compiler needed, about a minute, again for every new environment: its build hash holds the venv's
    paths), used only by DeepSpeed's inference all-reduce; training reduces through torch.distributed (gloo) either
    way. Marking it incompatible in DeepSpeed's table of ops makes the backend skip it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# ----------------------------------------------------------------------------------------------
# One process without DeepSpeed
# ----------------------------------------------------------------------------------------------


class TorchEngine:
    """What the trainer uses of a DeepSpeed engine, in plain PyTorch, for one process (one GPU, or the CPU).

    Precision as DeepSpeed's: with "bf16" the module holds bf16 parameters and the optimizer steps fp32 master
    copies (gradients accumulate in fp32 across micro-batches; after the step the masters are copied back to the
    bf16 parameters); "fp32" steps the parameters themselves. Clipping at `grad_clip` on the global norm, AdamW
    (`build_optimizer`), the LR schedule stepped once per optimizer step.

    Checkpoints (no pickle): <dir>/<tag>/model.safetensors (trainable parameters), optimizer.safetensors (masters
    and AdamW moments), engine_state.json (steps, scheduler, optimizer hyperparameters).
    """

    MODEL, OPTIMIZER, STATE = "model.safetensors", "optimizer.safetensors", "engine_state.json"

    def __init__(self, model: torch.nn.Module, train_cfg: TrainConfig, *, total_steps: int, device: torch.device):
        self.module = model
        self.bf16 = train_cfg.precision == "bf16"
        if self.bf16:
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params] if self.bf16 else self.params
        self.optimizer = build_optimizer(self.masters, train_cfg, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           cosine_with_warmup(total_steps, train_cfg.warmup_ratio))
        self.grad_accum, self.grad_clip = train_cfg.grad_accum, train_cfg.grad_clip
        self.micro_steps = self.global_steps = 0
        self._grad_norm: torch.Tensor | None = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        (loss / self.grad_accum if scale_wrt_gas else loss).backward()
        if self.bf16:  # accumulate in fp32 on the masters; the bf16 gradients are dropped
            for p, m in zip(self.params, self.masters):
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None

    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary clip, step AdamW and the schedule, zero the grads."""
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.bf16:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        self.global_steps += 1

    def get_global_grad_norm(self) -> torch.Tensor | None:
        """The last step's gradient norm before clipping, a 0-d device tensor (read it when logging: no sync here)."""
        return self._grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def zero_optimization(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return self.bf16

    def fp16_enabled(self) -> bool:
        return False

    def save_checkpoint(self, save_dir: str, tag: str, exclude_frozen_parameters: bool = True) -> None:
        """Write the tag directory (the frozen buffers are never saved; `exclude_frozen_parameters` is DeepSpeed's
        name for that)."""
        from safetensors.torch import save_file

        out = Path(save_dir) / tag
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in zip(self.names, self.params)}, str(out / self.MODEL))
        opt = self.optimizer.state_dict()  # {"state": {index: {name: tensor}}, "param_groups": [plain values]}
        tensors = {f"{i}.master": m.detach().contiguous() for i, m in enumerate(self.masters)}
        tensors.update({f"{i}.{k}": v.detach().contiguous() for i, st in opt["state"].items() for k, v in st.items()})
        save_file(tensors, str(out / self.OPTIMIZER))
        atomic_write_json(out / self.STATE, {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                                             "scheduler": self.scheduler.state_dict(),
                                             "param_groups": opt["param_groups"], "names": self.names})

    def load_checkpoint(self, load_dir: str, tag: str, load_module_strict: bool = False) -> tuple[str | None, dict]:
        """Restore what `save_checkpoint` wrote; (path, {}) like DeepSpeed, (None, {}) when the tag is missing."""
        from safetensors.torch import load_file

        src = Path(load_dir) / tag
        if not (src / self.STATE).exists():
            return None, {}
        state = read_json(src / self.STATE)
        if state["names"] != self.names:
            raise ValueError(f"checkpoint {src} holds other parameters than this drafter's")
        model, tensors = load_file(str(src / self.MODEL)), load_file(str(src / self.OPTIMIZER))
        with torch.no_grad():
            for i, (n, p, m) in enumerate(zip(self.names, self.params, self.masters)):
                p.copy_(model[n])
                m.copy_(tensors.pop(f"{i}.master"))
        per_param: dict[int, dict] = {}
        for key, value in tensors.items():
            i, name = key.split(".", 1)
            per_param.setdefault(int(i), {})[name] = value
        self.optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_steps, self.micro_steps = state["global_steps"], state["micro_steps"]
        return str(src), {}


def compile_layers(drafter: torch.nn.Module) -> None:
    """torch.compile the drafter's training forward (`DFlashDrafter.compile_training`: feature fusion, every layer
    step including its context K/V, final norm), dynamic in the packed-row lengths from the first step. Every
    recompilation is logged with the guard that failed (torch's `recompiles` log, in the stage's log): the metrics
    count compiled frames and their seconds per window (`compiles`, `compile_s`), the log says which shape or
    guard caused them (unless TORCH_LOGS chose torch's logs: set_logs would replace that choice). The modules are
    not replaced, so parameter names, checkpoints and ZeRO hooks are unchanged."""
    if not os.environ.get("TORCH_LOGS"):
        torch._logging.set_logs(recompiles=True)
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
