"""Training metrics: the JSONL log (every metric, every logged step), W&B (offline by default), and the
useful-FLOPs model behind MFU (also used by benchmarks/bench_train.py). Loss/accuracy/tau_hat statistics come
from train/loss.py (`dflash_loss` stats, `tau_hat`) and are reduced in train/step.py.

Only rank 0 constructs a `MetricsLogger`; other ranks pass `None` around.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import RunConfig, to_dict
from pipeline.files import atomic_write_text


# ----------------------------------------------------------------------------------------------
# Useful FLOPs (the MFU numerator)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterShape:
    """What the FLOPs model needs to know about the drafter (D = target hidden size)."""

    hidden: int
    num_taps: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    block_size: int
    layer_windows: tuple = ()  # per layer: None (full attention) or the sliding window; () = all full

    @classmethod
    def from_args(cls, args) -> "DrafterShape":
        """From dflash_model.model.DrafterArgs."""
        windows = tuple(args.sliding_window if t == "sliding_attention" else None for t in args.layer_types)
        return cls(hidden=args.hidden_size, num_taps=args.num_taps, num_layers=args.num_hidden_layers,
                   num_heads=args.num_attention_heads, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                   intermediate=args.intermediate_size, vocab=args.vocab_size, block_size=args.block_size,
                   layer_windows=windows)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def trainable_params(self) -> int:
        d = self.hidden
        per_layer = 2 * d * self.q_dim + 2 * d * self.kv_dim + 3 * d * self.intermediate
        return self.num_taps * d * d + self.num_layers * per_layer


def visible_keys(anchor_offsets: torch.Tensor, block_size: int, window: int | None = None) -> int:
    """Sum over all query rows of the keys each may see (the attention work that is not masked out).

    `anchor_offsets` [N]: anchor position minus its sequence start (= context rows before the anchor).
    Full attention: query (n, j) sees the a_n context rows before the anchor and all B block rows.
    Sliding window W: it sees context t with a_n + j - (W-1) <= t < a_n and block rows j' <= j.
    """
    a = anchor_offsets.to(torch.int64)
    B = block_size
    if window is None:
        return int(B * (a.sum() + a.numel() * B))
    j = torch.arange(B, dtype=torch.int64)
    ctx = torch.minimum(a[:, None], (window - 1 - j).clamp(min=0)[None, :])  # [N, B]
    return int(ctx.sum() + a.numel() * (B * (B + 1) // 2))


def train_flops(shape: DrafterShape, *, context_rows: int, anchor_offsets: torch.Tensor, label_rows: int) -> float:
    """Useful FLOPs of one training micro-batch, forward + backward (a multiply-add = 2 FLOPs):

      fc         2*S*(n*D)*D forward + the same for its weight gradient (features need no gradient)   -> x2
      per layer  q/o projections and the MLP on the Q = N*B query rows, k/v projections on the S context
                 rows and the Q block rows; forward + input gradient + weight gradient                  -> x3
      attention  4*q_dim*(visible keys summed over queries) (QK^T and PV, masked keys not counted)       -> x3
      LM head    2*R*D*V over the R rows with a label; forward + input gradient (frozen, no weight grad) -> x2
    Norms, RoPE, activations, softmax and the CE itself are not counted.
    """
    D, S, R = shape.hidden, context_rows, label_rows
    Q = int(anchor_offsets.numel()) * shape.block_size
    fc = 2 * S * shape.num_taps * D * D
    per_layer = 2 * Q * D * shape.q_dim * 2 + 2 * (Q + S) * D * shape.kv_dim * 2 + 2 * Q * 3 * D * shape.intermediate
    windows = shape.layer_windows or (None,) * shape.num_layers
    attn = sum(4 * shape.q_dim * visible_keys(anchor_offsets, shape.block_size, w) for w in windows)
    lm_head = 2 * R * D * shape.vocab
    return 2.0 * fc + 3.0 * shape.num_layers * per_layer + 3.0 * attn + 2.0 * lm_head


# Dense peak FLOP/s per device, by (name substring, dtype); None = unknown (MFU not reported).
_PEAKS = {("H200", "bf16"): 989e12, ("H100", "bf16"): 989e12, ("A100", "bf16"): 312e12, ("B200", "bf16"): 2250e12,
          ("H200", "fp32"): 494e12, ("H100", "fp32"): 494e12, ("A100", "fp32"): 156e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak dense FLOP/s of `device` at `precision` ('bf16' | 'fp32' as TF32), or None when unknown (CPU)."""
    override = os.environ.get("DRAFTER_PEAK_FLOPS")
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for (key, prec), value in _PEAKS.items():
        if key in name and prec == precision:
            return value
    return None


# ----------------------------------------------------------------------------------------------
# Sinks: JSONL + W&B
# ----------------------------------------------------------------------------------------------


class JsonlLog:
    """Append-only JSON-lines metrics file; one row per logged step (`{"step": ..., "kind": ..., ...}`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by kill -9
                continue
        return out

    def truncate_after(self, step: int) -> int:
        """Drop rows logged after optimizer step `step` (work a resumed run will redo). Returns rows kept."""
        keep = [r for r in self.rows() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
        return len(keep)

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


class MetricsLogger:
    """Rank 0's logger: every row goes to the JSONL file and to W&B (offline unless train.wandb.mode says so)."""

    def __init__(self, cfg: RunConfig, train_dir: Path, *, resume_step: int | None):
        self.jsonl = JsonlLog(Path(train_dir) / "metrics.jsonl")
        if resume_step is None:
            self.jsonl.path.unlink(missing_ok=True)
        else:
            self.jsonl.truncate_after(resume_step)
        self.run = _wandb_init(cfg, Path(train_dir))
        self.cfg = cfg
        self.tokens_seen = 0
        self.t0 = time.time()

    def log(self, step: int, kind: str, metrics: dict) -> None:
        row = {"step": int(step), "kind": kind, "time": round(time.time() - self.t0, 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self.jsonl.write(row)
        if self.run is not None:
            self.tokens_seen = row.get("tokens_seen", self.tokens_seen)
            self.run.log(wandb_row(row, self.tokens_seen), step=int(step))

    def log_export(self, export_dir: Path, info: dict) -> None:
        """The z-lab export as the W&B model artifact `<run>-drafter` (`pipeline.wandb_run.drafter_artifact`: config
        and weights; `info` as metadata), the artifact `drafter eval` uses."""
        if self.run is None:
            return
        from pipeline.wandb_run import drafter_artifact

        self.run.log_artifact(drafter_artifact(self.cfg, Path(export_dir), metadata=info))

    def finish(self, exit_code: int = 0) -> None:
        """End the W&B run (marked failed with a non-zero `exit_code`); the JSONL file needs no closing."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


# The x-axes of the train run's charts: every `train/*` and `eval/*` metric against the optimizer step, and the losses
# and acceptance again under `tokens/*` against the training tokens seen (`define_axes`).
STEP_AXIS, TOKENS_AXIS = "optimizer_step", "tokens_seen"
TOKENS_METRICS = ("loss", "ce", "tau_hat", "accept_len")


def wandb_row(row: dict, tokens_seen: float) -> dict:
    """One JSONL row as W&B metrics: `<kind>/<metric>`, both axes, and `tokens/<kind>_<metric>` for TOKENS_METRICS."""
    kind = row["kind"]
    out = {f"{kind}/{k}": v for k, v in row.items() if k not in ("step", "kind")}
    out[STEP_AXIS], out[TOKENS_AXIS] = row["step"], tokens_seen
    out.update({f"tokens/{kind}_{k}": row[k] for k in TOKENS_METRICS if k in row})
    return out


def define_axes(run) -> None:
    run.define_metric(STEP_AXIS)
    run.define_metric(TOKENS_AXIS)
    for prefix in ("train/*", "eval/*"):
        run.define_metric(prefix, step_metric=STEP_AXIS)
    run.define_metric("tokens/*", step_metric=TOKENS_AXIS)


def _wandb_init(cfg: RunConfig, train_dir: Path):
    """The train W&B run (`pipeline.wandb_run.open_run`) under `<train_dir>/wandb/`; its id is kept in `wandb_id.txt`
    so a resumed run continues it. Named the run (or train.wandb.run_name), in the run's group, console captured."""
    from pipeline.wandb_run import open_run

    w = cfg.train.wandb
    if w.mode == "disabled":
        return None
    id_file = train_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    atomic_write_text(id_file, run_id + "\n")
    run = open_run(cfg, "train", train_dir, config=to_dict(cfg), run_id=run_id,
                   name=w.run_name or cfg.name)
    define_axes(run)
    return run
