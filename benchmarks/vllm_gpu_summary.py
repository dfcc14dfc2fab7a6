"""The summary of a `benchmarks/vllm_gpu.sh` run: one JSON of the numbers that docs/results/vllm-h200/ keeps, read
from the step results the run wrote (its --work dir's json/ folder and results.jsonl), and a table of them.

    python benchmarks/vllm_gpu_summary.py --work /tmp/vllm-gpu [--out summary.json]

Keys: vllm_version, device, regen_tok_s {vllm, hf} (SmolLM2, the hf fast path at the largest batch) and
regen_same_as_hf, regen_fp32_same_as_hf (the fp32 equality sample), regen_curve (generated tokens/s per mode and
batch), extract_tok_s {vllm, hf} (Qwen3-8B shape, bf16 features) and extract_tok_s_fp8 {vllm},
extract_ceilings (compute roofline, disk ceiling), extract_verify_passed (the stage's tap check and `extract
--verify` on the vllm-written features), hybrid_verify_passed, serve_full {greedy_identical, acceptance_len_vllm,
tau_ours, speedup_vllm, speedup_ours, parity}, serve_mixed_swa {greedy_identical, passed, ...} or {error}; a step
that did not run or failed is named under "missing" / "failed".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


STEPS = ("env", "verify8b", "hybrid", "smol", "serve", "regen32", "regen", "regencurve", "extract")


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(work: Path) -> dict:
    js = work / "json"
    steps = {}
    for line in (work / "results.jsonl").read_text().splitlines() if (work / "results.jsonl").exists() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        steps[r["step"]] = r
    out: dict = {"steps": {k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in steps.items()}}
    out["failed"] = sorted(k for k, v in steps.items() if v["rc"] != 0)
    out["missing"] = sorted(set(STEPS) - set(steps))

    regen = _load(js / "bench_regen.json")
    if regen:
        rows = [r for r in regen["rows"] if "tok_s" in r]
        hf = [r for r in rows if r["mode"] != "vllm"]
        vl = [r for r in rows if r["mode"] == "vllm"]
        best_hf = max(hf, key=lambda r: r["batch"] if isinstance(r["batch"], int) else 0, default=None)
        out["device"] = regen["env"].get("device_name")
        out["regen_tok_s"] = {"vllm": vl[0]["tok_s"] if vl else None, "hf": best_hf["tok_s"] if best_hf else None,
                              "hf_batch": best_hf["batch"] if best_hf else None}
        out["regen_same_as_hf"] = vl[0]["same_as_ref"] if vl else None
        out["regen_prefix_agreement"] = vl[0].get("prefix_agreement") if vl else None
        out["regen_prompts"] = vl[0]["prompts"] if vl else None
    fp32 = _load(js / "bench_regen_fp32.json")
    if fp32:
        vl = [r for r in fp32["rows"] if r["mode"] == "vllm" and "tok_s" in r]
        out["regen_fp32_same_as_hf"] = vl[0]["same_as_ref"] if vl else None
        out["regen_fp32_prefix_agreement"] = vl[0].get("prefix_agreement") if vl else None
        if vl and "divergences" in vl[0]:  # where the outputs part: the reference's logit gap (near tie or not)
            out["regen_fp32_divergences"] = {"max_gap": vl[0]["max_gap"], "ended_apart": vl[0]["ended_apart"],
                                             "at": vl[0]["divergences"]}
    curve = _load(js / "bench_regen_curve.json")
    if curve:
        out.setdefault("device", curve["env"].get("device_name"))
        out["regen_curve"] = [{"mode": r["mode"], "batch": r["batch"], "tok_s": r["tok_s"]}
                              for r in curve["rows"] if "tok_s" in r]
    ext = {}
    for f in sorted(js.glob("bench_extract-*.json")):
        r = _load(f)
        if r:
            ext[(r["backend"], r["storage_dtype"])] = r
            if r.get("vllm"):
                out["vllm_version"] = r["vllm"]
    if ext:
        out["extract_tok_s"] = {b: round(ext[(b, "bfloat16")]["end_to_end_tps"], 1) if (b, "bfloat16") in ext else None
                                for b in ("vllm", "hf")}
        if ("vllm", "fp8") in ext:
            out["extract_tok_s_fp8"] = {"vllm": round(ext[("vllm", "fp8")]["end_to_end_tps"], 1)}
        ref = ext.get(("vllm", "bfloat16")) or next(iter(ext.values()))
        out["extract_shape"] = ref["shape"]
        out["extract_ceilings"] = {"compute_roofline_tps": round(ref["compute_roofline_tps"], 1),
                                   "full_model_roofline_tps": round(ref["full_model_roofline_tps"], 1),
                                   "disk_ceiling_tps_bf16": round(ref["disk_ceiling_tps"], 1)}
    for name, key in (("verify8b", "extract_verify_passed"), ("hybrid", "hybrid_verify_passed")):
        tap, verify = _load(js / f"{name}-tap-check.json"), _load(js / f"{name}-verify-stored.json")
        if tap or verify:
            out[key] = bool(tap and tap.get("passed")) and bool(verify and verify.get("passed"))
            out[f"{key[:-len('_passed')]}_layers"] = {
                "tap_check": [{k: r[k] for k in ("layer", "cos_mean", "cos_min", "rel")} for r in (tap or {}).get("layers", [])],
                "verify": [{k: r[k] for k in ("layer", "cos_mean", "cos_min", "rel")} for r in (verify or {}).get("layers", [])]}
    serve = _load(js / "bench_vllm_serve.json")
    if serve:
        g = serve["greedy_identical"]
        out.setdefault("vllm_version", serve["engine"]["vllm"])
        out["serve_full"] = {"greedy_identical": f"{g['dflash_vs_vllm_plain']}/{g['of']}",
                             "greedy_identical_to_ours_ar": f"{g['dflash_vs_ours_ar']}/{g['of']}",
                             "acceptance_len_vllm": round(serve["acceptance_len_vllm"], 3),
                             "tau_ours": round(serve["tau_ours"], 3),
                             "per_position_vllm": [round(x, 3) for x in serve["per_position_vllm"]],
                             "per_position_ours": [round(x, 3) for x in serve["per_position_ours"]],
                             "speedup_vllm": round(serve["speedup_vllm"], 3), "speedup_ours": round(serve["speedup_ours"], 3),
                             "tok_s": {k: round(v, 1) for k, v in serve["tok_s"].items()},
                             "parity": serve.get("parity")}
        m = serve.get("mixed_swa")
        if m is not None:
            out["serve_mixed_swa"] = ({"error": m["error"]} if not m["served"] else
                                      {"greedy_identical": f"{m['greedy_identical_to_ours_ar']}/{m['prompts']}",
                                       "passed": m["passed"], "relative_error": m["relative_error"],
                                       "neighbours": m["neighbours"], "window": m["window"], "engine": m["engine"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s = summarize(Path(args.work))
    text = json.dumps(s, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
