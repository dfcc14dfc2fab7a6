"""Target caches for attention-only targets (full or sliding layers): `KVTargetCache` (interface:
eval/engine/cache/interface.py).

  * `static=False`: HF `DynamicCache`, additive 4-D mask over past+N keys. The reference path.
  * `static=True`: a preallocated K/V buffer [layers, 2, 1, KVH, capacity, hd] that HF writes
    through `StaticKV.update` at explicit row indices. A verify of N rows attends to the first kv_len rows only,
    kv_len = length + N rounded up to a multiple of KV_BUCKET (<= capacity); the mask hides the unused ones.
    The 4-D mask is built inside the verify call from the tree's ancestor matrix (`VerifyInputs.visibility`) and
    the device scalar `past`, so all shapes are fixed by (N, kv_len). Compaction is one gather + one copy over all
    layers at once. With `graphs=True` (CUDA) the whole verify (mask + every layer + head + taps) for each
    (N, kv_len) is captured once as a CUDA graph (`pipeline.cuda_graphs.CudaGraphFn`) and replayed; the mask then
    lives in the graph's private memory and is rewritten in place by each replay. The decoder also captures its
    tree build and its walk. The first replay of each graph is checked against the eager call; a mismatch or
    failed capture falls back to eager.
  * `fused=True` (static only; impl 'fused', and 'graphs' where the target allows): the verify runs
    `eval.engine.target_forward.VerifyForward` (fused projections, folded-GQA attention straight from the buffer,
    compiled pointwise ops under 'graphs') instead of HF's forward. Its first verify is checked against HF's
    forward on the same inputs; a refusal or a mismatch falls back to HF's forward, with a warning.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache

from eval.engine.cache.interface import (ForwardOutput, HFForward, TargetCache, TreeUnsupportedError, VerifyInputs,
                               recurrent_layer_types)
from eval.engine.target_forward import VerifyForward, refusal
from eval.engine.tree import Tree
from eval.engine.verify import (ancestor_matrix, causal_attention_mask, tree_attention_mask, verify_positions,
                         visibility_attention_mask)
from eval.engine.walk import compact_path_rows, compact_rows
from pipeline.cuda_graphs import CudaGraphFn, relative_error, rounding_tolerance
from pipeline.log import get_logger
from pipeline.target import kv_head_shape, text_config

log = get_logger("eval.engine.cache.kv")

KV_BUCKET = 128  # static-cache verify: attended key rows are rounded up to this (one verify graph per bucket)


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


def disagreement(got: tuple[Tensor, Tensor | None], ref: tuple[Tensor, Tensor | None], taps: int) -> str:
    """Where two verify forwards' (logits [N, V], features [N, taps*D] or None) differ, for the log: the relative
    error of the logits and of each tap's block, and the tree rows (0 = the bonus token) whose logits differ most —
    a wrong layer shows in one tap onward, a wrong mask or position in the rows past the first."""
    parts = [f"logits {relative_error(got[0], ref[0]):.2e}"]
    if ref[1] is not None and taps:
        blocks = zip(got[1].chunk(taps, dim=-1), ref[1].chunk(taps, dim=-1))
        parts.append("taps " + " ".join(f"{relative_error(g, r):.2e}" for g, r in blocks))
    rows = [relative_error(g, r) for g, r in zip(got[0], ref[0])]
    worst = sorted(range(len(rows)), key=lambda i: -rows[i])[:4]
    parts.append("worst rows " + ", ".join(f"{i}: {rows[i]:.2e}" for i in worst))
    return "; ".join(parts)


class KVTargetCache(TargetCache):
    """A target with only (full or sliding) attention layers; dynamic (reference) or static (+ CUDA graphs)."""

    def __init__(self, target, tap_ids: Sequence[int], *, static: bool = False, graphs: bool = False,
                 fused: bool = False):
        if recurrent_layer_types(target.config):
            raise TreeUnsupportedError(f"recurrent layers {recurrent_layer_types(target.config)}: a hybrid target "
                                       "needs eval.engine.cache.hybrid.HybridTargetCache")
        self.forward = HFForward(target, tap_ids)
        self.static = self.device_commit = static
        self.graphs = graphs and static and self.forward.device.type == "cuda"
        self.fused = self._fused_forward(target, tap_ids) if fused and static else None
        self._fused_checked = False
        self.kv: StaticKV | None = None
        self.dynamic: DynamicCache | None = None
        self.length = 0
        self.past = torch.zeros((), dtype=torch.long, device=self.forward.device)  # device copy of `length`
        self._verify_fns: dict[tuple[int, int], object] = {}  # (N, kv_len) -> verify fn / CUDA graph
        self.generation = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self, capacity: int) -> None:
        self._set_length(0)
        if not self.static:
            self.dynamic = DynamicCache()
            return
        if self.kv is None or self.kv.capacity < capacity:
            cfg = text_config(self.forward.target.config)
            heads, head_dim = kv_head_shape(cfg)
            capacity = -(-capacity // 2048) * 2048  # buckets: graphs (keyed by capacity) survive across prompts
            self.kv = None
            self._verify_fns.clear()
            self.generation += 1
            self.kv = StaticKV(cfg.num_hidden_layers, heads, head_dim, capacity, self.forward.dtype, self.forward.device)

    def bucket_lengths(self, rows: int, max_length: int) -> list[int]:
        """One committed length per key bucket a verify of `rows` rows reaches up to max_length (static cache, after
        reset(); [] for the dynamic cache)."""
        if not self.static or self.kv is None:
            return []
        first, last = self.key_rows(1, rows), self.key_rows(max_length, rows)
        return [min(max_length, max(1, kv_len - rows)) for kv_len in range(first, last + 1, KV_BUCKET)]

    def key_rows(self, length: int, rows: int) -> int:
        """Key rows a static verify of `rows` rows on `length` committed rows attends to: length + rows rounded up
        to KV_BUCKET, at most the capacity (one verify graph per value)."""
        return min(self.kv.capacity, -(-(length + rows) // KV_BUCKET) * KV_BUCKET)

    def describe(self) -> str:
        if not self.static:
            return "dynamic KV, HF forward"
        forward = "HF forward" if self.fused is None else \
            f"fused forward ({self.fused.attention_mode(self.forward.device)} attention)"
        graphs = [f for f in self._verify_fns.values() if hasattr(f, "disabled")]
        on_graphs = bool(graphs) and not any(f.disabled for f in graphs)
        return f"static KV, {forward}" + (", CUDA graphs" if on_graphs else "")

    def _fused_forward(self, target, tap_ids):
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
        capturable in a CUDA graph (fixed shapes, no host read). ancestors: the tree's eval.engine.verify.ancestor_table,
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
        kv_len = self.key_rows(self.length, tree.size)
        if self.fused is not None and not self._fused_checked:
            self._check_fused(kv_len, tree, vin)
        key = (tree.size, kv_len)
        fn = self._verify_fns.get(key)
        if fn is None:
            fn = functools.partial(self._static_verify, kv_len)
            if self.graphs:
                fn = CudaGraphFn(fn, f"verify forward N={tree.size} keys={kv_len}", check=logits_close)
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
        err = max(relative_error(g, r) for g, r in zip(got, ref) if r is not None)
        if err > rounding_tolerance(self.forward.dtype):
            log.warning("fused verify forward differs from HF's (relative error %.2e; %s): using HF's forward", err,
                        disagreement(got, ref, len(self.forward.tap_ids)))
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
            keep_dynamic_rows(self.dynamic.layers, self.length, keep, contiguous)
        self._set_length(self.length + n)


def keep_dynamic_rows(layers, length: int, keep: Tensor, contiguous: bool) -> None:
    """HF dynamic-cache layers with K/V [1, KVH, rows, hd]: rows length + keep[j] become rows length + j and every
    row after them is dropped (no move when `contiguous`, i.e. keep == arange(n)). Layers without K/V (linear
    attention) are skipped."""
    end = length + keep.shape[0]
    for layer in layers:
        if getattr(layer, "keys", None) is None:
            continue
        if not contiguous:
            compact_rows(layer.keys, 2, length, keep)
            compact_rows(layer.values, 2, length, keep)
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def logits_close(graph_out, eager_out) -> bool:
    """The verify graph's self-check: its logits equal an eager run's up to rounding
    (`pipeline.cuda_graphs.rounding_tolerance`, the same allowance as the fused forward against HF's). A failure
    logs the error."""
    err = relative_error(graph_out[0], eager_out[0])
    ok = err <= rounding_tolerance(eager_out[0].dtype)
    if not ok:
        log.warning("verify graph vs eager: relative L2 error of the logits %.2e", err)
    return ok
