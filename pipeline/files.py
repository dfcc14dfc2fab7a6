"""Files a stage writes so that a kill -9 never leaves a part: atomic writes (temp + fsync + rename), `AtomicFile`
for writers that need a path, the append-only `Journal` (progress inside a unit), checksums, and `read_json`, which
names a damaged file instead of raising a bare JSONDecodeError.

Invariants:
  * a reader sees the old file or the whole new one, never a part: every write goes to `<name>.tmp-<host>-<pid>`,
    is fsync'd, then renamed; a killed writer leaves only such temp files, which `is_debris` recognises (written on
    this host by a pid that no longer runs) so cleanup never removes a live writer's file;
  * every item `Journal.append` returned from is read back after a kill; a torn last line is cut off;
  * a failed write names its path (`with_path`), also where the OS error does not (ENOSPC, EIO).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from pipeline.errors import DamagedFile

HOST = socket.gethostname().split(".")[0].replace("-", "_")


def tmp_path(path: Path) -> Path:
    """`<name>.tmp-<host>-<pid>`: the writer is identifiable, so cleanup never removes a live writer's file."""
    return path.with_name(f"{path.name}.tmp-{HOST}-{os.getpid()}")


def is_debris(tmp: Path) -> bool:
    """A temp file whose writer is gone: written on this host by a pid that no longer runs.

    Temp files of other hosts (a multi-node job on a shared filesystem) or of live processes (another rank
    still writing) are left alone."""
    host, _, pid = tmp.name.rsplit(".tmp-", 1)[-1].rpartition("-")
    if host != HOST or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return int(pid) == os.getpid()


def with_path(e: OSError, path: Path) -> OSError:
    """``e`` itself when it names a file, else the same error naming ``path`` (a failed write — ENOSPC, EIO —
    raises an OSError that names no file; pyarrow's carries the errno but not the path)."""
    if e.filename is not None or e.errno is None:
        return e
    return type(e)(e.errno, os.strerror(e.errno), str(path))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise with_path(e, path) from e


def replace_dir(new: Path, path: Path) -> None:
    """Put the finished directory `new` at `path` (a sibling), replacing what is there: the old one is renamed to
    `<path>.old` first and removed last, so a kill at any point leaves `path` or `<path>.old` whole
    (`recover_dir` puts the latter back)."""
    new, path = Path(new), Path(path)
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(path: Path) -> None:
    """After a kill inside `replace_dir`: `path` missing and `<path>.old` whole -> renamed back."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.is_dir():
        os.rename(old, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.tmp = tmp_path(self.path)

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and with_path(exc, self.path) is not exc:
                raise with_path(exc, self.path) from exc
            return
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            raise with_path(e, self.path) from e
        finally:
            os.close(fd)
        os.replace(self.tmp, self.path)


REDO_UNIT = "Delete it and run the same command again: that unit is redone (the other units are kept)"


class Journal:
    """Progress inside one unit, for resume below unit granularity: an append-only JSONL file, one line per
    finished item (a JSON object). `append` writes the line, flushes and fsyncs before it returns, so every item
    appended before a kill -9 is read back by the next run; a torn last line (killed mid-write) is cut off when the
    journal is opened. Remove it once the unit's shard and sidecar are written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.items: list[dict] = self._recover()

    def _recover(self) -> list[dict]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # bytes after the last newline are a torn write
        items = []
        for number, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise DamagedFile(self.path, f"line {number} is not JSON ({e})", REDO_UNIT) from None
            if not isinstance(item, dict):
                raise DamagedFile(self.path, f"line {number} is not a JSON object", REDO_UNIT)
            items.append(item)
        if end < len(data):  # cut only once the rest has been read back: a refused journal stays as it was
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        return items

    def append(self, item: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write((json.dumps(item) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        self.items.append(item)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_json(path: Path, *, repair: str = "") -> Any:
    """The parsed file; a file that is not valid JSON (or not UTF-8) is a DamagedFile naming it and `repair` (what
    to run), never a bare JSONDecodeError."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, invalid UTF-8, nesting deeper than Python's stack
        raise DamagedFile(path, f"not valid JSON ({str(e)[:200] or type(e).__name__})", repair) from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
