"""The packed training forward (all anchors at once, dflash_model/blocks.py mask) gives, for every anchor, the same
logits as the inference forward (draft_logits with the context = features strictly before the anchor)."""

from __future__ import annotations

import pytest
import torch

from dflash_model.blocks import build_block_batch
from dflash_model.model import DFlashDrafter, DrafterArgs

D, N_TAPS, V, B = 32, 3, 96, 4
MASK = 90


def tiny_drafter(layer_types, sliding_window=None, seed=0) -> DFlashDrafter:
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, block_size=B,
        mask_token_id=MASK, target_layer_ids=[1, 3, 5], num_target_layers=8, layer_types=list(layer_types),
        sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(args).double()
    for p in drafter.parameters():  # spread weights so attention patterns (and any mask error) matter
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    drafter.attach_target_head(torch.randn(V, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64))
    return drafter


def inference_logits(drafter, features, input_ids, anchor):
    cache = drafter.new_cache()
    return drafter.draft_logits(cache, features[:, :anchor], int(input_ids[anchor]), anchor)


CASES = {
    "full": dict(layer_types=["full_attention"] * 2),
    "mixed_sliding": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=5),
    "sliding_window_smaller_than_block": dict(layer_types=["sliding_attention"] * 2, sliding_window=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_training_forward_equals_inference_forward_for_every_anchor(case):
    drafter = tiny_drafter(**CASES[case])
    S = 24
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 80, (S,), generator=g)
    features = torch.randn(1, S, N_TAPS * D, generator=g, dtype=torch.float64)
    anchors = torch.tensor([0, 1, 5, 6, 7, 13, 20])  # overlapping blocks, anchor 0 (empty context), S-B
    batch = build_block_batch(input_ids, torch.ones(S, dtype=torch.bool), anchors, B, MASK)
    hidden = drafter.forward_train(features, batch, attention="dense")
    train_logits = drafter.logits(hidden).view(len(anchors), B, V)
    for n, a in enumerate(anchors.tolist()):
        ref = inference_logits(drafter, features, input_ids, a)
        torch.testing.assert_close(train_logits[n, 1:], ref, rtol=1e-9, atol=1e-9, msg=f"anchor {a}")


def test_packed_sequences_equal_separate_inference_with_positions_restarting_per_sequence():
    drafter = tiny_drafter(**CASES["mixed_sliding"])
    g = torch.Generator().manual_seed(2)
    lens = [14, 11]
    S = sum(lens)
    input_ids = torch.randint(0, 80, (S,), generator=g)
    features = torch.randn(1, S, N_TAPS * D, generator=g, dtype=torch.float64)
    anchors = torch.tensor([2, 9, 10, 14, 15, 21])  # 14 = first token of sequence 2
    batch = build_block_batch(input_ids, torch.ones(S, dtype=torch.bool), anchors, B, MASK, seq_lens=lens, pad_to=8)
    hidden = drafter.forward_train(features, batch, attention="dense")
    assert torch.isfinite(hidden).all()
    assert (hidden.view(8, B, D)[6:] == 0).all(), "padded blocks must come out as zeros"
    train_logits = drafter.logits(hidden).view(8, B, V)
    for n, a in enumerate(anchors.tolist()):
        start = 0 if a < lens[0] else lens[0]
        ref = inference_logits(drafter, features[:, start:], input_ids[start:], a - start)
        torch.testing.assert_close(train_logits[n, 1:], ref, rtol=1e-9, atol=1e-9, msg=f"anchor {a}")


def test_incremental_cache_appends_equal_one_shot_context():
    drafter = tiny_drafter(**CASES["mixed_sliding"])
    g = torch.Generator().manual_seed(3)
    S = 20
    input_ids = torch.randint(0, 80, (S,), generator=g)
    features = torch.randn(1, S, N_TAPS * D, generator=g, dtype=torch.float64)
    cache = drafter.new_cache()
    start = 0
    for step in [7, 1, 3, 4]:  # accepted lengths of successive rounds
        new_start = start + step
        inc = drafter.draft_logits(cache, features[:, start:new_start], int(input_ids[new_start]), new_start)
        ref = inference_logits(drafter, features, input_ids, new_start)
        torch.testing.assert_close(inc, ref, rtol=1e-10, atol=1e-10)
        assert cache.length == new_start, "the cache must hold only context rows, never block rows"
        start = new_start
    with pytest.raises(ValueError, match="start"):
        drafter.draft_logits(cache, features[:, start : start + 2], 0, start + 5)


def test_float32_inference_returns_fp32_logits_of_b_minus_1_slots():
    drafter = tiny_drafter(**CASES["full"]).float()
    out = drafter.draft_logits(drafter.new_cache(), torch.randn(1, 5, N_TAPS * D), 3, 5)
    assert out.shape == (B - 1, V) and out.dtype == torch.float32


def test_bonus_token_may_be_a_device_scalar_tensor():
    drafter = tiny_drafter(**CASES["full"])
    feats = torch.randn(1, 6, N_TAPS * D, dtype=torch.float64)
    a = drafter.draft_logits(drafter.new_cache(), feats, 7, 6)
    b = drafter.draft_logits(drafter.new_cache(), feats, torch.tensor([7]), 6)
    assert torch.equal(a, b)
