"""The W&B runs of a pipeline run, opened in one place (`open_run`), so that they sit together and link up.

    curate / regen / tokenize / extract   counts and rates from the stage's manifest (`log_stage_run`, when the
                                          stage finishes): what was read, written, dropped (with reasons), per second
    train                                 metrics per step against the step and the tokens seen (`define_axes`),
                                          the drafter as a `model` artifact `<run>-drafter` (`drafter_artifact`)
    eval                                  the report; it *uses* `<run>-drafter` (the same files, so the same artifact
                                          version): W&B shows the lineage train -> drafter -> eval

Every run: project/entity/mode from `train.wandb` (offline by default: nothing leaves the machine; `wandb sync`
uploads later; 'disabled' opens none), group = the run name (`cfg.name`), job_type = the stage, the console
captured (`output.log` of the run), its files under `<run_dir>/<stage>/wandb/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config import RunConfig

# What defines a drafter for W&B: its config and weights. The model card (README.md) is left out: `drafter eval`
# rewrites its results section, and a card edit must not make the scored drafter another artifact version.
DRAFTER_ARTIFACT_FILES = ("config.json", "model.safetensors")
# Per stage, the counts whose per-second rate is logged (count / the stage's wall seconds).
THROUGHPUT = {
    "curate": ("read", "train"),
    "regen": ("written", "generated_tokens"),
    "tokenize": ("written", "tokens"),
    "extract": ("samples", "tokens"),
}


def open_run(cfg: RunConfig, stage: str, directory: Path, *, config: dict | None = None, run_id: str | None = None,
             name: str | None = None):
    """A W&B run for `stage` (None when train.wandb.mode is 'disabled'), its files in `<directory>/wandb/` (the stage's
    directory); `run_id` continues that run (resume)."""
    w = cfg.train.wandb
    if w.mode == "disabled":
        return None
    import wandb

    _skip_launch_inputs_unless_staged(wandb)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        mode=w.mode, project=w.project, entity=w.entity, name=name or f"{w.run_name or cfg.name}-{stage}",
        group=cfg.name, job_type=stage, dir=str(directory), config=config, id=run_id,
        resume="allow" if run_id else None, reinit="create_new",
        settings=wandb.Settings(quiet=True, console="wrap"),
    )


LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


def _skip_launch_inputs_unless_staged(wandb) -> None:
    """`wandb.init` applies the inputs a W&B Launch job staged (`Run._detect_and_apply_job_inputs`) by importing
    wandb's launch package first: about a second per process once torch is loaded (its pydantic models look up
    their docstrings through `inspect.getmodule`, a scan of every loaded module). Inputs can only have been staged by
    code that imported `LAUNCH_INPUTS` (its registry lives there), so while that module is not loaded there is
    nothing to apply: the import is skipped then, and the call is wandb's own otherwise."""
    run_class = getattr(getattr(getattr(wandb, "sdk", None), "wandb_run", None), "Run", None)
    original = getattr(run_class, "_detect_and_apply_job_inputs", None)
    if original is None or getattr(original, "skips_unless_staged", False):
        return

    def detect_and_apply_job_inputs(self) -> None:
        if LAUNCH_INPUTS in sys.modules:
            original(self)

    detect_and_apply_job_inputs.skips_unless_staged = True
    run_class._detect_and_apply_job_inputs = detect_and_apply_job_inputs


def drafter_artifact_name(cfg: RunConfig, export_dir: Path) -> str:
    """`<run>-drafter` for this run's own export; another drafter dir is named by its folder."""
    own = (cfg.run_dir / "train" / "export").resolve()
    if Path(export_dir).resolve() == own:
        return f"{cfg.name}-drafter"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(export_dir).resolve().name)
    return f"drafter-{safe}"


def drafter_artifact(cfg: RunConfig, export_dir: Path, metadata: dict | None = None):
    """The drafter at `export_dir` as a W&B `model` artifact (`DRAFTER_ARTIFACT_FILES`): train logs it, eval uses it."""
    import wandb

    artifact = wandb.Artifact(drafter_artifact_name(cfg, export_dir), type="model", metadata=metadata)
    for name in DRAFTER_ARTIFACT_FILES:
        artifact.add_file(str(Path(export_dir) / name))
    return artifact


def use_drafter(run, artifact) -> None:
    """Declare the drafter `artifact` (`drafter_artifact`) an input of `run`. Online: `run.use_artifact`. Offline,
    W&B refuses `use_artifact`; the record it writes online for an artifact built from local files is written
    instead — the artifact logged with `use_after_commit`, which `wandb sync` turns into the use once it has
    committed the (identical, hence the same) version."""
    if run.offline:
        run._log_artifact(artifact, is_user_created=True, use_after_commit=True)
    else:
        run.use_artifact(artifact)


def stage_metrics(stage: str, manifest: dict) -> dict[str, float]:
    """`<stage>/<count>` for every count of the manifest, `<stage>/<count>_per_s` for its THROUGHPUT counts, and
    `<stage>/wall_seconds`."""
    seconds = float(manifest.get("wall_seconds") or 0.0)
    counts = manifest.get("counts") or {}
    out = {f"{stage}/{k}": v for k, v in counts.items() if isinstance(v, (int, float))}
    out[f"{stage}/wall_seconds"] = seconds
    for k in THROUGHPUT.get(stage, ()):
        if k in counts and seconds > 0:
            out[f"{stage}/{k}_per_s"] = counts[k] / seconds
    return out


def log_stage_run(cfg: RunConfig, stage: str, manifest: dict) -> None:
    """One W&B run for a finished data stage: its counts and rates (`stage_metrics`) as the summary and one logged
    row, the counts as a table (reason by reason), the stage's config section."""
    section = getattr(cfg, stage, None)
    from pipeline.config import to_dict

    run = open_run(cfg, stage, cfg.run_dir / stage, config={stage: to_dict(section)} if section else None)
    if run is None:
        return
    try:
        import wandb

        metrics = stage_metrics(stage, manifest)
        counts = manifest.get("counts") or {}
        run.log({**metrics, f"{stage}/counts": wandb.Table(columns=["count", "value"],
                                                           data=[[k, v] for k, v in counts.items()])})
        for k, v in metrics.items():
            run.summary[k] = v
    finally:
        run.finish()
