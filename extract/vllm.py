"""The `vllm` extraction backend (production): vLLM's native ``extract_hidden_states`` + our shard connector.

The engine is built once with
  * ``speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": to_vllm_aux_ids(layer_ids)}}}``
    (the +1 translation lives in `extract.layers`);
  * ``kv_transfer_config`` -> `extract.vllm_connector.ShardHiddenStatesConnector`, which writes every
    finished request's states into its token range of the shard being written;
  * chunked prefill and prefix caching OFF (with prefix caching the dumps come out short; chunked prefill
    is not supported by the method).

Per unit, every sample is one request (prompt = its token ids, ``max_tokens=1``) carrying its byte
offsets; vLLM schedules them with continuous batching.  When ``generate`` returns, the stage waits for
one receipt per sample (the last disk writes may still be in flight), checks each receipt's token-id
hash against the tokenized sample, and only then closes (fsync) and renames the shard.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from extract.layers import to_vllm_aux_ids
from extract.store import ShardWriter
from extract.vllm_connector import read_receipts, token_ids_sha
from pipeline.config import ExtractConfig, TargetConfig
from pipeline.log import get_logger
from pipeline.errors import StageError
from pipeline.target import check_vllm, vllm_engine_kwargs

log = get_logger("extract.vllm")

RECEIPT_TIMEOUT_S = 600.0


def engine_kwargs(location: str, tcfg: TargetConfig, ecfg: ExtractConfig, layer_ids: Sequence[int], max_len: int,
                  config=None) -> dict:
    """Keyword arguments of ``vllm.LLM`` for extraction (exposed for tests and for a vLLM server launch): the
    target's engine arguments (`pipeline.target.vllm_engine_kwargs`) plus the extraction method and connector."""
    max_model_len = int(max_len) + 1  # the prompt + the one sampled token
    kwargs = vllm_engine_kwargs(location, tcfg, ecfg.vllm, max_model_len=max_model_len, seed=tcfg.seed,
                                config=config)
    return dict(
        kwargs,
        max_num_batched_tokens=max(ecfg.tokens_per_batch, max_model_len),
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": to_vllm_aux_ids(layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": "ShardHiddenStatesConnector",
            "kv_connector_module_path": "extract.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"num_writer_threads": ecfg.writer_threads},
        },
    )


class VLLMExtractor:
    """One vLLM engine; ``extract_unit`` fills one shard writer through the connector."""

    streams_hash = False  # the bytes are written by the engine's worker: the stage hashes the file

    def __init__(self, location: str, tcfg: TargetConfig, ecfg: ExtractConfig, layer_ids: Sequence[int], *,
                 max_len: int = 4096):
        check_vllm("extract.backend")
        from vllm import LLM

        self.layer_ids = list(layer_ids)
        self.kwargs = engine_kwargs(location, tcfg, ecfg, self.layer_ids, max_len)
        self.max_len = max_len
        self.llm = LLM(**self.kwargs)

    def extract_unit(self, writer: ShardWriter, input_ids: Sequence[np.ndarray], progress=None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        L = writer.layout
        path = str(writer.path)
        prompts, params, expected = [], [], {}
        for i, ids in enumerate(input_ids):
            if len(ids) > self.max_len:
                raise StageError(f"sample of {len(ids)} tokens exceeds the engine's max_len {self.max_len}")
            start = int(writer.sample_offsets[i])
            dest = {"extract_shard": path, "features_offset": L.features_offset(start),
                    "scales_offset": L.scales_offset(start) if L.storage_dtype == "fp8" else -1,
                    "storage_dtype": L.storage_dtype, "num_taps": L.num_taps, "num_tokens": len(ids)}
            prompts.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids]))
            params.append(SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": dest}))
            expected[dest["features_offset"]] = (len(ids), token_ids_sha(ids))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for out, ids in zip(outputs, input_ids):
            if list(out.prompt_token_ids) != [int(t) for t in ids]:
                raise StageError("vLLM changed a prompt's token ids (tokenizer round trip?): refusing the shard")
        self._await_receipts(path, expected, pump=self._pump_engine)
        os.unlink(path + ".receipts")
        if progress is not None:
            progress.update(int(writer.num_tokens))

    def wait(self, writer: ShardWriter) -> None:
        """Nothing left in flight: ``extract_unit`` returns after every receipt arrived."""

    def _pump_engine(self) -> None:
        """Step an in-process engine core once more: the last finished requests' states are handed to the
        connector one step after they finish, and ``generate`` stops stepping as soon as outputs are out.
        (A separate engine process keeps stepping on its own while the connector holds blocks.)"""
        from vllm.v1.engine.core_client import InprocClient

        core = self.llm.llm_engine.engine_core
        if isinstance(core, InprocClient):
            core.get_output()

    @staticmethod
    def _await_receipts(path: str, expected: dict[int, tuple[int, str]], pump=None) -> None:
        """Wait until every sample's write is confirmed; check token counts and token-id hashes."""
        deadline = time.time() + RECEIPT_TIMEOUT_S
        while True:
            receipts = read_receipts(path)
            got = {r["features_offset"]: r for r in receipts}
            if len(receipts) != len(got):
                raise StageError(f"{path}: a sample was written twice by the engine")
            for off, r in got.items():
                if off not in expected:
                    raise StageError(f"{path}: receipt for an unknown offset {off}")
                n, sha = expected[off]
                if r["num_tokens"] != n or r["token_ids_sha"] != sha:
                    raise StageError(f"{path}: the engine extracted {r['num_tokens']} tokens (hash {r['token_ids_sha']}) "
                                     f"where the sample has {n} (hash {sha}); prefix caching or chunked prefill on?")
            if len(got) == len(expected):
                return
            if time.time() > deadline:
                raise StageError(f"{path}: only {len(got)} of {len(expected)} samples were written after "
                                 f"{RECEIPT_TIMEOUT_S:.0f} s")
            if pump is not None:
                pump()
            time.sleep(0.01)

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()
