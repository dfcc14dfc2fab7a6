"""`drafter plan`: storage estimates consistent with docs/storage.md (5 taps x D x 2 bytes per token)."""

from __future__ import annotations

from pathlib import Path

from drafter.cli import main as drafter_main
from drafter.plan import estimate
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_qwen36_27b_features_are_5_taps_x_5120_x_2_bytes_and_tens_of_tb():
    cfg = load_config(REPO / "configs/qwen3.6-27b.yaml")
    est = estimate(cfg)
    assert est["samples"] == 913_000
    # 5 x 5120 x 2 bytes of features (+ 4-byte id and 1-byte mask stored alongside)
    assert est["feature_bytes_per_token"] == 5 * 5120 * 2 + 5
    assert est["storage_bytes"] == est["total_tokens"] * est["feature_bytes_per_token"]
    assert 10e12 < est["storage_bytes"] < 200e12
    assert abs(est["drafter_params"] - 1.73e9) / 1.73e9 < 0.02  # docs/drafter.md, "Shapes": ~1.73B for the Qwen3.6-27B drafter


def test_qwen3_8b_drafter_is_about_1_05b_params():
    est = estimate(load_config(REPO / "configs/qwen3-8b.yaml"))
    assert abs(est["drafter_params"] - 1.05e9) / 1.05e9 < 0.02


def test_fp8_halves_the_feature_bytes():
    bf16 = estimate(load_config(REPO / "configs/qwen3-8b.yaml"))["feature_bytes_per_token"]
    fp8 = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["extract.storage_dtype=fp8"]))["feature_bytes_per_token"]
    assert 0.49 < fp8 / bf16 < 0.52


def test_plan_bytes_per_token_is_the_storage_formats_own():
    from extract.store import bytes_per_token

    for dtype in ("bfloat16", "float32", "fp8"):
        est = estimate(load_config(REPO / "configs/qwen3-8b.yaml", [f"extract.storage_dtype={dtype}"]))
        assert est["feature_bytes_per_token"] == bytes_per_token(est["taps"], est["hidden_size"], dtype)


def test_plan_cli_prints_storage_in_tb(capsys):
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3.6-27b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "5 taps x 5120 x bfloat16 = 51,205 bytes" in out
    assert " TB)" in out and "GPU-hours" in out
