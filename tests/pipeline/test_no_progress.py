"""DRAFTER_NO_PROGRESS=1 silences every progress bar of a run, the libraries' included: transformers' "Writing model
shards" (a random target written to the cache) and "Loading weights" (the target loaded), even when transformers
was imported before the pipeline. Without it the same script shows both bars (the check is not vacuous)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import transformers  # imported before the pipeline, as a user's script might
from pipeline.config import load_config
from pipeline.log import progress
from pipeline.target import load_target, materialize_target

cfg = load_config("configs/tiny.yaml", [f"cache_dir={sys.argv[1]}", "target.random_init={num_hidden_layers: 2}"])
location = materialize_target(cfg.target, cfg.cache_dir)   # save_pretrained: "Writing model shards"
load_target(location, cfg.target)                           # from_pretrained: "Loading weights"
for _ in progress(range(3), desc="our own bar"):
    pass
"""


def run(tmp_path: Path, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("DRAFTER_NO_PROGRESS", "TQDM_DISABLE",
                                                              "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cache")], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**base, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def test_drafter_no_progress_silences_transformers_bars_and_ours(tmp_path):
    shown = run(tmp_path / "a")
    assert "Writing model shards" in shown and "Loading weights" in shown and "our own bar" in shown
    quiet = run(tmp_path / "b", DRAFTER_NO_PROGRESS="1")
    for bar in ("Writing model shards", "Loading weights", "our own bar", "it/s]"):
        assert bar not in quiet, quiet[-2000:]
