"""Decayed loss weights, their normalisation, the chunked CE (== naive full-logits CE, value and gradients),
and the accuracy statistics (per-position accuracy, block acceptance, tau_hat)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ConfigError
from dflash_model.blocks import build_block_batch
from train.loss import chunked_cross_entropy, decay_weights, default_gamma, dflash_loss, label_weights, tau_hat


def test_decay_weights_are_zero_at_slot0_and_exp_minus_k_minus_1_over_gamma():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1.0
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert torch.equal(decay_weights(8), decay_weights(8, 4.0))
    with pytest.raises(ConfigError, match="loss_gamma"):
        decay_weights(12)


def test_loss_is_the_weighted_mean_normalised_by_the_decay_weights():
    V, D, B = 11, 6, 4
    torch.manual_seed(0)
    ids = torch.randint(0, V, (20,))
    loss_mask = torch.ones(20, dtype=torch.bool)
    loss_mask[7] = False
    batch = build_block_batch(ids, loss_mask, torch.tensor([2, 5, 14]), B, 10, pad_to=4)
    hidden = torch.randn(16, D, dtype=torch.float64)
    head = torch.randn(V, D, dtype=torch.float64)
    loss, stats = dflash_loss(hidden, head, batch, gamma=2.0, chunk_rows=3)
    w = decay_weights(B, 2.0).double()
    num = den = 0.0
    for q in range(16):
        n, j = divmod(q, B)
        if j == 0 or n == 3:
            continue
        a = [2, 5, 14][n]
        if not loss_mask[a + j]:
            continue
        ce = F.cross_entropy((hidden[q] @ head.T)[None], ids[a + j][None])
        num, den = num + w[j] * ce, den + w[j]
    assert loss.dtype == torch.float32, "the loss is accumulated in fp32"
    assert torch.allclose(loss.double(), num / den, rtol=1e-6)
    assert torch.allclose(stats["weight_sum"].double(), den) and torch.allclose(label_weights(batch, 2.0).sum().double(), den)
    loss2, _ = dflash_loss(hidden, head, batch, gamma=2.0, normalizer=2 * den)
    assert torch.allclose(loss2, loss / 2), "an explicit (global) normaliser replaces the batch weight sum"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_chunked_cross_entropy_equals_full_logits_cross_entropy_value_and_gradients(dtype, tol):
    M, D, V = 23, 8, 50
    torch.manual_seed(1)
    h = torch.randn(M, D, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (M,))
    row_w = torch.rand(M, dtype=dtype)
    ce, pred = chunked_cross_entropy(h, W, labels, chunk_rows=5)
    (ce * row_w).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    logits = h @ W.T
    ref = F.cross_entropy(logits.float() if dtype == torch.float32 else logits, labels, reduction="none")
    (ref * row_w).sum().backward()
    torch.testing.assert_close(ce.to(dtype), ref.to(dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(gh, h.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(gW, W.grad, rtol=tol, atol=tol)
    assert torch.equal(pred, logits.argmax(-1))


def test_chunked_cross_entropy_never_builds_more_than_one_chunk_of_logits():
    """Peak extra memory scales with chunk_rows, not with the number of rows (measured on the autograd graph)."""
    M, D, V = 512, 16, 4096
    h = torch.randn(M, D, requires_grad=True)
    W = torch.randn(V, D)
    labels = torch.randint(0, V, (M,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ce, _ = chunked_cross_entropy(h, W, labels, chunk_rows=32)
    assert max(saved) < M * V // 4, "no [M, V] logits tensor is kept for backward"
    ce.sum().backward()
    assert h.grad.shape == h.shape


def test_stats_count_per_position_hits_and_block_acceptance():
    V, D, B = 7, 7, 4
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    batch = build_block_batch(ids, torch.ones(10, dtype=torch.bool), torch.tensor([0, 4]), B, 6)
    head = torch.eye(V, dtype=torch.float64)
    hidden = torch.zeros(8, D, dtype=torch.float64)
    # block 0 predicts slots 1, 2 right and slot 3 wrong; block 1 gets slot 1 wrong, slots 2, 3 right
    for q, tok in [(1, 1), (2, 2), (3, 0), (5, 0), (6, 6), (7, 0)]:
        hidden[q, tok] = 5.0
    _, stats = dflash_loss(hidden, head, batch, gamma=4.0)
    assert stats["correct_per_pos"].tolist() == [1, 2, 1] and stats["count_per_pos"].tolist() == [2, 2, 2]
    assert stats["accept_len_sum"].item() == (1 + 2) + (1 + 0) and stats["num_blocks"].item() == 2
    assert math.isclose(stats["tau_hat"], 1 + 0.5 + 0.5 * 1.0 + 0.5 * 1.0 * 0.5)
    assert math.isclose(tau_hat(torch.tensor([3.0, 3.0]), torch.tensor([4.0, 4.0])), 1 + 0.75 + 0.75**2)


def test_loss_with_no_valid_label_is_zero_and_differentiable():
    batch = build_block_batch(torch.arange(8), torch.zeros(8, dtype=torch.bool), torch.tensor([1]), 4, 7)
    hidden = torch.randn(4, 5, requires_grad=True)
    loss, stats = dflash_loss(hidden, torch.randn(9, 5), batch, gamma=3.0)
    loss.backward()
    assert loss.item() == 0 and torch.equal(hidden.grad, torch.zeros_like(hidden)) and stats["num_labels"] == 0
