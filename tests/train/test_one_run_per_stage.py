"""Two `drafter train` processes on one run: the second is refused at once, naming the first (host, pid), and
the first logs every step exactly once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import CACHE, REPO, make_config
from tests.train.test_stage_train import _dist_env, rows, subprocess_env, write_extract_stage  # noqa: F401

STEPS = ["train.max_steps=12", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
         "train.micro_batch_tokens=384", "train.num_anchors=16", "train.num_workers=0"]


@pytest.mark.slow
def test_a_second_train_on_the_same_run_is_refused_and_the_first_logs_every_step_once(tmp_path):
    cfg = make_config(tmp_path, overrides=STEPS)
    write_extract_stage(cfg, n=24)
    command = [sys.executable, "-m", "drafter.cli", "train", "--config", "configs/tiny.yaml",
               f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *STEPS]
    first = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    metrics = cfg.run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"step": 1,' in metrics.read_text()):
        assert first.poll() is None and time.time() < deadline, first.stderr.read().decode()[-3000:]
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)  # mid-run, holding the lock for as long as the test needs
    try:
        second = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stderr[-3000:]
    assert (f"stage 'train' at {cfg.run_dir / 'train'} is in use by pid {first.pid} on host {socket.gethostname()}"
            in second.stderr)
    assert first.wait(timeout=600) == 0, first.stderr.read().decode()[-3000:]
    assert [r["step"] for r in rows(cfg.run_dir)] == list(range(1, 13))  # once each, not twice
