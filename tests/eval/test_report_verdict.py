"""The eval report leads with its verdict (best method by the geometric mean of per-benchmark speedups, each
benchmark's fastest, τ, lossless share, responses per cell, plain warnings), flags a speedup above its τ as disturbed
timing and leaves it out, chooses no best method on fewer than 10 responses per cell and says why, shows
per-position acceptance both ways (conditional and vLLM's unconditional), plots the speedup with legends beside the
axes and every text at 10 pt or more, and ticks the per-depth axis at whole depths — in report.json, report.md and
report.html alike."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_report_files import B, make_report, records  # noqa: E402

from eval.metrics import per_depth_acceptance  # noqa: E402
from eval.metrics import speedup, summarize  # noqa: E402
from eval.report import (FEW_RESPONSES, FIGURES, FONT_PT, geometric_mean, per_depth_figure, timing_disturbed,  # noqa: E402
                         verdict, verdict_text, write_report)


def scaled(report: dict, factor: float) -> dict:
    """The same report with every speedup multiplied by `factor`."""
    for c in report["cells"]:
        if c.get("speedup") is not None and c["method"] != "ar":
            c["speedup"] *= factor
    return report


def with_responses(report: dict, n: int) -> dict:
    for c in report["cells"]:
        c["responses"] = n
    return report


def test_verdict_picks_the_fastest_method_and_warns_only_when_it_should():
    report = with_responses(make_report("r", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 50)
    v = verdict(report)
    speedups = {c["label"]: c["speedup"] for c in report["cells"] if c["benchmark"] == "gsm8k"}
    assert v["best"] == max((lb for lb in speedups if lb != "ar"), key=speedups.get) == "ddtree@16"
    assert v["speedup"] == pytest.approx(speedups["ddtree@16"])  # the same on both benchmarks here
    assert v["lossless"] == 1.0 and v["responses"] == [50, 50] and v["warnings"] == []

    slow = verdict(scaled(with_responses(make_report("r", [[3, 2, 1], [4]], [[5, 3]]), 50), 0.2))
    assert slow["speedup"] < 1 and len(slow["warnings"]) == 1 and "slower than AR" in slow["warnings"][0]

    few = verdict(make_report("r", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]))  # 2 responses per cell
    assert few["responses"][0] == 2 < FEW_RESPONSES
    assert any(f"as few as 2 responses (fewer than {FEW_RESPONSES})" in w for w in few["warnings"])
    assert few["best"] is None and "cannot rank the methods" in few["no_best"]

    lossy = make_report("r", [[2]], [[3]])
    lossy["cells"][1]["ar_match"] = 0.5  # gsm8k chain
    assert any(w.startswith("chain: only 75% of responses equal AR") for w in verdict(lossy)["warnings"])


def test_every_document_opens_with_the_verdict_and_its_warnings(tmp_path):
    report = scaled(with_responses(make_report("run-v", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 12), 0.2)
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["verdict"]["best"] == "ddtree@16" and len(data["verdict"]["warnings"]) == 1
    md = (tmp_path / "report.md").read_text()
    assert md.split("\n## ")[1].startswith("Verdict\n")
    first = md.split("\n## ")[1]
    assert re.search(r"Best method: ddtree@16 — speedup 0\.\d\dx over AR \(geometric mean over 2 benchmarks: gsm8k "
                     r"0\.\d\dx, mt_bench 0\.\d\dx\), τ \d\.\d\d, 100% of responses identical to AR, 12 responses "
                     r"per cell\.", first)
    assert "Warning: Speculation does not pay off here" in first
    assert "| geometric mean | 0.40x | 0.50x | 0.57x | ddtree@16 |" in first  # the per-benchmark table
    page = (tmp_path / "report.html").read_text()
    assert re.findall(r"<h2>(.*?)</h2>", page)[0] == "Verdict"
    assert page.index("Warning: Speculation does not pay off") < page.index("<table>")


def test_the_verdict_is_the_geometric_mean_of_per_benchmark_speedups_with_each_benchmarks_fastest():
    report = with_responses(make_report("r", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 20)
    for c in report["cells"]:  # chain: 0.5x on gsm8k, 2x on mt_bench (arithmetic mean 1.25, geometric 1.0)
        if c["label"] == "chain":
            c["speedup"] = {"gsm8k": 0.5, "mt_bench": 2.0}[c["benchmark"]]
        if c["label"] == "ddtree@16" and c["benchmark"] == "gsm8k":
            c["speedup"] = 1.2
    v = verdict(report)
    assert v["methods"]["chain"]["speedup"] == pytest.approx(1.0) == geometric_mean([0.5, 2.0])
    assert v["methods"]["chain"]["speedup_by_benchmark"] == {"gsm8k": 0.5, "mt_bench": 2.0}
    assert v["per_benchmark"]["gsm8k"]["best"] == "ddtree@4" and v["per_benchmark"]["mt_bench"]["best"] == "ddtree@16"
    ddtree16 = geometric_mean([1.2, v["methods"]["ddtree@16"]["speedup_by_benchmark"]["mt_bench"]])
    assert v["methods"]["ddtree@16"]["speedup"] == pytest.approx(ddtree16)
    assert v["best"] == max(v["methods"], key=lambda lb: v["methods"][lb]["speedup"])


def test_a_speedup_above_its_tau_is_flagged_as_disturbed_timing_and_left_out_of_the_verdict(tmp_path):
    """AR on gsm8k timed while the machine was busy (10x slower per token than on mt_bench): the methods' gsm8k
    speedups exceed their τ, which no speculative decoder can reach."""
    report = with_responses(make_report("run-d", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 20)
    busy_ar = records([[1] * 12, [1] * 9], 0.2)  # AR's time per token, disturbed
    for c in report["cells"]:
        if c["benchmark"] == "gsm8k" and c["method"] != "ar":
            recs = records([[3, 2, 1], [4]] if c["method"] == "chain" else [[5, 3], [8, 2, 2]], 0.008)
            c.update(summarize(recs, max_tau=B), speedup=speedup(busy_ar, recs), responses=20)
    gsm8k = {c["label"]: c for c in report["cells"] if c["benchmark"] == "gsm8k" and c["method"] != "ar"}
    assert all(c["speedup"] > c["tau_mean"] and timing_disturbed(c) for c in gsm8k.values())
    mt = {c["label"]: c for c in report["cells"] if c["benchmark"] == "mt_bench" and c["method"] != "ar"}
    assert not any(timing_disturbed(c) for c in mt.values())

    v = verdict(report)
    assert {(d["benchmark"], d["method"]) for d in v["disturbed"]} == {("gsm8k", lb) for lb in gsm8k}
    for lb, m in v["methods"].items():  # only mt_bench's trustworthy speedups count
        assert m["speedup"] == pytest.approx(mt[lb]["speedup"])
    assert v["per_benchmark"]["gsm8k"]["best"] is None
    warnings = [w for w in v["warnings"] if w.startswith("Disturbed timing: gsm8k")]
    assert len(warnings) == len(gsm8k) and "above its τ" in warnings[0] and "left out of the verdict" in warnings[0]
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    verdict_section = md.split("\n## ")[1]
    assert "Warning: Disturbed timing: gsm8k chain shows a speedup of" in verdict_section
    assert f"{gsm8k['chain']['speedup']:.2f}x (disturbed)" in verdict_section
    assert json.loads((tmp_path / "report.json").read_text())["verdict"]["disturbed"][0]["benchmark"] == "gsm8k"


def test_no_best_method_is_chosen_on_fewer_than_ten_responses_and_the_report_says_why(tmp_path):
    report = with_responses(make_report("run-f", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 20)
    report["cells"][1]["responses"] = FEW_RESPONSES - 1  # gsm8k chain: one cell short
    v = verdict(report)
    assert v["best"] == "ddtree@16"  # chain is not eligible; the DDTree cells are
    few = with_responses(make_report("run-f", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), FEW_RESPONSES - 1)
    v = verdict(few)
    assert v["best"] is None and v["speedup"] is None
    text = verdict_text(v)
    assert text.startswith(f"No best method: the cells rest on as few as {FEW_RESPONSES - 1} responses (fewer than "
                           f"{FEW_RESPONSES})") and "Geometric-mean speedups over AR: ddtree@16 2.86x, ddtree@4 2.50x, chain 2.00x" in text
    write_report(few, tmp_path)
    assert text in (tmp_path / "report.md").read_text().split("\n## ")[1]


def test_plots_have_their_legend_beside_the_axes_and_every_text_at_10pt_or_more():
    report = make_report("run-p", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]])
    assert FONT_PT >= 10
    for figure in FIGURES:
        fig = figure(report)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        assert legends, figure.__name__
        axes_right = max(ax.get_window_extent(renderer).x1 for ax in fig.axes)
        for legend in legends:
            assert legend.get_window_extent(renderer).x0 >= axes_right, figure.__name__  # outside, never over data
            assert all(t.get_fontsize() >= 10 for t in legend.get_texts()), figure.__name__
        for ax in fig.axes:
            texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]
            assert all(t.get_fontsize() >= 10 for t in texts if t.get_text()), figure.__name__


def test_per_position_acceptance_is_reported_conditionally_and_as_vllm_counts_it(tmp_path):
    recs = records([[3, 2, 1], [4]], 0.01)  # accepted drafts per round: 2, 1, 0 | 3
    per_depth = per_depth_acceptance(recs, B - 1)
    assert [d["rate"] for d in per_depth[:4]] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 0 / 1])
    assert [d["unconditional"] for d in per_depth[:4]] == pytest.approx([3 / 4, 2 / 4, 1 / 4, 0 / 4])
    write_report(make_report("run-p", [[3, 2, 1], [4]], [[5, 3]]), tmp_path)
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Per-position acceptance")[1].split("\n## ")[0]
    assert "Conditional: P(accept depth k | depth k reached)" in section and "spec_decode_num_drafts" in section
    assert "| gsm8k | chain | 0.75 | 0.67 | 0.50 | 0.00 |" in section  # conditional
    assert "| gsm8k | chain | 0.75 | 0.50 | 0.25 | 0.00 | 0.00 | 0.00 | 0.00 |" in section  # unconditional


def test_speedup_is_plotted_and_depth_ticks_are_whole_numbers(tmp_path):
    report = make_report("run-s", [[3, 2, 1], [4]], [[5, 3]])
    fig = per_depth_figure(report)
    for ax in fig.axes:
        assert list(ax.get_xticks()) == list(range(1, B))
        assert {line.get_linestyle() for line in ax.get_lines()} == {"-", "--"}  # conditional + unconditional
    write_report(report, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5  # speedup, τ bars, τ vs budget, histograms, per-depth
    no_timing = make_report("run-n", [[2]], [[3]])
    for c in no_timing["cells"]:
        c["speedup"] = None
    write_report(no_timing, tmp_path / "n")
    assert (tmp_path / "n" / "report.html").read_text().count("data:image/png;base64,") == 4
