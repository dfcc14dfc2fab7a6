"""`drafter eval`: AR / chain / DDTree decoding of benchmark prompts with the target and the trained drafter,
scored with eval.metrics and written as runs/<run>/eval/report.{json,md,html}.

`run_eval` reads top to bottom: the target and the drafter, refused where they do not fit (eval/drafter_inputs.py)
-> stage dir -> this rank's units (eval/units.py: `<benchmark>.ar`, `.chain`, `.ddtree-b<N>`), which decode every
prompt of their benchmark conversation by conversation (eval/conversation.py) with the engine (eval/engine/),
interleaved: each prompt by every unit in turn, so machine noise falls on AR and every method alike -> once
every unit of every rank is done: the overlap and lossless checks (eval/lossless.py), the report (eval/report.py),
the W&B run (eval/wandb_log.py) and the manifest.

Resume is per prompt (kill -9 safe): a finished prompt's responses are appended to the unit's journal, so no
journaled prompt is decoded again; the unit's shard is written from its journal once every prompt is in. Before a
benchmark's first timed prompt every CUDA graph its units' prompts can use is captured (`eval.engine.decode.warm_up`),
so timings are steady state. Units split over ranks (`--rank/--world-size`); whichever rank finishes last, or
`drafter eval --merge`, aggregates the sidecar'd shards into the report and writes the manifest.
"""

from __future__ import annotations

import time
from pathlib import Path

from dflash_model.card import CARD_NAME, write_card_results
from eval.conversation import longest_context, response_record, run_conversation, stop_token_ids
from eval.drafter_inputs import (check_drafter_fits_target, check_drafter_tokenizer, drafter_dir, drafter_sha,
                                 load_drafter, trained_drafter)
from eval.engine.cache.interface import tree_unsupported_reason
from eval.lossless import check_lossless
from eval.metrics import ResponseRecord, speedup, summarize
from eval.overlap import eval_shingles, find_overlap, summarize_overlap, training_prompts
from eval.prompts import LoadedBenchmark, benchmarks_in_use, chat_prompt_ids, format_content
from eval.report import REPORT_FILES, card_results, cell_label, read_report, tau_table, write_report
from eval.units import Unit, interleaved, open_journal, plan_units, read_unit, write_unit
from eval.wandb_log import log_eval_run
from dflash_model.export import read_export
from pipeline.config import ConfigError, RunConfig, config_record
from pipeline.errors import StageError
from pipeline.log import get_logger, progress, summary
from pipeline.manifests import curate_outputs
from pipeline.records import COUNTS, INT, STR, Optional
from pipeline.stage_dir import RankInfo, StageDir, units_for_rank
from pipeline.target import load_target, open_target, text_config

log = get_logger("eval")


def unit_names(cfg: RunConfig) -> list[str]:
    """Every unit of this config's eval, in the order ranks slice them (`drafter eval --merge` checks them)."""
    in_use = benchmarks_in_use(cfg)[0]  # the benchmarks found (the `use` rule), as run_eval plans them
    units, _ = plan_units(in_use, tree_unsupported_reason(open_target(cfg.target, cfg.cache_dir).config))
    return [u.name for u in units]


# an eval unit's sidecar (pipeline/records.py shape), beside the files of every sidecar
SIDECAR = {"responses": INT, "skipped": Optional(COUNTS), "verify_paths": Optional([STR]),
           "draft_paths": Optional([STR]), "graphs_captured_while_timed": Optional(INT)}


def build_report(cfg: RunConfig, stage: StageDir, by_unit: dict[Unit, list[ResponseRecord]], *, block_size: int,
                 header: dict, lossless: dict[str, dict] | None = None) -> dict:
    """Aggregate the units' responses (`read_unit` of every unit) into report.json's dict (every cell's numbers,
    see eval.report). lossless: unit name -> `eval.lossless.lossless_summary` (from `check_lossless`)."""
    sidecars = stage.done_units(SIDECAR)
    cells = []
    for u, recs in by_unit.items():
        ar = by_unit.get(Unit(u.benchmark, "ar"))
        cell = {"benchmark": u.benchmark, "method": u.method, "budget": u.budget, "label": u.label,
                **summarize(recs, max_tau=block_size)}
        cell["speedup"] = speedup(ar, recs) if ar is not None else None
        cell["ar_match"] = None
        if ar is not None and cfg.eval.temperature == 0:
            ar_out = {(r.prompt_id, r.turn): r.output_ids for r in ar}
            matched = [ar_out.get((r.prompt_id, r.turn)) == r.output_ids for r in recs]
            cell["ar_match"] = sum(matched) / len(matched) if matched else None
        cell["lossless"] = (lossless or {}).get(u.name)
        cell["skipped"] = sidecars[u.name].get("skipped", {})
        cell["verify_paths"] = sidecars[u.name].get("verify_paths", [])  # the verify forward the timings come from
        cell["draft_paths"] = sidecars[u.name].get("draft_paths", [])  # and the drafter's forward
        cell["graphs_captured_while_timed"] = sidecars[u.name].get("graphs_captured_while_timed", 0)
        cells.append(cell)
    return {**header, "cells": cells}


def update_card(dpath: Path, report: dict) -> None:
    """The results section of the drafter's model card (README.md beside its weights) from this report, rewritten
    atomically; a card of another kind, or one this user may not write (a hub snapshot), is left alone."""
    try:
        if write_card_results(dpath, card_results(report)):
            log.info("model card results updated: %s", dpath / CARD_NAME)
    except OSError as e:
        log.warning("model card at %s not updated: %s", dpath / CARD_NAME, e)


def check_overlap(cfg: RunConfig, benchmarks: dict[str, LoadedBenchmark]) -> dict | None:
    """report.json's `overlap`: eval prompts whose content this run's curated training prompts contain
    (`eval.overlap`); None when the check is off, a note when this run has no curated training split."""
    if not cfg.eval.overlap_check:
        return None
    curate = StageDir(cfg.run_dir, "curate")
    shards = sorted(curate.shards.glob("train-*.parquet")) if curate.shards.is_dir() else []
    if not shards:
        return {"against": None, "note": f"not checked: no curated training split in {curate.path}"}
    sets = {p.id: eval_shingles(format_content(b.name, t) for t in p.turns)
            for b in benchmarks.values() for p in b.prompts}
    hits = find_overlap(sets, training_prompts(curate, shards))
    train_rows = curate_outputs(cfg.run_dir).train_conversations if curate.is_complete() else None
    out = summarize_overlap(hits, eval_prompts=len(sets), train_conversations=train_rows,
                            against=f"{curate.shards}/train-*.parquet")
    if out["exact"] or out["near"]:
        log.warning("eval prompts found in the training prompts: %d exact, %d near duplicates (e.g. %s)",
                    out["exact"], out["near"], out["examples"][0]["eval_id"])
    return out


def run_eval(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    started = time.time()
    if not cfg.eval.benchmarks:
        raise ConfigError("eval.benchmarks: at least one benchmark is required")
    cfg, benchmarks, data = benchmarks_in_use(cfg)  # found (own file, mirror, cache, hub, held-out split) or why not
    target = open_target(cfg.target, cfg.cache_dir)
    location, tokenizer, target_config = target.location, target.tokenizer, target.config
    tok_fp = target.fingerprint["tokenizer"]
    dpath = drafter_dir(cfg)
    drafter_cfg = read_export(dpath).config  # config, weights and shapes checked before anything is allocated
    trained = trained_drafter(dpath)
    taps = check_drafter_fits_target(drafter_cfg, target_config, trained.layer_ids if trained else None)
    check_drafter_tokenizer(tok_fp, trained, dpath)
    d_sha = drafter_sha(dpath)
    fingerprint = {**target.fingerprint,
                   "drafter": {"path": str(dpath), "sha": d_sha}, "enable_thinking": cfg.target.enable_thinking}
    config_hash, settings = config_record(eval=cfg.eval, target=cfg.target, fingerprint=fingerprint, data=data)

    stage = StageDir(cfg.run_dir, "eval")
    if not stage.begin(config_hash, force=force, ranks=ranks, settings=settings):
        log.info("eval already complete for this config: %s", stage.path)
        report = read_report(stage.path / "report.json")
        summary("eval", "\n" + tau_table(report).markdown())
        return stage.manifest()

    tree_reason = tree_unsupported_reason(target_config)
    units, skipped_methods = plan_units(cfg, tree_reason)
    for s in skipped_methods:
        log.warning("skipping %s: %s", cell_label(s["method"], s["budget"]), s["reason"])
    for lb in benchmarks.values():
        if lb.skipped:
            log.warning("%s: skipped %s of %d records read from %s", lb.name, dict(lb.skipped), lb.read, lb.path)
        if not lb.prompts:
            raise StageError(f"eval benchmark {lb.name!r}: no usable prompt in {lb.path} ({dict(lb.skipped)})")

    mine = units_for_rank(units, ranks)
    todo = [u for u in mine if not stage.unit_done(u.name, fields=SIDECAR)]
    block_size = int(drafter_cfg.get("block_size") or cfg.drafter.block_size)
    for unit in todo:  # the journals of a killed run are read back before any model is loaded
        open_journal(stage, unit)
    if todo:
        _run_units(cfg, stage, todo, benchmarks, location, tokenizer, target_config, dpath, block_size)
    rank_summary = stage.rank_summary(ranks, [u.name for u in mine], started) if ranks.is_split else None

    done = stage.done_units(SIDECAR)
    missing = [u.name for u in units if u.name not in done]
    if missing:
        log.info("rank %d/%d finished its units; %d of %d units still running elsewhere (%s); "
                 "the rank that finishes last writes the report", ranks.rank, ranks.world_size,
                 len(missing), len(units), ", ".join(missing[:4]))
        return rank_summary

    header = {
        "run": cfg.name,
        "target": {"model": cfg.target.model, "location": location, "model_type": fingerprint["target"]["model_type"],
                   "layers": fingerprint["target"]["num_hidden_layers"]},
        "drafter": {"path": str(dpath), "sha": d_sha, "block_size": block_size,
                    "target_layer_ids": taps,
                    "num_layers": drafter_cfg.get("num_hidden_layers")},
        "settings": {"temperature": cfg.eval.temperature, "max_new_tokens": cfg.eval.max_new_tokens,
                     "enable_thinking": cfg.target.enable_thinking, "device": cfg.target.device,
                     "dtype": cfg.target.dtype, "seed": cfg.eval.seed, "budgets": cfg.eval.budgets,
                     "world_size": ranks.world_size},
        "benchmarks": {n: {"path": b.path, "prompts": len(b.prompts), "read": b.read, "skipped": dict(b.skipped),
                           "examples": b.examples} for n, b in benchmarks.items()},
        "data": data,
        "skipped_methods": skipped_methods,
    }
    header["overlap"] = check_overlap(cfg, benchmarks)
    responses = {u: read_unit(stage, u) for u in units}
    lossless = check_lossless(cfg, responses, benchmarks, tokenizer, location)
    report = build_report(cfg, stage, responses, block_size=block_size, header=header, lossless=lossless)
    table = write_report(report, stage.path)
    update_card(dpath, report)
    log_eval_run(cfg, report, stage.path, dpath)
    counts: dict[str, int] = {"units": len(units), "responses": sum(c["responses"] for c in report["cells"]),
                              "new_tokens": sum(c["new_tokens"] for c in report["cells"]),
                              "records_read": sum(b.read for b in benchmarks.values()),
                              "prompts": sum(len(b.prompts) for b in benchmarks.values())}
    for b in benchmarks.values():  # records_read = prompts + dropped.*
        for reason, n in b.skipped.items():
            counts[f"dropped.{reason}"] = counts.get(f"dropped.{reason}", 0) + n
    for c in report["cells"]:  # turns not decoded, summed over units
        for reason, n in c["skipped"].items():
            counts[f"turns_skipped.{reason}"] = counts.get(f"turns_skipped.{reason}", 0) + n
    manifest = stage.write_manifest(config_hash=config_hash, fingerprint=fingerprint, counts=counts, started=started,
                                    inputs={"drafter": {"path": str(dpath), "sha": d_sha}},
                                    extra={"report": list(REPORT_FILES),
                                           "skipped_methods": skipped_methods})
    summary("eval", f"τ (per-response mean) and speedup over AR — {stage.path / 'report.md'}\n{table}")
    return manifest


def _run_units(cfg: RunConfig, stage: StageDir, units: list[Unit], benchmarks: dict[str, LoadedBenchmark],
               location: str, tokenizer, target_config, dpath: Path, block_size: int) -> None:
    """Decode this rank's units benchmark by benchmark, interleaved per prompt (`eval.units.interleaved`): each
    prompt is decoded by every unit of its benchmark in turn (AR, chain, DDTree per budget; the order rotates from
    prompt to prompt), so a slow spell of the machine falls on every method alike instead of on whichever unit ran
    then. Each finished prompt (all its turns) is appended to its unit's journal, so a killed run resumes at the
    first prompt a unit has not journaled. Before the first timed prompt of a benchmark, `eval.engine.decode.warm_up`
    captures every CUDA graph each unit's prompts can need (largest trees first: the shared buffers then never grow
    later and drop graphs) and runs one short decode per unit, so timings are steady state."""
    import torch

    from eval.engine.decode import decode, warm_up
    from pipeline.cuda_graphs import GRAPH_LOG

    target = load_target(location, cfg.target)
    drafter, _ = load_drafter(dpath, target, target.device)
    stop = stop_token_ids(tokenizer, target)
    e, thinking = cfg.eval, cfg.target.enable_thinking
    max_prompt = int(getattr(text_config(target_config), "max_position_embeddings", 1 << 30)) - e.max_new_tokens \
        - block_size
    warm_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Warmup"}], enable_thinking=thinking)
    bar = progress(total=sum(len(benchmarks[u.benchmark].prompts) for u in units), desc="eval", unit="prompt")
    paths: tuple[set, set] = (set(), set())

    def generate_with(unit: Unit):
        @torch.inference_mode()
        def generate(ids: list[int], max_new: int = e.max_new_tokens):
            result = decode(unit.method, target, drafter, ids, max_new_tokens=max_new, budget=unit.budget,
                            temperature=e.temperature, seed=e.seed, stop_token_ids=stop, phase_timing=e.phase_timing,
                            cache_impl=e.target_cache)
            paths[0].add(result.verify_path)
            paths[1].add(result.draft_path)
            return result
        return generate

    for bench in dict.fromkeys(u.benchmark for u in units):
        group = [u for u in units if u.benchmark == bench]
        prompts = benchmarks[bench].prompts
        journals = {u: open_journal(stage, u) for u in group}
        done = {u: {entry["prompt_id"] for entry in journals[u].items} for u in group}
        bar.update(sum(len(done[u]) for u in group))
        todo = [p for p in prompts if any(p.id not in done[u] for u in group)]
        if todo and e.warmup_tokens > 0:
            longest = longest_context(todo, tokenizer, enable_thinking=thinking, max_new_tokens=e.max_new_tokens,
                                      limit=max_prompt + e.max_new_tokens)
            for unit in sorted(group, key=lambda u: (u.method == "ddtree", u.budget or 0, u.method != "ar"),
                               reverse=True):
                with torch.inference_mode():
                    warm_up(unit.method, target, drafter, max_length=longest, budget=unit.budget,
                            temperature=e.temperature, cache_impl=e.target_cache)
                generate_with(unit)(warm_ids, min(e.warmup_tokens, e.max_new_tokens))
        late = {u: 0 for u in group}
        for prompt, order in interleaved(group, prompts, done):
            for unit in order:
                paths[0].clear()
                paths[1].clear()
                captured, started = GRAPH_LOG.captured, time.time()
                responses, skipped = [], {}
                for turn, item in enumerate(run_conversation(prompt, tokenizer, generate_with(unit),
                                                             enable_thinking=thinking, max_prompt_tokens=max_prompt)):
                    if isinstance(item, str):
                        skipped[item] = skipped.get(item, 0) + 1
                        continue
                    ids, result = item
                    responses.append(response_record(result, prompt_id=prompt.id, turn=turn, prompt_tokens=len(ids)))
                late[unit] += GRAPH_LOG.captured - captured
                journals[unit].append({"prompt_id": prompt.id, "responses": [r.to_dict() for r in responses],
                                       "skipped": skipped, "verify_paths": sorted(paths[0]),
                                       "draft_paths": sorted(paths[1]), "timed": [started, time.time()]})
                bar.update(1)
        for unit in group:
            if unit.name in stage.done_units():
                continue
            if late[unit]:
                log.warning("%s: %d CUDA graphs were captured during timed decoding (a shape the warm-up did not "
                            "reach); the rounds that captured them are in the timings", unit.name, late[unit])
            write_unit(stage, unit, prompts, journals[unit], graphs_captured_while_timed=late[unit])
    bar.close()
