"""The training process group: who this process is (from the launcher's environment), where rank 0 listens, which
device it drives, and the few collectives the trainer needs.

Launch modes, all through `drafter train` / `python -m drafter.cli train`; rank and world size come from
`pipeline.stage_dir.rank_from_env` (the same reading every split stage uses), the rest from the launcher:
  * torchrun (one node):  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set by torchrun;
  * srun (many nodes):    only SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODELIST are set; the torch
                          variables are derived from them (MASTER_ADDR = first host of the node list, MASTER_PORT
                          from the job id so every task agrees without talking);
  * plain `python`:       a single process on a free local port.
A SLURM array task is an independent worker, not a rank of a process group: train refuses to run as one.
On CPU the backend is gloo, on GPU nccl.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, TypeVar

import torch

from pipeline.log import get_logger
from pipeline.errors import StageError
from pipeline.stage_dir import rank_from_env

log = get_logger("train.distributed")

T = TypeVar("T")


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


def resolve_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Who am I and where is rank 0: rank and world size from `rank_from_env`, local rank and rendezvous from the
    launcher's variables. Pure function of `environ` (default: os.environ) except for picking a free port when
    nothing names one."""
    env = os.environ if environ is None else environ
    ranks = rank_from_env(environ=env)
    if ranks.source == "slurm-array" and ranks.world_size > 1:
        raise StageError("train runs as one process group, not as a SLURM array: launch it with torchrun "
                         "(slurm/train.sbatch) or srun with --ntasks")
    if ranks.source == "torchrun":
        return DistEnv(rank=ranks.rank, world_size=ranks.world_size,
                       local_rank=int(env.get("LOCAL_RANK", ranks.rank)),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", 0)) or free_port(), source="torchrun")
    if ranks.source == "slurm":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        return DistEnv(rank=ranks.rank, world_size=ranks.world_size, local_rank=int(env.get("SLURM_LOCALID", 0)),
                       master_addr=env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", 0)) or (20000 + job % 20000), source="slurm")
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                   source="single")


def export_dist_env(d: DistEnv) -> None:
    """Write the torch variables so `torch.distributed`'s env:// rendezvous (and DeepSpeed) find them."""
    os.environ.update({"RANK": str(d.rank), "WORLD_SIZE": str(d.world_size), "LOCAL_RANK": str(d.local_rank),
                       "MASTER_ADDR": d.master_addr, "MASTER_PORT": str(d.master_port)})


def init_distributed(timeout_minutes: int = 30) -> tuple[DistEnv, torch.device]:
    """Resolve the environment, export it, pick this rank's device and initialize the process group (env://;
    DeepSpeed, when the engine is DeepSpeed, uses this group)."""
    d = resolve_dist_env()
    export_dist_env(d)
    if torch.cuda.is_available():
        device = torch.device("cuda", d.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                             timeout=timedelta(minutes=timeout_minutes))
        if d.is_main:
            log.info("process group: %d rank(s) from %s, rendezvous %s:%d, backend %s, device %s", d.world_size,
                     d.source, d.master_addr, d.master_port, torch.distributed.get_backend(), device)
    return d, device


def _group_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (no-op with one process: NCCL would build a communicator for its first barrier, a stall
    the one-GPU recipe's first checkpoint showed, docs/benchmarks.md "quality")."""
    if _group_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op with one process). Returns `t`."""
    if _group_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order (`[obj]` with one process)."""
    out = [None] * _group_size()
    if len(out) > 1:
        torch.distributed.all_gather_object(out, obj)
    else:
        out = [obj]
    return out


def rank0_first(fn: Callable[[], T], is_main: bool) -> T:
    """Run `fn` on rank 0, then share its result (or its error) with every rank."""
    result: list = [None]
    if is_main:
        try:
            result[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            result[0] = ("error", e)
    if _group_size() > 1:
        torch.distributed.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "error":
        raise value if isinstance(value, Exception) else StageError(str(value))
    return value
