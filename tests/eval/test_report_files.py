"""Eval reports: report.json is strict JSON with every number, report.html is self-contained (plots as
base64 PNGs, nothing fetched from elsewhere), and `drafter report` compares eval dirs side by side."""

from __future__ import annotations

import base64
import json
import re

import pytest

from eval.metrics import ResponseRecord, speedup, summarize
from eval.report import compare_runs, write_report
from drafter.cli import main as drafter_main
from pipeline.config import ConfigError

B = 8


PHASES = {"draft": 0.1, "tree_build": 0.02, "verify": 0.3, "walk_commit": 0.05}


def records(taus_per_response, seconds_per_token, phases=PHASES):
    out = []
    for i, taus in enumerate(taus_per_response):
        n = sum(taus)
        out.append(ResponseRecord(
            prompt_id=f"p{i}", turn=0, prompt_tokens=20, num_new_tokens=n, num_rounds=len(taus),
            accept_lengths=list(taus), draft_depths=[B - 1] * len(taus), decode_seconds=n * seconds_per_token,
            prefill_seconds=0.01,
            phase_seconds=dict(phases),
        ))
    return out


def make_report(run: str, chain_taus, tree_taus, phases=PHASES) -> dict:
    ar = records([[1] * 12, [1] * 9], 0.02, phases)
    groups = {("ar", None): ar, ("chain", None): records(chain_taus, 0.01, phases),
              ("ddtree", 4): records(tree_taus, 0.008, phases), ("ddtree", 16): records(tree_taus[::-1], 0.007, phases)}
    cells = []
    for bench in ("gsm8k", "mt_bench"):
        for (method, budget), recs in groups.items():
            cells.append({"benchmark": bench, "method": method, "budget": budget,
                          "label": method if budget is None else f"{method}@{budget}",
                          **summarize(recs, max_tau=B), "speedup": speedup(ar, recs), "ar_match": 1.0})
    return {
        "run": run, "target": {"model": "random:qwen3"}, "drafter": {"path": "x", "block_size": B},
        "settings": {"temperature": 0.0, "max_new_tokens": 32},
        "benchmarks": {"gsm8k": {"path": "g.jsonl", "prompts": 2, "read": 3, "skipped": {"missing_question": 1}}},
        "skipped_methods": [{"method": "ddtree", "budget": 64, "reason": "hybrid target"}],
        "cells": cells,
    }


def assert_self_contained(page: str) -> None:
    assert "href=" not in page.lower()
    srcs = re.findall(r"src\s*=\s*['\"]([^'\"]*)", page, flags=re.I)
    assert srcs, "no plots embedded"
    for s in srcs:
        assert s.startswith("data:image/png;base64,")
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<link" not in page.lower() and "<script" not in page.lower() and "@import" not in page


def test_report_files_are_written_with_every_number_and_a_self_contained_html(tmp_path):
    rep = make_report("run-a", [[3, 2, 1], [4]], [[5, 3], [8, 2, 2]])
    rep["cells"][0]["tau_mean"] = float("nan")  # AR has no drafted rounds in some decoders: NaN must not leak
    table = write_report(rep, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert data["cells"][0]["tau_mean"] is None
    chain = next(c for c in data["cells"] if c["benchmark"] == "gsm8k" and c["label"] == "chain")
    assert chain["tau_mean"] == pytest.approx((2 + 4) / 2) and chain["tau_pooled"] == pytest.approx(10 / 4)
    assert chain["histogram"] == [0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert chain["speedup"] == pytest.approx(2.0)
    md = (tmp_path / "report.md").read_text()
    assert table in md and "| gsm8k | 3.00 (2.00x) |" in table
    for heading in ("τ vs DDTree budget", "Accepted-length histogram", "Per-position acceptance",
                    "Time split per phase", "skipped ddtree@64: hybrid target", "missing_question=1"):
        assert heading in md
    page = (tmp_path / "report.html").read_text()
    assert_self_contained(page)
    assert page.count("data:image/png;base64,") == 5  # speedup, τ bars, τ vs budget, histograms, per-depth


def test_the_time_split_includes_the_drafter_and_is_left_out_when_phases_were_not_timed(tmp_path):
    write_report(make_report("timed", [[3, 2]], [[5, 3]]), tmp_path / "timed")
    md = (tmp_path / "timed" / "report.md").read_text()
    split = md[md.index("Time split per phase"):]
    assert "| benchmark | method | draft | tree build | verify | walk + commit |" in split
    assert "| gsm8k | chain | 0.100 s (21%) |" in split  # the drafter's share of the 0.47 s round time
    assert "captured while timing" not in md
    late = make_report("late", [[3, 2]], [[5, 3]])
    late["cells"][1]["graphs_captured_while_timed"] = 2  # gsm8k chain met a shape its warm-up did not reach
    write_report(late, tmp_path / "late")
    assert "CUDA graphs captured while timing (not steady state): gsm8k chain: 2" in \
        (tmp_path / "late" / "report.md").read_text()
    write_report(make_report("untimed", [[3, 2]], [[5, 3]], phases={}), tmp_path / "untimed")
    data = json.loads((tmp_path / "untimed" / "report.json").read_text())
    assert all(c["phases"] is None for c in data["cells"])
    assert "Time split per phase" not in (tmp_path / "untimed" / "report.md").read_text()


def test_compare_runs_puts_two_eval_dirs_side_by_side(tmp_path, capsys):
    a, b = tmp_path / "a" / "eval", tmp_path / "b" / "eval"
    write_report(make_report("drafter-a", [[3, 2, 1], [4]], [[5, 3]]), a)
    write_report(make_report("drafter-b", [[6, 6], [7]], [[8, 8]]), b)
    out = tmp_path / "cmp"
    table = compare_runs([a, b], out)
    assert table.splitlines()[0] == "| benchmark | method | τ drafter-a (speedup) | τ drafter-b (speedup) |"
    assert "| gsm8k | chain | 3.00 (2.00x) | 6.50 (2.00x) |" in table
    assert table in (out / "report.md").read_text()
    assert_self_contained((out / "report.html").read_text())
    # the CLI entry point prints the same table
    assert drafter_main(["report", str(a), str(b), "--out", str(tmp_path / "cmp2")]) == 0
    assert table in capsys.readouterr().out


def test_compare_runs_refuses_a_missing_eval_dir(tmp_path):
    write_report(make_report("a", [[2]], [[3]]), tmp_path / "a")
    with pytest.raises(ConfigError, match="run `drafter eval`"):
        compare_runs([tmp_path / "a", tmp_path / "missing"], tmp_path / "out")
