"""Schema adapters: one raw record of a known dataset layout -> conversations in the curated schema.

An adapter only reshapes; it never judges content. Roles are mapped where the layout has its own names
(ShareGPT `human`/`gpt`), everything else (unknown roles, non-string content, empty turns) is passed
through for `pipeline/curate/clean.py` to drop with a reason. A record that lacks the fields its layout
needs raises `NotThisFormat` and is counted as malformed.

Layouts:
    openai     {"messages": [{"role", "content"}, ...]}
    sharegpt   {"conversations": [{"from", "value"}, ...]}          (also role/content items)
    alpaca     {"instruction", "input"?, "output" | "response"?}
               {"instruction", "instances": [{"input", "output"}, ...]}   (alpaca seed tasks: one
               conversation per instance)
    gsm8k      {"question", "answer"}
    humaneval  {"prompt", "canonical_solution"?, "task_id"?}
    mt_bench   {"turns": [str, ...]}                                 (user turns only, no answers)
    prompt     {"prompt", "response" | "completion" | "output" | "answer"?}   (also the prompt-only sets of
               docs/data.md: prompt, source, category and an id column; one user turn, the rest kept as metadata;
               a record without `prompt` is malformed, a `prompt` that is not usable text is dropped by clean)
"""

from __future__ import annotations

import json
from typing import Any

FORMATS = ("openai", "sharegpt", "alpaca", "gsm8k", "humaneval", "mt_bench", "prompt")

# ShareGPT speaker names -> roles (FastChat uses human/gpt; dumps also carry chatgpt/bing/bard).
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}

METADATA_MAX_STR = 256  # longer unconsumed string fields are left out of `metadata`

Conversation = tuple[list[dict], dict]  # (messages [{role, content}], extra metadata)


class NotThisFormat(ValueError):
    """The record lacks the fields its layout needs (the message says which): counted as malformed."""


def detect_format(record: dict) -> str | None:
    """The layout of one record, from its keys; None if no adapter recognizes it."""
    if isinstance(record.get("messages"), list):
        return "openai"
    if isinstance(record.get("conversations"), list):
        return "sharegpt"
    if isinstance(record.get("turns"), list):
        return "mt_bench"
    if "instruction" in record:
        return "alpaca"
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "prompt" in record:
        if "canonical_solution" in record or "entry_point" in record:
            return "humaneval"
        return "prompt"
    return None


def adapt(record: Any, fmt: str) -> tuple[str, list[Conversation]]:
    """(resolved format, conversations) for one raw record. `fmt` is a layout name or 'auto'.

    Raises NotThisFormat when the record is not an object or lacks its layout's fields.
    """
    if not isinstance(record, dict):
        raise NotThisFormat(f"record is a JSON {type(record).__name__}, not an object")
    if fmt == "auto":
        fmt = detect_format(record)
        if fmt is None:
            raise NotThisFormat(f"no adapter recognizes a record with keys {sorted(record)[:8]}")
    convs, consumed = _ADAPTERS[fmt](record)
    extra = _unconsumed_scalars(record, consumed)
    return fmt, [(messages, {**extra, **meta}) for messages, meta in convs]


def _require(record: dict, key: str, fmt: str) -> Any:
    if key not in record:
        raise NotThisFormat(f"{fmt} record has no '{key}' field (keys: {sorted(record)[:8]})")
    return record[key]


def _require_list(record: dict, key: str, fmt: str) -> list:
    value = _require(record, key, fmt)
    if not isinstance(value, list):
        raise NotThisFormat(f"{fmt} record field '{key}' is a {type(value).__name__}, not a list")
    return value


def _turn(role: Any, content: Any) -> dict:
    return {"role": role, "content": content}


def _openai(r: dict):
    items = _require_list(r, "messages", "openai")
    if not all(isinstance(m, dict) for m in items):
        raise NotThisFormat("openai record has a message that is not an object")
    return [([_turn(m.get("role"), m.get("content")) for m in items], {})], {"messages"}


def _sharegpt(r: dict):
    items = _require_list(r, "conversations", "sharegpt")
    if not all(isinstance(m, dict) for m in items):
        raise NotThisFormat("sharegpt record has a turn that is not an object")
    messages = []
    for m in items:
        speaker = m.get("from", m.get("role"))
        role = SHAREGPT_ROLES.get(speaker.lower(), speaker) if isinstance(speaker, str) else speaker
        messages.append(_turn(role, m.get("value", m.get("content"))))
    return [(messages, {})], {"conversations"}


def _instruction_prompt(instruction: Any, inp: Any) -> Any:
    """`instruction`, then a blank line and `input` when there is one (non-strings pass through to clean)."""
    if not isinstance(instruction, str):
        return instruction
    if inp is None or inp == "":
        return instruction
    if not isinstance(inp, str):
        return inp
    return f"{instruction}\n\n{inp}"


def _with_answer(prompt: Any, answer: Any) -> list[dict]:
    messages = [_turn("user", prompt)]
    if answer is not None:
        messages.append(_turn("assistant", answer))
    return messages


def _alpaca(r: dict):
    instruction = _require(r, "instruction", "alpaca")
    if "instances" in r:  # stanford_alpaca seed_tasks.jsonl
        instances = _require_list(r, "instances", "alpaca")
        if not instances or not all(isinstance(i, dict) for i in instances):
            raise NotThisFormat("alpaca seed record needs a non-empty list of {input, output} instances")
        convs = [
            (_with_answer(_instruction_prompt(instruction, i.get("input")), i.get("output")), {"instance": k})
            for k, i in enumerate(instances)
        ]
        return convs, {"instruction", "instances"}
    answer = r.get("output", r.get("response"))  # code_alpaca_new carries both (identical)
    prompt = _instruction_prompt(instruction, r.get("input"))
    return [(_with_answer(prompt, answer), {})], {"instruction", "input", "output", "response"}


def _gsm8k(r: dict):
    question = _require(r, "question", "gsm8k")
    return [(_with_answer(question, _require(r, "answer", "gsm8k")), {})], {"question", "answer"}


def _humaneval(r: dict):
    prompt = _require(r, "prompt", "humaneval")
    return [(_with_answer(prompt, r.get("canonical_solution")), {})], {"prompt", "canonical_solution", "test"}


def _mt_bench(r: dict):
    turns = _require_list(r, "turns", "mt_bench")
    return [([_turn("user", t) for t in turns], {})], {"turns", "reference"}


_PROMPT_ANSWER_KEYS = ("response", "completion", "output", "answer")


def _prompt(r: dict):
    prompt = _require(r, "prompt", "prompt")
    answer = next((r[k] for k in _PROMPT_ANSWER_KEYS if k in r), None)
    return [(_with_answer(prompt, answer), {})], {"prompt", *_PROMPT_ANSWER_KEYS}


_ADAPTERS = {
    "openai": _openai, "sharegpt": _sharegpt, "alpaca": _alpaca, "gsm8k": _gsm8k,
    "humaneval": _humaneval, "mt_bench": _mt_bench, "prompt": _prompt,
}
assert set(_ADAPTERS) == set(FORMATS)


def _unconsumed_scalars(record: dict, consumed: set[str]) -> dict:
    """The record's other short scalar fields (ids, categories, licences) kept for traceability."""
    out = {}
    for k, v in record.items():
        if k in consumed or not isinstance(k, str):
            continue
        if isinstance(v, (bool, int, float)) or v is None or (isinstance(v, str) and len(v) <= METADATA_MAX_STR):
            out[k] = v
    return out


def metadata_json(fmt: str, location: str, extra: dict) -> str:
    """The `metadata` column: JSON with sorted keys (stable bytes for identical inputs); ASCII-escaped so
    that a stray lone surrogate in an unconsumed field can never make the row unwritable."""
    return json.dumps({**extra, "format": fmt, "location": location}, sort_keys=True)
