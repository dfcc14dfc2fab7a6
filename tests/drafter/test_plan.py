"""`drafter plan`: storage estimates consistent with docs/storage.md (5 taps x D x 2 bytes per token), checkpoints
counted, online training without feature storage, wall-clock per stage for `--gpus N`, and every rate printed with
its source (`rate_for`, the one lookup)."""

from __future__ import annotations

from pathlib import Path

from drafter.cli import main as drafter_main
import pytest

from drafter.plan import STAGES, estimate, rate_for, target_shape
from pipeline.config import ConfigError, load_config
from train.checkpoint import KEEP

REPO = Path(__file__).resolve().parents[2]


def test_qwen36_27b_features_are_5_taps_x_5120_x_2_bytes_and_tens_of_tb():
    cfg = load_config(REPO / "configs/qwen3.6-27b.yaml")
    est = estimate(cfg)
    assert est["samples"] == 913_000
    # 5 x 5120 x 2 bytes of features (+ 4-byte id and 1-byte mask stored alongside)
    assert est["feature_bytes_per_token"] == 5 * 5120 * 2 + 5
    assert est["feature_bytes"] == est["total_tokens"] * est["feature_bytes_per_token"]
    assert 10e12 < est["feature_bytes"] < 200e12
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


def test_plan_with_gpus_prints_each_stages_wall_clock_and_every_rate_with_its_source(capsys):
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3-8b.yaml"), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    est = estimate(load_config(REPO / "configs/qwen3-8b.yaml"), gpus=8)
    wall = next(line for line in out.splitlines() if line.strip().startswith("offline") and line.endswith(" h"))
    for stage in ("regen", "extract", "train", "eval"):
        assert f"{stage} {est['wall_hours'][stage]:,.1f} h" in wall or est["wall_hours"][stage] < 1
    assert f"total {sum(est['wall_hours'].values()):,.1f} h" in wall
    assert est["wall_hours"]["regen"] == pytest.approx(est["gpu_hours"]["regen"] / 8)  # 8 engines of one GPU
    rates = out.split("rates (one GPU, and where each comes from):\n")[1].splitlines()
    for stage, line in zip(STAGES, rates):
        assert line.split()[0] == stage and est["rate_sources"][stage] in line
    assert "assumed MFU 0.05" in rates[0] and "measured: " in rates[1] and "measured: " in rates[2]
    assert "assumed batch-1 decode" in rates[3]
    scaling = out.split("    scaling:\n")[1].splitlines()
    assert [line.split()[0] for line in scaling[:4]] == list(STAGES)


def test_every_rate_comes_from_rate_for_and_hours_are_its_work_over_it():
    cfg = load_config(REPO / "configs/qwen3-8b.yaml")
    est, shape = estimate(cfg), target_shape(cfg)
    for stage in STAGES:
        rate = rate_for(cfg, shape, stage)
        assert est["rate_sources"][stage] == rate.source
        assert est["gpu_hours"][stage] == pytest.approx(rate.hours(est["tokens"][stage], est["flops"][stage]))
        if rate.tok_s is None:  # an assumption: FLOPs over the assumed FLOP/s
            assert est["gpu_hours"][stage] == pytest.approx(est["flops"][stage] / rate.flops_per_s / 3600)
        else:  # a calibration row: tokens over the measured tokens/s
            assert est["gpu_hours"][stage] == pytest.approx(est["tokens"][stage] / rate.tok_s / 3600)


def test_online_training_stores_no_features_and_runs_the_target_in_the_step(capsys):
    offline = estimate(load_config(REPO / "configs/qwen3-8b.yaml"))
    online = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["train.online=true"]))
    assert offline["feature_bytes"] > 40e12 and online["feature_bytes"] == 0 and online["gpu_hours"]["extract"] == 0
    assert online["gpu_hours"]["train"] > offline["gpu_hours"]["train"]  # the target's forward in every step
    assert online["storage_bytes"] == online["checkpoint_bytes"] + online["export_bytes"]
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3-8b.yaml"), "train.online=true"]) == 0
    out = capsys.readouterr().out
    assert "feature storage         none: train.online=true" in out and "note: features this large" not in out


def test_checkpoints_and_the_export_are_counted_in_storage():
    est = estimate(load_config(REPO / "configs/qwen3-8b.yaml"))
    params = est["drafter_params"]
    # bf16 weights + fp32 master + two fp32 AdamW moments, KEEP checkpoints kept and one being written
    assert est["checkpoint_bytes"] == params * (2 + 4 + 8) * (KEEP + 1)
    assert est["export_bytes"] == params * 2
    assert est["storage_bytes"] == est["feature_bytes"] + est["checkpoint_bytes"] + est["export_bytes"]
    fp32 = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["train.precision=fp32"]))
    assert fp32["checkpoint_bytes"] == params * (4 + 8) * (KEEP + 1) and fp32["export_bytes"] == params * 4
    best = estimate(load_config(REPO / "configs/qwen3-8b.yaml", ["train.keep_best=true"]))  # train/best/ + its copy
    assert best["export_bytes"] == params * 2 * 2 and best["checkpoint_bytes"] == est["checkpoint_bytes"]


def test_an_engine_wider_than_the_gpus_is_refused_and_eval_uses_at_most_its_units():
    cfg = load_config(REPO / "configs/qwen3-8b.yaml", ["regen.vllm.tensor_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"regen\.vllm\.tensor_parallel_size: 4 GPUs per engine, but --gpus is 2"):
        estimate(cfg, gpus=2)
    est = estimate(cfg, gpus=6)  # one engine of 4 GPUs; 2 idle
    assert est["wall_hours"]["regen"] == pytest.approx(est["gpu_hours"]["regen"] / 4)
    tiny = load_config(REPO / "configs/qwen3-8b.yaml", ["eval.methods=[ar]"])  # 3 benchmarks x 1 decoder = 3 units
    est = estimate(tiny, gpus=8)
    assert est["wall_hours"]["eval"] == pytest.approx(est["gpu_hours"]["eval"] / 3)


def test_training_memory_per_gpu_shows_the_27b_online_run_past_one_80gb_card_and_within_it_over_8_gpus(capsys):
    """Before activations, online training of the Qwen3.6-27B drafter holds the bf16 target (2 x 27.0B bytes) and 18
    bytes per drafter parameter (bf16 weights, fp32 gradient, fp32 master + AdamW moments): more than an 80 GB card.
    ZeRO-2 over 8 GPUs splits the gradients and optimizer state (2 + 16/8 bytes a parameter), ZeRO-3 the weights too;
    offline holds the target's embedding and LM head instead of the whole target."""
    path = str(REPO / "configs/qwen3.6-27b.yaml")
    one = estimate(load_config(path, ["train.online=true"]))
    params, m = one["drafter_params"], one["train_memory"]
    assert m["online"] == pytest.approx(2 * 27.0e9 + 18 * params) and m["online"] > 80e9
    assert m["offline"] == pytest.approx(18 * params + 2 * 2 * 248320 * 5120) and (m["zero_stage"], m["gpus"]) == (0, 1)
    eight = estimate(load_config(path, ["train.online=true"]), gpus=8)["train_memory"]
    assert eight["zero_stage"] == 2 and eight["online"] == pytest.approx(2 * 27.0e9 + (2 + 16 / 8) * params)
    assert eight["online"] < 79e9
    zero3 = estimate(load_config(path, ["train.online=true", "train.zero_stage=3"]), gpus=8)["train_memory"]
    assert zero3["drafter_state"] == pytest.approx(18 / 8 * params)
    assert drafter_main(["plan", "--config", path, "train.online=true"]) == 0
    out = capsys.readouterr().out
    assert f"train memory / GPU      online {m['online'] / 1e9:,.1f} GB" in out and "ZeRO-0 over 1 GPU(s)" in out
    assert "note: this config's training holds 85.1 GB per GPU before activations, more than an 80 GB card" in out
    assert drafter_main(["plan", "--config", path, "train.online=true", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2 over 8 GPU(s)" in out and "note: this config's training holds" not in out
