"""The eval report leads with its verdict (best method, speedup, τ, lossless share, responses per cell, plain
warnings), shows per-position acceptance both ways (conditional and vLLM's unconditional), plots the speedup, and
ticks the per-depth axis at whole depths — in report.json, report.md and report.html alike."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_report_files import B, make_report, records  # noqa: E402

from eval.metrics import per_depth_acceptance  # noqa: E402
from eval.report import FEW_RESPONSES, per_depth_figure, verdict, write_report  # noqa: E402


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

    lossy = make_report("r", [[2]], [[3]])
    lossy["cells"][1]["ar_match"] = 0.5  # gsm8k chain
    assert any(w.startswith("chain: only 75% of responses equal AR") for w in verdict(lossy)["warnings"])


def test_every_document_opens_with_the_verdict_and_its_warnings(tmp_path):
    report = scaled(make_report("run-v", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]]), 0.2)
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["verdict"]["best"] == "ddtree@16" and len(data["verdict"]["warnings"]) == 2
    md = (tmp_path / "report.md").read_text()
    assert md.split("\n## ")[1].startswith("Verdict\n")
    first = md.split("\n## ")[1]
    assert re.search(r"Best method: ddtree@16 — speedup 0\.\d\dx over AR, τ \d\.\d\d, 100% of responses identical "
                     r"to AR, 2 responses per cell\.", first)
    assert "Warning: Speculation does not pay off here" in first and "Warning: Cells rest on as few as 2" in first
    page = (tmp_path / "report.html").read_text()
    assert re.findall(r"<h2>(.*?)</h2>", page)[0] == "Verdict"
    assert page.index("Warning: Speculation does not pay off") < page.index("<table>")


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
