"""Decayed, chunked cross-entropy of DFlash (docs/drafter.md, "Training: labels and loss") and its accuracy statistics.

    w_k  = exp(-(k-1)/gamma) for slot k >= 1, 0 at slot 0 (the anchor token is never a target)
    loss = sum_q w_{k(q)} m_q CE(logits_q, label_q) / sum_q w_{k(q)} m_q          m = batch.label_mask

Logits are never materialised for all rows at once: `chunked_cross_entropy` computes them `chunk_rows` rows at a time
(in the matmul's dtype; logsumexp/CE in fp32, fused into one compiled kernel group on CUDA). With the frozen LM head
the same pass also computes each row's input gradient, so the head costs two matmuls per labelled row (logits,
input gradient) and nothing of [rows, V] is kept for backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipeline.config import ConfigError
from train.blocks import BlockBatch

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the DFlash paper, appendix A.1


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ConfigError(
            f"train.loss_gamma: no published default for block_size {block_size} (known: "
            f"{sorted(DEFAULT_GAMMA)}); set train.loss_gamma"
        )
    return DEFAULT_GAMMA[block_size]


def decay_weights(block_size: int, gamma: Optional[float] = None) -> Tensor:
    """Float[B]: 0 at slot 0, exp(-(k-1)/gamma) at slot k >= 1 (gamma None = 7/5/4 for B = 16/10/8)."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)


def label_weights(batch: BlockBatch, gamma: Optional[float] = None) -> Tensor:
    """Float[Q] loss weight of every block row: decay weight of its slot where the label is valid, else 0."""
    w = decay_weights(batch.block_size, gamma).to(batch.label_mask.device)
    return w[batch.slots] * batch.label_mask


def _chunk_ce(logits: Tensor, labels: Tensor, with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """One chunk: logits [c, V] (the matmul's dtype), labels Long[c] -> (ce [c], lse [c], argmax Long[c], dlogits).

    Reductions run in >= fp32; dlogits = softmax - onehot(label) [c, V] in the logits' dtype (the gradient of ce
    with respect to the logits, per unit of upstream gradient), or None. On CUDA this is one compiled kernel
    group: the logits are read twice and dlogits written once, no fp32 [c, V] copy is ever materialised."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    pred = x.argmax(dim=-1)
    if not with_grad:
        return ce, lse, pred, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    return ce, lse, pred, (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)).to(logits.dtype)


_compiled_chunk_ce = None


def _chunk_ce_fn(device: torch.device):
    """`_chunk_ce`, torch.compile'd on CUDA (automatic dynamic rows: the last, shorter chunk compiles once more);
    eager elsewhere."""
    global _compiled_chunk_ce
    if device.type != "cuda":
        return _chunk_ce
    if _compiled_chunk_ce is None:
        _compiled_chunk_ce = torch.compile(_chunk_ce)
    return _compiled_chunk_ce


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-row CE of logits = hidden @ weight.T, chunk by chunk; logits are never kept for backward.

    Frozen weight (the trainer's case): the forward also computes d ce_q / d hidden_q = (softmax - onehot) @ weight
    per row (the upstream gradient of a per-row output only scales its row), so the LM head costs two matmuls per
    chunk in all -- logits and input gradient -- and backward is one row scaling of the saved [M, D] gradient.
    Trainable weight: its gradient needs the upstream gradient inside the matmul, so backward recomputes each
    chunk's logits (three matmuls per chunk).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int, with_grad: bool):
        rows = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # CE statistics in at least fp32
        ce = torch.empty(rows, dtype=acc, device=hidden.device)
        lse = torch.empty_like(ce)
        pred = torch.empty(rows, dtype=torch.long, device=hidden.device)
        need_w = with_grad and ctx.needs_input_grad[1]
        fused = with_grad and not need_w  # input gradient computed here, in the same pass
        grad_h = torch.empty_like(hidden) if fused else None
        chunk_ce = _chunk_ce_fn(hidden.device)
        for s in range(0, rows, chunk_rows):
            e = min(s + chunk_rows, rows)
            logits = hidden[s:e] @ weight.T  # [c, V]
            ce[s:e], lse[s:e], pred[s:e], dlogits = chunk_ce(logits, labels[s:e], fused)
            del logits
            if fused:
                torch.mm(dlogits, weight, out=grad_h[s:e])  # [c, D]; logits, hidden and weight share one dtype
        ctx.mark_non_differentiable(pred)
        ctx.fused, ctx.chunk_rows = fused, chunk_rows
        if fused:
            ctx.save_for_backward(grad_h)
        elif with_grad:
            ctx.save_for_backward(hidden, weight, labels, lse)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce: Tensor, _grad_pred):
        if ctx.fused:
            (grad_h,) = ctx.saved_tensors
            # in place (a second backward through this graph fails the saved-tensor version check); the product
            # is computed in fp32 and rounded once to the hidden dtype
            return grad_h.mul_(grad_ce[:, None]), None, None, None, None
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        rows, c = hidden.shape[0], ctx.chunk_rows
        for s in range(0, rows, c):
            e = min(s + c, rows)
            logits = (hidden[s:e] @ weight.T).to(acc)
            g = torch.exp(logits - lse[s:e, None])  # softmax
            g[torch.arange(e - s, device=g.device), labels[s:e]] -= 1.0
            g *= grad_ce[s:e, None].to(acc)
            if need_h:
                grad_h[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += g.T @ hidden[s:e].to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int = 2048) -> tuple[Tensor, Tensor]:
    """(ce [M] in >= fp32, argmax Long[M]) of logits = hidden [M, D] @ weight [V, D].T; memory O(chunk_rows * V).

    With a frozen `weight` and gradients enabled the forward also produces the input gradient (two LM-head
    matmuls per row in all, see `_ChunkedLinearCrossEntropy`): O(M * D) extra memory, like saving `hidden`.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, int(chunk_rows), with_grad)


def tau_hat(correct_per_pos: Tensor, count_per_pos: Tensor) -> float:
    """Simulated acceptance 1 + sum_k prod_{i<=k} acc_i from per-position counts [B-1] (index k-1 = slot k)."""
    acc = correct_per_pos.double() / count_per_pos.double().clamp_min(1)
    return float(1.0 + torch.cumprod(acc, dim=0).sum())


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    batch: BlockBatch,
    gamma: Optional[float] = None,
    chunk_rows: int = 2048,
    normalizer: Optional[Tensor | float] = None,
) -> tuple[Tensor, dict]:
    """Weighted CE of the drafter's final-normed hidden states [Q, D] (forward_train output) -> (loss, stats).

    loss = sum(w * CE) / normalizer, normalizer = sum(w) of this batch unless given (pass the global weight sum
    over ranks x accumulation steps for a globally normalised loss; see `label_weights`).
    stats (detached, summable across micro-batches and ranks):
      weighted_ce_sum, weight_sum, ce_sum, num_labels            scalars
      correct_per_pos, count_per_pos                              [B-1] argmax hits / valid labels at slot k = index+1
      accept_len_sum, num_blocks                                  per valid block 1 + leading run of valid hits
      acc_per_pos [B-1], tau_hat (float)                          this batch only (derived, not summable)
    """
    B = batch.block_size
    weights = label_weights(batch, gamma).to(hidden.device)
    rows = torch.nonzero(batch.label_mask, as_tuple=False).flatten().to(hidden.device)
    labels = batch.labels.to(hidden.device)[rows]
    ce, pred = chunked_cross_entropy(hidden[rows], lm_head_weight, labels, chunk_rows)
    ce = ce.float()
    w = weights[rows]
    weighted_sum = (ce * w).sum()
    weight_sum = w.sum()
    denom = weight_sum if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device)
    loss = weighted_sum / denom.clamp_min(1e-12)

    with torch.no_grad():
        slot = batch.slots.to(hidden.device)[rows]
        hit = (pred == labels).float()
        correct = torch.zeros(B, device=hidden.device).index_add_(0, slot, hit)[1:]
        count = torch.zeros(B, device=hidden.device).index_add_(0, slot, torch.ones_like(hit))[1:]
        hits = torch.zeros(batch.label_mask.shape[0], dtype=torch.bool, device=hidden.device)
        hits[rows] = pred == labels
        leading = torch.cumprod(hits.view(-1, B)[:, 1:].long(), dim=1).sum(dim=1)  # [N]
        valid = batch.block_valid.to(hidden.device)
        stats = {
            "weighted_ce_sum": weighted_sum.detach(),
            "weight_sum": weight_sum.detach(),
            "ce_sum": ce.detach().sum(),
            "num_labels": torch.tensor(float(rows.numel()), device=hidden.device),
            "correct_per_pos": correct,
            "count_per_pos": count,
            "accept_len_sum": (1 + leading)[valid].sum().float(),
            "num_blocks": valid.sum().float(),
        }
        # derived for this batch only (not summable): aggregate the counts above across batches instead
        stats["acc_per_pos"] = correct / count.clamp_min(1)
        stats["tau_hat"] = tau_hat(correct, count)
    return loss, stats

