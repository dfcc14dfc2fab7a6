"""A vLLM KV connector that writes extracted hidden states straight into this project's feature shards.

vLLM's ``extract_hidden_states`` speculative method caches the aux hidden states of every prompt token
in a paged "KV cache" ``[blocks, n_taps, block_size, D]``; the stock ``ExampleHiddenStatesConnector``
then writes one safetensors file per request (CUDA streams + pinned memory: it dies on CPU).

``ShardHiddenStatesConnector`` keeps vLLM's extraction and replaces the output side:

* each request carries, in ``SamplingParams.extra_args["kv_transfer_params"]``, where its tokens go:
  ``extract_shard`` (the shard's temp file, pre-sized by `extract.store.ShardWriter`),
  ``features_offset`` / ``scales_offset`` (absolute byte offsets from `ShardLayout`), ``storage_dtype``,
  ``num_taps``, ``num_tokens``;
* when the request finishes, the worker gathers its slots ``[T, n, D]``, encodes them to the storage
  dtype on the device (`extract.store.encode_features`: bf16 / fp32 / fp8 + scales), copies them to
  the host (CUDA: async on a side stream into pinned memory; CPU: directly), and ``pwrite``s them at
  the offsets — no per-request files, no second copy;
* after the write it appends a receipt line (offset, token count, sha256 of the token ids) to
  ``<extract_shard>.receipts``; the stage waits for one receipt per sample and checks the token ids
  before it fsyncs and renames the shard.

Works in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and in a separate worker process, on CPU and
GPU.  Only TP rank 0 writes.  Load with::

    kv_transfer_config={"kv_connector": "ShardHiddenStatesConnector",
                        "kv_connector_module_path": "extract.vllm_connector", "kv_role": "kv_producer"}
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, ExampleHiddenStatesConnectorMetadata, PendingSave, extract_from_kv_cache,
)
from vllm.logger import init_logger

try:
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
except ImportError:  # older vLLM: no sync checker
    from contextlib import nullcontext as gpu_sync_allowed

from extract.store import as_bytes, encode_features, pwrite_all

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

DESTINATION_KEYS = ("extract_shard", "features_offset", "scales_offset", "storage_dtype", "num_taps", "num_tokens")


def token_ids_sha(token_ids) -> str:
    """sha256 of token ids as int32 bytes: the receipt's proof of which tokens were extracted."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int32).tobytes()).hexdigest()[:16]


def read_receipts(shard_path: str) -> list[dict]:
    """The receipt lines written so far for one shard (a torn last line is ignored)."""
    path = str(shard_path) + ".receipts"
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


@dataclass
class ShardPendingSave(PendingSave):
    destination: dict | None = None


class _Done:
    """Stands in for a CUDA event when the copy was synchronous (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ShardHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Hidden states of each finished request -> its token range of a feature shard (see module doc)."""

    # -- scheduler side ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput"):
        meta = ExampleHiddenStatesConnectorMetadata()
        meta.pending_saves = list(self._pending_saves.values())
        self._pending_saves.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            params = (new_req.sampling_params.extra_args or {}).get("kv_transfer_params") if new_req.sampling_params else None
            params = params or {}
            missing = [k for k in DESTINATION_KEYS if k not in params]
            if missing:
                raise ValueError(f"request {new_req.req_id}: kv_transfer_params lacks {missing} "
                                 "(ShardHiddenStatesConnector needs a shard destination per request)")
            self._request_filenames[new_req.req_id] = json.dumps({k: params[k] for k in DESTINATION_KEYS})
        return meta  # no lock files: completion is signalled by receipts

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        encoded = self._request_filenames.pop(req_id, None)
        if encoded is None:  # aborted before it was scheduled
            self._pending_saves.pop(req_id, None)
            return False, None
        dest = json.loads(encoded)
        token_ids = torch.tensor(request.prompt_token_ids or [], dtype=torch.long)
        self._pending_saves[req_id] = ShardPendingSave(req_id=req_id, filename=dest["extract_shard"],
                                                       token_ids=token_ids, block_ids=list(block_ids),
                                                       destination=dest)
        return True, {"extract_shard": dest["extract_shard"], "features_offset": dest["features_offset"]}

    # -- worker side ---------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        pass  # no lock files to pre-create

    def _submit_async_write(self, pending: ShardPendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        dest = pending.destination
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None, :] + blocks[:, None] * self._block_size).flatten()
        T = int(pending.token_ids.shape[0])
        cache = self._kv_cache
        if cache.is_cuda:
            copy_stream = self._get_copy_stream()
            ready = torch.cuda.Event()
            ready.record()
            copy_stream.wait_event(ready)
            with torch.cuda.stream(copy_stream), gpu_sync_allowed():  # as the stock connector: a small H2D
                hs = extract_from_kv_cache(cache, slots.to(cache.device, non_blocking=True), T)  # [T, n, D]
                data, scales = encode_features(hs.reshape(T, -1), dest["num_taps"], dest["storage_dtype"])
                host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                host.copy_(data, non_blocking=True)
                host_scales = None
                if scales is not None:
                    host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
                    host_scales.copy_(scales, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copy_stream)
        else:
            hs = extract_from_kv_cache(cache, slots, T)
            host, host_scales = encode_features(hs.reshape(T, -1), dest["num_taps"], dest["storage_dtype"])
            done = _Done()
        future = self._executor.submit(self._write_to_shard, host, host_scales, done, dest,
                                       token_ids_sha(pending.token_ids.numpy()), T)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, r=pending.req_id: self._on_write_done(r, f))

    @staticmethod
    def _write_to_shard(data: torch.Tensor, scales: torch.Tensor | None, done, dest: dict, ids_sha: str, T: int) -> None:
        """Thread: wait for the copy, pwrite features (+ scales), then append the receipt."""
        done.synchronize()
        if T == dest["num_tokens"]:  # a different count would spill into the next sample: receipt only
            fd = os.open(dest["extract_shard"], os.O_WRONLY)
            try:
                pwrite_all(fd, as_bytes(data), dest["features_offset"])
                if scales is not None:
                    pwrite_all(fd, as_bytes(scales.float()), dest["scales_offset"])
            finally:
                os.close(fd)
        receipt = json.dumps({"features_offset": dest["features_offset"], "num_tokens": T,
                              "expected_tokens": dest["num_tokens"], "token_ids_sha": ids_sha}) + "\n"
        rfd = os.open(dest["extract_shard"] + ".receipts", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(rfd, receipt.encode())  # one small O_APPEND write: never interleaved with another
        finally:
            os.close(rfd)
