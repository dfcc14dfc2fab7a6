"""eval/engine/verify.py: positions = start + depth and the ancestor-only 4-D mask, against a hand-built example and
against plain forwards of each root->node path through a real HF target."""

from __future__ import annotations

import pytest
import torch

from eval.engine.cache.factory import target_cache
from eval.engine.tree import Tree, build_tree
from eval.engine.verify import ancestor_matrix, causal_attention_mask, tree_attention_mask, verify_positions
from extract.layers import tap_features
from pipeline.config import TargetConfig
from pipeline.target import load_target, materialize_target

from tests.conftest import CACHE

MIN = torch.finfo(torch.float32).min


pytestmark = pytest.mark.usefixtures("one_torch_thread")

#        0 (root, bonus)
#       / \
#      1   2
#      |   |
#      3   5
#      |
#      4
HAND = Tree(torch.tensor([9, 11, 12, 13, 14, 15]), torch.tensor([0, 0, 0, 1, 3, 2]),
            torch.tensor([0, 1, 1, 2, 3, 2]), 5, 3, "tree")
VIS = [
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 1, 0, 1, 1, 0],
    [1, 0, 1, 0, 0, 1],
]


def test_positions_share_a_depth_and_start_at_the_bonus_position():
    assert verify_positions(HAND, 3).tolist() == [[3, 4, 4, 5, 6, 5]]
    assert verify_positions(HAND, torch.tensor(3)).tolist() == [[3, 4, 4, 5, 6, 5]]


def test_ancestor_matrix_matches_the_hand_built_example():
    assert ancestor_matrix(HAND).int().tolist() == VIS


def test_mask_past_fully_visible_tree_ancestor_only_unused_rows_hidden():
    past, capacity = 3, 12
    for kv_len, past_arg in ((past + 6, past), (capacity, torch.tensor(past))):
        mask = tree_attention_mask(HAND, past_arg, kv_len, torch.float32)
        assert mask.shape == (1, 1, 6, kv_len)
        expected = torch.full((6, kv_len), MIN)
        expected[:, :past] = 0
        expected[:, past:past + 6] = torch.where(torch.tensor(VIS, dtype=torch.bool), 0.0, MIN)
        assert torch.equal(mask[0, 0], expected)


def test_sliding_window_uses_real_positions_not_flat_indices():
    mask = tree_attention_mask(HAND, 3, 9, torch.float32, sliding_window=2)[0, 0] == 0
    # node 4 sits at position 6: it sees keys at positions 5 (node 3) and 6 (itself) only
    assert mask[4].nonzero().flatten().tolist() == [3 + 3, 3 + 4]
    # node 2 at position 4 sees the root (position 3) and itself; its sibling 1 (also position 4) stays hidden
    assert mask[2].nonzero().flatten().tolist() == [3 + 0, 3 + 2]


def test_causal_mask_for_new_rows_on_top_of_a_past():
    mask = causal_attention_mask(3, 2, 7, torch.float32, "cpu")[0, 0] == 0
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("impl", ["dynamic", "static"])
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tree_row_logits_equal_plain_forward_of_each_root_to_node_path(impl, model_type):
    tcfg = TargetConfig(model=f"random:{model_type}", device="cpu", dtype="float32")
    target = load_target(materialize_target(tcfg, CACHE), tcfg)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (9,), generator=gen)
    cache = target_cache(target, [2, 4], impl)
    cache.reset(64)
    cache.prefill(prompt)
    tree = build_tree(torch.randn(5, 320, generator=gen) * 2, 12, 42)
    out = cache.verify(tree, cache.verify_inputs(tree))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    with torch.no_grad():
        for i in range(tree.size):
            path, j = [tokens[i]], i
            while j:
                j = parents[j]
                path.append(tokens[j])
            seq = torch.cat([prompt, torch.tensor(path[::-1])])[None]
            ref = target(seq, output_hidden_states=True)
            assert torch.allclose(out.logits[i], ref.logits[0, -1], atol=1e-4), i
            taps = tap_features(ref.hidden_states, [2, 4])[0, -1]
            assert torch.allclose(out.features[i], taps, atol=1e-4), i
