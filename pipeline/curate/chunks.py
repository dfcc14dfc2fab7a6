"""The reading phase: each `Chunk` is read, adapted, cleaned and hashed into one work file.

A work file (`curate/work/shards/<source>-NNNNN.arrow`, Arrow IPC, uncompressed so later phases can
memory-map it) holds the chunk's surviving conversations in record order with the columns of
`schema.work_schema`; its sidecar (`.done.json`, `StageDir.finish_unit`) holds the chunk's counts
(`read`, `malformed`, `conversations`, `kept`, `dropped.<reason>`, `format.<name>`, `fixed.<what>`)
and the first few examples of every drop and parse failure. A chunk is the unit of resume: after
kill -9 only chunks without a valid sidecar are redone. Chunks run in `curate.num_workers` processes;
their results do not depend on which process ran them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.config import CurateConfig
from pipeline.curate.adapters import NotThisFormat, adapt, metadata_json
from pipeline.curate.clean import clean_conversation
from pipeline.curate.dedup import dedup_text, exact_key, minhash_signatures, shingle_hashes
from pipeline.curate.schema import work_schema
from pipeline.curate.sources import Chunk, read_chunk
from pipeline.log import progress
from pipeline.files import AtomicFile
from pipeline.records import COUNTS, OBJECT
from pipeline.stage_dir import StageDir

MIN_RECORDS_PER_WORKER = 10000  # below this, starting worker processes costs more than it saves
EXAMPLES_PER_REASON = 3  # examples kept per drop reason (per chunk; the report keeps the first overall)
EXCERPT_CHARS = 160


def work_file(work: StageDir, chunk: Chunk) -> Path:
    return work.shard_path(chunk.unit, "arrow")


def _excerpt(messages: list[dict]) -> str:
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str) and c.strip():
            return c[:EXCERPT_CHARS]
    return repr(messages)[:EXCERPT_CHARS]


def process_chunk(chunk: Chunk, cfg: CurateConfig, work_path: str) -> dict:
    """Read, adapt, clean and hash one chunk; write its work file and sidecar. Returns the sidecar."""
    work = StageDir(Path(work_path).parent, Path(work_path).name)
    source = cfg.sources[chunk.source]
    counts: Counter = Counter()
    examples: dict[str, list] = {}
    cols: dict[str, list] = {k: [] for k in ("id", "source", "metadata", "chars", "prompt_chars", "turns", "key")}
    roles: list[str] = []      # messages, flattened: built into a list<struct> array in one go
    contents: list[str] = []
    texts: list[str] = []
    for raw in read_chunk(chunk, source):
        counts["read"] += 1
        error = raw.error
        if not error:
            try:
                fmt, kept, drops = _process_record(raw, source, cfg)
            except NotThisFormat as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - a record nothing could foresee (too deep, too large): malformed
                error = f"cannot process record: {type(e).__name__}: {str(e)[:200]}"
        if error:
            counts["malformed"] += 1
            bucket = examples.setdefault("malformed", [])
            if len(bucket) < EXAMPLES_PER_REASON:
                bucket.append({"location": raw.location, "error": error})
            continue
        counts[f"format.{fmt}"] += 1
        counts["conversations"] += len(kept) + len(drops)
        for reason, example in drops:
            counts[f"dropped.{reason}"] += 1
            bucket = examples.setdefault(reason, [])
            if len(bucket) < EXAMPLES_PER_REASON:
                bucket.append(example)
        for cid, c, metadata in kept:
            if c.removed_empty_system:
                counts["fixed.empty_system_removed"] += c.removed_empty_system
            text = dedup_text(c.messages)
            texts.append(text)
            cols["id"].append(cid)
            cols["source"].append(source.name)
            roles += [m["role"] for m in c.messages]
            contents += [m["content"] for m in c.messages]
            cols["metadata"].append(metadata)
            cols["chars"].append(sum(len(m["content"]) for m in c.messages))
            cols["prompt_chars"].append(sum(len(m["content"]) for m in c.messages if m["role"] != "assistant"))
            cols["turns"].append(len(c.messages))
            cols["key"].append(exact_key(text))
    counts["kept"] = len(texts)

    num_perm = cfg.minhash_perm if cfg.near_dedup else None
    schema = work_schema(num_perm)
    offsets = np.zeros(len(cols["turns"]) + 1, dtype=np.int32)
    np.cumsum(cols["turns"], out=offsets[1:])
    messages = pa.ListArray.from_arrays(
        pa.array(offsets), pa.StructArray.from_arrays([pa.array(roles, pa.string()), pa.array(contents, pa.string())],
                                                      fields=list(schema.field("messages").type.value_type)))
    arrays = [messages if f.name == "messages" else pa.array(cols[f.name], type=f.type)
              for f in schema if f.name != "minhash"]
    if num_perm:
        sig = minhash_signatures(*shingle_hashes(texts), num_perm) if texts else np.zeros((0, num_perm), np.uint32)
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(sig.ravel(), type=pa.uint32()), num_perm))
    table = pa.Table.from_arrays(arrays, schema=schema)
    path = work_file(work, chunk)
    with AtomicFile(path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(table)
    return work.finish_unit(chunk.unit, [path], counts=dict(counts), examples=examples)


def _process_record(raw, source, cfg: CurateConfig) -> tuple[str, list[tuple], list[tuple[str, dict]]]:
    """(format, kept [(id, cleaned, metadata json)], dropped [(reason, example)]) of one parsed record.
    Raises (NotThisFormat or anything else) before anything of the record is counted, so a record is
    either processed whole or counted once as malformed."""
    fmt, convs = adapt(raw.record, source.format)
    kept, drops = [], []
    for k, (messages, extra) in enumerate(convs):
        cid = f"{source.name}/{raw.index}" + (f".{k}" if k else "")
        c = clean_conversation(messages, min_chars=cfg.min_chars, max_chars=cfg.max_chars)
        if c.reason:
            drops.append((c.reason, {"id": cid, "location": raw.location, "detail": c.detail,
                                     "excerpt": _excerpt(messages)}))
        else:
            kept.append((cid, c, metadata_json(fmt, raw.location, extra)))
    return fmt, kept, drops


def _die_with_parent() -> None:
    """Pool workers get SIGKILL when the main process dies (Linux), so a kill -9 of the job leaves no
    orphan still writing chunks; elsewhere this is a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# a reading chunk's sidecar (pipeline/records.py shape), beside the files of every sidecar
SIDECAR = {"counts": COUNTS, "examples": OBJECT}


def _process_chunk_star(args) -> dict:
    return process_chunk(*args)


def read_chunks(chunks: list[Chunk], cfg: CurateConfig, work: StageDir, num_workers: int) -> dict[str, dict]:
    """Process every chunk without a valid sidecar; returns {unit: sidecar} for all chunks, in plan order."""
    done = {c.unit: info for c in chunks if (info := work.unit_done(c.unit, fields=SIDECAR))}
    todo = [c for c in chunks if c.unit not in done]
    planned = {c.unit: c.count for c in chunks}  # records (jsonl: lines) per chunk
    bar = progress(total=sum(planned.values()), desc="curate read", unit="rec")
    bar.update(sum(planned[u] for u in done))
    jobs = [(c, cfg, str(work.path)) for c in todo]
    num_workers = min(num_workers, len(todo), sum(c.count for c in todo) // MIN_RECORDS_PER_WORKER)
    if num_workers <= 1:
        for c, job in zip(todo, jobs):
            done[c.unit] = process_chunk(*job)
            bar.update(c.count)
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork: safe whatever threads the parent holds
        with ctx.Pool(num_workers, initializer=_die_with_parent) as pool:
            for info in pool.imap_unordered(_process_chunk_star, jobs):
                done[info["unit"]] = info
                bar.update(planned[info["unit"]])
    bar.close()
    return {c.unit: done[c.unit] for c in chunks}


def default_workers(cfg: CurateConfig) -> int:
    return cfg.num_workers if cfg.num_workers > 0 else (os.cpu_count() or 1)
