"""The eval W&B run (offline by default) carries the same tables as report.json; disabled mode writes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from test_report_files import make_report  # noqa: E402

from eval.report import REPORT_FILES, json_ready, verdict_text, write_report  # noqa: E402
from eval.wandb_log import log_eval_run  # noqa: E402
from tests.conftest import md5_b64, wandb_artifact_files, wandb_offline_records  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_offline_wandb_run_holds_the_cell_tau_and_depth_tables(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}", "train.wandb.mode=offline"])
    report = make_report("tiny", [[3, 2, 1], [4]], [[5, 3]])
    log_eval_run(cfg, report, tmp_path / "eval")
    tables = {p.name.split("_")[0]: p for p in (tmp_path / "eval").rglob("*.table.json")}
    assert {"cells", "tau", "per"} <= set(tables), sorted(tables)
    cells = json.loads(tables["cells"].read_text())
    assert cells["columns"][:3] == ["benchmark", "method", "budget"]
    chain = next(r for r in cells["data"] if r[0] == "gsm8k" and r[1] == "chain")
    want = next(c for c in json_ready(report)["cells"] if c["benchmark"] == "gsm8k" and c["label"] == "chain")
    assert chain[6] == want["tau_mean"] and chain[9] == want["speedup"]
    tau = json.loads(tables["tau"].read_text())
    assert tau["columns"][0] == "benchmark" and [r[0] for r in tau["data"]] == ["gsm8k", "mt_bench"]


def test_disabled_wandb_writes_no_run(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}", "train.wandb.mode=disabled"])
    log_eval_run(cfg, make_report("tiny", [[2]], [[3]]), tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_offline_eval_run_is_grouped_with_train_and_carries_the_report_and_its_verdict(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}"])  # W&B mode left at its default
    assert cfg.train.wandb.mode == "offline"
    report = make_report("tiny", [[3, 2, 1], [4]], [[5, 3]])
    stage = tmp_path / "eval"
    write_report(report, stage)
    log_eval_run(cfg, report, stage)
    records = wandb_offline_records(stage)
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.run_group == cfg.name == "tiny" and run.job_type == "eval"
    (art,) = [r for r in records if r.HasField("artifact") and r.artifact.type == "eval-report"]
    assert art.artifact.name == "tiny-eval-report"
    assert wandb_artifact_files(art) == {name: md5_b64(stage / name) for name in REPORT_FILES}
    summary = {}
    for r in records:
        if r.HasField("summary"):
            summary.update({u.key: json.loads(u.value_json) for u in r.summary.update if u.key})
    assert summary["eval/verdict"] == verdict_text(json.loads((stage / "report.json").read_text())["verdict"])
    assert summary["eval/verdict/best"] == "ddtree@16" and summary["eval/verdict/responses_per_cell_min"] == 1
    assert any("as few as 1 responses" in w for w in summary["eval/verdict/warnings"])
    tables = {p.name.split("_")[0]: p for p in stage.rglob("*.table.json")}
    per_depth = json.loads(tables["per"].read_text())
    assert per_depth["columns"] == ["benchmark", "method", "depth", "conditional", "unconditional"]
    images = sorted(p.name.split("_plot")[0] for p in stage.rglob("media/images/eval/*.png"))
    assert images == ["per_depth", "speedup"]
