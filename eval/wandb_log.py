"""The eval W&B run: the report's tables and plots, its verdict in the summary, and report.{json,md,html} as an
artifact, in the W&B project and group of the train run (`pipeline.wandb_run.open_run`; nothing when train.wandb.mode
is 'disabled'). It uses the drafter it scored as an input artifact (`pipeline.wandb_run.drafter_artifact`, the same
files the train run logged, hence the same artifact version): W&B links train -> drafter -> eval."""

from __future__ import annotations

from pathlib import Path

from eval.report import REPORT_FILES, json_ready, plot_per_depth, plot_speedup, tau_table, verdict, verdict_text
from pipeline.config import RunConfig, to_dict
from pipeline.wandb_run import DRAFTER_ARTIFACT_FILES, drafter_artifact, open_run, use_drafter


def log_eval_run(cfg: RunConfig, report: dict, stage_path: Path, drafter_dir: Path | None = None) -> None:
    """The eval W&B run (group = the run name, beside the train run): the drafter at `drafter_dir` used as its input
    artifact, the report's tables, its verdict in the summary, its speedup and per-position plots, and
    report.{json,md,html} as the `<run>-eval-report` artifact."""
    run = open_run(cfg, "eval", stage_path, config=json_ready(to_dict(cfg.eval)))
    if run is None:
        return
    import io

    import wandb
    from PIL import Image

    cols = ["benchmark", "method", "budget", "responses", "rounds", "new_tokens", "tau_mean", "tau_pooled",
            "tokens_per_second", "speedup", "ar_match"]
    try:
        if drafter_dir is not None and all((Path(drafter_dir) / f).is_file() for f in DRAFTER_ARTIFACT_FILES):
            use_drafter(run, drafter_artifact(cfg, Path(drafter_dir)))
        report = json_ready(report)
        cells = report["cells"]
        tau = tau_table(report)
        depth_rows = [[c["benchmark"], c["label"], d["depth"], d["rate"], d.get("unconditional")]
                      for c in cells for d in c["per_depth"]]
        images = {"eval/speedup_plot": plot_speedup(report), "eval/per_depth_plot": plot_per_depth(report)}
        run.log({
            "eval/cells": wandb.Table(columns=cols, data=[[c.get(k) for k in cols] for c in cells]),
            "eval/tau_table": wandb.Table(columns=tau.headers, data=tau.rows),
            "eval/per_depth": wandb.Table(columns=["benchmark", "method", "depth", "conditional", "unconditional"],
                                          data=depth_rows),
            **{k: wandb.Image(Image.open(io.BytesIO(png))) for k, png in images.items()},
        })
        v = verdict(report)
        run.summary["eval/verdict"] = verdict_text(v)
        for key in ("best", "speedup", "tau", "lossless"):
            run.summary[f"eval/verdict/{key}"] = v[key]
        run.summary["eval/verdict/responses_per_cell_min"] = v["responses"][0]
        run.summary["eval/verdict/warnings"] = list(v["warnings"])
        for c in cells:
            for key in ("tau_mean", "tau_pooled", "speedup", "tokens_per_second"):
                run.summary[f"eval/{c['benchmark']}/{c['label']}/{key}"] = c.get(key)
        artifact = wandb.Artifact(f"{cfg.name}-eval-report", type="eval-report",
                                  metadata={"verdict": verdict_text(v), "warnings": v["warnings"]})
        for name in REPORT_FILES:
            if (stage_path / name).is_file():
                artifact.add_file(str(stage_path / name))
        run.log_artifact(artifact)
    finally:
        run.finish()
