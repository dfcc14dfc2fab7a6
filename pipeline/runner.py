"""The stage-runner contract every stage uses: run directory, manifests, fingerprints, atomic writes,
shard-level resume and rank slicing.

Layout of one stage:  <runs_dir>/<run>/<stage>/
    manifest.json            written last, atomically: the stage is complete iff it exists
    shards/<unit>.<ext>      one output per unit of work, written temp + rename
    shards/<unit>.done.json  sidecar written after the shard: counts, bytes, sha256, failures
    ranks/rank-XXXXX.json    per-rank summary when the work was split over ranks

Invariants:
  * a unit is done iff its sidecar exists and its shard's size + sha256 match the sidecar
    (kill -9 can leave only `*.tmp-<host>-<pid>` files; the next start removes those whose writer is dead);
  * `manifest.json` holds `config_hash`: re-running a finished stage with the same hash is a no-op,
    a different hash is refused (naming the differing fields) unless `force=True`;
  * `fingerprint` is what a downstream stage must agree with; `check_fingerprint` names the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

MANIFEST = "manifest.json"


class StageError(RuntimeError):
    """A stage cannot run: missing/mismatched inputs, a finished stage with another config, ..."""


class FingerprintMismatch(StageError):
    """A stage's input was produced under settings that differ from this stage's config."""


# ----------------------------------------------------------------------------------------------
# Atomic writes and checksums
# ----------------------------------------------------------------------------------------------


_HOST = socket.gethostname().split(".")[0].replace("-", "_")


def _tmp_path(path: Path) -> Path:
    """`<name>.tmp-<host>-<pid>`: the writer is identifiable, so cleanup never removes a live writer's file."""
    return path.with_name(f"{path.name}.tmp-{_HOST}-{os.getpid()}")


def _is_debris(tmp: Path) -> bool:
    """A temp file whose writer is gone: written on this host by a pid that no longer runs.

    Temp files of other hosts (a multi-node job on a shared filesystem) or of live processes (another rank
    still writing) are left alone."""
    host, _, pid = tmp.name.rsplit(".tmp-", 1)[-1].rpartition("-")
    if host != _HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return int(pid) == os.getpid()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class AtomicFile:
    """Context manager yielding a temp path; on clean exit fsyncs and renames it onto `path`.

    >>> with AtomicFile(out) as tmp: writer.write(tmp)
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = _tmp_path(self.path)

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.tmp, self.path)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------
# Ranks (torchrun / SLURM / explicit flags)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    source: str = field(default="single", compare=False)  # "flags" | "torchrun" | "slurm-array" | "slurm" | "single"

    @property
    def is_split(self) -> bool:
        return self.world_size > 1


def rank_from_env(rank: int | None = None, world_size: int | None = None, environ: Mapping[str, str] | None = None
                  ) -> RankInfo:
    """Who am I among the workers of a split job?

    Order: explicit `--rank/--world-size`; torchrun (`RANK`/`WORLD_SIZE`); a SLURM array
    (`SLURM_ARRAY_TASK_ID` - `SLURM_ARRAY_TASK_MIN` over `SLURM_ARRAY_TASK_COUNT`); SLURM tasks
    (`SLURM_PROCID`/`SLURM_NTASKS`); else a single worker. `environ` defaults to `os.environ`; the answer
    names which of these it came from (`source`).
    """
    env = os.environ if environ is None else environ
    if rank is not None or world_size is not None:
        r, w, source = rank or 0, world_size or 1, "flags"
    elif "WORLD_SIZE" in env and "RANK" in env:
        r, w, source = int(env["RANK"]), int(env["WORLD_SIZE"]), "torchrun"
    elif "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
        lo = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        r, w, source = int(env["SLURM_ARRAY_TASK_ID"]) - lo, int(env["SLURM_ARRAY_TASK_COUNT"]), "slurm-array"
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        r, w, source = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "slurm"
    else:
        r, w, source = 0, 1, "single"
    if not 0 <= r < w:
        raise StageError(f"rank {r} is outside world size {w}")
    return RankInfo(r, w, source)


def units_for_rank(units: Sequence[Any], ranks: RankInfo) -> list[Any]:
    """The disjoint slice of `units` this rank owns (round-robin: balanced when units are sorted by cost)."""
    return list(units[ranks.rank :: ranks.world_size])


# ----------------------------------------------------------------------------------------------
# Code version and fingerprints
# ----------------------------------------------------------------------------------------------


def code_version() -> str:
    """Package version plus git commit (and '-dirty') when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("dflash-pipeline")
    except PackageNotFoundError:
        v = "0+unknown"
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        if sha:
            v += f"+g{sha}" + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def diff_fields(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two (nested) dicts."""
    out = []
    for key in sorted(set(expected) | set(actual)):
        a, b = expected.get(key, "<missing>"), actual.get(key, "<missing>")
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_fields(a, b, path + ".")
        elif a != b:
            out.append(path)
    return out


def check_fingerprint(expected: dict, actual: dict, *, what: str, producer: str) -> None:
    """Refuse an input whose fingerprint differs from what this stage's config implies.

    `expected` comes from this stage's config, `actual` from the input manifest written by `producer`.
    Only keys present in `expected` are compared.
    """
    actual_sub = {k: actual.get(k, "<missing>") for k in expected}
    bad = diff_fields(expected, actual_sub)
    if bad:
        lines = [f"  {k}: this config wants {_get(expected, k)!r}, {producer} has {_get(actual_sub, k)!r}" for k in bad]
        raise FingerprintMismatch(
            f"{what} does not match this config (fields differ):\n" + "\n".join(lines)
            + f"\nRe-run '{producer}' with this config, or fix the config."
        )


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return "<missing>"
        d = d.get(part, "<missing>")
    return d


# ----------------------------------------------------------------------------------------------
# The stage directory
# ----------------------------------------------------------------------------------------------


class StageDir:
    """One stage's directory with its manifest, shards and resume bookkeeping."""

    def __init__(self, run_dir: Path, stage: str):
        self.stage = stage
        self.path = Path(run_dir) / stage
        self.shards = self.path / "shards"

    # -- reading -----------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def is_complete(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict:
        if not self.is_complete():
            raise StageError(
                f"stage '{self.stage}' has no manifest at {self.manifest_path}: run `drafter {self.stage}` first"
            )
        return read_json(self.manifest_path)

    # -- lifecycle ---------------------------------------------------------------------------
    def begin(self, config_hash: str, *, force: bool = False, ranks: RankInfo | None = None) -> bool:
        """Prepare the directory. Returns False if the stage is already complete with this config (no-op).

        A complete stage made with another config is refused unless `force`; `force` wipes the stage, so it is
        refused for a rank of a split run (each rank would wipe the others' work).
        Partial work from the same config is kept (resume); partial work from another config is refused.
        """
        if force and ranks is not None and ranks.is_split:
            raise StageError("--force with several ranks would let each rank wipe the others' work: "
                             "run once with --force on a single rank, or delete the stage directory first")
        if force and self.path.exists():
            shutil.rmtree(self.path)
        if self.is_complete():
            m = self.manifest()
            if m.get("config_hash") == config_hash:
                return False
            raise StageError(
                f"stage '{self.stage}' at {self.path} is complete but was made with another config "
                f"(config_hash {m.get('config_hash')} != {config_hash}); pass --force to redo it"
            )
        state = self.path / "state.json"
        if state.exists():
            prev = read_json(state).get("config_hash")
            if prev != config_hash:
                raise StageError(
                    f"stage '{self.stage}' at {self.path} holds partial work from another config "
                    f"(config_hash {prev} != {config_hash}); pass --force to start over"
                )
        self.shards.mkdir(parents=True, exist_ok=True)
        for tmp in self.path.rglob("*.tmp-*"):
            if _is_debris(tmp):
                tmp.unlink(missing_ok=True)  # debris of a killed writer (never another live rank's file)
        atomic_write_json(state, {"config_hash": config_hash})
        return True

    # -- shards ------------------------------------------------------------------------------
    def shard_path(self, unit: str, ext: str) -> Path:
        return self.shards / f"{unit}.{ext}"

    def sidecar_path(self, unit: str) -> Path:
        return self.shards / f"{unit}.done.json"

    def unit_done(self, unit: str, verify: bool = False) -> dict | None:
        """The sidecar of a finished unit, or None. With `verify`, a shard whose sha256 differs is redone."""
        side = self.sidecar_path(unit)
        if not side.exists():
            return None
        info = read_json(side)
        for f in info.get("files", []):
            p = self.shards / f["name"]
            if not p.exists() or p.stat().st_size != f["bytes"]:
                side.unlink(missing_ok=True)
                return None
            if verify and sha256_file(p) != f["sha256"]:
                side.unlink(missing_ok=True)
                return None
        return info

    def finish_unit(self, unit: str, files: Iterable[Path], *, sha256: dict[str, str] | None = None, **info: Any) -> dict:
        """Record a unit as done: its files (already renamed into place) plus counts and notes.

        `sha256` maps file names to digests computed while the bytes went to disk (no read-back);
        files not in it are hashed here.
        """
        known = sha256 or {}
        entries = [{"name": Path(f).name, "bytes": Path(f).stat().st_size,
                    "sha256": known.get(Path(f).name) or sha256_file(f)} for f in files]
        record = {"unit": unit, "files": entries, **info}
        atomic_write_json(self.sidecar_path(unit), record)
        return record

    def done_units(self) -> dict[str, dict]:
        return {p.name[: -len(".done.json")]: read_json(p) for p in sorted(self.shards.glob("*.done.json"))}

    # -- completion --------------------------------------------------------------------------
    def write_manifest(
        self,
        *,
        config_hash: str,
        fingerprint: dict,
        inputs: dict[str, dict] | None = None,
        counts: dict[str, int] | None = None,
        started: float,
        extra: dict | None = None,
    ) -> dict:
        """Write the manifest last: it marks the stage complete. Files/bytes/checksums come from sidecars."""
        units = self.done_units()
        files = [f for u in units.values() for f in u.get("files", [])]
        manifest = {
            "stage": self.stage,
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "inputs": inputs or {},
            "counts": counts or {},
            "num_units": len(units),
            "files": files,
            "total_bytes": sum(f["bytes"] for f in files),
            "code_version": code_version(),
            "python": sys.version.split()[0],
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_seconds": round(time.time() - started, 3),
            **(extra or {}),
        }
        atomic_write_json(self.manifest_path, manifest)
        return manifest


def input_ref(stage: StageDir) -> dict:
    """What a consumer records about an input stage in its own manifest."""
    m = stage.manifest()
    return {"path": str(stage.path), "config_hash": m["config_hash"], "fingerprint": m["fingerprint"]}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
