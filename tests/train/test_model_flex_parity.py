"""Dense (SDPA + boolean mask) and FlexAttention training paths agree: loss, and gradients where flex has a
backward (CUDA). On CPU, torch's flex_attention runs the forward only (eager, unfused) -- so the CPU test checks
the forward/loss and the gradient test runs on GPU only."""

from __future__ import annotations

import pytest
import torch

from dflash_model.blocks import build_block_batch
from train.loss import dflash_loss
from dflash_model.model import DFlashDrafter, DrafterArgs

D, N_TAPS, V, B, MASK = 32, 2, 80, 4, 70


def setup(device, dtype=torch.float32):
    args = DrafterArgs(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, block_size=B, mask_token_id=MASK,
        target_layer_ids=[1, 2], num_target_layers=4, layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(args).to(device=device, dtype=dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    model.attach_target_head(torch.randn(V, D, device=device, dtype=dtype), torch.randn(V, D, device=device, dtype=dtype))
    g = torch.Generator().manual_seed(1)
    S, lens = 40, [25, 15]
    ids = torch.randint(0, 60, (S,), generator=g)
    feats = torch.randn(1, S, N_TAPS * D, generator=g).to(device=device, dtype=dtype)
    anchors = torch.tensor([0, 3, 7, 8, 15, 21, 25, 30, 36])
    batch = build_block_batch(ids, torch.ones(S, dtype=torch.bool), anchors, B, MASK, seq_lens=lens, pad_to=12)
    return model, feats, batch.to(device)


def test_flex_forward_and_loss_equal_dense_on_cpu():
    model, feats, batch = setup("cpu")
    with torch.no_grad():
        dense = model.forward_train(feats, batch, attention="dense")
        flex = model.forward_train(feats, batch, attention="flex")
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
        l_dense, _ = dflash_loss(dense, model.lm_head_weight, batch, gamma=4.0)
        l_flex, _ = dflash_loss(flex, model.lm_head_weight, batch, gamma=4.0)
    torch.testing.assert_close(l_flex, l_dense, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(dense).all() and torch.isfinite(flex).all(), "padded blocks must not produce NaN"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU (torch raises NotImplementedError); gradient parity runs on CUDA")
def test_flex_loss_and_gradients_equal_dense_on_cuda():
    model, feats, batch = setup("cuda")
    grads = {}
    for attention in ("dense", "flex"):
        model.zero_grad()
        loss, _ = dflash_loss(model.forward_train(feats, batch, attention=attention), model.lm_head_weight, batch, 4.0)
        loss.backward()
        grads[attention] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["flex"][0], grads["dense"][0], rtol=1e-4, atol=1e-5)
    for name, g in grads["dense"][1].items():
        torch.testing.assert_close(grads["flex"][1][name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_dense_padded_blocks_have_zero_gradient_and_no_nan():
    model, feats, batch = setup("cpu")
    feats = feats.clone().requires_grad_(True)
    hidden = model.forward_train(feats, batch, attention="dense")
    loss, _ = dflash_loss(hidden, model.lm_head_weight, batch, gamma=4.0)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(feats.grad).all()


def test_a_padding_only_micro_batch_gives_zero_loss_and_finite_zero_gradients():
    """What the trainer feeds when a rank runs out of data: one token, no anchors, one padding block."""
    model, _, _ = setup("cpu")
    batch = build_block_batch(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool),
                              torch.zeros(0, dtype=torch.long), B, MASK, pad_to=1)
    hidden = model.forward_train(torch.randn(1, 1, N_TAPS * D), batch, attention="dense")
    loss, stats = dflash_loss(hidden, model.lm_head_weight, batch, gamma=4.0)
    loss.backward()
    assert loss.item() == 0 and stats["num_blocks"] == 0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters())
