"""Target caches for hybrid targets: Gated-DeltaNet (linear-attention) + attention layers, e.g. qwen3_5_text
(interface: eval/target_cache.py; docs/tree.md, "Hybrid (recurrent) targets").

A tree mask cannot keep a tree's branches apart inside a recurrent layer, so the Gated-DeltaNet layers are walked
along the tree instead (eval/tree_recurrent.py).

`HybridTargetCache` (the default for hybrids), a round of N verify rows:
  * verify: ONE HF forward over the N rows. Attention layers run under the tree mask at positions start + depth
    (eval/verify.py) and append N K/V rows to HF's dynamic cache; each Gated-DeltaNet module is routed, for the
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

`PathBatchedTargetCache` (the reference: the test oracle of the tree-aware verify, and what the H200 benchmark
compares it with): every root->leaf path is one row of a batch [P, depth+1] run through HF's own forward from a
copy of the committed cache (rows cannot leak into each other); each node's logits and taps come from a row that
holds it, and commit re-runs the accepted path on the committed cache. P*(depth+1) rows and one host read of the
tree per round, plus the re-run. Chains and AR run as in `HybridTargetCache`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from eval.kv_cache import keep_dynamic_rows
from eval.target_cache import ForwardOutput, HFForward, TargetCache, VerifyInputs
from eval.tree import Tree
from eval.tree_recurrent import TreeLayerRecord, commit_path, tree_gated_delta_net, tree_walk
from eval.verify import tree_attention_mask, verify_positions
from extract.layers import decoder_layers
from pipeline.target import gated_delta_kernels, text_config

LINEAR_ATTENTION = "linear_attention"


class HybridTargetCache(TargetCache):
    """Hybrid target: attention layers under the tree mask, Gated-DeltaNet layers walked along the tree; commit of
    the accepted node's state without a re-run (module docstring)."""

    def __init__(self, target, tap_ids: Sequence[int]):
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
        self.cache: DynamicCache | None = None
        self.conv_states: Tensor | None = None  # [NL, C, K] committed conv windows (HF's cache holds views)
        self.recurrent_states: Tensor | None = None  # [NL, HV, dk, dv] committed states (HF's cache holds views)
        self.length = 0
        self._rows: list[TreeLayerRecord] | None = None  # node rows of the pending tree verify, one per layer

    def describe(self) -> str:
        return ("hybrid: dynamic KV under the tree mask + tree-walked Gated-DeltaNet layers, HF forward (prefill and "
                f"AR steps on the {gated_delta_kernels(self.forward.target)} gated delta rule)")

    def reset(self, capacity: int) -> None:
        self.cache = DynamicCache(config=self.config)
        self.conv_states = self.recurrent_states = None
        self._rows = None
        self.length = 0

    def prefill(self, input_ids: Tensor) -> ForwardOutput:
        S = input_ids.shape[-1]
        positions = torch.arange(S, device=self.forward.device).unsqueeze(0)
        out = self.forward(input_ids, positions, None, self.cache, last_logits_only=True)
        self.length = S
        self._stack_states()
        return out

    def _stack_states(self) -> None:
        """Move every Gated-DeltaNet layer's conv window and state (HF's [1, ...] tensors, made by the prefill) into
        one stacked buffer each and point HF's cache at views of them."""
        layers = [self.cache.layers[i] for i, _ in self.linear]
        self.conv_states = torch.cat([layer.conv_states[0] for layer in layers])
        self.recurrent_states = torch.cat([layer.recurrent_states[0] for layer in layers])
        for j, layer in enumerate(layers):
            layer.conv_states[0] = self.conv_states[j: j + 1]
            layer.recurrent_states[0] = self.recurrent_states[j: j + 1]

    def verify_inputs(self, tree: Tree, ancestors: Tensor | None = None) -> VerifyInputs:
        """Positions start + depth; a tree gets its ancestor mask for the attention layers (the linear-attention
        entry None: those layers take no mask), a chain or a root HF's own causal mask."""
        positions = verify_positions(tree, self.length)
        if tree.kind != "tree":
            return VerifyInputs(positions, None)
        mask = tree_attention_mask(tree, self.length, self.length + tree.size, self.forward.dtype, ancestors=ancestors)
        return VerifyInputs(positions, {t: None if t == LINEAR_ATTENTION else mask for t in self.layer_types})

    def verify(self, tree: Tree, vin: VerifyInputs) -> ForwardOutput:
        if tree.kind == "root":  # HF's decode step: one row, always committed, states updated in place
            self._rows = None
            return self.forward(tree.tokens, vin.positions, vin.mask, self.cache)
        with self._tree_linear_attention(tree) as rows:
            out = self.forward(tree.tokens, vin.positions, vin.mask, self.cache)
        self._rows = rows
        return out

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
        keep_dynamic_rows(self.cache.layers, self.length, keep, contiguous)
        if self._rows is not None:
            rows = self._rows
            commit_path(self.linear[0][1], torch.stack([r.conv_inputs for r in rows]),
                        torch.stack([r.conv_outputs for r in rows]), torch.stack([r.g for r in rows]),
                        torch.stack([r.beta for r in rows]), keep, self.conv_states, self.recurrent_states)
        self._rows = None
        self.length += n


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
