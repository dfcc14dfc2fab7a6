"""The Gated-DeltaNet (linear-attention) states of an HF cache, held in two buffers stacked over the layers: what
regen's static decode (pipeline/regen/static_decode.py) and the evaluator's hybrid cache (eval/engine/cache/hybrid.py)
both keep of a hybrid target (Qwen3.5/3.6: three Gated-DeltaNet layers in four).

HF's cache keeps, per Gated-DeltaNet layer, a short-convolution window `conv_states[0]` [B, C, K] (model dtype) and a
recurrent state `recurrent_states[0]` [B, HV, dk, dv] (fp32); HF's one-token decode step updates both IN PLACE (the
window by `causal_conv1d_update`, the state by `update_recurrent_state`'s copy). `stack_linear_states` moves them,
after a prefill, into

    conv       [NL, B, C, K]          layer j of `layers` = conv[j]
    recurrent  [NL, B, HV, dk, dv]    layer j of `layers` = recurrent[j]

and points HF's entries at those views, so every later HF step advances the stacked buffers: one copy resets, reorders
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


@torch.no_grad()
def stack_linear_states(cache, layers: Sequence[int], conv: Tensor | None = None,
                        recurrent: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """HF cache `cache` after a prefill -> (conv [NL, B, C, K], recurrent [NL, B, HV, dk, dv]) holding the states of
    its Gated-DeltaNet layers `layers`, with HF's entries bound to views of them (`bind_linear_states`).

    Buffers given with the shapes and dtypes of the prefill's states are reused: the states are copied into them
    (their addresses stay, e.g. inside captured CUDA graphs); otherwise (None, or another shape) new buffers are
    made and returned: a caller that captured graphs on the old ones compares `data_ptr()`."""
    hf = [cache.layers[i] for i in layers]
    new_conv = torch.stack([layer.conv_states[0] for layer in hf])
    new_recurrent = torch.stack([layer.recurrent_states[0] for layer in hf])
    if _fits(conv, new_conv) and _fits(recurrent, new_recurrent):
        conv.copy_(new_conv)
        recurrent.copy_(new_recurrent)
    else:
        conv, recurrent = new_conv, new_recurrent
    bind_linear_states(cache, layers, conv, recurrent)
    return conv, recurrent


def _fits(buffer: Tensor | None, values: Tensor) -> bool:
    return buffer is not None and buffer.shape == values.shape and buffer.dtype == values.dtype \
        and buffer.device == values.device
