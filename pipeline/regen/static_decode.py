"""The hf backend's fast path: batched decoding over a preallocated KV cache, with the one-token step
replayed as a CUDA graph on GPU.

`model.generate` spends most of a step on Python and allocator overhead, not in the forward (docs/benchmarks.md,
"regen", has the numbers). Here every tensor of a decode step has a fixed shape and address, so the step is
captured once per (batch, cache length) and replayed:

    cache slots:  [ left padding | prompt | generated ... ]      slot index 0 .. L-1
    row b:        pad_b = P - len_b padding slots, prompt at P-len_b .. P-1, token k of the answer at P+k
    positions:    slot j of row b has RoPE position j - pad_b (the unpadded position)
    mask [B,1,Q,L] additive: query slot i sees key slot j  iff  j <= i and (j >= pad_b or j == i)

(a padding query sees only itself, so no softmax row is empty and no NaN reaches the cache.) L is a multiple of
`length_bucket`, and a decode step attends over the buckets written so far only (the first `live` slots of cache
and mask; one graph per live length): the K/V reads that dominate a large-batch step grow with the answer instead
of costing the whole preallocated cache from the first token.

Hybrid targets (Qwen3.5/3.6: Gated-DeltaNet layers beside the full-attention ones) decode the same way. Their
attention layers write K/V into the same slot buffers; each Gated-DeltaNet layer keeps, instead of K/V, a conv window
and a recurrent state per row, held in two buffers of fixed shape stacked over the NL such layers
(pipeline/recurrent_cache.py):

    conv       [NL, B, C, K]   (model dtype)     recurrent  [NL, B, HV, dk, dv]   (fp32)

The prefill runs HF's own layer code (the padding slots of a row are zeroed before its Gated-DeltaNet layers, as
`generate` does, so they leave its states at zero), then the states move into the stacked buffers and HF's cache
points at views of them: each one-token step is HF's decode step (fla's fused recurrent kernel where fla-core is
installed, transformers' torch recurrence otherwise), which updates the views in place. So the step has fixed
shapes, reads no host value and writes only fixed buffers: capturable like the attention-only step, with the
stacked states restored between the capture's extra runs. Compaction gathers the states' rows with the K/V rows.

The same code runs on CPU without graphs; for greedy decoding it produces the same tokens as
`model.generate` (tests/pipeline/test_regen_hf.py, attention-only and hybrid targets). Models with other layer
types (sliding windows, other recurrent layers) are not supported (`supports_static_decode`) and use
`model.generate`.
"""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from pipeline.cuda_graphs import CudaGraphFn, relative_error, rounding_tolerance
from pipeline.log import get_logger
from pipeline.recurrent_cache import LINEAR_ATTENTION, bind_linear_states, layer_types, linear_attention_layers, \
    linear_state_buffers, prebind_linear_states, stack_linear_states
from pipeline.regen.generator import Sampling, sample_next
from pipeline.regen.varlen_attention import bmm_has_fp32_output
from pipeline.target import compile_pointwise_modules, kv_head_shape, text_config, uncompile

log = get_logger("regen.static")

STOP_CHECK_EVERY = 8  # decode steps between host syncs that test "every row finished"
GQA_FOLDED = "drafter_gqa_folded_sdpa"  # attention implementation name used during static decoding
DECODE_GEMM = "drafter_decode_gemm"  # the same, its one-token steps as two batched GEMMs (decode_attention)


def gqa_folded_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for one-token steps: query [B, H, 1, D], key/value [B, H_kv, L, D],
    additive mask [B, 1, 1, L] -> ([B, 1, H, D], None).

    The H/H_kv query heads that share a KV head are folded into the query axis ([B, H_kv, H/H_kv, D]), so
    K/V are read once instead of being copied H/H_kv times (`repeat_kv`, what sdpa does whenever a mask is
    given): reading the cache's live slots is most of a decode step's memory traffic.
    Prefill (more than one query) goes to transformers' sdpa unchanged."""
    return _folded(module, query, key, value, attention_mask, scaling, dropout, gemm=False, **kwargs)


def gqa_folded_gemm(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`gqa_folded_sdpa` with the one-token step computed by `decode_attention` (two batched GEMMs) instead of
    torch's fused attention kernel."""
    return _folded(module, query, key, value, attention_mask, scaling, dropout, gemm=True, **kwargs)


def _folded(module, query, key, value, attention_mask, scaling, dropout, *, gemm: bool, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    hk = key.shape[1]
    if q > 1 or h == hk and not gemm or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    folded = query.reshape(b, hk, h // hk, d)
    scale = scaling if scaling is not None else d ** -0.5
    if gemm:
        out = decode_attention(folded, key, value, attention_mask, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                               scale=scale)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of a few queries per KV head as two batched GEMMs: query [B, Hk, G, D] (the G query heads that
    share each of the Hk KV heads), key / value [B, Hk, L, D] (slices of the slot buffers: a row's L slots
    contiguous, rows strided), additive mask [B, 1, 1, L] -> [B, Hk, G, D].

    Each K/V slot is read once per layer, as a memory-bound GEMM reads it. Fused attention kernels tile the query
    axis in blocks of 64 or more, so a decode step (G = 1..8 real query rows) runs them mostly on padding. The
    scores and the softmax are fp32 (bf16 / fp16 inputs accumulate into an fp32 output, as flash attention keeps
    its scores), the probabilities meet V in the value dtype."""
    b, hk, g, d = query.shape
    length = key.shape[2]
    q = query.reshape(b * hk, g, d)
    k = key.reshape(b * hk, length, d)  # a view for slot-buffer slices (their batch and head strides merge)
    v = value.reshape(b * hk, length, d)
    if q.is_cuda and q.dtype != torch.float32:
        scores = torch.bmm(q, k.mT, out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float().mT)
    scores = scores.view(b, hk, g, length).mul_(scale).add_(mask.float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b * hk, g, length)
    return torch.bmm(probs, v).view(b, hk, g, d)


def fp32_scores_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `decode_attention` gets fp32 scores without copying K: fp32 inputs, anywhere but CUDA (it upcasts), or
    a torch whose CUDA bmm takes `out_dtype` for these inputs. Where not, the decoder keeps the fused SDPA kernel
    (logged) rather than round the scores to bf16 or copy the cache."""
    if dtype == torch.float32 or device.type != "cuda":
        return True
    ok = bmm_has_fp32_output(device.type, dtype)
    if not ok:
        log.warning("regen static decode: this torch's CUDA bmm has no fp32 output for %s inputs; the one-token step "
                    "keeps the fused SDPA kernel", dtype)
    return ok


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_FOLDED, gqa_folded_sdpa)
    AttentionInterface.register(DECODE_GEMM, gqa_folded_gemm)
    try:  # masks are always passed in 4D here; registering keeps transformers from dropping them
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(GQA_FOLDED, sdpa_mask)
        AttentionMaskInterface.register(DECODE_GEMM, sdpa_mask)
    except ImportError:
        pass


@contextmanager
def attention_implementation(model, name: str | None):
    """Run the model's attention layers with implementation `name` inside the block (None = unchanged)."""
    if name is None:
        yield
        return
    before = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = before


GATED_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                   "out_proj")  # a Qwen3.5-style Gated-DeltaNet module's parts (its decode step runs in HF's code)


def supports_static_decode(config) -> bool:
    """True iff every decoder layer is plain full attention or Gated DeltaNet (linear attention): no sliding
    window, no other recurrent layer type."""
    text = text_config(config)
    return set(layer_types(config)) <= {"full_attention", LINEAR_ATTENTION} \
        and not getattr(text, "use_sliding_window", False)


class SlotCache:
    """Per-attention-layer KV buffers [B, H_kv, L, D] (buffer j for the j-th attention layer `reserve` was given,
    `slot[layer_idx]`); a forward writes its T new keys at slots `write_pos .. write_pos+T-1` (a device scalar, so a
    captured graph reads the current value)."""

    def __init__(self, max_len: int, device):
        self.max_len = max_len
        self.live = max_len  # slots 0..live-1 are returned to attention (the rest are unwritten)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slot: dict[int, int] = {}  # decoder layer index -> its K/V buffer
        self.write_pos = torch.zeros((), dtype=torch.long, device=device)
        self.is_compileable = True
        self._pos = 0

    def reserve(self, layers: Sequence[int], batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Allocate the K/V buffers [batch, kv_heads, max_len, head_dim] of the attention layers `layers` (decoder
        layer indices, in order) before any forward, so that views of their first rows (`first_rows`) can be taken
        before the first forward on all of them."""
        device = self.write_pos.device
        for i in layers:
            self.slot[i] = len(self.keys)
            self.keys.append(torch.zeros(batch, kv_heads, self.max_len, head_dim, dtype=dtype, device=device))
            self.values.append(torch.zeros(batch, kv_heads, self.max_len, head_dim, dtype=dtype, device=device))

    def set_write_pos(self, slot: int) -> None:
        self._pos = slot
        self.write_pos.fill_(slot)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """key/value_states [B, H_kv, T, D] -> views [B, H_kv, live, D] of the layer's buffers (the written slots
        must lie below `live`)."""
        j = self.slot.get(layer_idx)  # (`reserve` made every attention layer's buffers)
        if j is None or self.keys[j].shape[1] != key_states.shape[1] or self.keys[j].shape[3] != key_states.shape[3]:
            held = "no reserved slots" if j is None else f"reserved slots of {tuple(self.keys[j].shape)}"
            raise ValueError(f"static decode: attention layer {layer_idx} gives K/V of {key_states.shape[1]} heads x "
                             f"{key_states.shape[3]}; it has {held}")
        slots = self.write_pos + torch.arange(key_states.shape[2], device=key_states.device)
        self.keys[j].index_copy_(2, slots, key_states)
        self.values[j].index_copy_(2, slots, value_states)
        return self.keys[j][:, :, : self.live], self.values[j][:, :, : self.live]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._pos

    def first_rows(self, size: int) -> "SlotCache":
        """A SlotCache over views of the first `size` batch rows of these buffers."""
        out = copy.copy(self)  # the same write position (one device scalar for every batch size) and layer slots
        out.keys, out.values = [t[:size] for t in self.keys], [t[:size] for t in self.values]
        return out


class HybridSlotCache(DynamicCache):
    """HF's cache for a hybrid model: the attention layers write into `slots` (a SlotCache: fixed K/V buffers),
    the Gated-DeltaNet layers keep HF's own conv / recurrent state handling; after the prefill their tensors are
    views of the stacked buffers (pipeline/recurrent_cache.py), which HF's decode step updates in place."""

    def __init__(self, config, slots: SlotCache):
        super().__init__(config=config)
        self.slots = slots

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.slots.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.slots.get_seq_length()

    def first_rows(self, size: int, linear: Sequence[int], conv: Tensor, recurrent: Tensor) -> "HybridSlotCache":
        """The same cache over the first `size` batch rows: K/V views (`SlotCache.first_rows`), and HF's layer
        objects copied with their Gated-DeltaNet entries bound to conv[:, :size] / recurrent[:, :size] (the
        flags HF keeps, such as "has a previous state", carry over)."""
        out = copy.copy(self)
        out.slots = self.slots.first_rows(size)
        out.layers = [copy.copy(layer) for layer in self.layers]
        for i in linear:
            out.layers[i].conv_states = dict(out.layers[i].conv_states)
            out.layers[i].recurrent_states = dict(out.layers[i].recurrent_states)
        bind_linear_states(out, linear, conv[:, :size], recurrent[:, :size])
        return out


@dataclass
class _State:
    """Buffers (and the captured graph) for one (batch, cache length) shape, reused across batches."""

    slots: SlotCache  # the attention layers' K/V
    ids: torch.Tensor  # [B, 1] input token of the step
    pos: torch.Tensor  # [B, 1] RoPE position of the step
    mask: torch.Tensor  # [B, 1, 1, L] additive mask of the step
    cache: object = None  # what the model gets: `slots`, or (hybrid) a HybridSlotCache over them
    conv: Tensor | None = None  # hybrid: [NL, B, C, K] Gated-DeltaNet conv windows (from the first prefill on)
    recurrent: Tensor | None = None  # hybrid: [NL, B, HV, dk, dv] Gated-DeltaNet recurrent states, fp32
    steps: dict[int, CudaGraphFn] = field(default_factory=dict)  # the one-token step per live length (CUDA)
    compact: dict[int, "_State"] = field(default_factory=dict)  # views of the first rows, per smaller batch

    def __post_init__(self):
        if self.cache is None:
            self.cache = self.slots

    def states(self) -> list[Tensor]:
        """The tensors a step changes in place besides the K/V slot it rewrites: the hybrid's stacked states."""
        return [] if self.conv is None else [self.conv, self.recurrent]


class StaticDecoder:
    """Generate for a batch of prompts: prefill in chunks, then one-token steps over a SlotCache.

    Compaction: at each finished-rows check (every STOP_CHECK_EVERY steps), once the rows still generating fit in
    half the batch or less, they move to the first rows of the same buffers and decoding goes on at the smallest
    power of two that holds them (not below `min_compact_batch`): sampled answers end at very different lengths,
    and a batch no longer decodes at full size for its longest answer. A batch of fewer rows than the state holds
    (a run's few long prompts, its last partial batch) starts on such a first-rows state the same way
    (`rows_to_run`): the same views, the same captured graphs.

    Attention of a one-token step: the query heads folded onto their KV head (`gqa_fold`), computed as two batched
    GEMMs (`decode_gemm`, `decode_attention`) or by torch's fused SDPA kernel (`decode_gemm=False`).
    `compile_pointwise`: the decoder layers' norms and MLPs run torch.compile'd (`compile_pointwise_modules`) until
    `close()`.

    Prefill chunks: at most `prefill_chunk` positions and `prefill_tokens` rows x positions per forward. A chunk's
    additive mask [B, 1, Q, L], attention scores [B, H, Q, L] and activations [B, Q, ...] grow with B x Q, so a
    wider batch prefills in narrower chunks and the prefill's peak memory does not grow with the batch."""

    def __init__(self, model, *, vocab_limit: int, stop_ids: Sequence[int], sampling: Sampling,
                 cuda_graphs: bool = True, gqa_fold: bool = True, decode_gemm: bool = True,
                 compile_pointwise: bool = False, prefill_chunk: int = 512, prefill_tokens: int = 16384,
                 length_bucket: int = 128, min_compact_batch: int = 8):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_limit = vocab_limit
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device)
        self.sampling = sampling
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens = prefill_tokens
        self.length_bucket = length_bucket
        self.min_compact_batch = min_compact_batch
        self.linear = linear_attention_layers(model.config)  # Gated-DeltaNet layers (hybrid targets)
        if self.linear:
            _check_gated_delta_net(model, len(self.linear))
        self.attention = None
        if gqa_fold and model.config._attn_implementation in ("sdpa", GQA_FOLDED, DECODE_GEMM):
            _register_attention()
            self.attention = DECODE_GEMM if decode_gemm and fp32_scores_available(self.device, self.dtype) \
                else GQA_FOLDED
        self._state: _State | None = None
        self._key: tuple[int, int] | None = None
        self.compiled = compile_pointwise_modules(model) if compile_pointwise else []

    def close(self) -> None:
        """Give the model back as it came: its compiled modules run eagerly again."""
        uncompile(self.compiled)
        self.compiled = []

    # -- public --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], limits: Sequence[int], *, pad_to: int | None = None,
                 cache_len: int = 0, generator: torch.Generator | None = None) -> list[list[int]]:
        """prompts: token id lists; limits: max new tokens per prompt. Returns the raw generated stream of
        each prompt (max(limits) tokens, to be cut at the first stop id / its limit by the caller).
        `pad_to` sizes the state for that many rows and `cache_len` its K/V slots at least that long, so that every
        batch of a run decodes on one state, whose captured step graphs serve them all (a batch the state cannot
        hold frees it and captures its graphs again). The batch itself runs on the state's first `rows_to_run` rows,
        dummy rows (copies of its first prompt) filling them past its own."""
        with torch.inference_mode(), attention_implementation(self.model, self.attention):
            return self._generate(prompts, limits, pad_to=pad_to, cache_len=cache_len, generator=generator)

    def _generate(self, prompts, limits, *, pad_to, cache_len, generator) -> list[list[int]]:
        n = len(prompts)
        width, steps = max(len(p) for p in prompts), max(limits)
        root = self._prepare(max(n, pad_to or n), -(-max(width + steps, cache_len) // self.length_bucket)
                             * self.length_bucket)
        cache_len = root.slots.max_len  # (a state kept from an earlier call may hold more slots than this one needs)
        size = self.rows_to_run(n, self._key[0])
        state = root if size == self._key[0] else self._first_rows(root, size)
        rows = list(prompts) + [prompts[0]] * (size - n)

        # built on the host, one asynchronous copy each: a copy from pageable memory, or a device value read on the
        # host, would make the host wait for the GPU to drain
        lens = self._to_device(torch.tensor([len(p) for p in rows]))
        host_ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, p in enumerate(rows):
            host_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        ids = self._to_device(host_ids)
        pad = width - lens  # [B] left padding per row
        logits = self._prefill(state, ids, pad, cache_len)

        out = torch.empty(len(rows), steps, dtype=torch.long, device=self.device)
        limit_t = self._to_device(torch.tensor(list(limits) + [1] * (len(rows) - n)))
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        state.mask.fill_(torch.finfo(self.dtype).min)
        slots = torch.arange(cache_len, device=self.device)
        state.mask[:, 0, 0, :] = torch.where(
            (slots[None, :] >= pad[:, None]) & (slots[None, :] < width), 0.0, torch.finfo(self.dtype).min
        ).to(self.dtype)
        state.pos.copy_(lens[:, None])
        bucket = self.length_bucket
        row_of, real = torch.arange(len(rows), device=self.device), len(rows)
        for k in range(steps):
            nxt = sample_next(logits, self.sampling, generator, self.vocab_limit)
            out[row_of[:real], k] = nxt[:real]
            done |= torch.isin(nxt, self.stop_ids) | (k + 1 >= limit_t)
            if k + 1 < steps and (k + 1) % STOP_CHECK_EVERY == 0:
                alive = int((~done).sum())  # the host sync of the check
                if alive == 0:
                    return out[:n, : k + 1].tolist()  # (one read-back for the batch, not one per row)
                size = max(self.min_compact_batch, 1 << (alive - 1).bit_length())
                if size <= len(done) // 2:  # half the rows or more finished: go on with the others only
                    keep = torch.nonzero(~done).flatten()
                    idx = torch.cat([keep, keep[:1].expand(size - alive)])  # then copies of a live row
                    state = self._compact(root, idx, size, written=width + k)
                    nxt, limit_t, done, row_of, real = nxt[idx], limit_t[idx], done[idx], row_of[idx], alive
                    done[alive:] = True
            if k + 1 == steps:
                return out[:n, : k + 1].tolist()
            state.ids.copy_(nxt[:, None])
            state.mask[:, :, :, width + k] = 0.0
            state.slots.set_write_pos(width + k)
            state.slots.live = min(cache_len, -(-(width + k + 1) // bucket) * bucket)  # the filled buckets
            logits = self._step(state)
            state.pos.add_(1)
        return out[:n].tolist()

    def rows_to_run(self, n: int, rows: int) -> int:
        """The rows a batch of `n` prompts decodes on, of a state of `rows`: without graphs `n` (any first-rows view
        serves); with graphs the smallest power of two that holds them (not below `min_compact_batch`) where that
        is at most half the state, else all `rows` (the sizes compaction uses, whose graphs every batch shares)."""
        if not self.use_graphs:
            return n
        size = max(self.min_compact_batch, 1 << (n - 1).bit_length())
        return size if size <= rows // 2 else rows

    def _to_device(self, host: Tensor) -> Tensor:
        """A host tensor on the decoder's device: from pinned memory, asynchronously, on CUDA."""
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def _compact(self, root: _State, idx: Tensor, size: int, written: int) -> _State:
        """Rows `idx` of the batch in flight (rows 0.. of `root`'s buffers) moved to rows 0..size-1 of the same
        buffers (cache, positions, mask, a hybrid's stacked states: their batch axis is 1), and the state over those
        first rows (`_first_rows`). Of the K/V buffers only the `written` slots move (the rest are written by later
        steps before any unmasked read). Nothing is allocated but the gathered copies."""
        for buf in [*root.slots.keys, *root.slots.values]:
            buf[:size, :, :written].copy_(buf[:, :, :written][idx])  # the gather copies before rows are overwritten
        for buf in (root.pos, root.mask):
            buf[:size].copy_(buf[idx])
        for buf in root.states():
            buf[:, :size].copy_(buf[:, idx])
        return self._first_rows(root, size)

    def _first_rows(self, root: _State, size: int) -> _State:
        """The state over the first `size` rows of `root`'s buffers (views: K/V, inputs, mask, a hybrid's stacked
        states), kept per size, so its graphs serve every later batch and compaction of that size."""
        if size not in root.compact:
            slots = root.slots.first_rows(size)
            cache, conv, recurrent = slots, None, None
            if self.linear:
                conv, recurrent = root.conv[:, :size], root.recurrent[:, :size]
                cache = None  # until a prefill on these rows makes one, where `root` has none yet
                if isinstance(root.cache, HybridSlotCache):
                    cache = root.cache.first_rows(size, self.linear, root.conv, root.recurrent)
                    cache.slots = slots
            root.compact[size] = _State(slots=slots, ids=root.ids[:size], pos=root.pos[:size], mask=root.mask[:size],
                                        cache=cache, conv=conv, recurrent=recurrent)
        return root.compact[size]

    def on_graphs(self) -> bool:
        """True when the last shape's steps (at every batch size it was compacted to) replay CUDA graphs, each
        captured and checked against eager."""
        states = [self._state, *self._state.compact.values()] if self._state is not None else []
        steps = [step for st in states for step in st.steps.values()]
        return bool(steps) and not any(step.disabled for step in steps)

    # -- internals -----------------------------------------------------------------------------
    def _prepare(self, batch: int, cache_len: int) -> _State:
        """The state for `batch` rows and at least `cache_len` slots: the one in hand when it has `batch` rows (or,
        without graphs, more) and that many slots or more (so its captured step graphs serve every later call of this
        decoder: a regen stage calls it once per shard, each with its own longest prompt), else a new one of exactly
        that shape, the previous one freed first. A hybrid's stacked Gated-DeltaNet states come with it, so that
        first-rows states are views of them from the start."""
        rows_ok = self._key is not None and (self._key[0] == batch or not self.use_graphs and self._key[0] > batch)
        if not rows_ok or self._key[1] < cache_len:
            self._state = None  # free the previous shape's cache and graph first
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._state = _State(
                slots=SlotCache(cache_len, self.device),
                ids=torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                pos=torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                mask=torch.zeros(batch, 1, 1, cache_len, dtype=self.dtype, device=self.device),
            )
            self._state.slots.reserve([i for i, t in enumerate(layer_types(self.model.config)) if t != LINEAR_ATTENTION],
                                      batch, *kv_head_shape(self.model.config), self.dtype)
            if self.linear:
                self._state.conv, self._state.recurrent = linear_state_buffers(
                    self.model.config, self.linear, batch, self.dtype, self.device)
            self._key = (batch, cache_len)
        return self._state

    def _prefill(self, state: _State, ids: torch.Tensor, pad: torch.Tensor, cache_len: int) -> torch.Tensor:
        """ids [B, P] left-padded -> logits [B, V] at the last prompt slot; fills cache slots 0..P-1 (and a hybrid's
        Gated-DeltaNet states: HF's cache made for this batch, its states then moved into the stacked buffers)."""
        if self.linear:  # HF's prefill writes the Gated-DeltaNet states straight into the stacked buffers
            state.cache = HybridSlotCache(self.model.config, state.slots)  # (its buffers: made with the state)
            prebind_linear_states(state.cache, self.linear, state.conv, state.recurrent)
        width = ids.shape[1]
        logits = None
        for a in range(0, width, chunk := self.chunk_positions(ids.shape[0])):
            b = min(width, a + chunk)
            live = min(cache_len, -(-b // self.length_bucket) * self.length_bucket)  # the buckets written so far
            mask, pos, real = prefill_chunk_inputs(a, b, live, pad, self.dtype)
            state.slots.set_write_pos(a)
            state.slots.live = live
            out = self.model(input_ids=ids[:, a:b], position_ids=pos, attention_mask=self._masks(mask, real),
                             past_key_values=state.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        if self.linear:
            state.conv, state.recurrent = stack_linear_states(state.cache, self.linear, state.conv, state.recurrent)
        return logits

    def chunk_positions(self, rows: int) -> int:
        """Prompt positions one prefill forward takes for a batch of `rows`: `prefill_chunk`, fewer where
        rows x positions would pass `prefill_tokens` (never below one)."""
        return max(1, min(self.prefill_chunk, self.prefill_tokens // rows))

    def _masks(self, attention: Tensor, padding: Tensor | None):
        """The model's `attention_mask` argument: the additive 4-D mask, or for a hybrid HF's per-layer-type dict:
        that mask for the attention layers and `padding` [B, Q] (1 = a real token; None in a decode step, whose token
        is never padding) for the Gated-DeltaNet layers, which zero the padding slots' inputs as `generate` does."""
        if not self.linear:
            return attention
        return {"full_attention": attention, LINEAR_ATTENTION: padding}

    def _forward_step(self, state: _State, live: int) -> torch.Tensor:
        out = self.model(input_ids=state.ids, position_ids=state.pos,
                         attention_mask=self._masks(state.mask[..., :live], None), past_key_values=state.cache,
                         use_cache=True)
        return out.logits[:, -1, :]

    def _step(self, state: _State) -> torch.Tensor:
        """One token for every row: logits [B, V], attending over the cache's `live` slots only (the buckets of
        `length_bucket` slots written so far: a step reads the K/V it needs, not the whole preallocated cache).
        A CUDA graph per live length (pipeline.cuda_graphs) when graphs are on; the step reads only `state`'s
        buffers and rewrites the same K/V slot, and a hybrid's stacked states, which it advances in place, are
        restored between the capture's extra runs (`state.states()`)."""
        live = state.slots.live
        if not self.use_graphs:
            return self._forward_step(state, live)
        if live not in state.steps:
            state.steps[live] = CudaGraphFn(
                functools.partial(self._forward_step, state, live), f"regen decode step ({live} slots)",
                check=lambda g, e: relative_error(g, e) <= rounding_tolerance(self.dtype), state=state.states)
        return state.steps[live]()



def prefill_chunk_inputs(a: int, b: int, live: int, pad: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs of a prefill forward over slots a..b-1 of left-padded rows (pad [B]: row b's prompt starts at slot
    pad_b) whose keys are the first `live` slots: (additive mask [B, 1, b-a, live]: query slot i sees key slot j iff
    j <= i and (j >= pad_b or j == i), so a padding query sees itself only; RoPE positions [B, b-a], slot - pad_b,
    clamped at 0; padding flags [B, b-a], 1 on prompt slots, 0 on padding)."""
    keys = torch.arange(live, device=pad.device)
    q = torch.arange(a, b, device=pad.device)
    seen = (keys[None, None, :] <= q[None, :, None]) & (
        (keys[None, None, :] >= pad[:, None, None]) | (keys[None, None, :] == q[None, :, None])
    )  # [B, Q, L]
    mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
    pos = (q[None, :] - pad[:, None]).clamp(min=0)
    real = (q[None, :] >= pad[:, None]).to(dtype)
    return mask, pos, real


def _check_gated_delta_net(model, expected: int) -> None:
    """Refuse a hybrid whose `expected` linear-attention layers are not Qwen3.5-style Gated-DeltaNet modules (the
    state layout the stacked buffers and HF's decode step assume)."""
    modules = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "linear_attn"]
    bad = [type(m).__name__ for m in modules if not all(hasattr(m, part) for part in GATED_DELTA_NET)]
    if len(modules) != expected or bad:
        raise NotImplementedError(f"static decode: {expected} linear-attention layers, found {len(modules)} "
                                  f"Gated-DeltaNet modules ({', '.join(sorted(set(bad))) or 'all Qwen3.5-style'})")
