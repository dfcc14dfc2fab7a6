"""The GPU recipe's scripts run end to end on the CPU (so a GPU session cannot fail on a typo): the offline bundle
rebuilds the GGUF byte for byte from its parts and refuses a missing part; quality_gpu.sh runs every stage and the
loss ablation on configs/tiny.yaml, over two calls as a device session splits it, and prints its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def bundle(*args, cwd=REPO):
    return subprocess.run(["bash", "benchmarks/offline_bundle.sh", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable})


def test_offline_bundle_rebuilds_the_gguf_from_its_parts_and_refuses_a_missing_one(tmp_path):
    blob = tmp_path / "model.gguf"
    blob.write_bytes(os.urandom(3 << 20))  # incompressible: xz keeps ~3 MiB, so 1 MiB parts make several
    out = bundle("pack", "--out", tmp_path / "b", "--gguf-from", blob, "--part-mib", 1, "--no-wheels")
    assert out.returncode == 0, out.stderr
    parts = sorted((tmp_path / "b" / "gguf").glob("part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 1 << 20 for p in parts)
    back = bundle("assemble", "--from", tmp_path / "b", "--gguf", tmp_path / "node" / "smol.gguf")
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "node" / "smol.gguf").read_bytes() == blob.read_bytes()
    parts[1].unlink()
    broken = bundle("assemble", "--from", tmp_path / "b", "--gguf", tmp_path / "node2" / "smol.gguf")
    assert broken.returncode != 0 and not (tmp_path / "node2" / "smol.gguf").exists()


@pytest.mark.slow
def test_quality_recipe_runs_every_stage_and_the_ablation_on_the_tiny_config_over_two_calls(tmp_path):
    # one device call runs at most 10 minutes: the recipe is the same command per call, `--stop-after` ending one
    def call(*extra):
        return subprocess.run(
            ["bash", "benchmarks/quality_gpu.sh", "--out", tmp_path / "q", "--runs-dir", tmp_path / "runs",
             "--config", "configs/tiny.yaml", "--device", "cpu", "--ablation-steps", "2", "--train-steps", "2",
             "--quick", *extra, "--", "train.online=true", f"cache_dir={REPO / '.cache'}"],
            cwd=REPO, capture_output=True, text=True, timeout=1500,
            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    assert call("--stop-after", "nonsense").returncode == 2
    first = call("--stop-after", "regen")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped after regen" in first.stdout and not (tmp_path / "runs" / "tiny" / "train").exists()
    out = call()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "q" / "stage_seconds.txt").read_text().splitlines()
    labels = [line.split()[0] for line in lines]
    assert labels[:4] == ["curate", "regen", "curate", "regen"]  # the second call's are no-ops, appended
    assert set(labels) == {"curate", "regen", "train", "eval", "train[ce]", "train[kl]", "train[ce+kl]", "eval[ce]",
                           "eval[kl]", "eval[ce+kl]"}
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    regen_seconds = sum(int(line.split()[1]) for line in lines if line.startswith("regen "))
    assert summary["stages"]["regen"] == {"seconds": regen_seconds, "exit": 0}  # a stage's time sums its calls
    assert set(summary["ablation"]) == {"ce", "kl", "ce+kl"}
    assert summary["train"]["steps"] == 2 and summary["data"]["regen"]["written"] > 0
    assert "held_out/chain" in summary["eval"] and (tmp_path / "q" / "report.md").exists()  # no mirror: held-out
    assert "## Loss ablation" in out.stdout


@pytest.mark.slow
def test_a_sigterm_to_the_recipe_reaches_its_training_which_checkpoints_the_step_in_flight_and_resumes_there(tmp_path):
    """`timeout -s TERM` / a scheduler's limit signals the script: the stage in flight gets the signal and the
    script waits for it, so the trainer saves the step in flight (exit 75), no later stage starts, nothing is left
    running, and the checkpoint the same command resumes from is that step's. (Before, the shell died at once and its trainer was killed
    with the job before its checkpoint was written.)"""
    import signal
    import time

    runs = tmp_path / "runs"

    def start(*extra):
        return subprocess.Popen(
            ["bash", "benchmarks/quality_gpu.sh", "--out", tmp_path / "q", "--runs-dir", runs, "--config",
             "configs/tiny.yaml", "--device", "cpu", "--ablation-steps", "0", "--train-steps", "100000", *extra,
             "--", "train.online=true", "train.save_every=100000", "train.eval_every=0", "train.zero_stage=0",
             f"cache_dir={REPO / '.cache'}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    first = start()
    log = tmp_path / "q" / "train.log"
    deadline = time.monotonic() + 900
    while not (log.exists() and "trainable params" in log.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.5)
    time.sleep(3)  # some steps in
    first.send_signal(signal.SIGTERM)  # the script alone, as `timeout --foreground` or SLURM's batch shell gets it
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM during train" in out, out[-3000:]
    assert "train" in [line.split()[0] for line in (tmp_path / "q" / "stage_seconds.txt").read_text().splitlines()
                       if line.split()[2] == "75"]
    assert not (runs / "tiny" / "eval").exists()
    ckpts = sorted((runs / "tiny" / "train" / "checkpoints").glob("step-*/COMPLETE"))
    assert ckpts, "no complete checkpoint of the step in flight"
    saved = int(ckpts[-1].parent.name.split("-")[1])
    assert saved > 0
    leftover = subprocess.run(["pgrep", "-f", str(runs)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes of the run still alive: {leftover}"
    from train.checkpoint import latest_complete

    tag, state = latest_complete(runs / "tiny" / "train" / "checkpoints")  # what the same command resumes from
    assert tag == ckpts[-1].parent.name and state["global_step"] == saved
