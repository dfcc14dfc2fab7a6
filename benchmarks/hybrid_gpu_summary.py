"""The summary of a benchmarks/hybrid_gpu.sh run: what its steps measured, in the keys of
docs/results/hybrid-h200/summary.json.

    python benchmarks/hybrid_gpu_summary.py --work /tmp/hybrid-gpu --out $OUT/summary.json \
        [--record docs/results/hybrid-h200/summary.json]

Reads the work dir the script leaves (results.jsonl: one line per step run; json/: each step's JSON) and writes:
  every key of the round step's bench_hybrid summary (chain_verify_ms, tree_verify_ms, overhead_ms, host syncs, the
  overhead profile, reference_8b, ...) and the extract step's extract_* keys and ceilings, plus
  commit_us                 the commit step's pieces in microseconds (the copy floor, the gathers it no longer pays,
                            the state kernel per block shape, the window, the whole commit), commit_checks: each
                            block shape's state against the engine's
  extract_share_of_ceiling  {bf16, fp8}: extract_tok_s / extract_ceiling_tok_s
  regen_tok_s               {generate, static}: generated tokens/s at the largest batch both ran (`regen_batch`), and
                            regen_rows: every bench_regen row with its compute and memory roofline
  train_tok_s               tokens/s of the online training run's first variant (the config as configured), and
                            train: that variant's step split, peak memory and MFU; train_variants: every variant
  train_max_micro_batch     {variant, sequences}: the largest micro-batch found beside the resident target
  steps                     {failed: [...], missing: [...], seconds: {step: s}}
A step that failed or did not run leaves its keys out and is named under `steps`. Nothing is carried over from an
earlier summary. `--record PATH` writes the same file to PATH too, first moving the summary already there into
PATH's folder under its own date (`<date>/summary.json`) unless that exists.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

STEPS = ("env", "tests", "regen", "round", "commit", "extract", "train", "trainmax")
EXTRACT_KEYS = ("matmul_tflops", "matmul", "disk_write_GBps", "compute_roofline_tok_s", "extract_tok_s",
                "extract_ceiling_tok_s", "extract_disk_ceiling_tok_s", "extract_warmup", "extract_compile")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(work: Path) -> dict:
    """The summary dict of the run in `work` (see the module docstring)."""
    work = Path(work)
    runs = {}
    for line in (work / "results.jsonl").read_text().splitlines() if (work / "results.jsonl").exists() else []:
        if line.strip():
            r = json.loads(line)
            runs[r["step"]] = r  # a retried step: its last run
    out: dict = {}
    round_ = _json(work / "json" / "round.json") if runs.get("round", {}).get("rc") == 0 else None
    if round_:
        out.update(round_)
    commit = _json(work / "json" / "commit.json") if runs.get("commit", {}).get("rc") == 0 else None
    if commit:
        out["commit_us"], out["commit_checks"] = commit["us"], commit["checks"]
    extract = _json(work / "json" / "extract.json") if runs.get("extract", {}).get("rc") == 0 else None
    if extract:
        for k in ("device", "torch", "shape", "dtype", "date"):
            out.setdefault(k, extract.get(k))
        out.update({k: extract[k] for k in EXTRACT_KEYS if k in extract})
        out["extract_share_of_ceiling"] = {k: v / extract["extract_ceiling_tok_s"][k]
                                           for k, v in extract["extract_tok_s"].items()}
    regen = _json(work / "json" / "regen.json") if runs.get("regen", {}).get("rc") == 0 else None
    if regen:
        rows = [r for r in regen["rows"] if "tok_s" in r and isinstance(r["batch"], int)]
        mode = {r["mode"]: ("static" if r["mode"].startswith("static") else r["mode"]) for r in rows}
        both = [b for b in {r["batch"] for r in rows} if {mode[r["mode"]] for r in rows if r["batch"] == b}
                >= {"generate", "static"}]
        if both:
            out["regen_batch"] = max(both)
            out["regen_tok_s"] = {mode[r["mode"]]: r["tok_s"] for r in rows if r["batch"] == out["regen_batch"]
                                  and mode[r["mode"]] in ("generate", "static")}
        out["regen_rows"] = regen["rows"]
        out["regen_env"] = regen.get("env")
    train = _json(work / "json" / "train.json") if runs.get("train", {}).get("rc") == 0 else None
    ok = [r for r in train or [] if r.get("ok") and "max_batch" not in r]
    if ok:
        first = ok[0]
        out["train_tok_s"] = first["tokens_per_s"]
        out["train"] = {k: first.get(k) for k in ("variant", "seqs", "tokens_per_s", "ms_per_seq", "target_forward_ms",
                                                  "drafter_step_ms", "peak_mem_gib", "tflops_per_s", "mfu",
                                                  "mfu_with_target", "target_flops", "loss")}
        out["train"]["ms_per_step"] = first["ms_per_seq"] * first["seqs"]
        out["train_variants"] = train
    found = _json(work / "json" / "trainmax.json") if runs.get("trainmax", {}).get("rc") == 0 else None
    best = [r for r in found or [] if "max_batch" in r]
    if best:
        out["train_max_micro_batch"] = {"variant": best[0]["variant"], "sequences": best[0]["max_batch"],
                                        "peak_mem_gib": best[0].get("peak_mem_gib")}
    out["steps"] = {"failed": sorted(s for s, r in runs.items() if r["rc"] != 0),
                    "missing": [s for s in STEPS if s not in runs],
                    "seconds": {s: r["seconds"] for s, r in runs.items()}}
    return out


def write(summary: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)


def record(summary: dict, path: Path) -> None:
    """Write `summary` to `path`, the summary already there first copied under its date in the same folder."""
    path = Path(path)
    old = _json(path)
    if old and old.get("date") and old.get("date") != summary.get("date"):
        keep = path.parent / str(old["date"]) / path.name
        if not keep.exists():
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, keep)
    write(summary, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="the hybrid_gpu.sh work dir")
    ap.add_argument("--out", required=True, help="summary.json to write")
    ap.add_argument("--record", default=None, help="also write it here (the old one kept under its date)")
    a = ap.parse_args(argv)
    s = summarize(Path(a.work))
    write(s, Path(a.out))
    if a.record:
        record(s, Path(a.record))
    print(json.dumps({k: s.get(k) for k in ("regen_tok_s", "overhead_ms", "extract_tok_s", "extract_ceiling_tok_s",
                                            "train_tok_s", "train_max_micro_batch", "steps")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
