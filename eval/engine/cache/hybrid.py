"""Target caches for hybrid targets: Gated-DeltaNet (linear-attention) + attention layers, e.g. qwen3_5_text
(interface: eval/engine/cache/interface.py; docs/tree.md, "Hybrid (recurrent) targets").

A tree mask cannot keep a tree's branches apart inside a recurrent layer, so the Gated-DeltaNet layers are walked
along the tree instead (eval/engine/tree_recurrent.py).

`HybridTargetCache` (the default for hybrids), a round of N verify rows:
  * verify: ONE HF forward over the N rows. Attention layers run under the tree mask at positions start + depth
    (eval/engine/verify.py) and append N K/V rows to HF's dynamic cache; each Gated-DeltaNet module is routed, for the
    duration of that forward, to `tree_gated_delta_net` with its layer's committed conv window and state (read
    only), and its node rows are kept, stacked over layers, for the commit. The Triton walk's order and scratch
    are computed once per tree for all layers.
  * commit(path, n): attention layers keep the accepted K/V rows (`keep_dynamic_rows`, as the dynamic KV cache);
    the Gated-DeltaNet layers' conv windows and states are recomputed along the accepted root path from the kept
    rows, all layers in one `commit_path` (one Triton launch for the states): no re-run of the accepted path.
  * A chain is a one-branch tree (cutting it at n rows = committing a prefix); AR (a root-only tree) runs HF's
    own one-token decode step, which updates the states in place.
  The committed conv windows [NL, C, K] and states [NL, HV, dk, dv] of the NL Gated-DeltaNet layers live in two
  stacked buffers; HF's cache holds views of them (HF writes its states in place), so one launch commits them all.
  On CUDA with Triton neither the verify nor the commit reads the device: the round keeps the decoder's one sync.
  With `static=True` (impls 'static' and 'graphs') the attention layers write their K/V into one preallocated
  buffer [A, 2, 1, KVH, capacity, hd] (`StaticHybridKV`, eval/engine/cache/kv.py's StaticKV contract) and a verify of N
  rows attends to the first kv_len = length + N rows rounded up to KV_BUCKET, under a mask built inside the verify
  from the tree's ancestor matrix and the device length; the stacked states keep their addresses across prompts.
  Every shape is then fixed by (N, kv_len), and with `graphs=True` (CUDA) each verify, AR steps included, is
  captured once as a CUDA graph and replayed: HF's eager hybrid forward is bound by its launches, not the GPU
  (docs/benchmarks.md, "hybrid"), so 'auto' picks it on CUDA.
  The static cache also commits on the device (`device_commit`, the decoder's `compact_path` / `commit_compacted`):
  a verify stacks its node rows into buffers kept per tree size N (one address for every key bucket's verify
  graph), and the walk, right after choosing the path, moves the L+1 path rows of K/V to the front and commits the
  Gated-DeltaNet states along path[:accepted+1] with fixed shapes (`commit_path_steps`) from those buffers, then
  advances the device length: no host value, so the commit and the compaction replay inside the walk's CUDA graph
  and the round keeps its one host read (the walk's record). It equals `commit` bit for bit.

`PathBatchedTargetCache` (the reference: the test oracle of the tree-aware verify, and what the hybrid benchmark
compares it with): every root->leaf path is one row of a batch [P, depth+1] run through HF's own forward from a
copy of the committed cache (rows cannot leak into each other); each node's logits and taps come from a row that
holds it, and commit re-runs the accepted path on the committed cache. P*(depth+1) rows and one host read of the
tree per round, plus the re-run. Chains and AR run as in `HybridTargetCache`.
"""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from eval.engine.cache.kv import KV_BUCKET, keep_dynamic_rows, logits_close
from eval.engine.cache.interface import ForwardOutput, HFForward, TargetCache, VerifyInputs
from eval.engine.tree import Tree
from eval.engine.tree_recurrent import TreeLayerRecord, commit_path, commit_path_steps, tree_gated_delta_net, tree_walk
from eval.engine.verify import (ancestor_matrix, causal_attention_mask, tree_attention_mask, verify_positions,
                         visibility_attention_mask)
from eval.engine.walk import compact_path_rows, compact_rows
from pipeline.cuda_graphs import CudaGraphFn
from pipeline.recurrent_cache import stack_linear_states
from extract.layers import decoder_layers
from pipeline.target import gated_delta_kernels, kv_head_shape, text_config

LINEAR_ATTENTION = "linear_attention"
RECORD_FIELDS = ("conv_inputs", "conv_outputs", "g", "beta")  # a verify's node rows, stacked over the layers


class StaticHybridKV(DynamicCache):
    """HF's cache for a hybrid `config` whose attention layers write K/V into the preallocated buffer
    kv [A, 2, 1, KVH, capacity, hd] (slot j = the j-th attention layer) at `write_rows` (int64 [q], set before each
    forward) and return rows [0, kv_len) as views (eval/engine/cache/kv.py StaticKV's contract); the Gated-DeltaNet layers
    keep HF's own conv / recurrent state handling (prefill and AR steps)."""

    def __init__(self, config, kv: Tensor, attention_layers: Sequence[int]):
        super().__init__(config=config)
        self.kv = kv
        self.slot = {layer: j for j, layer in enumerate(attention_layers)}
        self.write_rows = torch.zeros(0, dtype=torch.long, device=kv.device)
        self.kv_len = kv.shape[4]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.kv[self.slot[layer_idx], 0], self.kv[self.slot[layer_idx], 1]
        keys.index_copy_(2, self.write_rows, key_states)
        values.index_copy_(2, self.write_rows, value_states)
        return keys.narrow(2, 0, self.kv_len), values.narrow(2, 0, self.kv_len)


class HybridTargetCache(TargetCache):
    """Hybrid target: attention layers under the tree mask, Gated-DeltaNet layers walked along the tree; commit of
    the accepted node's state without a re-run (module docstring)."""

    def __init__(self, target, tap_ids: Sequence[int], *, static: bool = False, graphs: bool = False):
        self.forward = HFForward(target, tap_ids)
        if self.forward.sliding_window is not None:
            raise NotImplementedError("hybrid target with sliding-window layers: HF's sliding caches keep only the "
                                      "window, so rejected rows cannot be dropped; not supported")
        self.config = target.config
        types = text_config(target.config).layer_types
        self.layer_types = sorted(set(types))
        # (cache layer index, Gated-DeltaNet module) of every linear-attention layer, in layer order
        self.linear = [(i, layer.linear_attn) for i, layer in enumerate(decoder_layers(target))
                       if types[i] == LINEAR_ATTENTION]
        self.attention = [i for i, t in enumerate(types) if t != LINEAR_ATTENTION]
        self.static = static
        self.graphs = graphs and static and self.forward.device.type == "cuda"
        self.cache: DynamicCache | None = None
        self.conv_states: Tensor | None = None  # [NL, C, K] committed conv windows (HF's cache holds views)
        self.recurrent_states: Tensor | None = None  # [NL, HV, dk, dv] committed states (HF's cache holds views)
        self.kv: Tensor | None = None  # static: [A, 2, 1, KVH, capacity, hd] K/V of the attention layers
        self.length = 0
        self.past = torch.zeros((), dtype=torch.long, device=self.forward.device)  # device copy of `length`
        self._rows: list[TreeLayerRecord] | None = None  # node rows of the pending tree verify, one per layer
        self._records: tuple[Tensor, ...] | None = None  # static: the same rows stacked over layers (RECORD_FIELDS)
        self._record_buffers: dict[int, tuple[Tensor, ...]] = {}  # static: N -> the buffers a verify stacks them in
        self.device_commit = self.static
        self._verify_fns: dict[tuple, object] = {}  # static: (kind, N, kv_len) -> verify fn / CUDA graph
        self.generation = 0

    def describe(self) -> str:
        kernels = gated_delta_kernels(self.forward.target)
        if not self.static:
            return ("hybrid: dynamic KV under the tree mask + tree-walked Gated-DeltaNet layers, HF forward (prefill "
                    f"and AR steps on the {kernels} gated delta rule)")
        graphs = [f for f in self._verify_fns.values() if hasattr(f, "disabled")]
        on_graphs = bool(graphs) and not any(f.disabled for f in graphs)
        return ("hybrid: static KV under the tree mask + tree-walked Gated-DeltaNet layers, HF forward (prefill and AR "
                f"steps on the {kernels} gated delta rule)" + (", CUDA graphs" if on_graphs else ""))

    def _set_length(self, n: int) -> None:
        self.length = n
        self.past.fill_(n)  # an async device fill, no sync

    def reset(self, capacity: int) -> None:
        self._rows = self._records = None
        self._set_length(0)
        if not self.static:
            self.cache = DynamicCache(config=self.config)
            self.conv_states = self.recurrent_states = None
            return
        if self.kv is None or self.kv.shape[4] < capacity:
            cfg = text_config(self.config)
            heads, head_dim = kv_head_shape(cfg)
            capacity = -(-capacity // 2048) * 2048  # buckets: graphs (keyed by the buffer) survive across prompts
            self.kv = None
            self._verify_fns.clear()
            self.generation += 1
            self.kv = torch.zeros(len(self.attention), 2, 1, heads, capacity, head_dim, dtype=self.forward.dtype,
                                  device=self.forward.device)
        self.cache = StaticHybridKV(self.config, self.kv, self.attention)

    def bucket_lengths(self, rows: int, max_length: int) -> list[int]:
        """Static cache: one committed length per key bucket a verify of `rows` rows reaches up to max_length (the
        warm-up visits them so that timed decoding captures nothing); [] for the dynamic cache."""
        if not self.static or self.kv is None:
            return []
        first, last = self.key_rows(1, rows), self.key_rows(max_length, rows)
        return [min(max_length, max(1, kv_len - rows)) for kv_len in range(first, last + 1, KV_BUCKET)]

    def key_rows(self, length: int, rows: int) -> int:
        """Key rows a static verify of `rows` rows on `length` committed rows attends to (eval/engine/cache/kv.py)."""
        return min(self.kv.shape[4], -(-(length + rows) // KV_BUCKET) * KV_BUCKET)

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        S = input_ids.shape[-1]
        positions = torch.arange(S, device=self.forward.device).unsqueeze(0)
        if self.static:
            self.cache.write_rows = torch.arange(S, device=self.forward.device)
            self.cache.kv_len = self.kv.shape[4]
            causal = causal_attention_mask(S, 0, self.kv.shape[4], self.forward.dtype, self.forward.device)
            out = self.forward(input_ids, positions, self._masks(causal), self.cache, last_logits_only=True)
        else:
            out = self.forward(input_ids, positions, None, self.cache, last_logits_only=True)
        self._set_length(S)
        self._stack_states()
        return out

    def _masks(self, mask: Tensor | None) -> dict:
        """HF's per-layer-type mask argument: `mask` for the attention layers, None for the linear-attention ones."""
        return {t: None if t == LINEAR_ATTENTION else mask for t in self.layer_types}

    def _stack_states(self) -> None:
        """Move every Gated-DeltaNet layer's conv window and state (HF's [1, ...] tensors, made by the prefill) into
        one stacked buffer each and point HF's cache at views of them (pipeline/recurrent_cache.py; batch 1: the
        buffers [NL, 1, ...] are kept as [NL, ...]). The static cache keeps its buffers (their addresses are in the
        CUDA graphs) and copies into them."""
        keep = self.static and self.conv_states is not None
        old = (self.conv_states.unsqueeze(1), self.recurrent_states.unsqueeze(1)) if keep else (None, None)
        conv, state = stack_linear_states(self.cache, [i for i, _ in self.linear], *old)
        if keep and conv.data_ptr() != old[0].data_ptr():  # new shapes: the graphs hold the old buffers
            self._verify_fns.clear()
            self.generation += 1
        self.conv_states, self.recurrent_states = conv[:, 0], state[:, 0]

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        """Positions start + depth. Dynamic cache: a tree gets its ancestor mask for the attention layers (the
        linear-attention entry None: those layers take no mask), a chain or a root HF's own causal mask. Static
        cache: positions from the device length + the ancestor matrix (`verify` builds the mask for its bucket)."""
        if self.static:
            return VerifyInputs(verify_positions(tree, self.past), None, ancestor_matrix(tree, ancestors))
        positions = verify_positions(tree, self.length)
        if tree.kind != "tree":
            return VerifyInputs(positions, None)
        mask = tree_attention_mask(tree, self.length, self.length + tree.size, self.forward.dtype, ancestors=ancestors)
        return VerifyInputs(positions, self._masks(mask))

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        if self.static:
            return self._verify_static(tree, vin)
        if tree.kind == "root":  # HF's decode step: one row, always committed, states updated in place
            self._rows = None
            return self.forward(tree.tokens, vin.positions, vin.mask, self.cache)
        with self._tree_linear_attention(tree) as rows:
            out = self.forward(tree.tokens, vin.positions, vin.mask, self.cache)
        self._rows = rows
        return out

    def _verify_static(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        """One fixed-shape verify per (kind, N, kv_len), a CUDA graph under `graphs`. A root (AR step) runs HF's decode
        step, which advances the stacked states in place (restored between a graph's first-call runs); a chain or a
        tree reads them and returns its node rows for the commit."""
        kv_len = self.key_rows(self.length, tree.size)
        key = (tree.kind, tree.size, tree.depth_limit, kv_len)
        fn = self._verify_fns.get(key)
        if fn is None:
            fn = functools.partial(self._static_verify, kv_len, tree.kind, tree.num_nodes, tree.depth_limit)
            if self.graphs:
                state = (lambda: [self.conv_states, self.recurrent_states]) if tree.kind == "root" else None
                fn = CudaGraphFn(fn, f"hybrid verify {tree.kind} N={tree.size} keys={kv_len}", check=logits_close,
                                 state=state)
            self._verify_fns[key] = fn
        logits, features, records = fn(tree.tokens, tree.parents, tree.depths, vin.positions, vin.visibility)
        self._records = records
        return ForwardOutput(logits, features)

    def _static_verify(self, kv_len: int, kind: str, num_nodes: int, depth_limit: int, tokens: Tensor, parents: Tensor,
                       depths: Tensor, positions: Tensor, visibility: Tensor):
        """-> (logits [N, V], taps [N, F] or None, the node rows stacked over layers or None for a root). Rows
        past..past+N-1 of the K/V buffer, keys [0, kv_len) under the mask built here; no host value read."""
        self.cache.kv_len = kv_len
        self.cache.write_rows = self.past + torch.arange(tokens.shape[0], device=tokens.device)
        masks = self._masks(visibility_attention_mask(visibility, positions, self.past, kv_len, self.forward.dtype))
        if kind == "root":
            out = self.forward(tokens, positions, masks, self.cache)
            return out.logits, out.features, None
        with self._tree_linear_attention(Tree(tokens, parents, depths, num_nodes, depth_limit, kind)) as rows:
            out = self.forward(tokens, positions, masks, self.cache)
        return out.logits, out.features, self._stack_records(rows)

    def _stack_records(self, rows: list[TreeLayerRecord]) -> tuple[Tensor, ...]:
        """The verify's node rows stacked over layers (RECORD_FIELDS: [NL, N, ...] each) into the buffers kept for
        this N: every verify graph of N rows (one per key bucket) writes the same addresses, which the walk's graph
        reads for the commit. Allocated on first use (a graph's first call runs eagerly before it captures)."""
        n = rows[0].conv_inputs.shape[0]
        stacked = [[getattr(r, f) for r in rows] for f in RECORD_FIELDS]
        buffers = self._record_buffers.get(n)
        if buffers is None:
            buffers = self._record_buffers[n] = tuple(torch.stack(x) for x in stacked)
            return buffers
        for buf, x in zip(buffers, stacked):
            torch.stack(x, out=buf)
        return buffers

    @contextmanager
    def _tree_linear_attention(self, tree: Tree):
        """While open, every Gated-DeltaNet module's forward is `tree_gated_delta_net` over `tree` with its layer's
        committed state (which it only reads); yields the list that receives each layer's node rows, in layer
        order. HF's decoder layer calls the module as `linear_attn(hidden_states=..., cache_params=...,
        attention_mask=...)`; everything else in the forward is HF's own."""
        rows: list[TreeLayerRecord] = []
        walk = tree_walk(tree, self.linear[0][1])

        def routed(j: int, module):
            def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
                out, record = tree_gated_delta_net(module, hidden_states, tree, self.conv_states[j: j + 1],
                                                   self.recurrent_states[j: j + 1], walk)
                rows.append(record)
                return out
            return forward

        for j, (_, module) in enumerate(self.linear):
            module.forward = routed(j, module)
        try:
            yield rows
        finally:
            for _, module in self.linear:
                del module.forward

    def commit(self, path: Tensor, n: int, contiguous: bool) -> None:
        """Keep the accepted nodes path[:n] (path: device int64, any length >= n): their K/V rows in the attention
        layers, and in every Gated-DeltaNet layer the conv window and state after them (recomputed from the kept
        node rows; nothing to do after a root-only verify, whose HF step already advanced them)."""
        keep = path[:n]
        if self.static:
            if not contiguous:
                compact_rows(self.kv, 4, self.length, keep)
            records, self._records = self._records, None
        else:
            keep_dynamic_rows(self.cache.layers, self.length, keep, contiguous)
            records = None if self._rows is None else \
                tuple(torch.stack([getattr(r, f) for r in self._rows]) for f in RECORD_FIELDS)
            self._rows = None
        if records is not None:
            commit_path(self.linear[0][1], *records, keep, self.conv_states, self.recurrent_states)
        self._set_length(self.length + n)

    # -- device commit (static cache): the decoder's walk calls compact_path inside its CUDA graph -------------

    def compact_path(self, path: Tensor, accepted: Tensor) -> None:
        """Fixed shapes, no host value (path [L+1] device int64, accepted 0-dim): K/V rows past + path[j] -> past + j
        for every j in 0..L, all attention layers at once; after a chain or tree verify every Gated-DeltaNet layer's
        conv window and state committed along path[:accepted+1] (`commit_path_steps`; after a root verify HF's step
        already advanced them); then the device length += accepted + 1. `commit_compacted` follows on the host."""
        compact_path_rows(self.kv, 4, self.past, path)
        if self._records is not None:
            commit_path_steps(self.linear[0][1], *self._records, path, accepted + 1, self.conv_states,
                              self.recurrent_states)
        self.past.add_(accepted + 1)

    def compaction_state(self, rows: int) -> list[Tensor]:
        """What `compact_path` changes (restored between a CUDA graph's first-call runs): K/V rows length ..
        length + rows - 1, the device length, the stacked conv windows and states."""
        return [self.kv.narrow(4, self.length, rows), self.past, self.conv_states, self.recurrent_states]

    def commit_compacted(self, n: int) -> None:
        """After `compact_path`: the host length += n; the verify's rows are spent."""
        self.length += n
        self._records = None


class PathBatchedTargetCache(HybridTargetCache):
    """The reference tree verify for hybrids: every root->leaf path as its own batch row from a copy of the
    committed cache, then the accepted path re-run (module docstring). Chains and AR: `HybridTargetCache`."""

    def __init__(self, target, tap_ids: Sequence[int]):
        super().__init__(target, tap_ids)
        self._tokens: Tensor | None = None  # the pending path-batched verify's tree tokens (None: not one)

    def describe(self) -> str:
        return "hybrid: trees path-batched through HF's forward (reference), chains tree-walked"

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        if tree.kind == "tree":
            return VerifyInputs(verify_positions(tree, self.length), None)  # rows run causally, path by path
        return super().verify_inputs(tree, ancestors)

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        self._tokens = None
        if tree.kind != "tree":
            return super().verify(tree, vin)
        self._tokens = tree.tokens
        return self._verify_paths(tree)

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
        """A path-batched tree: re-run the accepted path's n tokens on the committed cache (HF's forward advances
        the K/V and, in place, the states). Otherwise `HybridTargetCache.commit`."""
        if self._tokens is None:
            return super().commit(path, n, contiguous)
        tokens, self._tokens = self._tokens[path[:n]], None
        positions = torch.arange(self.length, self.length + n, device=self.forward.device).unsqueeze(0)
        with torch.no_grad():
            self.forward.target(input_ids=tokens.reshape(1, -1), position_ids=positions, past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1)
        self.length += n
