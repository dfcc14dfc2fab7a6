"""The eval stage's units of work and their files.

    <benchmark>.ar              AR once per prompt: the speedup baseline, measured in the same run
    <benchmark>.chain           DFlash: one drafted chain of B-1 tokens per round
    <benchmark>.ddtree-b<N>     DDTree with node budget N, for every N in eval.budgets

A unit decodes every prompt of its benchmark; each finished prompt is appended to the unit's journal
(`pipeline.files.Journal`, fsync'd), and once every prompt is in, `write_unit` writes the unit's shard (one JSON line
per response, `eval.metrics.ResponseRecord`, in prompt order) and its sidecar, and removes the journal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eval.metrics import ResponseRecord
from eval.prompts import EvalPrompt
from eval.report import cell_label
from pipeline.config import RunConfig
from pipeline.errors import DamagedFile
from pipeline.files import REDO_UNIT, AtomicFile, Journal
from pipeline.records import COUNTS, INT, NUMBER, OBJECT, STR, Optional, check
from pipeline.log import get_logger
from pipeline.stage_dir import StageDir

log = get_logger("eval")


# One response as a unit's journal and shard hold it (eval.metrics.ResponseRecord; pipeline/records.py shape), and
# one journal entry: a finished prompt's responses and notes.
RESPONSE_FIELDS = {"prompt_id": STR, "turn": INT, "prompt_tokens": INT, "num_new_tokens": INT, "num_rounds": INT,
                   "accept_lengths": [INT], "draft_depths": [INT], "decode_seconds": NUMBER, "prefill_seconds": NUMBER,
                   "phase_seconds": Optional(OBJECT), "output_ids": Optional([INT])}
JOURNAL_ENTRY = {"prompt_id": STR, "responses": [RESPONSE_FIELDS], "skipped": COUNTS, "verify_paths": [STR],
                 "draft_paths": [Optional(STR)], "timed": Optional([NUMBER])}


def open_journal(stage: StageDir, unit: "Unit") -> Journal:
    """The unit's journal (the prompts finished before a kill), every entry checked."""
    return stage.journal(unit.name, JOURNAL_ENTRY)


@dataclass(frozen=True)
class Unit:
    benchmark: str
    method: str  # "ar" | "chain" | "ddtree"
    budget: int | None = None

    @property
    def name(self) -> str:
        return f"{self.benchmark}.{self.method}" + (f"-b{self.budget}" if self.budget is not None else "")

    @property
    def label(self) -> str:
        return cell_label(self.method, self.budget)


def plan_units(cfg: RunConfig, tree_reason: str | None) -> tuple[list[Unit], list[dict]]:
    """Every unit of this eval, and the (method, budget) pairs skipped with their reason."""
    units, skipped = [], []
    methods = list(dict.fromkeys(cfg.eval.methods))
    budgets = list(dict.fromkeys(cfg.eval.budgets))
    if "ddtree" in methods and tree_reason:
        skipped = [{"method": "ddtree", "budget": b, "reason": tree_reason} for b in budgets]
    for bench in cfg.eval.benchmarks:
        for method in methods:
            if method == "ddtree":
                if not tree_reason:
                    units += [Unit(bench.name, "ddtree", b) for b in budgets]
            else:
                units.append(Unit(bench.name, method))
    return units, skipped


def interleaved(units: list[Unit], prompts: list[EvalPrompt], done: dict[Unit, set[str]]):
    """The timing order of one benchmark's units: (prompt, [units to decode it, in this order]) per prompt that some
    unit has not journaled (`done`: unit -> journaled prompt ids), the units rotating by one from prompt to prompt
    (prompt i starts with unit i mod n), so no method is always timed first or last after another's decode."""
    for i, prompt in enumerate(prompts):
        k = i % len(units) if units else 0
        order = [u for u in units[k:] + units[:k] if prompt.id not in done[u]]
        if order:
            yield prompt, order


def write_unit(stage: StageDir, unit: Unit, prompts: list[EvalPrompt], journal: Journal, **notes) -> None:
    """The unit's shard from its journal (one entry per prompt, written as each prompt finished), in prompt order;
    then its sidecar; then the journal goes."""
    entries = {e["prompt_id"]: e for e in journal.items}
    records = [ResponseRecord.from_dict(r) for p in prompts for r in entries[p.id]["responses"]]
    skipped: dict[str, int] = {}
    for e in entries.values():
        for reason, n in e["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
    path = stage.shard_path(unit.name, "jsonl")
    with AtomicFile(path) as tmp:
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r.to_dict()) + "\n")
    spans = [e["timed"] for e in entries.values() if e.get("timed")]
    stage.finish_unit(unit.name, [path], responses=len(records), new_tokens=sum(r.num_new_tokens for r in records),
                      skipped=skipped, verify_paths=sorted({v for e in entries.values() for v in e["verify_paths"]}),
                      draft_paths=sorted({v for e in entries.values() for v in e["draft_paths"] if v}),
                      timed=[min(s[0] for s in spans), max(s[1] for s in spans)] if spans else None, **notes)
    journal.remove()
    log.info("%s: %d responses, %d new tokens", unit.name, len(records), sum(r.num_new_tokens for r in records))


def read_unit(stage: StageDir, unit: Unit) -> list[ResponseRecord]:
    """The responses of a finished unit's shard, each checked (a damaged line is a DamagedFile naming it)."""
    path = stage.shard_path(unit.name, "jsonl")
    records = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(ResponseRecord.from_dict(check(json.loads(line), RESPONSE_FIELDS)))
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, a FieldProblem
            raise DamagedFile(path, f"line {number}: {str(e)[:200]}", REDO_UNIT.replace(
                "Delete it", f"Delete it and {stage.sidecar_path(unit.name).name}")) from None
    return records
