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


def _reference_gated_delta_kernels(namespace):
    """fla's whole-sequence contract (`fla_gated_delta_kernels`) stated in transformers' torch definitions: the
    convolution on [B, T, C], grouped value heads (value head j reads key head j // (HV / H)) and the decay made from
    the raw gate input inside the rule."""
    import inspect

    import torch.nn.functional as F

    torch_conv, torch_rule = (inspect.unwrap(namespace.causal_conv1d_fn),
                              inspect.unwrap(namespace.torch_chunk_gated_delta_rule))

    def conv(x, weight, bias=None, activation=None):
        return torch_conv(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2), None

    def rule(q, k, v, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias):
        assert use_qk_l2norm_in_kernel and use_gate_in_kernel
        groups = v.shape[2] // q.shape[2]
        decay = -A_log.float().exp() * F.softplus(g.float() + dt_bias)
        return torch_rule(q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2), v, g=decay,
                          beta=beta, use_qk_l2norm_in_kernel=True)

    return conv, rule


def test_whole_sequence_gated_delta_forward_equals_transformers_forward_and_leaves_cached_forwards_to_it():
    """`bind_whole_sequence_gated_delta` on a hybrid with grouped value heads (4 value heads over 2 key heads), with
    fla's kernel contract stated in transformers' torch code: the logits of a padded batch equal transformers' own
    forward; a forward with a cache (generate) is transformers' forward, token for token; undo() restores the class's
    forward. Split order, head grouping, gate or norm plumbing wrong: the logits move. A q/k/v projection that is
    not a plain nn.Linear (a quantized one) runs whole and is split, to the same logits."""
    import sys

    from pipeline.target import bind_whole_sequence_gated_delta

    model = random_target("qwen3_5_text")
    blocks = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert blocks[0].num_v_heads == 2 * blocks[0].num_k_heads
    namespace = sys.modules[type(blocks[0]).__module__]
    ids = torch.randint(3, 200, (3, 41), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding
    with torch.no_grad():
        before = model(ids, attention_mask=mask, use_cache=False).logits
        generated = model.generate(ids[:1, :12], max_new_tokens=6, do_sample=False)
    bound = bind_whole_sequence_gated_delta(model, kernels=_reference_gated_delta_kernels(namespace))
    assert len(bound) == len(blocks) and all("forward" in b.__dict__ for b in blocks)
    assert bind_whole_sequence_gated_delta(model) == []  # bound once
    calls = []
    blocks[0].register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        after = model(ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(model.generate(ids[:1, :12], max_new_tokens=6, do_sample=False), generated)
    assert calls
    torch.testing.assert_close(after[mask.bool()], before[mask.bool()], rtol=1e-5, atol=1e-5)

    class OtherLinear(torch.nn.Linear):  # a projection that is not a plain nn.Linear (a quantized one): run whole
        pass

    for block in blocks:
        plain = block.in_proj_qkv
        block.in_proj_qkv = OtherLinear(plain.in_features, plain.out_features, bias=False)
        block.in_proj_qkv.weight = plain.weight
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(whole[mask.bool()], before[mask.bool()], rtol=1e-5, atol=1e-5)
    for item in bound:
        item.undo()
    assert not any("forward" in b.__dict__ for b in blocks)
    assert not bind_whole_sequence_gated_delta(random_target("qwen3"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels run on CUDA (GPU machine with gpu-hybrid)")
def test_whole_sequence_gated_delta_forward_on_fla_equals_transformers_forward_on_cuda():
    """The whole-sequence forward on fla's kernels (grouped value heads and the decay inside the rule) vs
    transformers' forward (heads repeated, decay made in torch), on the 27B layer's head shapes (16 key heads of 128,
    48 value heads of 128) over 2 sequences: fp32 within TF32's rounding (Triton's dot multiplies fp32 operands in
    TF32 by default, a 10-bit mantissa: fla's fp32 forward differed by 3e-4 of the output's scale on an H100), bf16
    within bf16's."""
    pytest.importorskip("fla")
    from pipeline.target import base_model, bind_whole_sequence_gated_delta, random_target_config
    from transformers import AutoModelForCausalLM

    overrides = dict(hidden_size=512, linear_num_key_heads=16,
                     linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                     layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2)):
        model = AutoModelForCausalLM.from_config(random_target_config("qwen3_5_text", overrides)).to("cuda", dtype)
        model.eval().requires_grad_(False)
        ids = torch.randint(3, 200, (2, 300), device="cuda")
        hidden = base_model(model).embed_tokens(ids)
        block = base_model(model).layers[0].linear_attn
        with torch.no_grad():
            ref = block(hidden)
            bound = bind_whole_sequence_gated_delta(model)
            got = block(hidden)
        assert bound and got.shape == ref.shape == hidden.shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
