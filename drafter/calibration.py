"""Measured stage rates for `drafter plan`: the calibration table (drafter/calibration.yaml: tokens/s of one stage
on one GPU at one target shape, with the GPU, the date, the command and where the run is recorded) and its lookup.

    row = measured("extract", shape, backend="vllm", features="bfloat16")   # a Measurement, or None
    row.tok_s, row.describe(run_conditions)                                  # the rate and the line `plan` prints
    scaling("train")                                                         # a Scaling (multi-GPU), or None

A row applies when its stage and target shape match the run's (shape = layers, hidden size, intermediate size and
vocabulary: a random-init target of a production shape runs at that shape's speed). Among the rows that apply, the
one matching most of the run's conditions wins (ties: the file's order); its description says which conditions
differ from the run's, so a rate measured under other conditions is never passed off as the run's own. The table's
`scaling` rows are measured multi-GPU efficiencies of a stage (one per stage). Nothing here knows how `plan` turns
rates into hours.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

TABLE = Path(__file__).with_name("calibration.yaml")
SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class Measurement:
    """One row of the table: `tok_s` of `stage` at target shape `shape` on one `gpu`."""

    stage: str
    shape: str
    tok_s: float
    gpu: str
    date: str
    command: str
    source: str
    conditions: dict = field(default_factory=dict)

    def describe(self, run: dict | None = None) -> str:
        """'measured: ...' with the rate, GPU, date, conditions and command; the conditions where `run` (the run's
        own, same keys) differs are named."""
        conds = ", ".join(f"{k} {v}" for k, v in self.conditions.items())
        text = f"measured: {self.tok_s:,.0f} tok/s on 1x {self.gpu}, {self.date} ({conds}; `{self.command}`)"
        differ = [f"{k} {v}" for k, v in (run or {}).items() if k in self.conditions and self.conditions[k] != v]
        if differ:
            text += f"; this run: {', '.join(differ)}"
        return text


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(TABLE)) -> tuple[dict[str, tuple], tuple[Measurement, ...]]:
    """(shape name -> SHAPE_FIELDS values, the measurements in file order); every row checked."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    shapes = {name: tuple(int(spec[f]) for f in SHAPE_FIELDS) for name, spec in data["shapes"].items()}
    rows = []
    for i, r in enumerate(data["measurements"]):
        missing = [k for k in ("stage", "shape", "tok_s", "gpu", "date", "command", "source") if k not in r]
        if missing or r["shape"] not in shapes or float(r["tok_s"]) <= 0:
            raise ValueError(f"{path}: measurement {i} is malformed (missing {missing}, shape {r.get('shape')!r}, "
                             f"tok_s {r.get('tok_s')!r})")
        rows.append(Measurement(r["stage"], r["shape"], float(r["tok_s"]), r["gpu"], str(r["date"]), r["command"],
                                r["source"], dict(r.get("conditions") or {})))
    return shapes, tuple(rows)


def shape_name(shape, path: str = str(TABLE)) -> str | None:
    """The table's name of a target shape (any object with SHAPE_FIELDS attributes), or None."""
    shapes, _ = load_table(path)
    key = tuple(int(getattr(shape, f)) for f in SHAPE_FIELDS)
    return next((name for name, spec in shapes.items() if spec == key), None)


def measured(stage: str, shape, path: str = str(TABLE), **conditions) -> Measurement | None:
    """The row for `stage` at `shape` that matches most of `conditions` (the run's backend, features, mode, ...), or
    None when no row has this stage and shape."""
    name = shape_name(shape, path)
    rows = [r for r in load_table(path)[1] if r.stage == stage and r.shape == name]
    if not rows:
        return None
    return max(rows, key=lambda r: (sum(r.conditions.get(k) == v for k, v in conditions.items()), -rows.index(r)))


@dataclass(frozen=True)
class Scaling:
    """A measured multi-GPU efficiency of `stage` on one host: tokens/s at `gpus` / (gpus x tokens/s at one GPU)."""

    stage: str
    gpus: int
    efficiency: float
    gpu: str
    date: str
    command: str
    source: str
    conditions: dict = field(default_factory=dict)

    def describe(self) -> str:
        conds = ", ".join(f"{k} {v}" for k, v in self.conditions.items())
        return f"measured {self.efficiency:.1%} on {self.gpus}x {self.gpu} (one host), {self.date} ({conds}; `{self.command}`)"


@functools.lru_cache(maxsize=None)
def load_scaling(path: str = str(TABLE)) -> dict[str, Scaling]:
    """stage -> its Scaling row; every row checked (one per stage, 0 < efficiency <= 1.05, gpus >= 2)."""
    import yaml

    out = {}
    for i, r in enumerate(yaml.safe_load(Path(path).read_text()).get("scaling") or []):
        missing = [k for k in ("stage", "gpus", "efficiency", "gpu", "date", "command", "source") if k not in r]
        if missing or r["stage"] in out or not 0 < float(r["efficiency"]) <= 1.05 or int(r["gpus"]) < 2:
            raise ValueError(f"{path}: scaling {i} is malformed (missing {missing}, stage {r.get('stage')!r}, "
                             f"gpus {r.get('gpus')!r}, efficiency {r.get('efficiency')!r})")
        out[r["stage"]] = Scaling(r["stage"], int(r["gpus"]), float(r["efficiency"]), r["gpu"], str(r["date"]),
                                  r["command"], r["source"], dict(r.get("conditions") or {}))
    return out


def scaling(stage: str, path: str = str(TABLE)) -> Scaling | None:
    """The measured multi-GPU scaling of `stage`, or None."""
    return load_scaling(path).get(stage)
