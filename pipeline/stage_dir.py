"""One stage's directory and the rules every stage keeps in it: manifests, fingerprints, the lock (one process
per stage), shard-level resume, rank slicing and the code version recorded in a manifest. The files themselves are
written by pipeline/files.py (atomic, journaled).

Layout of one stage:  <runs_dir>/<run>/<stage>/
    manifest.json            written last, atomically: the stage is complete iff it exists
    state.json               config hash + settings of the work in progress (another config's partial work is refused)
    shards/<unit>.<ext>      one output per unit of work, written temp + rename
    shards/<unit>.done.json  sidecar written after the shard: counts, bytes, sha256, failures
                             (a later stage reads a parquet shard through `read_shard`: damage is a DamagedFile
                             naming it and the repair, never pyarrow's traceback)
    work/<unit>.jsonl        `Journal` of a unit in progress (stages that resume inside a unit); removed when done
    ranks/rank-XXXXX.json    per-rank summary when the work was split over ranks

    lock, lock.rank-XXXXX      advisory lock (fcntl.flock) of the process running the stage (or one rank of it)

Invariants:
  * one process per stage (per rank of a split run) at a time: `begin` takes the stage's lock and refuses
    at once, naming the holder, when another live process holds it; the kernel drops the lock of a dead
    process, so a killed run's lock is taken over; `write_manifest` releases it;
  * a unit is done iff its sidecar exists and its shard's size + sha256 match the sidecar
    (kill -9 can leave only `*.tmp-<host>-<pid>` files; the next start removes those whose writer is dead);
  * `manifest.json` holds `config_hash`: re-running a finished stage with the same hash is a no-op,
    a different hash is refused (naming the differing fields) unless `force=True`;
  * `fingerprint` is what a downstream stage must agree with; `check_fingerprint` names the field.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from pipeline.config import ConfigError
from pipeline.errors import DamagedFile, FingerprintMismatch, StageBusy, StageError
from pipeline.files import REDO_UNIT, Journal, atomic_write_json, is_debris, sha256_file
from pipeline.records import INT, OBJECT, STR, Optional, checked, read_record
from pipeline.log import get_logger

log = get_logger("stage_dir")

MANIFEST = "manifest.json"

# The shapes of the files every stage keeps (pipeline/records.py); a stage adds the fields of its own sidecars.
FILE_ENTRY = {"name": STR, "bytes": INT, "sha256": STR}
MANIFEST_FIELDS = {"config_hash": STR, "fingerprint": OBJECT, "counts": OBJECT, "files": [FILE_ENTRY]}
STATE_FIELDS = {"config_hash": STR, "settings": Optional(OBJECT)}
SIDECAR_FIELDS = {"files": [FILE_ENTRY]}
RANK_FIELDS = {"rank": INT, "world_size": INT, "units": [STR]}


# ----------------------------------------------------------------------------------------------
# Stage locks
# ----------------------------------------------------------------------------------------------

_HELD_LOCKS: dict[Path, int] = {}  # lock files this process holds -> their descriptor (taking one again is a no-op)


def _forget_locks_after_fork() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock descriptors: the lock stays with the
    parent alone (flock belongs to the open file, not the descriptor), so a worker orphaned by a kill -9 of its
    parent cannot keep the stage locked."""
    for fd in _HELD_LOCKS.values():
        os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks_after_fork)


def acquire_lock(path: Path, what: str) -> None:
    """Hold an exclusive advisory lock on ``path`` until `release_locks` (or this process ends).

    Refused at once (StageBusy, naming the holder's host and pid) while another process holds it. A holder
    that died (kill -9, node reboot) holds nothing: the kernel (or the NFS server) dropped its lock, and its
    note in the file is replaced. A filesystem without locks gets a warning, not a refusal.
    """
    path = Path(path).absolute()
    if path in _HELD_LOCKS:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise StageBusy(f"{what} is in use by {holder}: wait for that run to finish, or stop it and run this "
                        "command again (finished units are kept); a lock whose process has died is taken over "
                        "by the next run") from None
    except OSError as e:  # ENOLCK/EOPNOTSUPP: a filesystem without advisory locks
        log.warning("%s: no file locking on this filesystem (%s): nothing stops a second process "
                                     "from running %s at the same time", path, e.strerror, what)
    previous = _lock_holder(fd)
    if previous != "an unknown process":
        log.warning("%s: taking over the lock of %s, which ended without releasing it", what, previous)
    note = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": " ".join(sys.argv)[:200]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
    _HELD_LOCKS[path] = fd


def _lock_holder(fd: int) -> str:
    """'pid P on host H (since T: command)' from the note the holder wrote into the lock file."""
    try:
        note = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {note['pid']} on host {note['host']} (since {note['since']}: {note['command']})"
    except (OSError, ValueError, TypeError, KeyError):
        return "an unknown process"


def release_locks(directory: Path) -> None:
    """Release every lock this process holds in ``directory`` (the note is cleared: a clean release)."""
    directory = Path(directory).absolute()
    for path in [p for p in _HELD_LOCKS if p.parent == directory]:
        fd = _HELD_LOCKS.pop(path)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # a read-only remount: the lock goes with the descriptor all the same
        os.close(fd)


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

    def number(name: str, default: int | None = None) -> int:
        text = env.get(name)
        if text is None and default is not None:
            return default
        try:
            return int(str(text).strip())
        except ValueError:
            raise ConfigError(f"environment variable {name}={text!r} is not an integer (the launcher sets it to a "
                              "rank or a number of workers): fix it, or unset it and pass --rank/--world-size") from None

    if rank is not None or world_size is not None:
        r, w, source = (0 if rank is None else rank), (1 if world_size is None else world_size), "flags"
        if w < 1:
            raise ConfigError(f"--world-size {w}: the number of workers must be >= 1")
    elif "WORLD_SIZE" in env and "RANK" in env:
        r, w, source = number("RANK"), number("WORLD_SIZE"), "torchrun"
    elif "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
        lo = number("SLURM_ARRAY_TASK_MIN", 0)
        r, w, source = number("SLURM_ARRAY_TASK_ID") - lo, number("SLURM_ARRAY_TASK_COUNT"), "slurm-array"
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        r, w, source = number("SLURM_PROCID"), number("SLURM_NTASKS"), "slurm"
    else:
        r, w, source = 0, 1, "single"
    if w < 1:
        raise ConfigError(f"world size {w} (from {source}): the number of workers must be >= 1")
    if not 0 <= r < w:
        raise StageError(f"rank {r} is outside world size {w} (from {source}): a rank is 0 .. world size - 1")
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


def describe_changes(old: dict, new: dict, limit: int = 12) -> str:
    """One line per changed dotted key, ``  key: old -> new`` (values cut to 80 characters), at most ``limit``."""
    keys = diff_fields(new, old)
    lines = [f"  {k}: {_short(_get(old, k))} -> {_short(_get(new, k))}" for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f"  ... and {len(keys) - limit} more")
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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

    def finished_with(self, config_hash: str, *, force: bool = False) -> bool:
        """The stage is complete with this config (and not to be redone): running it again is a no-op, which reads
        nothing else (so a stage checks this before it checks or reads its inputs)."""
        return not force and self.is_complete() and self.manifest()["config_hash"] == config_hash

    def manifest(self) -> dict:
        """The finished stage's manifest, checked: an object with the fields every manifest has (config hash,
        fingerprint, counts, files); a damaged one is a DamagedFile naming it and what to run. The fields a later
        stage reads are checked by pipeline/manifests.py."""
        if not self.is_complete():
            raise StageError(
                f"stage '{self.stage}' has no manifest at {self.manifest_path}: run `drafter {self.stage}` first"
            )
        return read_record(self.manifest_path, MANIFEST_FIELDS, repair=self.repair_manifest)

    @property
    def repair_manifest(self) -> str:
        """What to run about a damaged manifest of this stage."""
        return (f"Delete it and run `drafter {self.stage}` again with the same config (the finished units are kept "
                f"and the manifest is written anew), or redo the stage with `drafter {self.stage} --force`")

    @property
    def repair_state(self) -> str:
        """What to run about a damaged state file of this stage's work in progress (state.json, a rank summary)."""
        return (f"Delete it and run `drafter {self.stage}` again with the same config (the finished units are "
                f"kept), or start the stage over with `drafter {self.stage} --force`")

    def read_state(self) -> dict | None:
        """state.json of the work in progress (config hash + settings), None if there is none."""
        state = self.path / "state.json"
        return read_record(state, STATE_FIELDS, repair=self.repair_state) if state.exists() else None

    def read_rank_summaries(self) -> list[dict]:
        """ranks/rank-XXXXX.json of a split run, each checked (rank, world_size, units)."""
        return [read_record(p, RANK_FIELDS, repair=self.repair_state)
                for p in sorted((self.path / "ranks").glob("rank-*.json"))]

    # -- lifecycle ---------------------------------------------------------------------------
    def begin(self, config_hash: str, *, force: bool = False, ranks: RankInfo | None = None,
              settings: dict | None = None) -> bool:
        """Prepare the directory. Returns False if the stage is already complete with this config (no-op).

        A complete stage made with another config is refused unless `force`; `force` wipes the stage, so it is
        refused for a rank of a split run (each rank would wipe the others' work).
        Partial work from the same config is kept (resume); partial work from another config is refused.
        `settings` (from `pipeline.config.config_record`: what `config_hash` hashes, by name) is kept in
        state.json and the manifest, so a refusal lists the changed keys with their old and new values.
        """
        split = ranks is not None and ranks.is_split
        if force and split:
            raise StageError("--force with several ranks would let each rank wipe the others' work: "
                             "run once with --force on a single rank, or delete the stage directory first")
        if self.finished_with(config_hash, force=force):
            return False  # a no-op reads only: it works on a read-only copy and while another process holds the lock
        lock = self.path / (f"lock.rank-{ranks.rank:05d}" if split else "lock")
        acquire_lock(lock, f"stage '{self.stage}' at {self.path}" + (f" (rank {ranks.rank})" if split else ""))
        try:
            return self._prepare(config_hash, force=force, settings=settings)
        except BaseException:
            release_locks(self.path)
            raise

    def _prepare(self, config_hash: str, *, force: bool, settings: dict | None) -> bool:
        """`begin` under the lock: wipe (force), refuse another config, clear a killed writer's debris."""
        if force:
            for child in self.path.iterdir():  # everything but the lock files
                if not child.name.startswith("lock"):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        if self.is_complete():
            m = self.manifest()
            if m["config_hash"] == config_hash:
                release_locks(self.path)  # finished by the process that held the lock before us
                return False
            raise StageError(f"stage '{self.stage}' at {self.path} is complete but was made with another config"
                             f"{self._changes(m, config_hash, settings)}\npass --force to redo it (this deletes its "
                             "outputs), or run under another name")
        state = self.path / "state.json"
        prev = self.read_state()
        if prev is not None:
            if prev["config_hash"] != config_hash:
                raise StageError(f"stage '{self.stage}' at {self.path} holds partial work from another config"
                                 f"{self._changes(prev, config_hash, settings)}\npass --force to start over, or "
                                 "go back to the config it was started with to resume it")
        self.shards.mkdir(parents=True, exist_ok=True)
        for tmp in self.path.rglob("*.tmp-*"):
            if is_debris(tmp):
                tmp.unlink(missing_ok=True)  # debris of a killed writer (never another live rank's file)
        atomic_write_json(state, {"config_hash": config_hash, "settings": settings})
        return True

    @staticmethod
    def _changes(recorded: dict, config_hash: str, settings: dict | None) -> str:
        """': changed keys' lines from the recorded settings, or the two hashes when either side has none."""
        if not isinstance(recorded.get("settings"), dict) or settings is None:
            return f" (config_hash {recorded.get('config_hash')} != {config_hash})"
        changes = describe_changes(recorded["settings"], settings)
        return ", changed:\n" + changes if changes else f" (config_hash {recorded.get('config_hash')} != {config_hash})"

    # -- shards ------------------------------------------------------------------------------
    def shard_path(self, unit: str, ext: str) -> Path:
        return self.shards / f"{unit}.{ext}"

    def sidecar_path(self, unit: str) -> Path:
        return self.shards / f"{unit}.done.json"

    def repair_shard(self, path: Path) -> str:
        """What to run about a damaged shard of this stage (its sidecar and the manifest go with it: the stage then
        resumes and rewrites that unit alone)."""
        unit = Path(path).name.split(".")[0]
        return (f"Delete it, its sidecar {self.sidecar_path(unit)} and {self.manifest_path}, then run "
                f"`drafter {self.stage}` again with the same config: unit {unit} is rewritten, the others are kept")

    def verify_shard(self, path: Path) -> None:
        """`path` is the file its unit's sidecar records (size and sha256), else a DamagedFile naming it and
        `repair_shard`: damage that still decodes (a parquet page has no checksum) is caught too. A shard with no
        sidecar (written by hand, not by a stage) has no record to check: it is read as it is."""
        path = Path(path)
        if not path.exists():
            raise DamagedFile(path, "missing", self.repair_shard(path))
        unit = path.name.split(".")[0]
        side = self.sidecar_path(unit)
        if not side.exists():
            return
        entry = {f["name"]: f for f in self.read_sidecar(unit)["files"]}.get(path.name)
        if entry is None:
            raise DamagedFile(path, f"not listed in its sidecar {side}", self.repair_shard(path))
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise DamagedFile(path, f"its size or sha256 differs from the record in {side}", self.repair_shard(path))

    def read_shard(self, path: Path, *, columns: Sequence[str] | None = None, schema=None, memory_map: bool = False,
                   verify: bool = False):
        """A parquet shard of this stage as a pyarrow Table (`columns` only, when given). A shard pyarrow cannot
        read (truncated, a damaged footer or page, missing), or whose columns are not those of `schema` (the
        stage's pyarrow schema: names, types, nullability), is a DamagedFile naming it and `repair_shard`; with `verify`,
        so is one that differs from its sidecar's record (`verify_shard`). Never modifies the stage."""
        import pyarrow.parquet as pq

        path = Path(path)
        if verify:
            self.verify_shard(path)
        elif not path.exists():
            raise DamagedFile(path, "missing", self.repair_shard(path))
        with self.reading_shard(path):
            if schema is not None:
                self.check_columns(path, pq.read_schema(path), schema, columns)
            return pq.read_table(path, columns=list(columns) if columns is not None else None, memory_map=memory_map)

    def check_columns(self, path: Path, found, schema, columns: Sequence[str] | None = None) -> None:
        """The `columns` (all of `schema`'s when None) of the shard's schema `found` have `schema`'s names, types and
        nullability, else a DamagedFile naming the first that differs."""
        for name in columns if columns is not None else schema.names:
            want = schema.field(name).type
            if name not in found.names:
                raise DamagedFile(path, f"column {name!r} is missing", self.repair_shard(path))
            got = found.field(name)
            if got.type != want or got.nullable != schema.field(name).nullable:
                raise DamagedFile(path, f"column {name!r} is {got.type}{'' if got.nullable else ' not null'}, not "
                                        f"{want}{'' if schema.field(name).nullable else ' not null'}",
                                  self.repair_shard(path))

    @contextmanager
    def reading_shard(self, path: Path):
        """Inside it, pyarrow failing on `path` (truncated, a damaged footer or page) is a DamagedFile naming the
        shard and `repair_shard`. For readers that open a shard themselves (row groups, metadata); keep the block to
        the reads of that one file."""
        import pyarrow as pa

        try:
            yield
        except (pa.ArrowException, OSError, ValueError) as e:  # ArrowInvalid, a thrift error, a short read, ...
            if isinstance(e, OSError) and e.errno is not None:
                raise  # the system's refusal (permissions, I/O): the CLI names it, the file may be intact
            detail = " ".join(str(e).split())[:200]  # pyarrow's messages span lines (schemas): one line
            raise DamagedFile(path, f"not readable parquet ({type(e).__name__}: {detail})",
                              self.repair_shard(path)) from None

    def journal(self, unit: str, fields: dict | None = None) -> Journal:
        """The progress journal of a unit in progress (items finished so far, read back after a kill); each item
        checked against `fields` (a damaged journal is a DamagedFile naming it and the line: delete it, the unit is
        redone)."""
        journal = Journal(self.path / "work" / f"{unit}.jsonl")
        for number, item in enumerate(journal.items, 1):
            checked(item, fields or {}, path=f"{journal.path} (entry {number})", repair=REDO_UNIT)
        return journal

    def read_sidecar(self, unit: str, fields: dict | None = None) -> dict:
        """A unit's sidecar, checked: the files of every sidecar plus the stage's own `fields` (a damaged one is a
        DamagedFile naming it: delete it and the unit is redone)."""
        return read_record(self.sidecar_path(unit), {**SIDECAR_FIELDS, **(fields or {})},
                           repair=f"Delete it and run `drafter {self.stage}` again: unit {unit} is redone (the other "
                                  "units are kept)")

    def unit_done(self, unit: str, verify: bool = False, fields: dict | None = None) -> dict | None:
        """The sidecar of a finished unit, or None. With `verify`, a shard whose sha256 differs is redone.
        fields: the stage's own sidecar fields, checked (`read_sidecar`)."""
        side = self.sidecar_path(unit)
        if not side.exists():
            return None
        info = self.read_sidecar(unit, fields)
        for f in info["files"]:
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

    def done_units(self, fields: dict | None = None) -> dict[str, dict]:
        """unit -> sidecar of every finished unit, each checked (`read_sidecar`)."""
        return {p.name[: -len(".done.json")]: self.read_sidecar(p.name[: -len(".done.json")], fields)
                for p in sorted(self.shards.glob("*.done.json"))}

    def rank_summary(self, ranks: RankInfo, units: Sequence[str], started: float, **extra: Any) -> dict:
        """A rank of a split run: record the units it owned in ranks/rank-XXXXX.json (extract --verify names a
        sample's rank from it) and return the rank's result while the stage is not complete,
        {"stage", "complete": False, "rank", "world_size", "units", "seconds", **extra}."""
        record = {"rank": ranks.rank, "world_size": ranks.world_size, "units": list(units),
                  "seconds": round(time.time() - started, 3), **extra}
        atomic_write_json(self.path / "ranks" / f"rank-{ranks.rank:05d}.json", record)
        return {"stage": self.stage, "complete": False, **record}

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
        files = [f for u in units.values() for f in u["files"]]
        state = self.read_state()
        manifest = {
            "stage": self.stage,
            "config_hash": config_hash,
            "settings": state["settings"] if state else None,
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
        release_locks(self.path)
        return manifest


def merge_ranks(stage: StageDir, units: Sequence[str], finish: Callable[[], dict]) -> dict:
    """`drafter <stage> --merge`, after a split run (a SLURM array, say): refuse while a unit of any rank is not done,
    naming them; else `finish()`, the stage run on a single rank, which finds every unit done and writes the
    manifest (a no-op returning it when the last rank already did). `units`: every unit name of the run."""
    if not stage.is_complete():
        missing = [u for u in units if stage.unit_done(u) is None]
        if missing:
            raise StageError(f"{stage.stage} --merge: {len(missing)} of {len(units)} units are not done "
                             f"(e.g. {missing[:3]}); re-run the missing ranks first")
    return finish()
