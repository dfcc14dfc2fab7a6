"""A record a stage cannot use, rejected with the reason it is counted under.

Every stage counts bad input by reason and never drops it silently (docs/design.md): the code that finds the problem
raises a `Rejected` subclass with a short `reason` (the counter's name in the stage's manifest) and an optional
`detail` (the example text a manifest keeps for the first few); the stage's loop catches it, counts the reason and
goes on to the next record."""

from __future__ import annotations


class Rejected(ValueError):
    """reason: the counter name (snake_case); detail: what was wrong with this record, for the examples."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
