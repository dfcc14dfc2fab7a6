"""train/preempt.py: a stop signal is recorded, not obeyed on the spot, and the handlers are given back; the ranks
agree to stop as soon as one of them was signalled (a real 2-process gloo group)."""

from __future__ import annotations

import os
import signal

import torch
import torch.multiprocessing as mp

from train.distributed import free_port
from train.preempt import StopSignals, any_rank_stopping


def test_a_stop_signal_is_recorded_the_process_lives_on_and_the_old_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with StopSignals() as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second copy (torchrun passing SLURM's on) changes nothing
        assert stop.received == "SIGUSR1"
    assert {s: signal.getsignal(s) for s in before} == before


CASES = (([1], True), ([], False), ([0, 1], True))  # (signalled ranks, what every rank must decide)


def _agree(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out.put((rank, [any_rank_stopping(rank in signalled, 2, torch.device("cpu")) for signalled, _ in CASES]))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_stops_when_one_rank_was_signalled_and_none_when_no_rank_was():
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_agree, args=(free_port(), out), nprocs=2, start_method="spawn")
    got = dict(out.get() for _ in range(2))
    expected = [e for _, e in CASES]
    assert got == {0: expected, 1: expected}
    assert any_rank_stopping(True, 1, torch.device("cpu")) and not any_rank_stopping(False, 1, torch.device("cpu"))
