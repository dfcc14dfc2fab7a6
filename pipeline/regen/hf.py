"""The embedded regeneration backend: HF transformers, batched, left-padded, length-sorted batches.

Three decode loops with the same semantics (see pipeline.regen.generator for the invariants):
  'generate'   — `model.generate` (the simple reference, used on CPU);
  'static'     — pipeline.regen.static_decode.StaticDecoder: static KV cache (and, for a Gated-DeltaNet hybrid,
                 fixed conv / recurrent state buffers) + CUDA-graphed step, batch by batch;
  'continuous' — pipeline.regen.continuous_decode.ContinuousDecoder: `batch_size` sequence rows over the same kind
                 of cache, each refilled with the next prompt as its answer ends (all-full-attention targets).
"""

from __future__ import annotations

import gc
import time
from typing import Sequence

import torch

from pipeline.config import RegenConfig, TargetConfig
from pipeline.log import get_logger
from pipeline.regen.continuous_decode import ContinuousDecoder, supports_continuous_decode
from pipeline.regen.generator import Generation, Sampling, cut_at_stop, mask_padded_vocab
from pipeline.regen.static_decode import StaticDecoder, supports_static_decode
from pipeline.target import load_target

log = get_logger("regen.hf")


class _VocabLimit:
    """transformers logits processor: ids >= vocab_limit (padded embedding rows) can never be picked."""

    def __init__(self, vocab_limit: int):
        self.vocab_limit = vocab_limit

    def __call__(self, input_ids, scores):
        return mask_padded_vocab(scores, self.vocab_limit)


def longest_first_batches(prompts: Sequence[list[int]], batch_size: int,
                          max_new_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of `prompts`, longest first, in batches of at most `batch_size`.

    A batch is left-padded to its first (longest) prompt, and every decode step of every row reads K/V over that
    width: a few long prompts at the head of a batch of short ones would make the whole batch attend over their
    length for its whole answer. Given the answers' limits `max_new_tokens`, a batch also closes before the prompt
    that would leave more than half of its K/V slots padding:

        rows x (longest prompt + longest answer)  >  2 x sum over rows of (prompt + answer)

    so the long tail decodes in small batches of its own and the rest in full ones whose width is their own. Without
    them, batches are `batch_size` prompts at a time."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    if max_new_tokens is None:
        return [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
    batches: list[list[int]] = []
    width = answer = real = 0  # of the batch being filled: its first prompt's length, longest answer, sum of both
    for i in order:
        n, a = len(prompts[i]), max_new_tokens[i]
        if batches and len(batches[-1]) < batch_size and \
                (len(batches[-1]) + 1) * (width + max(answer, a)) <= 2 * (real + n + a):
            batches[-1].append(i)
            answer, real = max(answer, a), real + n + a
        else:
            batches.append([i])
            width, answer, real = n, a, n + a
    return batches


class HFGenerator:
    def __init__(self, model, *, pad_id: int, vocab_limit: int, stop_ids: Sequence[int], sampling: Sampling,
                 batch_size: int, decode: str = "auto", cuda_graphs: bool = True, gqa_fold: bool = True,
                 decode_gemm: bool = True, compile_pointwise: bool = False, length_bucket: int = 128,
                 min_compact_batch: int = 8, max_model_len: int = 0):
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_id = pad_id
        self.vocab_limit = vocab_limit
        self.stop_ids = sorted(set(stop_ids))
        self.sampling = sampling
        self.batch_size = batch_size
        if decode == "auto":
            decode = "static" if self.device.type == "cuda" else "generate"
        if decode == "static" and not supports_static_decode(model.config):
            log.warning("static decode runs full-attention and Gated-DeltaNet layers only; using model.generate for "
                        "this target")
            decode = "generate"
        if decode == "continuous" and not supports_continuous_decode(model.config):
            log.warning("continuous decode runs all-full-attention targets only; using static decode for this target")
            decode = "static" if supports_static_decode(model.config) else "generate"
        self.decode = decode
        self.max_model_len = max_model_len  # continuous decode: K/V slots per row (0: the first call's need)
        self.batch_log: list[dict] = []  # per decoded batch: rows, width (longest prompt), answer limit, seconds
        self.continuous = (ContinuousDecoder(model, vocab_limit=vocab_limit, stop_ids=self.stop_ids, sampling=sampling,
                                             rows=batch_size, cuda_graphs=cuda_graphs,
                                             compile_pointwise=compile_pointwise, min_compact_batch=min_compact_batch)
                           if decode == "continuous" else None)
        self.static = (StaticDecoder(model, vocab_limit=vocab_limit, stop_ids=self.stop_ids, sampling=sampling,
                                     cuda_graphs=cuda_graphs, gqa_fold=gqa_fold, decode_gemm=decode_gemm,
                                     compile_pointwise=compile_pointwise, length_bucket=length_bucket,
                                     min_compact_batch=min_compact_batch)
                       if decode == "static" else None)

    @classmethod
    def load(cls, location: str, tcfg: TargetConfig, rcfg: RegenConfig, *, tokenizer, stop_ids, sampling):
        model = load_target(location, tcfg)
        on_cuda = next(model.parameters()).device.type == "cuda"
        compile_pointwise = rcfg.compile == "on" or (rcfg.compile == "auto" and on_cuda)
        return cls(model, pad_id=tokenizer.pad_token_id, vocab_limit=len(tokenizer), stop_ids=stop_ids,
                   sampling=sampling, batch_size=rcfg.batch_size, decode=rcfg.hf_decode,
                   cuda_graphs=rcfg.cuda_graphs, compile_pointwise=compile_pointwise,
                   max_model_len=rcfg.max_model_len)

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: Sequence[int],
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        """The prompts in `batches`; results in input order. Each batch's size, width and time go to `batch_log`."""
        if self.continuous is not None:  # every prompt in one call: rows refill as answers end
            return self._generate_continuous(prompts, max_new_tokens, seeds)
        results: list[Generation | None] = [None] * len(prompts)
        stop = set(self.stop_ids)
        # the first (longest) batch's K/V length for every batch: one static state and one set of step graphs
        span = max((len(p) for p in prompts), default=0) + max(max_new_tokens, default=0)
        for idx in self.batches(prompts, max_new_tokens):
            batch, limits = [prompts[i] for i in idx], [max_new_tokens[i] for i in idx]
            seed = seeds[idx[0]] if seeds is not None else 0
            t0 = time.perf_counter()
            streams = self._generate_batch(batch, limits, seed, span)  # (read back to the host: the GPU is done)
            self.batch_log.append({"rows": len(idx), "width": len(batch[0]), "max_new_tokens": max(limits),
                                   "seconds": round(time.perf_counter() - t0, 4)})
            for i, stream in zip(idx, streams):
                results[i] = cut_at_stop(stream, max_new_tokens[i], stop)
        return results

    def decode_stats(self) -> dict[str, float]:
        """The continuous loop's counters since it was made (`ContinuousDecoder.stats`); {} for the other loops."""
        return dict(self.continuous.stats) if self.continuous is not None else {}

    def _generate_continuous(self, prompts, max_new_tokens, seeds) -> list[Generation]:
        t0 = time.perf_counter()
        streams = self.continuous.generate(prompts, max_new_tokens, cache_len=self.max_model_len,
                                           generator=self._seeded(seeds[0] if seeds else 0))
        self.batch_log.append({"rows": len(prompts), "width": max(len(p) for p in prompts) if prompts else 0,
                               "max_new_tokens": max(max_new_tokens, default=0),
                               "seconds": round(time.perf_counter() - t0, 4)})
        stop = set(self.stop_ids)
        return [cut_at_stop(s, m, stop) for s, m in zip(streams, max_new_tokens)]

    def _seeded(self, seed: int) -> torch.Generator | None:
        """The device generator a sampled decode draws from, seeded; None for greedy decoding."""
        return None if self.sampling.greedy else torch.Generator(device=self.device).manual_seed(seed)

    def batches(self, prompts: Sequence[list[int]], max_new_tokens: Sequence[int]) -> list[list[int]]:
        """The batches `generate` decodes (`longest_first_batches`): the static decoder's cut where more than half a
        batch's K/V slots would be padding; `model.generate` (the CPU path) in full batches, where the per-step
        overhead of more, smaller batches costs more than their padding."""
        return longest_first_batches(prompts, self.batch_size, max_new_tokens if self.static is not None else None)

    def close(self) -> None:
        """Drop the model, the static state and its graphs (a state and its step graphs refer to each other: only
        a collection frees them) and hand the freed memory back to the device; modules the static decoder compiled run
        eagerly again."""
        for decoder in (self.static, self.continuous):
            if decoder is not None:
                decoder.close()
        self.model = self.static = self.continuous = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- decode loops --------------------------------------------------------------------------
    def _generate_batch(self, batch: list[list[int]], limits: list[int], seed: int, span: int) -> list[list[int]]:
        if self.static is not None:
            gen = self._seeded(seed)
            pad_to = self.batch_size if self.static.use_graphs else None
            return self.static.generate(batch, limits, pad_to=pad_to, cache_len=span, generator=gen)
        return self._generate_plain(batch, limits, seed)

    @torch.inference_mode()
    def _generate_plain(self, batch: list[list[int]], limits: list[int], seed: int) -> list[list[int]]:
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        kwargs = dict(max_new_tokens=max(limits), eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                      do_sample=not self.sampling.greedy)
        if not self.sampling.greedy:
            kwargs.update(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                          top_k=self.sampling.top_k or None)
            torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, generation_config=GenerationConfig(**kwargs),
            logits_processor=LogitsProcessorList([_VocabLimit(self.vocab_limit)]),
        )
        return [row.tolist() for row in out[:, width:]]
