"""`drafter extract --verify`: are the features what the canonical convention says they are?

Compares, per tapped layer, features from one of
  * ``stored`` — the finished extraction (after checking its fingerprint and its files: sizes, headers and, with
    ``extract.verify_checksums``, every shard's sha256; a damaged shard is a finding, its samples are not read),
  * ``hf`` / ``vllm`` — a fresh run of that backend on tokenized samples (into a scratch shard),
against an unbatched HF forward of the same tokens through `extract.layers.forward_taps` (tap l =
output of decoder layer l).

Which samples: at least one from every shard (for ``hf``/``vllm``: every planned unit), so every rank's slice is
checked, then more drawn at random up to ``extract.verify_samples``; the draw is seeded (``--seed``: another seed,
another draw) and the report names every sample it checked (id, shard, row, rank).

Reports per layer the mean and min per-token cosine, the max abs error and the relative error (max abs error /
max |reference|).  Fails when a layer's mean cosine is below ``extract.verify_min_cosine``, any token's cosine is
below ``extract.verify_min_token_cosine``, a value is NaN/Inf, or a file fails its checks.

An off-by-one layer set (e.g. vLLM aux ids passed without the +1) shows up as a cosine equal to the one
between adjacent layers (~0.95 on real models), far below the default 0.999 mean; the same offset on about one
percent of the tokens leaves the mean above 0.999 but not the per-token minimum (0.99 by default; fp8 storage keeps
every token above 0.999).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from extract.layers import forward_taps
from extract.inputs import (
    ExtractContext, extract_context, make_backend, plan_units, read_samples, read_tokenized_index, screen_index,
)
from extract.store import SHARD_EXT, Shard, ShardWriter, check_store
from pipeline.config import RunConfig
from pipeline.log import get_logger, summary
from pipeline.errors import StageError
from pipeline.files import atomic_write_json, read_json
from pipeline.stage_dir import StageDir, check_fingerprint
from pipeline.target import load_target, resolve_device, resolve_dtype

log = get_logger("extract.verify")


def draw_samples(group_sizes: Sequence[int], n: int, seed: int) -> list[tuple[int, int]]:
    """Sorted ``(group, row)`` pairs: one random row of every non-empty group, then rows drawn uniformly at random
    from the rest until there are ``n`` (or no rows left). A pure function of the sizes, ``n`` and ``seed``."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    rng = np.random.default_rng(seed)
    first = [int(offsets[g] + rng.integers(size)) for g, size in enumerate(sizes) if size > 0]
    rest = np.setdiff1d(np.arange(offsets[-1]), first)
    extra = rng.choice(rest, min(max(0, n - len(first)), len(rest)), replace=False)
    chosen = np.sort(np.concatenate((np.asarray(first, dtype=np.int64), extra.astype(np.int64))))
    groups = np.searchsorted(offsets, chosen, side="right") - 1
    return [(int(g), int(i - offsets[g])) for g, i in zip(groups, chosen)]


def token_cosines(candidate: torch.Tensor, reference: torch.Tensor, num_taps: int) -> torch.Tensor:
    """Per-token, per-tap cosine ``[T, n]`` of ``[T, n*D]`` features (any dtypes; compared in fp32)."""
    c = candidate.float().reshape(candidate.shape[0], num_taps, -1)
    r = reference.float().reshape(reference.shape[0], num_taps, -1)
    return torch.nn.functional.cosine_similarity(c, r, dim=-1, eps=1e-12)


def layer_report(candidate: torch.Tensor, reference: torch.Tensor, layer_ids: list[int]) -> list[dict]:
    """Per-layer agreement of ``[T, n*D]`` features (any dtypes; compared in fp32)."""
    n = len(layer_ids)
    cos = token_cosines(candidate, reference, n)
    c = candidate.float().reshape(candidate.shape[0], n, -1)
    r = reference.float().reshape(reference.shape[0], n, -1)
    rows = []
    for j, l in enumerate(layer_ids):
        a, b = c[:, j], r[:, j]
        err = (a - b).abs().max().item()
        rows.append({"layer": l, "cos_mean": cos[:, j].mean().item(), "cos_min": cos[:, j].min().item(),
                     "max_abs": err, "rel": err / max(b.abs().max().item(), 1e-30),
                     "finite": bool(torch.isfinite(a).all())})
    return rows


def layer_passes(row: dict, min_mean: float, min_token: float) -> bool:
    """The verdict on one layer over every checked sample: finite, mean cosine and every token's cosine high enough."""
    return tokens_pass(row, min_token) and row["cos_mean"] >= min_mean


def tokens_pass(row: dict, min_token: float) -> bool:
    """One sample's layer: finite and every token's cosine high enough. The mean bound judges the pooled layer
    only: one sample's mean wanders with its length and content (bf16 rounding grows with depth, so a deep layer
    can pass pooled while one short sample sits just under the bound), while a token below the bound also fails
    the pooled verdict, so a sample named as failed always comes with a failed verdict."""
    return row["finite"] and row["cos_min"] >= min_token


def format_table(rows: list[dict], min_mean: float, min_token: float) -> str:
    lines = [f"{'layer':>6} {'cos mean':>10} {'cos min':>10} {'max abs':>11} {'rel':>9}  ok "
             f"(mean >= {min_mean}, every token >= {min_token})"]
    for r in rows:
        ok = layer_passes(r, min_mean, min_token)
        lines.append(f"{r['layer']:>6} {r['cos_mean']:>10.6f} {r['cos_min']:>10.6f} {r['max_abs']:>11.4g} {r['rel']:>9.2e}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def _shard_ranks(stage: StageDir) -> dict[str, int]:
    """Shard name -> the rank that wrote it, from the rank summaries (a single run: every shard is rank 0's)."""
    out = {}
    for info in stage.read_rank_summaries():
        out.update({f"{u}.{SHARD_EXT}": info["rank"] for u in info["units"]})
    return out


def _stored_samples(cfg: RunConfig, ctx: ExtractContext, seed: int) -> tuple[list[dict], dict]:
    """Samples drawn from every shard that passes its checks, and the problems of those that do not."""
    stage = StageDir(cfg.run_dir, "extract")
    manifest = stage.manifest()
    check_fingerprint(ctx.fingerprint, manifest["fingerprint"], what=f"extraction {stage.path}", producer="extract")
    problems = check_store(stage.path, full=cfg.extract.verify_checksums)
    names = [n for n in manifest["storage"]["shards"] if stage.shards / n not in problems]
    shards = [Shard(stage.shards / n) for n in names]
    ranks = _shard_ranks(stage)
    samples = []
    for k, row in draw_samples([len(sh) for sh in shards], cfg.extract.verify_samples, seed):
        s = shards[k].sample(row, torch.float32)
        samples.append({**s, "shard": names[k], "row": row, "rank": ranks.get(names[k], 0)})
    return samples, problems


def _backend_samples(cfg: RunConfig, ctx: ExtractContext, backend: str, seed: int) -> list[dict]:
    """Run ``backend`` on samples drawn from every planned unit into a scratch shard; read them back."""
    index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
    keep, _, _ = screen_index(index)
    units = plan_units(index.lengths, keep, cfg.extract.shard_tokens)
    picks = {units[k].rows[row]: (f"{units[k].name}.{SHARD_EXT} (planned)", row)
             for k, row in draw_samples([len(u.rows) for u in units], cfg.extract.verify_samples, seed)}
    return extract_scratch(cfg, ctx, index, picks, lambda max_len: make_backend(cfg, ctx, backend, max_len=max_len))


def extract_scratch(cfg: RunConfig, ctx: ExtractContext, index, picks: dict[int, tuple[str, int]], make_engine) -> list[dict]:
    """Extract the tokenized rows ``picks`` ({row: (shard label, row in that shard)}) with the engine that
    ``make_engine(max_len)`` builds, into a scratch shard under the run dir; read them back as fp32 samples. The
    engine is closed before this returns (its GPU memory is free for the HF reference)."""
    rows = sorted(picks, key=lambda r: (-int(index.lengths[r]), r))  # writers take samples longest first
    data = read_samples(index, np.asarray(rows))
    scratch = Path(tempfile.mkdtemp(prefix="verify-", dir=cfg.run_dir))
    try:
        path = scratch / f"verify.{SHARD_EXT}"
        writer = ShardWriter(path, [index.ids[r] for r in rows], [data[r][0] for r in rows], [data[r][1] for r in rows],
                             num_taps=len(ctx.tap_ids), hidden_size=ctx.hidden_size,
                             storage_dtype=cfg.extract.storage_dtype)
        engine = make_engine(max(len(data[r][0]) for r in rows))
        try:
            engine.extract_unit(writer, [data[r][0] for r in rows])
            engine.wait(writer)
        finally:
            writer.close()
            engine.close()
        shard = Shard(path)
        samples = []
        for i, r in enumerate(rows):
            s = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in shard.sample(i, torch.float32).items()}
            label, row = picks[r]
            samples.append({**s, "shard": label, "row": row, "rank": None})
        del shard
        return samples
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compare_with_hf(cfg: RunConfig, ctx: ExtractContext, samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per-layer report over all samples, per-sample records) of ``samples``' features against an unbatched HF
    forward of their tokens (`forward_taps`), judged by `extract.verify_min_cosine` / `verify_min_token_cosine`.
    The HF target is loaded for this and released after (its GPU memory too)."""
    min_token = cfg.extract.verify_min_token_cosine
    device = resolve_device(cfg.target.device)
    model = load_target(ctx.location, cfg.target, device=device, dtype=resolve_dtype(cfg.target.dtype, device))
    cand, ref, checked = [], [], []
    try:
        for s in samples:
            cand.append(s["features"].float())
            ref.append(forward_taps(model, s["input_ids"].to(device)[None], ctx.tap_ids)[0].float().cpu())
            per_layer = layer_report(cand[-1], ref[-1], ctx.tap_ids)
            checked.append({"id": s["id"], "shard": s["shard"], "row": s["row"], "rank": s["rank"],
                            "tokens": len(cand[-1]), "cos_min": min(r["cos_min"] for r in per_layer),
                            "failed_layers": [r["layer"] for r in per_layer if not tokens_pass(r, min_token)]})
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return layer_report(torch.cat(cand), torch.cat(ref), ctx.tap_ids), checked


def check_engine_taps(cfg: RunConfig, ctx: ExtractContext, stage_path: Path, make_engine) -> dict | None:
    """The gate in front of a `vllm` extraction job: before the job writes a shard, `extract.tap_check_samples`
    tokenized samples (the first ones) go through the engine ``make_engine(max_len)`` builds, with the job's own
    settings, and every tapped layer is compared with an HF forward. A layer that is off (the seed's failure: taps
    one layer off; an engine returning another tensor than the layer's output, as vLLM 0.26's eager mode does for
    its aux id 0) stops the job before any work: `StageError` naming the layers. The verdict is kept in
    ``stage_path/tap-check.json``; a passing verdict for the same config is not repeated on resume. Returns the
    verdict, or None when the check is off."""
    n = cfg.extract.tap_check_samples
    if n <= 0:
        return None
    record = stage_path / "tap-check.json"
    if record.exists():
        old = read_json(record, repair="Delete it and run the same command again: the tap check runs again")
        if isinstance(old, dict) and old.get("config_hash") == ctx.config_hash and old.get("passed") is True:
            return old
    index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
    keep, _, _ = screen_index(index)
    rows = [int(r) for r in np.flatnonzero(keep)[:n]]
    if not rows:
        return None
    samples = extract_scratch(cfg, ctx, index, {r: ("tap check", r) for r in rows}, make_engine)
    layers, checked = compare_with_hf(cfg, ctx, samples)
    bad = [r for r in layers if not layer_passes(r, cfg.extract.verify_min_cosine, cfg.extract.verify_min_token_cosine)]
    verdict = {"passed": not bad, "config_hash": ctx.config_hash, "backend": cfg.extract.backend,
               "samples": [c["id"] for c in checked], "layers": layers}
    atomic_write_json(record, json.loads(json.dumps(verdict, default=str)))
    if bad:
        worst = ", ".join(f"layer {r['layer']} (mean cosine {r['cos_mean']:.4f}, lowest token {r['cos_min']:.4f})"
                          for r in bad)
        raise StageError(
            f"extract: the {cfg.extract.backend} engine's features are not the tapped layers' outputs: {worst}, on "
            f"{len(samples)} samples against an HF forward; nothing was extracted (verdict: {record}). A wrong tap "
            "inside the engine: check its version against docs/serving.md and extract.vllm.enforce_eager, or use "
            "extract.backend=hf")
    log.info("tap check: %s's features equal an HF forward at every tapped layer on %d samples",
             cfg.extract.backend, len(samples))
    return verdict


def run_verify(cfg: RunConfig, *, against: str = "stored", seed: int = 0) -> dict:
    """Compare features with a fresh unbatched HF forward; returns a report with ``passed``."""
    ctx = extract_context(cfg)
    problems: dict = {}
    if against == "stored":
        samples, problems = _stored_samples(cfg, ctx, seed)
    elif against in ("hf", "vllm"):
        samples = _backend_samples(cfg, ctx, against, seed)
    else:
        raise StageError(f"extract verify: --against must be stored, hf or vllm, not {against!r}")
    if not samples and not problems:
        raise StageError("extract verify: no samples to compare")
    min_mean, min_token = cfg.extract.verify_min_cosine, cfg.extract.verify_min_token_cosine
    layers, checked = compare_with_hf(cfg, ctx, samples) if samples else ([], [])
    bad_layers = [r["layer"] for r in layers if not layer_passes(r, min_mean, min_token)]
    failed = [c for c in checked if c["failed_layers"]]
    passed = not bad_layers and not problems
    report = {"passed": passed, "against": against, "seed": seed, "samples": len(samples),
              "tokens": int(sum(c["tokens"] for c in checked)), "layer_ids": ctx.tap_ids,
              "min_cosine": min_mean, "min_token_cosine": min_token, "layers": layers, "failed_layers": bad_layers,
              "checked": checked, "failed_samples": failed,
              "file_problems": {str(p): why for p, why in problems.items()}, "storage_dtype": cfg.extract.storage_dtype}
    if layers:
        print(format_table(layers, min_mean, min_token))
    ranks = sorted({c["rank"] for c in checked if c["rank"] is not None})
    print(f"checked {len(checked)} samples (seed {seed}) from {len({c['shard'] for c in checked})} shards"
          + (f", ranks {ranks}" if ranks else "") + ": "
          + ", ".join(f"{c['id']} ({c['shard']}#{c['row']})" for c in checked[:40])
          + (f", ... ({len(checked) - 40} more)" if len(checked) > 40 else ""))
    for c in failed[:20]:
        print(f"FAILED sample {c['id']} ({c['shard']}#{c['row']}, rank {c['rank']}): layers {c['failed_layers']}, "
              f"lowest token cosine {c['cos_min']:.4f}")
    for p, why in problems.items():
        print(f"damaged: {p}: {why}")
    out = StageDir(cfg.run_dir, "extract").path / f"verify-{against}.json"
    atomic_write_json(out, json.loads(json.dumps(report, default=str)))
    verdict = "PASSED" if passed else (f"FAILED (layers {bad_layers}, {len(failed)} samples, {len(problems)} damaged "
                                       "files" + ("; run `drafter extract --repair`" if problems else "") + ")")
    summary("extract verify", f"{against} vs HF forward on {len(samples)} samples: {verdict} -> {out}")
    return report
