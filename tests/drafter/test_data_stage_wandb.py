"""curate / regen / tokenize log their counts and rates to W&B when they finish (one run each, job_type = the stage,
in the pipeline's group), read back from the transaction logs W&B writes offline; a finished stage run again logs
nothing (its re-run writes nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from drafter.cli import main as drafter_main
from pipeline.config import load_config
from tests.conftest import wandb_offline_records

REPO = Path(__file__).resolve().parents[2]


def summary_of(records) -> dict:
    out = {}
    for r in records:
        if r.HasField("summary"):
            out.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
    return out


def test_data_stages_log_counts_and_rates_in_the_pipelines_group(tmp_path):
    overrides = [f"runs_dir={tmp_path}", "curate.total=60", "regen.max_samples=16", "regen.max_new_tokens=16"]
    cfg = load_config(REPO / "configs/tiny.yaml", overrides)
    assert drafter_main(["curate", "--config", str(REPO / "configs/tiny.yaml"), *overrides]) == 0
    assert drafter_main(["regen", "--config", str(REPO / "configs/tiny.yaml"), *overrides]) == 0  # + tokenize
    for stage, rate in (("curate", "train_per_s"), ("regen", "written_per_s"), ("tokenize", "tokens_per_s")):
        records = wandb_offline_records(cfg.run_dir / stage / "wandb")
        (run,) = [r.run for r in records if r.HasField("run")]
        assert (run.run_group, run.job_type, run.display_name) == ("tiny", stage, f"tiny-{stage}")
        manifest = json.loads((cfg.run_dir / stage / "manifest.json").read_text())
        summary = summary_of(records)
        for key, value in manifest["counts"].items():
            assert summary[f"{stage}/{key}"] == value, key  # every count, drops by reason included
        rated = rate.removesuffix("_per_s")
        assert summary[f"{stage}/{rate}"] == manifest["counts"][rated] / manifest["wall_seconds"] > 0
    assert summary_of(wandb_offline_records(cfg.run_dir / "curate" / "wandb"))["curate/train"] == 60
    runs_before = sorted(p.name for p in (cfg.run_dir / "curate" / "wandb").iterdir())
    assert drafter_main(["curate", "--config", str(REPO / "configs/tiny.yaml"), *overrides]) == 0  # already complete
    assert sorted(p.name for p in (cfg.run_dir / "curate" / "wandb").iterdir()) == runs_before


LAUNCH_CHECK = """
import importlib, json, sys
from pipeline.config import load_config
from pipeline.wandb_run import LAUNCH_INPUTS, open_run
cfg = load_config("configs/tiny.yaml", [f"runs_dir={sys.argv[1]}"])
open_run(cfg, "curate", cfg.run_dir / "a").finish()
skipped = LAUNCH_INPUTS not in sys.modules
applied = []
importlib.import_module(LAUNCH_INPUTS).StagedLaunchInputs.apply = lambda self, run: applied.append(run.id)
run = open_run(cfg, "curate", cfg.run_dir / "b")
run.finish()
print(json.dumps({"skipped": skipped, "applied": applied == [run.id]}))
"""


def test_a_run_skips_wandb_launch_unless_a_launch_job_staged_inputs_in_this_process(tmp_path):
    """`open_run` leaves wandb's launch package unloaded (a second per process once torch is loaded) when nothing
    could have staged Launch inputs, and applies them as wandb does once its registry is loaded."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LAUNCH_CHECK, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"skipped": True, "applied": True}
