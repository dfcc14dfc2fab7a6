"""The `hf` extraction backend: transformers forward up to the deepest tapped layer, straight into shards.

Per unit (one shard) the samples arrive sorted by length, longest first.  They are cut into batches
whose padded size ``B * S_max`` fits ``extract.tokens_per_batch``; each batch is right-padded with no
attention mask (pads follow the real tokens, so a causal model — attention or Gated DeltaNet — computes
the real tokens exactly as it would unbatched), run through `extract.layers.forward_taps` (no later
layers, no final norm, no LM head; on CUDA by default as a loop of torch.compiled decoder layers, see
`compiled_forward`: fused RMSNorm/RoPE/SiLU, one graph for all layers and batch shapes; a target the loop does not
rebuild, such as a Gated-DeltaNet hybrid, runs its own forward with its norms and MLPs compiled), gathered to the
real tokens ``[T, n*D]`` on the device, encoded to
the storage dtype on the device (fp8 halves the copy too) and handed to `DiskSink`:

    GPU compute stream ──► copy stream: D2H into a pinned staging buffer ──► writer threads: pwrite
                                                                        └──► hash thread: sha256 in order

The GPU never waits for the disk unless every staging buffer is still being written (back-pressure).
Each pwrite also starts the kernel's writeback of its bytes (`extract.store.start_writeback`), so the
disk is busy from the first batch instead of idling until the dirty-page threshold or the shard's fsync.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from extract.layers import call_decoder_layer, forward_taps, forward_taps_loop, plain_decoder_refusal
from extract.store import STORAGE_DTYPES, ShardWriter, encode_features
from pipeline.config import ExtractConfig, TargetConfig
from pipeline.log import get_logger
from pipeline.target import bind_whole_sequence_gated_delta, compile_pointwise_modules, gated_delta_kernels, \
    load_target, resolve_device, resolve_dtype, text_config, uncompile, whole_sequence_gated_delta_layers

log = get_logger("extract.hf")

WRITE_CHUNK_BYTES = 64 << 20  # one pwrite job; several run in parallel on the writer threads
COMPILE_PROBES = ((2, 64), (1, 48))  # (B, S) of the probe batches: one graph for B >= 2, one for B == 1
LOOP_MAX_ERROR = 1e-3  # eager layer loop vs forward_taps (the same kernels: expected 0)
# compiled vs eager: bf16 rounding through fused kernels, summed over every layer: a few percent on real weights
# (docs/benchmarks.md, "quality", run 1); a wrong graph gives more: a layer step without its residual ~1, one 5 %
# off ~0.2 (tests/extract/test_hf.py).
COMPILED_MAX_ERROR = 0.1


def plan_batches(lengths: Sequence[int], tokens_per_batch: int, overhead_tokens: int | None = None) -> list[tuple[int, int]]:
    """Cut samples sorted longest-first into contiguous ``[start, end)`` batches with ``count * longest <= budget``.

    Minimizes the padded tokens computed plus ``overhead_tokens`` per batch (the fixed cost of one forward;
    default ``budget // 64``), by dynamic programming: a long sample does not drag a run of much shorter
    ones into a half-empty batch, and short samples still fill the budget.  A sample longer than the
    budget forms a batch of its own.
    """
    L = np.asarray([int(x) for x in lengths], dtype=np.int64)
    if (L[1:] > L[:-1]).any():
        raise ValueError("plan_batches needs lengths sorted longest first")
    n = len(L)
    c0 = max(1, tokens_per_batch // 64) if overhead_tokens is None else overhead_tokens
    best = np.zeros(n + 1, dtype=np.float64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):  # best[j]: cheapest plan for samples [0, j); last batch [i, j) padded to L[i]
        lo = max(0, j - max(1, tokens_per_batch // int(L[j - 1])))
        i = np.arange(lo, j)
        cost = best[i] + (j - i) * L[i] + c0
        cost[(j - i) * L[i] > tokens_per_batch] = np.inf
        cost[-1] = best[j - 1] + L[j - 1] + c0  # a batch of one is always allowed
        k = int(np.argmin(cost))
        best[j], cut[j] = cost[k], lo + k
    out, j = [], n
    while j > 0:
        out.append((int(cut[j]), j))
        j = int(cut[j])
    return out[::-1]


# ----------------------------------------------------------------------------------------------
# Compiled decoder layers
# ----------------------------------------------------------------------------------------------

_COMPILED: dict = {}


def compiled_layer_call():
    """``layer_call(layer, hidden [B,S,D], cos, sin)`` for `forward_taps_loop`: `call_decoder_layer` under torch.compile.

    Every decoder layer runs the same code on the same shapes with its own parameters (graph inputs), so
    one compiled graph serves all of them.  B and S are marked dynamic (D stays static, so the fused
    RMSNorm/RoPE/SiLU kernels keep a fixed row width): one graph for every batch shape with B >= 2 and
    one for B == 1 (dynamo specializes size 1).  One wrapper per process: dynamo caches compiled code
    on the function's code object, guarded by the wrapper's backend.
    """
    if "fn" not in _COMPILED:
        compiled = torch.compile(call_decoder_layer, dynamic=None)

        def layer_call(layer, hidden, cos, sin):
            B, S = hidden.shape[:2]
            if B > 1:
                torch._dynamo.mark_dynamic(hidden, 0)
            if S > 1:
                for t in (hidden, cos, sin):
                    torch._dynamo.mark_dynamic(t, 1)
            return compiled(layer, hidden, cos, sin)

        _COMPILED["fn"] = layer_call
    return _COMPILED["fn"]


def _max_relative_error(got: torch.Tensor, ref: torch.Tensor, num_taps: int) -> float:
    """Largest per-tap relative L2 error ``||got - ref|| / ||ref||`` of two ``[B, S, n*D]`` feature tensors."""
    g = got.float().reshape(-1, num_taps, got.shape[-1] // num_taps)
    r = ref.float().reshape(-1, num_taps, ref.shape[-1] // num_taps)
    return float(((g - r).norm(dim=(0, 2)) / r.norm(dim=(0, 2)).clamp_min(1e-30)).max())


def compiled_forward(model, layer_ids: Sequence[int], setting: str, device: torch.device):
    """``fn(model, input_ids, layer_ids) -> [B, S, n*D]``: the compiled layer loop, or `forward_taps` (eager).

    ``setting`` is `extract.compile`: "auto" compiles on CUDA only, "on" everywhere, "off" never.  The
    compiled loop is used only after it reproduced `forward_taps` on probe batches (which also compiles
    both graphs up front, outside any timed or resumable work); with "auto" any refusal, compile error or
    disagreement falls back to eager with a warning, with "on" it is an error.
    """
    import time

    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return forward_taps
    if setting not in ("auto", "on"):
        raise ValueError(f"extract.compile must be 'auto', 'on' or 'off', got {setting!r}")
    n = len(layer_ids)
    reason = plain_decoder_refusal(model, layer_ids)
    if reason is not None:
        return _pointwise_compiled_forward(model, layer_ids, setting, device, reason)
    try:
        layer_call = compiled_layer_call()
        vocab = text_config(model.config).vocab_size
        gen = torch.Generator().manual_seed(0)
        started = time.perf_counter()
        for B, S in COMPILE_PROBES:
            ids = torch.randint(0, vocab, (B, S), generator=gen).to(device)
            ref = forward_taps(model, ids, layer_ids)
            err = _max_relative_error(forward_taps_loop(model, ids, layer_ids), ref, n)
            if err > LOOP_MAX_ERROR:
                raise RuntimeError(f"the layer loop differs from the model's forward (relative error {err:.2e})")
            err = _max_relative_error(forward_taps_loop(model, ids, layer_ids, layer_call), ref, n)
            if err > COMPILED_MAX_ERROR:
                raise RuntimeError(f"compiled layers differ from eager (relative error {err:.2e} > {COMPILED_MAX_ERROR})")
    except Exception as e:  # noqa: BLE001 — any failure of the optional fast path
        if setting == "on":
            raise RuntimeError(f"extract.compile=on: cannot compile the decoder layers: {e}") from e
        log.warning("extract.compile: running the eager forward (%s: %s)", type(e).__name__, e)
        return forward_taps
    log.info("extract.compile: decoder layers compiled and checked against eager in %.1f s (relative error %.2e)",
             time.perf_counter() - started, err)
    return lambda m, ids, taps: forward_taps_loop(m, ids, taps, layer_call)


_POINTWISE_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its check's error


def _pointwise_compiled_forward(model, layer_ids: Sequence[int], setting: str, device: torch.device, reason: str):
    """`forward_taps` with the decoder layers' norms and MLPs compiled (`compile_pointwise_modules`), for targets the
    layer loop does not rebuild (`reason`: hybrids, sliding windows), and on a GPU with fla-core a hybrid's
    Gated-DeltaNet layers on their whole-sequence forward (`bind_whole_sequence_gated_delta`); checked against
    transformers' eager forward on the probe batches first, undone on any failure (eager, with a warning; an error
    with "on"). A model an earlier call set up and checked, still in that state, is not checked again: its
    "eager" reference would be the fast forward itself."""
    import time

    earlier = _POINTWISE_CHECKED.get(model)
    if earlier is not None and _on_fast_forward(model):
        log.info("extract.compile: the layer loop does not cover this target (%s); its norms and MLPs are compiled "
                 "and checked against eager already (relative error %.2e)", reason, earlier)
        return forward_taps
    n, started, modules, bound = len(layer_ids), time.perf_counter(), [], []
    try:
        vocab = text_config(model.config).vocab_size
        gen = torch.Generator().manual_seed(0)
        probes = [torch.randint(0, vocab, (B, S), generator=gen).to(device) for B, S in COMPILE_PROBES]
        refs = [forward_taps(model, ids, layer_ids) for ids in probes]
        if device.type == "cuda" and gated_delta_kernels(model) == "fla":
            bound = bind_whole_sequence_gated_delta(model)
        modules = compile_pointwise_modules(model)
        err = max(_max_relative_error(forward_taps(model, ids, layer_ids), ref, n) for ids, ref in zip(probes, refs))
        if err > COMPILED_MAX_ERROR:
            raise RuntimeError(f"compiled norms and MLPs differ from eager (relative error {err:.2e} > "
                               f"{COMPILED_MAX_ERROR})")
    except Exception as e:  # noqa: BLE001 — any failure of the optional fast path
        uncompile(modules)
        for item in bound:
            item.undo()
        if setting == "on":
            raise RuntimeError(f"extract.compile=on: the layer loop does not cover this target ({reason}) and its "
                               f"norms and MLPs could not be compiled: {e}") from e
        log.warning("extract.compile: running the eager forward (%s; compiling its norms and MLPs failed: %s: %s)",
                    reason, type(e).__name__, e)
        return forward_taps
    fast = whole_sequence_gated_delta_layers(model)
    _POINTWISE_CHECKED[model] = err
    log.info("extract.compile: the layer loop does not cover this target (%s); its %d norms and MLPs are compiled "
             "instead%s, checked against eager in %.1f s (relative error %.2e)", reason, len(modules),
             f" and its {fast} Gated-DeltaNet layers run their whole-sequence forward on fla" if fast else "",
             time.perf_counter() - started, err)
    return forward_taps


def _on_fast_forward(model) -> bool:
    """Whether any of `model`'s modules runs compiled or a Gated-DeltaNet layer its whole-sequence forward."""
    return bool(whole_sequence_gated_delta_layers(model)) or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


# ----------------------------------------------------------------------------------------------
# Device -> disk
# ----------------------------------------------------------------------------------------------


@dataclass
class _Job:
    writer: ShardWriter
    token_start: int
    data: torch.Tensor  # CPU bytes (uint8) of the encoded features, token-major
    scales: torch.Tensor | None  # CPU float32 [T, n] (fp8)
    event: object  # torch.cuda.Event or None
    buffer: object  # staging buffer to give back, or None
    remaining: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class DiskSink:
    """Moves encoded feature batches from the device into shard files without stalling the device.

    ``submit`` queues an async D2H copy (CUDA) into one of ``staging_buffers`` pinned buffers (all pinned
    up front) and returns.
    A dispatcher thread waits for each copy (in submission order) and fans the bytes out to the writer
    threads (parallel ``pwrite`` chunks) and to the shard's own hash thread, which feeds them in token
    order to the shard's streaming sha256 — so shards written at the same time are hashed in parallel.
    A buffer is reused once its bytes are written and hashed.  On CPU the encoded tensors are written
    directly (no staging), with at most ``staging_buffers`` batches in flight.
    """

    def __init__(self, device: torch.device, *, writer_threads: int = 4, staging_buffers: int = 3,
                 buffer_bytes: int = 0, scale_bytes: int = 0):
        from concurrent.futures import ThreadPoolExecutor

        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = ThreadPoolExecutor(max_workers=max(1, writer_threads), thread_name_prefix="extract-write")
        self.copies: queue.Queue = queue.Queue()
        self.lanes: dict[int, tuple[queue.Queue, threading.Thread]] = {}  # id(writer) -> its hash thread
        self.free: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(max(1, staging_buffers))
        self.num_buffers = max(1, staging_buffers)
        self.allocated = 0
        self.buffer_bytes, self.scale_bytes = buffer_bytes, scale_bytes  # staging size: one full batch
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, int] = {}  # id(writer) -> jobs not finished
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        if self.cuda and buffer_bytes > 0:  # pin them all now: pinning GBs mid-run would stall the device
            for _ in range(self.num_buffers):
                self.free.put(self._alloc(buffer_bytes, scale_bytes))
            self.allocated = self.num_buffers
        self.dispatcher = threading.Thread(target=self._dispatch_loop, name="extract-dispatch", daemon=True)
        self.dispatcher.start()

    # -- main thread -----------------------------------------------------------------------------
    def _staging(self, data_bytes: int, scale_bytes: int):
        """A free pinned buffer big enough, allocating up to ``num_buffers`` (grown when too small)."""
        if self.allocated < self.num_buffers and self.free.empty():
            self.allocated += 1
            return self._alloc(max(data_bytes, self.buffer_bytes), max(scale_bytes, self.scale_bytes))
        while True:  # back-pressure: wait while every buffer is still being written
            try:
                buf = self.free.get(timeout=1.0)
                break
            except queue.Empty:
                self._raise_if_failed()
        if buf[0].numel() < data_bytes or 4 * buf[1].numel() < scale_bytes:
            return self._alloc(data_bytes, scale_bytes)  # a sample longer than the budget: the old one is dropped
        return buf

    @staticmethod
    def _alloc(data_bytes: int, scale_bytes: int):
        return (torch.empty(data_bytes, dtype=torch.uint8, pin_memory=True),
                torch.empty(max(scale_bytes, 4) // 4, dtype=torch.float32, pin_memory=True))

    def submit(self, writer: ShardWriter, token_start: int, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Queue ``data [T, n, D]`` (storage dtype, on the device) for tokens ``token_start..`` of ``writer``."""
        self._raise_if_failed()
        raw = data.reshape(-1).view(torch.uint8)
        if self.cuda:
            buf = self._staging(raw.numel(), 0 if scales is None else scales.numel() * 4)
            host = buf[0][: raw.numel()]
            host_scales = None if scales is None else buf[1][: scales.numel()].view(scales.shape)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host.copy_(raw, non_blocking=True)
                if scales is not None:
                    host_scales.copy_(scales, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            raw.record_stream(self.copy_stream)
            if scales is not None:
                scales.record_stream(self.copy_stream)
        else:
            while not self.slots.acquire(timeout=1.0):
                self._raise_if_failed()
            buf, host, host_scales, event = None, raw, scales, None
        job = _Job(writer, token_start, host, host_scales, event, buf)
        with self.cond:
            self.pending[id(writer)] = self.pending.get(id(writer), 0) + 1
            if id(writer) not in self.lanes:
                q: queue.Queue = queue.Queue()
                t = threading.Thread(target=self._hash_loop, args=(q,), name="extract-hash", daemon=True)
                t.start()
                self.lanes[id(writer)] = (q, t)
        self.copies.put(job)

    def drain(self, writer: ShardWriter) -> None:
        """Block until every submitted batch of ``writer`` is written and hashed; ends its hash thread."""
        with self.cond:
            while self.pending.get(id(writer), 0) and self.error is None:
                self.cond.wait(timeout=1.0)
            self.pending.pop(id(writer), None)
            lane = self.lanes.pop(id(writer), None)
        if lane is not None:
            lane[0].put(None)
            lane[1].join()
        self._raise_if_failed()

    def close(self) -> None:
        self.copies.put(None)
        self.dispatcher.join()
        for q, t in list(self.lanes.values()):
            q.put(None)
            t.join()
        self.pool.shutdown(wait=True)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError("writing features failed") from self.error

    # -- background threads ----------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """In submission order: wait for the copy, fan the bytes out to the writers and the shard's hasher."""
        while (job := self.copies.get()) is not None:
            try:
                if job.event is not None:
                    job.event.synchronize()
                L = job.writer.layout
                if job.scales is not None:
                    job.writer.set_scales(job.token_start, job.scales)
                raw = job.data.numpy()
                start = L.features_offset(job.token_start)
                chunks = [(a, min(a + WRITE_CHUNK_BYTES, raw.nbytes)) for a in range(0, raw.nbytes, WRITE_CHUNK_BYTES)]
                job.remaining = len(chunks) + 1
                for a, b in chunks:
                    self.pool.submit(self._write, job, raw[a:b], start + a)
                with self.cond:
                    lane = self.lanes[id(job.writer)][0]
                lane.put((job, raw))
            except BaseException as e:  # noqa: BLE001 — surfaced in the main thread
                self._fail(e)

    def _hash_loop(self, lane: queue.Queue) -> None:
        """One shard's bytes, in token order, into its streaming sha256."""
        while (item := lane.get()) is not None:
            job, raw = item
            try:
                job.writer.hash_features(raw)
                self._part_done(job)
            except BaseException as e:  # noqa: BLE001
                self._fail(e)

    def _write(self, job: _Job, raw: np.ndarray, offset: int) -> None:
        try:
            job.writer.pwrite(offset, raw)
            self._part_done(job)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)

    def _part_done(self, job: _Job) -> None:
        with job.lock:
            job.remaining -= 1
            last = job.remaining == 0
        if not last:
            return
        if job.buffer is not None:
            self.free.put(job.buffer)
        else:
            self.slots.release()
        with self.cond:
            self.pending[id(job.writer)] -= 1
            self.cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            self.error = self.error or e
            self.cond.notify_all()


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


class HFExtractor:
    """Loads the target once; ``extract_unit`` fills one shard writer with the features of its samples."""

    streams_hash = True  # ShardWriter(stream_hash=True): the sha256 comes from the bytes in flight

    def __init__(self, location: str, tcfg: TargetConfig, ecfg: ExtractConfig, layer_ids: Sequence[int], *,
                 model=None, device: torch.device | None = None):
        self.device = device or resolve_device(tcfg.device)
        self.dtype = resolve_dtype(tcfg.dtype, self.device)
        self.model = model if model is not None else load_target(location, tcfg, device=self.device, dtype=self.dtype)
        self.layer_ids = list(layer_ids)
        self.ecfg = ecfg
        self.forward = compiled_forward(self.model, self.layer_ids, ecfg.compile, self.device)
        n, D = len(self.layer_ids), text_config(self.model.config).hidden_size
        row = n * D * STORAGE_DTYPES[ecfg.storage_dtype][2]
        self.sink = DiskSink(self.device, writer_threads=ecfg.writer_threads, staging_buffers=ecfg.staging_buffers,
                             buffer_bytes=ecfg.tokens_per_batch * row,
                             scale_bytes=ecfg.tokens_per_batch * n * 4 if ecfg.storage_dtype == "fp8" else 0)
        self.tokens_done = 0

    def features(self, input_ids: Sequence[np.ndarray]) -> torch.Tensor:
        """Packed features ``[sum(S_i), n*D]`` (compute dtype, on the device) of a batch of samples."""
        lengths = [len(x) for x in input_ids]
        B, S = len(lengths), max(lengths)
        host = torch.zeros(B, S, dtype=torch.long, pin_memory=self.device.type == "cuda")
        for b, ids in enumerate(input_ids):
            host[b, : lengths[b]] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        feats = self.forward(self.model, host.to(self.device, non_blocking=True), self.layer_ids)
        flat = feats.reshape(B * S, -1)
        if all(n == S for n in lengths):
            return flat
        index = np.concatenate([b * S + np.arange(n) for b, n in enumerate(lengths)])
        idx = torch.from_numpy(index)
        if self.device.type == "cuda":
            idx = idx.pin_memory()
        return flat.index_select(0, idx.to(self.device, non_blocking=True))

    def extract_unit(self, writer: ShardWriter, input_ids: Sequence[np.ndarray], progress=None) -> None:
        """Queue the features of ``input_ids`` (the writer's samples, in its order: longest first) for writing.

        Returns once every batch is computed and queued; ``wait(writer)`` blocks until the bytes are written,
        so the stage can finish one shard in the background while the device computes the next."""
        self.extract_units([(writer, input_ids)], progress)

    def extract_units(self, work: Sequence[tuple[ShardWriter, Sequence[np.ndarray]]], progress=None) -> None:
        """Like `extract_unit` for several shards at once, alternating their batches, so that each shard's
        sha256 runs on its own thread in parallel (one hash thread per shard is the other ceiling)."""
        plans = [[(writer, ids, a, b) for a, b in plan_batches([len(x) for x in ids], self.ecfg.tokens_per_batch)]
                 for writer, ids in work]
        for k in range(max((len(p) for p in plans), default=0)):
            for plan in plans:
                if k >= len(plan):
                    continue
                writer, ids, a, b = plan[k]
                L = writer.layout
                packed = self.features(ids[a:b])
                data, scales = encode_features(packed, L.num_taps, L.storage_dtype)
                self.sink.submit(writer, int(writer.sample_offsets[a]), data, scales)
                n = int(writer.sample_offsets[b] - writer.sample_offsets[a])
                self.tokens_done += n
                if progress is not None:
                    progress.update(n)

    def wait(self, writer: ShardWriter) -> None:
        """Block until every queued batch of ``writer`` is written (and hashed)."""
        self.sink.drain(writer)

    def close(self) -> None:
        self.sink.close()


__all__ = ["HFExtractor", "DiskSink", "plan_batches"]
