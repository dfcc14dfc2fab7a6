"""The one interface every regeneration backend implements (`Generator`: `hf.HFGenerator`,
`vllm.VLLMGenerator`), and the sampling rules they share. The stage picks the backend
(`pipeline.regen.stage.build_generator`); backends import only this module, never the stage.

    gen = build_generator(cfg, location, tokenizer, stop_ids)      # = <Backend>.load(...)
    outs = gen.generate(prompts, max_new_tokens, seeds)   # prompts: list[list[int]] token ids
    outs[i].token_ids   # generated ids, ending with the stop id iff finish_reason == "stop"
    outs[i].finish_reason in {"stop", "length"}

Invariants every backend keeps: generation only ever picks ids < `vocab_limit` (= len(tokenizer); random
targets have padded embedding rows that decode to nothing), stops at the first id in `stop_ids`, and
never writes more than `max_new_tokens[i]` tokens for request i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from pipeline.config import RegenConfig, TargetConfig


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


class Generator(Protocol):
    @classmethod
    def load(cls, location: str, tcfg: TargetConfig, rcfg: RegenConfig, *, tokenizer, stop_ids: Sequence[int],
             sampling: Sampling) -> "Generator":
        """The backend with the target at `location` loaded, ready to generate."""
        ...

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: Sequence[int],
                 seeds: Sequence[int] | None = None) -> list[Generation]: ...

    def close(self) -> None: ...


def cut_at_stop(tokens: Sequence[int], limit: int, stop_ids: set[int]) -> Generation:
    """A raw generated stream -> the request's Generation: up to and including the first stop id,
    else the first `limit` tokens (finish 'length')."""
    for i, t in enumerate(tokens[:limit]):
        if t in stop_ids:
            return Generation([int(x) for x in tokens[: i + 1]], "stop")
    return Generation([int(x) for x in tokens[:limit]], "length")


def mask_padded_vocab(logits, vocab_limit: int):
    """logits [..., V] -> same tensor with rows >= vocab_limit set to -inf (in place); no-op if V <= limit."""
    if logits.shape[-1] > vocab_limit:
        logits[..., vocab_limit:] = float("-inf")
    return logits


def nucleus_probs(logits, sampling: Sampling):
    """logits [B, V] (already vocab-masked) -> [B, V] the distribution a sampled token is drawn from, in vocabulary
    order: softmax(logits / temperature) over the top_k largest (0 = all), then over the smallest prefix of those,
    in descending probability, whose mass reaches top_p, renormalized. The reference `sample_next` draws from."""
    import torch

    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample_next(logits, sampling: Sampling, generator=None):
    """logits [B, V] (already vocab-masked) -> next ids [B]: the argmax (greedy), else one draw per row from
    `nucleus_probs`'s distribution. The draw is made among the candidates in descending order (torch.topk's top_k,
    or every id sorted when only top_p is set), their dropped tail zeroed and the rest renormalized by
    `torch.multinomial` itself, and the pick is mapped back through that order: no [B, V] scatter back to vocabulary
    order and no second softmax, where a large batch's sampling step spends its memory traffic."""
    import torch

    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    if sampling.top_k > 0:
        values, order = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1)  # (descending)
    else:
        values, order = torch.sort(logits, descending=True, dim=-1)
    probs = values.softmax(-1)
    if sampling.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs > sampling.top_p, 0.0)
    return order.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)
