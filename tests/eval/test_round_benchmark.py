"""benchmarks/bench_round.py (the full round against an AR step) runs at tiny sizes on CPU in both modes and
writes the summary JSON the docs record, so the GPU run at the Qwen3-8B shape / with a trained drafter uses
code that already ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from extract.layers import configured_layer_ids
from pipeline.config import load_config
from pipeline.target import load_tokenizer, materialize_target
from tests.conftest import CACHE, REPO, synthetic_records, write_records
from dflash_model.export import export_zlab
from dflash_model.model import DFlashDrafter, DrafterArgs


def run_bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTER_NO_PROGRESS": "1", **(env or {})}
    return subprocess.run([sys.executable, "benchmarks/bench_round.py", "--device", "cpu", "--repeats", "1", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_shape_mode_prints_every_method_and_writes_the_summary_keys(tmp_path):
    out = tmp_path / "tiny.json"
    res = run_bench("--shape", "tiny", "--budgets", "4,16", "--past", "40", "--new-tokens", "12", "--out", str(out),
                    "--profile-drafter", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    labels = [line.split()[0] for line in res.stdout.splitlines() if line.split()[:1] in (["ar"], ["chain"],
                                                                                         ["ddtree@4"], ["ddtree@16"])]
    assert labels == ["ar", "chain", "ddtree@4", "ddtree@16"]
    summary = json.loads(out.read_text())["tiny"]
    assert set(summary["verify_ms"]) == {"4", "16"} and set(summary["round_ms"]) == {"4", "16", "chain"}
    assert summary["ar_step_ms"] > 0 and summary["drafter_ms"] > 0 and summary["overhead_ms"] > 0
    assert summary["host_syncs_per_round"] is None  # counted on CUDA only
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["ddtree@16"]["draft_path"] == "static context, eager" and rows["ar"]["draft_path"] == ""
    assert all(r["graphs_captured_while_timed"] == 0 and not r["graph_fallbacks"] for r in summary["rows"])
    prof = summary["drafter_profile"]  # where a draft step's time goes (CPU ops here, CUDA kernels on a GPU)
    assert prof["steps"] == 3 and prof["past"] == 40 and prof["kernels_per_step"] > 10
    assert 0 < prof["kernel_ms"] and 0 < prof["step_wall_ms"] and prof["weight_bytes"] > 0
    assert any(k["kernel"] == "aten::mm" for k in prof["top"]) and "draft step profile" in res.stdout


@pytest.mark.slow
def test_export_mode_decodes_gsm8k_prompts_with_a_trained_drafter_layout(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", [f"cache_dir={CACHE}"])
    location = materialize_target(cfg.target, cfg.cache_dir)
    target_config = AutoConfig.from_pretrained(location)
    args = DrafterArgs.from_run_config(cfg, target_config, len(load_tokenizer(location, cfg.target)),
                                       layer_ids=configured_layer_ids(cfg.extract, target_config.num_hidden_layers))
    torch.manual_seed(0)
    export_zlab(DFlashDrafter(args), args, tmp_path / "export")
    out = tmp_path / "export.json"
    mirror = tmp_path / "mirror"  # GSM8K test's mirror file name, made-up word problems in it
    write_records(mirror / "gsm8k_test.jsonl", synthetic_records("gsm8k", 4))
    res = run_bench("--config", "configs/tiny.yaml", "--export", str(tmp_path / "export"), "--budgets", "4",
                    "--prompts", "2", "--new-tokens", "8", "--name", "tiny_export", "--out", str(out),
                    env={"DRAFTER_DATA_DIR": str(mirror)})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(out.read_text())["tiny_export"]
    assert set(summary["round_ms"]) == {"4", "chain", "ddtree@4"}
    assert summary["speedup_gsm8k"] > 0 and summary["tau_gsm8k"] >= 1.0
    assert "GSM8K prompts" in res.stdout
