"""The Gated-DeltaNet (linear-attention) states of an HF cache, held in two buffers stacked over the layers: what
regen's static decode (pipeline/regen/static_decode.py) and the evaluator's hybrid cache (eval/engine/cache/hybrid.py)
both keep of a hybrid target (Qwen3.5/3.6: three Gated-DeltaNet layers in four).

HF's cache keeps, per Gated-DeltaNet layer, a short-convolution window `conv_states[0]` [B, C, K] (model dtype) and a
recurrent state `recurrent_states[0]` [B, HV, dk, dv] (fp32); HF's one-token decode step updates both IN PLACE (the
window by `causal_conv1d_update`, the state by `update_recurrent_state`'s copy). `stack_linear_states` moves them,
after a prefill, into

    conv       [NL, B, C, K]          layer j of `layers` = conv[j]
    recurrent  [NL, B, HV, dk, dv]    layer j of `layers` = recurrent[j]

and points HF's entries at those views, so every later HF step advances the stacked buffers (`linear_state_buffers`
allocates them from the config and `prebind_linear_states` hands them to HF before a prefill, which then writes its
states into them: the states exist once, not twice, at the prefill's peak): one copy resets, reorders
(batch compaction) or commits every layer at once, and a CUDA graph captured on the buffers reads and writes the same
addresses in every replay. Only HF's per-layer `conv_states` / `recurrent_states` dicts are touched.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from pipeline.target import text_config

LINEAR_ATTENTION = "linear_attention"


def layer_types(config) -> list[str]:
    """The decoder's layer types (HF `layer_types` of the language model; all 'full_attention' when absent)."""
    text = text_config(config)
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def linear_attention_layers(config) -> list[int]:
    """Indices of the Gated-DeltaNet (linear-attention) decoder layers, in layer order ([] for a pure attention
    model)."""
    return [i for i, t in enumerate(layer_types(config)) if t == LINEAR_ATTENTION]


def bind_linear_states(cache, layers: Sequence[int], conv: Tensor, recurrent: Tensor) -> None:
    """Point HF's conv window / recurrent state of cache layer layers[j] at conv[j] / recurrent[j] (views, no copy)."""
    for j, i in enumerate(layers):
        layer = cache.layers[i]
        layer.conv_states[0] = conv[j]
        layer.recurrent_states[0] = recurrent[j]


def linear_state_buffers(config, layers: Sequence[int], batch: int, dtype: torch.dtype,
                         device) -> tuple[Tensor, Tensor]:
    """Zeroed (conv [NL, B, C, K] in `dtype`, recurrent [NL, B, HV, dk, dv] fp32) for the Gated-DeltaNet layers
    `layers` of `config` at batch size `batch`: the shapes HF's Qwen3.5 layers give their states
    (C = 2 * key heads * dk + value heads * dv, the channels of the short convolution; K its kernel size)."""
    text = text_config(config)
    hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    conv = torch.zeros(len(layers), batch, 2 * hk * dk + hv * dv, text.linear_conv_kernel_dim, dtype=dtype,
                       device=device)
    recurrent = torch.zeros(len(layers), batch, hv, dk, dv, dtype=torch.float32, device=device)
    return conv, recurrent


def prebind_linear_states(cache, layers: Sequence[int], conv: Tensor, recurrent: Tensor) -> bool:
    """Before a prefill: make HF's cache layers layers[j] treat conv[j] / recurrent[j] as their already allocated
    state buffers, so that the prefill writes its final states into them (HF copies into an initialized buffer to
    keep its address) instead of allocating a second set: the states then take their size once, not twice, at the
    prefill's peak. Returns False (nothing bound) where this transformers' cache layers keep no such
    initialization flags; `stack_linear_states` then copies the states in after the prefill."""
    hf = [cache.layers[i] for i in layers]
    flags = ("is_conv_states_initialized", "is_recurrent_states_initialized", "conv_kernel_size")
    if not all(hasattr(layer, f) for layer in hf for f in flags):
        return False
    for j, layer in enumerate(hf):
        layer.conv_states[0], layer.recurrent_states[0] = conv[j], recurrent[j]
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        if getattr(layer, "device", None) is None:
            layer.dtype, layer.device = conv.dtype, conv.device
    return True


@torch.no_grad()
def stack_linear_states(cache, layers: Sequence[int], conv: Tensor | None = None,
                        recurrent: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """HF cache `cache` after a prefill -> (conv [NL, B, C, K], recurrent [NL, B, HV, dk, dv]) holding the states of
    its Gated-DeltaNet layers `layers`, with HF's entries bound to views of them (`bind_linear_states`).

    Buffers given with the shapes and dtypes of the prefill's states are reused: the states are copied into them
    (their addresses stay, e.g. inside captured CUDA graphs); otherwise (None, or another shape) new buffers are
    made and returned: a caller that captured graphs on the old ones compares `data_ptr()`."""
    hf = [cache.layers[i] for i in layers]
    if _fits(conv, [layer.conv_states[0] for layer in hf]) and _fits(recurrent, [layer.recurrent_states[0] for layer in hf]):
        for j, layer in enumerate(hf):  # layer by layer: at most one layer's states exist twice
            for buf, value in ((conv[j], layer.conv_states[0]), (recurrent[j], layer.recurrent_states[0])):
                if value.data_ptr() != buf.data_ptr():  # not written in place (prebind_linear_states)
                    buf.copy_(value)
            bind_linear_states(cache, [layers[j]], conv[j:j + 1], recurrent[j:j + 1])
    else:
        conv = torch.stack([layer.conv_states[0] for layer in hf])
        recurrent = torch.stack([layer.recurrent_states[0] for layer in hf])
    bind_linear_states(cache, layers, conv, recurrent)
    return conv, recurrent


def _fits(buffer: Tensor | None, values: list[Tensor]) -> bool:
    """`buffer` [NL, ...] holds one entry per tensor of `values`, each of the same shape, dtype and device."""
    return buffer is not None and buffer.shape[0] == len(values) and all(
        buffer.shape[1:] == v.shape and buffer.dtype == v.dtype and buffer.device == v.device for v in values)
