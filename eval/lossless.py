"""Is speculative output the target's output? A lossless check that can tell a bug from bf16 rounding.

At temperature 0 speculative decoding is lossless: every committed token is the target's argmax given its prefix,
so a method's response must equal plain autoregressive decoding (AR). In bf16 it does not always: the verify forward
scores a tree of N tokens at once, AR scores one, and the two GEMMs round differently, so where the target's two
best logits are (nearly) tied the two runs can pick different tokens and the responses part ways — without a bug.

For a response that differs from AR's, `first_divergence` finds the first position where they part; the prefix
before it (prompt + the common output) is identical in both runs, so the target's logits there are one
well-defined vector. Recomputed in fp32 (`fp32_logits_at`), the gap between the two tokens the runs chose,

    gap = |logit_fp32[ar_token] - logit_fp32[method_token]|

says what happened: gap <= margin -> a near-tie (rounding picked one of two equally good tokens). The margin
(`NEAR_TIE_MARGIN`) is a few bf16 ulps of a logit of magnitude ~30 (bf16 keeps 8 significant bits: one ulp at 16..32
is 0.125), summed over a verify forward's rounding: 0.5 logits. A real bug (a wrong position, mask or KV row) moves
the chosen token's logit by whole units, far past it.

A fixed margin still has a tail: a 256-node tree verify rounds differently from AR's one-row step, and bf16 verifies
leave AR just past the margin now and then (docs/benchmarks.md, "quality", lossless check). So a divergence beyond
the margin is decided by a replay (`fp32_replay`): AR and the method decode the same prompt again in fp32, through the
divergence, on the same device and decode path. Rounding does not survive fp32 (the two agree); a bug in the
decoder does (they differ again). The report shows "identical" beside "identical or rounding" (near-ties and
divergences the fp32 replay did not reproduce); the second must be 100 %. The replay checks the decoder, not a
stored response: a response file edited after decoding is not what it re-decodes.

The fp32 subset (`fp32_subset_summary`, eval.fp32_subset) asks the question without bf16 at all: the first few
prompts of each benchmark decoded whole in fp32 by AR and by the method, where identical must be 100 %.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from eval import conversation
from eval.metrics import ResponseRecord
from eval.prompts import EvalPrompt, LoadedBenchmark, chat_prompt_ids
from eval.units import Unit
from pipeline.config import RunConfig
from pipeline.log import get_logger

if TYPE_CHECKING:
    from torch import Tensor

log = get_logger("eval")

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
    # beyond the margin only: "identical" (the fp32 replay of AR and the method agree through this position:
    # rounding), "differs" (the replay reproduces a divergence: a bug), "failed: <why>", or None (no replay run)
    fp32_replay: str | None = None

    @property
    def rounding(self) -> bool:
        """bf16 rounding, not a bug: a near-tie, or a divergence the fp32 replay does not reproduce."""
        return self.near_tie or self.fp32_replay == "identical"

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
             logits_at: Callable[[list[int]], "Tensor"], margin: float = NEAR_TIE_MARGIN,
             replay: Callable[[list[int], int], str] | None = None) -> Divergence | None:
    """The response's first divergence from AR, classified (None when it equals AR).

    replay(prompt_ids, n) -> "identical" | "differs" | "failed: ..." (`fp32_replay`): run for a divergence that is
    not a near-tie, with n = position + 1 (decode through the divergence).

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
    replayed = None if near or replay is None else replay(list(prompt_ids), pos + 1)
    return Divergence(prompt_id, turn, pos, a, m, gap, argmax, near, replayed)


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


def fp32_replay(decode: Callable[..., object], target, drafter, method: str, budget: int | None,
                stop_token_ids: Sequence[int] = (), cache_impl: str = "auto") -> Callable[[list[int], int], str]:
    """replay for `classify`: AR and `method` decode `n` tokens of the prompt with `decode` (eval.engine.decode.decode)
    on `target` / `drafter` (both fp32; the verify path `cache_impl`, the eval's) and are compared. Never raises: a
    replay that cannot run says why."""

    def replay(prompt_ids: list[int], n: int) -> str:
        try:
            ar = decode("ar", target, None, prompt_ids, max_new_tokens=n, stop_token_ids=stop_token_ids,
                        phase_timing=False, cache_impl=cache_impl)
            got = decode(method, target, drafter, prompt_ids, max_new_tokens=n, budget=budget,
                         stop_token_ids=stop_token_ids, phase_timing=False, cache_impl=cache_impl)
        except Exception as e:  # noqa: BLE001 -- reported in the cell (the divergence then counts as a bug)
            return f"failed: {type(e).__name__}: {e}"[:300]
        return "identical" if list(ar.output_ids) == list(got.output_ids) else "differs"

    return replay


def lossless_summary(num_responses: int, divergences: Sequence[Divergence], examples: int = 5) -> dict:
    """report cell fields: the identical share, the identical-or-near-tie share (the margin alone), the
    identical-or-rounding share (near-ties + divergences the fp32 replay did not reproduce: must be 100 %), and
    examples of divergences beyond the margin and of bugs."""
    beyond = [d for d in divergences if not d.near_tie]
    bugs = [d for d in divergences if not d.rounding]

    def share(bad: int):
        return (num_responses - bad) / num_responses if num_responses else None

    return {
        "identical": share(len(divergences)),
        "identical_or_near_tie": share(len(beyond)),
        "identical_or_rounding": share(len(bugs)),
        "near_tie_margin": NEAR_TIE_MARGIN,
        "divergences": len(divergences),
        "not_near_tie": len(beyond),
        "fp32_replay_identical": sum(d.fp32_replay == "identical" for d in beyond),
        "bugs": len(bugs),
        "max_near_tie_gap": max((d.gap for d in divergences if d.near_tie and d.gap is not None), default=None),
        "not_near_tie_examples": [d.to_dict() for d in beyond[:examples]],
        "bug_examples": [d.to_dict() for d in bugs[:examples]],
    }


def fp32_subset_summary(outcomes: Sequence[str], prompt_ids: Sequence[str], max_new_tokens: int) -> dict:
    """report cell field "fp32_subset": outcomes[i] is `fp32_replay`'s answer for prompt prompt_ids[i] decoded for
    max_new_tokens in fp32 ("identical" | "differs" | "failed: ..."); identical must be 1.0."""
    n = len(outcomes)
    bad = [(pid, o) for pid, o in zip(prompt_ids, outcomes) if o != "identical"]
    return {"prompts": n, "max_new_tokens": max_new_tokens,
            "identical": (n - len(bad)) / n if n else None,
            "not_identical": [{"prompt_id": pid, "outcome": o} for pid, o in bad]}


# ----------------------------------------------------------------------------------------------
# The check over an eval run's responses
# ----------------------------------------------------------------------------------------------


def check_lossless(cfg: RunConfig, by_unit: dict[Unit, list[ResponseRecord]], benchmarks: dict[str, LoadedBenchmark],
                   tokenizer, location: str) -> dict[str, dict] | None:
    """unit name -> `eval.lossless.lossless_summary` of its responses against AR's, at temperature 0.

    Per prompt the first turn that differs from AR's is classified (`eval.lossless.classify`, fp32 logits of the
    target at the divergence); later turns of that prompt follow a different history and are not compared. A
    divergence beyond the near-tie margin is replayed in fp32 (`eval.lossless.fp32_replay`: AR and the unit's method
    decode that prompt again through the divergence, with the fp32 target and drafter on the target's device). The
    fp32 target is loaded only when some response differs or eval.fp32_subset asks for it, the fp32 drafter only
    when a replay or the subset needs it. eval.fp32_subset = N: the first N prompts of each benchmark (first turn)
    are decoded whole in fp32 by AR and each method (`eval.lossless.fp32_subset_summary`: identical must be 1.0)."""
    e = cfg.eval
    if not e.lossless_check or e.temperature != 0:
        return None
    todo: dict[str, list[tuple[ResponseRecord, ResponseRecord]]] = {}
    for u, recs in by_unit.items():
        ar = by_unit.get(Unit(u.benchmark, "ar"))
        if ar is None or u.method == "ar":
            continue
        ar_by = {(r.prompt_id, r.turn): r for r in ar}
        first: dict[str, tuple[ResponseRecord, ResponseRecord]] = {}
        for r in sorted(recs, key=lambda r: r.turn):
            a = ar_by.get((r.prompt_id, r.turn))
            if a is not None and a.output_ids != r.output_ids and r.prompt_id not in first:
                first[r.prompt_id] = (a, r)
        todo[u.name] = list(first.values())
    if not any(todo.values()) and not e.fp32_subset:
        return {u.name: lossless_summary(len(recs), []) for u, recs in by_unit.items() if u.name in todo}
    import torch

    from eval.drafter_inputs import drafter_dir, load_drafter
    from eval.engine.decode import decode
    from pipeline.target import load_target

    target = load_target(location, replace(cfg.target, dtype="float32")).eval()
    logits_at = fp32_logits_at(target)
    fp32_drafter: list = []  # loaded at the first replay

    def replay_for(u: Unit):
        def replay(prompt_ids: list[int], n: int) -> str:
            if not fp32_drafter:
                fp32_drafter.append(load_drafter(drafter_dir(cfg), target, target.device)[0])
            run = fp32_replay(decode, target, fp32_drafter[0], u.method, u.budget,
                              conversation.stop_token_ids(tokenizer, target), cache_impl=e.target_cache)
            return run(prompt_ids, n)
        return replay

    def first_turn_ids(p: EvalPrompt) -> list[int]:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}],
                               enable_thinking=cfg.target.enable_thinking)

    prompts = {p.id: p for b in benchmarks.values() for p in b.prompts}
    out = {}
    with torch.inference_mode():
        for u, recs in by_unit.items():
            if u.name not in todo:
                continue
            found = []
            for a, r in todo[u.name]:
                messages = []
                for turn, user in enumerate(prompts[r.prompt_id].turns[: r.turn + 1]):
                    messages.append({"role": "user", "content": user})
                    if turn < r.turn:  # earlier turns are identical to AR's: the same history
                        messages.append({"role": "assistant",
                                         "content": tokenizer.decode(_earlier_output(by_unit, u, r, turn),
                                                                     skip_special_tokens=True)})
                ids = chat_prompt_ids(tokenizer, messages, enable_thinking=cfg.target.enable_thinking)
                found.append(classify(r.prompt_id, r.turn, ids, a.output_ids, r.output_ids, logits_at,
                                      replay=replay_for(u)))
            out[u.name] = lossless_summary(len(recs), found)
            s = out[u.name]
            if e.fp32_subset:
                subset = benchmarks[u.benchmark].prompts[: e.fp32_subset]
                replay = replay_for(u)
                s["fp32_subset"] = fp32_subset_summary([replay(first_turn_ids(p), e.max_new_tokens) for p in subset],
                                                       [p.id for p in subset], e.max_new_tokens)
                if s["fp32_subset"]["not_identical"]:
                    log.warning("%s: in fp32, %d of %d subset prompts decode differently from AR (a bug): e.g. %s",
                                u.name, len(s["fp32_subset"]["not_identical"]), len(subset),
                                s["fp32_subset"]["not_identical"][0])
            if s["not_near_tie"]:
                log.info("%s: %d of %d divergences from AR lie beyond the near-tie margin; the fp32 replay agrees with "
                         "AR on %d (rounding)", u.name, s["not_near_tie"], s["divergences"], s["fp32_replay_identical"])
            if s["bugs"]:
                log.warning("%s: %d responses leave AR's output and the fp32 replay does not put them back (a bug): "
                            "e.g. %s", u.name, s["bugs"], s["bug_examples"][0])
    del target, fp32_drafter
    return out


def _earlier_output(by_unit: dict, unit: Unit, r: ResponseRecord, turn: int) -> list[int]:
    return next(x.output_ids for x in by_unit[unit] if x.prompt_id == r.prompt_id and x.turn == turn)
