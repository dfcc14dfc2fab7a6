"""The hf backend's continuous-batching decode loop: a fixed set of rows, each holding one sequence, a row taking
the next prompt as soon as its answer ends.

static_decode decodes a batch until its longest answer ends. Sampled answers range from a few tokens to the limit
(the SmolLM2 recipe: a mean of 180 of 384 tokens, a fifth of them cut at 384), so most of such a batch's row-steps go
to rows that have finished, or to compacted batches too small to use the GPU. Here every row is one sequence slot:

    row b, slots of its K/V buffers:  [ start_b .. w-1: its prompt | w .. end_b-1: its answer so far | free ]
                                      (w: the width of the group it was prefilled with, left padding below start_b)
    a step:   row b writes its input token's K/V at slot end_b and attends over slots start_b .. end_b, its own
              range only (pipeline/regen/varlen_attention.py), then end_b += 1; a finished row idles in place
    a check:  every `check_every` steps (the loop's one host sync): finished rows hand their answers back; once
              enough rows are free (`refill_rows`) they take the next prompts, longest first, prefilled as one group
              straight into their rows; once no prompt is left and half the rows or more are free, the live rows
              move to the first rows and decoding goes on at the smallest power of two that holds them (as
              static_decode compacts)

The one-token step has fixed shapes for a given row count: the input ids, RoPE positions, slot ranges and write
slots are per-row device tensors, so it is captured as one CUDA graph per row count (no graph per live length:
the attention kernel reads each row's own range, not a shared one). The same code runs on the CPU without graphs
and, for greedy decoding, writes the same tokens as `model.generate` (tests/pipeline/test_regen_continuous.py).
Targets: all-full-attention layers (a Gated-DeltaNet hybrid's rows would need their recurrent states reset and
prefilled per row: those decode with static_decode).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from pipeline.cuda_graphs import CudaGraphFn, relative_error, rounding_tolerance
from pipeline.log import get_logger
from pipeline.recurrent_cache import layer_types
from pipeline.regen.generator import Sampling, sample_next
from pipeline.regen.static_decode import STOP_CHECK_EVERY, attention_implementation, gqa_folded_sdpa, \
    prefill_chunk_inputs
from pipeline.regen.varlen_attention import varlen_decode_attention
from pipeline.target import compile_pointwise_modules, kv_head_shape, text_config, uncompile

log = get_logger("regen.continuous")

VARLEN = "drafter_varlen_decode"  # attention implementation name while decoding continuously
REFILL_SHARE = 16  # a check refills once 1/REFILL_SHARE of the rows (or every row still wanted) are free


def varlen_decode_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, slot_range=None,
                       **kwargs):
    """transformers attention function of the continuous decoder. A one-token step (`slot_range` = (start [B], end
    [B]) given): query [B, H, 1, D], key / value the layer's whole slot buffers [B, H_kv, L, D] -> ([B, 1, H, D],
    None), row b attending over slots start_b .. end_b-1 only, its query heads folded onto their KV head. A prefill
    (no `slot_range`) goes to `gqa_folded_sdpa` with its additive mask."""
    if slot_range is None:
        return gqa_folded_sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    b, h, _, d = query.shape
    hk = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    out = varlen_decode_attention(query.reshape(b, hk, h // hk, d), key, value, slot_range[0], slot_range[1], scale)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_decode_sdpa)
    try:  # the masks passed are 4-D; registering keeps transformers from dropping them
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(VARLEN, sdpa_mask)
    except ImportError:
        pass


def supports_continuous_decode(config) -> bool:
    """True iff every decoder layer is plain full attention (no sliding window, no recurrent layer)."""
    return set(layer_types(config)) == {"full_attention"} and not getattr(text_config(config), "use_sliding_window",
                                                                        False)


class RowSlots:
    """Per-attention-layer K/V buffers [B, H_kv, L, D] in which row b holds one sequence, and the two ways a forward
    writes them: a one-token step (`decode`: row b's token at slot end_b, the whole buffers returned for
    `varlen_decode_sdpa` to read each row's range) and a group's prefill chunk (`prefill`: rows `rows` at slots
    a..b-1, returned as gathered copies of those rows' first b slots for a plain masked attention)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], slot: dict[int, int], end: Tensor):
        self.keys, self.values, self.slot = keys, values, slot
        self.end = end  # [B] the write slot of a decode step
        self.rows: Tensor | int | None = None  # prefill: the rows written ([r] indices, or the first r)
        self.span = (0, 0)  # prefill: the chunk's slots
        self.is_compileable = True

    def decode(self) -> "RowSlots":
        self.rows = None
        return self

    def prefill(self, rows: Tensor | int, a: int, b: int) -> "RowSlots":
        """Write rows `rows` (indices [r], or r: the first r rows) at slots a..b-1 in the next forward."""
        self.rows, self.span = rows, (a, b)
        return self

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        j = self.slot[layer_idx]
        keys, values = self.keys[j], self.values[j]
        if self.rows is None:  # key_states [B, H_kv, 1, D]
            batch = torch.arange(keys.shape[0], device=keys.device)
            keys[batch, :, self.end] = key_states[:, :, 0]
            values[batch, :, self.end] = value_states[:, :, 0]
            return keys, values
        a, b = self.span  # key_states [r, H_kv, b-a, D]
        if isinstance(self.rows, int):  # the first r rows (a call's first fill): views, no gather
            r = self.rows
            keys[:r, :, a:b] = key_states
            values[:r, :, a:b] = value_states
            return keys[:r, :, :b], values[:r, :, :b]
        slots = torch.arange(a, b, device=keys.device)
        keys[self.rows[:, None], :, slots[None, :]] = key_states.transpose(1, 2)
        values[self.rows[:, None], :, slots[None, :]] = value_states.transpose(1, 2)
        return keys[:, :, :b].index_select(0, self.rows), values[:, :, :b].index_select(0, self.rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span[0] if self.rows is not None else 0

    def first_rows(self, size: int, end: Tensor) -> "RowSlots":
        return RowSlots([t[:size] for t in self.keys], [t[:size] for t in self.values], self.slot, end)


@dataclass
class _Rows:
    """Every per-row buffer of one row count (views of the first rows of the decoder's full-size buffers)."""

    slots: RowSlots
    ids: Tensor  # [B, 1] the step's input token
    pos: Tensor  # [B, 1] its RoPE position
    start: Tensor  # [B] int32, first slot of the row's sequence
    end: Tensor  # [B] int32, the slot the next step writes (the row's range is start .. end inclusive then)
    mask: Tensor  # [B, 1, 1, 1] a placeholder 4-D mask (the step's attention reads `start` / `end`)
    out: Tensor  # [B, T + 1] the answer so far (column T: where idle rows write)
    count: Tensor  # [B] tokens in `out`
    limit: Tensor  # [B] the answer's limit
    done: Tensor  # [B] bool: finished (or idle)
    steps: dict[str, CudaGraphFn] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def per_row(self) -> list[Tensor]:
        return [self.ids, self.pos, self.start, self.end, self.out, self.count, self.limit, self.done]


class ContinuousDecoder:
    """Generate for any number of prompts on `rows` sequence slots, refilled as answers end (module docstring).

    `compile_pointwise`: the decoder layers' norms and MLPs run torch.compile'd (`compile_pointwise_modules`) until
    `close()`. Prefill chunks: at most `prefill_chunk` positions and `prefill_tokens` rows x positions per forward
    (a group's mask and activations grow with rows x positions)."""

    def __init__(self, model, *, vocab_limit: int, stop_ids: Sequence[int], sampling: Sampling, rows: int,
                 cuda_graphs: bool = True, compile_pointwise: bool = False, prefill_chunk: int = 512,
                 prefill_tokens: int = 16384, check_every: int = STOP_CHECK_EVERY, min_compact_batch: int = 8,
                 refill_rows: int | None = None):
        if not supports_continuous_decode(model.config):
            raise ValueError("continuous decode runs all-full-attention targets only (no sliding window, no "
                             "recurrent layers): use static decode for this target")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_limit = vocab_limit
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device)
        self.sampling = sampling
        self.rows = rows
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.check_every = check_every
        self.min_compact_batch = min_compact_batch
        self.refill_rows = refill_rows or max(1, rows // REFILL_SHARE)
        _register_attention()
        self._root: _Rows | None = None
        self._views: dict[int, _Rows] = {}
        self.compiled = compile_pointwise_modules(model) if compile_pointwise else []
        # since construction: decode steps, rows x steps, tokens handed back, refill groups prefilled, and on CUDA
        # the GPU milliseconds of the prefills, of the decode steps' forwards and of their draws and bookkeeping
        # (CUDA events around each, read once per call, at its end: where a step's time goes, and how much of the
        # wall the GPU idles)
        self.stats = {"steps": 0, "row_steps": 0, "tokens": 0, "prefills": 0, "prefill_gpu_ms": 0.0,
                      "forward_gpu_ms": 0.0, "draw_gpu_ms": 0.0}
        self._events: dict[str, list] = {"prefill": [], "forward": [], "draw": []}

    def close(self) -> None:
        """Give the model back as it came: its compiled modules run eagerly again."""
        uncompile(self.compiled)
        self.compiled = []

    def on_graphs(self) -> bool:
        """True when the one-token step of every row count used so far replays a CUDA graph, checked against eager."""
        steps = [g for rows in self._views.values() for g in rows.steps.values()]
        return bool(steps) and not any(g.disabled for g in steps)

    # -- public --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], limits: Sequence[int], *, cache_len: int = 0,
                 generator: torch.Generator | None = None) -> list[list[int]]:
        """prompts: token id lists; limits: max new tokens per prompt (>= 1). Returns each prompt's generated stream,
        in input order, ending at its first stop id or its limit (`cut_at_stop` applies unchanged). `cache_len`: K/V
        slots per row at least (the stage's max_model_len, which holds every prompt + its answer: one state, and one
        set of graphs, for every call of the run)."""
        if not prompts:
            return []
        with torch.inference_mode(), attention_implementation(self.model, VARLEN):
            return self._generate(prompts, limits, cache_len, generator)

    def rows_to_run(self, n: int) -> int:
        """The rows `n` prompts decode on: all of them where `n` fills more than half, else the smallest power of two
        that holds `n` (not below `min_compact_batch`): the row counts compaction uses, whose graphs every call shares."""
        size = max(self.min_compact_batch, 1 << (n - 1).bit_length())
        return size if size <= self.rows // 2 else self.rows

    # -- the loop ------------------------------------------------------------------------------
    def _generate(self, prompts, limits, cache_len: int, generator) -> list[list[int]]:
        need = max(len(p) + lim for p, lim in zip(prompts, limits))  # (`_refill` keeps every group within it)
        root = self._prepare(max(need, cache_len), max(limits))
        rows = self._first_rows(self.rows_to_run(len(prompts)))
        rows.done.fill_(True)
        rows.start.zero_()
        rows.end.zero_()
        rows.count.zero_()
        queue = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))  # longest first
        occupant = [-1] * rows.size  # the prompt each row answers (-1: idle)
        results: list[list[int] | None] = [None] * len(prompts)
        self._refill(rows, list(range(min(rows.size, len(queue)))), queue, occupant, prompts, limits, generator)
        while True:
            for _ in range(self.check_every):
                self._decode_step(rows, generator)
            flags = torch.cat([rows.done.to(torch.int32), rows.end.max()[None]]).tolist()  # the host sync
            done, written = flags[:-1], flags[-1]
            finished = [b for b in range(rows.size) if done[b] and occupant[b] >= 0]
            self._harvest(rows, finished, occupant, results)
            free = [b for b in range(rows.size) if done[b]]
            if queue:
                if len(free) >= min(self.refill_rows, len(queue), rows.size):
                    self._refill(rows, free[: len(queue)], queue, occupant, prompts, limits, generator)
                continue
            alive = rows.size - len(free)
            if alive == 0:
                self._count_gpu_time()
                return results
            size = max(self.min_compact_batch, 1 << (alive - 1).bit_length())
            if size <= rows.size // 2:
                rows, occupant = self._compact(root, rows, [b for b in range(rows.size) if not done[b]], size,
                                               occupant, written)

    def _decode_step(self, rows: _Rows, generator) -> None:
        """One token for every row; live rows record it and advance, finished rows stay where they are."""
        mark = self._mark("forward")
        logits = self._step(rows)
        mark()
        mark = self._mark("draw")
        nxt = sample_next(logits, self.sampling, generator, self.vocab_limit)
        live = ~rows.done
        column = torch.where(live, rows.count, rows.out.shape[1] - 1)
        rows.out.scatter_(1, column[:, None], nxt[:, None])
        rows.count.add_(live)
        rows.done.logical_or_(torch.isin(nxt, self.stop_ids) | (rows.count >= rows.limit))
        rows.ids.copy_(nxt[:, None])
        rows.end.add_(live)
        rows.pos.add_(live[:, None])
        mark()
        self.stats["steps"] += 1
        self.stats["row_steps"] += rows.size

    def _harvest(self, rows: _Rows, finished: list[int], occupant: list[int], results: list) -> None:
        """Finished rows' answers to `results` (one read-back for all of them); the rows become idle."""
        if not finished:
            return
        idx = self._to_device(torch.tensor(finished))
        for b, (n, *tokens) in zip(finished, torch.cat([rows.count[idx, None], rows.out[idx]], 1).tolist()):
            results[occupant[b]] = tokens[:n]
            occupant[b] = -1
            self.stats["tokens"] += n

    def _refill(self, rows: _Rows, free: list[int], queue: deque, occupant: list[int], prompts, limits,
                generator) -> None:
        """The next prompts of `queue` (at most len(free)) into rows `free`: prefilled as one left-padded group of
        width w (its first, longest prompt) straight into those rows' slots 0..w-1, their first token drawn, their
        ranges and counts set. The group ends before a prompt whose answer would pass the rows' slots when padded
        to w (w + its limit > slots), so that no call needs more slots than its longest prompt + answer: a long
        prompt with little room left beside short ones with whole answers (their rows then wait for the next check)."""
        slots = rows.slots.keys[0].shape[2]
        group = [queue.popleft()]
        while queue and len(group) < len(free) and len(prompts[group[0]]) + limits[queue[0]] <= slots:
            group.append(queue.popleft())
        n = len(group)
        width = len(prompts[group[0]])  # (the queue is longest first)
        host_ids = torch.zeros(n, width, dtype=torch.long)
        for r, i in enumerate(group):
            host_ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
        lens = self._to_device(torch.tensor([len(prompts[i]) for i in group]))
        ids = self._to_device(host_ids)
        idx = self._to_device(torch.tensor(free[:n]))
        mark = self._mark("prefill")
        logits = self._prefill(rows, n if free[:n] == list(range(n)) else idx, ids, width - lens)
        mark()
        nxt = sample_next(logits, self.sampling, generator, self.vocab_limit)
        limit = self._to_device(torch.tensor([limits[i] for i in group]))
        rows.out[idx, 0] = nxt
        rows.count.index_fill_(0, idx, 1)  # (a scalar assigned by indexing is a synchronizing host copy)
        rows.limit[idx] = limit
        rows.done[idx] = torch.isin(nxt, self.stop_ids) | (limit <= 1)
        rows.ids[idx, 0] = nxt
        rows.pos[idx, 0] = lens
        rows.start[idx] = (width - lens).to(rows.start.dtype)
        rows.end.index_fill_(0, idx, width)
        for b, i in zip(free, group):
            occupant[b] = i
        self.stats["prefills"] += 1

    def _mark(self, part: str):
        """On CUDA: record an event now and return the function that records the part's end (CPU: a no-op)."""
        if self.device.type != "cuda":
            return lambda: None
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        self._events[part].append((begin, end))
        return end.record

    def _count_gpu_time(self) -> None:
        """Add the GPU time of this call's parts to `stats` (its last check has synchronized: no wait)."""
        for part, pairs in self._events.items():
            self.stats[f"{part}_gpu_ms"] += sum(a.elapsed_time(b) for a, b in pairs)
            pairs.clear()

    def _prefill(self, rows: _Rows, idx: Tensor | int, ids: Tensor, pad: Tensor) -> Tensor:
        """ids [r, w] left-padded (pad [r]) -> logits [r, V] at each row's last prompt slot; writes slots 0..w-1 of
        rows `idx` (or of the first r rows: views, no gather), in chunks of at most `prefill_chunk` positions and `prefill_tokens` rows x positions."""
        width = ids.shape[1]
        chunk = max(1, min(self.prefill_chunk, self.prefill_tokens // ids.shape[0]))
        logits = None
        for a in range(0, width, chunk):
            b = min(width, a + chunk)
            mask, pos, _ = prefill_chunk_inputs(a, b, b, pad, self.dtype)
            out = self.model(input_ids=ids[:, a:b], position_ids=pos, attention_mask=mask,
                             past_key_values=rows.slots.prefill(idx, a, b), use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        rows.slots.decode()
        return logits

    def _compact(self, root: _Rows, rows: _Rows, live: list[int], size: int, occupant: list[int],
                 written: int) -> tuple[_Rows, list[int]]:
        """The rows `live` (then copies of the first to fill `size`) moved to rows 0..size-1 of the same buffers
        (of the K/V buffers, slots 0..written-1: no row has written past them); returns the `size`-row view and the
        occupants in the new order. The copies are idle rows."""
        order = live + [live[0]] * (size - len(live))
        idx = torch.tensor(order, device=self.device)
        for buf in [*root.slots.keys, *root.slots.values]:
            buf[:size, :, :written].copy_(buf[:, :, :written][idx])  # (the gather copies before rows are overwritten)
        for full, view in zip(root.per_row(), rows.per_row()):
            full[:size].copy_(view[idx])
        small = self._first_rows(size)
        small.done[len(live):] = True
        return small, [occupant[b] for b in live] + [-1] * (size - len(live))

    # -- state -----------------------------------------------------------------------------------
    def _prepare(self, cache_len: int, answer: int) -> _Rows:
        """The full-size buffers for `rows` sequences of at least `cache_len` slots and answers of `answer` tokens:
        the ones in hand when they hold that much (their graphs serve every call of a run), else new ones."""
        root = self._root
        if root is not None and root.slots.keys[0].shape[2] >= cache_len and root.out.shape[1] > answer:
            return root
        self._root = self._views = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        n, dev = self.rows, self.device
        kv_heads, head_dim = kv_head_shape(self.model.config)
        layers = [i for i, t in enumerate(layer_types(self.model.config))]
        keys = [torch.zeros(n, kv_heads, cache_len, head_dim, dtype=self.dtype, device=dev) for _ in layers]
        values = [torch.zeros(n, kv_heads, cache_len, head_dim, dtype=self.dtype, device=dev) for _ in layers]
        end = torch.zeros(n, dtype=torch.int32, device=dev)
        self._root = _Rows(
            slots=RowSlots(keys, values, {i: j for j, i in enumerate(layers)}, end),
            ids=torch.zeros(n, 1, dtype=torch.long, device=dev), pos=torch.zeros(n, 1, dtype=torch.long, device=dev),
            start=torch.zeros(n, dtype=torch.int32, device=dev), end=end,
            mask=torch.zeros(n, 1, 1, 1, dtype=self.dtype, device=dev),
            out=torch.zeros(n, answer + 1, dtype=torch.long, device=dev),
            count=torch.zeros(n, dtype=torch.long, device=dev), limit=torch.ones(n, dtype=torch.long, device=dev),
            done=torch.ones(n, dtype=torch.bool, device=dev))
        self._views = {n: self._root}
        return self._root

    def _first_rows(self, size: int) -> _Rows:
        """The state over the first `size` rows (views), kept per size with its step graph."""
        if size not in self._views:
            root = self._root
            ids, pos, start, end, out, count, limit, done = (t[:size] for t in root.per_row())
            self._views[size] = _Rows(slots=root.slots.first_rows(size, end), ids=ids, pos=pos, start=start, end=end,
                                      mask=root.mask[:size], out=out, count=count, limit=limit, done=done)
        return self._views[size]

    def _to_device(self, host: Tensor) -> Tensor:
        """A host tensor on the decoder's device: from pinned memory, asynchronously, on CUDA."""
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def _forward_step(self, rows: _Rows) -> Tensor:
        out = self.model(input_ids=rows.ids, position_ids=rows.pos, attention_mask=rows.mask,
                         past_key_values=rows.slots.decode(), use_cache=True, slot_range=(rows.start, rows.end + 1))
        return out.logits[:, -1, :]

    def _step(self, rows: _Rows) -> Tensor:
        """logits [B, V] of every row's input token (a CUDA graph per row count when graphs are on; the step
        rewrites the same K/V slot on every run, so the capture's extra runs change nothing)."""
        if not self.use_graphs:
            return self._forward_step(rows)
        if "step" not in rows.steps:
            rows.steps["step"] = CudaGraphFn(
                functools.partial(self._forward_step, rows), f"regen continuous decode step ({rows.size} rows)",
                check=lambda g, e: relative_error(g, e) <= rounding_tolerance(self.dtype))
        return rows.steps["step"]()
