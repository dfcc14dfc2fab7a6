"""Cleaning rules: every conversation either passes or is dropped under exactly one named reason.

Rules, in the order they are checked (the first that fails names the drop):
    unknown_role        a turn's role is not system/user/assistant (after the adapter's mapping)
    non_string_content  a turn's content is not a string (None, a list of parts, a number, ...)
    invalid_utf8        a turn holds undecodable bytes (lone surrogates from invalid UTF-8 or from
                        `\\ud800`-style JSON escapes): such text cannot be stored or tokenized
    control_chars       a turn holds C0/C1 control characters other than tab, newline, carriage return
    empty_turn          a user/assistant turn is empty or whitespace only
    not_user_first      the conversation does not start with a user turn after an optional system turn
    too_short           a user/assistant turn is shorter than `curate.min_chars` (stripped characters)
    too_long            the whole conversation is longer than `curate.max_chars` characters

One fix is applied instead of a drop, and counted: an empty or whitespace-only *system* turn is removed
(chat dumps such as Nemotron carry `{"role": "system", "content": ""}`); the conversation is kept.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from pipeline.curate.schema import ROLES

CLEAN_REASONS = (
    "unknown_role", "non_string_content", "invalid_utf8", "control_chars",
    "empty_turn", "not_user_first", "too_short", "too_long",
)
DEDUP_REASONS = ("exact_duplicate", "near_duplicate")
DROP_REASONS = CLEAN_REASONS + DEDUP_REASONS

_BAD_CHAR = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")  # control chars, lone surrogates


class Cleaned(NamedTuple):
    messages: list[dict] | None  # the kept turns, or None when dropped
    reason: str | None           # one of CLEAN_REASONS when dropped
    detail: str                  # which turn and why, for the report
    removed_empty_system: int    # empty system turns removed (the one fix)


def _drop(reason: str, detail: str) -> Cleaned:
    return Cleaned(None, reason, detail, 0)


def clean_conversation(messages: list[dict], *, min_chars: int, max_chars: int) -> Cleaned:
    """Check one adapted conversation against the rules above; returns the kept turns or the reason."""
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role not in ROLES:
            return _drop("unknown_role", f"turn {i} has role {role!r}")
        if not isinstance(content, str):
            return _drop("non_string_content", f"turn {i} ({role}) content is {type(content).__name__}")
    for i, m in enumerate(messages):
        bad = _BAD_CHAR.search(m["content"])
        if bad and any("\ud800" <= ch <= "\udfff" for ch in m["content"]):
            return _drop("invalid_utf8", f"turn {i} ({m['role']}) holds undecodable bytes")
        if bad:
            return _drop("control_chars", f"turn {i} ({m['role']}) holds control character {bad.group()!r}")
    kept = [m for m in messages if not (m["role"] == "system" and not m["content"].strip())]
    removed = len(messages) - len(kept)
    for i, m in enumerate(kept):
        if m["role"] != "system" and not m["content"].strip():
            return _drop("empty_turn", f"turn {i} ({m['role']}) is empty")
    first = 1 if kept and kept[0]["role"] == "system" else 0
    if len(kept) <= first or kept[first]["role"] != "user":
        got = kept[first]["role"] if len(kept) > first else "nothing"
        return _drop("not_user_first", f"turn {first} is {got}, not user")
    for i, m in enumerate(kept):
        n = len(m["content"].strip())
        if m["role"] != "system" and n < min_chars:
            return _drop("too_short", f"turn {i} ({m['role']}) has {n} < min_chars={min_chars} characters")
    total = sum(len(m["content"]) for m in kept)
    if total > max_chars:
        return _drop("too_long", f"{total} > max_chars={max_chars} characters")
    return Cleaned([{"role": m["role"], "content": m["content"]} for m in kept], None, "", removed)
