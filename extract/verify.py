"""`drafter extract --verify`: are the features what the canonical convention says they are?

Compares, per tapped layer, features from one of
  * ``stored`` — the finished extraction (after checking its fingerprint and, with
    ``extract.verify_checksums``, every shard's sha256),
  * ``hf`` / ``vllm`` — a fresh run of that backend on a few tokenized samples (into a scratch shard),
against an unbatched HF forward of the same tokens through `extract.layers.forward_taps` (tap l =
output of decoder layer l).  Reports per layer the mean and min per-token cosine, the max abs error and
the relative error (max abs error / max |reference|).  Fails when a layer's mean cosine is below
``extract.verify_min_cosine``, a value is NaN/Inf, or a shard's checksum differs.

An off-by-one layer set (e.g. vLLM aux ids passed without the +1) shows up as a cosine equal to the one
between adjacent layers (~0.95 on real models), far below the default 0.999.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from extract.layers import forward_taps
from extract.stage import (
    ExtractContext, extract_context, make_backend, read_samples, read_tokenized_index, screen_index,
)
from extract.store import SHARD_EXT, FeatureReader, Shard, ShardWriter, verify_checksums
from pipeline.config import RunConfig
from pipeline.log import get_logger, summary
from pipeline.runner import StageDir, StageError, atomic_write_json, check_fingerprint
from pipeline.target import load_target, resolve_device, resolve_dtype

log = get_logger("extract.verify")


def pick(n_total: int, n: int) -> list[int]:
    """``n`` evenly spaced indices of ``range(n_total)`` (deterministic; first and last included)."""
    if n_total <= n:
        return list(range(n_total))
    return sorted({int(round(x)) for x in np.linspace(0, n_total - 1, n)})


def layer_report(candidate: torch.Tensor, reference: torch.Tensor, layer_ids: list[int]) -> list[dict]:
    """Per-layer agreement of ``[T, n*D]`` features (any dtypes; compared in fp32)."""
    n = len(layer_ids)
    c = candidate.float().reshape(candidate.shape[0], n, -1)
    r = reference.float().reshape(reference.shape[0], n, -1)
    rows = []
    for j, l in enumerate(layer_ids):
        a, b = c[:, j], r[:, j]
        finite = bool(torch.isfinite(a).all())
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
        err = (a - b).abs().max().item()
        rows.append({"layer": l, "cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "max_abs": err,
                     "rel": err / max(b.abs().max().item(), 1e-30), "finite": finite})
    return rows


def format_table(rows: list[dict], threshold: float) -> str:
    lines = [f"{'layer':>6} {'cos mean':>10} {'cos min':>10} {'max abs':>11} {'rel':>9}  ok"]
    for r in rows:
        ok = r["finite"] and r["cos_mean"] >= threshold
        lines.append(f"{r['layer']:>6} {r['cos_mean']:>10.6f} {r['cos_min']:>10.6f} {r['max_abs']:>11.4g} {r['rel']:>9.2e}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def _stored_samples(cfg: RunConfig, ctx: ExtractContext) -> tuple[list[dict], list[str]]:
    stage = StageDir(cfg.run_dir, "extract")
    reader = FeatureReader(stage.path)
    check_fingerprint(ctx.fingerprint, reader.fingerprint, what=f"extraction {stage.path}", producer="extract")
    problems = verify_checksums(stage.path, full=cfg.extract.verify_checksums)
    samples = [reader.sample(i, torch.float32) for i in pick(len(reader), cfg.extract.verify_samples)]
    return samples, problems


def _backend_samples(cfg: RunConfig, ctx: ExtractContext, backend: str) -> list[dict]:
    """Run ``backend`` on a few tokenized samples into a scratch shard; read them back."""
    index = read_tokenized_index(ctx.tok_stage, cfg.extract.max_samples)
    keep, _, _ = screen_index(index)
    rows_all = np.flatnonzero(keep)
    rows = [int(rows_all[i]) for i in pick(len(rows_all), cfg.extract.verify_samples)]
    rows.sort(key=lambda r: (-int(index.lengths[r]), r))  # writers take samples longest first
    data = read_samples(index, np.asarray(rows))
    scratch = Path(tempfile.mkdtemp(prefix="verify-", dir=cfg.run_dir))
    try:
        path = scratch / f"verify.{SHARD_EXT}"
        writer = ShardWriter(path, [index.ids[r] for r in rows], [data[r][0] for r in rows], [data[r][1] for r in rows],
                             num_taps=len(ctx.layer_ids), hidden_size=ctx.hidden_size,
                             storage_dtype=cfg.extract.storage_dtype)
        engine = make_backend(cfg, ctx, backend, max_len=max(len(data[r][0]) for r in rows))
        try:
            engine.extract_unit(writer, [data[r][0] for r in rows])
            engine.wait(writer)
        finally:
            writer.close()
            engine.close()
        shard = Shard(path)
        samples = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in shard.sample(i, torch.float32).items()}
                   for i in range(len(shard))]
        del shard
        return samples
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_verify(cfg: RunConfig, *, against: str = "stored") -> dict:
    """Compare features with a fresh unbatched HF forward; returns a report with ``passed``."""
    ctx = extract_context(cfg)
    problems: list[str] = []
    if against == "stored":
        samples, problems = _stored_samples(cfg, ctx)
    elif against in ("hf", "vllm"):
        samples = _backend_samples(cfg, ctx, against)
    else:
        raise StageError(f"extract verify: --against must be stored, hf or vllm, not {against!r}")
    if not samples:
        raise StageError("extract verify: no samples to compare")
    device = resolve_device(cfg.target.device)
    model = load_target(ctx.location, cfg.target, device=device, dtype=resolve_dtype(cfg.target.dtype, device))
    cand, ref = [], []
    for s in samples:
        ids = s["input_ids"].to(device)[None]
        ref.append(forward_taps(model, ids, ctx.layer_ids)[0].float().cpu())
        cand.append(s["features"].float())
    layers = layer_report(torch.cat(cand), torch.cat(ref), ctx.layer_ids)
    threshold = cfg.extract.verify_min_cosine
    bad_layers = [r["layer"] for r in layers if not r["finite"] or r["cos_mean"] < threshold]
    passed = not bad_layers and not problems
    report = {"passed": passed, "against": against, "samples": len(samples), "tokens": int(sum(len(c) for c in cand)),
              "layer_ids": ctx.layer_ids, "min_cosine": threshold, "layers": layers, "failed_layers": bad_layers,
              "checksum_problems": problems, "storage_dtype": cfg.extract.storage_dtype}
    table = format_table(layers, threshold)
    print(table)
    for p in problems:
        print(f"checksum: {p}")
    out = StageDir(cfg.run_dir, "extract").path / f"verify-{against}.json"
    atomic_write_json(out, report)
    verdict = "PASSED" if passed else f"FAILED (layers {bad_layers}, {len(problems)} checksum problems)"
    summary("extract verify", f"{against} vs HF forward on {len(samples)} samples: {verdict} -> {out}")
    return report
