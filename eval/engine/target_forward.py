"""The target's verify forward, rebuilt for speed: Llama-family attention targets on the static KV buffer.

HF's forward under a custom 4-D mask runs dozens of small kernels per decoder layer (unfused fp32 RMSNorm,
rotate-half RoPE, a GQA copy of K/V because SDPA with a mask cannot broadcast heads): most of a verify even inside
a CUDA graph is not its GEMMs (docs/benchmarks.md, "eval"). `VerifyForward` computes the same function with

  * fused projections: q/k/v and gate/up are ONE GEMM each (`fuse_projections` re-points HF's weights at
    row-views of one buffer, so the model itself is unchanged and no memory is added);
  * GQA without a K/V copy: keys/values are read straight from the cache [KVH, kv_len, hd]. The attention is
    chosen by `ATTENTIONS` — by default on CUDA SDPA with enable_gqa under the eval/engine/verify.py mask;
    also SDPA over "folded" queries (the G heads of a KV group laid out along the query axis) and a Triton
    tree-attention kernel (eval/engine/target_forward_triton.py) that reads the [N, N] ancestor matrix instead of
    a mask and splits the keys into chunks merged by log-sum-exp (`merge_splits`); docs/benchmarks.md ("eval")
    compares the three;
  * pointwise work (RMSNorm, q/k norm, RoPE, SiLU*up, residuals) in two functions per layer that
    torch.compile fuses (`compile=True`; weights are arguments, so one compiled graph serves every layer
    and every N).

Per layer: qkv GEMM, fused pre-attention kernels (which also write the layer's K and V rows into the cache),
the attention, o GEMM, fused merge/residual/norm kernels, gate/up GEMM, fused SiLU*up, down GEMM.

Only targets whose layer math is exactly that are accepted (`refusal`): model_type llama / qwen2 / qwen3,
every layer full attention (no sliding window), SiLU MLP, RMSNorm, and HF's own `rotary_emb` module (so every
RoPE scaling variant comes from HF). The cache (eval/engine/cache/kv.py) checks the first verify against HF's forward
and falls back to it on any disagreement.

Layer-id convention: features are the residual-stream outputs of layers `tap_ids` (extract/layers.py), the
same rows `TapHooks` records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eval.engine import target_forward_triton
from pipeline import triton_runtime
from eval.engine.verify import visibility_attention_mask
from extract.layers import decoder_layers, validate_layer_ids
from pipeline.target import base_model, kv_head_shape, text_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


ATTENTIONS = ("auto", "sdpa", "sdpa_gqa", "triton")
"""How VerifyForward attends: 'sdpa' = SDPA over the folded queries under the repeated mask; 'sdpa_gqa' = SDPA
with enable_gqa over [H, N, hd] queries (no mask copy, no output transpose); 'triton' = the Triton tree
attention (CUDA); 'auto' = sdpa_gqa on CUDA, sdpa elsewhere."""


def refusal(target) -> str | None:
    """Why `VerifyForward` cannot stand in for the HF forward of `target`, or None when it can."""
    cfg = text_config(target.config)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        return f"layer types {sorted(set(types))}: only full attention is rebuilt"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    base = base_model(target)
    if getattr(base, "rotary_emb", None) is None or getattr(base, "norm", None) is None:
        return f"{type(base).__name__} has no rotary_emb/norm"
    if getattr(base, "embed_tokens", None) is None or target.get_output_embeddings() is None:
        return "no input/output embeddings"
    return None


def fuse_projections(target) -> None:
    """In place: each layer's q/k/v weights (and biases) become row-views of one [q+k+v, D] buffer and gate/up of
    one [2I, D] buffer. Same values, same HF modules, no extra memory; idempotent."""
    for layer in decoder_layers(target):
        attn, mlp = layer.self_attn, layer.mlp
        _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        _fuse_linears([mlp.gate_proj, mlp.up_proj])


def _fuse_linears(linears) -> None:
    weights = [m.weight for m in linears]
    if _are_row_views(weights):
        return
    fused = torch.cat([w.data for w in weights], dim=0)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row: row + n]
        row += n
    biases = [m.bias for m in linears]
    if all(b is not None for b in biases):
        fused_b = torch.cat([b.data for b in biases])
        row = 0
        for m in linears:
            n = m.bias.shape[0]
            m.bias.data = fused_b[row: row + n]
            row += n


def _are_row_views(weights: Sequence[Tensor]) -> bool:
    """True when weights are consecutive row blocks of one contiguous buffer (what `_fuse_linears` makes)."""
    first = weights[0]
    ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for w in weights:
        if not w.is_contiguous() or w.data_ptr() != ptr or w.untyped_storage().data_ptr() != storage:
            return False
        ptr += w.numel() * w.element_size()
    return True


def _fused(linears) -> tuple[Tensor, Tensor | None]:
    """(weight [sum rows, D], bias or None) spanning `linears` (after `fuse_projections`: a view, no copy)."""
    w0 = linears[0].weight
    rows = sum(m.weight.shape[0] for m in linears)
    weight = w0.as_strided((rows, w0.shape[1]), (w0.shape[1], 1))
    bias = None
    if linears[0].bias is not None:
        b0 = linears[0].bias
        bias = b0.as_strided((rows,), (1,)) if _are_row_views([m.bias for m in linears]) else \
            torch.cat([m.bias for m in linears])
    return weight, bias


@dataclass
class LayerWeights:
    """One decoder layer's tensors (views of the HF parameters)."""

    attn_norm: Tensor  # [D]
    w_qkv: Tensor  # [(H + 2*KVH) * hd, D]
    b_qkv: Tensor | None
    q_norm: Tensor | None  # [hd] (qwen3)
    k_norm: Tensor | None
    w_o: Tensor  # [D, H*hd]
    b_o: Tensor | None
    mlp_norm: Tensor  # [D]
    w_gate_up: Tensor  # [2I, D]
    w_down: Tensor  # [D, I]
    b_gate_up: Tensor | None
    b_down: Tensor | None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale (in the input dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., N, hd] rotated (rotate-half convention); cos/sin [N, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def pre_attention(x: Tensor, w: LayerWeights, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int,
                  head_dim: int, kv_rows: Tensor, kv_slices: Tensor, write_rows: Tensor, fold: bool) -> Tensor:
    """x [N, D] -> q, and the layer's rotated K and V rows written into the cache.

    q: [N, H, hd] (token-major: SDPA reads it as the [H, N, hd] view and returns its output in the same layout, so
    post_attention's [N, H*hd] is a view, not a transpose copy), or with `fold` [KVH, G*N, hd] (the G heads of a
    KV group folded into the query axis). The write: kv_rows [layers*2*KVH, cap, hd] (the cache buffer, flat)
    gets rows `write_rows` [N] of slices `kv_slices` [2*KVH] (this layer's K heads then V heads), in place.
    """
    N = x.shape[0]
    qkv = F.linear(_rms_norm(x, w.attn_norm, eps), w.w_qkv, w.b_qkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(N, heads, head_dim)
    k = k.view(N, kv_heads, head_dim)
    if w.q_norm is not None:
        q = _rms_norm(q, w.q_norm, eps)
        k = _rms_norm(k, w.k_norm, eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, hd]: every head
    q = _rope(q, cos, sin)  # [N, H, hd]
    k = _rope(k, cos, sin)  # [N, KVH, hd]
    rows = torch.stack([k, v.view(N, kv_heads, head_dim)], dim=1).reshape(N, 2 * kv_heads, head_dim)
    kv_rows.index_put_((kv_slices[:, None], write_rows[None, :]), rows.transpose(0, 1))
    if fold:  # head h = kvh*G + g -> row g*N + i of group kvh
        return q.transpose(0, 1).reshape(kv_heads, (heads // kv_heads) * N, head_dim)
    return q


def merge_splits(out: Tensor, lse: Tensor) -> Tensor:
    """[S, KVH, M, hd] chunk outputs + [S, KVH, M] log-sum-exps -> [KVH, M, hd]: the softmax over all keys."""
    weight = torch.softmax(lse.float(), dim=0).unsqueeze(-1)
    return (out.float() * weight).sum(0).to(out.dtype)


def post_attention(x: Tensor, attn: Tensor, lse: Tensor | None, w: LayerWeights, eps: float, heads: int) -> Tensor:
    """x [N, D] residual, attn [KVH, G*N, hd] (folded; or [S, KVH, G*N, hd] chunks with their lse [S, KVH, G*N])
    -> the layer's output [N, D]."""
    N = x.shape[0]
    if lse is not None:
        attn = merge_splits(attn, lse)
    attn = attn.reshape(heads, N, -1).transpose(0, 1).reshape(N, -1)  # back to [N, H*hd], head-major
    x = x + F.linear(attn, w.w_o, w.b_o)
    gate, up = F.linear(_rms_norm(x, w.mlp_norm, eps), w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.w_down, w.b_down)


class VerifyForward:
    """`forward(ids [N], positions [1, N], mask [1, 1, N, kv_len] additive, write_rows [N], kv [layers, 2, 1, KVH,
    cap, hd], kv_len)` -> (logits [N, V], features [N, n_taps*D] or None); writes K/V rows `write_rows` of every
    layer and attends to rows [0, kv_len) under `mask` (eval/engine/verify.py layout)."""

    def __init__(self, target, tap_ids: Sequence[int], *, compile: bool = False, attention: str = "auto",
                 splits: int | None = None):
        reason = refusal(target)
        if reason:
            raise ValueError(f"VerifyForward: {reason}")
        cfg = text_config(target.config)
        fuse_projections(target)
        self.target = target
        self.base = base_model(target)
        layers = decoder_layers(target)
        self.tap_ids = validate_layer_ids(tap_ids, len(layers)) if tap_ids else []
        self.heads = cfg.num_attention_heads
        self.kv_heads, self.head_dim = kv_head_shape(cfg)
        self.eps = cfg.rms_norm_eps
        self.scale = layers[0].self_attn.scaling
        self.layers = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            w_qkv, b_qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
            w_gu, b_gu = _fused([mlp.gate_proj, mlp.up_proj])
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(LayerWeights(
                layer.input_layernorm.weight, w_qkv, b_qkv,
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                w_gu, mlp.down_proj.weight, b_gu, mlp.down_proj.bias))
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.attention = attention
        self.attention_config = None  # (BLOCK_M, BLOCK_N, warps, stages); None = target_forward_triton.ATTENTION_CONFIG
        self.splits = splits  # key chunks of the Triton attention; None = `attention_splits`
        self.compiled = compile
        self.pre, self.post = pre_attention, post_attention
        if compile:  # sizes: N (marked dynamic at each call) varies, the weights' shapes are constants
            self.pre = torch.compile(pre_attention, dynamic=None)
            self.post = torch.compile(post_attention, dynamic=None)
        self._kv_slices: dict = {}  # device -> per layer the [2*KVH] row blocks of its K and V heads
        self._out_buffers: dict = {}  # (N, device) -> (logits, features) every verify of N rows writes

    def attention_mode(self, device) -> str:
        """The attention that runs on `device`: `self.attention`, with 'auto' = sdpa_gqa on CUDA, else sdpa, and
        'triton' = sdpa where the kernels are not available."""
        mode = self.attention
        if mode == "auto":
            mode = "sdpa_gqa" if torch.device(device).type == "cuda" else "sdpa"
        if mode == "triton" and not triton_runtime.available(device):
            mode = "sdpa"
        return mode

    def attention_splits(self, queries: int, kv_len: int) -> int:
        """Key chunks for `queries` folded query rows over kv_len keys: `self.splits`, else the S in 1, 2, 4, 8 that
        minimises the attention's waves per unit of work, ceil(tiles * S / SMs) / S with tiles = KVH * ceil(M / 64)
        (smallest S on ties; chunks stay multiples of 64 keys)."""
        if self.splits is not None:
            return self.splits
        sms = torch.cuda.get_device_properties(self.base.embed_tokens.weight.device).multi_processor_count
        tiles = self.kv_heads * -(-queries // 64)
        block_n = (self.attention_config or target_forward_triton.ATTENTION_CONFIG)[1]
        options = [s for s in (1, 2, 4, 8) if kv_len % (block_n * s) == 0]
        return min(options, key=lambda s: (-(-tiles * s // sms) / s, s))

    def kv_slices(self, device) -> list[Tensor]:
        """Per layer l: int64 [2*KVH] indices of its K heads then V heads in the flat cache [layers*2*KVH, ...]."""
        key = str(device)
        if key not in self._kv_slices:
            width = 2 * self.kv_heads
            self._kv_slices[key] = [torch.arange(l * width, (l + 1) * width, device=device)
                                    for l in range(len(self.layers))]
        return self._kv_slices[key]

    @torch.no_grad()
    def __call__(self, ids: Tensor, positions: Tensor, visibility: Tensor, past: Tensor, write_rows: Tensor,
                 kv: Tensor, kv_len: int) -> tuple[Tensor, Tensor | None]:
        """visibility: bool [N, N] ancestor matrix; past: 0-dim device int (committed rows); kv contiguous."""
        N = ids.shape[0]
        x = self.base.embed_tokens(ids)  # [N, D]
        cos, sin = self.base.rotary_emb(x.unsqueeze(0), positions)
        cos, sin = cos[0], sin[0]  # [N, hd]
        if self.compiled:  # one compiled graph for every N (a tensor's N-sized dims)
            for t in (cos, sin, write_rows):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        mode = self.attention_mode(ids.device)
        if mode == "triton":
            splits = self.attention_splits((self.heads // self.kv_heads) * N, kv_len)
        else:  # SDPA under the additive mask (repeated for the folded queries unless SDPA broadcasts the heads)
            mask = visibility_attention_mask(visibility, positions, past, kv_len, x.dtype)
            if mode == "sdpa":
                G = self.heads // self.kv_heads
                mask = mask.reshape(1, N, kv_len).expand(G, N, kv_len).reshape(1, 1, G * N, kv_len)
        kv_rows = kv.view(-1, kv.shape[-2], kv.shape[-1])  # [layers*2*KVH, cap, hd]
        slices = self.kv_slices(ids.device)
        taps = []
        for l, w in enumerate(self.layers):
            if self.compiled:
                torch._dynamo.maybe_mark_dynamic(x, 0)
            q = self.pre(x, w, cos, sin, self.eps, self.heads, self.kv_heads, self.head_dim, kv_rows, slices[l],
                         write_rows, mode != "sdpa_gqa")
            keys, values = kv[l, 0, 0].narrow(1, 0, kv_len), kv[l, 1, 0].narrow(1, 0, kv_len)  # [KVH, kv_len, hd]
            lse = None
            if mode == "triton":
                attn, lse = target_forward_triton.tree_attention(q, keys, values, visibility, past, self.scale, splits,
                                                          self.attention_config)
                attn, lse = (attn[0], None) if splits == 1 else (attn, lse)  # a failure: cache falls back to HF
            elif mode == "sdpa_gqa":  # q [N, H, hd] read as [1, H, N, hd]; the output keeps q's layout
                attn = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                                      values.unsqueeze(0), attn_mask=mask, scale=self.scale,
                                                      enable_gqa=True)[0]
            else:
                attn = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                      attn_mask=mask, scale=self.scale)[0]
            if self.compiled:
                torch._dynamo.maybe_mark_dynamic(attn, attn.dim() - 2)  # the (folded) query axis
                if lse is not None:
                    torch._dynamo.maybe_mark_dynamic(lse, lse.dim() - 1)
            x = self.post(x, attn, lse, w, self.eps, self.heads)
            if l in self.tap_ids:
                taps.append(x)
        return self._outputs(self.base.norm(x), taps)

    def _outputs(self, h: Tensor, taps: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """(logits [N, V], features [N, n_taps*D] or None) written into buffers kept per N: every verify graph of
        one tree size returns the SAME tensors, so the walk graph that reads them never copies its inputs when a
        new key bucket brings a new verify graph. Overwritten by the next verify of that size."""
        head = self.target.get_output_embeddings()
        if head.bias is not None:
            return head(h), (torch.cat(taps, dim=-1) if taps else None)
        N, key = h.shape[0], (h.shape[0], str(h.device))
        if key not in self._out_buffers:
            feats = torch.empty(N, len(taps) * h.shape[1], dtype=h.dtype, device=h.device) if taps else None
            self._out_buffers[key] = (torch.empty(N, head.weight.shape[0], dtype=h.dtype, device=h.device), feats)
        logits, feats = self._out_buffers[key]
        torch.mm(h, head.weight.t(), out=logits)
        if taps:
            torch.cat(taps, dim=-1, out=feats)
        return logits, feats
