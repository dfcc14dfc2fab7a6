"""The DFlash drafter (docs/drafter.md): fused target features injected as K/V into a small Qwen3-style decoder.

    features [T, n_taps*D] --fc--> hidden_norm --> H_t [T, D]             once per context token, shared by all layers
    block    [x_bonus, MASK x (B-1)] --frozen target embedding--> x [B, D]
    layer i:  h = input_layernorm(x)
              Q = q_norm(q_proj h)              K = k_norm(k_proj [H_t ; h])      V = v_proj [H_t ; h]
              RoPE on Q and on every K row at its absolute position (context 0..T-1, block anchor+j)
              x = x + o_proj(attention(Q, K, V, mask))          mask: dflash_model/blocks.py::block_visibility
              x = x + mlp(post_attention_layernorm(x))
    logits = frozen target lm_head(norm(x))       slot k predicts the token at anchor + k; slot 0 is never a target

Context rows are pure K/V entries: no input_layernorm, no Q/O projection, no MLP, no residual.
Trainable parameters carry the z-lab names (fc, hidden_norm, layers.{i}.…, norm); the target's embedding and
LM head are frozen, non-persistent buffers (never in state_dict, never in the optimizer, never exported).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.config import ConfigError, check_layer_types
from pipeline.target import text_config
from dflash_model.blocks import FULL, SLIDING, BlockBatch, dense_block_mask, flex_block_mask

INIT_STD = 0.02  # Qwen3 initializer_range


@dataclass
class DrafterArgs:
    """The drafter architecture; mirrors the z-lab config.json fields (dflash_model/export.py writes/reads them)."""

    hidden_size: int  # D, equal to the target's (the embedding and LM head are shared)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # rows of the target's LM head
    block_size: int  # B
    mask_token_id: int  # reserved row of the target embedding used for MASK slots
    target_layer_ids: list[int]  # tapped target layers, extract/layers.py convention (output of decoder layer l)
    num_target_layers: int
    layer_types: list[str] = field(default_factory=list)  # per layer 'full_attention' | 'sliding_attention'
    sliding_window: Optional[int] = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_run_config(cls, cfg, target_config, tokenizer_len: int, *, layer_ids: list[int]) -> "DrafterArgs":
        """Fill the drafter architecture from `cfg.drafter`, taking every None field from the target HF config.

        layer_ids: the tapped target layers (extract/layers.py convention), as the feature manifest fixed them
        (or `extract.layers.configured_layer_ids` when features are computed online).
        mask_token_id: `cfg.drafter.mask_token_id`, else the first id past the tokenizer if the target embedding
        has such a (padded, unused) row; otherwise a ConfigError (no silent fallback to pad/eos).
        """
        d = cfg.drafter
        text = text_config(target_config)
        heads = d.num_attention_heads or text.num_attention_heads
        head_dim = d.head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads
        num_target_layers = text.num_hidden_layers
        if d.mask_token_id is not None:
            mask_token_id = d.mask_token_id
        elif tokenizer_len < text.vocab_size:
            mask_token_id = tokenizer_len
        else:
            raise ConfigError(
                f"drafter.mask_token_id: the tokenizer has {tokenizer_len} tokens and the target vocabulary "
                f"{text.vocab_size} rows, so there is no unused row past the tokenizer; set drafter.mask_token_id "
                "to a reserved row of the target embedding (never pad/eos)"
            )
        return cls(
            hidden_size=text.hidden_size,
            num_hidden_layers=d.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=d.intermediate_size or text.intermediate_size,
            rms_norm_eps=d.rms_norm_eps,
            rope_theta=d.rope_theta,
            vocab_size=text.vocab_size,
            block_size=d.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(layer_ids),
            num_target_layers=num_target_layers,
            layer_types=list(d.layer_types) if d.layer_types else [FULL] * d.num_layers,
            sliding_window=d.sliding_window,
        )


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim] for integer positions [T] (full rotary, neox/rotate-half layout, as HF Qwen3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [heads, T, head_dim] rotated at the positions of cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


_compiled_flex = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    """flex_attention, compiled on GPU (fused kernel); eager elsewhere (CPU runs the forward only)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled training step: traced into its graph
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    with warnings.catch_warnings():  # "called without torch.compile": expected on CPU, which runs eager
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def attend(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
    """Attention of q [1, H, Q, hd] over k, v [1, KVH, K, hd] (GQA) -> [1, H, Q, hd].

    mask: None (everything visible), a dense Bool[Q, K] (True = visible; every row must see >= 1 key), or a
    FlexAttention BlockMask.
    """
    if mask is not None and not isinstance(mask, Tensor):
        return _flex_attention(q, k, v, mask, scale)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # explicit repeat keeps the memory-efficient SDPA kernels available with a mask
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class Attention(nn.Module):
    """GQA attention whose keys/values are [context rows ; block rows], with per-head q_norm / k_norm."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        D, hd = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def key_value(self, rows: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K, V [KVH, T, hd] of rows [T, D] (context features H_t, or normed block rows), RoPE'd at cos/sin."""
        T = rows.shape[0]
        k = self.k_norm(self.k_proj(rows).view(T, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(rows).view(T, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, h: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        """h [Q, D] normed block rows at cos/sin [Q, hd]; ctx_k/ctx_v [KVH, S, hd]; mask over [S + Q] keys."""
        Q = h.shape[0]
        q = self.q_norm(self.q_proj(h).view(Q, self.num_heads, self.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos, sin)
        block_k, block_v = self.key_value(h, cos, sin)
        k = torch.cat([ctx_k, block_k], dim=1)
        v = torch.cat([ctx_v, block_v], dim=1)
        out = attend(q[None], k[None], v[None], mask, self.head_dim**-0.5)[0]  # [H, Q, hd]
        return self.o_proj(out.transpose(0, 1).reshape(Q, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        D, I = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer over the block rows; the context enters only as extra K/V rows (ctx_k, ctx_v)."""

    def __init__(self, args: DrafterArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------
# Inference cache
# ----------------------------------------------------------------------------------------------


@dataclass
class DrafterCache:
    """Per-layer K/V of the context rows held so far (never block rows); batch 1.

    keys[i] / values[i]: [KVH, capacity, hd] buffers of layer i, rows 0..length-1 valid (positions 0..length-1).
    """

    keys: list[Tensor]
    values: list[Tensor]
    length: int = 0

    def extend(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write the K/V [KVH, T, hd] of T new rows at positions length..length+T-1 (caller bumps `length`)."""
        end = self.length + k.shape[1]
        if end > self.keys[layer].shape[1]:
            capacity = max(end, 2 * self.keys[layer].shape[1], 64)
            for buf in (self.keys, self.values):
                old = buf[layer]
                grown = old.new_empty(old.shape[0], capacity, old.shape[2])
                grown[:, : self.length] = old[:, : self.length]
                buf[layer] = grown
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.keys[i][:, : self.length], self.values[i][:, : self.length]


# ----------------------------------------------------------------------------------------------
# Training-forward pieces (plain functions so one compiled graph serves every layer)
# ----------------------------------------------------------------------------------------------


def _fuse_step(drafter: "DFlashDrafter", features: Tensor) -> Tensor:
    """H_t [S, D] of the packed row's features [S, n_taps*D]."""
    return drafter.fuse(features)


def _layer_step(layer: DecoderLayer, x: Tensor, ctx: Tensor, ctx_cos: Tensor, ctx_sin: Tensor, cos: Tensor,
                sin: Tensor, mask) -> Tensor:
    """One decoder layer over the block rows x [Q, D]; its context K/V come from H_t ctx [S, D] (this layer's
    k_proj/v_proj, k_norm, RoPE at ctx_cos/ctx_sin)."""
    ctx_k, ctx_v = layer.self_attn.key_value(ctx, ctx_cos, ctx_sin)
    return layer(x, ctx_k, ctx_v, cos, sin, mask)


def _first_layer_step(layer: DecoderLayer, x: Tensor, ctx: Tensor, ctx_cos: Tensor, ctx_sin: Tensor, cos: Tensor,
                      sin: Tensor, mask) -> Tensor:
    """`_layer_step` of the first layer, whose x (the frozen embedding of the block) needs no gradient where every
    later layer's does. A function of its own so that compiled it has its own graphs: sharing one would make each
    step alternate between two requires_grad guards, and with the shape guards that exhausts torch._dynamo's
    recompile limit (8) within minutes of training (docs/benchmarks.md, "quality")."""
    return _layer_step(layer, x, ctx, ctx_cos, ctx_sin, cos, sin, mask)


def _final_step(drafter: "DFlashDrafter", x: Tensor, row_valid: Tensor) -> Tensor:
    """norm(x) [Q, D], zero on the rows of padded blocks (row_valid Bool[Q] False)."""
    return torch.where(row_valid[:, None], drafter.norm(x), 0.0)


_TRAIN_FNS = {"fuse": _fuse_step, "first_layer": _first_layer_step, "layer": _layer_step, "final": _final_step}


def _dynamic_lengths(*values) -> None:
    """Mark the lengths of a packed row's tensors dynamic for torch.compile before their first compiled call: the
    row length S and the block rows Q differ from micro-batch to micro-batch, so each compiled piece gets one graph
    for every shape at once, where automatic dynamic shapes compile a static graph, then a dynamic one at the
    second shape (a compile per piece more). Row tensors ([S, ...], [Q, ...]) have their first dim marked; a dense
    mask [Q, S + Q] both; a FlexAttention BlockMask its block counts and indices ([1, 1, blocks(, blocks)]). A
    BlockMask also carries its lengths as Python ints, which a first compile specializes on: the layer steps on
    flex attention still compile a second, dynamic graph at the second shape (the fusion and final norm do not)."""
    from torch._dynamo import maybe_mark_dynamic

    for v in values:
        if isinstance(v, Tensor):
            for d in range(v.dim()) if v.dtype == torch.bool else range(1):
                maybe_mark_dynamic(v, d)
        elif v is not None and hasattr(v, "as_tuple"):  # a BlockMask
            for t in v.as_tuple():
                if isinstance(t, Tensor) and t.dim() >= 3:
                    for d in range(2, t.dim()):
                        maybe_mark_dynamic(t, d)


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        D = args.hidden_size
        self.fc = nn.Linear(args.num_taps * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, args.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(args, t) for t in args.layer_types])
        self.norm = RMSNorm(D, args.rms_norm_eps)
        # the target's frozen embedding and LM head: buffers, not parameters, and not persistent
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.gradient_checkpointing = False  # recompute each layer in backward (forward_train only)
        self._train_fns = _TRAIN_FNS  # forward_train's pieces; compile_training() swaps in compiled ones
        self.apply(self._init_weights)

    def compile_training(self, backend: str = "inductor") -> None:
        """torch.compile the pieces of `forward_train`: the feature fusion (fc + hidden_norm), each layer step
        (the context rows' K/V projection, norm and RoPE + the decoder layer: one graph shared by all layers) and
        the final norm. The BlockMask construction and the loss stay eager. The row lengths are marked dynamic
        before the first call (`_dynamic_lengths`): one graph per piece for every shape. Modules are not replaced,
        so parameter names, state_dict, checkpoints and ZeRO hooks are unchanged; inference (`draft_logits`) stays
        eager. `backend`: torch.compile's (CPU tests trace with 'aot_eager')."""
        self._train_fns = {name: torch.compile(fn, backend=backend) for name, fn in _TRAIN_FNS.items()}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    # -- the target's frozen pieces ------------------------------------------------------------

    def attach_target_head(self, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        """Reference (no copy) the target's embedding [V_e, D] and LM head [V, D] as frozen buffers.

        The MASK row (`args.mask_token_id`) must exist in the embedding: its target value IS the mask embedding.
        """
        D = self.args.hidden_size
        if embed_weight.dim() != 2 or embed_weight.shape[1] != D:
            raise ValueError(f"embed_weight must be [V, {D}], got {tuple(embed_weight.shape)}")
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != D:
            raise ValueError(f"lm_head_weight must be [V, {D}], got {tuple(lm_head_weight.shape)}")
        if embed_weight.shape[0] <= self.args.mask_token_id:
            raise ValueError(
                f"mask_token_id {self.args.mask_token_id} has no row in the target embedding ({embed_weight.shape[0]} rows)"
            )
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def _embed(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        if self.embed_weight is None:
            raise RuntimeError("call attach_target_head(embed_weight, lm_head_weight) before running the drafter")
        return F.embedding(ids, self.embed_weight).to(dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits [.., V] of final-normed hidden states through the frozen LM head, in the head's dtype (an fp32 copy
        would only be an exact upcast: consumers that need fp32, like the tree builder's log-softmax, convert)."""
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)

    # -- shared pieces ---------------------------------------------------------------------------

    def fuse(self, features: Tensor) -> Tensor:
        """H_t = hidden_norm(fc(features)): [.., T, n_taps*D] -> [.., T, D] (taps concatenated shallow -> deep)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, dtype)

    # -- training ----------------------------------------------------------------------------------

    def forward_train(self, features: Tensor, batch: BlockBatch, attention: str = "dense") -> Tensor:
        """Final-normed hidden states [Q, D] of all Q = N*B packed block rows (dflash_model/blocks.py layout).

        features: [1, S, n_taps*D] target features of the packed row. attention: 'dense' (exact SDPA with a boolean
        mask, any device), 'flex' (FlexAttention BlockMask; backward needs a GPU) or 'auto' (flex on CUDA).
        Rows of padded blocks are returned as zeros.
        """
        if attention == "auto":
            attention = "flex" if features.is_cuda else "dense"
        if attention not in ("dense", "flex"):
            raise ValueError(f"attention must be 'dense', 'flex' or 'auto', got {attention!r}")
        if features.dim() != 3 or features.shape[0] != 1 or features.shape[1] != batch.seq_len:
            raise ValueError(f"features must be [1, {batch.seq_len}, n*D], got {tuple(features.shape)}")
        # the held-out evaluation (no gradient) runs eager: compiled, it would double every graph's variants
        fns = self._train_fns if torch.is_grad_enabled() else _TRAIN_FNS
        compiled = fns is not _TRAIN_FNS
        row = features[0]  # [S, n_taps*D]
        if compiled:
            _dynamic_lengths(row)
        ctx = fns["fuse"](self, row)  # [S, D]
        dtype = ctx.dtype
        x = self._embed(batch.block_ids, dtype)  # [Q, D]
        ctx_cos, ctx_sin = self._rope(batch.context_positions, dtype)
        cos, sin = self._rope(batch.block_positions, dtype)
        masks = {t: self._train_mask(batch, t, attention) for t in set(self.args.layer_types)}
        row_valid = batch.block_valid.repeat_interleave(batch.block_size)
        if compiled:
            _dynamic_lengths(ctx, x, ctx_cos, ctx_sin, cos, sin, row_valid, *masks.values())
        for i, layer in enumerate(self.layers):
            run = fns["first_layer" if i == 0 else "layer"]
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    run, layer, x, ctx, ctx_cos, ctx_sin, cos, sin, masks[layer.layer_type], use_reentrant=False
                )
            else:
                x = run(layer, x, ctx, ctx_cos, ctx_sin, cos, sin, masks[layer.layer_type])
            if compiled:
                _dynamic_lengths(x)
        return fns["final"](self, x, row_valid)

    def _train_mask(self, batch: BlockBatch, layer_type: str, attention: str):
        args = (batch.anchors, batch.seq_len, batch.block_size, layer_type, self.args.sliding_window)
        kw = dict(block_valid=batch.block_valid, doc_start=batch.doc_start)
        if attention == "flex":
            return flex_block_mask(*args, **kw)
        mask = dense_block_mask(*args, **kw)
        # rows that see nothing (padded blocks) would give NaN in SDPA: let them see themselves; zeroed later
        empty = ~mask.any(dim=1)
        rows = torch.nonzero(empty).flatten()
        mask[rows, batch.seq_len + rows] = True
        return mask

    # -- inference ---------------------------------------------------------------------------------

    def new_cache(self) -> DrafterCache:
        """An empty context cache (batch 1) on the drafter's device/dtype."""
        w = self.fc.weight
        shape = (self.args.num_key_value_heads, 0, self.args.head_dim)
        n = len(self.layers)
        return DrafterCache([w.new_empty(shape) for _ in range(n)], [w.new_empty(shape) for _ in range(n)])

    @torch.no_grad()
    def append_context(self, cache: DrafterCache, new_context_features: Tensor) -> None:
        """Append the K/V of T_new context rows (positions cache.length .. cache.length+T_new-1) to `cache`.

        new_context_features: [1, T_new, n_taps*D] target features of exactly those tokens, in order.
        """
        T_new = new_context_features.shape[1]
        if T_new == 0:
            return
        ctx = self.fuse(new_context_features[0])
        positions = torch.arange(cache.length, cache.length + T_new, device=ctx.device)
        cos, sin = self._rope(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            cache.extend(i, k, v)
        cache.length += T_new

    @torch.no_grad()
    def draft_logits(
        self, cache: DrafterCache, new_context_features: Tensor, bonus_token: int | Tensor, start: int
    ) -> Tensor:
        """Logits [B-1, V] (LM head dtype) of block slots 1..B-1 (slot k predicts the token at position start+k).

        Appends the T_new new context rows (positions cache.length .. start-1; requires cache.length + T_new ==
        start) to `cache`, then runs the block [bonus, MASK x (B-1)] at positions start..start+B-1 against all
        context rows and the block (full layers bidirectional, sliding layers causal + window). The cache keeps
        only context rows.
        """
        if new_context_features.dim() != 3 or new_context_features.shape[0] != 1:
            raise ValueError(f"new_context_features must be [1, T_new, n*D], got {tuple(new_context_features.shape)}")
        T_new = new_context_features.shape[1]
        if cache.length + T_new != start:
            raise ValueError(f"cache holds {cache.length} rows + {T_new} new != start {start}")
        self.append_context(cache, new_context_features)
        B, dtype = self.args.block_size, self.fc.weight.dtype
        device = self.fc.weight.device
        ids = torch.full((B,), self.args.mask_token_id, dtype=torch.long, device=device)
        ids[:1] = torch.as_tensor(bonus_token, device=device).reshape(1)  # int or device scalar (no host sync)
        x = self._embed(ids, dtype)
        cos, sin = self._rope(torch.arange(start, start + B, device=device), dtype)
        masks = {FULL: None, SLIDING: None}
        if SLIDING in self.args.layer_types:
            # what a serving engine does: causal sliding window over absolute positions (keys 0..start+B-1).
            # Written independently of the training predicate so the equivalence test checks one against the other.
            q_pos = torch.arange(start, start + B, device=device)[:, None]
            k_pos = torch.arange(start + B, device=device)[None, :]
            masks[SLIDING] = (k_pos <= q_pos) & (k_pos > q_pos - self.args.sliding_window)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = cache.layer(i)
            x = layer(x, ctx_k, ctx_v, cos, sin, masks[layer.layer_type])
        return self.logits(self.norm(x[1:]))

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

