"""`drafter curate`: sources -> clean, deduplicated, mixed conversations in parquet shards.

Phases and their units of resume (a killed run redoes only unfinished units):

    find    every source's dataset: own file, mirror copy, cache or hub (`pipeline.datasets`; before the
            stage begins: what was found and its checksums are part of the config record, so a resumed or
            finished run made from other data is refused naming the source)
    synth   per synthesized source, its units of target-written prompts (`synthesize.py`)
    plan    cut every source in use into chunks of `curate.read_chunk` records (a newline scan, no parsing)
    read    per chunk: read, adapt, clean, exact key + MinHash -> work/shards/<source>-NNNNN.arrow
            (`chunks.py`; `curate.num_workers` processes)
    dedup   exact then near duplicates over all chunks in source order -> work/shards/dedup.arrow
    select  eval split, mixture, shuffle (`mix.py`; deterministic from cfg.seed, recomputed)
    write   shards/{train,eval}-NNNNN.parquet, each a pure function of the selection
    report  stats.json, report.md, manifest.json (last); the work directory is removed

Output contract: docs/design.md ("curate"); row schema: `pipeline/curate/schema.py`.
"""

from __future__ import annotations

import math
import shutil
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import RunConfig, config_record, hashed_fields
from pipeline.curate.chunks import default_workers, read_chunks, work_file
from pipeline.curate.clean import DROP_REASONS
from pipeline.curate.dedup import LSH_WEIGHTS, SHINGLE_WORDS, exact_duplicates, near_duplicates
from pipeline.curate.mix import Selection, select
from pipeline.curate.report import CHAR_EDGES, histogram, length_summary, render_report
from pipeline.curate.schema import CONVERSATION_SCHEMA, KEY_BYTES
from pipeline.curate.sources import Chunk, plan_chunks, resolve_sources
from pipeline.curate.synthesize import synthesize
from pipeline.datasets import Choice
from pipeline.log import get_logger, progress, summary
from pipeline.errors import StageError
from pipeline.files import AtomicFile, atomic_write_json, atomic_write_text
from pipeline.stage_dir import RankInfo, StageDir
from pipeline.sample_ids import repeat_id

SCHEMA_VERSION = "curate.conversation.v1"
DEDUP_UNIT = "dedup"
REPEAT_WARNING = 4.0  # up-sampling factor above which the log warns that a source's data repeats
OUTPUT_COLUMNS = [f.name for f in CONVERSATION_SCHEMA]
log = get_logger("curate")


def curate_config_record(cfg: RunConfig, data: dict) -> tuple[str, dict]:
    """(hash, settings) of everything that shapes the output: the curate section without its `hashed=False`
    fields (`num_workers`, `max_error_rate`: they change how the work runs or whether it may finish, never what it
    writes, so a run that failed on the error rate resumes with a higher limit), and `data`: per source, what was
    found (where, files, checksums; the target that synthesizes) or that it is absent."""
    return config_record(curate=hashed_fields(cfg.curate), run={"seed": cfg.seed, "schema": SCHEMA_VERSION}, data=data)


def data_record(cfg: RunConfig, choices: list[Choice]) -> tuple[dict, object]:
    """(per source name: its `Choice.record()`, with the synthesizing target's identity where one synthesizes;
    the opened target or None)."""
    data = {c.name: c.record() for c in choices}
    synth = [c for c in choices if c.status == "used" and cfg.curate.sources[c.index].synthesize is not None]
    target = None
    if synth:
        from pipeline.target import open_target

        target = open_target(cfg.target, cfg.cache_dir)
        for c in synth:
            data[c.name]["target"] = {**target.fingerprint, "enable_thinking": cfg.target.enable_thinking}
    return data, target


def run_curate(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    if ranks.is_split:
        raise StageError("curate runs as one job (it deduplicates across all sources); "
                         "parallelism comes from curate.num_workers")
    started = time.time()
    choices = resolve_sources(cfg)
    data, target = data_record(cfg, choices)
    for ch in choices:
        if ch.status == "absent":
            log.warning("source %r left out (use: if_present): %s", ch.name, ch.reason)
        elif ch.status == "fallback_unused":
            log.info("source %r (fallback) %s", ch.name, ch.reason)
    stage = StageDir(cfg.run_dir, "curate")
    work = StageDir(stage.path, "work")
    chash, settings = curate_config_record(cfg, data)
    if not stage.begin(chash, force=force, settings=settings):
        shutil.rmtree(work.path, ignore_errors=True)  # left over if a kill hit between manifest and cleanup
        m = stage.manifest()
        summary("curate", f"already complete: {m['counts']['train']} train + {m['counts']['eval']} eval "
                          f"-> {stage.shards}; report: {stage.path / 'report.md'}")
        return m
    timings: dict[str, float] = {}
    c = cfg.curate
    names = [s.name for s in c.sources]
    files, synthesized = {}, {}
    for ch in choices:
        if ch.status != "used":
            continue
        if c.sources[ch.index].synthesize is not None:
            with _phase(timings, f"synthesize {ch.name}"):
                files[ch.index], synthesized[ch.name] = synthesize(cfg, ch.index, target, work)
        else:
            files[ch.index] = list(ch.located.files)
    with _phase(timings, "plan"):
        chunks = plan_chunks(c, files, cfg.cache_dir)
    with _phase(timings, "read"):
        sidecars = read_chunks(chunks, c, work, default_workers(c))
    _check_error_rate(cfg, sidecars)
    with _phase(timings, "dedup"):
        pool = WorkPool(work, chunks, len(names))
        exact_of, near_of = _dedup(cfg, pool, work)
    with _phase(timings, "select"):
        unique = (exact_of < 0) & (near_of < 0)
        pools = [np.flatnonzero(unique & (pool.source_of_row == i)) for i in range(len(names))]
        _check_eval_size(c.eval_size, sum(len(p) for p in pools))
        sel = select(pools, names, [s.weight for s in c.sources], total=c.total, eval_size=c.eval_size, seed=cfg.seed)
    _warn_repeats(sel, c.total)
    with _phase(timings, "write"):
        shards = _write_shards(stage, pool, sel, c.shard_size, names)

    data_stats = {name: {**record, **({"synthesized": synthesized[name]} if name in synthesized else {})}
                  for name, record in data.items()}
    stats = _stats(cfg, stage, chunks, sidecars, pool, exact_of, near_of, sel, shards, timings, data_stats)
    atomic_write_json(stage.path / "stats.json", stats)
    report_path = stage.path / "report.md"
    atomic_write_text(report_path, render_report(stats))
    if stats["counts"]["unique"] == 0:
        raise StageError(f"curate: no conversation survived reading, cleaning and dedup; see {report_path}")

    manifest = stage.write_manifest(
        config_hash=chash,
        fingerprint={"schema": SCHEMA_VERSION, "seed": cfg.seed,
                     "sources": {ch.name: ch.located.identity for ch in choices if ch.status == "used"}},
        counts=stats["manifest_counts"],
        started=started,
        extra={"sources": stats["sources_manifest"], "data": data, "report": str(report_path),
               "stats": str(stage.path / "stats.json")},
    )
    pool.close()
    shutil.rmtree(work.path, ignore_errors=True)
    k = stats["counts"]
    dropped = sum(v for key, v in k.items() if key.startswith("dropped."))
    used = ", ".join(ch.name for ch in choices if ch.status == "used")
    absent = ", ".join(ch.name for ch in choices if ch.status == "absent")
    summary("curate", f"{k['train']} train + {k['eval']} eval conversations from {k['read']} records of {used}"
                      f"{f' ({absent} absent)' if absent else ''} ({k['malformed']} malformed, {dropped} dropped, "
                      f"{k['repeats']} up-sampled copies) -> {stage.shards}; report: {report_path}")
    return manifest


@contextmanager
def _phase(timings: dict[str, float], name: str):
    """Time one phase into `timings` and log it."""
    tick = time.time()
    yield
    timings[name] = time.time() - tick
    log.info(f"{name}: {timings[name]:.1f} s")


# ----------------------------------------------------------------------------------------------
# The work pool: every chunk's work file, memory-mapped, rows numbered in plan order
# ----------------------------------------------------------------------------------------------


class WorkPool:
    """All work files as one row space: global row r = row r - offsets[c] of chunk c (plan order)."""

    def __init__(self, work: StageDir, chunks: list[Chunk], num_sources: int):
        self._maps = [pa.memory_map(str(work_file(work, ch))) for ch in chunks]
        self.tables = [pa.ipc.open_file(m).read_all() for m in self._maps]
        sizes = np.array([t.num_rows for t in self.tables], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))
        self.source_of_row = np.repeat(np.array([ch.source for ch in chunks], dtype=np.int64), sizes)
        self.num_sources = num_sources

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def close(self) -> None:
        self.tables = []
        for m in self._maps:
            m.close()

    def numpy(self, column: str) -> np.ndarray:
        """A fixed-width column over all rows: ints as [N]; key as [N, 2] uint64; minhash as [N, perm] uint32."""
        parts = []
        for t in self.tables:
            for arr in t.column(column).chunks:
                if column == "key":
                    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
                    parts.append(raw[arr.offset * KEY_BYTES:(arr.offset + len(arr)) * KEY_BYTES].view(np.uint64)
                                 .reshape(-1, 2))
                elif column == "minhash":
                    width = arr.type.list_size
                    parts.append(arr.flatten().to_numpy().reshape(-1, width))
                else:
                    parts.append(arr.to_numpy())
        if parts:
            return np.concatenate(parts)
        return np.zeros((0, 2) if column == "key" else 0, dtype=np.uint64 if column == "key" else np.int64)

    def take(self, rows: np.ndarray, columns: list[str] = OUTPUT_COLUMNS) -> pa.Table:
        """Rows in the given order, gathered chunk by chunk (never concatenating whole columns)."""
        chunk_of = np.searchsorted(self.offsets, rows, side="right") - 1
        order = np.argsort(chunk_of, kind="stable")
        pieces = []
        for c in np.unique(chunk_of):
            picked = order[chunk_of[order] == c]
            pieces.append(self.tables[c].select(columns).take(pa.array(rows[picked] - self.offsets[c])))
        if not pieces:
            return CONVERSATION_SCHEMA.empty_table().select(columns)
        grouped = pa.concat_tables(pieces).combine_chunks()
        return grouped.take(pa.array(np.argsort(order, kind="stable")))


# ----------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------


def _check_error_rate(cfg: RunConfig, sidecars: dict[str, dict]) -> None:
    read = sum(s["counts"].get("read", 0) for s in sidecars.values())
    bad = sum(s["counts"].get("malformed", 0) for s in sidecars.values())
    rate = bad / read if read else 0.0
    if rate > cfg.curate.max_error_rate:
        where = [e for s in sidecars.values() for e in s["examples"].get("malformed", [])][:5]
        lines = "\n".join(f"  {e['location']}: {e['error']}" for e in where)
        raise StageError(
            f"curate: {bad} of {read} raw records are malformed ({rate:.2%} > curate.max_error_rate="
            f"{cfg.curate.max_error_rate:.2%}); first ones:\n{lines}\n"
            f"Fix the inputs or raise curate.max_error_rate (finished chunks are kept and reused)."
        )


def _check_eval_size(eval_size: int, unique: int) -> None:
    """The held-out split must leave conversations to train on (what exists is known only after dedup)."""
    if 0 < unique <= eval_size:
        raise StageError(f"curate.eval_size={eval_size:,} but only {unique:,} unique conversations survived reading, "
                         "cleaning and dedup, which leaves none to train on; lower curate.eval_size or add data "
                         "(finished chunks are kept and reused)")


def _warn_repeats(sel: Selection, total: int | None) -> None:
    """Log a warning for every source whose conversations the mixture repeats more than REPEAT_WARNING times."""
    for m in sel.sources:
        if m.factor > REPEAT_WARNING:
            log.warning(f"source {m.name!r}: its {m.available:,} unique train conversations are repeated "
                        f"{m.factor:.1f}x on average to fill its share ({m.target:,}) of curate.total={total:,}; "
                        "lower curate.total or this source's weight, or add data")


def _dedup(cfg: RunConfig, pool: WorkPool, work: StageDir) -> tuple[np.ndarray, np.ndarray]:
    """(exact_of, near_of) [N] int64: -1, or the row that this row duplicates. One checkpointed unit."""
    path = work.shard_path(DEDUP_UNIT, "arrow")
    if work.unit_done(DEDUP_UNIT):
        with pa.memory_map(str(path)) as m:
            t = pa.ipc.open_file(m).read_all()
            return t.column("exact_of").to_numpy().copy(), t.column("near_of").to_numpy().copy()
    exact_of = exact_duplicates(pool.numpy("key"))
    if cfg.curate.near_dedup:
        near_of = near_duplicates(pool.numpy("minhash"), np.flatnonzero(exact_of < 0),
                                  cfg.curate.near_dedup_threshold, desc="curate near-dedup")
    else:
        near_of = np.full(len(pool), -1, dtype=np.int64)
    table = pa.table({"exact_of": exact_of, "near_of": near_of})
    with AtomicFile(path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    work.finish_unit(DEDUP_UNIT, [path], exact=int((exact_of >= 0).sum()), near=int((near_of >= 0).sum()))
    return exact_of, near_of


def _units(sel: Selection, shard_size: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(unit, rows, copy numbers) of every output shard: train-NNNNN then eval-NNNNN."""
    units = []
    for split, rows, copies in (("train", sel.train_rows, sel.train_copy),
                                ("eval", sel.eval_rows, np.zeros(len(sel.eval_rows), np.int64))):
        for k in range(math.ceil(len(rows) / shard_size)):
            lo, hi = k * shard_size, (k + 1) * shard_size
            units.append((f"{split}-{k:05d}", rows[lo:hi], copies[lo:hi]))
    return units


def _write_shards(stage: StageDir, pool: WorkPool, sel: Selection, shard_size: int, names: list[str]) -> dict[str, int]:
    """Write every output shard not yet done; returns the number of train and eval shards."""
    units = _units(sel, shard_size)
    bar = progress(total=len(units), desc="curate write", unit="shard")
    for unit, rows, copies in units:
        if stage.unit_done(unit):
            bar.update(1)
            continue
        table = pool.take(rows)
        if (copies > 0).any():
            ids = table.column("id").to_pylist()
            ids = [repeat_id(i, k) for i, k in zip(ids, copies.tolist())]
            table = table.set_column(0, CONVERSATION_SCHEMA.field("id"), pa.array(ids, pa.string()))
        path = stage.shard_path(unit, "parquet")
        with AtomicFile(path) as tmp:
            pq.write_table(table.cast(CONVERSATION_SCHEMA), tmp, compression="zstd")
        per_source = Counter(pool.source_of_row[rows].tolist())
        stage.finish_unit(unit, [path], rows=len(rows), sources={names[k]: v for k, v in sorted(per_source.items())})
        bar.update(1)
    bar.close()
    return {"train": sum(u.startswith("train") for u, _, _ in units), "eval": sum(u.startswith("eval") for u, _, _ in units)}


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def _dup_examples(pool: WorkPool, dup_of: np.ndarray, k: int = 3) -> list[dict]:
    rows = np.flatnonzero(dup_of >= 0)[:k]
    if not len(rows):
        return []
    dups = pool.take(rows, ["id", "messages", "metadata"]).to_pylist()
    firsts = pool.take(dup_of[rows], ["id"]).column("id").to_pylist()
    out = []
    for d, first in zip(dups, firsts):
        text = next((m["content"] for m in d["messages"] if m["role"] == "user"), "")
        out.append({"id": d["id"], "duplicate_of": first, "excerpt": text[:160]})
    return out


def _stats(cfg: RunConfig, stage: StageDir, chunks: list[Chunk], sidecars: dict[str, dict], pool: WorkPool,
           exact_of: np.ndarray, near_of: np.ndarray, sel: Selection, shards: dict, timings: dict, data: dict) -> dict:
    c = cfg.curate
    names = [s.name for s in c.sources]
    per_source = [Counter() for _ in names]
    examples: dict[str, list] = {}
    for ch in chunks:  # plan order: examples are the first ones in source/record order
        info = sidecars[ch.unit]
        per_source[ch.source].update(info["counts"])
        for reason, ex in info["examples"].items():
            bucket = examples.setdefault(reason, [])
            bucket += ex[: max(0, 3 - len(bucket))]
    n = len(names)
    exact_by_source = np.bincount(pool.source_of_row[exact_of >= 0], minlength=n)
    near_by_source = np.bincount(pool.source_of_row[near_of >= 0], minlength=n)
    for i in range(n):
        per_source[i]["dropped.exact_duplicate"] = int(exact_by_source[i])
        per_source[i]["dropped.near_duplicate"] = int(near_by_source[i])
    examples["exact_duplicate"] = _dup_examples(pool, exact_of)
    examples["near_duplicate"] = _dup_examples(pool, near_of)

    total_counts = Counter()
    for p in per_source:
        total_counts.update(p)
    weight_sum = sum(s.weight for s in c.sources) or 1.0
    sources, sources_manifest = {}, {}
    for i, (s, mix) in enumerate(zip(c.sources, sel.sources)):
        p = per_source[i]
        dropped = {r: int(p.get(f"dropped.{r}", 0)) for r in DROP_REASONS if p.get(f"dropped.{r}", 0)}
        train = mix.selected_unique + mix.repeats
        share = (s.weight / weight_sum) if c.total is not None else (mix.unique / max(1, sum(m.unique for m in sel.sources)))
        sources[s.name] = {
            "path": data[s.name].get("identity", ""), "status": data[s.name]["status"], "category": s.category,
            "weight": s.weight, "share": share,
            "formats": {k.split(".", 1)[1]: v for k, v in p.items() if k.startswith("format.")},
            "read": p.get("read", 0), "malformed": p.get("malformed", 0), "conversations": p.get("conversations", 0),
            "dropped": dropped, "unique": mix.unique, "eval": mix.eval, "available": mix.available,
            "target": mix.target, "train": train, "selected_unique": mix.selected_unique, "repeats": mix.repeats,
            "not_selected": mix.not_selected, "factor": round(mix.factor, 4),
        }
        sources_manifest[s.name] = {
            "read": p.get("read", 0), "malformed": p.get("malformed", 0), "unique": mix.unique,
            "eval": mix.eval, "train": train, "repeats": mix.repeats, "not_selected": mix.not_selected,
            **{f"dropped.{r}": v for r, v in dropped.items()},
        }
    counts = {
        "read": total_counts.get("read", 0), "malformed": total_counts.get("malformed", 0),
        "conversations": total_counts.get("conversations", 0),
        "unique": sum(m.unique for m in sel.sources), "eval": len(sel.eval_rows), "train": len(sel.train_rows),
        "repeats": sum(m.repeats for m in sel.sources), "not_selected": sum(m.not_selected for m in sel.sources),
        **{f"dropped.{r}": int(total_counts.get(f"dropped.{r}", 0)) for r in DROP_REASONS},
    }
    chars, prompt_chars, turns = pool.numpy("chars"), pool.numpy("prompt_chars"), pool.numpy("turns")
    lengths = {
        split: {"summary": length_summary(chars[rows]), "prompt_summary": length_summary(prompt_chars[rows]),
                "chars": histogram(chars[rows], CHAR_EDGES), "turns": histogram(turns[rows], [1, 2, 3, 4, 5, 7, 9, 13, 17])}
        for split, rows in (("train", sel.train_rows), ("eval", sel.eval_rows))
    }
    categories: dict[str, Counter] = {}
    for name, src in sources.items():
        if src["category"]:
            categories.setdefault(src["category"], Counter()).update(
                {k: src[k] for k in ("read", "unique", "eval", "train", "selected_unique")})
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=c.near_dedup_threshold, num_perm=max(c.minhash_perm, 2), weights=LSH_WEIGHTS)
    read = counts["read"]
    return {
        "run": cfg.name,
        "output": str(stage.shards),
        "shards": shards,
        "counts": counts,
        "manifest_counts": {k: v for k, v in counts.items()},
        "sources": sources,
        "sources_manifest": sources_manifest,
        "categories": {k: dict(v) for k, v in sorted(categories.items())},
        "data": data,
        "drops": {r: {"count": counts[f"dropped.{r}"], "examples": examples.get(r, [])} for r in DROP_REASONS},
        "malformed": {"count": counts["malformed"], "rate": counts["malformed"] / read if read else 0.0,
                      "max_error_rate": c.max_error_rate, "examples": examples.get("malformed", [])},
        "fixes": {k.split(".", 1)[1]: v for k, v in total_counts.items() if k.startswith("fixed.")},
        "lengths": lengths,
        "dedup": {"key": "system + user turns, lower-cased, whitespace collapsed (assistant turns are regenerated)",
                  "near": c.near_dedup, "num_perm": c.minhash_perm, "shingle_words": SHINGLE_WORDS,
                  "threshold": c.near_dedup_threshold, "bands": lsh.b, "rows": lsh.r},
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
