"""The target's cache behind ONE interface, so the decoders never touch KV or recurrent state directly.

    cache = target_cache(target, tap_ids)       # eval/engine/cache/factory.py: one per (target, taps, impl), reused
    cache.reset(capacity)                       # empty; capacity = rows the decode may ever hold
    out = cache.prefill(prompt_ids [S])         # rows 0..S-1; out.logits [1, V] (last row), out.features [S, F]
    vin = cache.verify_inputs(tree)             # positions start+depth and the 4-D tree mask (start = length)
    out = cache.verify(tree, vin)               # rows length..length+N-1 appended; logits [N, V], features [N, F]
    cache.commit(path, n, contiguous)           # keep rows length+path[:n] (moved to the front of the tail), drop the
                                                # rest: length += n
    cache.length                                # committed rows (= next bonus position)

features: the target's taps (extract/layers.py convention, concatenated shallow -> deep) recorded with
`extract.layers.TapHooks` during the same forward; None when no taps were requested (AR).

Implementations, one module per kind (`eval.engine.cache.factory.target_cache` picks one):
  * `eval.engine.cache.kv.KVTargetCache`: targets with only (full or sliding) attention layers: dynamic (HF
    `DynamicCache`, the reference path) or static (one preallocated K/V buffer, optionally the fused verify forward
    of eval/engine/target_forward.py and CUDA graphs).
  * `eval.engine.cache.hybrid.HybridTargetCache`: hybrid targets with linear-attention (Gated DeltaNet) layers: one
    forward over the tree's rows, attention layers under the tree mask, Gated-DeltaNet layers walked along the
    tree; the accepted node's state committed without a re-run (docs/tree.md, "Hybrid (recurrent) targets").
    `eval.engine.cache.hybrid.PathBatchedTargetCache` (impl 'paths') is its reference: every root->leaf path verified
    as its own batch row.

Targets must run with attn_implementation "sdpa" or "eager" for tree masks (never flash_attention_2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from eval.engine.tree import Tree
from extract.layers import TapHooks
from pipeline.target import text_config

RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
MASKABLE_ATTENTION = ("sdpa", "eager")


class TreeUnsupportedError(ValueError):
    """The target cannot verify a tree (recurrent layers, or an attention backend without arbitrary masks)."""


def recurrent_layer_types(config) -> list[str]:
    """The recurrent (linear-attention / SSM / conv) layer types of a HF config, sorted; [] for pure attention."""
    return sorted({t for t in (getattr(text_config(config), "layer_types", None) or []) if t in RECURRENT_LAYER_TYPES})


def tree_unsupported_reason(config) -> str | None:
    """Why DDTree cannot verify on a target with this HF config, or None. (Hybrid targets: `HybridTargetCache`
    walks the recurrent layers along the tree; its attention layers take the mask through HF's dict of masks.)"""
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl not in MASKABLE_ATTENTION:
        return f"target attention '{impl}' cannot take a 4-D tree mask; load the target with attn_implementation='sdpa'"
    return None


@dataclass
class ForwardOutput:
    logits: Tensor  # [rows, V] in the target dtype
    features: Tensor | None  # [rows, n_taps*D] target taps, None without taps


@dataclass
class VerifyInputs:
    positions: Tensor  # [1, N] = start + depth
    mask: object  # additive [1, 1, N, kv_len] tensor, a {layer_type: mask} dict, or None (causal / built later)
    visibility: Tensor | None = None  # static cache: bool [N, N] ancestor matrix; verify builds the mask from it


class HFForward:
    """Runs the HF target with explicit positions/mask/cache, recording the taps."""

    def __init__(self, target, tap_ids: Sequence[int]):
        self.target = target
        self.tap_ids = list(tap_ids)
        cfg = text_config(target.config)
        types = getattr(cfg, "layer_types", None) or []
        self.sliding_window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
        self.device = target.get_input_embeddings().weight.device
        self.dtype = target.get_input_embeddings().weight.dtype

    def mask_arg(self, build) -> object:
        """`build(sliding_window)` -> mask; a per-layer-type dict when the target has sliding layers."""
        full = build(None)
        if self.sliding_window is None:
            return full
        return {"full_attention": full, "sliding_attention": build(self.sliding_window)}

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, positions: Tensor, mask, cache, *, last_logits_only=False) -> ForwardOutput:
        """input_ids [S] (one sequence) or [B, S] (a batch); outputs flattened to [B*S, ...] rows."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)
        kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                      use_cache=True)
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        if not self.tap_ids:
            return ForwardOutput(self.target(**kwargs).logits.flatten(0, 1), None)
        with TapHooks(self.target, self.tap_ids) as taps:
            logits = self.target(**kwargs).logits.flatten(0, 1)
            return ForwardOutput(logits, taps.features().flatten(0, 1))


class TargetCache:
    """The interface (see module docstring). `length` = committed rows = the bonus token's position."""

    length: int = 0
    graphs: bool = False  # the verify replays CUDA graphs: the decoder captures its round steps too
    device_commit: bool = False  # rows at fixed addresses + a device length: compact_path/commit_compacted exist
    generation: int = 0  # bumped when the buffers are reallocated: CUDA graphs captured on the old ones are stale

    def describe(self) -> str:
        """How the verify forward ran, for reports (the speedups were measured on this path)."""
        raise NotImplementedError

    def reset(self, capacity: int) -> None:
        raise NotImplementedError

    def bucket_lengths(self, rows: int, max_length: int) -> list[int]:
        """Committed lengths (<= max_length), one per shape bucket a verify of `rows` rows reaches: where it first
        needs a new step (a new CUDA graph under `graphs`), what a warm-up visits so that timed decoding captures
        nothing; [] for a cache without shape buckets."""
        return []

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        raise NotImplementedError

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        raise NotImplementedError

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        raise NotImplementedError

    def commit(self, path: Tensor, n: int, contiguous: bool) -> None:
        raise NotImplementedError

    # -- device commit (only where `device_commit`) --------------------------------------------

    def compact_path(self, path: Tensor, accepted: Tensor) -> None:
        """Keep rows length + path[j] as rows length + j for every j in 0..L and advance the device length by
        accepted + 1 (path [L+1], accepted 0-dim: fixed shapes, no host value)."""
        raise NotImplementedError

    def compaction_state(self, rows: int) -> list[Tensor]:
        """The tensors `compact_path` changes in place (a CUDA graph's first call restores them between runs)."""
        raise NotImplementedError

    def commit_compacted(self, n: int) -> None:
        """After `compact_path`: the host length += n."""
        raise NotImplementedError
