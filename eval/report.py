"""Eval reports: report.json (every number), report.md, and a self-contained report.html whose plots are
base64 PNGs (matplotlib, Agg backend) — no external src/href, so the file can be mailed or archived alone.

`report` is the dict that `eval.stage` builds (and writes as report.json):

    {"run": str, "target": {...}, "drafter": {"path", "block_size", ...}, "settings": {...},
     "benchmarks": {name: {"path", "prompts", "read", "skipped": {reason: n}}},
     "skipped_methods": [{"method", "budget", "reason"}],
     "overlap": eval.overlap.summarize_overlap(...) | {"note"} | None,
     "cells": [{"benchmark", "method", "budget", "label", **eval.metrics.summarize(...), "speedup", "ar_match",
                "lossless": eval.lossless.lossless_summary(...) | None,
                "skipped", "verify_paths", "draft_paths", "graphs_captured_while_timed"}],
     "verdict": verdict(...)}                     (added by write_report: the best method and the warnings)

Every document opens with the verdict (best method, its speedup, τ, lossless share, responses per cell, plain
warnings), then the tables and plots, settings last.

Undefined numbers (a τ without rounds, a speedup without an AR run) are JSON null and print as "—".
`compare_runs(eval_dirs, out)` puts two or more such reports side by side (`drafter report`).
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from pathlib import Path
from typing import Any, Sequence

from pipeline.config import ConfigError
from pipeline.files import atomic_write_json, atomic_write_text
from pipeline.records import NUMBER, OBJECT, STR, Optional, read_record

DASH = "—"
REPORT_FILES = ("report.json", "report.md", "report.html")  # what write_report writes


# ----------------------------------------------------------------------------------------------
# Tables: built once, rendered as Markdown and as HTML
# ----------------------------------------------------------------------------------------------


class Table:
    def __init__(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]):
        self.headers = [str(h) for h in headers]
        self.rows = [[str(c) for c in r] for r in rows]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def geometric_mean(xs: list) -> float | None:
    """exp(mean(log x)) over the positive numbers given (the mean of ratios); None when there are none."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    return f"{x:{spec}}{suffix}"


def json_ready(obj: Any) -> Any:
    """NaN/inf -> None, tuples -> lists: report.json stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def cell_label(method: str, budget: int | None) -> str:
    return f"{method}@{budget}" if budget is not None else method


def _distinct(report: dict, key: str) -> list[str]:
    """The cells' values of `key` ("label" or "benchmark"), each once, in first-seen order."""
    return list(dict.fromkeys(c[key] for c in report["cells"]))


def _cell(report: dict, benchmark: str, label: str) -> dict | None:
    return next((c for c in report["cells"] if c["benchmark"] == benchmark and c["label"] == label), None)


# ----------------------------------------------------------------------------------------------
# The verdict: the report's first answer
# ----------------------------------------------------------------------------------------------

# A cell resting on fewer responses than this is flagged: τ and speed vary from prompt to prompt, so a handful of
# responses gives a rough number (the demo's cells rest on 2).
FEW_RESPONSES = 10


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def timing_disturbed(cell: dict) -> bool:
    """A speedup above the cell's τ cannot be real: every round costs at least one target forward, at least an AR
    step, and yields τ tokens on average, so speedup <= τ (the larger of τ mean and τ pooled, to be safe). Above it,
    the timings were disturbed — most often AR measured while the machine was busy."""
    s, taus = cell.get("speedup"), [t for t in (cell.get("tau_mean"), cell.get("tau_pooled")) if t is not None]
    return s is not None and bool(taus) and s > max(taus)


def verdict(report: dict) -> dict:
    """Which speculative method to use on this target, and how far to trust the numbers.

    Per method (cell label): its speedup over AR on each benchmark, their geometric mean (the mean of ratios;
    cells with disturbed timing, `timing_disturbed`, left out), the mean τ over benchmarks, the fewest responses of
    its cells, the lossless share (responses whose output equals AR's at temperature 0, pooled) and, where the
    lossless check ran, the share identical or parting from AR only by bf16 rounding (`eval.lossless`; below 100 %
    there is a bug). per_benchmark: each benchmark's fastest method. best = the method with the highest
    geometric-mean speedup (mean τ where no speedup was measured) among those whose every cell rests on at least
    FEW_RESPONSES responses; None, with `no_best` saying why, when no method does. responses = (fewest, most)
    responses per cell. warnings: plain sentences, one per concern — disturbed timings, speculation slower than AR,
    cells on fewer than FEW_RESPONSES responses, output differing from AR (a bug, or only near-ties), eval prompts
    found in the training prompts.
    """
    disturbed = [c for c in report["cells"] if c["method"] != "ar" and timing_disturbed(c)]
    trusted = lambda c: c.get("speedup") is not None and c not in disturbed  # noqa: E731
    methods = {}
    for label in _distinct(report, "label"):
        if label == "ar":
            continue
        cells = [c for c in report["cells"] if c["label"] == label]
        matched = [(c["ar_match"], c["responses"]) for c in cells if c.get("ar_match") is not None]
        near = [(c["lossless"]["identical_or_rounding"], c["responses"]) for c in cells
                if (c.get("lossless") or {}).get("identical_or_rounding") is not None]
        methods[label] = {
            "speedup": geometric_mean([c["speedup"] for c in cells if trusted(c)]),
            "speedup_by_benchmark": {c["benchmark"]: c.get("speedup") for c in cells},
            "tau": _mean([c.get("tau_mean") for c in cells]),
            "responses": min(c["responses"] for c in cells),
            "lossless": sum(m * n for m, n in matched) / sum(n for _, n in matched) if matched else None,
            "lossless_or_rounding": sum(m * n for m, n in near) / sum(n for _, n in near) if near else None,
        }
    counts = [c["responses"] for c in report["cells"]]
    out = {"best": None, "no_best": None, "speedup": None, "tau": None, "lossless": None, "lossless_or_rounding": None,
           "responses": [min(counts), max(counts)] if counts else [0, 0], "methods": methods, "per_benchmark": {},
           "disturbed": [{"benchmark": c["benchmark"], "method": c["label"], "speedup": c["speedup"],
                          "tau": c.get("tau_mean")} for c in disturbed], "warnings": []}
    if not methods:
        out["warnings"].append("No speculative method was run: there is nothing to compare with AR.")
        return out
    for bench in _distinct(report, "benchmark"):
        cells = [c for c in report["cells"] if c["benchmark"] == bench and c["method"] != "ar" and trusted(c)
                 and c["responses"] >= FEW_RESPONSES]
        top = max(cells, key=lambda c: c["speedup"], default=None)
        out["per_benchmark"][bench] = {"best": top["label"] if top else None,
                                       "speedup": top["speedup"] if top else None}

    def rank(label):
        m = methods[label]
        return (m["speedup"] is not None, m["speedup"] or 0.0, m["tau"] or 0.0)

    for c in disturbed:
        out["warnings"].append(
            f"Disturbed timing: {c['benchmark']} {c['label']} shows a speedup of {c['speedup']:.2f}x, above its τ "
            f"{fmt(max(t for t in (c.get('tau_mean'), c.get('tau_pooled')) if t is not None))}, which no speculative "
            "decoder can reach (each round costs at least one target forward); the machine was busy while AR or this "
            "method was timed. This speedup is left out of the verdict; rerun on a quiet machine.")
    eligible = [lb for lb, m in methods.items() if m["responses"] >= FEW_RESPONSES]
    if not eligible:
        out["no_best"] = (f"no best method is chosen: the cells rest on as few as {out['responses'][0]} responses "
                          f"(fewer than {FEW_RESPONSES}), and with τ and speed varying from prompt to prompt so few "
                          "responses cannot rank the methods")
    else:
        best = max(eligible, key=rank)
        out.update(best=best, **{k: methods[best][k] for k in ("speedup", "tau", "lossless", "lossless_or_rounding")})
        if out["speedup"] is not None and out["speedup"] < 1:
            out["warnings"].append(
                f"Speculation does not pay off here: the best method, {best}, runs at {out['speedup']:.2f}x the speed "
                "of plain autoregressive decoding (geometric mean over benchmarks; slower than AR).")
    if out["responses"][0] < FEW_RESPONSES:
        out["warnings"].append(
            f"Cells rest on as few as {out['responses'][0]} responses (fewer than {FEW_RESPONSES}): τ and speedup vary "
            "from prompt to prompt, so these numbers are rough; raise eval.benchmarks[].num_samples.")
    for label, m in methods.items():
        if m["lossless"] is None or m["lossless"] >= 1:
            continue
        if m["lossless_or_rounding"] is None:
            out["warnings"].append(
                f"{label}: only {m['lossless']:.0%} of responses equal AR's output at temperature 0 — speculative "
                "decoding is lossless, so this is a bug or a bf16 near tie (see 'same output as AR').")
        elif m["lossless_or_rounding"] < 1:
            out["warnings"].append(
                f"{label}: {1 - m['lossless_or_rounding']:.0%} of responses leave AR's output at a token that is not "
                "a near-tie in fp32, and decoding again in fp32 does not put them back — a bug in speculative decoding "
                "(see 'Lossless check').")
    for c in report["cells"]:
        sub = (c.get("lossless") or {}).get("fp32_subset")
        if sub and sub["identical"] is not None and sub["identical"] < 1:
            out["warnings"].append(
                f"{c['benchmark']} {c['label']}: decoded in fp32, {len(sub['not_identical'])} of {sub['prompts']} "
                "prompts give another output than AR — with no bf16 rounding to blame, a bug in speculative decoding "
                "(see 'Lossless check').")
    overlap = report.get("overlap") or {}
    if overlap.get("exact") or overlap.get("near"):
        out["warnings"].append(
            f"{overlap['exact']} eval prompts have an exact and {overlap['near']} a near duplicate in the training "
            "prompts: τ on them overstates what unseen prompts get (see 'Eval prompts in the training set').")
    return out


def verdict_text(v: dict) -> str:
    """The verdict as one sentence (the warnings are separate paragraphs)."""
    if not v["methods"]:
        return "No speculative method was run."
    lo, hi = v["responses"]
    per_cell = f"{lo}" if lo == hi else f"{lo}–{hi}"
    if v["best"] is None:
        ranked = sorted(v["methods"].items(), key=lambda kv: (kv[1]["speedup"] is None, -(kv[1]["speedup"] or 0), kv[0]))
        means = ", ".join(f"{lb} {fmt(m['speedup'], '.2f', 'x')}" for lb, m in ranked)
        return (f"No best method: {v['no_best'].removeprefix('no best method is chosen: ')}. Geometric-mean speedups "
                f"over AR: {means}; {per_cell} responses per cell.")
    lossless = DASH if v["lossless"] is None else f"{v['lossless']:.0%}"
    if v.get("lossless_or_rounding") is not None:
        lossless += f" ({v['lossless_or_rounding']:.0%} identical or parting by bf16 rounding)"
    by_bench = v["methods"][v["best"]]["speedup_by_benchmark"]
    per_bench = ", ".join(f"{b} {fmt(x, '.2f', 'x')}" for b, x in sorted(by_bench.items()))
    return (f"Best method: {v['best']} — speedup {fmt(v['speedup'], '.2f', 'x')} over AR (geometric mean over "
            f"{len(by_bench)} benchmark{'s' if len(by_bench) != 1 else ''}: {per_bench}), τ {fmt(v['tau'])}, "
            f"{lossless} of responses identical to AR, {per_cell} responses per cell.")


def per_benchmark_table(report: dict, v: dict) -> Table:
    """benchmark x method: the speedup over AR (disturbed timings marked), the benchmark's fastest method (on at least
    FEW_RESPONSES responses), and the geometric mean over benchmarks per method as the last row."""
    labels = list(v["methods"])
    rows = []
    for b in _distinct(report, "benchmark"):
        row = [b]
        for lb in labels:
            c = _cell(report, b, lb)
            row.append(DASH if c is None else fmt(c.get("speedup"), ".2f", "x")
                       + (" (disturbed)" if timing_disturbed(c) else ""))
        row.append(v["per_benchmark"].get(b, {}).get("best") or DASH)
        rows.append(row)
    rows.append(["geometric mean", *(fmt(v["methods"][lb]["speedup"], ".2f", "x") for lb in labels),
                 v["best"] or DASH])
    return Table(["benchmark", *(f"speedup {lb}" for lb in labels), "fastest"], rows)


# ----------------------------------------------------------------------------------------------
# The tables of one run
# ----------------------------------------------------------------------------------------------


def tau_table(report: dict) -> Table:
    """benchmark x method: per-response mean τ and the speedup over AR (the table `drafter eval` prints)."""
    labels = [lb for lb in _distinct(report, "label") if lb != "ar"]
    rows = []
    for b in _distinct(report, "benchmark"):
        row = [b]
        for lb in labels:
            c = _cell(report, b, lb)
            row.append(DASH if c is None else f"{fmt(c['tau_mean'])} ({fmt(c.get('speedup'), '.2f', 'x')})")
        rows.append(row)
    return Table(["benchmark", *(f"τ {lb} (speedup)" for lb in labels)], rows)


def cells_table(report: dict) -> Table:
    rows = []
    for c in report["cells"]:
        rows.append([
            c["benchmark"], c["label"], c["responses"], c["rounds"], c["new_tokens"],
            fmt(c["tau_mean"]), fmt(c["tau_pooled"]), fmt(c["tokens_per_second"], ".1f"),
            fmt(c.get("speedup"), ".2f", "x"), fmt(c.get("ar_match"), ".0%"),
            fmt((c.get("lossless") or {}).get("identical_or_rounding"), ".0%"),
        ])
    return Table(["benchmark", "method", "responses", "rounds", "new tokens", "τ mean", "τ pooled",
                  "tok/s", "speedup", "same output as AR", "same or rounding"], rows)


# What the lossless columns count; "same" is always token for token at temperature 0.
LOSSLESS_TERMS = (
    "Terms. Same output as AR: the method's generated token ids equal AR's for the same prompt and turn, token for "
    "token (temperature 0, both in the run's dtype). Same or rounding: the same, or parting from AR only where bf16 "
    "rounding decides (a near-tie, or a divergence the fp32 replay does not reproduce); below 100 % is a bug. fp32 "
    "subset, same as fp32 AR (k / n): the first n prompts of the benchmark (eval.fp32_subset; first turn, "
    "eval.max_new_tokens) decoded again by AR and by the method with fp32 copies of the target and the drafter; k "
    "counts the prompts whose method output equals fp32 AR's token for token. With no bf16 rounding left to blame, "
    "k must equal n.")


def lossless_table(report: dict) -> Table:
    """Per speculative cell: responses that differ from AR, how many part at a near-tie (and the largest such gap),
    how many lie beyond the margin, how many of those the fp32 replay puts back on AR's output (rounding), the
    bugs left, and the first bug (else the first divergence beyond the margin)."""
    rows = []
    for c in report["cells"]:
        s = c.get("lossless")
        if not s:
            continue
        ex = (s["bug_examples"] or s["not_near_tie_examples"] or [None])[0]
        sub = s.get("fp32_subset")
        rows.append([c["benchmark"], c["label"], c["responses"], s["divergences"], s["divergences"] - s["not_near_tie"],
                     fmt(s["max_near_tie_gap"], ".3f"), s["not_near_tie"], s["fp32_replay_identical"], s["bugs"],
                     DASH if ex is None else f"{ex['prompt_id']} turn {ex['turn']} @ {ex['position']} "
                                             f"(gap {fmt(ex['gap'], '.2f')}, fp32 replay {ex['fp32_replay'] or DASH})",
                     DASH if not sub else f"{sub['prompts'] - len(sub['not_identical'])} / {sub['prompts']}"])
    return Table(["benchmark", "method", "responses", "differ from AR", "near-tie", "largest near-tie gap",
                  "beyond the margin", "fp32 replay identical", "bugs", "first bug (or beyond the margin)",
                  "fp32 subset: same as fp32 AR"], rows)


def overlap_text(report: dict) -> str:
    o = report.get("overlap")
    if not o:
        return "not checked (eval.overlap_check is off)"
    if o.get("note"):
        return o["note"]
    lines = [f"{o['eval_prompts']} eval prompts against {o['against']} ({o['train_conversations']} conversations): "
             f"{o['exact']} exact, {o['near']} near duplicates (containment of the prompt's word 3-grams >= "
             f"{o['threshold']:.0%})"]
    lines += [f"  {e['eval_id']} in {e['train_id']}: {e['containment']:.0%} ({e['kind']})" for e in o["examples"]]
    return "\n".join(lines)


def phase_table(report: dict) -> Table:
    phases = ("draft", "tree_build", "verify", "walk_commit")
    rows = []
    for c in report["cells"]:
        if c["method"] == "ar" or not c.get("phases"):
            continue
        ph = c["phases"]
        rows.append([c["benchmark"], c["label"], *(
            f"{fmt(ph[p]['seconds'], '.3f')} s ({fmt(ph[p]['share'], '.0%')})" for p in phases)])
    return Table(["benchmark", "method", "draft", "tree build", "verify", "walk + commit"], rows)


def depth_table(report: dict, key: str = "rate") -> Table:
    """benchmark x method: acceptance per draft depth k. key 'rate' = P(accept k | reached k) (conditional);
    'unconditional' = share of drafting rounds that accepted k tokens or more (vLLM's per-position rate)."""
    max_depth = max((len(c["per_depth"]) for c in report["cells"]), default=0)
    rows = []
    for c in report["cells"]:
        if c["method"] == "ar":
            continue
        rates = [fmt(d.get(key), ".2f") for d in c["per_depth"]]
        rows.append([c["benchmark"], c["label"], *rates, *([DASH] * (max_depth - len(rates)))])
    return Table(["benchmark", "method", *(f"d{k}" for k in range(1, max_depth + 1))], rows)


def histogram_table(report: dict) -> Table:
    max_tau = max((len(c["histogram"]) - 1 for c in report["cells"]), default=0)
    rows = []
    for c in report["cells"]:
        if c["method"] == "ar":
            continue
        total = sum(c["histogram"]) or 1
        shares = [f"{n / total:.0%}" for n in c["histogram"][1:]]
        rows.append([c["benchmark"], c["label"], *shares, *([DASH] * (max_tau - len(shares)))])
    return Table(["benchmark", "method", *(f"τ={t}" for t in range(1, max_tau + 1))], rows)


def budget_table(report: dict) -> Table:
    from eval.metrics import tau_vs_budget

    curves = tau_vs_budget(report["cells"])
    budgets = sorted({b for pts in curves.values() for b, _ in pts})
    rows = [[b, *(fmt(dict(pts).get(x)) for x in budgets)] for b, pts in curves.items()]
    return Table(["benchmark", *(f"B={x}" for x in budgets)], rows)


# ----------------------------------------------------------------------------------------------
# Plots (PNG bytes)
# ----------------------------------------------------------------------------------------------


FONT_PT = 10  # every text of a plot, legends included (readable at the size the HTML shows them)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update({key: FONT_PT for key in ("font.size", "axes.labelsize", "axes.titlesize",
                                                         "xtick.labelsize", "ytick.labelsize", "legend.fontsize",
                                                         "figure.titlesize")})
    return plt


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")  # "tight" takes in the legend beside the axes
    _plt().close(fig)
    return buf.getvalue()


def _legend_outside(fig, axes) -> None:
    """One legend to the right of the plot, outside every axes (never over the data): the labels of all `axes`,
    each once, in first-seen order."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:
        right = max(ax.get_position().x1 for ax in axes)
        fig.legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(right + 0.01, 0.95),
                   bbox_transform=fig.transFigure, fontsize=FONT_PT, frameon=False)


def _grouped_bars(groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str) -> bytes:
    return _png(_grouped_bars_figure(groups, series, ylabel, title))


def _grouped_bars_figure(groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str,
                         reference: tuple[float, str] | None = None):
    """Bars per group and series (None -> no bar); `reference` = (y, label) draws a dashed horizontal line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(groups) * max(1, len(series)) / 2), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
    if reference is not None:
        ax.axhline(reference[0], linestyle="--", color="black", linewidth=1, label=reference[1])
    ax.set_xticks(range(len(groups)), groups, rotation=15)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _legend_outside(fig, [ax])
    return fig


def tau_bars_figure(report: dict):
    labels = [lb for lb in _distinct(report, "label") if lb != "ar"]
    benches = _distinct(report, "benchmark")
    series = {lb: [(_cell(report, b, lb) or {}).get("tau_mean") for b in benches] for lb in labels}
    return _grouped_bars_figure(benches, series, "τ (per-response mean)", "Acceptance length τ per benchmark and method")


def plot_tau_bars(report: dict) -> bytes:
    return _png(tau_bars_figure(report))


def tau_vs_budget_figure(report: dict):
    from eval.metrics import tau_vs_budget

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    curves = tau_vs_budget(report["cells"])
    for bench, pts in curves.items():
        line = ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=f"{bench} ddtree")[0]
        chain = _cell(report, bench, "chain")
        if chain and chain.get("tau_mean") is not None:
            ax.axhline(chain["tau_mean"], linestyle="--", color=line.get_color(), alpha=0.6, label=f"{bench} chain")
    ax.set_xscale("log", base=2)
    budgets = sorted({b for pts in curves.values() for b, _ in pts})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("DDTree node budget")
    ax.set_ylabel("τ (per-response mean)")
    ax.set_title("τ vs budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _legend_outside(fig, [ax])
    return fig


def plot_tau_vs_budget(report: dict) -> bytes:
    return _png(tau_vs_budget_figure(report))


def _per_benchmark_axes(n: int):
    plt = _plt()
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.4), squeeze=False)
    return fig, axes[0]


def histograms_figure(report: dict):
    benches = _distinct(report, "benchmark")
    fig, axes = _per_benchmark_axes(len(benches))
    for ax, b in zip(axes, benches):
        cells = [c for c in report["cells"] if c["benchmark"] == b and c["method"] != "ar"]
        width = 0.8 / max(1, len(cells))
        for i, c in enumerate(cells):
            total = sum(c["histogram"]) or 1
            taus = range(1, len(c["histogram"]))
            ax.bar([t + (i - (len(cells) - 1) / 2) * width for t in taus],
                   [c["histogram"][t] / total for t in taus], width, label=c["label"])
        ax.set_title(b)
        ax.set_xlabel("accepted length τ")
        ax.set_ylabel("share of rounds")
    fig.tight_layout()
    _legend_outside(fig, list(axes))
    return fig


def plot_histograms(report: dict) -> bytes:
    return _png(histograms_figure(report))


def speedup_figure(report: dict):
    """Speedup over AR per benchmark and method; the dashed line at 1 is AR's own speed."""
    labels = [lb for lb in _distinct(report, "label") if lb != "ar"]
    benches = _distinct(report, "benchmark")
    series = {lb: [(_cell(report, b, lb) or {}).get("speedup") for b in benches] for lb in labels}
    return _grouped_bars_figure(benches, series, "speedup over AR (×)", "Speedup over autoregressive decoding",
                                reference=(1.0, "AR"))


def plot_speedup(report: dict) -> bytes:
    return _png(speedup_figure(report))


def plot_per_depth(report: dict) -> bytes:
    return _png(per_depth_figure(report))


def per_depth_figure(report: dict):
    """Per benchmark: acceptance at each draft depth, conditional (solid) and unconditional (dashed), one colour
    per method; integer ticks (depths are whole numbers)."""
    benches = _distinct(report, "benchmark")
    fig, axes = _per_benchmark_axes(len(benches))
    for ax, b in zip(axes, benches):
        depth = 0
        for c in report["cells"]:
            if c["benchmark"] != b or c["method"] == "ar":
                continue
            pts = [(d["depth"], d["rate"], d.get("unconditional")) for d in c["per_depth"] if d["rate"] is not None]
            line = ax.plot([k for k, _, _ in pts], [r for _, r, _ in pts], marker="o", label=f"{c['label']} conditional")[0]
            ax.plot([k for k, _, u in pts if u is not None], [u for _, _, u in pts if u is not None], marker="s",
                    linestyle="--", color=line.get_color(), label=f"{c['label']} unconditional")
            depth = max([depth, *(k for k, _, _ in pts)])
        ax.set_xticks(range(1, depth + 1))
        ax.set_ylim(0, 1.05)
        ax.set_title(b)
        ax.set_xlabel("draft depth k")
        ax.set_ylabel("acceptance")
    fig.tight_layout()
    _legend_outside(fig, list(axes))
    return fig


# Every plot of a report, as a figure (the PNGs are these, rendered): tests check their legends and fonts.
FIGURES = (speedup_figure, tau_bars_figure, tau_vs_budget_figure, histograms_figure, per_depth_figure)


# ----------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------

_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:0.6em 0 1.4em;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
    "td:first-child,td:nth-child(2){text-align:left}img{max-width:100%;display:block;margin:0.5em 0 1.5em}"
    "pre{background:#f7f7f7;padding:0.6em}"
)


def html_document(title: str, blocks: list[tuple[str, Any]]) -> str:
    """A standalone HTML page. blocks: ("h2", text) | ("p", text) | ("pre", text) | ("table", Table) | ("png", bytes)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for kind, value in blocks:
        if kind == "table":
            parts.append(value.html())
        elif kind == "png":
            parts.append(f"<img alt='plot' src='data:image/png;base64,{base64.b64encode(value).decode()}'>")
        else:
            parts.append(f"<{kind}>{html.escape(str(value))}</{kind}>")
    parts.append("</body></html>")
    return "".join(parts)


def markdown_document(title: str, blocks: list[tuple[str, Any]]) -> str:
    out = [f"# {title}", ""]
    for kind, value in blocks:
        if kind == "h2":
            out += [f"## {value}", ""]
        elif kind == "table":
            out += [value.markdown(), ""]
        elif kind == "pre":
            out += ["```", str(value), "```", ""]
        elif kind == "p":
            out += [str(value), ""]
    return "\n".join(out)


def _settings_text(report: dict) -> str:
    lines = [f"run: {report.get('run')}"]
    for key in ("target", "drafter", "settings"):
        for k, v in (report.get(key) or {}).items():
            lines.append(f"{key}.{k}: {v}")
    return "\n".join(lines)


def _notes_text(report: dict) -> str:
    lines = []
    paths = sorted({p for c in report["cells"] for p in c.get("verify_paths", [])})
    if paths:  # where the timings (and so the speedups) were measured
        lines.append("verify forward: " + "; ".join(paths))
    drafts = sorted({p for c in report["cells"] for p in c.get("draft_paths", [])})
    if drafts:
        lines.append("drafter forward: " + "; ".join(drafts))
    late = [f"{c['benchmark']} {c['label']}: {c['graphs_captured_while_timed']}" for c in report["cells"]
            if c.get("graphs_captured_while_timed")]
    if late:  # a shape the warm-up did not reach: those rounds' times include a capture
        lines.append("CUDA graphs captured while timing (not steady state): " + ", ".join(late))
    for s in report.get("skipped_methods", []):
        lines.append(f"skipped {cell_label(s['method'], s.get('budget'))}: {s['reason']}")
    for name, b in (report.get("benchmarks") or {}).items():
        skipped = ", ".join(f"{r}={n}" for r, n in b.get("skipped", {}).items()) or "none"
        lines.append(f"{name}: {b.get('prompts')} prompts from {b.get('path')} (records read {b.get('read')}, "
                     f"skipped: {skipped})")
    return "\n".join(lines) or "none"


def verdict_blocks(report: dict) -> list[tuple[str, Any]]:
    v = verdict(report)
    blocks = [("h2", "Verdict"), ("p", verdict_text(v)), *(("p", f"Warning: {w}") for w in v["warnings"])]
    if v["methods"]:
        blocks += [("table", per_benchmark_table(report, v)),
                   ("p", "Speedup = AR time per output token ÷ the method's, AR timed in the same run, each prompt "
                         "decoded by AR and every method in turn (timing noise falls on all alike). The verdict ranks "
                         "methods by the geometric mean of their per-benchmark speedups; a speedup above the cell's τ "
                         f"is impossible and marked disturbed; no method is ranked on fewer than {FEW_RESPONSES} "
                         "responses per cell.")]
    return blocks


def report_blocks(report: dict) -> list[tuple[str, Any]]:
    has_spec = any(c["method"] != "ar" for c in report["cells"])
    has_tree = any(c["method"] == "ddtree" for c in report["cells"])
    has_speedup = any(c.get("speedup") is not None for c in report["cells"] if c["method"] != "ar")
    blocks: list[tuple[str, Any]] = [
        *verdict_blocks(report),
        ("h2", "τ per benchmark and method (speedup over AR in the same run)"), ("table", tau_table(report)),
        ("p", "τ counts the bonus token (1 ≤ τ ≤ block size); τ mean = per-response mean averaged over responses, "
              "τ pooled = all rounds together. speedup = AR time per output token ÷ method time per output token "
              "(decode after prefill)."),
    ]
    if has_speedup:
        blocks += [("png", plot_speedup(report))]
    blocks += [("h2", "All numbers per cell"), ("table", cells_table(report))]
    if has_spec:
        blocks += [("png", plot_tau_bars(report))]
    if has_tree:
        blocks += [("h2", "τ vs DDTree budget"), ("table", budget_table(report)), ("png", plot_tau_vs_budget(report))]
    if has_spec:
        blocks += [
            ("h2", "Accepted-length histogram (share of rounds)"), ("table", histogram_table(report)),
            ("png", plot_histograms(report)),
            ("h2", "Per-position acceptance"),
            ("p", "Conditional: P(accept depth k | depth k reached) — how good the drafter is at depth k once the "
                  "walk got there."), ("table", depth_table(report, "rate")),
            ("p", "Unconditional: share of drafting rounds that accepted k or more tokens — what vLLM reports as "
                  "spec_decode_num_accepted_tokens_per_pos[k-1] / spec_decode_num_drafts."),
            ("table", depth_table(report, "unconditional")),
            ("png", plot_per_depth(report)),
        ]
    if any(c.get("phases") for c in report["cells"] if c["method"] != "ar"):  # only where phase timing was on
        blocks += [("h2", "Time split per phase (summed over rounds)"), ("table", phase_table(report))]
    if any(c.get("lossless") for c in report["cells"]):
        blocks += [("h2", "Lossless check"),
                   ("p", "Each response that differs from AR's is compared at its first differing token with the "
                         "target's fp32 logits: a gap of at most 0.5 logits between the two chosen tokens is a near-tie "
                         "(bf16 rounding picked one of two equally good tokens). A larger gap is replayed: AR and the "
                         "method decode that prompt again in fp32 through the divergence. If they agree, bf16 rounding "
                         "made it; if they differ again, it is a bug."),
                   ("p", LOSSLESS_TERMS),
                   ("table", lossless_table(report))]
    if "overlap" in report:
        blocks += [("h2", "Eval prompts in the training set"), ("pre", overlap_text(report))]
    blocks += [("h2", "Settings"), ("pre", _settings_text(report)),
               ("h2", "Skipped methods and prompts"), ("pre", _notes_text(report))]
    return blocks


def write_report(report: dict, out_dir: Path) -> str:
    """Write report.json, report.md and report.html into `out_dir` (each atomically); return the τ table."""
    out_dir = Path(out_dir)
    report = json_ready({**report, "verdict": verdict(report)})
    title = f"DFlash eval — {report.get('run')}"
    blocks = report_blocks(report)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", markdown_document(title, blocks))
    atomic_write_text(out_dir / "report.html", html_document(title, blocks))
    return tau_table(report).markdown()


def card_results(report: dict) -> str:
    """The model card's results section (`dflash_model.card.write_card_results`): the verdict, the τ and speedup table
    and the settings they were measured under, in markdown."""
    report = json_ready(report)
    v = verdict(report)
    st = report.get("settings") or {}
    lines = [
        f"Measured by `drafter eval` (run `{report.get('run')}`, {time.strftime('%Y-%m-%d')}) with dflash-pipeline's "
        f"evaluator: the HF target on {st.get('device')} ({st.get('dtype')}), temperature {st.get('temperature')}, "
        f"up to {st.get('max_new_tokens')} new tokens. Speedups are this evaluator's, not a serving engine's.",
        "", verdict_text(v), *(f"\n- {w}" for w in v["warnings"]), "",
        "τ (per-response mean acceptance length, bonus token included) and speedup over AR:", "",
        tau_table(report).markdown(),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Comparing runs
# ----------------------------------------------------------------------------------------------


# What a reader of report.json reads (pipeline/records.py shape): the cells' keys and numbers, the run's headers.
REPORT_FIELDS = {"cells": [{"benchmark": STR, "label": STR, "tau_mean": Optional(NUMBER), "speedup": Optional(NUMBER)}],
                 "target": Optional(OBJECT), "drafter": Optional(OBJECT), "settings": Optional(OBJECT)}


def read_report(path: str | Path) -> dict:
    """An eval run's report.json, checked (a damaged one is a DamagedFile naming it and what to run)."""
    path = Path(path)
    return read_record(path, REPORT_FIELDS, repair=f"Delete {path.parent / 'manifest.json'} and run `drafter eval` "
                                                   "again for that run: its decoded units are kept and the report is "
                                                   "written anew")


def _report_path(eval_dir: str | Path) -> Path:
    path = Path(eval_dir)
    path = path if path.name == "report.json" else path / "report.json"
    if not path.is_file():
        raise ConfigError(f"drafter report: {path} does not exist: give runs/<name>/eval directories of finished "
                          "eval runs (run `drafter eval` for that run first)")
    return path


def _check_report_args(eval_dirs: Sequence[str | Path], out: str | Path) -> list[Path]:
    """The report.json of every input; refused before anything is read: fewer than two inputs, an input given
    twice, an output directory that is an input's directory (its report.json would be overwritten) or a file."""
    if len(eval_dirs) < 2:
        raise ConfigError(f"drafter report: {len(eval_dirs)} eval directory given; it compares two or more "
                          "(drafter report runs/a/eval runs/b/eval --out runs/compare)")
    paths = [_report_path(d) for d in eval_dirs]
    seen: dict[Path, str] = {}
    for d, p in zip(eval_dirs, paths):
        key = p.resolve()
        if key in seen:
            raise ConfigError(f"drafter report: {d} and {seen[key]} are the same eval run; give each run once")
        seen[key] = str(d)
    target = Path(out).resolve()
    for d, p in zip(eval_dirs, paths):
        if target == p.parent.resolve():
            raise ConfigError(f"drafter report: --out {out} is the input {d}: the comparison would overwrite that "
                              "run's report.json; give another directory (e.g. runs/compare)")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"drafter report: --out {out} is a file, not a directory")
    return paths


def _run_names(reports: list[dict], dirs: Sequence[str | Path]) -> list[str]:
    names = [str(r.get("run") or Path(d).parent.name) for r, d in zip(reports, dirs)]
    if len(set(names)) < len(names):  # same run name twice: tell them apart by directory
        names = [f"{n} ({d})" for n, d in zip(names, dirs)]
    return names


def compare_runs(eval_dirs: Sequence[str | Path], out: str | Path) -> str:
    """Side-by-side τ and speedup of two or more eval runs -> <out>/report.md + report.html; returns the table."""
    reports = [read_report(p) for p in _check_report_args(eval_dirs, out)]
    names = _run_names(reports, eval_dirs)
    keys: list[tuple[str, str]] = []
    for r in reports:
        for c in r["cells"]:
            if (c["benchmark"], c["label"]) not in keys:
                keys.append((c["benchmark"], c["label"]))
    rows = []
    for bench, label in keys:
        row = [bench, label]
        for r in reports:
            c = _cell(r, bench, label)
            row.append(DASH if c is None else f"{fmt(c['tau_mean'])} ({fmt(c.get('speedup'), '.2f', 'x')})")
        rows.append(row)
    table = Table(["benchmark", "method", *(f"τ {n} (speedup)" for n in names)], rows)
    settings = Table(
        ["run", "eval dir", "target", "drafter", "temperature", "max new tokens"],
        [[n, str(d), (r.get("target") or {}).get("model", DASH), (r.get("drafter") or {}).get("path", DASH),
          (r.get("settings") or {}).get("temperature", DASH), (r.get("settings") or {}).get("max_new_tokens", DASH)]
         for n, r, d in zip(names, reports, eval_dirs)],
    )
    spec_keys = [k for k in keys if k[1] != "ar"]
    series = {n: [(_cell(r, b, lb) or {}).get("tau_mean") for b, lb in spec_keys] for n, r in zip(names, reports)}
    blocks: list[tuple[str, Any]] = [
        ("h2", "Runs"), ("table", settings),
        ("h2", "τ (per-response mean) and speedup over each run's own AR"), ("table", table),
    ]
    if spec_keys:
        blocks.append(("png", _grouped_bars([f"{b}\n{lb}" for b, lb in spec_keys], series, "τ", "τ by run")))
    out = Path(out)
    title = "DFlash eval comparison — " + " vs ".join(names)
    atomic_write_text(out / "report.md", markdown_document(title, blocks))
    atomic_write_text(out / "report.html", html_document(title, blocks))
    atomic_write_json(out / "report.json", {"runs": names, "eval_dirs": [str(d) for d in eval_dirs],
                                            "headers": table.headers, "rows": table.rows})
    return table.markdown()
