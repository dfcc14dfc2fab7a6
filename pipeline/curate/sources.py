"""Where raw records come from: local jsonl/json/parquet files (or directories of them) and hub datasets.

`plan_chunks` cuts every source into deterministic reading units (`Chunk`: a range of records of one
file or hub split), and `read_chunk` yields a chunk's records with their location, or the reason a
record could not be parsed. Record indices count across a source's files in sorted order (blank jsonl
lines keep their index but yield nothing), so ids `<source>/<index>` are stable whatever the chunking.

Locations in reports: `file:line` (jsonl, and .json files that hold JSON lines), `file[i]` (JSON array),
`file#row` (parquet), `hub:<id>/<split>#i` (hub dataset).

A record that cannot be parsed, whatever the parser raises (nesting deeper than the recursion limit, an
integer longer than Python converts, invalid JSON), is a malformed record with its location; a file that
cannot be read at all (a corrupt parquet footer) is one `StageError` naming the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import ConfigError, CurateConfig, SourceConfig
from pipeline.errors import StageError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_SCAN_BLOCK = 1 << 24


@dataclass(frozen=True)
class Chunk:
    """One reading unit: records [first, first + count) of one file or hub split of one source."""

    source: int      # index into cfg.curate.sources
    name: str        # source name
    number: int      # chunk number within the source
    kind: str        # jsonl | json | parquet | hub
    path: str        # file path or hub id
    first: int       # index of the first record within the source (ids count from here)
    count: int       # records (jsonl: lines) in the chunk
    offset: int      # jsonl: byte offset of the first line; json/parquet/hub: row within the file/split
    end: int         # jsonl: byte offset past the last line; otherwise offset + count
    line: int = 0    # jsonl: 1-based line number of the first line

    @property
    def unit(self) -> str:
        return f"{self.name}-{self.number:05d}"


@dataclass(frozen=True)
class RawRecord:
    index: int             # record index within the source
    location: str          # for reports: file:line etc.
    record: Any = None     # the parsed record (None when `error` is set)
    error: str = ""        # why the record could not be parsed (malformed)


# ----------------------------------------------------------------------------------------------
# Source resolution and planning
# ----------------------------------------------------------------------------------------------


def check_sources(cfg: CurateConfig) -> None:
    """What curate needs beyond a valid config (`CurateConfig.validate`): at least one source, and every local
    source's files present with a supported extension."""
    if not cfg.sources:
        raise ConfigError("curate.sources: at least one source is required")
    for i, s in enumerate(cfg.sources):
        source_files(s, f"curate.sources[{i}]")


def is_local(path: str) -> bool:
    """A path that exists, or that looks like a file path rather than a hub id `owner/name`."""
    p = Path(path)
    return p.exists() or p.suffix in LOCAL_SUFFIXES or path.startswith((".", "/", "~")) or not _HUB_ID.match(path)


def source_files(s: SourceConfig, key: str = "source") -> list[tuple[str, str]]:
    """[(kind, path)] of a source: its local files in sorted order, or [("hub", id)]."""
    if not is_local(s.path):
        return [("hub", s.path)]
    p = Path(s.path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOCAL_SUFFIXES)
        if not files:
            raise ConfigError(f"{key}.path: directory {s.path!r} holds no .jsonl/.json/.parquet files")
    elif p.is_file():
        if p.suffix not in LOCAL_SUFFIXES:
            raise ConfigError(f"{key}.path: {s.path!r} is not a .jsonl/.json/.parquet file")
        files = [p]
    else:
        raise ConfigError(f"{key}.path: {s.path!r} does not exist (and is not a hub dataset id)")
    return [(_local_kind(f), str(f)) for f in files]


def _local_kind(path: Path) -> str:
    """jsonl | json | parquet; a .json file that is not a JSON array holds JSON lines (common on the hub)."""
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix == ".json":
        with open(path, "rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return "json"
    return "jsonl"


def plan_chunks(cfg: CurateConfig) -> list[Chunk]:
    """All reading units of all sources, in source order then record order."""
    chunks: list[Chunk] = []
    for si, s in enumerate(cfg.sources):
        first, number = 0, 0
        limit = s.max_samples if s.max_samples is not None else 1 << 62
        for kind, path in source_files(s, f"curate.sources[{si}]"):
            if first >= limit:
                break
            for offset, end, count, line in _file_ranges(kind, path, s, cfg.read_chunk, limit - first):
                chunks.append(Chunk(si, s.name, number, kind, path, first, count, offset, end, line))
                first += count
                number += 1
    return chunks


def _file_ranges(kind: str, path: str, s: SourceConfig, size: int, limit: int) -> list[tuple[int, int, int, int]]:
    """(offset, end, count, line) ranges of at most `size` records each, at most `limit` records in all."""
    if kind == "jsonl":
        return _jsonl_ranges(path, size, limit)
    n = min(_num_records(kind, path, s), limit)
    return [(o, min(o + size, n), min(size, n - o), 0) for o in range(0, n, size)]


def _jsonl_ranges(path: str, size: int, limit: int) -> list[tuple[int, int, int, int]]:
    """Byte ranges of `size` lines each: one scan for newlines, no parsing."""
    line_ends: list[np.ndarray] = []  # byte offset just past each '\n'
    pos = 0
    with open(path, "rb") as f:
        while block := f.read(_SCAN_BLOCK):
            line_ends.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + pos + 1)
            pos += len(block)
    ends = np.concatenate(line_ends) if line_ends else np.zeros(0, dtype=np.int64)
    if pos and (ends.size == 0 or ends[-1] != pos):
        ends = np.append(ends, pos)  # last line without a trailing newline
    ends = ends[:limit]
    ranges = []
    for start_line in range(0, len(ends), size):
        stop_line = min(start_line + size, len(ends))
        offset = int(ends[start_line - 1]) if start_line else 0
        ranges.append((offset, int(ends[stop_line - 1]), stop_line - start_line, start_line + 1))
    return ranges


def _num_records(kind: str, path: str, s: SourceConfig) -> int:
    if kind == "parquet":
        return _parquet_file(path).metadata.num_rows
    if kind == "json":
        return len(_json_array(path))
    return len(hub_dataset(path, s.subset, s.split, s.data_files))


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def read_chunk(chunk: Chunk, s: SourceConfig) -> Iterator[RawRecord]:
    """The chunk's records in order; unparseable ones carry `error` (never raises for bad data)."""
    if chunk.kind == "jsonl":
        yield from _read_jsonl(chunk)
    elif chunk.kind == "json":
        yield from _read_json_array(chunk)
    elif chunk.kind == "parquet":
        yield from _read_parquet(chunk)
    else:
        ds = hub_dataset(chunk.path, s.subset, s.split, s.data_files)
        yield from dataset_records(ds, chunk.offset, chunk.end, first=chunk.first, where=f"hub:{chunk.path}/{s.split}")


def parse_json(raw: bytes | str) -> tuple[Any, str]:
    """``(value, "")``, or ``(None, why)`` when ``raw`` is not a JSON value Python can hold: invalid JSON, but
    also any other exception of the parser (RecursionError for deep nesting, ValueError for an integer of more
    than 4,300 digits, MemoryError). Invalid UTF-8 becomes lone surrogates: such a record parses and
    `clean` drops it as invalid_utf8."""
    text = raw.decode("utf-8", errors="surrogateescape") if isinstance(raw, bytes) else raw
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (line {e.lineno} column {e.colno})"
    except Exception as e:  # noqa: BLE001 - any input, any size: the record is malformed, the job goes on
        return None, f"unparseable JSON: {type(e).__name__}: {str(e)[:200]}"


def _read_jsonl(chunk: Chunk) -> Iterator[RawRecord]:
    with open(chunk.path, "rb") as f:
        f.seek(chunk.offset)
        data = f.read(chunk.end - chunk.offset)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    for k, raw in enumerate(lines):
        if not raw.strip():
            continue  # blank line: not a record
        record, error = parse_json(raw)
        yield RawRecord(chunk.first + k, f"{chunk.path}:{chunk.line + k}", record, error)


@dataclass(frozen=True)
class Unparsed:
    """A record that did not parse, in place of its value; `error` says why (from `parse_json`)."""

    error: str


@lru_cache(maxsize=1)
def _json_array(path: str) -> list:
    """The records of a .json file holding one JSON array; a file that does not parse is one
    `Unparsed` record (counted as malformed, with the parser's line and column)."""
    data, error = parse_json(Path(path).read_bytes())
    if error:
        return [Unparsed(f"{error.replace('JSON', 'JSON file', 1)}")]
    return data if isinstance(data, list) else [data]


def _read_json_array(chunk: Chunk) -> Iterator[RawRecord]:
    records = _json_array(chunk.path)
    for k in range(chunk.offset, chunk.end):
        index, location, r = chunk.first + k - chunk.offset, f"{chunk.path}[{k}]", records[k]
        if isinstance(r, Unparsed):
            yield RawRecord(index, location, error=r.error)
        else:
            yield RawRecord(index, location, r)


def _parquet_file(path: str) -> pq.ParquetFile:
    """The opened file, or a StageError naming it when it is not readable parquet (truncated, corrupt footer)."""
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ...: one clear error instead of a traceback
        raise unreadable_file(path, e) from e


def unreadable_file(path: str, e: BaseException) -> StageError:
    """The one error for a source file that cannot be read at all (as opposed to a malformed record in it)."""
    return StageError(f"cannot read {path}: {type(e).__name__}: {str(e)[:300]}. Replace the file or remove it "
                      "from the config")


def _read_parquet(chunk: Chunk) -> Iterator[RawRecord]:
    pf = _parquet_file(chunk.path)
    row0 = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        lo, hi = max(chunk.offset, row0), min(chunk.end, row0 + n)
        if lo < hi:
            try:
                rows = pf.read_row_group(g).slice(lo - row0, hi - lo).to_pylist()
            except Exception as e:  # noqa: BLE001 - a corrupt page: the file is unreadable, not one record
                raise unreadable_file(f"{chunk.path} (row group {g})", e) from e
            for k, r in enumerate(rows):
                yield RawRecord(chunk.first + lo + k - chunk.offset, f"{chunk.path}#{lo + k}", r)
        row0 += n
        if row0 >= chunk.end:
            break


@lru_cache(maxsize=4)
def hub_dataset(path: str, subset: str | None, split: str, data_files: str | None = None):
    """`datasets.load_dataset(path, subset, split=split[, data_files=...])`: downloaded once into the HF
    cache, then memory-mapped (random access by row, so any worker can read any chunk)."""
    import datasets

    kwargs = {"data_files": data_files} if data_files else {}
    try:
        return datasets.load_dataset(path, subset, split=split, **kwargs)
    except Exception as e:  # noqa: BLE001 - any loader failure is a config/network problem, reported as such
        raise StageError(
            f"cannot load hub dataset {path!r} (subset={subset!r}, split={split!r}, data_files={data_files!r}; "
            f"no local file or directory of that name exists either): {type(e).__name__}: {e}"
        ) from e


def dataset_records(ds, start: int, stop: int, *, first: int, where: str) -> Iterator[RawRecord]:
    """Rows [start, stop) of a `datasets.Dataset` as records (one columnar slice, then dicts)."""
    try:
        columns = ds[start:stop]
    except Exception as e:  # noqa: BLE001 - a broken cached arrow file: the dataset is unreadable, not one record
        raise unreadable_file(where, e) from e
    names = list(columns)
    for k, values in enumerate(zip(*(columns[c] for c in names))):
        yield RawRecord(first + k, f"{where}#{start + k}", dict(zip(names, values)))
