"""What slurm/pipeline.sh asks SLURM for, read from its --dry-run (no cluster needed): GPUs per regen / extract task
from the config's tensor parallelism, time limits per stage or for all, the time-limit warning that makes a job
checkpoint and requeue itself, and a config error refused before anything is submitted. The sbatch scripts run
every stage through `requeueable` (slurm/env.sh), tested for real in test_slurm_pipeline.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(*flags: str, args: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "CONFIG": "configs/qwen3-8b.yaml", "ARGS": args,
           "DRAFTER_VENV": os.environ.get("VIRTUAL_ENV", str(REPO / ".venv"))}
    return subprocess.run(["bash", "slurm/pipeline.sh", "--dry-run", *flags], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)


def jobs(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.strip().splitlines()}


def test_gpus_per_task_follow_the_configs_tensor_parallelism():
    out = dry_run(args="regen.vllm.tensor_parallel_size=2 extract.vllm.tensor_parallel_size=4")
    assert out.returncode == 0, out.stderr
    j = jobs(out.stdout)
    assert "--array=0-7 --gpus=2 " in j["regen"] and "--array=0-7 --gpus=4 " in j["extract"]
    hf = jobs(dry_run(args="regen.backend=hf extract.backend=hf regen.vllm.tensor_parallel_size=2").stdout)
    assert "--gpus=1 " in hf["regen"] and "--gpus=1 " in hf["extract"]  # the hf backends run on one GPU


def test_time_limits_and_the_warning_before_them_reach_every_job():
    out = dry_run("--time", "4:00:00", "--time", "train=2-00:00:00", "--signal-margin", "300")
    assert out.returncode == 0, out.stderr
    j = jobs(out.stdout)
    assert list(j) == ["curate", "regen", "regen-merge", "extract", "extract-merge", "train", "eval"]
    for name, line in j.items():
        assert "--signal=B:USR1@300" in line, name
        assert ("--time=2-00:00:00" if name == "train" else "--time=4:00:00") in line, name
    assert "--dependency=afterok:<extract-merge>" in j["train"]
    assert "--time" not in dry_run().stdout  # no limit asked: the partition's default


def test_a_config_error_is_refused_before_anything_is_submitted():
    out = dry_run(args="train.lrr=1")
    assert out.returncode != 0 and out.stdout == ""
    assert "unknown config key 'train.lrr'; did you mean 'train.lr'?" in out.stderr
    bad = dry_run("--time", "trian=1:00:00")
    assert bad.returncode == 2 and "the stage must be one of" in bad.stderr


def test_every_sbatch_script_requeues_itself_at_its_time_limit():
    for script in sorted((REPO / "slurm").glob("*.sbatch")):
        text = script.read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text, script.name
        assert "requeueable " in text, script.name  # the stage runs under the wrapper that forwards and requeues
