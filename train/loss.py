"""The DFlash training loss (docs/drafter.md, "Training: labels and loss"): decayed, chunked cross-entropy to the
target's tokens, optionally mixed with forward KL to the target's next-token distribution (logit distillation),
and its accuracy statistics.

    w_k   = exp(-(k-1)/gamma) for slot k >= 1, 0 at slot 0 (the anchor token is never a target)
    row   = (1 - a) CE(logits_q, label_q) + a KL(p_q || softmax(logits_q))      a = kl share: 0 (ce), 1 (kl), kl_weight
    loss  = sum_q w_{k(q)} m_q row_q / sum_q w_{k(q)} m_q                          m = batch.label_mask
    p_q   = softmax(lm_head(final_norm(h_{t(q)})))      the target's distribution for the label of row q: its last
                                                        hidden state h at row t(q) = a_n + j - 1 (BlockBatch.target_rows)

Logits are never materialised for all rows at once: `chunked_head_loss` computes them (and the target's) `chunk_rows`
rows at a time (in the matmul's dtype; logsumexp/CE/KL in fp32, fused into one compiled kernel group on CUDA). With
the frozen LM head the same pass also computes each row's input gradient (softmax - (1 - a) onehot - a p) @ W, so
the head costs two matmuls per labelled row (three with distillation: the target's logits too) and nothing of
[rows, V] is kept for backward. The target's logits are a function of the packed position t(q), which the blocks
of a dense anchor draw share (256 anchors over a ~300-token sample: each position is the target row of ~13 block
rows): given as one row per position (`DistillTarget`), each chunk multiplies only the positions its rows span and
gathers, where that span is shorter than the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from pipeline.config import ConfigError
from dflash_model.blocks import BlockBatch

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
    w = decay_weights(batch.block_size, gamma).to(batch.label_mask.device, non_blocking=True)
    return w[batch.slots] * batch.label_mask


def kl_share(loss: str, kl_weight: float) -> float:
    """a of the row loss (1 - a) CE + a KL for `train.loss` ('ce' -> 0, 'kl' -> 1, 'ce+kl' -> train.kl_weight)."""
    if loss not in ("ce", "kl", "ce+kl"):
        raise ConfigError(f"train.loss: {loss!r} is not 'ce', 'kl' or 'ce+kl'")
    return {"ce": 0.0, "kl": 1.0}.get(loss, float(kl_weight))


def _chunk_loss(logits: Tensor, labels: Tensor, target_logits: Optional[Tensor], kl: float, with_grad: bool):
    """One chunk: logits [c, V] (the matmul's dtype), labels Long[c], the target's logits [c, V] or None, the KL
    share `kl` -> (ce [c], kl [c] or None, lse [c], argmax Long[c], dlogits).

    ce = lse - logit[label]; kl = KL(p || q) = sum_v p_v (t_v - x_v) - lse(t) + lse(x) with p = softmax(t),
    q = softmax(x). Reductions run in >= fp32; dlogits = softmax(x) - ((1 - kl) onehot(label) + kl p) [c, V] in
    the logits' dtype (the gradient of (1 - kl) ce + kl KL with respect to the logits, per unit of upstream
    gradient), or None. On CUDA this is one compiled kernel group: no fp32 [c, V] copy is ever materialised."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    pred = x.argmax(dim=-1)
    div, p = None, None
    if target_logits is not None:
        t = target_logits.to(acc)
        t_lse = torch.logsumexp(t, dim=-1)
        p = torch.exp(t - t_lse[:, None])
        div = (p * (t - x)).sum(dim=-1) - t_lse + lse
    if not with_grad:
        return ce, div, lse, pred, None
    onehot = (torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]).to(acc)
    target = onehot if p is None else (1.0 - kl) * onehot + kl * p
    return ce, div, lse, pred, (torch.exp(x - lse[:, None]) - target).to(logits.dtype)


_compiled_chunk_loss = None


def _chunk_loss_fn(device: torch.device):
    """`_chunk_loss`, torch.compile'd on CUDA (automatic dynamic rows: the last, shorter chunk compiles once more);
    eager elsewhere."""
    global _compiled_chunk_loss
    if device.type != "cuda":
        return _chunk_loss
    if _compiled_chunk_loss is None:
        _compiled_chunk_loss = torch.compile(_chunk_loss)
    return _compiled_chunk_loss


def _row_loss(ce: Tensor, div: Tensor, kl: float) -> Tensor:
    return (1.0 - kl) * ce + kl * div


class _ChunkedHeadLoss(torch.autograd.Function):
    """Per-row loss (1 - a) CE + a KL of logits = hidden @ weight.T (target logits = target_hidden @ weight.T),
    chunk by chunk; logits are never kept for backward.

    Frozen weight (the trainer's case): the forward also computes d row_q / d hidden_q = dlogits_q @ weight per
    row (the upstream gradient of a per-row output only scales its row), so the LM head costs two matmuls per
    chunk -- logits and input gradient -- plus the target's logits with distillation, and backward is one row
    scaling of the saved [M, D] gradient. Trainable weight: its gradient needs the upstream gradient inside the
    matmul, so backward recomputes each chunk's logits.
    Outputs: row loss [M] (differentiable), ce [M] and kl [M] (both empty without a target: the row loss is the
    CE), argmax Long[M].
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, target_hidden: Optional[Tensor], kl: float,
                chunk_rows: int, with_grad: bool, target_rows: Optional[Tensor] = None):
        rows = hidden.shape[0]
        spans = position_spans(target_rows, chunk_rows) if target_rows is not None else None
        if target_rows is not None:  # page-locked first: a copy from pageable memory would wait for the device
            staged = target_rows.pin_memory() if target_hidden.is_cuda else target_rows
            target_index = staged.to(target_hidden.device, non_blocking=True)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # statistics in at least fp32
        ce = torch.empty(rows, dtype=acc, device=hidden.device)
        lse = torch.empty_like(ce)
        div = torch.empty_like(ce) if target_hidden is not None else ce.new_empty(0)
        pred = torch.empty(rows, dtype=torch.long, device=hidden.device)
        need_w = with_grad and ctx.needs_input_grad[1]
        fused = with_grad and not need_w  # input gradient computed here, in the same pass
        grad_h = torch.empty_like(hidden) if fused else None
        chunk_loss = _chunk_loss_fn(hidden.device)
        for s in range(0, rows, chunk_rows):
            e = min(s + chunk_rows, rows)
            logits = hidden[s:e] @ weight.T  # [c, V]
            if target_hidden is None:
                target = None
            elif spans is None:
                target = target_hidden[s:e] @ weight.T
            elif spans[s // chunk_rows] is not None:  # the positions lo..hi these rows name, then a gather
                lo, hi = spans[s // chunk_rows]
                target = (target_hidden[lo: hi + 1] @ weight.T).index_select(0, target_index[s:e] - lo)
            else:
                target = target_hidden.index_select(0, target_index[s:e]) @ weight.T
            ce[s:e], d, lse[s:e], pred[s:e], dlogits = chunk_loss(logits, labels[s:e], target, kl, fused)
            if d is not None:
                div[s:e] = d
            del logits, target
            if fused:
                torch.mm(dlogits, weight, out=grad_h[s:e])  # [c, D]; logits, hidden and weight share one dtype
        ctx.fused, ctx.chunk_rows, ctx.kl = fused, chunk_rows, kl
        if fused:
            ctx.save_for_backward(grad_h)
        elif with_grad:
            if target_rows is not None:  # backward recomputes per row
                target_hidden = target_hidden.index_select(0, target_index)
            ctx.save_for_backward(hidden, weight, labels, lse, target_hidden)
        if target_hidden is None:  # the row loss is the CE itself
            ce_out, div = ce.new_empty(0), ce.new_empty(0)
            ctx.mark_non_differentiable(ce_out, div, pred)
            return ce, ce_out, div, pred
        ctx.mark_non_differentiable(ce, div, pred)
        return _row_loss(ce, div, kl), ce, div, pred

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_kl, _grad_pred):
        if ctx.fused:
            (grad_h,) = ctx.saved_tensors
            # in place (a second backward through this graph fails the saved-tensor version check); the product
            # is computed in fp32 and rounded once to the hidden dtype
            return grad_h.mul_(grad_loss[:, None]), None, None, None, None, None, None, None
        hidden, weight, labels, lse, target_hidden = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        rows, c = hidden.shape[0], ctx.chunk_rows
        for s in range(0, rows, c):
            e = min(s + c, rows)
            logits = (hidden[s:e] @ weight.T).to(acc)
            g = torch.exp(logits - lse[s:e, None])  # softmax
            if target_hidden is None:
                g[torch.arange(e - s, device=g.device), labels[s:e]] -= 1.0
            else:
                t = (target_hidden[s:e] @ weight.T).to(acc)
                g -= ctx.kl * torch.softmax(t, dim=-1)
                g[torch.arange(e - s, device=g.device), labels[s:e]] -= 1.0 - ctx.kl
            g *= grad_loss[s:e, None].to(acc)
            if need_h:
                grad_h[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += g.T @ hidden[s:e].to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


def position_spans(target_rows: Tensor, chunk_rows: int) -> list[tuple[int, int] | None]:
    """Per chunk of `chunk_rows` labelled rows: (lo, hi), the least and greatest target position its rows name,
    where hi - lo + 1 (the rows a matmul over the span costs) is fewer than the chunk's rows; else None (a matmul
    per row is cheaper: sparse anchors, or a chunk across sequences). target_rows: a host Long[M] (no device
    read)."""
    m = target_rows.shape[0]
    if m == 0:
        return []
    pad = -m % chunk_rows
    t = torch.cat([target_rows, target_rows[-1:].expand(pad)]).view(-1, chunk_rows)
    lo, hi = t.min(dim=1).values.tolist(), t.max(dim=1).values.tolist()
    sizes = [min(chunk_rows, m - k * chunk_rows) for k in range(len(lo))]
    return [(a, b) if b - a + 1 < n else None for a, b, n in zip(lo, hi, sizes)]


def chunked_head_loss(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int = 2048,
                      target_hidden: Optional[Tensor] = None, kl: float = 0.0, target_rows: Optional[Tensor] = None):
    """Per-row (loss, ce, kl, argmax) of logits = hidden [M, D] @ weight [V, D].T; memory O(chunk_rows * V).

    loss = (1 - kl) ce + kl KL(softmax(target_hidden @ weight.T) || softmax(logits)) per row (differentiable;
    `kl` the share a); ce [M] and KL [M] (None without `target_hidden`, which gets no gradient) are detached
    statistics in >= fp32. target_hidden: [M, D], one row per labelled row; or with `target_rows` (a host Long[M])
    one row per position [S, D], row q's being target_hidden[target_rows[q]]: each chunk then multiplies the span
    of positions it names once (`position_spans`) instead of a row per labelled row. With a frozen `weight` and
    gradients enabled the forward also produces the input gradient (see `_ChunkedHeadLoss`): O(M * D) extra
    memory, like saving `hidden`.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if target_hidden is not None:
        target_hidden = target_hidden.detach().to(hidden.dtype)
    elif kl:
        raise ValueError(f"a KL share of {kl} needs the target's hidden states")
    if target_rows is not None and (target_hidden is None or target_rows.device.type != "cpu"):
        raise ValueError("target_rows (a host tensor) index the rows of target_hidden: give both")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, ce, div, pred = _ChunkedHeadLoss.apply(hidden, weight, labels, target_hidden, float(kl), int(chunk_rows),
                                                 with_grad, target_rows)
    if target_hidden is None:
        return loss, loss.detach(), None, pred
    return loss, ce, div, pred


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int = 2048) -> tuple[Tensor, Tensor]:
    """(ce [M] in >= fp32, differentiable; argmax Long[M]) of logits = hidden [M, D] @ weight [V, D].T: the
    cross-entropy case of `chunked_head_loss`."""
    loss, _, _, pred = chunked_head_loss(hidden, weight, labels, chunk_rows)
    return loss, pred


def tau_hat(correct_per_pos: Tensor, count_per_pos: Tensor) -> Tensor:
    """Simulated acceptance 1 + sum_k prod_{i<=k} acc_i from per-position counts [B-1] (index k-1 = slot k): a
    0-d float64 tensor on their device (no host sync; `float()` it to read it)."""
    acc = correct_per_pos.double() / count_per_pos.double().clamp_min(1)
    return 1.0 + torch.cumprod(acc, dim=0).sum()


@dataclass
class DistillTarget:
    """The target's side of distillation for one micro-batch: `hidden` [S, D] = final_norm(h) of every packed
    position (h = its last hidden state, the pre-norm output of the last layer; through the LM head, the target's
    next-token distribution after that position) and `rows` (host Long[R]): the position t(q) of each labelled row
    q, in `BlockBatch.label_rows` order."""

    hidden: Tensor
    rows: Tensor


@torch.no_grad()
def target_hidden(final_norm: torch.nn.Module, last_hidden: Tensor, batch: BlockBatch) -> DistillTarget:
    """The `DistillTarget` of `batch` (give its host copy: the rows are read on the host) from the target's last
    hidden state [S, D] of the packed row: each position normed once, not once per block row that names it."""
    return DistillTarget(final_norm(last_hidden), batch.target_rows[batch.label_rows].cpu())


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    batch: BlockBatch,
    gamma: Optional[float] = None,
    chunk_rows: int = 2048,
    normalizer: Optional[Tensor | float] = None,
    target: Optional[DistillTarget] = None,
    kl: float = 0.0,
) -> tuple[Tensor, dict]:
    """Weighted loss of the drafter's final-normed hidden states [Q, D] (forward_train output) -> (loss, stats).

    loss = sum(w * row) / normalizer with row = (1 - kl) CE + kl KL (module docstring), normalizer = sum(w) of
    this batch unless given (pass the global weight sum over ranks x accumulation steps for a globally normalised
    loss; see `label_weights`). target: the batch's `target_hidden` (needed when kl > 0).
    stats (detached, summable across micro-batches and ranks):
      weighted_loss_sum, weighted_ce_sum, weight_sum, ce_sum, num_labels    scalars
      kl_sum, kl_rows                                                       KL summed over the kl_rows labelled
                                                                            rows that have a target (0 without)
      correct_per_pos, count_per_pos                              [B-1] argmax hits / valid labels at slot k = index+1
      accept_len_sum, num_blocks                                  per valid block 1 + leading run of valid hits
      acc_per_pos [B-1], tau_hat (0-d)                            this batch only (derived, not summable)
    Nothing here waits for the device: the labelled rows come from the host (`BlockBatch.label_rows`).
    """
    B = batch.block_size
    weights = label_weights(batch, gamma).to(hidden.device)
    rows = batch.label_rows.to(hidden.device)  # made on the host: no device -> host sync here
    labels = batch.labels.to(hidden.device)[rows]
    row_loss, ce, div, pred = chunked_head_loss(hidden[rows], lm_head_weight, labels, chunk_rows,
                                                target.hidden if target is not None else None, kl,
                                                target.rows if target is not None else None)
    w = weights[rows]
    weighted_sum = (row_loss.float() * w).sum()
    weight_sum = w.sum()
    denom = weight_sum if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device)
    loss = weighted_sum / denom.clamp_min(1e-12)

    with torch.no_grad():
        ce = ce.float()
        slot = batch.slots.to(hidden.device)[rows]
        hit = (pred == labels).float()
        correct = torch.zeros(B, device=hidden.device).index_add_(0, slot, hit)[1:]
        count = torch.zeros(B, device=hidden.device).index_add_(0, slot, torch.ones_like(hit))[1:]
        hits = torch.zeros(batch.label_mask.shape[0], dtype=torch.bool, device=hidden.device)
        hits[rows] = pred == labels
        leading = torch.cumprod(hits.view(-1, B)[:, 1:].long(), dim=1).sum(dim=1)  # [N]
        valid = batch.block_valid.to(hidden.device)
        num_labels = torch.full((), float(rows.numel()), device=hidden.device)
        stats = {
            "weighted_loss_sum": weighted_sum.detach(),
            "weighted_ce_sum": (ce * w).sum(),
            "weight_sum": weight_sum.detach(),
            "ce_sum": ce.sum(),
            "num_labels": num_labels,
            "kl_sum": div.float().sum() if div is not None else torch.zeros((), device=hidden.device),
            "kl_rows": num_labels if div is not None else torch.zeros((), device=hidden.device),
            "correct_per_pos": correct,
            "count_per_pos": count,
            "accept_len_sum": ((1 + leading) * valid).sum().float(),
            "num_blocks": valid.sum().float(),
        }
        # derived for this batch only (not summable; device tensors): aggregate the counts above across batches
        stats["acc_per_pos"] = correct / count.clamp_min(1)
        stats["tau_hat"] = tau_hat(correct, count)
    return loss, stats
