"""`drafter extract`: tokenized samples -> target features at the tapped layers, in the format of store.py.

Steps (the stage contract of docs/design.md):
  1. refuse tokenize output whose target/tokenizer fingerprint differs from this config;
  2. plan units deterministically from the sample lengths alone: sort by length (longest first, ties by
     tokenize order) and cut into runs of about ``extract.shard_tokens`` tokens — every rank computes
     the same plan and takes ``units_for_rank`` of it;
  3. for each unit not done: read its samples, drop bad ones (counted with a reason), write the shard in
     place inside an ``AtomicFile`` (temp + fsync + rename), then the sidecar with sha256 and counts;
  4. one rank: write index.parquet + manifest.  Several ranks: each stops after its units (returning its rank
     summary), and ``drafter extract --merge`` writes them once every unit is done (the index is built once, by one
     process, not by whichever ranks happen to finish together).

``drafter extract --repair`` (`repair_extract`) re-extracts only the units whose shard fails its checks and
rebuilds the index and manifest; a finished extraction whose files fail their size/header checks is refused
with a message that says so.

kill -9 at any point loses at most the unit in flight: its temp file is removed on the next start and
the unit is redone; finished units are skipped by their sidecars.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from extract.inputs import (
    MAX_FAILURE_EXAMPLES, ExtractContext, TokenizedIndex, Unit, check_sample, extract_context, make_backend, plan_units,
    read_samples, read_tokenized_index, screen_index,
)
from extract.layers import LAYER_CONVENTION
from extract.store import SHARD_EXT, ShardWriter, bytes_per_token, check_store, damaged, finalize_store
from extract.verify import check_engine_taps
from pipeline.config import RunConfig
from pipeline.log import get_logger, progress, summary
from pipeline.errors import StageError
from pipeline.files import AtomicFile, human_bytes
from pipeline.manifests import tokenize_outputs
from pipeline.records import COUNTS, INT, OBJECT, Optional
from pipeline.stage_dir import RankInfo, StageDir, acquire_lock, release_locks, units_for_rank

log = get_logger("extract")


def check_disk_space(path: Path, remaining_tokens: int, per_token: int) -> int:
    """Refuse to start without room for this rank's remaining shards (``per_token`` bytes each, the formula
    `store.bytes_per_token` that `drafter plan` prints too). Returns the bytes needed."""
    need = int(remaining_tokens * per_token * 1.01) + (64 << 20)  # + headers/index slack
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if need > free:
        raise StageError(
            f"not enough disk space for extract at {path}: this rank's remaining {remaining_tokens:,} tokens x "
            f"{per_token:,} bytes/token need {human_bytes(need)}, only {human_bytes(free)} free. "
            "Point runs_dir to a larger disk, use extract.storage_dtype=fp8 (half the bytes), split the work over "
            "machines (--rank/--world-size), or train online (train.online=true)."
        )
    return need


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def run_extract(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    """Extract this rank's units; with one rank also write the index and manifest. Returns the manifest
    (one rank) or this rank's summary (several ranks: `drafter extract --merge` writes the manifest)."""
    started = time.time()
    ctx = extract_context(cfg)
    stage = StageDir(cfg.run_dir, "extract")
    if not stage.begin(ctx.config_hash, force=force, ranks=ranks, settings=ctx.settings):
        problems = check_store(stage.path, full=False)
        if problems:
            raise damaged(stage.path, problems)
        log.info("extract is already complete with this config: %s", stage.path)
        return stage.manifest()
    index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
    keep, _, _ = screen_index(index)
    units = plan_units(index.lengths, keep, cfg.extract.shard_tokens)
    mine = units_for_rank(units, ranks)
    todo = [u for u in mine if stage.unit_done(u.name, fields=SIDECAR) is None]
    remaining = sum(u.tokens for u in todo)
    need = check_disk_space(stage.path, remaining,
                            bytes_per_token(len(ctx.tap_ids), ctx.hidden_size, cfg.extract.storage_dtype))
    log.info("%d units (%d for rank %d/%d, %d to do: %s tokens, %s)", len(units), len(mine), ranks.rank,
             ranks.world_size, len(todo), f"{remaining:,}", human_bytes(need))
    if todo:
        if cfg.extract.backend == "vllm":  # a wrong tap inside the engine stops the job before it writes a shard
            check_engine_taps(cfg, ctx, stage.path, lambda max_len: make_backend(cfg, ctx, max_len=max_len))
        backend = make_backend(cfg, ctx, max_len=max(int(index.lengths[u.rows[0]]) for u in todo))
        try:
            bar = progress(total=remaining, desc=f"extract rank {ranks.rank}", unit="tok")
            extract_units(stage, ctx, cfg, backend, index, todo, bar)
            bar.close()
        finally:
            backend.close()
    if ranks.is_split:
        summary("extract", f"rank {ranks.rank}/{ranks.world_size}: {len(mine)} units done; "
                           "run `drafter extract --merge` once every rank has finished")
        return stage.rank_summary(ranks, [u.name for u in mine], started, tokens=int(sum(u.tokens for u in mine)))
    return _finalize(cfg, ctx, stage, index, units, started)


@dataclass
class _UnitInFlight:
    unit: Unit
    final: Path
    tmp: Path | None
    writer: ShardWriter | None
    input_ids: list
    counts: dict


def open_unit(stage: StageDir, ctx: ExtractContext, cfg: RunConfig, backend, index: TokenizedIndex, unit: Unit,
              bar=None) -> _UnitInFlight:
    """Read and check a unit's samples and open its shard (a pre-sized temp file)."""
    data = read_samples(index, np.asarray(unit.rows))
    rows, failed, examples = [], {}, {}
    for r in unit.rows:
        reason = check_sample(*data[r], ctx.vocab_rows)
        if reason is None:
            rows.append(r)
            continue
        failed[reason] = failed.get(reason, 0) + 1
        if len(examples.setdefault(reason, [])) < MAX_FAILURE_EXAMPLES:
            examples[reason].append(index.ids[r])
        if bar is not None:
            bar.update(int(index.lengths[r]))
    counts = {"samples": len(rows), "tokens": int(sum(len(data[r][0]) for r in rows)),
              "loss_tokens": int(sum(int(data[r][1].sum()) for r in rows)), "failed": failed,
              "failure_examples": examples}
    final = stage.shard_path(unit.name, SHARD_EXT)
    if not rows:
        return _UnitInFlight(unit, final, None, None, [], counts)
    tmp = AtomicFile(final).tmp
    writer = ShardWriter(
        tmp, [index.ids[r] for r in rows], [data[r][0] for r in rows], [data[r][1] for r in rows],
        num_taps=len(ctx.tap_ids), hidden_size=ctx.hidden_size, storage_dtype=cfg.extract.storage_dtype,
        metadata={"rows": rows, "layer_ids": ctx.tap_ids, "layer_convention": LAYER_CONVENTION},
        stream_hash=getattr(backend, "streams_hash", False),
    )
    return _UnitInFlight(unit, final, tmp, writer, [data[r][0] for r in rows], counts)


def _discard(backend, job: _UnitInFlight) -> None:
    """Abandon a unit after an error: let queued writes finish, then remove its temp file."""
    if job.writer is None:
        return
    try:
        backend.wait(job.writer)
    except BaseException:  # noqa: BLE001 — the first error is the one to report
        pass
    job.writer.close()
    job.tmp.unlink(missing_ok=True)


# an extract unit's sidecar (pipeline/records.py shape), beside the files of every sidecar
SIDECAR = {"samples": INT, "tokens": INT, "loss_tokens": INT, "failed": Optional(COUNTS),
           "failure_examples": Optional(OBJECT)}


def finish_unit(stage: StageDir, backend, job: _UnitInFlight) -> dict:
    """Wait for the unit's bytes, fsync, rename into place, write the sidecar (last: it marks the unit done)."""
    if job.writer is None:
        return stage.finish_unit(job.unit.name, [], **job.counts)
    try:
        backend.wait(job.writer)
        digest = job.writer.close()  # fsync
    except BaseException:
        job.writer.close()
        job.tmp.unlink(missing_ok=True)
        raise
    os.replace(job.tmp, job.final)
    # hashed on the way to disk: no read-back (digest is None when another process, vLLM, wrote the bytes)
    known = {job.final.name: digest} if digest is not None else None
    return stage.finish_unit(job.unit.name, [job.final], sha256=known, **job.counts)


def extract_units(stage: StageDir, ctx: ExtractContext, cfg: RunConfig, backend, index: TokenizedIndex,
                  units: list[Unit], bar=None) -> None:
    """Extract units in groups of ``extract.parallel_shards`` (their batches alternate, so each shard's hash
    thread runs in parallel).  A group is finished (drain, fsync, rename, sidecar) on background threads
    while the device already computes the next group."""
    from concurrent.futures import ThreadPoolExecutor

    lanes = max(1, cfg.extract.parallel_shards)
    with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="extract-finish") as finisher:
        pending: list = []
        try:
            for g in range(0, len(units), lanes):
                jobs = [open_unit(stage, ctx, cfg, backend, index, u, bar) for u in units[g:g + lanes]]
                work = [(j.writer, j.input_ids) for j in jobs if j.writer is not None]
                try:
                    if hasattr(backend, "extract_units"):
                        backend.extract_units(work, progress=bar)
                    else:
                        for writer, ids in work:
                            backend.extract_unit(writer, ids, progress=bar)
                except BaseException:
                    for j in jobs:
                        _discard(backend, j)
                    raise
                for f in pending:
                    f.result()
                pending = [finisher.submit(finish_unit, stage, backend, j) for j in jobs]
            for f in pending:
                f.result()
            pending = []
        finally:
            for f in pending:
                f.cancel()


def _finalize(cfg: RunConfig, ctx: ExtractContext, stage: StageDir, index: TokenizedIndex, units: list[Unit],
              started: float) -> dict:
    """All units done: index + manifest (counts account for every input sample)."""
    missing = [u.name for u in units if stage.unit_done(u.name) is None]
    if missing:
        raise StageError(f"extract: {len(missing)} of {len(units)} units are not done yet "
                         f"(first: {missing[:5]}); run the missing ranks again, then --merge")
    _, screened, screen_examples = screen_index(index)
    done = {u.name: stage.unit_done(u.name, fields=SIDECAR) for u in units}
    counts: dict[str, int] = {"input": len(index.ids), "written": 0, "tokens": 0, "loss_tokens": 0}
    examples: dict[str, list] = {k: list(v) for k, v in screen_examples.items()}
    for reason, n in screened.items():
        counts[f"dropped.{reason}"] = n
    for info in done.values():
        counts["written"] += info["samples"]
        counts["tokens"] += info["tokens"]
        counts["loss_tokens"] += info["loss_tokens"]
        for reason, n in info.get("failed", {}).items():
            counts[f"dropped.{reason}"] = counts.get(f"dropped.{reason}", 0) + n
        for reason, ex in info.get("failure_examples", {}).items():
            examples.setdefault(reason, []).extend(ex[: MAX_FAILURE_EXAMPLES - len(examples.get(reason, []))])
    dropped = sum(v for k, v in counts.items() if k.startswith("dropped."))
    if counts["written"] + dropped != counts["input"]:
        raise StageError(f"extract: written {counts['written']} + dropped {dropped} != input {counts['input']}")
    shard_names = [f"{u.name}.{SHARD_EXT}" for u in units if done[u.name]["files"]]
    manifest = finalize_store(
        stage, shard_names=shard_names, config_hash=ctx.config_hash, fingerprint=ctx.fingerprint, started=started,
        inputs={"tokenize": tokenize_outputs(cfg.run_dir).ref()}, counts=counts,
        extra={"backend": cfg.extract.backend, "failure_examples": examples,
               "bytes_per_token": bytes_per_token(len(ctx.tap_ids), ctx.hidden_size, cfg.extract.storage_dtype)},
    )
    summary("extract", f"{counts['written']:,} samples, {counts['tokens']:,} tokens, layers {ctx.tap_ids} "
                       f"({cfg.extract.storage_dtype}), {human_bytes(manifest['total_bytes'])}, dropped {dropped} "
                       f"-> {stage.path}")
    return manifest


def unit_names(cfg: RunConfig) -> list[str]:
    """Every unit of this config's extraction, in the order ranks slice them (`drafter extract --merge` checks
    them): a function of the tokenized input's lengths and `extract.shard_tokens` alone."""
    ctx = extract_context(cfg)
    index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
    keep, _, _ = screen_index(index)
    return [u.name for u in plan_units(index.lengths, keep, cfg.extract.shard_tokens)]


def repair_extract(cfg: RunConfig) -> dict:
    """`drafter extract --repair`: re-extract exactly the units whose shard fails its checks (missing, another size,
    or another sha256 than its sidecar: every byte is read), then rebuild index.parquet and the manifest.

    Good shards are not written (their bytes and mtimes stay); a repaired shard is byte-identical to what a clean
    run writes (units are a pure function of the tokenized input and the config). Nothing to repair: a no-op.
    """
    started = time.time()
    ctx = extract_context(cfg)
    stage = StageDir(cfg.run_dir, "extract")
    state = stage.read_state()
    if state is None:
        raise StageError(f"nothing to repair at {stage.path}: run `drafter extract` first")
    if state["config_hash"] != ctx.config_hash:
        raise StageError(f"{stage.path} was extracted with another config: repair with the config it was made with, "
                         "or redo it with --force")
    acquire_lock(stage.path / "lock", f"stage 'extract' at {stage.path}")
    try:
        index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
        keep, _, _ = screen_index(index)
        units = plan_units(index.lengths, keep, cfg.extract.shard_tokens)
        bad = [u for u in progress(units, desc="extract repair: sha256", unit="shard")
               if stage.unit_done(u.name, verify=True) is None]
        try:
            store_problems = check_store(stage.path, full=False) if stage.is_complete() else {stage.manifest_path: "missing"}
        except StageError as e:  # a damaged manifest
            store_problems = {stage.manifest_path: str(e)}
        if not bad and not store_problems:
            summary("extract", f"nothing to repair: every shard matches its sha256, index and manifest are intact "
                               f"({stage.path})")
            return stage.manifest()
        for u in bad:
            log.warning("shard %s.%s fails its checks: re-extracting it", u.name, SHARD_EXT)
        for path, why in store_problems.items():
            log.warning("%s: %s", path, why)
        stage.manifest_path.unlink(missing_ok=True)  # incomplete (readers refuse it) until the repair is done
        if bad:
            backend = make_backend(cfg, ctx, max_len=max(int(index.lengths[u.rows[0]]) for u in bad))
            try:
                bar = progress(total=sum(u.tokens for u in bad), desc="extract repair", unit="tok")
                extract_units(stage, ctx, cfg, backend, index, bad, bar)
                bar.close()
            finally:
                backend.close()
        manifest = _finalize(cfg, ctx, stage, index, units, started)  # index + manifest
    finally:
        release_locks(stage.path)
    summary("extract", f"repaired {len(bad)} shard(s)" + (f" ({', '.join(u.name for u in bad)})" if bad else "")
            + " and rebuilt the index and manifest")
    return manifest
