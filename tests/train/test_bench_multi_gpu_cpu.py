"""benchmarks/multi_gpu.sh end to end on CPU (gloo) at the tiny shape: the 2-rank ZeRO-3 training run ends with
bit-identical weights on both ranks, and 2 independent extraction ranks (RANK/WORLD_SIZE from the environment,
one shared stage dir) merge into an index holding every tokenized sample exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
             "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")


@pytest.mark.slow
def test_two_rank_training_keeps_replicas_identical_and_split_extraction_covers_every_sample_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and k != "WANDB_SERVICE"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    cmd = ["bash", "benchmarks/multi_gpu.sh", "--gpus", "2", "--device", "cpu", "--shape", "tiny", "--extract-shape",
           "tiny", "--stages", "3", "--no-single", "--steps", "2", "--warmup", "0", "--tokens-per-rank", "4000",
           "--out", str(out), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (row,) = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert (row["world_size"], row["zero_stage"], row["launcher"]) == (2, 3, "torchrun")
    assert row["weights_identical"] is True and len(row["weights_sha256"]) == 64
    assert row["tokens_per_s_per_gpu"] > 0 and row["loss"] > 0

    res = json.loads((out / "extract.json").read_text())
    assert res["world_size"] == res["ranks_reported"] == 2
    assert res["exactly_once"] and res["ranks_disjoint_and_cover"] and res["passed"]
    assert res["samples_in_index"] == res["samples"] > 2 and res["tokens"] == res["manifest_tokens"]
    timing = [json.loads((tmp_path / "work" / "extract" / "timing" / f"rank-{r:05d}.json").read_text()) for r in (0, 1)]
    assert [t["rank"] for t in timing] == [0, 1] and all(t["units"] for t in timing)
    assert not set(timing[0]["units"]) & set(timing[1]["units"])  # disjoint slices, as an array job takes them
    assert "efficiency" in (out / "train.txt").read_text() and "AGGREGATE tok/s" in (out / "extract.txt").read_text()
