"""The SLURM launchers, for real: a single-node SLURM cluster on localhost (slurm/ci-slurm.sh) runs the tiny
pipeline through `slurm/pipeline.sh` — curate, a 2-task regen array + merge, a 2-task extract array + merge, a
2-process torchrun training job and a 2-task eval array + merge — as one afterok dependency chain; and a training
job with a 2-minute time limit stops at SLURM's warning with a checkpoint, requeues itself and finishes, every step
logged once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI_SLURM = REPO / "slurm" / "ci-slurm.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting slurmctld/slurmd/munged needs root (CI runs as root)"),
    pytest.mark.skipif(shutil.which("apt-get") is None and shutil.which("sbatch") is None,
                       reason="neither SLURM nor apt-get (to install it) is available"),
]


def _sh(script: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm_cluster():
    # a requeued job waits the step-credential lifetime before it starts again: 20 s here instead of SLURM's 120
    env = {"SLURM_FAKE_CPUS": "8", "SLURM_FAKE_GPUS": "2", "SLURM_CRED_EXPIRE": "20"}
    start = _sh(f"bash {CI_SLURM} start", env, timeout=300)
    assert start.returncode == 0, start.stdout + start.stderr
    yield env
    _sh(f"bash {CI_SLURM} stop", env, timeout=120)


def test_pipeline_runs_as_a_slurm_dependency_chain_with_arrays_and_torchrun(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    env = {
        "CONFIG": "configs/tiny.yaml",
        "ARGS": f"runs_dir={runs} cache_dir={REPO / '.cache'} regen.max_samples=24 regen.shard_size=8 "
                "extract.shard_tokens=1024 train.max_steps=4 train.eval_every=0 train.save_every=2 eval.max_new_tokens=8 "
                "eval.budgets=[4]",
        "SBATCH_FLAGS": "--cpus-per-task=1",
        "DRAFTER_VENV": str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))),
        "OMP_NUM_THREADS": "1",
    }
    submit = _sh("slurm/pipeline.sh --regen-tasks 2 --extract-tasks 2 --eval-tasks 2 --train-nodes 1 "
                 "--gpus-per-node 2", env)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    jobs = dict(line.split() for line in submit.stdout.strip().splitlines())
    assert list(jobs) == ["curate", "regen", "regen-merge", "extract", "extract-merge", "train", "eval", "eval-merge"]
    wait = _sh(f"source {CI_SLURM}; slurm_wait {jobs['eval-merge']} 840", env, timeout=900)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(REPO.glob("slurm-drafter-*.out")))
    assert wait.returncode == 0, wait.stderr + logs
    # every array task and dependency finished cleanly
    for name, job in jobs.items():
        state = _sh(f"scontrol -o show job {job}", env).stdout
        assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, (name, state)
    run = runs / "tiny"
    for stage in ("curate", "regen", "tokenize", "extract", "train", "eval"):
        assert (run / stage / "manifest.json").exists(), stage
    assert (run / "eval" / "report.md").exists()
    ranks = sorted(p.name for p in (run / "extract" / "ranks").glob("rank-*.json"))
    assert ranks == ["rank-00000.json", "rank-00001.json"]  # two array tasks split the work
    assert (run / "train" / "export" / "model.safetensors").exists()
    for p in REPO.glob("slurm-drafter-*.out"):
        p.unlink()


def test_a_time_limited_training_job_requeues_itself_and_finishes_with_every_step_once(slurm_cluster, tmp_path):
    """--time 2 min, USR1 60 s before it: the batch shell passes SIGTERM to the torchrun step, the rank checkpoints
    the step in flight and exits 75, the job requeues itself (`requeueable`, slurm/env.sh), the restart resumes
    after that step. 600 online steps of the tiny drafter take longer than one slot on a quiet 2-core machine (about
    6 steps/s), so at least one requeue; a loaded machine needs more. A stop that comes before a restart's first step
    (a slow start) leaves no new checkpoint: the next restart resumes from the same step again; every checkpointed
    stop is resumed exactly there, and every step is logged once."""
    runs, steps = tmp_path / "runs", 600
    data = f"runs_dir={runs} cache_dir={REPO / '.cache'} regen.max_samples=24"
    venv = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))
    for stage in ("curate", "regen"):  # the data, directly (the tiny target answers its prompts, then tokenizes)
        out = _sh(f"{venv}/bin/drafter {stage} --config configs/tiny.yaml {data}", {"DRAFTER_NO_PROGRESS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
    env = {
        "CONFIG": "configs/tiny.yaml",
        "ARGS": f"{data} train.online=true train.engine=torch train.max_steps={steps} train.log_every=1 "
                "train.eval_every=0 train.save_every=0 train.wandb.mode=disabled",
        "SBATCH_FLAGS": f"--cpus-per-task=1 --output={tmp_path}/train-%j.out",
        "DRAFTER_VENV": str(venv), "OMP_NUM_THREADS": "1",
    }
    submit = _sh("slurm/pipeline.sh --stages train --time train=2 --signal-margin 60 --gpus-per-node 1", env)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    (job,) = [line.split()[1] for line in submit.stdout.strip().splitlines()]
    wait = _sh(f"source {CI_SLURM}; slurm_wait {job} 840", env, timeout=900)
    log = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("train-*.out"))
    assert wait.returncode == 0, wait.stderr + log[-4000:]
    state = _sh(f"scontrol -o show job {job}", env).stdout
    restarts = int(re.search(r"Restarts=(\d+)", state).group(1))
    assert "JobState=COMPLETED" in state and restarts >= 1, state
    assert log.count("requeueing job") == restarts, log[-4000:]
    stopped = [int(k) for k in re.findall(r"stopped by SIGTERM after step (\d+) of", log)]
    resumed = [int(k) for k in re.findall(r"resumed from step-\d+ \(step (\d+),", log)]
    # every checkpointed stop is resumed exactly there; a restart stopped before its first step (a slow start on a
    # loaded machine) checkpoints nothing, so the next one resumes from the same step again
    assert 1 <= len(stopped) <= restarts and sorted(set(resumed)) == stopped and resumed == sorted(resumed), \
        (stopped, resumed)
    rows = [json.loads(line) for line in (runs / "tiny" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, steps + 1))  # every step once
    assert (runs / "tiny" / "train" / "manifest.json").exists()
    assert (runs / "tiny" / "train" / "export" / "model.safetensors").exists()
