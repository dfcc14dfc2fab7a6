"""Checkpoints that survive kill -9, and exact resume.

Layout under `runs/<run>/train/checkpoints/`:
    step-00000200/                       one DeepSpeed tag (model + optimizer/ZeRO partitions + LR scheduler)
        rng-rank00000.safetensors        this rank's torch CPU/CUDA, numpy and python RNG states
        trainer_state.json               data position (epoch, step in epoch), global step, run identity
        COMPLETE                         written last by rank 0, after every rank finished: the tag is usable
    latest                               DeepSpeed's own pointer; NOT trusted for resume (written non-atomically)

Invariant: resume only ever loads a tag that has `COMPLETE`; a tag without it is debris of a killed save and
is deleted on the next start. The frozen target embedding/LM head are excluded from checkpoints (they come
from the target at start-up). DeepSpeed reads its own files with torch.load — files this run created; RNG
and trainer state are safetensors/JSON.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pipeline.log import get_logger
from pipeline.errors import StageError
from pipeline.files import atomic_write_json, atomic_write_text, read_json

log = get_logger("train.checkpoint")

COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
_TAG = re.compile(r"^step-(\d{8})$")

# Fields of trainer_state.json that must match to resume exactly: the data plan (other values would replay or skip
# data) and the engine that wrote the checkpoint (DeepSpeed and the torch engine have different layouts).
KEEP = 2  # complete checkpoints kept (the newest); `drafter plan` counts them in its storage line
RESUME_FIELDS = ("world_size", "micro_batch_tokens", "grad_accum", "seed", "num_train_samples", "engine")


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def _tags(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if p.is_dir() and (m := _TAG.match(p.name))]
    return sorted(out)


def latest_complete(ckpt_dir: Path) -> tuple[str, dict] | None:
    """(tag, trainer_state) of the newest checkpoint marked COMPLETE, or None."""
    for step, path in reversed(_tags(Path(ckpt_dir))):
        if (path / COMPLETE).exists() and (path / STATE).exists():
            return path.name, read_json(path / STATE)
    return None


def remove_incomplete(ckpt_dir: Path) -> list[str]:
    """Delete tag dirs without COMPLETE (a save killed half-way). Call on rank 0 before any rank loads."""
    removed = []
    for _, path in _tags(Path(ckpt_dir)):
        if not (path / COMPLETE).exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    if removed:
        log.warning("removed incomplete checkpoint(s) from a killed save: %s", ", ".join(removed))
    return removed


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (rank 0, after a save completed)."""
    complete = [p for _, p in _tags(Path(ckpt_dir)) if (p / COMPLETE).exists()]
    for path in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# RNG state (per rank)
# ----------------------------------------------------------------------------------------------


def _rng_path(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng-rank{rank:05d}.safetensors"


def save_rng(path: Path, device: torch.device) -> None:
    """torch CPU (+ CUDA of `device`), numpy and python RNG states as safetensors (+ JSON metadata)."""
    np_state = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64))}
    if device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    py_version, py_internal, py_gauss = random.getstate()
    meta = {"numpy": json.dumps([np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]),
            "python": json.dumps([py_version, list(py_internal), py_gauss])}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_rng(path: Path, device: torch.device) -> None:
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)
    name, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order: equal iff the weights are equal.
    Used to prove that all data-parallel replicas end a run with identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------


def save(engine, ckpt_dir: Path, state: dict, *, rank: int, device: torch.device, keep: int = KEEP) -> str:
    """Save a complete checkpoint for optimizer step `state['global_step']` on every rank (collective).

    Order: DeepSpeed tag (all ranks) -> per-rank RNG -> barrier -> rank 0 writes trainer_state.json and then
    COMPLETE -> barrier. A kill anywhere before COMPLETE leaves a tag that resume ignores and deletes.
    """
    from train.distributed import barrier

    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(int(state["global_step"]))
    engine.save_checkpoint(str(ckpt_dir), tag=tag, exclude_frozen_parameters=True)
    save_rng(_rng_path(ckpt_dir / tag, rank), device)
    barrier()
    if rank == 0:
        atomic_write_json(ckpt_dir / tag / STATE, state)
        atomic_write_text(ckpt_dir / tag / COMPLETE, tag + "\n")
        prune(ckpt_dir, keep)
    barrier()
    return tag


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse to resume when the data plan or the engine would differ (names the field)."""
    bad = [k for k in RESUME_FIELDS if k in current and saved.get(k) != current[k]]
    if bad:
        lines = "\n".join(f"  {k}: checkpoint has {saved.get(k)!r}, this run has {current[k]!r}" for k in bad)
        raise StageError(
            "cannot resume exactly: the data plan differs from the checkpoint's (fields differ):\n" + lines
            + "\nRun with the same settings/number of ranks, or pass --force to start over."
        )


def load(engine, ckpt_dir: Path, tag: str, *, rank: int, device: torch.device) -> dict:
    """Restore model, optimizer, scheduler (DeepSpeed) and this rank's RNG; return trainer_state."""
    ckpt_dir = Path(ckpt_dir)
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=False)
    if load_path is None:
        raise StageError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    rng = _rng_path(ckpt_dir / tag, rank)
    if rng.exists():
        load_rng(rng, device)
    return read_json(ckpt_dir / tag / STATE)
