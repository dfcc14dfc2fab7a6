"""tokenize: regenerated conversations -> `input_ids` + assistant-only `loss_mask`, in the target's template.

    runs/<run>/regen/shards/NNNNN.parquet  ->  runs/<run>/tokenize/shards/NNNNN.parquet
    columns: id string, input_ids list<int32>, loss_mask list<uint8>, num_tokens int32, num_loss_tokens int32
    parquet schema metadata b"drafter.fingerprint": the stage fingerprint as JSON

The loss mask is found by rendering, not by offsets (assistant_loss_mask): for assistant turn k,
    prompt_k = render(messages before turn k, generation prompt)   # what the target saw
    full_k   = render(messages through turn k)                    # prompt + the turn, closed by the template
tokens(prompt_k) must be a prefix of tokens(full_k) (else the sample is dropped: template_not_prefix_stable),
and should extend the sequence built so far. Where it does not, the template re-renders earlier turns (Qwen3
with thinking off writes the empty think block on the last assistant turn only, so a past turn renders without
it), and no single sequence holds every turn as the target saw it. With `tokenize.unstable_template: split` (the
default) a new sample starts at such a turn k: its tokens are tokens(prompt_k) (the history as the target saw
it when it wrote turn k, unsupervised) followed by turn k and every later turn that extends it. Sample ids: the
first sample keeps the conversation's id, a sample starting at assistant turn k is `<id>@t<k>`
(pipeline/sample_ids.py). With `drop` the conversation is dropped (template_not_prefix_stable), as every
conversation is when the generation prompt itself is not a prefix of the turn. Every supervised token thus has
exactly the context the target generated it in.
The turn's tokens are tokens(full_k)[len(tokens(prompt_k)):], supervised up to and including the first
end-of-turn id (what the target generated, e.g. `...<|im_end|>`), unsupervised after it (template glue
such as the newline after <|im_end|>). A turn cut by max_new_tokens (regen metadata finish 'length')
keeps its end-of-turn id unsupervised: the target did not write it there.

Then: truncate to `tokenize.max_len`; drop samples with fewer than `tokenize.min_loss_tokens` supervised tokens
(unset: samples with none). Two drafter blocks of supervision (`RunConfig.min_loss_tokens`) is a training rule,
applied by train/data.py `RunPlan`, so that no drafter setting is part of this stage's config hash. Every drop is
counted under its reason, and every extra sample a split made under `split`: input + split = written +
dropped.<reason>.
"""

from __future__ import annotations

import ctypes
import functools
import json
import multiprocessing
import os
import signal
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import RunConfig, config_record
from pipeline.log import get_logger, progress, summary
from pipeline.regen.conversation import encode_chat, end_of_turn_ids
from pipeline.rejects import Rejected
from pipeline.errors import StageError
from pipeline.files import AtomicFile
from pipeline.manifests import RegeneratedData, regen_outputs
from pipeline.records import COUNTS, INT, LIST
from pipeline.stage_dir import RankInfo, StageDir, check_fingerprint, units_for_rank
from pipeline.sample_ids import turn_id
from pipeline.target import OpenedTarget, open_target, render_chat

log = get_logger("tokenize")

TOKENIZED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
])
FINGERPRINT_KEY = b"drafter.fingerprint"
MAX_DROP_EXAMPLES = 20


class Dropped(Rejected):
    """A sample that cannot be tokenized faithfully; `reason` is its counter name."""


@dataclass
class TurnSample:
    """One tokenized sample of a conversation: input_ids [S], loss_mask [S] in {0,1}, and the index (among the
    conversation's assistant turns) of the first turn it supervises."""

    input_ids: list[int]
    loss_mask: list[int]
    first_turn: int

    def sample_id(self, conversation_id: str) -> str:
        """The conversation's id for its first sample, `<id>@t<k>` for one that starts at assistant turn k."""
        return turn_id(conversation_id, self.first_turn)


def assistant_samples(tokenizer, messages: list[dict], *, enable_thinking: bool, end_of_turn: set[int],
                      ended: list[bool] | None = None, split: bool = True) -> list[TurnSample]:
    """messages -> the conversation's samples (module docstring): one, unless the template re-renders earlier
    turns and `split` is on, then one per run of turns that extend each other. In each, loss_mask is 1 exactly on
    its assistant turns' tokens including each turn's end-of-turn id, except where `ended[k]` is False (turn k was
    cut by max_new_tokens: the target never wrote its end-of-turn id, the template did). Raises Dropped
    (no_assistant_turn, template_not_prefix_stable, no_end_of_turn_token)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise Dropped("no_assistant_turn")
    if ended is None or len(ended) != len(turns):
        ended = [True] * len(turns)
    samples: list[TurnSample] = []
    for k, i in enumerate(turns):
        prompt = encode_chat(tokenizer, render_chat(tokenizer, messages[:i], add_generation_prompt=True,
                                                    enable_thinking=enable_thinking))
        full = encode_chat(tokenizer, render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False,
                                                  enable_thinking=enable_thinking))
        if full[: len(prompt)] != prompt:
            raise Dropped("template_not_prefix_stable", f"turn {k}: the generation prompt is not a prefix of the turn")
        if not samples or prompt[: len(samples[-1].input_ids)] != samples[-1].input_ids:
            if samples and not split:
                raise Dropped("template_not_prefix_stable",
                              f"turn {k}: the template re-renders earlier turns differently")
            samples.append(TurnSample([], [], k))  # a new sample: this turn's context as the target saw it
        sample = samples[-1]
        turn = full[len(prompt):]
        end = next((j for j, t in enumerate(turn) if t in end_of_turn), None)
        if end is None:
            raise Dropped("no_end_of_turn_token", f"turn {k}: no end-of-turn id {sorted(end_of_turn)} in the turn")
        sample.loss_mask += ([0] * (len(prompt) - len(sample.input_ids)) + [1] * end + [int(ended[k])]
                             + [0] * (len(turn) - end - 1))
        sample.input_ids = full
    return samples


def assistant_loss_mask(tokenizer, messages: list[dict], *, enable_thinking: bool, end_of_turn: set[int],
                        ended: list[bool] | None = None) -> tuple[list[int], list[int]]:
    """messages -> (input_ids [S], loss_mask [S]) of the whole conversation as ONE sample (`assistant_samples`
    without splitting): Dropped(template_not_prefix_stable) where the template re-renders earlier turns."""
    (sample,) = assistant_samples(tokenizer, messages, enable_thinking=enable_thinking, end_of_turn=end_of_turn,
                                  ended=ended, split=False)
    return sample.input_ids, sample.loss_mask


def turn_ended(row: dict) -> list[bool] | None:
    """Per assistant turn: did the target end it itself (finish 'stop')? From regen's metadata; None when
    unknown (dataset answers of regen.backend=none end where the dataset ends them)."""
    try:
        reasons = json.loads(row.get("metadata") or "{}").get("regen", {}).get("finish_reasons")
    except (json.JSONDecodeError, AttributeError):
        return None
    return [r == "stop" for r in reasons] if reasons else None


def tokenize_fingerprint(cfg: RunConfig, target: OpenedTarget) -> dict:
    """What extract/train must agree with: the target, its tokenizer + template, thinking mode, max_len."""
    return {
        **target.fingerprint,
        "enable_thinking": cfg.target.enable_thinking,
        "max_len": cfg.tokenize.max_len,
    }


def shard_fingerprint(path) -> dict:
    """The fingerprint stored in a tokenized shard's parquet metadata."""
    meta = pq.read_schema(path).metadata or {}
    if FINGERPRINT_KEY not in meta:
        raise StageError(f"{path} has no {FINGERPRINT_KEY.decode()} metadata: not a tokenize shard")
    return json.loads(meta[FINGERPRINT_KEY])


# a tokenize unit's sidecar (pipeline/records.py shape), beside the files of every sidecar
SIDECAR = {"input": INT, "split": INT, "written": INT, "truncated": INT, "tokens": INT, "loss_tokens": INT,
           "dropped": COUNTS, "drop_examples": LIST}


def tokenize_unit(unit: str, regen: StageDir, stage: StageDir, tokenizer, cfg: RunConfig, *,
                  end_of_turn: set[int], fingerprint: dict) -> dict:
    rows = regen.read_shard(regen.shard_path(unit, "parquet")).to_pylist()  # verified by run_tokenize
    out, drops, examples = [], Counter(), []
    truncated = 0
    floor, max_len = cfg.tokenize.min_loss_tokens or 1, cfg.tokenize.max_len
    split = cfg.tokenize.unstable_template == "split"
    extra = 0  # samples beyond one per conversation, made by splits

    def drop(sample_id: str, e: Dropped) -> None:
        drops[e.reason] += 1
        if len(examples) < MAX_DROP_EXAMPLES:
            examples.append({"id": sample_id, "reason": e.reason, "detail": e.detail})

    for row in rows:
        try:
            samples = assistant_samples(tokenizer, row["messages"] or [], end_of_turn=end_of_turn,
                                        enable_thinking=cfg.target.enable_thinking, ended=turn_ended(row), split=split)
        except Dropped as e:
            drop(row["id"], e)
            continue
        extra += len(samples) - 1
        for sample in samples:
            sid, ids, mask = sample.sample_id(row["id"]), sample.input_ids, sample.loss_mask
            if len(ids) > max_len:
                ids, mask = ids[:max_len], mask[:max_len]
                truncated += 1
            if sum(mask) < floor:
                drop(sid, Dropped("too_few_loss_tokens",
                                  f"{sum(mask)} supervised tokens < tokenize.min_loss_tokens {floor}"))
                continue
            out.append({"id": sid, "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids),
                        "num_loss_tokens": sum(mask)})
    table = pa.Table.from_pylist(out, schema=TOKENIZED_SCHEMA).replace_schema_metadata(
        {FINGERPRINT_KEY: json.dumps(fingerprint, sort_keys=True)})
    path = stage.shard_path(unit, "parquet")
    with AtomicFile(path) as tmp:
        pq.write_table(table, tmp)
    return stage.finish_unit(
        unit, [path], input=len(rows), split=extra, written=len(out), dropped=dict(drops), drop_examples=examples,
        truncated=truncated, tokens=sum(r["num_tokens"] for r in out),
        loss_tokens=sum(r["num_loss_tokens"] for r in out),
    )


_WORK = None  # a forked worker's unit function (inherited from the stage process, never pickled)


def _start_worker(work) -> None:
    """A worker process's start: dies with the stage process (a kill -9 of the stage leaves no worker writing
    units behind it), then keeps `work`."""
    global _WORK
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the stage died before the line above
        os._exit(1)
    _WORK = work


def _run_unit(unit: str) -> None:
    _WORK(unit)


def _in_worker_processes(work, todo: list[str], workers: int, bar) -> None:
    """`work(unit)` for every unit of `todo` in `workers` forked processes, one unit at a time each (each unit is
    written atomically with its sidecar by the process that made it, as in the stage process). The first unit that
    fails stops the rest and is raised."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker,
                               initargs=(work,))
    try:
        for done in as_completed([pool.submit(_run_unit, unit) for unit in todo]):
            done.result()
            bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _finalize(stage: StageDir, units: list[str], *, regenerated: RegeneratedData, config_hash: str, fingerprint: dict,
              started: float) -> dict | None:
    done = stage.done_units(SIDECAR)
    missing = [u for u in units if u not in done]
    if missing:
        log.info("tokenize: %d of %d units still missing: manifest not written yet", len(missing), len(units))
        return None
    counts = Counter(dict.fromkeys(("input", "split", "written", "dropped", "truncated", "tokens", "loss_tokens"), 0))
    for u in units:
        rec = done[u]
        for key in ("input", "split", "written", "truncated", "tokens", "loss_tokens"):
            counts[key] += rec[key]
        for reason, n in rec["dropped"].items():
            counts[f"dropped.{reason}"] += n
            counts["dropped"] += n
    if counts["written"] + counts["dropped"] != counts["input"] + counts["split"]:
        raise StageError(f"tokenize accounting broken: {dict(counts)}")
    examples = [e for u in units for e in done[u]["drop_examples"]][:MAX_DROP_EXAMPLES]
    manifest = stage.write_manifest(config_hash=config_hash, fingerprint=fingerprint,
                                    inputs={"regen": regenerated.ref()}, counts=dict(counts), started=started,
                                    extra={"drop_examples": examples})
    split = f" (+{counts['split']} from turn splits)" if counts["split"] else ""
    summary("tokenize", f"{counts['written']} samples, {counts['tokens']} tokens ({counts['loss_tokens']} supervised), "
                        f"{counts['dropped']} dropped of {counts['input']} conversations{split}")
    return manifest


def unit_names(cfg: RunConfig) -> list[str]:
    """Every unit of this config's tokenize run (one per regenerated shard), in the order ranks slice them."""
    return regen_outputs(cfg.run_dir).units


def run_tokenize(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    """Tokenize this rank's regen shards; the rank that completes the last one writes the manifest. Returns the
    manifest, or this rank's summary while other ranks' units are missing."""
    started = time.time()
    regen = StageDir(cfg.run_dir, "regen")
    regenerated = regen_outputs(cfg.run_dir)
    target = open_target(cfg.target, cfg.cache_dir)
    tokenizer = target.tokenizer
    fingerprint = tokenize_fingerprint(cfg, target)
    check_fingerprint({k: fingerprint[k] for k in ("target", "tokenizer", "enable_thinking")},
                      regenerated.fingerprint, what="the regenerated data (regen stage)", producer="drafter regen")
    tokenize_settings = {"max_len": cfg.tokenize.max_len, "min_loss_tokens": cfg.tokenize.min_loss_tokens,
                         "unstable_template": cfg.tokenize.unstable_template}
    config_hash, settings = config_record(target=cfg.target, tokenize=tokenize_settings,
                                          regen_output=regenerated.config_hash)
    stage = StageDir(cfg.run_dir, "tokenize")
    units = regenerated.units
    mine = units_for_rank(units, ranks)
    if stage.finished_with(config_hash, force=force):
        return stage.manifest()
    for unit in mine:  # the bytes regen wrote, before anything is written (a damaged page can still decode)
        regen.verify_shard(regen.shard_path(unit, "parquet"))
    if not stage.begin(config_hash, force=force, ranks=ranks, settings=settings):
        return stage.manifest()
    todo = [u for u in mine if not stage.unit_done(u, fields=SIDECAR)]
    end_of_turn = set(end_of_turn_ids(tokenizer, target.location))
    work = functools.partial(tokenize_unit, regen=regen, stage=stage, tokenizer=tokenizer, cfg=cfg,
                             end_of_turn=end_of_turn, fingerprint=fingerprint)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(todo), cfg.tokenize.workers or cores)
    with progress(total=len(todo), desc=f"tokenize rank {ranks.rank}", unit="shard") as bar:
        if workers <= 1:
            for unit in todo:
                work(unit)
                bar.update(1)
        else:
            _in_worker_processes(work, todo, workers, bar)
    rank_summary = stage.rank_summary(ranks, mine, started) if ranks.is_split else None
    manifest = _finalize(stage, units, regenerated=regenerated, config_hash=config_hash, fingerprint=fingerprint,
                         started=started)
    return manifest if manifest is not None else rank_summary
