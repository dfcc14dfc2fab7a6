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

The same code runs on CPU without graphs; for greedy decoding it produces the same tokens as
`model.generate` (tests/pipeline/test_regen_hf.py). Only models whose layers are all full attention
are supported (`supports_static_decode`); others use `model.generate`.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from pipeline.cuda_graphs import CudaGraphFn, relative_error, rounding_tolerance
from pipeline.log import get_logger
from pipeline.regen.generator import Sampling, mask_padded_vocab, sample_next
from pipeline.target import text_config

log = get_logger("regen.static")

STOP_CHECK_EVERY = 8  # decode steps between host syncs that test "every row finished"
GQA_FOLDED = "drafter_gqa_folded_sdpa"  # attention implementation name used during static decoding


def gqa_folded_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for one-token steps: query [B, H, 1, D], key/value [B, H_kv, L, D],
    additive mask [B, 1, 1, L] -> ([B, 1, H, D], None).

    The H/H_kv query heads that share a KV head are folded into the query axis ([B, H_kv, H/H_kv, D]), so
    K/V are read once instead of being copied H/H_kv times (`repeat_kv`, what sdpa does whenever a mask is
    given): reading the cache's live slots is most of a decode step's memory traffic.
    Prefill (more than one query) goes to transformers' sdpa unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    hk = key.shape[1]
    if q > 1 or h == hk or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, hk, h // hk, d), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_FOLDED, gqa_folded_sdpa)
    try:  # masks are always passed in 4D here; registering keeps transformers from dropping them
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(GQA_FOLDED, sdpa_mask)
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


def supports_static_decode(config) -> bool:
    """True iff every decoder layer is plain full attention (no sliding window, no linear attention)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not getattr(text, "use_sliding_window", False)


class SlotCache:
    """Per-layer KV buffers [B, H_kv, L, D]; a forward writes its T new keys at slots
    `write_pos .. write_pos+T-1` (a device scalar, so a captured graph reads the current value)."""

    def __init__(self, max_len: int, device):
        self.max_len = max_len
        self.live = max_len  # slots 0..live-1 are returned to attention (the rest are unwritten)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_pos = torch.zeros((), dtype=torch.long, device=device)
        self.is_compileable = True
        self._pos = 0

    def set_write_pos(self, slot: int) -> None:
        self._pos = slot
        self.write_pos.fill_(slot)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """key/value_states [B, H_kv, T, D] -> views [B, H_kv, live, D] of the layer's buffers (the written slots
        must lie below `live`)."""
        if layer_idx == len(self.keys):  # first forward allocates (outside any graph capture)
            b, h, _, d = key_states.shape
            self.keys.append(key_states.new_zeros(b, h, self.max_len, d))
            self.values.append(value_states.new_zeros(b, h, self.max_len, value_states.shape[-1]))
        slots = self.write_pos + torch.arange(key_states.shape[2], device=key_states.device)
        self.keys[layer_idx].index_copy_(2, slots, key_states)
        self.values[layer_idx].index_copy_(2, slots, value_states)
        return self.keys[layer_idx][:, :, : self.live], self.values[layer_idx][:, :, : self.live]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._pos


@dataclass
class _State:
    """Buffers (and the captured graph) for one (batch, cache length) shape, reused across batches."""

    cache: SlotCache
    ids: torch.Tensor  # [B, 1] input token of the step
    pos: torch.Tensor  # [B, 1] RoPE position of the step
    mask: torch.Tensor  # [B, 1, 1, L] additive mask of the step
    steps: dict[int, CudaGraphFn] = field(default_factory=dict)  # the one-token step per live length (CUDA)
    compact: dict[int, "_State"] = field(default_factory=dict)  # views of the first rows, per smaller batch


class StaticDecoder:
    """Generate for a batch of prompts: prefill in chunks, then one-token steps over a SlotCache.

    Compaction: at each finished-rows check (every STOP_CHECK_EVERY steps), once the rows still generating fit in
    half the batch or less, they move to the first rows of the same buffers and decoding goes on at the smallest
    power of two that holds them (not below `min_compact_batch`): sampled answers end at very different lengths,
    and a batch no longer decodes at full size for its longest answer."""

    def __init__(self, model, *, vocab_limit: int, stop_ids: Sequence[int], sampling: Sampling,
                 cuda_graphs: bool = True, gqa_fold: bool = True, prefill_chunk: int = 512, length_bucket: int = 128,
                 min_compact_batch: int = 8):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_limit = vocab_limit
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device)
        self.sampling = sampling
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk
        self.length_bucket = length_bucket
        self.min_compact_batch = min_compact_batch
        self.attention = None
        if gqa_fold and model.config._attn_implementation in ("sdpa", GQA_FOLDED):
            _register_attention()
            self.attention = GQA_FOLDED
        self._state: _State | None = None
        self._key: tuple[int, int] | None = None

    # -- public --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], limits: Sequence[int], *, pad_to: int | None = None,
                 generator: torch.Generator | None = None) -> list[list[int]]:
        """prompts: token id lists; limits: max new tokens per prompt. Returns the raw generated stream of
        each prompt (max(limits) tokens, to be cut at the first stop id / its limit by the caller).
        `pad_to` fills the batch with dummy rows up to that size so one captured graph serves every batch."""
        with torch.inference_mode(), attention_implementation(self.model, self.attention):
            return self._generate(prompts, limits, pad_to=pad_to, generator=generator)

    def _generate(self, prompts, limits, *, pad_to, generator) -> list[list[int]]:
        n = len(prompts)
        rows = list(prompts) + [prompts[0]] * max(0, (pad_to or n) - n)
        lens = torch.tensor([len(p) for p in rows], device=self.device)
        width, steps = int(lens.max()), max(limits)
        cache_len = -(-(width + steps) // self.length_bucket) * self.length_bucket
        state = self._prepare(len(rows), cache_len)

        pad = width - lens  # [B] left padding per row
        ids = torch.full((len(rows), width), 0, dtype=torch.long, device=self.device)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
        logits = self._prefill(state, ids, pad, cache_len)

        out = torch.empty(len(rows), steps, dtype=torch.long, device=self.device)
        limit_t = torch.tensor(list(limits) + [1] * (len(rows) - n), device=self.device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        state.mask.fill_(torch.finfo(self.dtype).min)
        slots = torch.arange(cache_len, device=self.device)
        state.mask[:, 0, 0, :] = torch.where(
            (slots[None, :] >= pad[:, None]) & (slots[None, :] < width), 0.0, torch.finfo(self.dtype).min
        ).to(self.dtype)
        state.pos.copy_(lens[:, None])
        bucket = self.length_bucket
        root, row_of, real = state, torch.arange(len(rows), device=self.device), len(rows)
        for k in range(steps):
            nxt = sample_next(mask_padded_vocab(logits.float(), self.vocab_limit), self.sampling, generator)
            out[row_of[:real], k] = nxt[:real]
            done |= torch.isin(nxt, self.stop_ids) | (k + 1 >= limit_t)
            if k + 1 < steps and (k + 1) % STOP_CHECK_EVERY == 0:
                alive = int((~done).sum())  # the host sync of the check
                if alive == 0:
                    return [row[: k + 1].tolist() for row in out[:n]]
                size = max(self.min_compact_batch, 1 << (alive - 1).bit_length())
                if size <= len(done) // 2:  # half the rows or more finished: go on with the others only
                    keep = torch.nonzero(~done).flatten()
                    idx = torch.cat([keep, keep[:1].expand(size - alive)])  # then copies of a live row
                    state = self._compact(root, idx, size)
                    nxt, limit_t, done, row_of, real = nxt[idx], limit_t[idx], done[idx], row_of[idx], alive
                    done[alive:] = True
            if k + 1 == steps:
                return [row[: k + 1].tolist() for row in out[:n]]
            state.ids.copy_(nxt[:, None])
            state.mask[:, :, :, width + k] = 0.0
            state.cache.set_write_pos(width + k)
            state.cache.live = min(cache_len, -(-(width + k + 1) // bucket) * bucket)  # the filled buckets
            logits = self._step(state)
            state.pos.add_(1)
        return [row.tolist() for row in out[:n]]

    def _compact(self, root: _State, idx: Tensor, size: int) -> _State:
        """Rows `idx` of the batch in flight (rows 0.. of `root`'s buffers) moved to rows 0..size-1 of the same
        buffers (cache, positions, mask), and the state over those first rows (kept per size: its graphs are
        reused by every later batch). Nothing is allocated but the gathered copies."""
        for buf in [*root.cache.keys, *root.cache.values, root.pos, root.mask]:
            buf[:size].copy_(buf[idx])  # buf[idx] gathers (a copy) before the first rows are overwritten
        if size not in root.compact:
            cache = SlotCache(root.cache.max_len, self.device)
            cache.keys = [t[:size] for t in root.cache.keys]
            cache.values = [t[:size] for t in root.cache.values]
            root.compact[size] = _State(cache=cache, ids=root.ids[:size], pos=root.pos[:size], mask=root.mask[:size])
        return root.compact[size]

    def on_graphs(self) -> bool:
        """True when the last shape's steps (at every batch size it was compacted to) replay CUDA graphs, each
        captured and checked against eager."""
        states = [self._state, *self._state.compact.values()] if self._state is not None else []
        steps = [step for st in states for step in st.steps.values()]
        return bool(steps) and not any(step.disabled for step in steps)

    # -- internals -----------------------------------------------------------------------------
    def _prepare(self, batch: int, cache_len: int) -> _State:
        if self._key != (batch, cache_len):
            self._state = None  # free the previous shape's cache and graph first
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._state = _State(
                cache=SlotCache(cache_len, self.device),
                ids=torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                pos=torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                mask=torch.zeros(batch, 1, 1, cache_len, dtype=self.dtype, device=self.device),
            )
            self._key = (batch, cache_len)
        return self._state

    def _prefill(self, state: _State, ids: torch.Tensor, pad: torch.Tensor, cache_len: int) -> torch.Tensor:
        """ids [B, P] left-padded -> logits [B, V] at the last prompt slot; fills cache slots 0..P-1."""
        width = ids.shape[1]
        neg = torch.finfo(self.dtype).min
        keys = torch.arange(cache_len, device=self.device)
        logits = None
        for a in range(0, width, self.prefill_chunk):
            b = min(width, a + self.prefill_chunk)
            q = torch.arange(a, b, device=self.device)
            seen = (keys[None, None, :] <= q[None, :, None]) & (
                (keys[None, None, :] >= pad[:, None, None]) | (keys[None, None, :] == q[None, :, None])
            )  # [B, Q, L]
            mask = torch.where(seen, 0.0, neg).to(self.dtype)[:, None]
            pos = (q[None, :] - pad[:, None]).clamp(min=0)
            state.cache.set_write_pos(a)
            state.cache.live = cache_len
            out = self.model(input_ids=ids[:, a:b], position_ids=pos, attention_mask=mask,
                             past_key_values=state.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        return logits

    def _forward_step(self, state: _State, live: int) -> torch.Tensor:
        out = self.model(input_ids=state.ids, position_ids=state.pos, attention_mask=state.mask[..., :live],
                         past_key_values=state.cache, use_cache=True)
        return out.logits[:, -1, :]

    def _step(self, state: _State) -> torch.Tensor:
        """One token for every row: logits [B, V], attending over the cache's `live` slots only (the buckets of
        `length_bucket` slots written so far: a step reads the K/V it needs, not the whole preallocated cache).
        A CUDA graph per live length (pipeline.cuda_graphs) when graphs are on; the step reads only `state`'s
        buffers and rewrites the same K/V slot, so the capture's extra runs change nothing."""
        live = state.cache.live
        if not self.use_graphs:
            return self._forward_step(state, live)
        if live not in state.steps:
            state.steps[live] = CudaGraphFn(
                functools.partial(self._forward_step, state, live), f"regen decode step ({live} slots)",
                check=lambda g, e: relative_error(g, e) <= rounding_tolerance(self.dtype))
        return state.steps[live]()
