"""`make clean` removes caches and keeps runs/ (a user's curated data, features, drafters and reports); only the
explicit `make clean-runs` removes runs/. Run with the repository's Makefile in a scratch directory."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_make_clean_keeps_runs_and_clean_runs_removes_them(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for d in ("runs/demo/train/export", "wandb/run-1", ".pytest_cache/v"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "runs/demo/train/export/model.safetensors").write_bytes(b"weights")
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, timeout=60)
    assert (tmp_path / "runs/demo/train/export/model.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "wandb").exists() and not (tmp_path / ".pytest_cache").exists()
    subprocess.run(["make", "-s", "clean-runs"], cwd=tmp_path, check=True, timeout=60)
    assert not (tmp_path / "runs").exists()
