"""The target's cache behind ONE interface, so the decoders never touch KV or recurrent state directly.

    cache = target_cache(target, tap_ids)       # one per (target, taps, impl); reused across decode calls
    cache.reset(capacity)                       # empty; capacity = rows the decode may ever hold
    out = cache.prefill(prompt_ids [S])         # rows 0..S-1; out.logits [1, V] (last row), out.features [S, F]
    vin = cache.verify_inputs(tree)             # positions start+depth and the 4-D tree mask (start = length)
    out = cache.verify(tree, vin)               # rows length..length+N-1 appended; logits [N, V], features [N, F]
    cache.commit(path, n, contiguous)           # keep rows length+path[:n] (moved to the front of the tail), drop the
                                                # rest: length += n
    cache.length                                # committed rows (= next bonus position)

features: the target's taps (extract/layers.py convention, concatenated shallow -> deep) recorded with
`extract.layers.TapHooks` during the same forward; None when no taps were requested (AR).

Implementations:
  * `KVTargetCache(static=False)`: HF `DynamicCache`, additive 4-D mask over past+N keys. The reference path.
  * `KVTargetCache(static=True)`: a preallocated K/V buffer [layers, 2, 1, KVH, capacity, hd] that HF writes
    through `StaticKV.update` at explicit row indices. A verify of N rows attends to the first kv_len rows only,
    kv_len = length + N rounded up to a multiple of KV_BUCKET (<= capacity); the mask hides the unused ones.
    The 4-D mask is built inside the verify call from the tree's ancestor matrix (`VerifyInputs.visibility`) and
    the device scalar `past`, so all shapes are fixed by (N, kv_len). Compaction is one gather + one copy over all
    layers at once. With `graphs=True` (CUDA) the whole verify (mask + every layer + head + taps) for each
    (N, kv_len) is captured once as a CUDA graph (`CudaGraphFn`) and replayed; the mask then lives in the graph's
    private memory and is rewritten in place by each replay. The decoder also captures its tree build and its
    walk. The first replay of each graph is checked against the eager call; a mismatch or failed capture falls
    back to eager.
  * `fused=True` (static only; impl 'fused', and 'graphs' where the target allows): the verify runs
    `eval.target_forward.VerifyForward` (fused projections, folded-GQA attention straight from the buffer,
    compiled pointwise ops under 'graphs') instead of HF's forward. Its first verify is checked against HF's
    forward on the same inputs; a refusal or a mismatch falls back to HF's forward, with a warning.
  * `RecurrentTargetCache`: hybrid targets with linear-attention (Gated DeltaNet) layers, e.g. qwen3_5_text.
    A tree mask cannot stop recurrent state from flowing between branches (docs/tree.md, "Hybrid (recurrent) targets"), so nothing here
    uses one. Chain: the recurrent/conv states are copied before verify; if the chain is cut at n < N rows,
    they are restored, the attention KV is cropped, and the n accepted rows are re-run from the saved state.
    Tree (path-batched): every root->leaf path is one row of a batch [P, depth+1] run from a copy of the committed
    state (rows cannot leak into each other), each node's logits/taps are read from a row that holds it, and
    commit re-runs the accepted path on the committed state. Both are exact; a tree costs P*(depth+1) verify rows
    and one host read of the tree per round, plus the re-run of the accepted rows. A per-node recurrent-state
    kernel (state of node i = post-update state of parent[i]) would be the fast version of the same interface.

Targets must run with attn_implementation "sdpa" or "eager" for tree masks (never flash_attention_2).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache

from eval.tree import Tree
from eval.verify import (ancestor_matrix, causal_attention_mask, tree_attention_mask, verify_positions,
                         visibility_attention_mask)
from eval.walk import compact_path_rows, compact_rows
from extract.layers import TapHooks
from pipeline.log import get_logger

log = get_logger("eval.cache")

KV_BUCKET = 128  # static-cache verify: attended key rows are rounded up to this (one verify graph per bucket)
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
MASKABLE_ATTENTION = ("sdpa", "eager")


class TreeUnsupportedError(ValueError):
    """The target cannot verify a tree (recurrent layers, or an attention backend without arbitrary masks)."""


def text_config(config):
    return getattr(config, "text_config", None) or config


def recurrent_layer_types(config) -> list[str]:
    """The recurrent (linear-attention / SSM / conv) layer types of a HF config, sorted; [] for pure attention."""
    return sorted({t for t in (getattr(text_config(config), "layer_types", None) or []) if t in RECURRENT_LAYER_TYPES})


def tree_unsupported_reason(config) -> str | None:
    """Why DDTree cannot verify on a target with this HF config, or None. (Hybrid targets verify trees path by
    path, `RecurrentTargetCache`, which needs no tree mask.)"""
    if recurrent_layer_types(config):
        return None
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


# ----------------------------------------------------------------------------------------------
# Shared
# ----------------------------------------------------------------------------------------------


class _Forward:
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
    round_ops: dict  # the decoder's per-configuration round helpers (CUDA graphs); cleared with the buffers

    def describe(self) -> str:
        """How the verify forward ran, for reports (the speedups were measured on this path)."""
        raise NotImplementedError

    def reset(self, capacity: int) -> None:
        raise NotImplementedError

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        raise NotImplementedError

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        raise NotImplementedError

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        raise NotImplementedError

    def commit(self, path: Tensor, n: int, contiguous: bool) -> None:
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# KV targets
# ----------------------------------------------------------------------------------------------


class StaticKV(Cache):
    """HF cache over one preallocated buffer kv [layers, 2, 1, KVH, capacity, hd].

    `update` writes the new K/V rows at `write_rows` (int64 [q], set before each forward) and returns rows
    [0, kv_len) (views, no copy; kv_len set before each forward); the caller's mask hides rows that are not
    committed or not part of this forward.
    """

    is_compileable = True

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        super().__init__(layers=[])
        self.kv = torch.zeros(num_layers, 2, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.write_rows = torch.zeros(0, dtype=torch.long, device=device)
        self.capacity = capacity
        self.kv_len = capacity

    def __len__(self):
        return self.kv.shape[0]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        keys.index_copy_(2, self.write_rows, key_states)
        values.index_copy_(2, self.write_rows, value_states)
        return keys.narrow(2, 0, self.kv_len), values.narrow(2, 0, self.kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("StaticKV has no implicit length: pass position_ids and a 4-D mask")


class KVTargetCache(TargetCache):
    """A target with only (full or sliding) attention layers; dynamic (reference) or static (+ CUDA graphs)."""

    def __init__(self, target, tap_ids: Sequence[int], *, static: bool = False, graphs: bool = False,
                 fused: bool = False):
        if recurrent_layer_types(target.config):
            raise TreeUnsupportedError(tree_unsupported_reason(target.config))
        self.forward = _Forward(target, tap_ids)
        self.static = static
        self.graphs = graphs and static and self.forward.device.type == "cuda"
        self.fused = self._fused_forward(target, tap_ids) if fused and static else None
        self._fused_checked = False
        self.kv: StaticKV | None = None
        self.dynamic: DynamicCache | None = None
        self.length = 0
        self.past = torch.zeros((), dtype=torch.long, device=self.forward.device)  # device copy of `length`
        self._verify_fns: dict[tuple[int, int], object] = {}  # (N, kv_len) -> verify fn / CUDA graph
        self.round_ops: dict = {}

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self, capacity: int) -> None:
        self._set_length(0)
        if not self.static:
            self.dynamic = DynamicCache()
            return
        if self.kv is None or self.kv.capacity < capacity:
            cfg = text_config(self.forward.target.config)
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            capacity = -(-capacity // 2048) * 2048  # buckets: graphs (keyed by capacity) survive across prompts
            self.kv = None
            self._verify_fns.clear()
            self.round_ops.clear()
            self.kv = StaticKV(cfg.num_hidden_layers, heads, head_dim, capacity, self.forward.dtype, self.forward.device)

    def describe(self) -> str:
        if not self.static:
            return "dynamic KV, HF forward"
        forward = "HF forward" if self.fused is None else \
            f"fused forward ({self.fused.attention_mode(self.forward.device)} attention)"
        graphs = [f for f in self._verify_fns.values() if hasattr(f, "disabled")]
        on_graphs = bool(graphs) and not any(f.disabled for f in graphs)
        return f"static KV, {forward}" + (", CUDA graphs" if on_graphs else "")

    def _fused_forward(self, target, tap_ids):
        from eval.target_forward import VerifyForward, refusal

        reason = refusal(target)
        if reason:
            log.info("verify runs HF's forward: %s", reason)
            return None
        return VerifyForward(target, tap_ids, compile=self.graphs)

    def _set_length(self, n: int) -> None:
        self.length = n
        self.past.fill_(n)  # an async device fill, no sync

    # -- forwards ---------------------------------------------------------------------------------

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        S = input_ids.shape[-1]
        positions = torch.arange(S, device=self.forward.device).unsqueeze(0)
        if self.static:
            self.kv.write_rows = torch.arange(S, device=self.forward.device)
            self.kv.kv_len = self.kv.capacity
            mask = self.forward.mask_arg(lambda w: causal_attention_mask(
                S, 0, self.kv.capacity, self.forward.dtype, self.forward.device, sliding_window=w))
            out = self.forward(input_ids, positions, mask, self.kv, last_logits_only=True)
        else:
            out = self.forward(input_ids, positions, None, self.dynamic, last_logits_only=True)
        self._set_length(S)
        return out

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        """Dynamic cache: positions + the 4-D mask over past + N keys. Static cache: positions (from the device
        scalar `past`) + the ancestor matrix; `verify` turns it into the mask for its key bucket. Both are
        capturable in a CUDA graph (fixed shapes, no host read). ancestors: the tree's eval.verify.ancestor_table,
        if the caller has it."""
        if self.static:
            return VerifyInputs(verify_positions(tree, self.past), None, ancestor_matrix(tree, ancestors))
        mask = self.forward.mask_arg(lambda w: tree_attention_mask(tree, self.length, self.length + tree.size,
                                                                   self.forward.dtype, sliding_window=w,
                                                                   ancestors=ancestors))
        return VerifyInputs(verify_positions(tree, self.length), mask)

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        if not self.static:
            return self.forward(tree.tokens, vin.positions, vin.mask, self.dynamic)
        kv_len = min(self.kv.capacity, -(-(self.length + tree.size) // KV_BUCKET) * KV_BUCKET)
        if self.fused is not None and not self._fused_checked:
            self._check_fused(kv_len, tree, vin)
        key = (tree.size, kv_len)
        fn = self._verify_fns.get(key)
        if fn is None:
            fn = functools.partial(self._static_verify, kv_len)
            if self.graphs:
                fn = CudaGraphFn(fn, f"verify forward N={tree.size} keys={kv_len}", check=_logits_close)
            self._verify_fns[key] = fn
        logits, features = fn(tree.tokens, vin.positions, vin.mask, vin.visibility)
        return ForwardOutput(logits, features)

    def _static_verify(self, kv_len: int, ids: Tensor, positions: Tensor, mask,
                       visibility: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Rows past..past+N-1 of the static buffer, attending to rows [0, kv_len) (all shapes fixed by N and
        kv_len). The mask is `mask` if given, else built here from `visibility` and the device scalar `past`."""
        self.kv.kv_len = kv_len
        self.kv.write_rows = self.past + torch.arange(ids.shape[0], device=ids.device)
        if self.fused is not None:
            return self.fused(ids, positions, visibility, self.past, self.kv.write_rows, self.kv.kv, kv_len)
        if mask is None:
            mask = self.forward.mask_arg(lambda w: visibility_attention_mask(
                visibility, positions, self.past, kv_len, self.forward.dtype, sliding_window=w))
        out = self.forward(ids, positions, mask, self.kv)
        return out.logits, out.features

    def _check_fused(self, kv_len: int, tree: Tree, vin: VerifyInputs) -> None:
        """Once per cache: the fused verify against HF's forward on the same rows; HF's forward from now on if they
        differ by more than rounding (relative L2 error of logits and taps; a wrong graph gives ~1)."""
        from eval.target_forward import max_error

        self._fused_checked = True
        fused, self.fused = self.fused, None
        ref = self._static_verify(kv_len, tree.tokens, vin.positions, vin.mask, vin.visibility)
        self.fused = fused
        try:  # also compiles it (torch.compile, Triton): a failure here means HF's forward, not a crash
            got = self._static_verify(kv_len, tree.tokens, vin.positions, vin.mask, vin.visibility)
        except Exception as exc:  # noqa: BLE001
            log.warning("fused verify forward failed (%s: %s): using HF's forward", type(exc).__name__, exc)
            self.fused = None
            return
        err = max(_relative_error(g, r) for g, r in zip(got, ref) if r is not None)
        if err > max_error(self.forward.dtype):
            log.warning("fused verify forward differs from HF's (relative error %.2e): using HF's forward", err)
            self.fused = None
        else:
            log.info("fused verify forward checked against HF's: relative error %.2e", err)

    # -- commit -----------------------------------------------------------------------------------

    def compact_path(self, path: Tensor, accepted: Tensor) -> None:
        """Static cache, fixed shape (CUDA-graph safe, no host value): rows past + path[j] -> past + j for every j
        in 0..L, all layers at once, then the device past += accepted + 1 (accepted: 0-dim device int). Rows after
        the accepted ones are past the committed length (rewritten by the next verify); `commit_compacted` then
        records the new length on the host. Not idempotent: see `compaction_state`."""
        compact_path_rows(self.kv.kv, 4, self.past, path)
        self.past.add_(accepted + 1)

    def compaction_state(self, rows: int) -> list[Tensor]:
        """What `compact_path` changes, for CudaGraphFn to restore between the extra runs of a first call: the K/V
        rows length .. length + rows - 1 of every layer and the device `past`."""
        return [self.kv.kv.narrow(4, self.length, rows), self.past]

    def commit_compacted(self, n: int) -> None:
        """After `compact_path` (whose device update of `past` has been queued): the host length += n."""
        self.length += n

    def commit(self, path: Tensor, n: int, contiguous: bool) -> None:
        """Keep rows length+path[:n] as rows length..length+n-1 (skip the move when path[:n] == arange(n))."""
        keep = path[:n]
        if self.static:
            if not contiguous:
                compact_rows(self.kv.kv, 4, self.length, keep)
        else:
            end = self.length + n
            for layer in self.dynamic.layers:
                if not contiguous:
                    compact_rows(layer.keys, 2, self.length, keep)
                    compact_rows(layer.values, 2, self.length, keep)
                layer.keys = layer.keys[:, :, :end]
                layer.values = layer.values[:, :, :end]
        self._set_length(self.length + n)


def _relative_error(got: Tensor, ref: Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _logits_close(graph_out, eager_out) -> bool:
    """The verify graph's self-check: its logits equal an eager run's up to rounding, the same allowance as the
    fused forward against HF's (eval/target_forward.py `max_error`: bf16 rounding differences grow through the
    layers; 2.6e-2 measured for a bf16 AR graph of a random-init Qwen3-8B shape); a graph that replays stale
    inputs is off by ~1. A failure logs the error."""
    from eval.target_forward import max_error

    err = _relative_error(graph_out[0], eager_out[0])
    ok = err <= max_error(eager_out[0].dtype)
    if not ok:
        log.warning("verify graph vs eager: relative L2 error of the logits %.2e", err)
    return ok


def _same_buffer(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class CudaGraphFn:
    """`fn(*args)` (args/outputs: tensors, or tuples/dicts of them, or constants) captured once as a CUDA graph.

    The first call warms up, captures with the given tensors as the graph's input buffers (kept by reference) and
    replays. Later calls copy each input into its captured buffer unless it IS that buffer (graph outputs chained
    into the next graph cost nothing), replay, and return the captured outputs (overwritten by the next replay).
    Pass only tensors the caller no longer needs, or this graph's/other graphs' static buffers.
    The first replay is checked against an eager call on the same inputs (`check(graph_out, eager_out)`; exact
    equality by default); a failed check or capture logs a warning and `fn` runs eagerly from then on. If fn also
    changes other tensors in place (`state`), those are restored between the first call's runs.
    Host values inside `fn` (shapes, budgets) are frozen at capture: key one instance per static configuration.
    """

    def __init__(self, fn, name: str, check=None, state=None):
        self.fn, self.name = fn, name
        self.check = check or (lambda g, e: all(torch.equal(a, b) for a, b in zip(_leaves(g), _leaves(e))))
        self.state = state or (lambda: [])  # () -> tensors fn changes in place besides its outputs
        self.graph = None
        self.disabled = False

    def __call__(self, *args):
        if self.disabled:
            return self.fn(*args)
        if self.graph is None:
            return self._first_call(args)
        for buf, x in zip(self.buffers, _leaves(args) if self.nested else [a for a in args if a is not None]):
            if buf is not x and not _same_buffer(buf, x):
                buf.copy_(x)
        self.graph.replay()
        return self.out

    def _first_call(self, args):
        """Warm up, capture, replay, and check the replay against an eager run. fn runs four times here (two
        warm-ups, the replay, the eager check): the `state` tensors are put back before each run after the first,
        so the call leaves them as one run of fn does."""
        saved = [t.clone() for t in self.state()]

        def restore():
            for t, s in zip(self.state(), saved):
                t.copy_(s)

        try:
            self._capture(args, restore)
        except Exception as exc:  # e.g. a host sync inside fn
            log.warning("CUDA-graph capture of %s failed (%s): running eagerly", self.name, exc)
            self.disabled = True
            restore()
            return self.fn(*args)
        restore()
        self.graph.replay()
        from torch.utils._pytree import tree_map

        replayed = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, self.out)
        restore()
        eager = self.fn(*self.args)  # (fn may write into the same buffers the graph does: compare a copy)
        if not self.check(replayed, eager):
            log.warning("CUDA-graph %s differs from eager: running eagerly from now on", self.name)
            self.disabled = True
            return eager
        return self.out

    def _capture(self, args, restore) -> None:
        self.args = args
        self.buffers = _leaves(args)  # the graph's input tensors, flattened once
        self.nested = not all(a is None or isinstance(a, Tensor) for a in args)  # flat args skip the pytree walk
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(2):  # warm-up outside the graph (allocator, cuBLAS handles, lazy caches)
                if i:
                    restore()
                self.fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.fn(*args)
        self.graph = graph


def _leaves(tree) -> list[Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


# ----------------------------------------------------------------------------------------------
# Hybrid (recurrent) targets
# ----------------------------------------------------------------------------------------------


def _recurrent_layers(cache: DynamicCache):
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


class RecurrentTargetCache(TargetCache):
    """Hybrid target (linear-attention + attention layers). Chain: rollback by state copy + re-run. Tree: every
    root->leaf path is one row of a batch run from a copy of the committed state, then the accepted path is re-run
    on the committed state (see the module docstring)."""

    def __init__(self, target, tap_ids: Sequence[int]):
        self.forward = _Forward(target, tap_ids)
        if self.forward.sliding_window is not None:
            raise NotImplementedError("hybrid target with sliding-window layers: crop-based rollback would cut the "
                                      "window caches; not supported")
        self.config = target.config
        self.cache: DynamicCache | None = None
        self.length = 0
        self.round_ops: dict = {}
        self._saved: list[tuple[Tensor, Tensor]] | None = None
        self._tokens: Tensor | None = None
        self._tree = False  # the pending verify was path-batched (the committed state is untouched)

    def describe(self) -> str:
        return "hybrid: recurrent state + dynamic KV, HF forward (chain rollback; trees path-batched)"

    def reset(self, capacity: int) -> None:
        self.cache = DynamicCache(config=self.config)
        self.length = 0

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        S = input_ids.shape[-1]
        positions = torch.arange(S, device=self.forward.device).unsqueeze(0)
        out = self.forward(input_ids, positions, None, self.cache, last_logits_only=True)
        self.length = S
        return out

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        return VerifyInputs(verify_positions(tree, self.length), None)  # rows run causally (chain or per path)

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        self._tokens = tree.tokens
        self._tree = tree.kind == "tree"
        if self._tree:
            return self._verify_paths(tree)
        states = []
        for layer in _recurrent_layers(self.cache):
            for table in (layer.conv_states, layer.recurrent_states):
                for idx, t in table.items():
                    if t is not None:
                        states.append((t, t.clone()))
        self._saved = states
        return self.forward(tree.tokens, vin.positions, None, self.cache)

    def _verify_paths(self, tree: Tree) -> ForwardOutput:
        """Logits/features [N, ...] of every node, in tree order, from a batch of the P root->leaf paths
        ([P, depth+1] rows, right-padded: causal, so padding never reaches a real row). One host read of the tree."""
        parents = tree.parents.tolist()
        N = len(parents)
        has_child = set(parents[1:])
        paths = []
        for leaf in (i for i in range(N) if i not in has_child):
            path = [leaf]
            while path[-1] != 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])
        width = max(len(p) for p in paths)
        nodes = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths], device=self.forward.device)
        row_of = [0] * N  # node -> its first row in the flattened [P * width] outputs
        for r in reversed(range(len(paths))):
            for k, node in enumerate(paths[r]):
                row_of[node] = r * width + k
        positions = self.length + torch.arange(width, device=self.forward.device).expand(len(paths), width)
        out = self.forward(tree.tokens[nodes], positions, None, self._replicated_cache(len(paths)))
        rows = torch.tensor(row_of, device=self.forward.device)
        return ForwardOutput(out.logits[rows], None if out.features is None else out.features[rows])

    def _replicated_cache(self, batch: int) -> DynamicCache:
        """A copy of the committed cache with every state and K/V tensor repeated `batch` times (batch dim 0); the
        committed cache is not touched. Layer objects are shallow-copied, their tensors replaced (one copy each)."""
        import copy

        replica = copy.copy(self.cache)
        replica.layers = []
        for layer in self.cache.layers:
            layer = copy.copy(layer)
            for name, value in list(vars(layer).items()):  # own bookkeeping dicts: the forward may update them
                if isinstance(value, dict):
                    setattr(layer, name, dict(value))
            for name in ("conv_states", "recurrent_states"):
                table = getattr(layer, name, None)
                if table is not None:
                    setattr(layer, name, {i: None if t is None else t.repeat_interleave(batch, dim=0)
                                          for i, t in table.items()})
            for name in ("keys", "values"):
                if isinstance(getattr(layer, name, None), Tensor):
                    setattr(layer, name, getattr(layer, name).repeat_interleave(batch, dim=0))
            replica.layers.append(layer)
        return replica

    def commit(self, path: Tensor, n: int, contiguous: bool) -> None:
        """Keep the accepted rows: a tree's path (any shape) or a chain prefix is re-run / kept on the committed
        state so that it equals the state after exactly those n tokens."""
        if self._tree:
            self._run(self._tokens[path[:n]], n)
        else:
            if not contiguous:
                raise TreeUnsupportedError("recurrent target: a chain verify commits a prefix")
            if n < self._tokens.shape[0]:
                for live, saved in self._saved:
                    live.copy_(saved)
                for layer in self.cache.layers:
                    if getattr(layer, "keys", None) is not None:
                        layer.keys = layer.keys[:, :, : self.length]
                        layer.values = layer.values[:, :, : self.length]
                self._run(self._tokens[:n], n)
        self._saved = self._tokens = None
        self.length += n

    def _run(self, tokens: Tensor, n: int) -> None:
        """Advance the committed cache over `tokens` [n] at positions length..length+n-1."""
        positions = torch.arange(self.length, self.length + n, device=self.forward.device).unsqueeze(0)
        with torch.no_grad():
            self.forward.target(input_ids=tokens.reshape(1, -1), position_ids=positions, past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1)


# ----------------------------------------------------------------------------------------------
# Factory (one cache per target/taps/impl, reused across decode calls)
# ----------------------------------------------------------------------------------------------

_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
IMPLS = ("auto", "dynamic", "static", "fused", "graphs")


def target_cache(target, tap_ids: Sequence[int] = (), impl: str = "auto") -> TargetCache:
    """The target's cache object. impl: 'dynamic' (reference, HF forward), 'static' (HF forward on the static
    buffer), 'fused' (static + eval.target_forward, eager), 'graphs' (fused with compiled pointwise ops where the
    target allows, else HF's forward, + CUDA graphs; CUDA only), or 'auto' (graphs on CUDA, dynamic on CPU).
    Hybrid targets always get the recurrent cache."""
    if impl not in IMPLS:
        raise ValueError(f"cache impl must be one of {IMPLS}, got {impl!r}")
    device = target.get_input_embeddings().weight.device
    if impl == "auto":
        impl = "graphs" if device.type == "cuda" else "dynamic"
    recurrent = bool(recurrent_layer_types(target.config))
    key = ("recurrent" if recurrent else impl, tuple(tap_ids))
    per_target = _CACHES.setdefault(target, {})
    if key not in per_target:
        if recurrent:
            per_target[key] = RecurrentTargetCache(target, tap_ids)
        else:
            per_target[key] = KVTargetCache(target, tap_ids, static=impl in ("static", "fused", "graphs"),
                                            graphs=impl == "graphs", fused=impl in ("fused", "graphs"))
    return per_target[key]
