"""pipeline/target.py `gated_delta_kernels`: which kernels transformers runs a hybrid's Gated-DeltaNet layers with."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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


def test_binding_fla_short_convolution_swaps_the_modeling_function_once_and_leaves_cpu_outputs_bit_equal(monkeypatch):
    """`bind_fla_short_convolution` swaps the Gated-DeltaNet layers' `causal_conv1d_fn` for the fla adapter (once:
    a second bind keeps the first adapter), attention-only targets are left alone, and on CPU tensors the adapter is
    transformers' own function: a hybrid's logits do not move by one bit."""
    import inspect
    import sys

    from pipeline.target import SHORT_CONVOLUTION, bind_fla_short_convolution

    model = random_target("qwen3_5_text")
    namespace = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    original = getattr(namespace, SHORT_CONVOLUTION)
    monkeypatch.setattr(namespace, SHORT_CONVOLUTION, original)  # undone after the test
    ids = torch.randint(3, 200, (2, 37))
    with torch.no_grad():
        before = model(ids).logits
    if importlib.util.find_spec("causal_conv1d") is not None:
        assert not bind_fla_short_convolution(model)
        return
    assert bind_fla_short_convolution(model)
    adapter = getattr(namespace, SHORT_CONVOLUTION)
    assert adapter is not original and adapter.original is original
    assert bind_fla_short_convolution(model) and getattr(namespace, SHORT_CONVOLUTION) is adapter
    assert not bind_fla_short_convolution(random_target("qwen3"))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    x = torch.randn(2, 24, 9)
    weight = torch.randn(24, 4)
    assert torch.equal(adapter(x, weight, None, activation="silu"), inspect.unwrap(original)(x, weight, None, "silu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton convolution runs on CUDA (GPU machine with gpu-hybrid)")
def test_fla_short_convolution_equals_transformers_torch_convolution_on_cuda():
    """The adapter on fla's kernel vs transformers' torch definition (F.conv1d, fp32 here so that only the order of
    four products differs), for the extraction layout (a transposed contiguous [B, T, C]), a cached prefill's layout
    (conv window and new rows concatenated: [B, C, T] contiguous), with and without bias and SiLU; and in bf16, the
    dtype stages run, within bf16's rounding of the same sums."""
    import inspect

    from pipeline.target import fla_short_convolution

    pytest.importorskip("fla")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    reference = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    adapter = fla_short_convolution(reference)
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for layout in ("extract", "cached"):
            for bias, act in ((None, "silu"), (True, None)):
                c, t = 768, 333
                if layout == "extract":
                    x = torch.randn(3, t, c, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
                else:
                    x = torch.randn(3, c, t, device="cuda", dtype=dtype, generator=g)
                w = torch.randn(c, 4, device="cuda", dtype=dtype, generator=g) * 0.5
                b = torch.randn(c, device="cuda", dtype=dtype, generator=g) if bias else None
                got, ref = adapter(x, w, b, activation=act), reference(x, w, b, activation=act)
                assert got.shape == ref.shape == x.shape and got.dtype == ref.dtype
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
