"""The production regeneration backend: offline batched vLLM (`LLM.generate`) over a whole round of prompts.

Prompts arrive as token ids already rendered through pipeline.target.render_chat (the same template call,
thinking flag included, that the hf backend and tokenize use), so both backends see identical prompts.
vLLM schedules the batch itself (continuous batching); one SamplingParams per request carries its token
limit and seed. Ids >= len(tokenizer) are masked by VocabLimitLogitsProcessor (the padded embedding rows of
random targets), a per-request limit in `extra_args` instead of `allowed_token_ids`, whose O(vocab) list per
request is costly at 150K vocabularies.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.config import RegenConfig, TargetConfig
from pipeline.regen.generator import Generation, Sampling, cut_at_stop
from pipeline.target import build_vllm_engine, hf_config, text_config

try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:  # vLLM not installed: the hf backend still works
    LogitsProcessor, BatchUpdate, process_dict_updates = object, None, None


class VocabLimitLogitsProcessor(LogitsProcessor):
    """vLLM v1 batch logits processor: a row whose request has `extra_args['vocab_limit'] = n` gets -inf
    at every id >= n. Requests without the key are untouched."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.limits: dict[int, int] = {}  # persistent-batch row -> vocab limit

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the greedy pick when a padded row would win

    def update_state(self, batch_update: "BatchUpdate | None") -> None:
        process_dict_updates(
            self.limits, batch_update,
            lambda params, _prompt, _out: (params.extra_args or {}).get("vocab_limit") if params else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, V] -> logits with the padded ids of limited rows at -inf (in place)."""
        by_limit: dict[int, list[int]] = {}
        for row, limit in self.limits.items():
            if limit < logits.shape[-1]:
                by_limit.setdefault(limit, []).append(row)
        for limit, rows in by_limit.items():
            logits[torch.tensor(rows, device=logits.device), limit:] = float("-inf")
        return logits


class VLLMGenerator:
    def __init__(self, llm, *, vocab_limit: int, stop_ids: Sequence[int], sampling: Sampling, seed: int = 0):
        self.llm = llm
        self.vocab_limit = vocab_limit
        self.stop_ids = sorted(set(stop_ids))
        self.sampling = sampling
        self.model_vocab = llm.llm_engine.model_config.get_vocab_size()

    @classmethod
    def load(cls, location: str, tcfg: TargetConfig, rcfg: RegenConfig, *, tokenizer, stop_ids, sampling):
        padded = text_config(hf_config(location, tcfg)).vocab_size > len(tokenizer)  # else the processor is not needed
        llm = build_vllm_engine(
            location, tcfg, rcfg.vllm, max_model_len=rcfg.max_model_len, seed=rcfg.seed,
            **({"logits_processors": [VocabLimitLogitsProcessor]} if padded else {}),
        )
        return cls(llm, vocab_limit=len(tokenizer), stop_ids=stop_ids, sampling=sampling)

    def _params(self, max_tokens: int, seed: int | None):
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
            seed=None if s.greedy else seed, stop_token_ids=self.stop_ids, ignore_eos=False, detokenize=False,
            skip_special_tokens=False,
            extra_args={"vocab_limit": self.vocab_limit} if self.model_vocab > self.vocab_limit else None,
        )

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: Sequence[int],
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        params = [self._params(m, seeds[i] if seeds is not None else None) for i, m in enumerate(max_new_tokens)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        stop = set(self.stop_ids)
        return [cut_at_stop(list(o.outputs[0].token_ids), m, stop) for o, m in zip(outs, max_new_tokens)]

    def close(self) -> None:
        self.llm = None
