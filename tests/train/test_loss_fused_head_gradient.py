"""The trainer's LM-head cross-entropy path (frozen head: the input gradient is computed in the forward, two
matmuls per row) gives the full-logits CE's value, argmax and input gradient; and the compiled training forward
(`DFlashDrafter.compile_training`) traces without graph breaks and equals the eager one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_model.blocks import build_block_batch
from train.loss import _chunk_loss, chunked_cross_entropy, dflash_loss
from dflash_model.model import DFlashDrafter, DrafterArgs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_frozen_head_cross_entropy_equals_full_logits_value_argmax_and_input_gradient(dtype, tol):
    M, D, V = 23, 8, 50
    torch.manual_seed(1)
    h = torch.randn(M, D, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, dtype=dtype)  # frozen, like the target's LM head buffer
    labels = torch.randint(0, V, (M,))
    row_w = torch.rand(M, dtype=dtype)
    ce, pred = chunked_cross_entropy(h, W, labels, chunk_rows=5)
    (ce * row_w).sum().backward()
    gh = h.grad.clone()
    h.grad = None
    logits = h @ W.T
    ref = F.cross_entropy(logits, labels, reduction="none")
    (ref * row_w).sum().backward()
    torch.testing.assert_close(ce.to(dtype), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gh, h.grad, rtol=tol, atol=tol)
    assert torch.equal(pred, logits.argmax(-1))


def test_bf16_frozen_head_gradient_matches_the_fp64_reference_like_the_recompute_path():
    """bf16 logits/dlogits: the fused path is as close to fp64 as the three-matmul recompute path."""
    M, D, V = 64, 32, 300
    torch.manual_seed(2)
    h64, W64 = torch.randn(M, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (M,))
    row_w = torch.rand(M, dtype=torch.float64) * 1e-3  # the trainer's tiny per-row weights (w / normaliser)
    grads = {}
    for name, W_grad in (("fused", False), ("recompute", True), ("fp64", False)):
        dt = torch.float64 if name == "fp64" else torch.bfloat16
        h = h64.to(dt).requires_grad_(True)
        W = W64.to(dt).requires_grad_(W_grad)
        ce, _ = chunked_cross_entropy(h, W, labels, chunk_rows=16)
        (ce * row_w.to(ce.dtype)).sum().backward()
        grads[name] = h.grad.double()
    scale = grads["fp64"].abs().max()
    err_fused = (grads["fused"] - grads["fp64"]).abs().max() / scale
    err_recompute = (grads["recompute"] - grads["fp64"]).abs().max() / scale
    assert err_fused < 2e-2 and err_fused <= 2 * err_recompute + 1e-3, (err_fused, err_recompute)


def test_frozen_head_cross_entropy_without_grad_and_twice_backward_fails_loudly():
    M, D, V = 9, 4, 20
    h = torch.randn(M, D, requires_grad=True)
    W = torch.randn(V, D)
    labels = torch.randint(0, V, (M,))
    with torch.no_grad():  # evaluation: no gradient computed, same values
        ce_eval, _ = chunked_cross_entropy(h, W, labels, chunk_rows=4)
    ce, _ = chunked_cross_entropy(h, W, labels, chunk_rows=4)
    torch.testing.assert_close(ce_eval, ce)
    ce.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        ce.sum().backward()  # the saved gradient was scaled in place: a second pass must not silently reuse it


@pytest.mark.parametrize("distil", [False, True])
def test_chunk_loss_kernel_traces_as_one_graph(distil):
    """What CUDA compiles (fullgraph: no graph break) equals the eager chunk function, with and without the
    target's logits (distillation)."""
    torch.manual_seed(3)
    logits, labels = torch.randn(6, 40), torch.randint(0, 40, (6,))
    target = torch.randn(6, 40) if distil else None
    compiled = torch.compile(_chunk_loss, backend="aot_eager", fullgraph=True)
    for with_grad in (True, False):
        got, want = compiled(logits, labels, target, 0.3, with_grad), _chunk_loss(logits, labels, target, 0.3, with_grad)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)


def _tiny_drafter_and_batch():
    D, V, B, MASK = 32, 80, 4, 70
    args = DrafterArgs(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B,
                       mask_token_id=MASK, target_layer_ids=[1, 2], num_target_layers=4,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    torch.manual_seed(0)
    model = DFlashDrafter(args)
    model.attach_target_head(torch.randn(V, D), torch.randn(V, D))
    S = 40
    ids = torch.randint(0, 60, (S,))
    batch = build_block_batch(ids, torch.ones(S, dtype=torch.bool), torch.tensor([0, 3, 7, 8, 15, 21, 25, 30]), B,
                              MASK, seq_lens=[25, 15], pad_to=10)
    return model, torch.randn(1, S, 2 * D), batch


@pytest.mark.slow
def test_compiled_training_forward_has_no_graph_break_and_equals_eager():
    from torch._dynamo.utils import counters

    model, feats, batch = _tiny_drafter_and_batch()

    def loss_and_grads():
        model.zero_grad()
        loss, _ = dflash_loss(model.forward_train(feats, batch, "dense"), model.lm_head_weight, batch, 4.0, 7)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    with torch.no_grad():
        eager_flex = model.forward_train(feats, batch, "flex")
    eager_loss, eager_grads = loss_and_grads()
    torch._dynamo.reset()
    counters.clear()
    model.compile_training(backend="aot_eager")
    loss, grads = loss_and_grads()
    with torch.no_grad():  # flex is traced into the layer graph (forward only on CPU)
        flex = model.forward_train(feats, batch, "flex")
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(flex, eager_flex, rtol=1e-4, atol=1e-5)


def test_compiled_training_compiles_each_piece_once_for_every_row_length():
    """Each compiled piece gets one graph, dynamic in the row lengths from its first call (`_dynamic_lengths`), and
    nothing more: over batches of four shapes with backward, each followed by a held-out forward under no_grad
    (which runs eager). Automatic dynamic shapes alone compiled a static graph, then a dynamic one at the second
    shape: a compile per piece more. The failure this also guards against: the first layer's input (the frozen
    embedding) needs no gradient and every later layer's does, so one shared layer graph recompiled on every
    alternation and, with grad_mode and shape guards, hit torch._dynamo's recompile limit (8) within minutes on the
    H200 (2026-12-02); pieces past the limit ran eager."""
    from torch._dynamo.utils import counters

    D, V, B, MASK = 32, 80, 4, 70
    args = DrafterArgs(hidden_size=D, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B,
                       mask_token_id=MASK, target_layer_ids=[1, 2], num_target_layers=4,
                       layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=5)
    torch.manual_seed(0)
    model = DFlashDrafter(args)
    model.attach_target_head(torch.randn(V, D), torch.randn(V, D))
    torch._dynamo.reset()
    counters.clear()
    model.compile_training(backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for S, pad in [(40, 10), (56, 12), (48, 10), (64, 16)]:
        ids = torch.randint(0, 60, (S,), generator=gen)
        anchors = torch.sort(torch.randperm(S - B, generator=gen)[:8]).values
        batch = build_block_batch(ids, torch.ones(S, dtype=torch.bool), anchors, B, MASK,
                                  seq_lens=[S // 2, S - S // 2], pad_to=pad)
        feats = torch.randn(1, S, 2 * D, generator=gen)
        loss, _ = dflash_loss(model.forward_train(feats, batch, "dense"), model.lm_head_weight, batch, 4.0, 7)
        loss.backward()
        with torch.no_grad():
            model.forward_train(feats, batch, "dense")
    pieces = len(model._train_fns)  # fuse, first layer, later layers, final norm
    assert counters["stats"]["unique_graphs"] == pieces, dict(counters["stats"])
