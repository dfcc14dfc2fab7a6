"""regen: the target writes every assistant turn of the curated conversations (on-policy data).

    runs/<run>/curate/shards/train-*.parquet  ->  runs/<run>/regen/shards/NNNNN.parquet  (+ NNNNN.done.json)

Units of work are consecutive slices of `regen.shard_size` curated train conversations (in curate's
order, the first `regen.max_samples`); a unit's parquet holds the conversations that succeeded, its
sidecar the counts and every failure with its reason. Multi-turn conversations are answered turn by turn
against the target's own previous turns: dataset assistant turns are dropped, system/user turns kept, and
round r generates assistant turn r for every conversation that has a user turn r. Prompts are rendered
with pipeline.target.render_chat (thinking flag included) and encoded once (pipeline.regen.conversation), so the
hf and vllm backends see identical prompt ids.

`regen.backend: none` keeps the dataset's answers (off-policy: the drafter then learns the dataset, not the
target; the fingerprint says `off_policy: true`); conversations without an answer are counted as failed.

`regen.samples_per_prompt: n` > 1 writes n responses per conversation, sample k with the id `<id>#<k>` and its
own per-request seed (so n samples are n distinct draws at `regen.temperature`, stable across resumes and ranks).
`regen.prompt_formats` rewrites the first user turn of sample k with the k-th template (cyclically) of the
conversation's source, so the training data shows the prompt formats a user serves (e.g. a GSM8K-style
"put the answer in \\boxed{}" instruction); the rewritten turn is what the target answers and what tokenize sees.

Accounting (in samples = conversations x n): input = written + failed.<reason> + skipped.max_samples, over all
curated train conversations.
Tokenize is the next stage; `drafter regen` runs it after regen (so the command yields tokenized data).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import RunConfig, config_record
from pipeline.curate.schema import CONVERSATION_SCHEMA  # regen writes the curate schema back, answers replaced
from pipeline.errors import is_out_of_memory
from pipeline.log import get_logger, progress, summary
from pipeline.regen.conversation import (MalformedConversation, Skeleton, end_of_turn_ids, prompt_ids, skeleton,
                                         strip_reasoning)
from pipeline.regen.generator import Generator, Sampling
from pipeline.errors import StageError
from pipeline.files import AtomicFile
from pipeline.manifests import CuratedData, curate_outputs
from pipeline.records import COUNTS, INT, LIST, NUMBER, OBJECT, Optional
from pipeline.stage_dir import RankInfo, StageDir, units_for_rank
from pipeline.sample_ids import response_id
from pipeline.target import OpenedTarget, open_target

log = get_logger("regen")

MAX_FAILURE_EXAMPLES = 20


def write_conversations(path: Path, rows: list[dict]) -> None:
    """Write conversation rows (id, source, messages, metadata) as one parquet file, atomically."""
    with AtomicFile(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=CONVERSATION_SCHEMA), tmp)


# ----------------------------------------------------------------------------------------------
# Units: consecutive slices of the curated train conversations
# ----------------------------------------------------------------------------------------------


@dataclass
class Unit:
    name: str
    segments: list[tuple[str, int, int]]  # (curate shard file name, first row, end row)

    @property
    def rows(self) -> int:
        return sum(hi - lo for _, lo, hi in self.segments)


def curate_train_files(curate: StageDir) -> list[Path]:
    files = sorted(curate.shards.glob("train-*.parquet"))
    if not files:
        raise StageError(f"no curated train shards (train-*.parquet) in {curate.shards}")
    return files


def plan_units(curate: StageDir, shard_size: int, max_samples: int | None) -> tuple[list[Unit], int]:
    """(units, number of curated train conversations). Unit k covers global rows [k*size, (k+1)*size). Each curated
    shard is checked against its sidecar first (a damaged one: a DamagedFile naming it)."""
    files = curate_train_files(curate)
    sizes = []
    for f in files:
        curate.verify_shard(f)  # the bytes curate wrote (a damaged page can still decode, into other rows)
        with curate.reading_shard(f):
            sizes.append(pq.ParquetFile(f).metadata.num_rows)
    total = sum(sizes)
    take = total if max_samples is None else min(total, max_samples)
    units = []
    starts = [sum(sizes[:i]) for i in range(len(files))]
    for k, lo in enumerate(range(0, take, shard_size)):
        hi = min(take, lo + shard_size)
        segs = []
        for f, s, n in zip(files, starts, sizes):
            a, b = max(lo, s), min(hi, s + n)
            if a < b:
                segs.append((f.name, a - s, b - s))
        units.append(Unit(f"{k:05d}", segs))
    return units, total


def read_rows(curate: StageDir, name: str, lo: int, hi: int) -> list[dict]:
    """Rows [lo, hi) of the curated shard `name`, reading only the row groups that hold them."""
    path = curate.shards / name
    with curate.reading_shard(path):
        pf = pq.ParquetFile(path)
        groups, start, first = [], 0, None
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if start < hi and start + n > lo:
                groups.append(g)
                first = start if first is None else first
            start += n
        if not groups:
            return []
        table = pf.read_row_groups(groups, columns=["id", "source", "messages", "metadata"])
        return table.slice(lo - first, hi - lo).to_pylist()


# ----------------------------------------------------------------------------------------------
# Fingerprint and config hash
# ----------------------------------------------------------------------------------------------


def sampling_fields(cfg: RunConfig) -> dict:
    r = cfg.regen
    fields = {"backend": r.backend, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
              "max_new_tokens": r.max_new_tokens, "max_model_len": r.max_model_len,
              "strip_reasoning": r.strip_reasoning, "seed": r.seed}
    if r.samples_per_prompt != 1 or r.prompt_formats:  # absent at the defaults: earlier runs keep their hash
        fields.update(samples_per_prompt=r.samples_per_prompt, prompt_formats=r.prompt_formats or {})
    return fields


def formatted(sk: Skeleton, templates: list[str] | None, k: int) -> Skeleton:
    """The skeleton with its first user turn put into template k (cyclically); unchanged without templates."""
    if not templates:
        return sk
    first = templates[k % len(templates)].replace("{prompt}", sk.users[0])
    return Skeleton(sk.system, [first, *sk.users[1:]])


def regen_fingerprint(cfg: RunConfig, target: OpenedTarget) -> dict:
    return {
        **target.fingerprint,
        "enable_thinking": cfg.target.enable_thinking,
        "sampling": sampling_fields(cfg),
        "off_policy": cfg.regen.backend == "none",
    }


def regen_config_record(cfg: RunConfig, curated: CuratedData) -> tuple[str, dict]:
    """(hash, settings) of what decides the output: target, sampling, unit layout and the curated input."""
    layout = {"shard_size": cfg.regen.shard_size, "max_samples": cfg.regen.max_samples}
    return config_record(target=cfg.target, sampling=sampling_fields(cfg), regen=layout,
                         curate_output=curated.config_hash)


def request_seed(base: int, conv_id: str, turn: int) -> int:
    """Per-request sampling seed: stable across runs, resumes, batch compositions and ranks."""
    return int(hashlib.sha256(f"{base}:{conv_id}:{turn}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------
# Turn-by-turn regeneration of one unit
# ----------------------------------------------------------------------------------------------


@dataclass
class Answered:
    answers: list[str]
    finish_reasons: list[str]
    generated_tokens: list[int]


def regenerate(generator, tokenizer, items: list[tuple[str, object]], cfg: RunConfig
               ) -> tuple[dict[str, Answered], dict[str, tuple[str, str]]]:
    """items: (conversation id, Skeleton). Returns (answered by id, failures id -> (reason, detail)).

    Round r renders every still-active conversation's history (its own answers so far + user turn r) with
    the generation prompt and generates assistant turn r for all of them in one backend call."""
    r = cfg.regen
    done = {cid: Answered([], [], []) for cid, _ in items}
    failures: dict[str, tuple[str, str]] = {}
    active = list(items)
    turn = 0
    while active:
        todo, prompts, limits, seeds = [], [], [], []
        for cid, sk in active:
            if len(sk.users) <= turn:
                continue
            ids = prompt_ids(tokenizer, sk.history(done[cid].answers), enable_thinking=cfg.target.enable_thinking)
            room = r.max_model_len - len(ids)
            if room < 1:
                failures[cid] = ("context_overflow",
                                 f"turn {turn}: prompt has {len(ids)} tokens, regen.max_model_len is {r.max_model_len}")
                continue
            todo.append((cid, sk))
            prompts.append(ids)
            limits.append(min(r.max_new_tokens, room))
            seeds.append(request_seed(r.seed, cid, turn))
        if not todo:
            break
        gens = _generate_isolating_failures(generator, todo, prompts, limits, seeds, failures, turn)
        todo = [item for item in todo if item[0] not in failures]
        for (cid, _), gen in zip(todo, gens):
            body = gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids
            text = tokenizer.decode(body, skip_special_tokens=False)
            a = done[cid]
            a.answers.append(strip_reasoning(text) if r.strip_reasoning else text)
            a.finish_reasons.append(gen.finish_reason)
            a.generated_tokens.append(len(gen.token_ids))
        active = todo
        turn += 1
    return {cid: a for cid, a in done.items() if cid not in failures}, failures


def _generate_isolating_failures(generator, todo, prompts, limits, seeds, failures, turn):
    """One backend call for the round; if it raises, retry request by request and record the requests
    that still fail as 'generation_error' (returns the generations of the others, in order). If every
    request fails the problem is not the input: re-raise. Memory running out is never isolated: re-raised at once."""
    try:
        return generator.generate(prompts, limits, seeds)
    except Exception as batch_error:  # noqa: BLE001 - isolate the bad request, keep the job alive
        if is_out_of_memory(batch_error):
            raise  # no request's fault: the stage stops (finished units kept), one line says what to lower
        log.warning("regen: a batch of %d failed (%s); retrying one by one", len(todo), batch_error)
        gens, last = [], batch_error
        for (cid, _), p, m, s in zip(todo, prompts, limits, seeds):
            try:
                gens.append(generator.generate([p], [m], [s])[0])
            except Exception as e:  # noqa: BLE001
                failures[cid] = ("generation_error", f"turn {turn}: {type(e).__name__}: {e}"[:300])
                last = e
        if not gens:
            raise last
        return gens


def _with_regen_metadata(metadata: str | None, info: dict) -> str:
    try:
        meta = json.loads(metadata) if metadata else {}
        if not isinstance(meta, dict):
            meta = {"curate": meta}
    except json.JSONDecodeError:
        meta = {"curate_raw": metadata}
    meta["regen"] = info
    return json.dumps(meta, ensure_ascii=False)


class BackendClock:
    """The generator, its `generate` calls timed: `seconds` is the time a unit spent in the backend, the rest of
    the unit's time is the host's (rendering prompts, decoding answers, writing the shard). `compile_seconds` and
    `graphs_captured`: what of it went to torch.compile (recompilations included) and how many CUDA graphs it
    captured (a unit much slower than the others that compiled or captured was paying for a new shape). `decode`:
    the unit's share of the decode loop's own counters where the backend keeps some (`decode_stats()`: the
    continuous loop's steps, rows x steps, tokens, prefills and GPU milliseconds by part), else empty."""

    def __init__(self, generator):
        self.generator, self.seconds, self.compile_seconds, self.graphs_captured = generator, 0.0, 0.0, 0
        self.decode: dict[str, float] = {}

    def generate(self, prompts, max_new_tokens, seeds=None):
        from pipeline.cuda_graphs import GRAPH_LOG, compile_totals

        counters = getattr(self.generator, "decode_stats", dict)
        before = counters()
        compiled, captured, t0 = compile_totals()[1], GRAPH_LOG.captured, time.perf_counter()
        try:
            return self.generator.generate(prompts, max_new_tokens, seeds)
        finally:
            self.seconds += time.perf_counter() - t0
            self.compile_seconds += compile_totals()[1] - compiled
            self.graphs_captured += GRAPH_LOG.captured - captured
            for key, value in counters().items():
                self.decode[key] = round(self.decode.get(key, 0) + value - before.get(key, 0), 3)


def process_unit(unit: Unit, curate: StageDir, stage: StageDir, generator, tokenizer, cfg: RunConfig) -> dict:
    """Regenerate one unit and record it (parquet + sidecar). Returns the sidecar record."""
    t0 = time.time()
    backend = BackendClock(generator)
    rows = [row for name, lo, hi in unit.segments for row in read_rows(curate, name, lo, hi)]
    n = samples_per_conversation(cfg)
    formats = cfg.regen.prompt_formats or {}
    failures: dict[str, tuple[str, str]] = {}
    items = []  # (sample id, sample number k, skeleton, curated row)
    for row in rows:
        try:
            sk = skeleton(row["messages"] or [])
        except MalformedConversation as e:
            for k in range(n):
                failures[response_id(row["id"], k, n)] = (e.reason, e.detail)
            continue
        if cfg.regen.backend == "none" and not any(m["role"] == "assistant" for m in row["messages"]):
            failures[row["id"]] = ("no_answer", "regen.backend is 'none' and the conversation has no assistant turn")
            continue
        for k in range(n):
            items.append((response_id(row["id"], k, n), k, formatted(sk, formats.get(row["source"]), k), row))

    out_rows = []
    if cfg.regen.backend == "none":
        for _, _, _, row in items:
            meta = _with_regen_metadata(row["metadata"], {"backend": "none", "off_policy": True})
            out_rows.append({**row, "metadata": meta})
        answered: dict[str, Answered] = {}
    else:
        answered, gen_failures = regenerate(backend, tokenizer, [(sid, sk) for sid, _, sk, _ in items], cfg)
        failures.update(gen_failures)
        for sid, k, sk, row in items:
            a = answered.get(sid)
            if a is None:
                continue
            info = {"backend": cfg.regen.backend, "finish_reasons": a.finish_reasons,
                    "generated_tokens": a.generated_tokens}
            if n > 1:
                info["sample"] = k
            out_rows.append({"id": sid, "source": row["source"], "messages": sk.conversation(a.answers),
                             "metadata": _with_regen_metadata(row["metadata"], info)})

    path = stage.shard_path(unit.name, "parquet")
    write_conversations(path, out_rows)
    reasons = Counter(reason for reason, _ in failures.values())
    return stage.finish_unit(
        unit.name, [path],
        rows=len(rows) * n, written=len(out_rows), failed=dict(reasons),
        failures=[{"id": cid, "reason": reason, "detail": detail} for cid, (reason, detail) in failures.items()],
        turns=sum(len(a.answers) for a in answered.values()),
        truncated_turns=sum(f == "length" for a in answered.values() for f in a.finish_reasons),
        generated_tokens=sum(sum(a.generated_tokens) for a in answered.values()),
        seconds=round(time.time() - t0, 3), backend_seconds=round(backend.seconds, 3),
        compile_seconds=round(backend.compile_seconds, 3), graphs_captured=backend.graphs_captured,
        **({"decode": backend.decode} if backend.decode else {}),
    )


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def samples_per_conversation(cfg: RunConfig) -> int:
    return 1 if cfg.regen.backend == "none" else cfg.regen.samples_per_prompt


# a regen unit's sidecar (pipeline/records.py shape), beside the files of every sidecar
SIDECAR = {"written": INT, "failed": COUNTS, "failures": LIST, "turns": INT, "truncated_turns": INT,
           "generated_tokens": INT, "seconds": NUMBER, "backend_seconds": Optional(NUMBER),  # (older sidecars: none)
           "compile_seconds": Optional(NUMBER), "graphs_captured": Optional(INT), "decode": Optional(OBJECT)}


def _counts(units: list[Unit], done: dict[str, dict], total: int, n: int) -> dict:
    """Counts in samples: `total` curated train conversations with `n` samples each."""
    counts = Counter({"input": total * n, "skipped.max_samples": (total - sum(u.rows for u in units)) * n, "written": 0,
                      "failed": 0, "turns": 0, "truncated_turns": 0, "generated_tokens": 0})
    for u in units:
        rec = done[u.name]
        counts["written"] += rec["written"]
        for reason, failed in rec["failed"].items():
            counts[f"failed.{reason}"] += failed
            counts["failed"] += failed
        for key in ("turns", "truncated_turns", "generated_tokens"):
            counts[key] += rec[key]
    if counts["written"] + counts["failed"] + counts["skipped.max_samples"] != total * n:
        raise StageError(f"regen accounting broken: {dict(counts)} does not add up to {total} x {n} inputs")
    return dict(counts)


def _total(done: dict[str, dict], units: list[Unit], key: str):
    """The units' sum of a sidecar field, None when a unit lacks it (written by an older version)."""
    values = [done[u.name].get(key) for u in units]
    return None if None in values else round(sum(values), 3)


def finalize_regen(cfg: RunConfig, *, stage: StageDir, units: list[Unit], total: int, config_hash: str,
                   fingerprint: dict, curated: CuratedData, started: float) -> dict | None:
    """Write the manifest iff every unit (of every rank) is done; None otherwise."""
    done = stage.done_units(SIDECAR)
    missing = [u.name for u in units if u.name not in done]
    if missing:
        log.info("regen: %d of %d units still missing (e.g. %s): manifest not written yet",
                 len(missing), len(units), missing[:3])
        return None
    counts = _counts(units, done, total, samples_per_conversation(cfg))
    seconds = sum(done[u.name]["seconds"] for u in units)
    backend, compiling, captures = (_total(done, units, key) for key in
                                    ("backend_seconds", "compile_seconds", "graphs_captured"))
    examples = [f for u in units for f in done[u.name]["failures"]][:MAX_FAILURE_EXAMPLES]
    manifest = stage.write_manifest(
        config_hash=config_hash, fingerprint=fingerprint, inputs={"curate": curated.ref()}, counts=counts,
        started=started,
        extra={"failure_examples": examples, "generation_seconds": round(seconds, 3),
               "generated_tokens_per_s": round(counts["generated_tokens"] / seconds, 1) if seconds else None,
               "backend_seconds": backend, "compile_seconds": compiling, "graphs_captured": captures},
    )
    where = (f" in {seconds:.0f} s ({backend:.0f} s in the backend, the rest on the host)"
             if backend is not None and counts["generated_tokens"] else "")
    summary("regen", f"{counts['written']} written, {counts['failed']} failed, "
                     f"{counts['skipped.max_samples']} skipped of {counts['input']} samples; "
                     f"{counts['generated_tokens']} tokens generated{where}")
    return manifest


def build_generator(cfg: RunConfig, location: str, tokenizer, stop_ids: Sequence[int]) -> Generator:
    """The backend `regen.backend` names (`hf` or `vllm`), loaded and ready ('none' has no generator)."""
    sampling = Sampling(cfg.regen.temperature, cfg.regen.top_p, cfg.regen.top_k)
    if cfg.regen.backend == "hf":
        from pipeline.regen.hf import HFGenerator as backend
    elif cfg.regen.backend == "vllm":
        from pipeline.regen.vllm import VLLMGenerator as backend
    else:
        raise ValueError(f"regen.backend {cfg.regen.backend!r} has no generator")
    return backend.load(location, cfg.target, cfg.regen, tokenizer=tokenizer, stop_ids=stop_ids, sampling=sampling)


def unit_names(cfg: RunConfig) -> list[str]:
    """Every unit of this config's regen run, in the order ranks slice them (`drafter regen --merge` checks them)."""
    units, _ = plan_units(StageDir(cfg.run_dir, "curate"), cfg.regen.shard_size,
                          cfg.regen.max_samples)
    return [u.name for u in units]


def run_regen(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    """Regenerate this rank's units; the rank that completes the last unit writes the manifest.
    Returns the manifest, or this rank's summary while other ranks' units are missing (`StageDir.rank_summary`).
    Tokenize is the next stage (`drafter regen` runs it after)."""
    started = time.time()
    curated = curate_outputs(cfg.run_dir)
    curate = StageDir(cfg.run_dir, "curate")
    stage = StageDir(cfg.run_dir, "regen")
    target = open_target(cfg.target, cfg.cache_dir)
    tokenizer = target.tokenizer
    fingerprint = regen_fingerprint(cfg, target)
    config_hash, settings = regen_config_record(cfg, curated)
    if cfg.regen.backend == "none":
        log.warning("regen.backend is 'none': keeping the dataset's answers (off-policy data)")

    if stage.finished_with(config_hash, force=force):
        return stage.manifest()
    units, total = plan_units(curate, cfg.regen.shard_size, cfg.regen.max_samples)  # before anything is written
    if not stage.begin(config_hash, force=force, ranks=ranks, settings=settings):
        return stage.manifest()
    mine = units_for_rank(units, ranks)
    todo = [u for u in mine if not stage.unit_done(u.name, fields=SIDECAR)]
    log.info("regen: %d units in all, %d for rank %d/%d, %d to do (backend %s)",
             len(units), len(mine), ranks.rank, ranks.world_size, len(todo), cfg.regen.backend)
    generator = None
    if todo and cfg.regen.backend != "none":
        generator = build_generator(cfg, target.location, tokenizer, end_of_turn_ids(tokenizer, target.location))
    bar = progress(total=len(todo), desc=f"regen rank {ranks.rank}", unit="shard")
    for unit in todo:
        rec = process_unit(unit, curate, stage, generator, tokenizer, cfg)
        bar.set_postfix(tok_s=f"{rec['generated_tokens'] / max(rec['seconds'], 1e-9):.0f}", refresh=False)
        bar.update(1)
    bar.close()
    if generator is not None:
        generator.close()
    rank_summary = stage.rank_summary(ranks, [u.name for u in mine], started) if ranks.is_split else None
    manifest = finalize_regen(cfg, stage=stage, units=units, total=total, config_hash=config_hash,
                              fingerprint=fingerprint, curated=curated, started=started)
    return manifest if manifest is not None else rank_summary
