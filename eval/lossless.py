"""Is speculative output the target's output? A lossless check that can tell a bug from bf16 rounding.

At temperature 0 speculative decoding is lossless: every committed token is the target's argmax given its prefix,
so a method's response must equal plain autoregressive decoding (AR). In bf16 it does not always: the verify forward
scores a tree of N tokens at once, AR scores one, and the two GEMMs round differently, so where the target's two
best logits are (nearly) tied the two runs can pick different tokens and the responses part ways — without a bug.

For a response that differs from AR's, `first_divergence` finds the first position where they part; the prefix
before it (prompt + the common output) is identical in both runs, so the target's logits there are one
well-defined vector. Recomputed in fp32 (`fp32_logits_at`), the gap between the two tokens the runs chose,

    gap = |logit_fp32[ar_token] - logit_fp32[method_token]|

says what happened: gap <= margin -> a near-tie (rounding picked one of two equally good tokens); gap > margin ->
one run did not take the argmax: a bug. The report shows "identical" beside "identical or near-tie"; the second must
be 100 %. The margin (`NEAR_TIE_MARGIN`) is a few bf16 ulps of a logit of magnitude ~30 (bf16 keeps 8 significant
bits: one ulp at 16..32 is 0.125), summed over a verify forward's rounding: 0.5 logits. A real bug (a wrong
position, mask or KV row) moves the chosen token's logit by whole units, far past it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from torch import Tensor

NEAR_TIE_MARGIN = 0.5


@dataclass(frozen=True)
class Divergence:
    """The first position where a method's response leaves AR's, classified with fp32 logits."""

    prompt_id: str
    turn: int
    position: int          # index into the response's output ids
    ar_token: int | None   # None: AR's response ended here (the method's is longer)
    method_token: int | None
    gap: float | None      # |fp32 logit(ar_token) - fp32 logit(method_token)|; None when one response ended
    argmax_token: int      # the fp32 argmax at that position
    near_tie: bool

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(ar: Sequence[int], method: Sequence[int]) -> int | None:
    """Index of the first differing token; if one response is a prefix of the other, the shorter one's length;
    None when both are equal."""
    for i, (a, b) in enumerate(zip(ar, method)):
        if a != b:
            return i
    return None if len(ar) == len(method) else min(len(ar), len(method))


def classify(prompt_id: str, turn: int, prompt_ids: Sequence[int], ar: Sequence[int], method: Sequence[int],
             logits_at: Callable[[list[int]], "Tensor"], margin: float = NEAR_TIE_MARGIN) -> Divergence | None:
    """The response's first divergence from AR, classified (None when it equals AR).

    logits_at(prefix_ids) -> fp32 logits [V] of the target's next token after `prefix_ids`.
    A divergence where one response simply ended (a stop token chosen by one run only) is classified by the
    stop token's logit against the other run's token, like any other pair; with no token on one side (the
    response was cut by the token limit) there is nothing to compare and it counts as a near-tie only if the
    other side's token is the fp32 argmax.
    """
    pos = first_divergence(ar, method)
    if pos is None:
        return None
    logits = logits_at([*prompt_ids, *ar[:pos]]).float()
    a = int(ar[pos]) if pos < len(ar) else None
    m = int(method[pos]) if pos < len(method) else None
    argmax = int(logits.argmax())
    if a is not None and m is not None:
        gap = abs(float(logits[a]) - float(logits[m]))
        near = gap <= margin
    else:
        gap, near = None, (a if a is not None else m) == argmax
    return Divergence(prompt_id, turn, pos, a, m, gap, argmax, near)


def fp32_logits_at(target) -> Callable[[list[int]], "Tensor"]:
    """logits_at for `classify`: one fp32 forward of `target` (an HF causal LM already cast to fp32) over the
    prefix, the last position's logits."""
    import torch

    device = next(target.parameters()).device

    @torch.no_grad()
    def logits_at(prefix_ids: list[int]):
        ids = torch.tensor([prefix_ids], dtype=torch.long, device=device)
        return target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()

    return logits_at


def lossless_summary(num_responses: int, divergences: Sequence[Divergence], examples: int = 5) -> dict:
    """report cell fields: the identical share, the identical-or-near-tie share, the bugs' examples."""
    bugs = [d for d in divergences if not d.near_tie]
    return {
        "identical": (num_responses - len(divergences)) / num_responses if num_responses else None,
        "identical_or_near_tie": (num_responses - len(bugs)) / num_responses if num_responses else None,
        "near_tie_margin": NEAR_TIE_MARGIN,
        "divergences": len(divergences),
        "not_near_tie": len(bugs),
        "max_near_tie_gap": max((d.gap for d in divergences if d.near_tie and d.gap is not None), default=None),
        "not_near_tie_examples": [d.to_dict() for d in bugs[:examples]],
    }
