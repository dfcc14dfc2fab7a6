"""THE layer-id convention, every translation of it, and feature tapping.

Convention (DFlash, `dflash_config.target_layer_ids`): tap id ``l`` is the residual-stream OUTPUT of
decoder layer ``l`` (0-based), before the final norm.  Features of several taps are concatenated
along the hidden dim in increasing id order (shallow -> deep): ``[..., S, n_taps * D]``.

Translations (all of them live here; nothing else may add or subtract 1):

=====================================  ===================================================================
HF ``output_hidden_states`` tuple       index ``l + 1`` (index 0 is the embedding output).  HF overwrites
                                        the last entry (index L) with the *post*-final-norm state, so tap
                                        ``L - 1`` cannot be read from that tuple (use the hooks below).
vLLM ``eagle_aux_hidden_state_layer_ids``  id ``l + 1`` (vLLM captures the *input* of layer i =
                                        ``hidden_states + residual``); aux id ``L`` is the pre-norm output
                                        of the last layer, i.e. tap ``L - 1`` — consistent with the hooks.
=====================================  ===================================================================

Two ways to tap a HF model:
  * ``forward_taps(model, input_ids, layer_ids)`` runs the decoder only up to the deepest tapped layer
    (no later layers, no final norm, no LM head, no logits) and returns ``[B, S, n*D]``;
  * ``with TapHooks(model, layer_ids) as taps: model(...); taps.features()`` records the taps during any
    forward you run yourself (e.g. a full forward with a KV cache in the evaluator).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipeline.target import base_model, text_config

LAYER_CONVENTION = "dflash:output-of-layer"


# ----------------------------------------------------------------------------------------------
# Ids and translations
# ----------------------------------------------------------------------------------------------


def default_layer_ids(num_layers: int, n: int) -> list[int]:
    """DFlash default taps: ``n`` ids spread evenly from layer 1 to layer L-3.

    ``round(1 + i*(L-4)/(n-1))`` for i in 0..n-1 (Python rounding, as z-lab's `build_target_layer_ids`),
    and ``[L // 2]`` when n == 1.  Qwen3-8B (L=36, n=5) -> [1, 9, 17, 25, 33].
    """
    if n < 1:
        raise ValueError(f"number of taps must be >= 1, got {n}")
    if n == 1:
        ids = [num_layers // 2]
    else:
        ids = [int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n)]
    validate_layer_ids(ids, num_layers)
    return ids


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Check taps are strictly increasing ids of existing decoder layers; returns them as a list."""
    ids = [int(x) for x in layer_ids]
    if not ids:
        raise ValueError("layer_ids is empty: tap at least one layer")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"layer_ids {ids} must be strictly increasing (features are concatenated shallow -> deep)")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise ValueError(f"layer_ids {ids} out of range for a target with {num_layers} decoder layers (0..{num_layers - 1})")
    return ids


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_taps: int, num_layers: int) -> list[int]:
    """The taps a run uses: explicit `extract.layer_ids`, else `default_layer_ids(L, num_taps)`."""
    if layer_ids is not None:
        return validate_layer_ids(layer_ids, num_layers)
    return default_layer_ids(num_layers, num_taps)


def configured_layer_ids(extract_cfg, num_layers: int) -> list[int]:
    """The taps a run config asks for (`extract.layer_ids`, else `extract.num_taps` spread by `default_layer_ids`)
    on a target with ``num_layers`` decoder layers; a bad value is a ConfigError naming ``extract.layer_ids``."""
    from pipeline.config import ConfigError

    try:
        return resolve_layer_ids(extract_cfg.layer_ids, extract_cfg.num_taps, num_layers)
    except ValueError as e:
        raise ConfigError(f"extract.layer_ids: {e}") from e


def stored_tap_ids(layer_ids: Sequence[int], num_layers: int, last_hidden: bool) -> list[int]:
    """The taps extraction stores per token, in column order: the drafter's ``layer_ids``, then -- with
    ``last_hidden``, for logit distillation -- tap ``L - 1``, the pre-norm output of the last decoder layer (vLLM
    aux id ``L``), whose ``lm_head(final_norm(.))`` is the target's next-token distribution.  A drafter that taps
    ``L - 1`` itself stores it already (no second copy).  Either way, with ``last_hidden`` the last hidden state is
    the last ``D`` columns of the features."""
    ids = validate_layer_ids(layer_ids, num_layers)
    if last_hidden and ids[-1] != num_layers - 1:
        ids.append(num_layers - 1)
    return ids


def hf_hidden_state_index(layer_id: int, num_layers: int) -> int:
    """Index into HF ``output_hidden_states`` holding tap ``layer_id``: ``layer_id + 1``.

    Refuses the last layer (L-1): HF's entry L is post-final-norm, not the layer's output.
    """
    if not 0 <= layer_id < num_layers:
        raise ValueError(f"layer id {layer_id} out of range 0..{num_layers - 1}")
    if layer_id == num_layers - 1:
        raise ValueError(
            f"tap {layer_id} is the last decoder layer: HF output_hidden_states[{num_layers}] is post-final-norm; "
            "use extract.layers.forward_taps / TapHooks to read the pre-norm output"
        )
    return layer_id + 1


def to_vllm_aux_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM ``eagle_aux_hidden_state_layer_ids`` for our taps: ``l + 1`` (input of layer l+1 = output of l;
    aux id L = pre-norm output of the last layer)."""
    return [int(l) + 1 for l in layer_ids]


def from_vllm_aux_ids(aux_ids: Sequence[int]) -> list[int]:
    """Inverse of `to_vllm_aux_ids`."""
    return [int(i) - 1 for i in aux_ids]


def tap_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate taps from a HF ``output_hidden_states`` tuple (L+1 entries of ``[..., S, D]``).

    Returns ``[..., S, n*D]`` (shallow -> deep).  Tap L-1 is refused (see `hf_hidden_state_index`).
    """
    num_layers = len(hidden_states) - 1
    return torch.cat([hidden_states[hf_hidden_state_index(l, num_layers)] for l in layer_ids], dim=-1)


# ----------------------------------------------------------------------------------------------
# Hooks on decoder layers
# ----------------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of a HF causal LM or its base model (``model.model.layers`` and friends)."""
    config = getattr(model, "config", None)
    n = text_config(config).num_hidden_layers if config is not None else None
    for candidate in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "language_model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList) and (n is None or len(layers) == n):
            return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and n is not None and len(module) == n:
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


class _StopForward(Exception):
    """Raised by the deepest tap hook to end the forward early (nothing after it is computed)."""


class TapHooks:
    """Record the outputs of decoder layers ``layer_ids`` during a forward (forward hooks, no copies).

    >>> with TapHooks(model, [1, 3, 5]) as taps:
    ...     model(input_ids)
    >>> taps.features()          # [B, S, 3*D], shallow -> deep

    With ``stop_after_deepest=True`` the deepest hook raises to skip the remaining layers; use
    `forward_taps`, which catches it.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, stop_after_deepest: bool = False):
        self.layers = decoder_layers(model)
        self.layer_ids = validate_layer_ids(layer_ids, len(self.layers))
        self.stop_after_deepest = stop_after_deepest
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self.outputs[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
            if self.stop_after_deepest and layer_id == self.layer_ids[-1]:
                raise _StopForward

        return hook

    def __enter__(self) -> "TapHooks":
        self.outputs.clear()
        self._handles = [self.layers[l].register_forward_hook(self._hook(l)) for l in self.layer_ids]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def features(self) -> torch.Tensor:
        """``[..., S, n*D]``: the recorded taps concatenated shallow -> deep."""
        missing = [l for l in self.layer_ids if l not in self.outputs]
        if missing:
            raise RuntimeError(f"taps {missing} were not recorded: did the forward run through those layers?")
        return torch.cat([self.outputs[l] for l in self.layer_ids], dim=-1)


@torch.no_grad()
def forward_taps(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer_ids: Sequence[int],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Features ``[B, S, n*D]`` of ``input_ids [B, S]``, running layers 0..max(layer_ids) only.

    No LM head, no logits, no KV cache, no all-layer ``output_hidden_states``.  Right padding without
    an attention mask is exact for the real tokens of a causal model (pads come after them), including
    linear-attention (Gated DeltaNet) layers.
    """
    base = base_model(model)
    kwargs = {"use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    with TapHooks(base, layer_ids, stop_after_deepest=True) as taps:
        try:
            base(input_ids=input_ids, **kwargs)
        except _StopForward:
            pass
        return taps.features()


# ----------------------------------------------------------------------------------------------
# The same forward as an explicit layer loop (what `extract.hf` compiles layer by layer)
# ----------------------------------------------------------------------------------------------


def plain_decoder_refusal(model: nn.Module, layer_ids: Sequence[int]) -> str | None:
    """Why `forward_taps_loop` cannot stand in for `forward_taps` on ``model``, or None when it can.

    The loop rebuilds the base model's forward as ``embed_tokens -> rotary_emb -> layers[0..deepest]``
    with causal SDPA and no mask, which is only that forward for a plain decoder: SDPA attention,
    every layer up to the deepest tap full attention (no sliding window, no linear attention), and the
    standard ``embed_tokens`` / ``rotary_emb`` modules.  Anything the check cannot see (an embedding scale
    inside the base forward, say) is caught by comparing both on a probe batch (`extract.hf`).
    """
    base = base_model(model)
    text = text_config(model.config)
    if getattr(text, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(text, '_attn_implementation', None)!r} is not 'sdpa'"
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding) or getattr(base, "rotary_emb", None) is None:
        return f"{type(base).__name__} has no embed_tokens/rotary_emb"
    types = getattr(text, "layer_types", None) or ["full_attention"] * len(decoder_layers(model))
    deepest = max(layer_ids)
    odd = sorted({t for t in types[: deepest + 1] if t != "full_attention"})
    if odd:
        return f"layers of type {odd} before the deepest tap (only full attention is rebuilt)"
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        return "sliding-window attention"
    return None


def call_decoder_layer(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One decoder layer ``[B, S, D] -> [B, S, D]``: no mask (SDPA runs causal: exact for right padding), no cache."""
    out = layer(hidden, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=(cos, sin))
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def forward_taps_loop(model: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int], layer_call=call_decoder_layer) -> torch.Tensor:
    """`forward_taps` as an explicit loop over layers 0..max(layer_ids): ``input_ids [B, S]`` -> ``[B, S, n*D]``.

    ``layer_call(layer, hidden, cos, sin)`` runs one layer (`call_decoder_layer`, or a compiled version of
    it: every layer has the same code and shapes, so one compiled graph serves them all).  Only valid
    where `plain_decoder_refusal` returns None.
    """
    base = base_model(model)
    layers = decoder_layers(model)
    taps = validate_layer_ids(layer_ids, len(layers))
    hidden = base.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    cos, sin = base.rotary_emb(hidden, positions)
    outputs = []
    for l in range(taps[-1] + 1):
        hidden = layer_call(layers[l], hidden, cos, sin)
        if l in taps:
            outputs.append(hidden)
    return torch.cat(outputs, dim=-1)
