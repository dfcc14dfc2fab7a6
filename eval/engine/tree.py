"""THE tree layout and the DDTree best-first builder (docs/tree.md, "The tree layout" and "Builder").

Layout (`Tree`, all tensors on the draft/target device, int64):

    index 0      the root = the bonus token (previous round's target token, not drafted), depth 0,
                 parent 0 (a self-loop, so `parents` can be used as a gather index everywhere)
    index 1..n   drafted nodes in *selection order*; parents[i] < i; depths[i] = depths[parents[i]] + 1
                 <= depth_limit = L = B-1; children of one node carry distinct tokens.

Builder (docs/tree.md, "Builder"; the DDTree paper's Algorithm 1): the draft logits [L, V] give per-depth marginals q_d. With
`K = min(budget, V)` and fp32 log-probs `lp = topk(log_softmax(logits), K)` (computed on the device), a prefix is a
rank tuple rho = (r_1..r_d) with score sigma(rho) = lp[1, r_1] + ... + lp[d, r_d], summed left to right in fp32
(sigma(child) = fp32(sigma(parent) + lp[d, r])).  The tree is exactly the `budget` highest-sigma prefixes
(Prop. 2; prefix-closed because adding a log-prob <= 0 never increases a float).

Total order (deterministic tie-breaking), used by every builder here and by the tests' brute force:
    u before v  iff  sigma(u) > sigma(v),
                or   sigma equal and depth(u) < depth(v),
                or   sigma and depth equal and (parent(u) before parent(v), or same parent and rank(u) < rank(v)).
The node index order is this order.  It differs from the reference's plain lexicographic rank-tuple tie-break only
for exact fp32 score ties between prefixes of different depths or different parents; it is what lets the
device builder below reproduce the heap exactly with fixed shapes.  Log-probs are clamped at -1e30 so that every
prefix has a finite score (a true -inf would make ties arbitrary).

Two builders, identical output:
  * `build_tree_heap`: the reference — one D2H copy of (lp, ids), a best-first heap over rank tuples on the CPU
    (entries (-sigma, depth, parent index, rank): popping in this order is the total order above), one H2D copy.
  * `build_tree`: the same tree computed on the device with fixed shapes and no host sync (CUDA-graph friendly):
    depth by depth it keeps the top-`budget` prefixes of that depth (the parent of any top-`budget` depth-d prefix
    is itself top-`budget` at depth d-1), enumerating only the "staircase" (parent slot i, rank j) with
    (i+1)(j+1) <= budget (any other candidate is beaten by >= budget dominating ones); a stable sort of the
    candidates laid out in (parent slot, rank) order realises the tie-break; a final stable sort over the per-depth
    winners laid out (depth, slot) picks the global top `n`. On CUDA the same selection runs as Triton kernels
    (eval/engine/tree_triton.py `select_tree`: ranks by counting unique int64 keys instead of sorting).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from eval.engine import tree_triton
from pipeline import triton_runtime

LOGPROB_FLOOR = -1e30  # clamp for log-probs: keeps every prefix score finite (15 * -1e30 is still finite in fp32)
MAX_BUDGET = 1 << 16


@dataclass
class Tree:
    """A verify tree (layout in the module docstring). tokens/parents/depths: int64 [1 + num_nodes] on one device."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    num_nodes: int  # n drafted nodes (host int, known without a sync)
    depth_limit: int  # L: no node is deeper (host int); the walk iterates ceil(log2(L)) times
    kind: str  # "root" (AR), "chain" (DFlash) or "tree" (DDTree)

    @property
    def size(self) -> int:
        """Rows of the verify forward: 1 + num_nodes."""
        return 1 + self.num_nodes


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def top_log_probs(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """fp32 top-k log-probs and token ids per depth: ([L, k], [L, k]), the first k tokens of each row in the order
    logit descending, equal logits by token id ascending (so the set, its order and every rank tuple are defined:
    a tie at the k-th logit keeps the lowest ids). log-prob = fp32(logit) - fp32 logsumexp of the row, clamped at
    LOGPROB_FLOOR and never -0.0 (x - lse rounds an exact zero to +0.0), so float sorts and Python comparisons
    agree; the [L, V] fp32 log-softmax is never written. On CUDA with Triton, 16-bit logits take a radix select
    (eval/engine/tree_triton.py `top_log_probs`); everything else takes `top_log_probs_torch`, the definition.
    """
    if draft_logits.dtype in tree_triton.TOP_K_DTYPES and triton_runtime.available(draft_logits.device):
        top = triton_runtime.run(tree_triton.top_log_probs, draft_logits, k, LOGPROB_FLOOR)
        if top is not None:
            return top
    return top_log_probs_torch(draft_logits, k)


def top_log_probs_torch(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`top_log_probs` in torch: one topk over unique int64 keys sortable(logit) << 32 | (2^31 - 1 - id), whose
    descending order is logit descending, ids ascending (+0.0 above -0.0, as in the Triton kernels' keys)."""
    x = draft_logits.float()
    bits = x.view(torch.int32)
    ids = torch.arange(x.shape[-1], device=x.device)
    keys = (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() << 32) | (0x7FFFFFFF - ids)
    top = torch.topk(keys, k, dim=-1).values
    high = (top >> 32).int()
    value = torch.where(high < 0, high ^ 0x7FFFFFFF, high).view(torch.float32)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    return (value - lse).clamp_min(LOGPROB_FLOOR), 0x7FFFFFFF - (top & 0xFFFFFFFF)


def tree_size(budget: int, depth_limit: int, vocab: int) -> int:
    """Number of drafted nodes the builders return: min(budget, sum_{d<=L} K^d) with K = min(budget, V)."""
    if budget <= 0 or depth_limit <= 0:
        return 0
    k = min(budget, vocab)
    total, level = 0, 1
    for _ in range(depth_limit):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


def _check_budget(budget: int) -> None:
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")


def _root_tensor(root_token, device) -> Tensor:
    """The bonus token as an int64 [1] tensor on `device` (int or 0-dim/1-element tensor; no host sync)."""
    if isinstance(root_token, Tensor):
        return root_token.reshape(1).to(device=device, dtype=torch.long)
    return torch.tensor([int(root_token)], dtype=torch.long, device=device)


def root_tree(root_token, device) -> Tree:
    """The AR 'tree': the bonus token alone (one verify row, nothing drafted)."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(_root_tensor(root_token, device), zero, zero.clone(), 0, 0, "root")


def chain_tree(draft_logits: Tensor, root_token) -> Tree:
    """The DFlash chain: root, then argmax of each draft row at depths 1..L (node i's parent is i-1)."""
    L = draft_logits.shape[0]
    device = draft_logits.device
    tokens = torch.cat([_root_tensor(root_token, device), draft_logits.argmax(dim=-1)])
    depths = torch.arange(L + 1, device=device)
    parents = (depths - 1).clamp_min(0)
    return Tree(tokens, parents, depths, L, L, "chain")


# ----------------------------------------------------------------------------------------------
# Reference: best-first heap on the CPU
# ----------------------------------------------------------------------------------------------


def heap_select(top_lp: np.ndarray, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Best-first selection in rank space. top_lp: float32 [L, K] (rows sorted descending).

    Returns (parents, depths, ranks) of the selected nodes 1..n in pop order (lists of length n; parent 0 = root).
    Heap entries (-sigma, depth, parent index, rank) pop in the module's total order; each pop pushes the next
    sibling (rank+1) and the first child (rank 0, depth+1), whose keys are strictly larger.
    """
    L, K = top_lp.shape
    if budget <= 0 or L == 0:
        return [], [], []
    lp = top_lp.astype(np.float32)
    sigma = [np.float32(0.0)]  # sigma of node i (root = 0)
    parents, depths, ranks = [], [], []
    heap = [(-lp[0, 0], 1, 0, 0)]
    while heap and len(parents) < budget:
        neg, depth, parent, rank = heapq.heappop(heap)
        node = len(parents) + 1
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        sigma.append(-neg)
        if rank + 1 < K:
            heapq.heappush(heap, (-(sigma[parent] + lp[depth - 1, rank + 1]), depth, parent, rank + 1))
        if depth < L:
            heapq.heappush(heap, (-(sigma[node] + lp[depth, 0]), depth + 1, node, 0))
    return parents, depths, ranks


def build_tree_heap(draft_logits: Tensor, budget: int, root_token) -> Tree:
    """The reference builder: device top-K, ONE D2H copy, CPU heap, one H2D copy. draft_logits: [L, V]."""
    _check_budget(budget)
    L, V = draft_logits.shape
    device = draft_logits.device
    if budget == 0 or L == 0:
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return Tree(_root_tensor(root_token, device), zero, zero.clone(), 0, L, "tree")
    top_lp, top_ids = top_log_probs(draft_logits, min(budget, V))
    host = torch.cat([top_lp.view(torch.int32).long(), top_ids], dim=1).cpu()  # the one D2H copy
    K = top_lp.shape[1]
    lp_np = host[:, :K].to(torch.int32).view(torch.float32).numpy()
    ids_np = host[:, K:].numpy()
    parents, depths, ranks = heap_select(lp_np, budget)
    tokens = [int(ids_np[d - 1, r]) for d, r in zip(depths, ranks)]
    arrays = torch.tensor([[0] + tokens, [0] + parents, [0] + depths], dtype=torch.long).to(device)
    tokens_t = torch.cat([_root_tensor(root_token, device), arrays[0, 1:]])
    return Tree(tokens_t, arrays[1], arrays[2], len(parents), L, "tree")


# ----------------------------------------------------------------------------------------------
# Device builder (fixed shapes, no host sync)
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _staircase_host(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate (parent slot i, rank j) pairs with (i+1)(j+1) <= budget, j < k; ordered by (i, j)."""
    slots, ranks = [], []
    for i in range(budget):
        m = min(k, budget // (i + 1))
        slots.extend([i] * m)
        ranks.extend(range(m))
    return np.asarray(slots, dtype=np.int64), np.asarray(ranks, dtype=np.int64)


_STAIRCASE: dict = {}


def _staircase(budget: int, k: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(slot_of, rank_of, first, root frontier) device constants, built once per (budget, K, device); first[i] is
    the index of candidate (i, 0)."""
    key = (budget, k, str(device))
    if key not in _STAIRCASE:
        i, j = _staircase_host(budget, k)
        first = np.searchsorted(i, np.arange(budget))
        frontier = torch.full((budget,), float("-inf"))
        frontier[0] = 0.0  # depth 0: the root alone in slot 0
        _STAIRCASE[key] = tuple(torch.as_tensor(a).to(device) for a in (i, j, first, frontier))
    return _STAIRCASE[key]


def build_tree(draft_logits: Tensor, budget: int, root_token) -> Tree:
    """The device builder: the same tree as `build_tree_heap`, with fixed shapes and no host sync.

    draft_logits: [L, V] (any float dtype; the builder works in fp32). root_token: int or device scalar tensor.
    Work: one topk + logsumexp over [L, V]; per depth one gather + add + stable sort over the staircase
    (~B·ln B candidates); one stable sort over the L·B per-depth winners. On CUDA with Triton the selection
    (everything after the top-K) is L + 3 Triton launches, eval/engine/tree_triton.py.
    """
    _check_budget(budget)
    L, V = draft_logits.shape
    device = draft_logits.device
    n = tree_size(budget, L, V)
    if n == 0:
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return Tree(_root_tensor(root_token, device), zero, zero.clone(), 0, L, "tree")
    B = budget
    top_lp, top_ids = top_log_probs(draft_logits, min(B, V))
    K = top_lp.shape[1]
    slot_of, rank_of, first, frontier = _staircase(B, K, device)  # [M] candidates in (slot, rank) order
    if triton_runtime.available(device):  # the same selection in L + 3 launches
        arrays = triton_runtime.run(tree_triton.select_tree, top_lp, top_ids, slot_of, rank_of, first, B, n,
                                    _root_tensor(root_token, device))
        if arrays is not None:
            return Tree(*arrays, n, L, "tree")
    lp_cand = top_lp[:, rank_of]  # [L, M]
    scores, picks = [], []
    for d in range(L):
        cand = frontier.index_select(0, slot_of) + lp_cand[d]
        vals, order = torch.sort(cand, descending=True, stable=True)
        frontier = vals[:B]
        scores.append(frontier)
        picks.append(order[:B])
    scores_all = torch.stack(scores)  # [L, B]: per depth, slots in (sigma desc, parent slot, rank) order
    pick = torch.stack(picks)  # [L, B] candidate index of each slot
    parent_slot = slot_of[pick]
    rank = rank_of[pick]

    _, order = torch.sort(scores_all.reshape(-1), descending=True, stable=True)
    chosen = order[:n]  # flat (depth-1)*B + slot, in the total order
    depth0 = chosen // B  # depth - 1
    slot = chosen % B
    node_of = torch.zeros(L * B, dtype=torch.long, device=device)
    node_of.scatter_(0, chosen, torch.arange(1, n + 1, device=device))
    parent_flat = (depth0 - 1).clamp_min(0) * B + parent_slot[depth0, slot]
    parents = torch.where(depth0 == 0, 0, node_of[parent_flat])
    tokens = top_ids[depth0, rank[depth0, slot]]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(
        torch.cat([_root_tensor(root_token, device), tokens]),
        torch.cat([zero, parents]),
        torch.cat([zero, depth0 + 1]),
        n, L, "tree",
    )
