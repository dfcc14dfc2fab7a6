"""pipeline/target.py `gated_delta_kernels`: which kernels transformers runs a hybrid's Gated-DeltaNet layers with."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.config import TargetConfig
from pipeline.target import gated_delta_kernels, load_target, materialize_target
from tests.conftest import CACHE


def random_target(model_type: str):
    tcfg = TargetConfig(model=f"random:{model_type}", device="cpu", dtype="float32")
    return load_target(materialize_target(tcfg, CACHE), tcfg)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla-core installed (GPU machine)")
def test_without_fla_core_hybrids_run_the_torch_loops_and_attention_targets_have_none():
    assert gated_delta_kernels(random_target("qwen3_5_text")) == "torch"
    assert gated_delta_kernels(random_target("qwen3")) is None
