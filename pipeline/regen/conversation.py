"""Conversations as regen and tokenize see them: the turn structure, the rendered+encoded prompt, the
target's end-of-turn tokens and reasoning text.

A conversation is `messages: list[{"role", "content"}]` with roles `system|user|assistant`: an optional
leading system turn, then user turns, each possibly followed by an assistant turn (the curate contract).
Regeneration keeps the system/user turns and lets the target write one assistant turn after each user turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.rejects import Rejected
from pipeline.target import render_chat

ROLES = ("system", "user", "assistant")
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


class MalformedConversation(Rejected):
    """A conversation breaks the curate contract; `reason` is the counter name it is recorded under."""


@dataclass
class Skeleton:
    """What the target answers: the optional system turns and the user turns, in order."""

    system: list[dict]
    users: list[str]

    def history(self, answers: list[str]) -> list[dict]:
        """Messages up to and including user turn `len(answers)`, with `answers` as the assistant turns
        in between (the target's own previous turns)."""
        k = len(answers)
        msgs = list(self.system)
        for i in range(k):
            msgs += [{"role": "user", "content": self.users[i]}, {"role": "assistant", "content": answers[i]}]
        msgs.append({"role": "user", "content": self.users[k]})
        return msgs

    def conversation(self, answers: list[str]) -> list[dict]:
        """The full conversation once every user turn has its answer."""
        assert len(answers) == len(self.users)
        return self.history(answers[:-1]) + [{"role": "assistant", "content": answers[-1]}]


def skeleton(messages: list[dict]) -> Skeleton:
    """Drop the assistant turns; check the shape. Raises MalformedConversation naming what is wrong."""
    if not messages:
        raise MalformedConversation("malformed", "no messages")
    system, users = [], []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise MalformedConversation("malformed", f"message {i} has role {role!r}")
        if not isinstance(content, str):
            raise MalformedConversation("malformed", f"message {i} has no text content")
        if role == "system":
            if users:
                raise MalformedConversation("malformed", f"system message {i} after a user turn")
            system.append({"role": "system", "content": content})
        elif role == "user":
            users.append(content)
        elif not users:
            raise MalformedConversation("malformed", f"assistant message {i} before any user turn")
    if not users:
        raise MalformedConversation("malformed", "no user turn")
    return Skeleton(system, users)


def encode_chat(tokenizer, text: str) -> list[int]:
    """THE tokenization of rendered chat text: no extra special tokens (the template writes BOS itself),
    as vLLM's chat path does."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages: list[dict], *, enable_thinking: bool) -> list[int]:
    """Token ids the target sees before writing the next assistant turn (template + generation prompt)."""
    return encode_chat(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True,
                                              enable_thinking=enable_thinking))


def end_of_turn_ids(tokenizer, location: str | None = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS plus the `eos_token_id`(s) of the model's
    generation_config.json (e.g. Llama-3's <|eot_id|> and <|end_of_text|>). Sorted, unique."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if location is not None and (Path(location) / "generation_config.json").exists():
        eos = json.loads((Path(location) / "generation_config.json").read_text()).get("eos_token_id")
        ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    if not ids:
        raise ValueError("the target's tokenizer has no EOS token: cannot tell where an assistant turn ends")
    return sorted(ids)


def strip_reasoning(text: str) -> str:
    """Remove `<think>…</think>` blocks (and the whitespace after them) from a generated turn; an
    unterminated `<think>` (cut by max_new_tokens) drops everything after it."""
    text = _THINK.sub("", text)
    cut = text.find("<think>")
    return text[:cut] if cut >= 0 else text
