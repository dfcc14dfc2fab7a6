"""The eval W&B run (offline by default) carries the same tables as report.json and uses the drafter artifact the
train run logged (the same files, the same digest: W&B's lineage train -> drafter -> eval); the train run charts its
metrics against the optimizer step and the tokens seen and captures the console; disabled mode writes nothing. Read
from the transaction logs W&B writes offline."""

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
    assert summary["eval/verdict/best"] is None and summary["eval/verdict/responses_per_cell_min"] == 1  # too few
    assert any("as few as 1 responses" in w for w in summary["eval/verdict/warnings"])
    tables = {p.name.split("_")[0]: p for p in stage.rglob("*.table.json")}
    per_depth = json.loads(tables["per"].read_text())
    assert per_depth["columns"] == ["benchmark", "method", "depth", "conditional", "unconditional"]
    images = sorted(p.name.split("_plot")[0] for p in stage.rglob("media/images/eval/*.png"))
    assert images == ["per_depth", "speedup"]


def test_the_eval_run_uses_the_drafter_artifact_the_train_run_logged_and_train_has_step_and_token_axes(tmp_path):
    import torch

    from dflash_model.export import export_zlab
    from dflash_model.model import DFlashDrafter, DrafterArgs
    from pipeline.log import get_logger
    from train.metrics import MetricsLogger

    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}"])
    args = DrafterArgs(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=64, block_size=8,
                       mask_token_id=60, target_layer_ids=[0, 1], num_target_layers=4)
    torch.manual_seed(0)
    export = cfg.run_dir / "train" / "export"
    export_zlab(DFlashDrafter(args), args, export)
    logger = MetricsLogger(cfg, cfg.run_dir / "train", resume_step=None)  # the train run, as the trainer opens it
    get_logger("train").info("a line the trainer writes to its console")
    logger.log(1, "train", {"loss": 2.0, "tokens_seen": 4096, "tau_hat": 1.5})
    logger.log(2, "train", {"loss": 1.5, "tokens_seen": 8192, "tau_hat": 1.7})
    logger.log(2, "eval", {"loss": 1.8, "tau_hat": 1.6})
    logger.log_export(export, {"steps": 2})
    logger.finish()
    log_eval_run(cfg, make_report("tiny", [[3, 2, 1], [4]], [[5, 3]]), cfg.run_dir / "eval", export)

    train = wandb_offline_records(cfg.run_dir / "train" / "wandb")
    evals = wandb_offline_records(cfg.run_dir / "eval" / "wandb")
    (logged,) = [r.artifact for r in train if r.HasField("artifact") and r.artifact.type == "model"]
    (used,) = [r.artifact for r in evals if r.HasField("artifact") and r.artifact.type == "model"]
    assert not logged.use_after_commit and used.use_after_commit  # produced by train, an input of eval
    assert used.name == logged.name == "tiny-drafter" and used.digest == logged.digest  # the same artifact version
    # the x-axes: train/* and eval/* against the optimizer step, tokens/* against the tokens seen
    axes = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in train if r.HasField("metric")}
    assert axes == {"optimizer_step": "", "tokens_seen": "", "train/*": "optimizer_step", "eval/*": "optimizer_step",
                    "tokens/*": "tokens_seen"}
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in train if r.HasField("history")]  # one row per step (W&B merges a step's logs)
    assert [(h["optimizer_step"], h["tokens_seen"], h["tokens/train_loss"]) for h in history] == [
        (1, 4096, 2.0), (2, 8192, 1.5)]
    assert history[1]["tokens/eval_loss"] == 1.8 and history[1]["eval/loss"] == 1.8
    console = [r.output.line or r.output_raw.line for r in train if r.HasField("output") or r.HasField("output_raw")]
    assert any("a line the trainer writes to its console" in line for line in console)
