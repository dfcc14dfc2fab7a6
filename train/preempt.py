"""Stop a training run cleanly when its scheduler asks, so that the next run of the same command loses no step.

SIGTERM (SLURM at the job's time limit or on `scancel`, torchrun passing it on, `timeout`) and SIGUSR1 (`sbatch
--signal=USR1@120`: two minutes' notice) set a flag; the trainer checks it after every optimizer step, all ranks
agreeing (any rank's flag stops every rank at the same step), saves a complete checkpoint of that step and leaves
with `Preempted`: exit status 75 (EX_TEMPFAIL, "try again") from `drafter train`, no manifest, the stage
incomplete. Running the same command resumes at the step after it. Repeats of the signal change nothing (under
torchrun a worker gets SLURM's copy and torchrun's); to stop at once, SIGINT or SIGKILL (the last checkpoint
resumes). torchrun gives its workers 30 s after passing SIGTERM on: the step in flight and the save must fit.
With several ranks the agreement is a one-element all-reduce after each step (a host sync per step).

DataLoader workers ignore both signals (`ignore_in_worker`): SLURM signals every process of a job step, and a
worker that died of it would fail the step before the checkpoint is written. A worker that ignores SIGTERM would
also ignore the `terminate()` with which multiprocessing ends daemonic children at interpreter exit, and its
`join()` would then wait forever (as when a run fails with its loader still referenced from the traceback): so
the main process kills its leftover children at exit first (`kill_leftover_children`, an atexit hook registered
after multiprocessing's, hence run before it).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import signal
import threading

import torch

from pipeline.log import get_logger
from pipeline.errors import StageError
from train.distributed import all_reduce_sum

log = get_logger("train")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(StageError):
    """A signal stopped the run after a saved step; the same command resumes it."""

    exit_status = PREEMPTED_EXIT


class StopSignals:
    """Context manager: while inside, SIGTERM / SIGUSR1 only record that a stop was asked (`received`: the signal's
    name, or None). Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        _register_exit_hook()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the same request again (SLURM signals torchrun and its workers: two copies)
            return
        self.received = signal.Signals(signum).name
        log.warning("%s received: stopping after the step in flight, with a checkpoint of it", self.received)


def any_rank_stopping(local: bool, world_size: int, device: torch.device) -> bool:
    """True on every rank iff some rank's flag is set (a one-element all-reduce; none on a single rank)."""
    if world_size == 1:
        return local
    return bool(all_reduce_sum(torch.tensor([float(local)], device=device)).item() > 0)


def ignore_in_worker(_worker_id: int) -> None:
    """DataLoader worker_init_fn: the main process decides when the run stops."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def kill_leftover_children() -> None:
    """SIGKILL the multiprocessing children still alive (DataLoader workers, which ignore SIGTERM), with PyTorch's
    SIGCHLD handler (which reports a killed worker as an error) put away first: at exit nothing waits for them."""
    children = multiprocessing.active_children()
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()


@functools.cache
def _register_exit_hook() -> None:
    """Once per process."""
    atexit.register(kill_leftover_children)
