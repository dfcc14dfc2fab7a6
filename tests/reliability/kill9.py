"""The kill -9 harness the resume tests share (curate, tokenize; docs/reliability.md): the real CLI in a
subprocess of its own session, SIGKILLed (it and every worker it started) the moment a condition on its files holds.

A test then runs the same command again and compares the result with an uninterrupted run of the same input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


def start_cli(argv: list[str]) -> subprocess.Popen:
    """`python -m drafter.cli <argv>` from the repository root, in a new session (so that its workers die with it),
    progress bars off, stdout and stderr piped."""
    env = dict(os.environ, DRAFTER_NO_PROGRESS="1")
    return subprocess.Popen([sys.executable, "-m", "drafter.cli", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 300) -> None:
    """SIGKILL the CLI and its worker processes as soon as `ready()` holds; fails if the command ended first (the
    kill must land mid-run) or `ready()` never held within `timeout` seconds."""
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the command finished before {what}: {proc.stderr.read().decode()[-2000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
