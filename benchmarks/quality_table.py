"""Summary of one `benchmarks/quality_gpu.sh` run: stage wall times, data sizes, training throughput and loss
curve, tau / speedup per benchmark and method, the loss ablation and the data-size curve. Prints markdown tables
and writes
<out>/summary.json (what docs/results/smollm2-h200/ keeps).

    python benchmarks/quality_table.py --out quality_out --run-dir runs/smollm2-135m-h200
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _num(x, spec=".2f", dash="—"):
    return dash if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _manifest(run_dir: Path, stage: str) -> dict:
    path = run_dir / stage / "manifest.json"
    if path.is_symlink() or not path.exists():
        path = path.resolve()
    return json.loads(path.read_text()) if path.exists() else {}


def stage_seconds(out: Path) -> dict[str, dict]:
    """label -> {seconds: summed over its lines (a stage run over several calls, `--stop-after`), exit: the last}."""
    rows: dict[str, dict] = {}
    path = out / "stage_seconds.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        label, seconds, rc = line.split()
        row = rows.setdefault(label, {"seconds": 0, "exit": 0})
        row["seconds"] += int(seconds)
        row["exit"] = int(rc)
    return rows


def train_summary(metrics_path: Path) -> dict:
    """Throughput and the loss curve from the trainer's metrics.jsonl (train records and held-out evals)."""
    if not metrics_path.exists():
        return {}
    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    held = [r for r in recs if r.get("kind") == "eval"]
    tok_s = sorted(r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s"))  # step 1 holds the start-up
    out = {"steps": train[-1]["step"] if train else None,
           "tokens_per_s_median": tok_s[len(tok_s) // 2] if tok_s else None,
           "loss_first": train[0].get("loss") if train else None, "loss_last": train[-1].get("loss") if train else None,
           "tau_hat_last": train[-1].get("tau_hat") if train else None,
           "held_out_loss": [(r["step"], r.get("loss")) for r in held],
           "held_out_tau_hat": [(r["step"], r.get("tau_hat")) for r in held]}
    return out


def cells(report: dict) -> dict[tuple[str, str], dict]:
    return {(c["benchmark"], c["label"]): c for c in report.get("cells", [])}


def data_curve(out: Path, run_dir: Path) -> list[dict]:
    """One row per data-curve run (`report-<run>-data-<P>.json` in `out`), by share of the prompts: its training
    samples and steps (the run's train manifest), its last held-out loss (`train_metrics-<run>.jsonl`) and τ per
    benchmark and method."""
    rows = []
    for path in out.glob(f"report-{run_dir.name}-data-*.json"):
        run = path.stem[len("report-"):]
        counts = _manifest(run_dir.parent / run, "train").get("counts", {})
        held = train_summary(out / f"train_metrics-{run}.jsonl").get("held_out_loss") or [(None, None)]
        rows.append({"percent": int(run.rsplit("-", 1)[1]), "train_samples": counts.get("train_samples"),
                     "steps": counts.get("steps"), "held_out_loss": held[-1][1],
                     "tau": {f"{b}/{lb}": c.get("tau_mean") for (b, lb), c in cells(json.loads(path.read_text())).items()}})
    return sorted(rows, key=lambda r: r["percent"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    out, run_dir = Path(args.out), Path(args.run_dir)
    summary: dict = {"stages": stage_seconds(out)}

    regen, tok = _manifest(run_dir, "regen"), _manifest(run_dir, "tokenize")
    summary["data"] = {"regen": regen.get("counts", {}), "tokenize": tok.get("counts", {}),
                       "generated_tokens_per_s": regen.get("generated_tokens_per_s")}
    summary["train"] = train_summary(out / "train_metrics.jsonl")

    print("## Stages\n")
    print(_table(["stage", "seconds", "exit"],
                 [[k, str(v["seconds"]), str(v["exit"])] for k, v in summary["stages"].items()]))
    rc, tc = summary["data"]["regen"], summary["data"]["tokenize"]
    print(f"\nregen: {rc.get('written')} samples written, {rc.get('failed')} failed, {rc.get('generated_tokens')} "
          f"tokens generated ({_num(summary['data']['generated_tokens_per_s'], '.0f')} tok/s); tokenize: "
          f"{tc.get('written')} samples, {tc.get('tokens')} tokens ({tc.get('loss_tokens')} supervised)")
    t = summary["train"]
    if t:
        print(f"train: {t.get('steps')} steps, median {_num(t.get('tokens_per_s_median'), '.0f')} tok/s, loss "
              f"{_num(t.get('loss_first'))} -> {_num(t.get('loss_last'))}; held-out loss "
              + ", ".join(f"{s}: {_num(v, '.3f')}" for s, v in t.get("held_out_loss", [])))

    report_path = out / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        by = cells(report)
        benches = list(dict.fromkeys(b for b, _ in by))
        labels = list(dict.fromkeys(lb for _, lb in by))
        rows = []
        for b in benches:
            row = [b]
            for lb in labels:
                c = by.get((b, lb))
                row.append("—" if c is None else f"{_num(c.get('tau_mean'))} ({_num(c.get('speedup'), '.2f')}x)")
            rows.append(row)
        print("\n## τ (speedup over AR)\n")
        print(_table(["benchmark", *labels], rows))
        summary["eval"] = {f"{b}/{lb}": {k: c.get(k) for k in ("tau_mean", "speedup", "ar_match", "responses",
                                                               "tokens_per_second")}
                           for (b, lb), c in by.items()}
        chain = by.get(("gsm8k", "chain"))
        trees = [c for (b, lb), c in by.items() if b == "gsm8k" and c["method"] == "ddtree"]
        if chain and trees:
            best = max(trees, key=lambda c: c["tau_mean"])
            summary["gsm8k"] = {"chain_tau": chain["tau_mean"], "best_ddtree": best["label"],
                                "best_ddtree_tau": best["tau_mean"],
                                "ddtree_over_chain": best["tau_mean"] / chain["tau_mean"],
                                "best_speedup": max(c.get("speedup") or 0 for (b, _), c in by.items() if b == "gsm8k")}
            print(f"\nGSM8K: chain τ {chain['tau_mean']:.2f} (target 4.0); best DDTree {best['label']} τ "
                  f"{best['tau_mean']:.2f} = {best['tau_mean'] / chain['tau_mean']:.2f}x chain (target 1.34x)")

    abl = sorted(out.glob("report-*-abl-*.json"))
    if abl:
        rows, summary["ablation"] = [], {}
        for path in abl:
            loss = path.stem.split("-abl-", 1)[1].replace("-", "+")
            by = cells(json.loads(path.read_text()))
            chain, tree = by.get(("gsm8k", "chain")), next((c for (b, lb), c in by.items() if c["method"] == "ddtree"), None)
            summary["ablation"][loss] = {"chain_tau": chain and chain["tau_mean"], "ddtree_tau": tree and tree["tau_mean"]}
            rows.append([loss, _num(chain and chain["tau_mean"]), _num(tree and tree["tau_mean"])])
        print("\n## Loss ablation (same data, same steps; GSM8K)\n")
        print(_table(["loss", "chain τ", "DDTree@64 τ"], rows))

    curve = data_curve(out, run_dir)
    if curve:
        summary["data_curve"] = curve
        labels = list(dict.fromkeys(k for row in curve for k in row["tau"]))
        print("\n## Data-size curve (equal steps, nested prompt subsets, the same held-out samples)\n")
        print(_table(["prompts", "train samples", "steps", "held-out loss", *[f"{k} τ" for k in labels]],
                     [[f"{row['percent']} %", str(row["train_samples"]), str(row["steps"]),
                       _num(row["held_out_loss"], ".3f"), *[_num(row["tau"].get(k)) for k in labels]]
                      for row in curve]))

    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
