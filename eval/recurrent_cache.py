"""Target cache for hybrid targets: linear-attention (Gated DeltaNet) + attention layers, e.g. qwen3_5_text
(interface: eval/target_cache.py).

A tree mask cannot stop recurrent state from flowing between branches (docs/tree.md, "Hybrid (recurrent)
targets"), so nothing here uses one. Chain: the recurrent/conv states are copied before verify; if the chain is
cut at n < N rows, they are restored, the attention KV is cropped, and the n accepted rows are re-run from the
saved state. Tree (path-batched): every root->leaf path is one row of a batch [P, depth+1] run from a copy of the
committed state (rows cannot leak into each other), each node's logits/taps are read from a row that holds it, and
commit re-runs the accepted path on the committed state. Both are exact; a tree costs P*(depth+1) verify rows
and one host read of the tree per round, plus the re-run of the accepted rows. A per-node recurrent-state
kernel (state of node i = post-update state of parent[i]) would be the fast version of the same interface.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from eval.target_cache import ForwardOutput, HFForward, TargetCache, TreeUnsupportedError, VerifyInputs
from eval.tree import Tree
from eval.verify import verify_positions


def _recurrent_layers(cache: DynamicCache):
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


class RecurrentTargetCache(TargetCache):
    """Hybrid target (linear-attention + attention layers). Chain: rollback by state copy + re-run. Tree: every
    root->leaf path is one row of a batch run from a copy of the committed state, then the accepted path is re-run
    on the committed state (see the module docstring)."""

    def __init__(self, target, tap_ids: Sequence[int]):
        self.forward = HFForward(target, tap_ids)
        if self.forward.sliding_window is not None:
            raise NotImplementedError("hybrid target with sliding-window layers: crop-based rollback would cut the "
                                      "window caches; not supported")
        self.config = target.config
        self.cache: DynamicCache | None = None
        self.length = 0
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
