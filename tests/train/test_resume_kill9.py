"""kill -9 in the middle of a training run, then run again: the resumed run logs exactly the loss curve of an
uninterrupted run (same losses, grad norms, learning rates and held-out metrics at every step)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import CACHE, REPO, make_config
from tests.train.test_stage_train import _dist_env, rows, subprocess_env, write_extract_stage  # noqa: F401

COMMON = ["train.max_steps=24", "train.log_every=1", "train.eval_every=8", "train.save_every=5",
          "train.micro_batch_tokens=384", "train.num_anchors=24", "train.num_workers=1"]


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    from train.stage import run_train

    straight = make_config(tmp_path / "straight", overrides=COMMON)
    write_extract_stage(straight, n=48)
    run_train(straight)  # the uninterrupted reference, in this process (1 thread, like the subprocesses)

    killed = make_config(tmp_path / "killed", overrides=COMMON)
    shutil.copytree(straight.run_dir / "extract", killed.run_dir / "extract")
    command = [sys.executable, "-m", "drafter.cli", "train", "--config", "configs/tiny.yaml",
               f"runs_dir={tmp_path / 'killed' / 'runs'}", f"cache_dir={CACHE}", *COMMON]
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed.run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and '"step": 12,' in metrics.read_text():
            break
        time.sleep(0.01)
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

    ref, got = rows(straight.run_dir), rows(killed.run_dir)
    assert [r["step"] for r in got] == list(range(1, 25))
    for key in ("loss", "grad_norm", "lr", "acc", "tau_hat", "tokens"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    ref_eval, got_eval = rows(straight.run_dir, "eval"), rows(killed.run_dir, "eval")
    assert [(r["step"], r["loss"]) for r in got_eval] == [(r["step"], r["loss"]) for r in ref_eval]
    ref_m = json.loads((straight.run_dir / "train" / "manifest.json").read_text())
    got_m = json.loads((killed.run_dir / "train" / "manifest.json").read_text())
    assert got_m["replica_digests"] == ref_m["replica_digests"]  # bit-identical final weights
