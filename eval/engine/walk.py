"""The tree walk on the device (docs/tree.md, "Walk") and KV compaction ("Commit").

After the verify forward, row i of the target logits is p(. | prefix, root->i path). The target's choice at row
i (`target_choices`: argmax, or one sample per row at T > 0) is compared with the children of i:

    match[i] = tokens[i] == choice[parents[i]]        (i >= 1; match[0] = True)
    ok[i]    = AND of match over i and all its ancestors   (pointer jumping: ok &= ok[anc]; anc = anc[anc])

Children carry distinct tokens, so the ok nodes form one root path: `accepted` = its depth (drafted tokens
accepted), `path[d]` = its node at depth d (d <= accepted; later entries 0), `bonus` = choice at its last node.
No host sync and no data-dependent control flow: ceil(log2 L) jumps over fixed-shape tensors.

At T > 0 the same rule is lossless (docs/tree.md, "Walk"): every committed token is a target sample given its exact prefix.
`target_choices` consumes exactly one uniform per verify row, drawn by the caller for a fixed maximum number of
rows per round, so the random stream does not depend on the tree's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from eval.engine import walk_triton
from pipeline import triton_runtime
from eval.engine.round_record import pack_record
from eval.engine.tree import Tree


def target_choices(logits: Tensor, temperature: float, uniforms: Tensor | None = None) -> Tensor:
    """The target's token after each verify row: int64 [N] from logits [N, V].

    temperature == 0: argmax. temperature > 0: inverse-CDF sample of softmax(logits / T) in fp32, row i using
    uniforms[i] in [0, 1) (one uniform per row: exact sampling, reproducible given the uniforms).
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if uniforms is None or uniforms.shape[0] < logits.shape[0]:
        raise ValueError("sampling needs one uniform per verify row")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    x = uniforms[: logits.shape[0]].unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    return idx.clamp_max(logits.shape[-1] - 1)


@dataclass
class Walk:
    """Result of one walk, all on the device. path: int64 [L+1]; accepted, bonus, last: int64 0-dim."""

    accepted: Tensor  # drafted nodes accepted (tau - 1)
    path: Tensor  # path[0] = 0 (root), path[d] = accepted node at depth d for d <= accepted, else 0
    bonus: Tensor  # the target's token after the last accepted node (next round's root)
    last: Tensor  # index of the last accepted node

    def host_record(self, tree: Tree) -> Tensor:
        """The round's record (eval/engine/round_record.py), the one small tensor the round reads back."""
        return pack_record(self.accepted, self.bonus, tree.depths.max(), self.path, tree.tokens)


def jump_rounds(depth_limit: int) -> int:
    """Pointer-jumping rounds so that ok[i] covers all of i's drafted ancestors: ceil(log2 L) (0 for L <= 1)."""
    return math.ceil(math.log2(depth_limit)) if depth_limit > 1 else 0


def walk_tree(tree: Tree, choices: Tensor, ancestors: Tensor | None = None) -> Walk:
    """Accepted root path of `tree` given the target's choice at every row (choices: int64 [1+n]).

    ancestors: the tree's `eval.engine.verify.ancestor_table` [N, 2^k] (distances 0..L) if the caller built it for the
    mask; then ok = AND of match over each row of the table (the doubling already done); otherwise pointer jumping.
    """
    tokens, parents, depths = tree.tokens, tree.parents, tree.depths
    N, L = tree.size, tree.depth_limit
    # match[0] = True, written without `match[0] = True`: on CUDA that assignment builds the Python scalar as a
    # CPU tensor and copies it H2D (a blocking copy, and illegal inside CUDA-graph capture)
    match = (tokens == choices[parents]) | (torch.arange(N, device=tokens.device) == 0)
    if ancestors is not None:
        ok = match[ancestors].all(dim=1)
    else:
        ok, anc = match, parents
        for r in range(jump_rounds(L)):
            ok = ok & ok[anc]
            if r + 1 < jump_rounds(L):
                anc = anc[anc]
    accepted = (depths * ok).max()
    slots = torch.where(ok, depths, L + 1)  # rejected nodes write to a dump slot
    path = torch.zeros(L + 2, dtype=torch.long, device=tokens.device)
    path.scatter_(0, slots, torch.arange(N, device=tokens.device))
    path = path[: L + 1]
    last = path.gather(0, accepted.reshape(1))  # gather, not path[accepted]: a 0-dim index would read the host
    bonus = choices.gather(0, last)
    return Walk(accepted, path, bonus.reshape(()), last.reshape(()))


def walk_tree_reference(tokens: list[int], parents: list[int], choices: list[int]) -> tuple[list[int], int]:
    """Sequential walk with per-node child maps (REF `follow_verified_tree`): (accepted node path, bonus)."""
    children: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]][tokens[i]] = i
    path, cur = [0], 0
    while choices[cur] in children[cur]:
        cur = children[cur][choices[cur]]
        path.append(cur)
    return path, choices[cur]


def compact_rows(x: Tensor, dim: int, past: int, keep: Tensor) -> None:
    """In place: rows past + keep[j] of `x` along `dim` move to past + j (j < len(keep)).

    Gathers first, then writes (keep is increasing with keep[j] >= j, but the copy never relies on it).
    """
    n = keep.shape[0]
    x.narrow(dim, past, n).copy_(x.index_select(dim, keep + past))


def compact_path_rows(x: Tensor, dim: int, past: Tensor, path: Tensor) -> None:
    """`compact_rows` for every entry of `path` [L+1] with `past` a 0-dim device int: fixed shape and no host value
    (CUDA-graph safe). Rows after the accepted ones receive copies that lie past the committed length."""
    if triton_runtime.available(x.device) and x.is_contiguous():  # the same move in one launch
        if triton_runtime.run(walk_triton.compact_path_rows, x, dim, past, path) is not None:
            return
    dest = past + torch.arange(path.shape[0], device=path.device)
    x.index_copy_(dim, dest, x.index_select(dim, past + path))
