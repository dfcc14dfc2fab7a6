"""`drafter eval`: AR / chain / DDTree decoding of benchmark prompts with the target and the trained drafter,
scored with eval.metrics and written as runs/<run>/eval/report.{json,md,html}.

Units of work (kill -9 safe through StageDir sidecars), in this order:

    <benchmark>.ar              AR once per prompt: the speedup baseline, measured in the same run
    <benchmark>.chain           DFlash: one drafted chain of B-1 tokens per round
    <benchmark>.ddtree-b<N>     DDTree with node budget N, for every N in eval.budgets

Each unit decodes every prompt of its benchmark (every turn of a multi-turn prompt: turn 2 is asked after the
method's own turn-1 answer, which is the target's own answer because decoding is lossless) and writes one JSONL
line per response (`eval.metrics.ResponseRecord`). Resume is per prompt: a finished prompt's responses are
appended to the unit's journal (`pipeline.runner.Journal`, fsync'd), so after kill -9 no journaled prompt is
decoded again; the unit's shard is written from its journal once every prompt is in. Before a unit's first timed
prompt every CUDA graph its prompts can use is captured (`eval.decode.warm_up`), so timings are steady state.
Units split over ranks (`--rank/--world-size`); whichever rank finishes last, or `drafter eval --merge`,
aggregates the sidecar'd shards into the report and writes the manifest.

The drafter is `eval.drafter` or this run's train export (`runs/<run>/train/export`). It is refused when its
tapped layers / hidden size / vocabulary do not fit the target, or when the train manifest beside it records a
tokenizer fingerprint other than the target tokenizer's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from eval.target_cache import tree_unsupported_reason
from eval.lossless import classify, fp32_logits_at, fp32_replay, fp32_subset_summary, lossless_summary
from eval.metrics import PHASES, ResponseRecord, speedup, summarize
from eval.overlap import eval_shingles, find_overlap, summarize_overlap, training_prompts
from eval.prompts import EvalPrompt, LoadedBenchmark, benchmarks_in_use, chat_prompt_ids, format_content
from eval.report import (REPORT_FILES, cell_label, json_ready, plot_per_depth, plot_speedup, tau_table, verdict,
                         verdict_text, write_report)
from extract.layers import validate_layer_ids
from pipeline.config import ConfigError, RunConfig, config_record, to_dict
from pipeline.log import get_logger, progress, summary
from pipeline.runner import (
    AtomicFile,
    Journal,
    RankInfo,
    StageDir,
    StageError,
    check_fingerprint,
    read_json,
    sha256_file,
    units_for_rank,
)
from pipeline.target import load_target, open_target, text_config

log = get_logger("eval")

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


# ----------------------------------------------------------------------------------------------
# Inputs: config checks, drafter location and compatibility
# ----------------------------------------------------------------------------------------------


def drafter_dir(cfg: RunConfig) -> Path:
    """`eval.drafter` (a local dir, or a hub id resolved by train.export), else this run's train export."""
    if cfg.eval.drafter:
        from train.export import resolve_drafter_dir

        path = resolve_drafter_dir(cfg.eval.drafter, None)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"eval.drafter: {path} is not a drafter directory (no config.json)")
        return path
    path = cfg.run_dir / "train" / "export"
    if not (path / "config.json").is_file():
        raise StageError(
            f"no drafter to evaluate: {path} does not exist. Run `drafter train` for run '{cfg.name}' first, "
            "or set eval.drafter to a drafter directory in the z-lab DFlash layout"
        )
    return path


def train_manifest_for(drafter_path: Path) -> dict | None:
    """The train manifest that produced an export dir (runs/<run>/train/export -> runs/<run>/train), if any."""
    manifest = drafter_path.parent / "manifest.json"
    if drafter_path.name == "export" and manifest.is_file():
        m = read_json(manifest)
        if m.get("stage") == "train":
            return m
    return None


def trained_tokenizer_fingerprint(train_manifest: dict) -> dict | None:
    """The tokenizer fingerprint the drafter was trained with (train fingerprint: {"drafter", "features"})."""
    fp = train_manifest.get("fingerprint", {})
    return fp.get("tokenizer") or (fp.get("features") or {}).get("tokenizer")


def drafter_sha(path: Path) -> str:
    files = sorted(path.glob("*.safetensors")) + [path / "config.json"]
    return "".join(sha256_file(f)[:16] for f in files)


def check_drafter_fits_target(drafter_cfg: dict, target_config: Any, train_manifest: dict | None) -> list[int]:
    """The target layers the drafter reads (extract/layers.py convention), after refusing a drafter whose taps,
    hidden size or vocabulary do not fit the target (a StageError naming every field).

    The taps are the export's `dflash_config.target_layer_ids`, which training copied from the feature manifest it
    trained on; when the train manifest beside the export records that manifest's `layer_ids`, the two must agree.
    extract.layers.validate_layer_ids (the one layer-id rule) checks them against the target.
    drafter_cfg: the drafter's z-lab config.json (hidden_size, vocab_size?, dflash_config.target_layer_ids,
    dflash_config.mask_token_id, num_target_layers?).
    """
    text = text_config(target_config)
    n_layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
    dcfg = drafter_cfg.get("dflash_config") or {}
    problems = []
    layer_ids = dcfg.get("target_layer_ids")
    trained_ids = ((train_manifest or {}).get("fingerprint", {}).get("features") or {}).get("layer_ids")
    if not layer_ids:
        problems.append("dflash_config.target_layer_ids: missing from the drafter config")
    else:
        try:
            layer_ids = validate_layer_ids(layer_ids, n_layers)
        except ValueError as e:
            problems.append(f"dflash_config.target_layer_ids: {e}")
        if trained_ids is not None and [int(i) for i in trained_ids] != layer_ids:
            problems.append(f"dflash_config.target_layer_ids: {layer_ids}, but the features it was trained on "
                            f"tapped {trained_ids} (train manifest beside the export)")
    if drafter_cfg.get("num_target_layers") not in (None, n_layers):
        problems.append(f"num_target_layers: drafter was built for {drafter_cfg['num_target_layers']}, "
                        f"the target has {n_layers}")
    if drafter_cfg.get("hidden_size") != hidden:
        problems.append(f"hidden_size: drafter {drafter_cfg.get('hidden_size')}, target {hidden}")
    if drafter_cfg.get("vocab_size") not in (None, vocab):
        problems.append(f"vocab_size: drafter {drafter_cfg['vocab_size']}, target {vocab}")
    mask = dcfg.get("mask_token_id")
    if mask is None or not 0 <= int(mask) < vocab:
        problems.append(f"dflash_config.mask_token_id: {mask} is not a row of the target vocabulary (size {vocab})")
    if problems:
        raise StageError("the drafter does not fit this target:\n  " + "\n  ".join(problems))
    return layer_ids


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


# ----------------------------------------------------------------------------------------------
# Decoding one conversation
# ----------------------------------------------------------------------------------------------


def response_record(result: Any, *, prompt_id: str, turn: int, prompt_tokens: int) -> ResponseRecord:
    """eval.decode.DecodeResult -> ResponseRecord (the one place that reads DecodeResult's field names)."""
    t = result.timings
    return ResponseRecord(
        prompt_id=prompt_id, turn=turn, prompt_tokens=prompt_tokens,
        num_new_tokens=int(result.num_new_tokens), num_rounds=int(result.num_rounds),
        accept_lengths=[int(x) for x in result.accept_lengths], draft_depths=[int(d) for d in result.draft_depths],
        decode_seconds=float(t["decode"]), prefill_seconds=float(t["prefill"]),
        phase_seconds={p: float(t[p]) for p in PHASES if p in t},  # empty without phase timing
        output_ids=[int(i) for i in result.output_ids],
    )


def run_conversation(prompt: EvalPrompt, tokenizer, generate: Callable[[list[int]], Any], *,
                     enable_thinking: bool, max_prompt_tokens: int) -> list[tuple[list[int], Any] | str]:
    """Ask every user turn of `prompt`, each after the model's own previous answers.

    generate(prompt_ids) -> DecodeResult. Returns per turn (prompt_ids, result), or a skip reason string
    (a turn that does not fit the context ends the conversation).
    """
    messages: list[dict] = []
    out: list[tuple[list[int], Any] | str] = []
    for user in prompt.turns:
        messages.append({"role": "user", "content": user})
        ids = chat_prompt_ids(tokenizer, messages, enable_thinking=enable_thinking)
        if len(ids) > max_prompt_tokens:
            out.append("prompt_too_long")
            break
        result = generate(ids)
        answer = tokenizer.decode(list(result.output_ids), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        out.append((ids, result))
    return out


ANSWER_SLACK = 8  # tokens an answer may gain when its decoded text is tokenized again inside the next turn's prompt


def longest_context(prompts: list[EvalPrompt], tokenizer, *, enable_thinking: bool, max_new_tokens: int,
                    limit: int) -> int:
    """An upper bound of the committed rows any turn of `prompts` reaches while decoding (what the warm-up sizes
    and captures for): the last turn's prompt, with every earlier answer counted as max_new_tokens + ANSWER_SLACK
    tokens, plus max_new_tokens; at most `limit`."""
    longest = 0
    for p in prompts:
        messages: list[dict] = []
        for user in p.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]
        ids = chat_prompt_ids(tokenizer, messages[:-1], enable_thinking=enable_thinking)
        longest = max(longest, len(ids) + len(p.turns) * (max_new_tokens + ANSWER_SLACK))
    return min(longest, limit)


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def load_drafter(path: Path, target, device):
    """The drafter from its z-lab export with the target's embedding and LM head attached (frozen)."""
    from train.export import load_zlab

    drafter, args = load_zlab(path)
    drafter.attach_target_head(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    drafter.to(device=device, dtype=target.dtype).eval().requires_grad_(False)
    return drafter, args


def _stop_token_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def _write_unit(stage: StageDir, unit: Unit, prompts: list[EvalPrompt], journal: Journal, **notes) -> None:
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
    stage.finish_unit(unit.name, [path], responses=len(records), new_tokens=sum(r.num_new_tokens for r in records),
                      skipped=skipped, verify_paths=sorted({v for e in entries.values() for v in e["verify_paths"]}),
                      draft_paths=sorted({v for e in entries.values() for v in e["draft_paths"] if v}), **notes)
    journal.remove()
    log.info("%s: %d responses, %d new tokens", unit.name, len(records), sum(r.num_new_tokens for r in records))


def read_unit(stage: StageDir, unit: Unit) -> list[ResponseRecord]:
    path = stage.shard_path(unit.name, "jsonl")
    return [ResponseRecord.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def build_report(cfg: RunConfig, stage: StageDir, by_unit: dict[Unit, list[ResponseRecord]], *, block_size: int,
                 header: dict, lossless: dict[str, dict] | None = None) -> dict:
    """Aggregate the units' responses (`read_unit` of every unit) into report.json's dict (every cell's numbers,
    see eval.report). lossless: unit name -> `eval.lossless.lossless_summary` (from `check_lossless`)."""
    sidecars = stage.done_units()
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
    hits = find_overlap(sets, training_prompts(shards))
    train_rows = curate.manifest().get("counts", {}).get("train") if curate.is_complete() else None
    out = summarize_overlap(hits, eval_prompts=len(sets), train_conversations=train_rows,
                            against=f"{curate.shards}/train-*.parquet")
    if out["exact"] or out["near"]:
        log.warning("eval prompts found in the training prompts: %d exact, %d near duplicates (e.g. %s)",
                    out["exact"], out["near"], out["examples"][0]["eval_id"])
    return out


def check_lossless(cfg: RunConfig, by_unit: dict[Unit, list[ResponseRecord]], benchmarks: dict[str, LoadedBenchmark],
                   tokenizer, location: str) -> dict[str, dict] | None:
    """unit name -> `eval.lossless.lossless_summary` of its responses against AR's, at temperature 0.

    Per prompt the first turn that differs from AR's is classified (`eval.lossless.classify`, fp32 logits of the
    target at the divergence); later turns of that prompt follow a different history and are not compared. A
    divergence beyond the near-tie margin is replayed in fp32 (`eval.lossless.fp32_replay`: AR and the unit's method
    decode that prompt again through the divergence, with the fp32 target and drafter on the target's device). The
    fp32 target is loaded only when some response differs or eval.fp32_subset asks for it, the fp32 drafter only
    when a replay or the subset needs it. eval.fp32_subset = N: the first N prompts of each benchmark (first turn)
    are decoded whole in fp32 by AR and each method (`eval.lossless.fp32_subset_summary`: identical must be 1.0)."""
    e = cfg.eval
    if not e.lossless_check or e.temperature != 0:
        return None
    todo: dict[str, list[tuple[ResponseRecord, ResponseRecord]]] = {}
    for u, recs in by_unit.items():
        ar = by_unit.get(Unit(u.benchmark, "ar"))
        if ar is None or u.method == "ar":
            continue
        ar_by = {(r.prompt_id, r.turn): r for r in ar}
        first: dict[str, tuple[ResponseRecord, ResponseRecord]] = {}
        for r in sorted(recs, key=lambda r: r.turn):
            a = ar_by.get((r.prompt_id, r.turn))
            if a is not None and a.output_ids != r.output_ids and r.prompt_id not in first:
                first[r.prompt_id] = (a, r)
        todo[u.name] = list(first.values())
    if not any(todo.values()) and not e.fp32_subset:
        return {u.name: lossless_summary(len(recs), []) for u, recs in by_unit.items() if u.name in todo}
    import torch

    from eval.decode import decode

    target = load_target(location, replace(cfg.target, dtype="float32")).eval()
    logits_at = fp32_logits_at(target)
    fp32_drafter: list = []  # loaded at the first replay

    def replay_for(u: Unit):
        def replay(prompt_ids: list[int], n: int) -> str:
            if not fp32_drafter:
                fp32_drafter.append(load_drafter(drafter_dir(cfg), target, target.device)[0])
            run = fp32_replay(decode, target, fp32_drafter[0], u.method, u.budget, _stop_token_ids(tokenizer, target),
                              cache_impl=e.target_cache)
            return run(prompt_ids, n)
        return replay

    def first_turn_ids(p: EvalPrompt) -> list[int]:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}],
                               enable_thinking=cfg.target.enable_thinking)

    prompts = {p.id: p for b in benchmarks.values() for p in b.prompts}
    out = {}
    with torch.inference_mode():
        for u, recs in by_unit.items():
            if u.name not in todo:
                continue
            found = []
            for a, r in todo[u.name]:
                messages = []
                for turn, user in enumerate(prompts[r.prompt_id].turns[: r.turn + 1]):
                    messages.append({"role": "user", "content": user})
                    if turn < r.turn:  # earlier turns are identical to AR's: the same history
                        messages.append({"role": "assistant",
                                         "content": tokenizer.decode(_earlier_output(by_unit, u, r, turn),
                                                                     skip_special_tokens=True)})
                ids = chat_prompt_ids(tokenizer, messages, enable_thinking=cfg.target.enable_thinking)
                found.append(classify(r.prompt_id, r.turn, ids, a.output_ids, r.output_ids, logits_at,
                                      replay=replay_for(u)))
            out[u.name] = lossless_summary(len(recs), found)
            s = out[u.name]
            if e.fp32_subset:
                subset = benchmarks[u.benchmark].prompts[: e.fp32_subset]
                replay = replay_for(u)
                s["fp32_subset"] = fp32_subset_summary([replay(first_turn_ids(p), e.max_new_tokens) for p in subset],
                                                       [p.id for p in subset], e.max_new_tokens)
                if s["fp32_subset"]["not_identical"]:
                    log.warning("%s: in fp32, %d of %d subset prompts decode differently from AR (a bug): e.g. %s",
                                u.name, len(s["fp32_subset"]["not_identical"]), len(subset),
                                s["fp32_subset"]["not_identical"][0])
            if s["not_near_tie"]:
                log.info("%s: %d of %d divergences from AR lie beyond the near-tie margin; the fp32 replay agrees with "
                         "AR on %d (rounding)", u.name, s["not_near_tie"], s["divergences"], s["fp32_replay_identical"])
            if s["bugs"]:
                log.warning("%s: %d responses leave AR's output and the fp32 replay does not put them back (a bug): "
                            "e.g. %s", u.name, s["bugs"], s["bug_examples"][0])
    del target, fp32_drafter
    return out


def _earlier_output(by_unit: dict, unit: Unit, r: ResponseRecord, turn: int) -> list[int]:
    return next(x.output_ids for x in by_unit[unit] if x.prompt_id == r.prompt_id and x.turn == turn)


def _log_wandb(cfg: RunConfig, report: dict, stage_path: Path) -> None:
    """The eval W&B run (group = the run name, beside the train run): the report's tables, its verdict in the
    summary, its speedup and per-position plots, and report.{json,md,html} as the `<run>-eval-report` artifact."""
    w = cfg.train.wandb
    if w.mode == "disabled":
        return
    import io

    import wandb
    from PIL import Image

    cols = ["benchmark", "method", "budget", "responses", "rounds", "new_tokens", "tau_mean", "tau_pooled",
            "tokens_per_second", "speedup", "ar_match"]
    run = wandb.init(mode=w.mode, project=w.project, entity=w.entity, name=f"{w.run_name or cfg.name}-eval",
                     group=cfg.name, job_type="eval", dir=str(stage_path), config=json_ready(to_dict(cfg.eval)),
                     reinit="create_new", settings=wandb.Settings(quiet=True, console="off"))
    try:
        report = json_ready(report)
        cells = report["cells"]
        tau = tau_table(report)
        depth_rows = [[c["benchmark"], c["label"], d["depth"], d["rate"], d.get("unconditional")]
                      for c in cells for d in c["per_depth"]]
        images = {"eval/speedup_plot": plot_speedup(report), "eval/per_depth_plot": plot_per_depth(report)}
        run.log({
            "eval/cells": wandb.Table(columns=cols, data=[[c.get(k) for k in cols] for c in cells]),
            "eval/tau_table": wandb.Table(columns=tau.headers, data=tau.rows),
            "eval/per_depth": wandb.Table(columns=["benchmark", "method", "depth", "conditional", "unconditional"],
                                          data=depth_rows),
            **{k: wandb.Image(Image.open(io.BytesIO(png))) for k, png in images.items()},
        })
        v = verdict(report)
        run.summary["eval/verdict"] = verdict_text(v)
        for key in ("best", "speedup", "tau", "lossless"):
            run.summary[f"eval/verdict/{key}"] = v[key]
        run.summary["eval/verdict/responses_per_cell_min"] = v["responses"][0]
        run.summary["eval/verdict/warnings"] = list(v["warnings"])
        for c in cells:
            for key in ("tau_mean", "tau_pooled", "speedup", "tokens_per_second"):
                run.summary[f"eval/{c['benchmark']}/{c['label']}/{key}"] = c.get(key)
        artifact = wandb.Artifact(f"{cfg.name}-eval-report", type="eval-report",
                                  metadata={"verdict": verdict_text(v), "warnings": v["warnings"]})
        for name in REPORT_FILES:
            if (stage_path / name).is_file():
                artifact.add_file(str(stage_path / name))
        run.log_artifact(artifact)
    finally:
        run.finish()


def run_eval(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict:
    started = time.time()
    if not cfg.eval.benchmarks:
        raise ConfigError("eval.benchmarks: at least one benchmark is required")
    cfg, benchmarks, data = benchmarks_in_use(cfg)  # found (own file, mirror, cache, hub, held-out split) or why not
    target = open_target(cfg.target, cfg.cache_dir)
    location, tokenizer, target_config = target.location, target.tokenizer, target.config
    tok_fp = target.fingerprint["tokenizer"]
    dpath = drafter_dir(cfg)
    drafter_cfg = read_json(dpath / "config.json")
    train_manifest = train_manifest_for(dpath)
    taps = check_drafter_fits_target(drafter_cfg, target_config, train_manifest)
    trained_tok = trained_tokenizer_fingerprint(train_manifest) if train_manifest else None
    if trained_tok is not None:
        check_fingerprint({"tokenizer": tok_fp}, {"tokenizer": trained_tok},
                          what=f"the drafter's tokenizer (train manifest beside {dpath})", producer="train")
    else:
        log.warning("no train manifest beside %s: the drafter's tokenizer cannot be checked against the target's", dpath)
    d_sha = drafter_sha(dpath)
    fingerprint = {**target.fingerprint,
                   "drafter": {"path": str(dpath), "sha": d_sha}, "enable_thinking": cfg.target.enable_thinking}
    config_hash, settings = config_record(eval=cfg.eval, target=cfg.target, fingerprint=fingerprint, data=data)

    stage = StageDir(cfg.run_dir, "eval")
    if not stage.begin(config_hash, force=force, ranks=ranks, settings=settings):
        log.info("eval already complete for this config: %s", stage.path)
        report = read_json(stage.path / "report.json")
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

    mine = [u for u in units_for_rank(units, ranks) if not stage.unit_done(u.name)]
    block_size = int(drafter_cfg.get("block_size") or cfg.drafter.block_size)
    if mine:
        _run_units(cfg, stage, mine, benchmarks, location, tokenizer, target_config, dpath, block_size)

    done = stage.done_units()
    missing = [u.name for u in units if u.name not in done]
    if missing:
        log.info("rank %d/%d finished its units; %d of %d units still running elsewhere (%s); "
                 "the rank that finishes last writes the report", ranks.rank, ranks.world_size,
                 len(missing), len(units), ", ".join(missing[:4]))
        return {"stage": "eval", "complete": False, "missing_units": missing}

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
    _log_wandb(cfg, report, stage.path)
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


def merge_ranks(cfg: RunConfig) -> dict:
    """After a split run (e.g. a SLURM array): refuse if any unit is missing, else write the report and manifest
    (if the last rank has not): what a single-rank `run_eval` does when no unit is left to do."""
    stage = StageDir(cfg.run_dir, "eval")
    if not stage.is_complete():
        in_use = benchmarks_in_use(cfg)[0]
        units, _ = plan_units(in_use, tree_unsupported_reason(open_target(cfg.target, cfg.cache_dir).config))
        missing = [u.name for u in units if not stage.unit_done(u.name)]
        if missing:
            raise StageError(f"eval --merge: {len(missing)} of {len(units)} units are not done "
                             f"(e.g. {missing[:3]}); re-run the missing ranks first")
    return run_eval(cfg)


def _run_units(cfg: RunConfig, stage: StageDir, units: list[Unit], benchmarks: dict[str, LoadedBenchmark],
               location: str, tokenizer, target_config, dpath: Path, block_size: int) -> None:
    """Decode this rank's units, prompt by prompt: each finished prompt (all its turns) is appended to the unit's
    journal, so a killed run resumes at the first prompt not journaled. Before a unit's first timed prompt,
    `eval.decode.warm_up` captures every CUDA graph its prompts can need (steady-state timings)."""
    import torch

    from eval.decode import decode, warm_up
    from pipeline.cuda_graphs import GRAPH_LOG

    target = load_target(location, cfg.target)
    drafter, _ = load_drafter(dpath, target, target.device)
    stop = _stop_token_ids(tokenizer, target)
    e, thinking = cfg.eval, cfg.target.enable_thinking
    max_prompt = int(getattr(text_config(target_config), "max_position_embeddings", 1 << 30)) - e.max_new_tokens \
        - block_size
    warm_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Warmup"}], enable_thinking=thinking)
    bar = progress(total=sum(len(benchmarks[u.benchmark].prompts) for u in units), desc="eval", unit="prompt")
    for unit in units:
        prompts = benchmarks[unit.benchmark].prompts
        journal = stage.journal(unit.name)
        done = {entry["prompt_id"] for entry in journal.items}
        todo = [p for p in prompts if p.id not in done]
        bar.update(len(prompts) - len(todo))
        paths: tuple[set, set] = (set(), set())

        @torch.inference_mode()
        def generate(ids: list[int], max_new: int = e.max_new_tokens):
            result = decode(unit.method, target, drafter, ids, max_new_tokens=max_new, budget=unit.budget,
                            temperature=e.temperature, seed=e.seed, stop_token_ids=stop, phase_timing=e.phase_timing,
                            cache_impl=e.target_cache)
            paths[0].add(result.verify_path)
            paths[1].add(result.draft_path)
            return result

        if todo and e.warmup_tokens > 0:
            with torch.inference_mode():
                longest = longest_context(todo, tokenizer, enable_thinking=thinking, max_new_tokens=e.max_new_tokens,
                                          limit=max_prompt + e.max_new_tokens)
                warm_up(unit.method, target, drafter, max_length=longest, budget=unit.budget,
                        temperature=e.temperature, cache_impl=e.target_cache)
            generate(warm_ids, min(e.warmup_tokens, e.max_new_tokens))
        captured = GRAPH_LOG.captured
        for prompt in todo:
            paths[0].clear()
            paths[1].clear()
            responses, skipped = [], {}
            for turn, item in enumerate(run_conversation(prompt, tokenizer, generate, enable_thinking=thinking,
                                                         max_prompt_tokens=max_prompt)):
                if isinstance(item, str):
                    skipped[item] = skipped.get(item, 0) + 1
                    continue
                ids, result = item
                responses.append(response_record(result, prompt_id=prompt.id, turn=turn, prompt_tokens=len(ids)))
            journal.append({"prompt_id": prompt.id, "responses": [r.to_dict() for r in responses],
                            "skipped": skipped, "verify_paths": sorted(paths[0]), "draft_paths": sorted(paths[1])})
            bar.update(1)
        late = GRAPH_LOG.captured - captured
        if late:
            log.warning("%s: %d CUDA graphs were captured during timed decoding (a shape the warm-up did not reach); "
                        "the rounds that captured them are in the timings", unit.name, late)
        _write_unit(stage, unit, prompts, journal, graphs_captured_while_timed=late)
    bar.close()
