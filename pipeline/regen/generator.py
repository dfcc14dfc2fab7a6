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

import math
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


# The candidates a sort-free nucleus draw makes per row, at most; below the top_p where they would not push the chance
# of no candidate inside the nucleus under NUCLEUS_MISS, `sample_next` sorts instead.
NUCLEUS_CANDIDATES = 64
NUCLEUS_MISS = 1e-12


def nucleus_candidates(top_p: float) -> int:
    """The candidates per row a sort-free nucleus draw needs for the chance that none lies inside the nucleus,
    at most (1 - top_p) ** n, to stay under NUCLEUS_MISS; 0 (sort instead) when that takes more than
    NUCLEUS_CANDIDATES, or top_p is outside (0, 1)."""
    if not 0.0 < top_p < 1.0:
        return 0
    n = math.ceil(math.log(NUCLEUS_MISS) / math.log1p(-top_p))
    return n if n <= NUCLEUS_CANDIDATES else 0


def sample_nucleus(probs, top_p: float, candidates: int, generator=None):
    """probs [B, V] (a softmax) -> ids [B] drawn from the top-p nucleus of each row, without sorting the vocabulary:
    `nucleus_from_uniforms` at `candidates` uniforms per row drawn from `generator`."""
    import torch

    uniforms = torch.rand(probs.shape[0], candidates, generator=generator, device=probs.device)
    return nucleus_from_uniforms(probs, top_p, uniforms)


def nucleus_from_uniforms(probs, top_p: float, uniforms):
    """probs [B, V] (a softmax), uniforms [B, C] in [0, 1) -> ids [B]: a draw from each row's top-p nucleus.

    Rejection sampling: candidate c is the inverse CDF of the row at uniforms[:, c] (the first id whose cumulative
    mass passes it: an independent draw from `probs`); an id x lies inside the nucleus iff the mass of the ids more
    probable than x is at most top_p (the rule of `nucleus_probs`: the smallest prefix, in descending probability,
    whose mass reaches top_p). The first candidate inside, in column order, is the row's draw, so conditioned on
    acceptance it follows the nucleus distribution exactly. Inside-ness is monotone in probability, so a binary
    search over the row's candidates, sorted, finds the least probable one inside in log2(C + 1) passes over
    [B, V], one masked sum each. Every candidate lies inside with probability >= top_p (the nucleus's mass), so a row
    has none inside with probability at most (1 - top_p) ** C (see `nucleus_candidates`); such a row takes its most
    probable id, which is always inside. Ids tied in probability with the nucleus's least probable one are all
    inside (`nucleus_probs`'s sort keeps those it puts first). No host sync. `generator_triton.nucleus_from_logits`
    is the same draw in one kernel over the raw logits (CUDA)."""
    import torch

    candidates = uniforms.shape[1]
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)  # [B, C]
    p_drawn = probs.gather(-1, drawn)  # [B, C]
    p_sorted = p_drawn.sort(-1).values  # [B, C] ascending
    lo = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)  # [B] least index inside, in [0, C]
    hi = torch.full_like(lo, candidates)
    for _ in range(candidates.bit_length()):
        mid = ((lo + hi) // 2).clamp(max=candidates - 1)
        threshold = p_sorted.gather(-1, mid[:, None])  # [B, 1]
        inside = torch.where(probs > threshold, probs, 0.0).sum(-1) <= top_p  # [B]
        searching = lo < hi
        hi = torch.where(searching & inside, mid, hi)
        lo = torch.where(searching & ~inside, mid + 1, lo)
    least = p_sorted.gather(-1, lo.clamp(max=candidates - 1)[:, None])  # [B, 1]
    accepted = (p_drawn >= least) & (lo < candidates)[:, None]  # [B, C]
    first = accepted.int().argmax(-1)  # [B] the first accepted candidate in column order
    picked = drawn.gather(-1, first[:, None]).squeeze(-1)
    return torch.where(accepted.any(-1), picked, probs.argmax(-1))


def sample_next(logits, sampling: Sampling, generator=None, vocab_limit: int | None = None):
    """logits [B, V] -> next ids [B], each < vocab_limit (default V; the ids past it are padded embedding rows): the
    argmax (greedy), else one draw per row from `nucleus_probs`'s distribution. With top_p alone, the sort-free draw
    (`sample_nucleus`: a large batch's full vocabulary sort costs more than the decode step it follows) where top_p
    allows it, on CUDA as one Triton kernel over the raw logits (`generator_triton.nucleus_from_logits`); else
    `sample_sorted`. `logits` is never written."""
    import torch

    from pipeline import triton_runtime

    limit = min(vocab_limit or logits.shape[-1], logits.shape[-1])
    if sampling.greedy:
        return logits[:, :limit].argmax(dim=-1)
    candidates = nucleus_candidates(sampling.top_p) if sampling.top_k <= 0 else 0
    if candidates and triton_runtime.available(logits.device) and logits.stride(-1) == 1:
        from pipeline.regen import generator_triton

        uniforms = torch.rand(logits.shape[0], candidates, generator=generator, device=logits.device)
        ids = triton_runtime.run(generator_triton.nucleus_from_logits, logits, sampling.temperature,
                                 sampling.top_p, uniforms, limit)
        if ids is not None:
            return ids
    logits = logits[:, :limit].float() / sampling.temperature
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    if candidates:
        return sample_nucleus(logits.softmax(-1), sampling.top_p, candidates, generator)
    return sample_sorted(logits, sampling, generator)


def sample_sorted(logits, sampling: Sampling, generator=None):
    """logits [B, V] (vocab-masked, divided by the temperature) -> ids [B] drawn from `nucleus_probs`'s
    distribution among the candidates in descending order (torch.topk's top_k, or every id sorted when only top_p
    is set), their dropped tail zeroed and the rest renormalized by `torch.multinomial` itself, the pick mapped
    back through that order: no [B, V] scatter back to vocabulary order and no second softmax."""
    import torch

    if sampling.top_k > 0:
        values, order = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1)  # (descending)
    else:
        values, order = torch.sort(logits, descending=True, dim=-1)
    probs = values.softmax(-1)
    if sampling.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs > sampling.top_p, 0.0)
    return order.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)
