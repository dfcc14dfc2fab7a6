"""The drafter's decode-time forward, rebuilt for the round: a static context cache and one fixed-shape step per key
bucket, replayed as a CUDA graph on the GPU. The reference is dflash_model/model.py `DFlashDrafter.draft_logits` (growing
per-layer caches, eager); this computes the same logits (tests/eval/test_draft_forward.py).

Each round the drafter (docs/drafter.md, "KV injection") takes the target features of the rows the last round
committed, stores their K/V as context rows, and runs the block [bonus, MASK x (B-1)] at positions
start..start+B-1 against every context row and the block:

    kv          [layers, 2, KVH, capacity, hd]   row p holds position p; rows 0..length-1 are the context
    prefill(features [S, F])                     context rows 0..S-1 (eager: S varies per prompt)
    step(new_rows [R, F], bonus [1], start)      context rows length..start-1 = K/V of new_rows[:start - length]
                                                 (R >= start - length; all R rows are written, the ones at and past
                                                 `start` are scratch that the block overwrites or the mask hides),
                                                 then the block: its K/V at rows start..start+B-1, queries = the B
                                                 block rows, keys = rows [0, kv_len) under the mask
                                                   full layers:    key row k visible iff k < start + B
                                                   sliding layers: k <= query position and k > position - window
                                                 -> logits [B-1, V] of block slots 1..B-1 (slot k predicts start+k)

kv_len = start + B rounded up to DRAFT_BUCKET (<= capacity), so the step's shapes are fixed by (R, kv_len). `length`
and `start` also live on the device (0-dim int64 `past`, `start_dev`, filled by the host before each step: async
fills, no sync): the step reads them there, so one capture per (R, kv_len) serves every round. With `graphs` (CUDA)
each (R, kv_len) step is a pipeline.cuda_graphs.CudaGraphFn, checked against eager on its first replay. The logits
land in one buffer shared by every bucket's step, so the tree-build graph that reads them never copies its input.
With `compile` (what `draft_forward` sets under CUDA graphs) the step's pieces (`STEP_FNS`: context K/V, the
block's q/k/v, the layer output, the final norm) are torch.compile'd, one compiled graph for every layer, so the
norms, RoPE and residual adds between the matmuls run fused; the first compiled step is checked against the plain
one and a failure or a difference beyond rounding keeps the plain pieces.

The step's GEMMs are few and large (`fused_weights`): each layer's q|k|v and gate|up projections are one GEMM each,
and the context K/V of every layer one batched GEMM, so a 5-layer step runs 23 GEMMs instead of 47 (a draft step
is bound by kernel latency as much as by its weights, docs/benchmarks.md "round").

The decoder passes the L+1 = B path rows its walk gathered (fixed shape) as `new_rows`; the first round of a prompt
has no new rows (`start == length` after the prefill) and passes None.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.cuda_graphs import CudaGraphFn, relative_error, rounding_tolerance
from pipeline.log import get_logger
from dflash_model.blocks import SLIDING
from dflash_model.model import DecoderLayer, DFlashDrafter, apply_rope, rope_cos_sin

DRAFT_BUCKET = 128  # attended key rows are rounded up to this (one step graph per bucket)
CAPACITY_STEP = 2048  # the context buffer grows in these steps (graphs are kept while it does not grow)

log = get_logger("eval.engine.draft_forward")


# ----------------------------------------------------------------------------------------------
# The step's pieces: plain functions of a layer (dflash_model/model.py modules), so one compiled graph serves every layer
# ----------------------------------------------------------------------------------------------


def _context_kv(drafter: DFlashDrafter, kv_weight: Tensor, k_norm_weight: Tensor, features: Tensor, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor]:
    """K and V [layers, KVH, T, hd] of context rows with target features [T, F], every layer at once: H_t =
    fuse(features), ONE batched GEMM against the layers' k|v rows kv_weight [layers, 2*KVH*hd, D], each layer's
    k_norm (k_norm_weight [layers, hd]) and RoPE at cos/sin (dflash_model/model.py `Attention.key_value`, per layer)."""
    a = drafter.args
    kv = torch.matmul(drafter.fuse(features), kv_weight.transpose(1, 2))  # [layers, T, 2*KVH*hd]
    k, v = kv.view(kv.shape[0], kv.shape[1], 2, a.num_key_value_heads, a.head_dim).unbind(2)  # [layers, T, KVH, hd]
    dtype = k.dtype
    k = k.float()
    k = k_norm_weight[:, None, None, :] * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps)).to(dtype)
    return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def _block_qkv(layer: DecoderLayer, kvq_weight: Tensor, x: Tensor, cos: Tensor,
               sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries [H, B, hd] and keys/values [KVH, B, hd] of the block rows x [B, D] (dflash_model/model.py `Attention`), the
    three projections as ONE GEMM against the layer's k|v|q rows kvq_weight [(2*KVH + H)*hd, D]."""
    attn, B = layer.self_attn, x.shape[0]
    kv_cols = attn.num_kv_heads * attn.head_dim
    k, v, q = (layer.input_layernorm(x) @ kvq_weight.t()).split([kv_cols, kv_cols, attn.num_heads * attn.head_dim],
                                                                dim=-1)
    q = apply_rope(attn.q_norm(q.reshape(B, attn.num_heads, attn.head_dim)).transpose(0, 1), cos, sin)
    k = apply_rope(attn.k_norm(k.reshape(B, attn.num_kv_heads, attn.head_dim)).transpose(0, 1), cos, sin)
    return q, k, v.reshape(B, attn.num_kv_heads, attn.head_dim).transpose(0, 1)


def _block_out(layer: DecoderLayer, gate_up_weight: Tensor, x: Tensor, attended: Tensor) -> Tensor:
    """The layer's output [B, D] from its input x and the attention output [H, B, hd]: o_proj, residual, then the
    MLP with gate and up as ONE GEMM against the layer's gate|up rows gate_up_weight [2*I, D]."""
    attn, B = layer.self_attn, x.shape[0]
    x = x + attn.o_proj(attended.transpose(0, 1).reshape(B, attn.num_heads * attn.head_dim))
    gate, up = (layer.post_attention_layernorm(x) @ gate_up_weight.t()).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(F.silu(gate) * up)


def _final_norm(drafter: DFlashDrafter, x: Tensor) -> Tensor:
    """norm(x) of the block slots 1..B-1 [B-1, D], in the LM head's dtype."""
    return drafter.norm(x[1:]).to(drafter.lm_head_weight.dtype)


def fused_weights(drafter: DFlashDrafter) -> tuple[Tensor, Tensor, Tensor]:
    """The draft step's GEMM weights, copied once from the drafter's projections (the step's GEMMs are fewer and
    larger; the copies cost 2*KVH*hd + H*hd + 2*I rows of D per layer):
      kvq      [layers, (2*KVH + H)*hd, D]  each layer's k | v | q rows; kvq[:, :2*KVH*hd] (a view) is every
                                            layer's k | v, the context K/V's one batched GEMM
      gate_up  [layers, 2*I, D]             each layer's gate | up rows
      k_norm   [layers, hd]                 each layer's k_norm weight (the context K/V's batched k_norm)
    Copies taken when the DraftForward is made: a drafter whose weights change afterwards needs a new one (eval
    only decodes trained, frozen drafters)."""
    layers = drafter.layers
    kvq = torch.stack([torch.cat([l.self_attn.k_proj.weight, l.self_attn.v_proj.weight, l.self_attn.q_proj.weight])
                       for l in layers])
    gate_up = torch.stack([torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]) for l in layers])
    return kvq, gate_up, torch.stack([l.self_attn.k_norm.weight for l in layers])


STEP_FNS = {"context": _context_kv, "qkv": _block_qkv, "out": _block_out, "norm": _final_norm}


class DraftForward:
    """The decode-time forward of one `DFlashDrafter` on a static context cache (module docstring)."""

    def __init__(self, drafter: DFlashDrafter, *, graphs: bool = False, compile: str | None = None):
        if drafter.embed_weight is None:
            raise RuntimeError("call attach_target_head(embed_weight, lm_head_weight) before decoding with a drafter")
        self.drafter = drafter
        self.args = drafter.args
        self.block = drafter.args.block_size
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.graphs = graphs and self.device.type == "cuda"
        self.kv: Tensor | None = None
        self.length = 0  # context rows held (host)
        self.past = torch.zeros((), dtype=torch.long, device=self.device)  # the step's `length` (rows before it)
        self.start_dev = torch.zeros((), dtype=torch.long, device=self.device)  # the step's `start`
        self.mask_ids = torch.full((self.block - 1,), drafter.args.mask_token_id, dtype=torch.long, device=self.device)
        self.no_rows = torch.zeros(self.block, drafter.args.num_taps * drafter.args.hidden_size, dtype=self.dtype,
                                   device=self.device)  # the new rows of a prompt's first round (none are new)
        self.logits = torch.empty(self.block - 1, drafter.lm_head_weight.shape[0], dtype=drafter.lm_head_weight.dtype,
                                  device=self.device)
        self.kvq_weight, self.gate_up_weight, self.k_norm_weight = fused_weights(drafter)
        self.ctx_kv_weight = self.kvq_weight[:, : 2 * drafter.args.num_key_value_heads * drafter.args.head_dim]
        self._steps: dict[tuple[int, int], object] = {}  # (R, kv_len) -> step fn / CUDA graph
        self.fns = STEP_FNS  # the step's pieces; with `compile` (a torch.compile backend) compiled ones, checked
        self.compiled = compile is not None  # against these on the first step
        if self.compiled:
            self.fns = {name: torch.compile(fn, backend=compile) for name, fn in STEP_FNS.items()}
        self._compile_checked = False

    def describe(self) -> str:
        """How the draft step ran, for reports (like TargetCache.describe)."""
        steps = [f for f in self._steps.values() if isinstance(f, CudaGraphFn)]
        on_graphs = bool(steps) and not any(f.disabled for f in steps)
        compiled = ", compiled" if self.fns is not STEP_FNS else ""
        return "static context" + compiled + (", CUDA graphs" if on_graphs else ", eager")

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    def reset(self, capacity: int) -> None:
        """Empty context; room for `capacity` context rows plus a round's block and scratch rows. The buffer (and
        the captured steps, which hold its address) is kept unless it must grow."""
        need = capacity + 2 * self.block
        if self.capacity < need:
            a = self.args
            rows = -(-need // CAPACITY_STEP) * CAPACITY_STEP
            self.kv = None
            self._steps.clear()
            self.kv = torch.zeros(a.num_hidden_layers, 2, a.num_key_value_heads, rows, a.head_dim, dtype=self.dtype,
                                  device=self.device)
        self.length = 0

    def bucket_lengths(self, max_length: int) -> list[int]:
        """Context lengths (<= max_length), one per key bucket a step reaches: where it first needs a new step (a
        new CUDA graph under `graphs`), what a warm-up visits so that timed decoding captures nothing."""
        first, last = self.key_rows(1), self.key_rows(max_length)
        return [min(max_length, max(1, kv_len - self.block)) for kv_len in range(first, last + 1, DRAFT_BUCKET)]

    def key_rows(self, start: int) -> int:
        """Key rows the step at `start` attends to: start + B rounded up to DRAFT_BUCKET, at most the capacity."""
        return min(self.capacity, -(-(start + self.block) // DRAFT_BUCKET) * DRAFT_BUCKET)

    # -- the forward ------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, features: Tensor) -> None:
        """Context rows 0..S-1 from the prompt's target features [S, F]."""
        self.past.fill_(0)
        self._write_context(features, self.past)
        self.length = features.shape[0]

    @torch.no_grad()
    def __call__(self, new_rows: Tensor | None, bonus: Tensor, start: int) -> Tensor:
        """Logits [B-1, V] of the block at `start` after appending new_rows[:start - length] as context (module
        docstring). new_rows [R, F], or None when no row is new (a prompt's first round); bonus: int64 [1] or 0-dim
        on the device (not read on the host)."""
        new_rows = self.no_rows if new_rows is None else new_rows
        new = start - self.length
        if not 0 <= new <= new_rows.shape[0]:
            raise ValueError(f"draft step: context holds {self.length} rows, start {start} needs {new} of "
                             f"{new_rows.shape[0]} new rows")
        if start + self.block > self.capacity - new_rows.shape[0]:
            raise ValueError(f"draft step at {start}: the context buffer holds {self.capacity} rows; reset() it larger")
        self.past.fill_(self.length)
        self.start_dev.fill_(start)
        kv_len = self.key_rows(start)
        key = (new_rows.shape[0], kv_len)
        step = self._steps.get(key)
        if step is None:
            if self.compiled and not self._compile_checked:
                self._check_compiled(kv_len, new_rows, bonus.reshape(1))
            step = functools.partial(self._step, kv_len)
            if self.graphs:
                step = CudaGraphFn(step, f"draft step R={key[0]} keys={kv_len}",
                                   check=lambda g, e: relative_error(g, e) <= rounding_tolerance(self.dtype))
            self._steps[key] = step
        logits = step(new_rows, bonus.reshape(1))
        self.length = start
        return logits

    def _step(self, kv_len: int, new_rows: Tensor, bonus: Tensor) -> Tensor:
        """The fixed-shape step (no host value, nothing in place but K/V rows >= `past`, rewritten alike by a rerun):
        append the new rows at `past`, then run the block at `start_dev`."""
        self._write_context(new_rows, self.past, self.fns)
        d, fns, start = self.drafter, self.fns, self.start_dev
        x = F.embedding(torch.cat([bonus, self.mask_ids]), d.embed_weight).to(self.dtype)  # [B, D]
        rows = start + torch.arange(self.block, device=self.device)
        cos, sin = rope_cos_sin(rows, self.args.head_dim, self.args.rope_theta, self.dtype)
        masks = {t: self._block_mask(t, start, kv_len) for t in set(self.args.layer_types)}
        for i, layer in enumerate(d.layers):
            q, k, v = fns["qkv"](layer, self.kvq_weight[i], x, cos, sin)
            kv = self.kv[i]  # [2, KVH, cap, hd]: the block's K/V at `rows`, then attention over rows [0, kv_len)
            kv[0].index_copy_(1, rows, k)
            kv[1].index_copy_(1, rows, v)
            attended = F.scaled_dot_product_attention(q[None], kv[0, :, :kv_len][None], kv[1, :, :kv_len][None],
                                                      attn_mask=masks[layer.layer_type],
                                                      scale=layer.self_attn.head_dim**-0.5, enable_gqa=True)[0]
            x = fns["out"](layer, self.gate_up_weight[i], x, attended)
        return torch.mm(fns["norm"](d, x), d.lm_head_weight.t(), out=self.logits)

    def _write_context(self, features: Tensor, at: Tensor, fns: dict = STEP_FNS) -> None:
        """K/V of context rows `features` [T, F] at rows/positions at..at+T-1 of every layer (at: 0-dim device)."""
        rows = at + torch.arange(features.shape[0], device=self.device)
        cos, sin = rope_cos_sin(rows, self.args.head_dim, self.args.rope_theta, self.dtype)
        k, v = fns["context"](self.drafter, self.ctx_kv_weight, self.k_norm_weight, features, cos, sin)
        self.kv[:, 0].index_copy_(2, rows, k)  # every layer's rows at once
        self.kv[:, 1].index_copy_(2, rows, v)

    def _block_mask(self, layer_type: str, start: Tensor, kv_len: int) -> Tensor:
        """Additive mask [B, kv_len] of the block's queries over key rows 0..kv_len-1 (module docstring)."""
        keys = torch.arange(kv_len, device=self.device)[None, :]
        if layer_type == SLIDING:
            q_pos = start + torch.arange(self.block, device=self.device)[:, None]
            visible = (keys <= q_pos) & (keys > q_pos - self.args.sliding_window)
        else:
            visible = (keys < start + self.block).expand(self.block, kv_len)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)

    def _check_compiled(self, kv_len: int, new_rows: Tensor, bonus: Tensor) -> None:
        """Once: the compiled step against the plain one on the same inputs (the step is idempotent); the plain
        pieces from now on, with a warning, if compiling fails or the logits differ by more than rounding."""
        self._compile_checked = True
        compiled, self.fns = self.fns, STEP_FNS
        ref = self._step(kv_len, new_rows, bonus).clone()
        try:
            self.fns = compiled
            got = self._step(kv_len, new_rows, bonus)
        except Exception as exc:  # noqa: BLE001 - a compiler failure means the plain step, not a crash
            log.warning("compiled draft step failed (%s: %s): running the plain one", type(exc).__name__, exc)
            self.fns = STEP_FNS
            return
        err = relative_error(got, ref)
        if err > rounding_tolerance(self.dtype):
            log.warning("compiled draft step differs from the plain one (relative error %.2e): running the plain one",
                        err)
            self.fns = STEP_FNS


_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def draft_forward(drafter, *, graphs: bool = False):
    """The decode-time forward of `drafter`: one `DraftForward` per (DFlashDrafter, graphs), reused across decode
    calls (its buffers and graphs persist); with CUDA graphs its pieces are also compiled (inductor fuses the norms,
    RoPE and residual adds between the matmuls, as eval/engine/target_forward.py does for the verify). Any other drafter object is used as it is: it implements the same calls
    (`args`, `reset`, `prefill`, `__call__`, `describe`), e.g. a drafter that drafts from a known continuation."""
    if not isinstance(drafter, DFlashDrafter):
        return drafter
    per_drafter = _FORWARDS.setdefault(drafter, {})
    if graphs not in per_drafter:
        cuda = graphs and drafter.fc.weight.device.type == "cuda"
        per_drafter[graphs] = DraftForward(drafter, graphs=graphs, compile="inductor" if cuda else None)
    return per_drafter[graphs]
