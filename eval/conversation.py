"""Decoding one conversation of a benchmark: every user turn asked after the model's own previous answers (turn 2
after the method's own turn-1 answer, which is the target's own answer because decoding is lossless), and what the
stage keeps of each response (`response_record`).
"""

from __future__ import annotations

from typing import Any, Callable

from eval.metrics import PHASES, ResponseRecord
from eval.prompts import EvalPrompt, chat_prompt_ids


def response_record(result: Any, *, prompt_id: str, turn: int, prompt_tokens: int) -> ResponseRecord:
    """eval.engine.decode.DecodeResult -> ResponseRecord (the one place that reads DecodeResult's field names)."""
    t = result.timings
    return ResponseRecord(
        prompt_id=prompt_id, turn=turn, prompt_tokens=prompt_tokens,
        num_new_tokens=int(result.num_new_tokens), num_rounds=int(result.num_rounds),
        accept_lengths=[int(x) for x in result.accept_lengths], draft_depths=[int(d) for d in result.draft_depths],
        decode_seconds=float(t["decode"]), prefill_seconds=float(t["prefill"]),
        phase_seconds={p: float(t[p]) for p in PHASES if p in t},  # empty without phase timing
        output_ids=[int(i) for i in result.output_ids],
    )


def run_conversation(prompt: EvalPrompt, tokenizer, generate: Callable[[list[int]], Any], *,
                     enable_thinking: bool, max_prompt_tokens: int) -> list[tuple[list[int], Any] | str]:
    """Ask every user turn of `prompt`, each after the model's own previous answers.

    generate(prompt_ids) -> DecodeResult. Returns per turn (prompt_ids, result), or a skip reason string
    (a turn that does not fit the context ends the conversation).
    """
    messages: list[dict] = []
    out: list[tuple[list[int], Any] | str] = []
    for user in prompt.turns:
        messages.append({"role": "user", "content": user})
        ids = chat_prompt_ids(tokenizer, messages, enable_thinking=enable_thinking)
        if len(ids) > max_prompt_tokens:
            out.append("prompt_too_long")
            break
        result = generate(ids)
        answer = tokenizer.decode(list(result.output_ids), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        out.append((ids, result))
    return out


ANSWER_SLACK = 8  # tokens an answer may gain when its decoded text is tokenized again inside the next turn's prompt


def longest_context(prompts: list[EvalPrompt], tokenizer, *, enable_thinking: bool, max_new_tokens: int,
                    limit: int) -> int:
    """An upper bound of the committed rows any turn of `prompts` reaches while decoding (what the warm-up sizes
    and captures for): the last turn's prompt, with every earlier answer counted as max_new_tokens + ANSWER_SLACK
    tokens, plus max_new_tokens; at most `limit`."""
    longest = 0
    for p in prompts:
        messages: list[dict] = []
        for user in p.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]
        ids = chat_prompt_ids(tokenizer, messages[:-1], enable_thinking=enable_thinking)
        longest = max(longest, len(ids) + len(p.turns) * (max_new_tokens + ANSWER_SLACK))
    return min(longest, limit)


def stop_token_ids(tokenizer, target) -> list[int]:
    """The tokens that end a response: the tokenizer's EOS and the target's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)
