"""One optimizer step and one held-out evaluation over collated micro-batches (train/data.py::collate).

The invariant this module protects: the loss of a step is normalised GLOBALLY -- the sum over every rank and
accumulated micro-batch of w*loss divided by the sum of w over all of them -- so a micro-batch counts by its label
weight, not by its count, and accumulating k micro-batches gives the gradient of one batch holding them all.
Statistics (loss sums, per-position hits, tokens, FLOPs) are summed on the device and reduced over ranks with one
all-reduce and one host sync per step.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from train.distributed import all_reduce_sum
from train.loss import dflash_loss, label_weights, target_hidden, tau_hat
from train.metrics import train_flops

# Summable statistics of train/loss.py::dflash_loss that are reduced over micro-batches and ranks.
SCALAR_STATS = ("weighted_loss_sum", "weighted_ce_sum", "weight_sum", "ce_sum", "num_labels", "kl_sum", "kl_rows",
                "accept_len_sum", "num_blocks")


class StepStats:
    """Statistics of one optimizer step (or one evaluation), summed over micro-batches and ALL ranks.

    Held on the device as one float64 vector [SCALAR_STATS, tokens, flops, correct_per_pos [B-1], count_per_pos
    [B-1]] and copied to the host (one sync) only when first read, so a training loop that reads them every
    `log_every` steps lets the host queue the next steps meanwhile."""

    def __init__(self, vec: torch.Tensor, block_size: int):
        self.vec, self.block_size = vec, block_size
        self._host: torch.Tensor | None = None

    @classmethod
    def total(cls, parts: list["StepStats"]) -> "StepStats":
        """The sum of several steps' statistics (still on the device)."""
        return cls(torch.stack([p.vec for p in parts]).sum(0), parts[0].block_size)

    def _read(self) -> torch.Tensor:
        if self._host is None:
            self._host = self.vec.cpu()
        return self._host

    @property
    def sums(self) -> dict:
        """name -> float: SCALAR_STATS + "tokens" + "flops"."""
        vec, n = self._read(), len(SCALAR_STATS)
        return {**{k: float(vec[i]) for i, k in enumerate(SCALAR_STATS)}, "tokens": float(vec[n]),
                "flops": float(vec[n + 1])}

    @property
    def correct_per_pos(self) -> torch.Tensor:
        n = len(SCALAR_STATS) + 2
        return self._read()[n : n + self.block_size - 1]

    @property
    def count_per_pos(self) -> torch.Tensor:
        return self._read()[len(SCALAR_STATS) + 2 + self.block_size - 1 :]

    @property
    def loss(self) -> float:
        sums = self.sums
        return sums["weighted_loss_sum"] / max(sums["weight_sum"], 1e-12)

    @property
    def acc_per_pos(self) -> list[float]:
        return (self.correct_per_pos / self.count_per_pos.clamp_min(1)).tolist()

    def metrics(self) -> dict:
        """Loss (the optimised objective), mean unweighted CE (and KL when distilling), per-position accuracy,
        tau_hat (formula) and block acceptance (simulated)."""
        sums = self.sums
        out = {"loss": self.loss, "ce": sums["ce_sum"] / max(sums["num_labels"], 1.0),
               "acc": float(self.correct_per_pos.sum() / self.count_per_pos.sum().clamp_min(1)),
               "tau_hat": float(tau_hat(self.correct_per_pos, self.count_per_pos)),
               "accept_len": sums["accept_len_sum"] / max(sums["num_blocks"], 1.0),
               "labels": sums["num_labels"], "tokens": sums["tokens"]}
        if sums["kl_rows"] > 0:
            out["kl"] = sums["kl_sum"] / sums["kl_rows"]
        out.update({f"acc_{k + 1}": a for k, a in enumerate(self.acc_per_pos)})
        return out


def _reduce(per_mb: list[tuple[dict, int, float]], block_size: int, device: torch.device) -> StepStats:
    """Sum (stats, tokens, flops) of this rank's micro-batches on the device, then over ranks (one all-reduce);
    nothing waits for the device."""
    rows = []
    for stats, tokens, flops in per_mb:
        scalars = torch.stack([torch.as_tensor(stats[k], device=device).double() for k in SCALAR_STATS])
        host = torch.tensor([tokens, flops], dtype=torch.float64).to(device, non_blocking=True)
        rows.append(torch.cat([scalars, host, stats["correct_per_pos"].double().to(device),
                               stats["count_per_pos"].double().to(device)]))
    return StepStats(all_reduce_sum(torch.stack(rows).sum(0)), block_size)


def micro_batch_flops(shape, batch) -> float:
    """Useful FLOPs (train/metrics.py::train_flops) of one micro-batch's BlockBatch (pass the host copy: no sync)."""
    valid = batch.block_valid
    offsets = (batch.anchors - batch.doc_start)[valid].cpu()
    return train_flops(shape, context_rows=batch.seq_len if bool(valid.any()) else 0, anchor_offsets=offsets,
                       label_rows=int(batch.label_mask.sum()))


def _scored(engine, mb: dict, features_of: Callable, *, gamma, chunk_rows, attention, normalizer=None, kl=0.0,
            final_norm=None) -> tuple[torch.Tensor, dict]:
    """(loss, stats) of one micro-batch: its features (the drafter's taps first; with distillation the last D
    columns are the target's last hidden state, extract.layers.stored_tap_ids), the drafter's forward, the loss."""
    drafter = engine.module.drafter
    features, batch = features_of(mb)
    target = target_hidden(final_norm, features[0, :, -drafter.args.hidden_size:], mb["batch"]) if kl else None
    hidden = engine(features[..., : drafter.args.num_taps * drafter.args.hidden_size], batch, attention)
    return dflash_loss(hidden, drafter.lm_head_weight, batch, gamma, chunk_rows, normalizer, target, kl)


def train_step(engine, micro_batches: list[dict], features_of: Callable, *, gamma: float | None, chunk_rows: int,
               attention: str, world_size: int, device: torch.device, flops_shape=None, kl: float = 0.0,
               final_norm: torch.nn.Module | None = None) -> tuple[StepStats, float]:
    """One optimizer step over this rank's `grad_accum` collated micro-batches (train/data.py::collate).

    The loss is normalised GLOBALLY: sum over all ranks and micro-batches of w*row loss divided by the sum of w
    over all of them (computed before the forward from the labels), so a micro-batch counts by its label weight,
    not by its count. DeepSpeed averages gradients over ranks, hence the `* world_size`, and `scale_wrt_gas=False`
    because the normaliser already spans the accumulation steps. `kl` > 0 distils the target's distribution
    through its frozen `final_norm` (train/loss.py). Returns (stats summed over ranks, grad norm as a float or a
    0-d device tensor); with the torch engine and one rank nothing in the step waits for the device.
    """
    local_w = sum(float(label_weights(mb["batch"], gamma).sum()) for mb in micro_batches)  # host copies: no sync
    normalizer = torch.tensor([local_w], dtype=torch.float64)
    if world_size > 1:
        normalizer = all_reduce_sum(normalizer.to(device, non_blocking=True))
    normalizer = normalizer.to(device, torch.float32, non_blocking=True)[0].clamp_min(1e-12)
    per_mb = []
    grad_norm = None
    for k, mb in enumerate(micro_batches):
        loss, stats = _scored(engine, mb, features_of, gamma=gamma, chunk_rows=chunk_rows, attention=attention,
                              normalizer=normalizer, kl=kl, final_norm=final_norm)
        engine.backward(loss * world_size, scale_wrt_gas=False)
        if k == len(micro_batches) - 1 and _needs_manual_grad_norm(engine):
            grad_norm = _grad_norm(engine)
        engine.step()
        flops = micro_batch_flops(flops_shape, mb["batch"]) if flops_shape is not None else 0.0
        per_mb.append((stats, 0 if mb.get("padding") else mb["tokens"], flops))
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    if grad_norm is None:
        grad_norm = float("nan")
    return _reduce(per_mb, engine.module.drafter.args.block_size, device), grad_norm


@torch.no_grad()
def eval_step(engine, micro_batches: Iterable[dict], features_of: Callable, *, gamma: float | None, chunk_rows: int,
              attention: str, device: torch.device, kl: float = 0.0,
              final_norm: torch.nn.Module | None = None) -> StepStats:
    """Loss/accuracy statistics of held-out micro-batches (any iterable, consumed lazily; no gradient), summed
    over ranks. Every rank must pass the same number of micro-batches (train/data.py::plan_eval pads)."""
    per_mb = []
    for mb in micro_batches:
        _, stats = _scored(engine, mb, features_of, gamma=gamma, chunk_rows=chunk_rows, attention=attention, kl=kl,
                           final_norm=final_norm)
        per_mb.append((stats, 0 if mb.get("padding") else mb["tokens"], 0.0))
    return _reduce(per_mb, engine.module.drafter.args.block_size, device)


def _needs_manual_grad_norm(engine) -> bool:
    """Plain fp32 without ZeRO: DeepSpeed clips but does not record the norm."""
    return not engine.zero_optimization() and not engine.bfloat16_enabled() and not engine.fp16_enabled()


def _grad_norm(engine) -> torch.Tensor | float:
    grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return torch.stack(grads).norm() if grads else 0.0
