"""benchmarks/bench_hybrid.py: the H200 command runs at the tiny shape on CPU and writes every key of
docs/results/hybrid-h200/summary.json; its Qwen3.6-27B shape builds (on the meta device) with the real layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.slow
def test_hybrid_benchmark_writes_the_summary_keys_at_the_tiny_shape(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_hybrid.py", "--device", "cpu", "--shape", "tiny", "--out",
         str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--past", "32", "--budgets", "4,16",
         "--iters", "1", "--ar-tokens", "3", "--extract-tokens", "4000"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "summary.json").read_text())
    for key in ("chain_verify_ms", "ar_step_ms"):
        assert res[key] > 0, key
    for key in ("tree_verify_ms", "path_batched_verify_ms", "overhead_ms", "gdn_walk_ms"):
        assert set(res[key]) == {"4", "16"} and all(v > 0 for v in res[key].values()), key
    assert "host_syncs_per_round" in res  # null on CPU
    for key in ("extract_tok_s", "extract_ceiling_tok_s"):
        assert set(res[key]) == {"bf16", "fp8"} and all(v > 0 for v in res[key].values()), key
    assert res["reference_8b"]["chain_verify_ms"] > 0 and res["reference_8b"]["tree_verify_ms"]["16"] > 0
    assert res["tree_shape"]["16"]["nodes"] == 17 and res["tree_shape"]["16"]["paths"] > 1
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("*.safetensors"))


@pytest.mark.slow
def test_hybrid_benchmark_measures_the_static_kv_verify(tmp_path):
    """`--cache static` (what `--cache graphs` captures on a GPU) runs the same verify section on the static K/V."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_hybrid.py", "--device", "cpu", "--shape", "tiny", "--out",
         str(tmp_path / "out"), "--past", "32", "--budgets", "4,16", "--iters", "1", "--ar-tokens", "3",
         "--sections", "verify", "--cache", "static"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert res["hybrid_cache"] == "static" and res["verify_path"].startswith("hybrid: static KV")
    assert res["chain_verify_ms"] > 0 and set(res["tree_verify_ms"]) == {"4", "16"}
    assert all(v > 0 for v in res["overhead_ms"].values())


def test_the_27b_shape_has_the_qwen36_layout_and_size():
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_hybrid import hybrid_config, random_model

    config = hybrid_config("qwen3.6-27b")
    model = random_model(config, "meta", torch.bfloat16)
    assert 26.5e9 < sum(p.numel() for p in model.parameters()) < 27.5e9
    assert config.layer_types.count("linear_attention") == 48
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == list(range(3, 64, 4))
    gdn, attn = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel_size) == (16, 48, 128, 128, 4)
    assert attn.q_proj.weight.shape == (2 * 24 * 256, 5120)  # 24 heads x 256 and their output gate
    assert attn.k_proj.weight.shape == (4 * 256, 5120)


def test_the_extraction_forward_profile_sums_its_time_by_part_of_the_forward():
    """bench_hybrid --profile-extract: kernel names from the GPU runs are sorted into the forward's parts (attention,
    Gated-DeltaNet, short convolution, GEMMs, the rest), and a profile of the tiny hybrid's forward (CPU operators)
    splits its whole time among them."""
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_hybrid import forward_part, hybrid_config, profile_forward, random_model

    assert forward_part("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert forward_part("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN") == "gemm"
    assert forward_part("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gated delta rule"
    assert forward_part("void cudnn::conv1d_depthwise_kernel<bf16>") == "short convolution"
    assert forward_part("void at::native::vectorized_elementwise_kernel<4, pow_tensor_scalar>") == "other"
    model = random_model(hybrid_config("tiny"), "cpu", torch.float32)
    got = profile_forward(model, 64, torch.device("cpu"))
    assert got["tokens"] == 64 and got["wall_ms"] > 0 and got["by_part_ms"]["gemm"] > 0
    assert abs(sum(got["by_part_ms"].values()) - got["kernel_ms"]) < 1e-6 and got["top"]


@pytest.mark.slow
def test_the_commit_benchmark_times_every_piece_and_checks_each_block_against_the_engines(tmp_path):
    """benchmarks/bench_gdn_commit.py in Triton's interpreter at the tiny shape: every row of its table timed, each
    state-kernel block checked against the engine's 8 x 1 (the interpreter reduces exactly alike: equal)."""
    pytest.importorskip("triton")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_gdn_commit.py", "--device", "cpu", "--shape", "tiny", "--iters", "1",
         "--nodes", "40", "--configs", "8x1,16x2,32x4", "--json", str(tmp_path / "c.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "c.json").read_text())
    assert list(res["us"]) == ["copy floor", "gathers (before)", "torch commit (states)", "state 8x1", "state 16x2",
                               "conv window", "commit"]  # 32 > the tiny head dim: skipped
    assert all(us > 0 for us in res["us"].values())
    assert res["checks"] == {"state 8x1": "equal", "state 16x2": "equal"}
    assert "| state 16x2 |" in out.stdout
