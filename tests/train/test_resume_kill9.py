"""kill -9 in the middle of a training run, then run again: the resumed run logs exactly the loss curve of an
uninterrupted run (same losses, grad norms, learning rates and held-out metrics at every step). SIGTERM (what a
scheduler sends at a time limit) instead: the run checkpoints the step in flight, exits 75, and the rerun resumes
right after it with the same curve."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import CACHE, REPO, make_config
from tests.train.test_stage_train import _dist_env, rows, subprocess_env, write_extract_stage  # noqa: F401

COMMON = ["train.max_steps=24", "train.log_every=1", "train.eval_every=8", "train.save_every=5",
          "train.micro_batch_tokens=384", "train.num_anchors=24", "train.num_workers=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run, in this process: the rendezvous variables and the one intra-op thread of
    `_dist_env` (a function fixture, which a module fixture cannot use), like the subprocesses."""
    from train.distributed import free_port
    from train.stage import run_train

    cfg = make_config(tmp_path_factory.mktemp("straight"), overrides=COMMON)
    write_extract_stage(cfg, n=48)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port())}.items():
            mp.setenv(k, v)
        torch.set_num_threads(1)
        try:
            run_train(cfg)
        finally:
            torch.set_num_threads(threads)
    return cfg


def assert_same_curve_and_weights(straight, resumed) -> None:
    ref, got = rows(straight.run_dir), rows(resumed.run_dir)
    assert [r["step"] for r in got] == list(range(1, 25))
    for key in ("loss", "grad_norm", "lr", "acc", "tau_hat", "tokens"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    ref_eval, got_eval = rows(straight.run_dir, "eval"), rows(resumed.run_dir, "eval")
    assert [(r["step"], r["loss"]) for r in got_eval] == [(r["step"], r["loss"]) for r in ref_eval]
    ref_m = json.loads((straight.run_dir / "train" / "manifest.json").read_text())
    got_m = json.loads((resumed.run_dir / "train" / "manifest.json").read_text())
    assert got_m["replica_digests"] == ref_m["replica_digests"]  # bit-identical final weights


def start_run(tmp_path, straight, name: str):
    cfg = make_config(tmp_path / name, overrides=COMMON)
    shutil.copytree(straight.run_dir / "extract", cfg.run_dir / "extract")
    command = [sys.executable, "-m", "drafter.cli", "train", "--config", "configs/tiny.yaml",
               f"runs_dir={tmp_path / name / 'runs'}", f"cache_dir={CACHE}", *COMMON]
    return cfg, command


def wait_for_step(proc, cfg, step: int) -> None:
    metrics = cfg.run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_in_flight_exits_75_and_the_rerun_resumes_after_it(tmp_path, straight):
    """SIGTERM to the whole process group (as SLURM signals every process of a job step, DataLoader workers too)
    after step 12, between the checkpoints at 10 and 15: the run saves the step it was in, leaves no manifest and
    exits 75; the rerun resumes after that step, and the curve and final weights equal the uninterrupted run's."""
    cfg, command = start_run(tmp_path, straight, "stopped")
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(proc, cfg, 12)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-4000:]
    stopped_at = int(re.search(r"stopped by SIGTERM after step (\d+) of 24", stderr).group(1))
    assert 12 <= stopped_at < 24 and stopped_at % 5, stopped_at  # not a periodic checkpoint
    ckpts = cfg.run_dir / "train" / "checkpoints"
    assert (ckpts / f"step-{stopped_at:08d}" / "COMPLETE").exists()
    assert not (cfg.run_dir / "train" / "manifest.json").exists()

    resumed = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from step-{stopped_at:08d}" in resumed.stderr
    assert_same_curve_and_weights(straight, cfg)


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_loss_curve(tmp_path, straight):
    killed, command = start_run(tmp_path, straight, "killed")
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_step(proc, killed, 12)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    ckpts = killed.run_dir / "train" / "checkpoints"
    assert not (killed.run_dir / "train" / "manifest.json").exists()
    assert (ckpts / "step-00000010" / "COMPLETE").exists()
    # debris of a save killed half-way: a newer tag without COMPLETE must be ignored and removed
    (ckpts / "step-00000020").mkdir(exist_ok=True)
    (ckpts / "step-00000020" / "mp_rank_00_model_states.pt").write_bytes(b"torn")

    resumed = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step-000000" in resumed.stderr
    assert "removed incomplete checkpoint(s) from a killed save: step-00000020" in resumed.stderr

    assert_same_curve_and_weights(straight, killed)
