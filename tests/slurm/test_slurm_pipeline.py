"""The SLURM launchers, for real: a single-node SLURM cluster on localhost (slurm/ci-slurm.sh) runs the tiny
pipeline through `slurm/pipeline.sh` — curate, a 2-task regen array + merge, a 2-task extract array + merge, a
2-process torchrun training job and a 2-task eval array + merge — as one afterok dependency chain."""

from __future__ import annotations

import os
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
    env = {"SLURM_FAKE_CPUS": "8", "SLURM_FAKE_GPUS": "2"}
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
