"""The stage contract's data side: one typed reader for each manifest that a later stage consumes.

A stage's manifest (written last by `StageDir.write_manifest`; docs/design.md, "Data contracts between stages") is
read by the stages after it through these readers, never by indexing the dict:

    curate_outputs(run_dir)    -> CuratedData        regen (config hash), eval (overlap), drafter plan
    regen_outputs(run_dir)     -> RegeneratedData    tokenize (fingerprint, config hash, units)
    tokenize_outputs(run_dir)  -> TokenizedData      extract and online training (fingerprint, config hash), plan
    extract_outputs(run_dir)   -> ExtractedFeatures  offline training (the feature fingerprint: taps, last_hidden)
    train_outputs(train_dir)   -> TrainedDrafter     eval (the drafter's tokenizer and taps, beside its export)

Each reader checks every field it returns (present, of its JSON type; pipeline/records.py). A damaged manifest (not
JSON, not an object, a key missing, a value of another type) is a DamagedFile (a StageError) naming the file, the
field and the command that writes it anew, never a KeyError or TypeError inside the stage that reads it. A stage that has not finished is the StageError
of `StageDir.manifest` ("run `drafter <stage>` first").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import DamagedFile
from pipeline.records import BOOL, INT, LIST, OBJECT, STR, FieldProblem, get
from pipeline.stage_dir import StageDir

_KINDS = {dict: OBJECT, list: LIST, str: STR, int: INT, bool: BOOL}


def damaged(stage: StageDir, problem: str) -> DamagedFile:
    """The error for a manifest whose fields are not what the stage contract says."""
    return DamagedFile(stage.manifest_path, problem, stage.repair_manifest)


def field(stage: StageDir, manifest: Any, dotted: str, kind: type, *, optional: bool = False) -> Any:
    """manifest[a][b]... for dotted = 'a.b...', checked to be of JSON type `kind` (a DamagedFile naming the file
    and the field otherwise). optional: a missing key (or null) reads as None."""
    try:
        return get(manifest, dotted, _KINDS[kind], optional=optional)
    except FieldProblem as e:
        raise damaged(stage, str(e)) from None


def _int_list(stage: StageDir, manifest: dict, dotted: str) -> list[int]:
    try:
        return list(get(manifest, dotted, [INT]))
    except FieldProblem as e:
        raise damaged(stage, str(e)) from None


@dataclass(frozen=True)
class StageOutputs:
    """What every finished stage's manifest holds for the stages after it."""

    path: Path  # the stage directory
    config_hash: str  # what a consumer folds into its own config hash (its input changed -> it reruns)
    fingerprint: dict  # what a consumer's config must agree with (`check_fingerprint`)
    counts: dict  # the stage's accounting (written, dropped.<reason>, ...)
    files: list  # [{"name", "bytes", "sha256"}] of every shard

    def ref(self) -> dict:
        """What a consumer records about this input in its own manifest (`inputs`)."""
        return {"path": str(self.path), "config_hash": self.config_hash, "fingerprint": self.fingerprint}


def stage_outputs(stage: StageDir) -> tuple[StageOutputs, dict]:
    """The common fields of a finished stage's manifest, and the manifest (for the stage-specific readers)."""
    m = stage.manifest()
    try:
        files = get(m, "files", [{"name": STR}])
    except FieldProblem as e:
        raise damaged(stage, str(e)) from None
    return StageOutputs(stage.path, field(stage, m, "config_hash", str), field(stage, m, "fingerprint", dict),
                        field(stage, m, "counts", dict), files), m


@dataclass(frozen=True)
class CuratedData(StageOutputs):
    train_conversations: int | None  # counts.train (None where a hand-made manifest has no count)


def curate_outputs(run_dir: Path) -> CuratedData:
    stage = StageDir(run_dir, "curate")
    common, m = stage_outputs(stage)
    return CuratedData(**vars(common), train_conversations=field(stage, m, "counts.train", int, optional=True))


@dataclass(frozen=True)
class RegeneratedData(StageOutputs):
    units: list[str]  # the regenerated shards' names without `.parquet`, sorted: tokenize's units


def regen_outputs(run_dir: Path) -> RegeneratedData:
    stage = StageDir(run_dir, "regen")
    common, _ = stage_outputs(stage)
    units = sorted(f["name"][: -len(".parquet")] for f in common.files if f["name"].endswith(".parquet"))
    return RegeneratedData(**vars(common), units=units)


@dataclass(frozen=True)
class TokenizedData(StageOutputs):
    samples: int | None  # counts.written
    tokens: int | None  # counts.tokens


def tokenize_outputs(run_dir: Path) -> TokenizedData:
    stage = StageDir(run_dir, "tokenize")
    common, m = stage_outputs(stage)
    return TokenizedData(**vars(common), samples=field(stage, m, "counts.written", int, optional=True),
                         tokens=field(stage, m, "counts.tokens", int, optional=True))


@dataclass(frozen=True)
class ExtractedFeatures(StageOutputs):
    layer_ids: list[int]  # the taps the drafter reads (extract/layers.py convention)
    last_hidden: bool  # the target's last hidden state is stored after them (logit distillation)


def extract_outputs(run_dir: Path) -> ExtractedFeatures:
    stage = StageDir(run_dir, "extract")
    common, m = stage_outputs(stage)
    return ExtractedFeatures(**vars(common), layer_ids=_int_list(stage, m, "fingerprint.layer_ids"),
                             last_hidden=bool(field(stage, m, "fingerprint.last_hidden", bool, optional=True)))


@dataclass(frozen=True)
class TrainedDrafter(StageOutputs):
    drafter: dict  # the drafter architecture it was trained as (dflash_model.model.DrafterArgs as a dict)
    tokenizer: dict | None  # the tokenizer fingerprint it was trained with (None: not recorded)
    layer_ids: list[int] | None  # the taps of the features it was trained on (None: not recorded)


def train_outputs(train_dir: Path) -> TrainedDrafter:
    """The train stage at `train_dir` (runs/<run>/train): its fingerprint is {"drafter": args, "features": the
    feature fingerprint trained on}; the tokenizer is the features' (or a top-level `tokenizer`)."""
    stage = StageDir(Path(train_dir).parent, Path(train_dir).name)
    common, m = stage_outputs(stage)
    tokenizer = field(stage, m, "fingerprint.tokenizer", dict, optional=True) or \
        field(stage, m, "fingerprint.features.tokenizer", dict, optional=True)
    recorded = field(stage, m, "fingerprint.features.layer_ids", list, optional=True) is not None
    return TrainedDrafter(**vars(common), drafter=field(stage, m, "fingerprint.drafter", dict), tokenizer=tokenizer,
                          layer_ids=_int_list(stage, m, "fingerprint.features.layer_ids") if recorded else None)
