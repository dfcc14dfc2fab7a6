"""THE sample-id convention: how an id says which prompt a sample came from.

    <source>/<n>[.<k>]      a curated conversation: record n of a source (k: the k-th conversation in one record)
    <conv>#r<k>             copy k >= 1 of a conversation that the mix repeats (curate, weights above the data)
    <conv>#<k>              response k of `regen.samples_per_prompt` > 1 to one conversation (regen)
    <sample>@t<k>           the sample tokenize starts at assistant turn k >= 1 of a conversation whose template
                            re-renders earlier turns (`tokenize.unstable_template: split`)

Each stage appends its suffix to the id it read, so `prompt_id` can undo them all: the held-out split groups by
it (train/data.py), so that no held-out sample shares its prompt with a training sample.
"""

from __future__ import annotations

import re

REPEAT, RESPONSE, TURN = "#r", "#", "@t"
_SUFFIXES = re.compile(rf"({re.escape(REPEAT)}\d+)?({re.escape(RESPONSE)}\d+)?({re.escape(TURN)}\d+)?$")


def repeat_id(conv_id: str, k: int) -> str:
    """Copy k of a repeated conversation: the conversation's own id for the first copy (k == 0)."""
    return conv_id if k == 0 else f"{conv_id}{REPEAT}{k}"


def response_id(conv_id: str, k: int, n: int) -> str:
    """Response k of n to one conversation: the conversation's own id when n == 1."""
    return conv_id if n == 1 else f"{conv_id}{RESPONSE}{k}"


def turn_id(sample_id: str, first_turn: int) -> str:
    """The tokenized sample that starts at assistant turn `first_turn`: the sample's own id for turn 0."""
    return sample_id if first_turn == 0 else f"{sample_id}{TURN}{first_turn}"


def prompt_id(sample_id: str) -> str:
    """The curated conversation a sample came from: `sample_id` without the suffixes above."""
    return _SUFFIXES.sub("", sample_id, count=1)
