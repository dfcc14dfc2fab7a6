"""Where raw records come from: each source's files (its own `path`, a mirror copy, a download or a hub dataset,
found by `pipeline.datasets`), random words, or the prompts the target synthesized (`synthesize.py`).

`resolve_sources` applies the `use` rule to curate.sources (`pipeline.datasets.choose`): every source in use
with what was found, every absent one with where it was looked for. `plan_chunks` cuts the sources in use into
deterministic reading units (`Chunk`: a range of records of one file, hub split or random-word source), and
`read_chunk` yields a chunk's records with their location, or the reason a record could not be parsed. Record
indices count across a source's files in sorted order (blank jsonl lines keep their index but yield nothing), so
ids `<source>/<index>` are stable whatever the chunking.

Locations in reports: `file:line` (jsonl, and .json files that hold JSON lines), `file[i]` (JSON array),
`file#row` (parquet), `hub:<id>/<split>#i` (hub dataset), `words:<source>#i` (random words).

A record that cannot be parsed, whatever the parser raises (nesting deeper than the recursion limit, an
integer longer than Python converts, invalid JSON), is a malformed record with its location; a file that
cannot be read at all (a corrupt parquet footer) is one `StageError` naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import ConfigError, CurateConfig, RunConfig, SourceConfig
from pipeline.datasets import Choice, Located, choose, load_hub, locate, locate_local
from pipeline.errors import StageError

_SCAN_BLOCK = 1 << 24


@dataclass(frozen=True)
class Chunk:
    """One reading unit: records [first, first + count) of one file or hub split of one source."""

    source: int      # index into cfg.curate.sources
    name: str        # source name
    number: int      # chunk number within the source
    kind: str        # jsonl | json | parquet | hub | words
    path: str        # file path, hub id, or the record count of a random-word source
    first: int       # index of the first record within the source (ids count from here)
    count: int       # records (jsonl: lines) in the chunk
    offset: int      # jsonl: byte offset of the first line; json/parquet/hub/words: row within the file/split
    end: int         # jsonl: byte offset past the last line; otherwise offset + count
    line: int = 0    # jsonl: 1-based line number of the first line
    cache: str = ""  # hub: the `datasets` cache directory

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


def generated(s: SourceConfig, target_model: str) -> Located | None:
    """What a source that reads no dataset yields (random words, synthesized prompts), or None for a dataset."""
    if s.random_words is not None:
        return Located(s.name, "random_words", (("words", str(s.random_words)),), f"random_words:{s.random_words}")
    if s.synthesize is not None:
        return Located(s.name, "synthesized", (), f"synthesized by the target {target_model}")
    return None


def resolve_sources(cfg: RunConfig) -> list[Choice]:
    """Every curate source after the `use` rule: used (with its files), absent (why) or an unneeded fallback.
    Raises ConfigError without sources, DatasetMissing (one line) when a required source is found nowhere."""
    if not cfg.curate.sources:
        raise ConfigError("curate.sources: at least one source is required")

    def find(i: int, s: SourceConfig) -> Located:
        return generated(s, cfg.target.model) or locate(s, s.name, f"curate.sources[{i}]", data_dir=cfg.data_dir,
                                                        cache_dir=cfg.cache_dir)

    return choose(cfg.curate.sources, "curate.sources", find)


def count_records(cfg: RunConfig) -> tuple[int, list[str]]:
    """Raw records of the sources of weight > 0 that are counted without fetching or generating anything (own
    files, mirror copies, random words, each capped by its max_samples; synthesized: its `count`), and the names
    of the others (hub and url sources not in the mirror). Fallback sources count only when no other source was
    found here. Reads no record, writes nothing."""
    total, uncounted, files = 0, [], {}
    sources = [(i, s) for i, s in enumerate(cfg.curate.sources) if s.weight > 0]
    for fallbacks in (False, True):
        if fallbacks and (files or total):
            break
        for i, s in sources:
            if (s.use == "fallback") != fallbacks:
                continue
            if s.synthesize is not None:
                total += s.synthesize.count
                continue
            found = generated(s, cfg.target.model) or locate_local(s, s.name, f"curate.sources[{i}]",
                                                                    data_dir=cfg.data_dir)
            if found is None:
                uncounted.append(s.name)
            else:
                files[i] = list(found.files)
    total += sum(c.count for c in plan_chunks(cfg.curate, files, cfg.cache_dir))
    return total, uncounted


def plan_chunks(cfg: CurateConfig, files: dict[int, list[tuple[str, str]]], cache_dir: str = "") -> list[Chunk]:
    """All reading units of the sources in `files` (source index -> [(kind, path)]), in source order then record
    order; `cache_dir` is where hub datasets are cached."""
    chunks: list[Chunk] = []
    cache = str(Path(cache_dir) / "datasets")
    for si in sorted(files):
        s = cfg.sources[si]
        first, number = 0, 0
        limit = s.max_samples if s.max_samples is not None else 1 << 62
        for kind, path in files[si]:
            if first >= limit:
                break
            for offset, end, count, line in _file_ranges(kind, path, s, cfg.read_chunk, limit - first, cache):
                chunks.append(Chunk(si, s.name, number, kind, path, first, count, offset, end, line,
                                    cache if kind == "hub" else ""))
                first += count
                number += 1
    return chunks


def _file_ranges(kind: str, path: str, s: SourceConfig, size: int, limit: int,
                 cache: str) -> list[tuple[int, int, int, int]]:
    """(offset, end, count, line) ranges of at most `size` records each, at most `limit` records in all."""
    if kind == "jsonl":
        return _jsonl_ranges(path, size, limit)
    n = min(_num_records(kind, path, s, cache), limit)
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


def _num_records(kind: str, path: str, s: SourceConfig, cache: str) -> int:
    if kind == "parquet":
        return _parquet_file(path).metadata.num_rows
    if kind == "json":
        return len(_json_array(path))
    if kind == "words":
        return int(path)
    return len(_hub(s, cache))


def _hub(s: SourceConfig, cache: str):
    return load_hub(s.hub, s.subset, s.split, s.revision, s.data_files, cache)


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
    elif chunk.kind == "words":
        from pipeline.curate.synthetic import random_words

        for k, text in enumerate(random_words(chunk.name, chunk.offset, chunk.count)):
            yield RawRecord(chunk.first + k, f"words:{chunk.name}#{chunk.offset + k}", {"prompt": text})
    else:
        ds = _hub(s, chunk.cache)
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


def dataset_records(ds, start: int, stop: int, *, first: int, where: str) -> Iterator[RawRecord]:
    """Rows [start, stop) of a `datasets.Dataset` as records (one columnar slice, then dicts)."""
    try:
        columns = ds[start:stop]
    except Exception as e:  # noqa: BLE001 - a broken cached arrow file: the dataset is unreadable, not one record
        raise unreadable_file(where, e) from e
    names = list(columns)
    for k, values in enumerate(zip(*(columns[c] for c in names))):
        yield RawRecord(first + k, f"{where}#{start + k}", dict(zip(names, values)))
