"""Training-forward properties: activation checkpointing changes nothing, gradients reach every trainable
parameter and never the frozen target head, bf16 runs end to end."""

from __future__ import annotations

import torch

from dflash_model.blocks import build_block_batch, sample_anchors
from train.loss import dflash_loss
from dflash_model.model import DFlashDrafter, DrafterArgs

D, V, B, MASK = 32, 64, 4, 63


def setup(dtype=torch.float64):
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B, mask_token_id=MASK,
        target_layer_ids=[0, 2], num_target_layers=4, layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(args).to(dtype)
    embed = torch.randn(V, D, dtype=dtype, requires_grad=True)
    head = torch.randn(V, D, dtype=dtype, requires_grad=True)
    model.attach_target_head(embed, head)
    S = 30
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (S,), generator=g)
    mask = torch.ones(S, dtype=torch.bool)
    batch = build_block_batch(ids, mask, sample_anchors(mask, B, 8, g), B, MASK)
    feats = torch.randn(1, S, 2 * D, generator=g).to(dtype)
    return model, feats, batch, embed, head


def grads(model, feats, batch):
    model.zero_grad()
    loss, _ = dflash_loss(model.forward_train(feats, batch), model.lm_head_weight, batch, gamma=4.0, chunk_rows=7)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_checkpointing_gives_identical_gradients():
    model, feats, batch, _, _ = setup()
    plain = grads(model, feats, batch)
    model.gradient_checkpointing = True
    ckpt = grads(model, feats, batch)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-12, atol=1e-12, msg=name)


def test_gradients_reach_every_trainable_parameter_and_never_the_frozen_head():
    model, feats, batch, embed, head = setup()
    g = grads(model, feats, batch)
    assert all(v.abs().sum() > 0 for v in g.values()), [n for n, v in g.items() if v.abs().sum() == 0]
    assert embed.grad is None and head.grad is None


def test_bf16_training_step_is_finite():
    model, feats, batch, _, _ = setup(torch.bfloat16)
    g = grads(model, feats, batch)
    assert all(torch.isfinite(v.float()).all() and v.dtype == torch.bfloat16 for v in g.values())
