"""eval/engine/tree.py: the builders return exactly the `budget` most probable prefixes, in THE layout and order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eval.engine.tree import build_tree, build_tree_heap, chain_tree, heap_select, root_tree, top_log_probs, tree_size


def brute_force_tree(top_lp: np.ndarray, top_ids: np.ndarray, budget: int):
    """Enumerate every rank tuple, order by the documented total order, keep the first `budget`.

    Returns (tokens, parents, depths) lists including the root (token -1 placeholder), and all prefix scores.
    """
    L, K = top_lp.shape
    levels = []  # per depth: list of (tuple, sigma, within-depth order)
    prev = [((), np.float32(0.0), 0)]
    for d in range(L):
        cands = [(t + (r,), np.float32(s + top_lp[d, r]), o, r) for (t, s, o) in prev for r in range(K)]
        cands.sort(key=lambda c: (-c[1], c[2], c[3]))  # sigma desc, parent order, rank
        prev = [(t, s, i) for i, (t, s, _, _) in enumerate(cands)]
        levels.append(prev)
    everything = [(t, s, d, o) for d, lvl in enumerate(levels) for (t, s, o) in lvl]
    everything.sort(key=lambda e: (-e[1], e[2], e[3]))  # sigma desc, depth asc, within-depth order
    chosen = everything[:budget]
    index = {t: i + 1 for i, (t, _, _, _) in enumerate(chosen)}
    tokens, parents, depths = [-1], [0], [0]
    for t, _, d, _ in chosen:
        tokens.append(int(top_ids[d, t[-1]]))
        parents.append(index[t[:-1]] if len(t) > 1 else 0)
        depths.append(len(t))
    return tokens, parents, depths, [s for (_, s, _, _) in everything]


def as_lists(tree):
    return tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()


def check_against_brute_force(logits: torch.Tensor, budget: int) -> None:
    L, V = logits.shape
    lp, ids = top_log_probs(logits, min(budget, V))
    tokens, parents, depths, scores = brute_force_tree(lp.cpu().numpy(), ids.cpu().numpy(), budget)
    for build in (build_tree, build_tree_heap):
        tree = build(logits, budget, root_token=7)
        got = as_lists(tree)
        assert got[0][0] == 7 and tree.num_nodes == len(tokens) - 1 == tree_size(budget, L, V)
        assert (got[0][1:], got[1], got[2]) == (tokens[1:], parents, depths), build.__name__
    # optimality independent of tie rules: the tree's prefixes carry the largest total probability (Prop. 1-2)
    q = torch.softmax(logits.double().cpu(), dim=-1)
    tokens_t, parents_t, depths_t = as_lists(build_tree(logits, budget, 0))
    prefix_q = [1.0]
    for i in range(1, len(tokens_t)):
        prefix_q.append(prefix_q[parents_t[i]] * float(q[depths_t[i] - 1, tokens_t[i]]))
    best = sorted((math.exp(s) for s in scores), reverse=True)[:budget]
    assert math.isclose(sum(prefix_q[1:]), sum(best), rel_tol=1e-5)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on CUDA build_tree is the Triton kernel


@pytest.mark.parametrize("device", DEVICES)
def test_builders_equal_brute_force_top_budget_on_random_distributions(device):
    gen = torch.Generator().manual_seed(0)
    for trial in range(150):
        L = int(torch.randint(1, 5, (1,), generator=gen))
        V = int(torch.randint(2, 7, (1,), generator=gen))
        budget = int(torch.randint(1, 45, (1,), generator=gen))
        scale = float(torch.rand((), generator=gen)) * 6
        logits = torch.randn(L, V, generator=gen) * scale
        check_against_brute_force(logits.to(device), budget)


@pytest.mark.parametrize("device", DEVICES)
def test_builders_equal_brute_force_under_exact_score_ties(device):
    """Logits from a tiny integer set: many exactly equal log-probs and prefix sums (incl. zero log-probs)."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(150):
        L = int(torch.randint(1, 5, (1,), generator=gen))
        V = int(torch.randint(2, 6, (1,), generator=gen))
        budget = int(torch.randint(1, 40, (1,), generator=gen))
        logits = torch.randint(0, 3, (L, V), generator=gen).float() * 40.0  # 40-logit gaps: p rounds to 1 in fp32
        check_against_brute_force(logits.to(device), budget)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [1, 2, 16, 64, 300, 1024])
def test_device_builder_equals_heap_at_real_depth(budget, device):
    gen = torch.Generator().manual_seed(budget)
    for trial in range(5):
        logits = torch.randn(15, 320, generator=gen) * 4
        if trial % 2:  # bf16 drafts with many exact ties, as the drafter emits them
            logits = (logits * 2).round().to(torch.bfloat16)
        logits = logits.to(device)
        heap, dev = build_tree_heap(logits, budget, 3), build_tree(logits, budget, 3)
        assert as_lists(heap) == as_lists(dev)
        tokens, parents, depths = as_lists(dev)
        assert len(tokens) == budget + 1
        for i in range(1, len(tokens)):
            assert parents[i] < i and depths[i] == depths[parents[i]] + 1 <= 15
        siblings = {}
        for i in range(1, len(tokens)):
            assert tokens[i] not in siblings.setdefault(parents[i], set()), "siblings must carry distinct tokens"
            siblings[parents[i]].add(tokens[i])


def test_budget_one_is_top_token_at_depth_one_and_small_vocab_caps_the_tree():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
    tree = build_tree(logits, 1, 9)
    assert as_lists(tree) == ([9, 1], [0, 0], [0, 1])
    # V=3, L=2: only 3 + 9 prefixes exist
    assert build_tree(logits, 50, 9).num_nodes == build_tree_heap(logits, 50, 9).num_nodes == 12
    assert build_tree(logits, 0, 9).num_nodes == 0


def test_heap_pops_in_total_order_and_parents_precede_children():
    lp = np.log(np.array([[0.5, 0.5, 1e-9], [1.0, 1e-30, 1e-30]], dtype=np.float32))
    parents, depths, ranks = heap_select(lp, 5)
    # (0,) and (1,) tie at log .5: rank order; then their rank-0 children with log 1 = 0 tie with them: depth order
    assert list(zip(parents, depths, ranks)) == [(0, 1, 0), (0, 1, 1), (1, 2, 0), (2, 2, 0), (0, 1, 2)]


def test_chain_and_root_layouts():
    logits = torch.tensor([[0.0, 3.0], [4.0, 0.0], [0.0, 1.0]])
    chain = chain_tree(logits, torch.tensor(5))
    assert as_lists(chain) == ([5, 1, 0, 1], [0, 0, 1, 2], [0, 1, 2, 3]) and chain.kind == "chain"
    root = root_tree(4, "cpu")
    assert as_lists(root) == ([4], [0], [0]) and root.size == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_log_probs_are_the_first_k_of_a_stable_descending_sort(dtype):
    """The top-K definition: logit descending, equal logits by token id ascending, so a tie at the k-th logit keeps
    the lowest ids; log-probs are the row's fp32 log-softmax at those ids (no zeros here: +0.0 ranks above -0.0)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        V = int(torch.randint(2, 3000, (1,), generator=gen))
        k = int(torch.randint(1, V + 1, (1,), generator=gen))
        logits = torch.randint(1, 6, (3, V), generator=gen).float() * (1 if trial % 2 else -0.5)  # many ties
        logits = logits.to(dtype)
        lp, ids = top_log_probs(logits, k)
        ref_ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids, ref_ids), trial
        ref_lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ref_ids)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
