"""End to end on a learnable pattern: training with blocks/mask/loss makes the INFERENCE path draft the right
continuation -- x[start + k] at slot k (a shifted label or leaked anchor would draft the wrong tokens)."""

from __future__ import annotations

import pytest
import torch

from dflash_model.blocks import build_block_batch, sample_anchors
from train.loss import dflash_loss
from dflash_model.model import DFlashDrafter, DrafterArgs

pytestmark = pytest.mark.slow  # trains a drafter until it drafts (tens of seconds on a CPU)

D, V, B, MASK, S = 32, 24, 4, 23, 48


def sequence(g):
    """x[t] = (x0 + 3 t) mod 20; features = one-hot(x[t]) (the 'target hidden state' of each token)."""
    x0 = int(torch.randint(0, 20, (1,), generator=g))
    ids = (x0 + 3 * torch.arange(S)) % 20
    return ids, torch.nn.functional.one_hot(ids, D).float()[None]


def test_training_makes_the_inference_path_draft_the_same_position_tokens():
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B, mask_token_id=MASK,
        target_layer_ids=[0], num_target_layers=2,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(args)
    drafter.attach_target_head(torch.randn(V, D), torch.randn(V, D))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.ones(S, dtype=torch.bool)
    for step in range(250):
        ids, feats = sequence(g)
        batch = build_block_batch(ids, loss_mask, sample_anchors(loss_mask, B, 12, g), B, MASK)
        loss, stats = dflash_loss(drafter.forward_train(feats, batch), drafter.lm_head_weight, batch, gamma=4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert stats["tau_hat"] > 3.5, {k: v for k, v in stats.items() if k in ("tau_hat", "acc_per_pos")}
    ids, feats = sequence(torch.Generator().manual_seed(123))
    hits = 0
    for start in (5, 17, 30, 40):
        drafted = drafter.draft_logits(drafter.new_cache(), feats[:, :start], int(ids[start]), start).argmax(-1)
        hits += int((drafted == ids[start + 1 : start + B]).sum())
    assert hits >= 11, f"{hits}/12 drafted tokens right"
