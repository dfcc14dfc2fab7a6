"""Named prompt sets -> local files: the one place a curate source or an eval benchmark finds its dataset.

An entry (`pipeline.config.DatasetConfig`) is either the user's own `path` (read as it is) or a public set named by
its public identity: `hub` (a hub dataset id + subset/split/revision), `url` (one file) or `origin` (a set built
from a public source that the pipeline cannot fetch itself). A public set is looked for in this order:

    1. mirror   <data_dir>/<file>: `data_dir` in the config, else $DRAFTER_DATA_DIR; `file` defaults to the entry's
                name with .parquet, .jsonl or .json (a directory of such files also counts). A mirror copy wins.
    2. cache    <cache_dir>/datasets: `datasets`' own cache of a hub dataset (read as `load_dataset` reads it offline;
                with a `revision`, only a copy cached at that revision), or the earlier download of a url
    3. source   hub: `datasets.load_dataset(...)` into the cache; url: downloaded into the cache (atomic rename);
                with HF_HUB_OFFLINE set, neither: a set not in the mirror or the cache is missing

What was found is a `Located`: where it came from, its files ((kind, path) with kind jsonl | json | parquet, or one
("hub", id) whose rows `load_hub` returns) and a checksum (the sha256 of every file; a hub dataset's `datasets`
fingerprint, its cached revision and its row count). A given `sha256` must match the file read, mirror copy or
download. A set found nowhere is `DatasetMissing`: one line naming the mirror path, the cache, the public identity
and how to get it.

`choose` applies the `use` rule of a list of entries (curate.sources, eval.benchmarks): 'required' entries must be
found; 'if_present' entries that are missing are left out and reported; 'fallback' entries are used only when no
other entry of the list is in use. After the first failure to reach the hub, later hub entries are looked up in
the cache only (no second network timeout), for the rest of the process.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from pipeline.config import DATA_DIR_ENV, ConfigError, DatasetConfig
from pipeline.errors import StageError

SUFFIXES = (".parquet", ".jsonl", ".json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HUB_LIKE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as a path that does not exist
URL_TIMEOUT_S = 60
GET_IT = "docs/data.md"  # where the README of the data sources lives (how to fill a mirror)

_hub_unreachable: str | None = None  # the first hub connection failure of this process, once there was one


class DatasetMissing(StageError):
    """A dataset was found neither in the mirror nor in the cache nor at its source (one line: where it looked)."""


@dataclass(frozen=True)
class Located:
    """A dataset found: where (`path` | `mirror` | `download` | `hub` | generated kinds), its files and checksum."""

    name: str
    where: str
    files: tuple[tuple[str, str], ...]  # (kind, path): jsonl | json | parquet files in order, or (("hub", id),)
    identity: str                       # the public identity (or the local path) as one string
    checksum: dict = field(default_factory=dict)
    cache: str = ""                     # hub: the `datasets` cache directory it was loaded from (`load_hub`)

    def record(self) -> dict:
        """What manifests and reports keep: where, identity, files, checksum (JSON values)."""
        return {"where": self.where, "identity": self.identity, "files": [p for _, p in self.files],
                "checksum": self.checksum}


def mirror_dir(data_dir: str | None) -> Path | None:
    """The mirror directory: `data_dir`, else $DRAFTER_DATA_DIR (empty = unset), else None."""
    value = data_dir or os.environ.get(DATA_DIR_ENV) or None
    return Path(value).expanduser() if value else None


def identity(entry: DatasetConfig) -> str:
    """The entry's public identity as one string (the local path for a `path` entry)."""
    if entry.hub:
        extra = [f"{k}={getattr(entry, k)}" for k in ("subset", "split", "revision", "data_files") if getattr(entry, k)]
        return f"hub:{entry.hub} ({', '.join(extra)})"
    if entry.url:
        return f"url:{entry.url}"
    if entry.origin:
        return f"origin:{entry.origin}"
    return entry.path


def file_kind(path: Path) -> str:
    """jsonl | json | parquet; a .json file that is not a JSON array holds JSON lines (common on the hub)."""
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix == ".json":
        with open(path, "rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return "json"
    return "jsonl"


def local_files(path: Path, key: str) -> list[tuple[str, str]]:
    """[(kind, path)] of a .jsonl/.json/.parquet file, or of every such file under a directory in sorted order."""
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ConfigError(f"{key}: directory {str(path)!r} holds no .jsonl/.json/.parquet files")
    elif path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"{key}: {str(path)!r} is not a .jsonl/.json/.parquet file")
        files = [path]
    else:
        raise ConfigError(f"{key}: {str(path)!r} does not exist")
    return [(file_kind(f), str(f)) for f in files]


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _checked(files: list[tuple[str, str]], entry: DatasetConfig, key: str) -> dict:
    """{"sha256": {path: digest}} of the files; a configured `sha256` must be the digest of the one file read."""
    digests = {p: sha256_of(p) for _, p in files}
    if entry.sha256:
        if len(files) != 1:
            raise ConfigError(f"{key}.sha256: set for a dataset of {len(files)} files; it checks exactly one")
        (path, got), = digests.items()
        if got != entry.sha256:
            raise StageError(f"{key}: {path} has sha256 {got}, not the configured {entry.sha256}: replace the file "
                             f"(or fix {key}.sha256)")
    return {"sha256": digests}


# ----------------------------------------------------------------------------------------------
# Finding one dataset: mirror -> cache -> source
# ----------------------------------------------------------------------------------------------


def mirror_candidates(entry: DatasetConfig, name: str, mirror: Path) -> list[Path]:
    """The paths in the mirror that would hold the entry: its `file`, else its name with each suffix (or as a dir)."""
    if entry.file:
        return [mirror / entry.file]
    return [mirror / f"{name}{s}" for s in SUFFIXES] + [mirror / name]


def locate_local(entry: DatasetConfig, name: str, key: str, *, data_dir: str | None) -> Located | None:
    """The entry's own `path`, or its mirror copy; None when neither exists (nothing is fetched)."""
    if entry.path:
        path = Path(entry.path).expanduser()
        if not path.exists() and _HUB_LIKE.fullmatch(entry.path):
            raise ConfigError(f"{key}.path: {entry.path!r} does not exist; a hub dataset is named with "
                              f"{key}.hub (path is your own file or directory)")
        files = local_files(path, f"{key}.path")
        return Located(name, "path", tuple(files), entry.path)
    mirror = mirror_dir(data_dir)
    for candidate in mirror_candidates(entry, name, mirror) if mirror is not None else []:
        if candidate.exists():
            files = local_files(candidate, f"{key}: mirror copy")
            return Located(name, "mirror", tuple(files), identity(entry), _checked(files, entry, key))
    return None


def locate(entry: DatasetConfig, name: str, key: str, *, data_dir: str | None, cache_dir: str | Path) -> Located:
    """Find one entry's dataset (module docstring); raises DatasetMissing (one line) or ConfigError."""
    found = locate_local(entry, name, key, data_dir=data_dir)
    if found is not None:
        return found
    mirror = mirror_dir(data_dir)
    if mirror is not None:
        shown = entry.file or f"{name}{{{','.join(SUFFIXES)}}}"
        looked = [f"not in the mirror {mirror} (as {shown})"]
    else:
        looked = [f"no mirror (data_dir and ${DATA_DIR_ENV} unset)"]
    cache = Path(cache_dir) / "datasets"
    if entry.hub:
        try:
            ds = load_hub(entry.hub, entry.subset, entry.split, entry.revision, entry.data_files, str(cache))
        except DatasetMissing as e:
            looked.append(str(e))
        else:
            return Located(name, "hub", (("hub", entry.hub),), identity(entry), hub_checksum(ds), str(cache))
    elif entry.url:
        try:
            path = download(entry.url, cache)
        except DatasetMissing as e:
            looked.append(str(e))
        else:
            files = [(file_kind(path), str(path))]
            return Located(name, "download", tuple(files), identity(entry), _checked(files, entry, key))
    else:
        looked.append(f"{identity(entry)} is not fetched by the pipeline: only a mirror holds it")
    wanted = entry.file or f"{name}.parquet/.jsonl/.json"
    raise DatasetMissing(
        f"{key} {name!r}: dataset not found: {'; '.join(looked)}. Get it: put {wanted} in a mirror directory and set "
        f"{DATA_DIR_ENV} (or data_dir){', or run once with hub access' if entry.hub else ''}"
        f"{', or allow the download' if entry.url else ''} ({GET_IT})")


def hub_checksum(ds) -> dict:
    """A hub dataset's identity as cached: `datasets`' fingerprint, the cached revision directory, the row count."""
    files = [f["filename"] for f in (ds.cache_files or [])]
    revision = Path(files[0]).parent.name if files else None
    return {"fingerprint": ds._fingerprint, "revision": revision, "rows": len(ds)}


@lru_cache(maxsize=8)
def load_hub(hub: str, subset: str | None, split: str, revision: str | None, data_files: str | None,
             cache: str):
    """The hub dataset (a memory-mapped `datasets.Dataset`, random access by row): `datasets`' cache under `cache`
    first (what `load_dataset` reads offline: the newest cached copy of that config; with a `revision`, only a copy
    cached at that revision), else from the hub, downloaded into the cache. After one failure to reach the hub, the
    cache only. Raises DatasetMissing."""
    global _hub_unreachable
    import datasets

    kwargs: dict[str, Any] = {"data_files": data_files} if data_files else {}
    where = f"hub:{hub} (subset={subset}, split={split})"
    try:
        from datasets.packaged_modules.cache.cache import Cache

        ds = Cache(cache_dir=cache, dataset_name=hub.split("/")[-1], repo_id=hub, config_name=subset, version="auto",
                   hash="auto", **kwargs).as_dataset(split=split)
        cached_at = hub_checksum(ds)["revision"]
        if revision is None or cached_at == revision:
            return ds
        not_cached = f"cached at revision {cached_at}, not {revision}"
    except Exception as e:  # noqa: BLE001 - not cached (ValueError), cached without that split, ...
        not_cached = f"{type(e).__name__}: {_first_line(e)}"
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    local_builder = hub in _PACKAGED_DATASETS_MODULES  # `json` + data_files: datasets' own builder, no hub involved
    if _hub_unreachable is not None and not local_builder:
        raise DatasetMissing(f"{where} not in the cache {cache} ({not_cached}) and the hub is unreachable "
                             f"({_hub_unreachable})")
    try:
        ds = datasets.load_dataset(hub, subset, split=split, revision=revision, cache_dir=cache, **kwargs)
    except ConnectionError as e:  # offline or unreachable
        reason = _first_line(e)
        if not local_builder:
            _hub_unreachable = reason
        raise DatasetMissing(f"{where} not in the cache {cache} and the hub is unreachable ({reason})") from e
    except Exception as e:  # noqa: BLE001 - no such dataset / split / config: one line, not a traceback
        raise DatasetMissing(f"{where}: {type(e).__name__}: {_first_line(e)}") from e
    got = hub_checksum(ds)["revision"]
    if revision and _COMMIT.fullmatch(revision) and got != revision:  # offline, load_dataset takes any cached copy
        raise DatasetMissing(f"{where} not in the cache {cache} (cached at revision {got}, not {revision}) and not "
                             "downloaded")
    return ds


def download(url: str, cache: Path) -> Path:
    """The file at `url` in the cache (`<cache>/downloads/<sha of url>/<name>`), downloaded first if absent; written
    to a temporary name and renamed, so a killed download leaves nothing behind. Raises DatasetMissing."""
    name = Path(urllib.parse.urlparse(url).path).name or "download"
    out = cache / "downloads" / hashlib.sha256(url.encode()).hexdigest()[:16] / name
    if out.is_file():
        return out
    if offline():
        raise DatasetMissing(f"url:{url} not in the cache {out.parent} and downloads are off (HF_HUB_OFFLINE)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as r:
            shutil.copyfileobj(r, f)
        os.replace(tmp, out)
    except OSError as e:  # URLError, HTTPError, timeouts, a full disk
        Path(tmp).unlink(missing_ok=True)
        raise DatasetMissing(f"url:{url} not in the cache {out.parent} and not downloadable "
                             f"({type(e).__name__}: {_first_line(e)})") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def offline() -> bool:
    """HF_HUB_OFFLINE set (as `datasets` reads it): no hub requests, and no url downloads either."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# A list of entries: the `use` rule
# ----------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One entry of a list after `choose`: used (with what was found), absent (why) or an unneeded fallback."""

    index: int
    name: str
    status: str              # used | absent | fallback_unused
    located: Located | None = None
    reason: str = ""         # absent: the DatasetMissing line; fallback_unused: which entries made it unneeded

    def record(self) -> dict:
        out: dict[str, Any] = {"status": self.status}
        if self.located is not None:
            out.update(self.located.record())
        if self.reason:
            out["reason"] = self.reason
        return out


def choose(entries: Sequence[Any], key: str, find: Callable[[int, Any], Located]) -> list[Choice]:
    """The `use` rule over a list (module docstring). `find(i, entry)` locates entry i or raises DatasetMissing.
    Raises DatasetMissing for a required entry, or when no entry at all is in use."""
    choices: list[Choice] = []
    for i, e in enumerate(entries):
        if e.use == "fallback":
            continue
        try:
            choices.append(Choice(i, e.name, "used", find(i, e)))
        except DatasetMissing as err:
            if e.use == "required":
                raise
            choices.append(Choice(i, e.name, "absent", reason=str(err)))
    used = [c.name for c in choices if c.status == "used"]
    for i, e in enumerate(entries):
        if e.use != "fallback":
            continue
        if used:
            choices.append(Choice(i, e.name, "fallback_unused", reason=f"not needed: {', '.join(used)} in use"))
        else:
            choices.append(Choice(i, e.name, "used", find(i, e)))
    choices.sort(key=lambda c: c.index)
    if not any(c.status == "used" for c in choices):
        absent = [c.reason for c in choices if c.status == "absent"]
        raise DatasetMissing(f"{key}: none of the {len(entries)} entries is available and none is a fallback; first: "
                             f"{absent[0] if absent else 'no entries'}")
    return choices
