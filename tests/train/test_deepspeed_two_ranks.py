"""A real 2-process DeepSpeed ZeRO-2 job on CPU (torchrun + gloo) through the CLI: both data-parallel replicas end
with identical weights and the loss falls, and DeepSpeed compiles no C++ op on the way (its CPU shared-memory
all-reduce is skipped: `train.engine.skip_shared_memory_op`)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import CACHE, REPO, make_config
from tests.train.test_stage_train import _dist_env, rows, subprocess_env, write_extract_stage  # noqa: F401
from train.distributed import free_port


@pytest.mark.slow
def test_two_rank_zero2_run_ends_with_identical_weights_and_falling_loss_and_builds_no_cpp_op(tmp_path):
    cfg_args = [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", "train.max_steps=10", "train.log_every=1",
                "train.eval_every=10", "train.eval_fraction=0.2", "train.save_every=0", "train.zero_stage=2",
                "train.micro_batch_tokens=256", "train.lr=5e-3"]
    write_extract_stage(make_config(tmp_path, overrides=cfg_args[2:]), n=40)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "drafter.cli", "train", "--config", "configs/tiny.yaml", *cfg_args]
    extensions = tmp_path / "torch_extensions"  # where a JIT-compiled op would be built
    done = subprocess.run(cmd, cwd=REPO, env={**subprocess_env(), "TORCH_EXTENSIONS_DIR": str(extensions)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not extensions.exists() or not any(extensions.rglob("*")), sorted(extensions.rglob("*"))
    assert "built successfully" not in done.stdout + done.stderr

    run = tmp_path / "runs" / "tiny"
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    per_rank = [json.loads((run / "train" / "ranks" / f"rank-{r:05d}.json").read_text()) for r in (0, 1)]
    assert per_rank[0]["weights_sha256"] == per_rank[1]["weights_sha256"]
    assert len(rows(run)) == 10 and all(np.isfinite(r["loss"]) for r in rows(run))
    held_out = {r["step"]: r["loss"] for r in rows(run, "eval")}  # same held-out blocks before and after
    assert held_out[10] < 0.85 * held_out[0]


