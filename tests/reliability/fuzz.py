"""What every fuzz test of tests/reliability/ shares: the hypothesis settings, damaged-JSON strategies, the in-process
CLI run and the checks each example must pass (docs/reliability.md).

An example passes when the real loader or `drafter.cli.main` either accepts the input or refuses it with one error line
(`drafter <command>: error: ...`, exit 2; a refusal that lists several fields indents them below that line), prints
no traceback, ends within the per-example deadline and leaves every input file byte for byte as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Derandomized (seeded from the test, not the clock: no run meets examples another run never saw), nothing written
# to the repo (no example database), a deadline per example; max_examples is set per test.
FUZZ = settings(derandomize=True, database=None, deadline=timedelta(seconds=10), print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

def fuzz(max_examples: int) -> settings:
    """FUZZ with this many examples per test (kept modest: the whole fuzz suite runs in `make test`)."""
    return settings(FUZZ, max_examples=max_examples)


# JSON values of every type, including the ones a careless edit or a damaged disk produces: huge and negative
# integers, inf/nan (Python's json writes and reads them), empty and odd strings, nesting.
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
           | st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, 10 ** 12])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (a tuple of keys / indexes) into a JSON value, the root () included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            out += json_paths(v, prefix + (i,))
    return out


def _replace(value: Any, path: tuple, new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    if len(path) == 1 and delete:
        del copy[path[0]]
    else:
        copy[path[0]] = _replace(copy[path[0]], path[1:], new, delete)
    return copy


@st.composite
def damaged_json_bytes(draw, original: Any) -> bytes:
    """`original` (a JSON value) damaged one way: a value somewhere replaced by another of any type, a key deleted,
    the serialised text cut short or with bytes flipped or inserted, or the file replaced by other bytes."""
    how = draw(st.sampled_from(["replace", "replace", "delete", "cut", "flip", "insert", "other"]))
    text = json.dumps(original).encode()
    if how in ("replace", "delete"):
        paths = json_paths(original)
        path = draw(st.sampled_from(paths[1:] if how == "delete" and len(paths) > 1 else paths))
        if how == "delete" and path:
            return json.dumps(_replace(original, path, None, delete=True)).encode()
        return json.dumps(_replace(original, path, draw(JSON_VALUES))).encode()
    if how == "cut":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if how == "flip":
        at = draw(st.integers(0, len(text) - 1))
        return text[:at] + bytes([text[at] ^ draw(st.integers(1, 255))]) + text[at + 1:]
    if how == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    return draw(st.binary(max_size=64) | st.sampled_from([b"", b"[]", b"null", b'"text"', b"0", b"{}"]))


@st.composite
def damaged_file_bytes(draw, original: bytes) -> bytes:
    """A binary file (a parquet shard) damaged one way: cut short, a byte flipped, a span overwritten, or replaced by
    other bytes. Never the original."""
    how = draw(st.sampled_from(["cut", "flip", "flip", "span", "other"]))
    if how == "cut":
        return original[: draw(st.integers(0, len(original) - 1))]
    at = draw(st.integers(0, len(original) - 1))
    if how == "flip":
        return original[:at] + bytes([original[at] ^ draw(st.integers(1, 255))]) + original[at + 1:]
    if how == "span":
        span = draw(st.binary(min_size=1, max_size=64))
        damaged = original[:at] + span + original[at + len(span):]
        return damaged if damaged != original else original[:at]
    other = draw(st.binary(max_size=64) | st.sampled_from([b"", b"PAR1", b"PAR1PAR1"]))
    return other if other != original else b""


def digest(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (files or directories): compared before and after to prove no input
    was modified. A stage's lock files are left out: they hold the note of the process that ran last, not data."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*")
                                                     if p.is_file() and not p.name.startswith("lock"))
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`drafter.cli.main(argv)` in this process: (exit status, what it printed on stderr). The stages' log lines go
    to the logging handler's own stream, not here: this is what the error boundary prints."""
    from drafter.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def assert_one_error_line(command: str, rc: int, stderr: str) -> str:
    """The boundary's output for a refused input: exit 2, no traceback, one `drafter <command>: error:` line (a list of
    fields below it indented). Returns the error line."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    # a progress bar that a library drew before the refusal (redrawn with \r: transformers writing a target into the
    # cache) is not part of the boundary's output
    lines = [line for line in stderr.strip("\n").split("\n") if "\r" not in line]
    assert rc == 2, (rc, stderr[-3000:])
    assert lines[0].startswith(f"drafter {command}: error: ") and len(lines[0]) > len(command) + 20, stderr
    assert all(line.startswith("  ") for line in lines[1:]), stderr
    return lines[0]


def finite_numbers(value: Any) -> bool:
    """No inf/nan anywhere in a (nested) value."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(finite_numbers(v) for v in value)
    return True
