"""Typed reading of the JSON files the pipeline keeps: a value read from disk is checked against the shape its
writer writes before any code indexes it, so a damaged file is a `DamagedFile` naming the file, the field and what
to run, never a KeyError / TypeError / AttributeError inside the code that reads it.

A shape (`spec`) is written as the JSON it describes:

    {"config_hash": STR, "settings": Optional(OBJECT)}           an object with these fields (others are allowed)
    {"files": [{"name": STR, "bytes": INT, "sha256": STR}]}      a list whose items each have this shape
    INT, NUMBER, STR, BOOL, OBJECT, LIST, COUNTS, ANY             one JSON value (INT excludes true/false; NUMBER is
                                                                 a finite int or float; COUNTS: {str: int})

`check(value, spec)` raises `FieldProblem` ("field 'counts.train' is a string, not an integer"); `read_record(path,
spec, repair=...)` reads a file (`pipeline.files.read_json`) and turns a problem into `DamagedFile(path, problem,
repair)`. The manifest readers (pipeline/manifests.py), `StageDir` (state.json, sidecars, journals), extract's rank
summaries and tap-check verdict and eval's journal entries and reports read through here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import DamagedFile


class FieldProblem(ValueError):
    """A value is not of the shape its writer writes; the message names the field ("field 'a.b' is ...")."""


@dataclass(frozen=True)
class Kind:
    """One JSON value kind: `name` for messages ("an integer"), `test` whether a value is one."""

    name: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class Optional:
    """A field that may be missing or null."""

    spec: Any


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v)


ANY = Kind("any value", lambda v: True)
OBJECT = Kind("an object", lambda v: isinstance(v, dict))
LIST = Kind("a list", lambda v: isinstance(v, list))
STR = Kind("a string", lambda v: isinstance(v, str))
INT = Kind("an integer", _int)
NUMBER = Kind("a finite number", _number)
BOOL = Kind("true/false", lambda v: isinstance(v, bool))
COUNTS = Kind("an object of counts", lambda v: isinstance(v, dict) and all(isinstance(k, str) and _int(n)
                                                                          for k, n in v.items()))


def kind_of(value: Any) -> str:
    """'null', 'a list', 'a string', ... for a message about `value`."""
    if value is None:
        return "null"
    for kind in (BOOL, INT, NUMBER, STR, LIST, OBJECT):
        if kind.test(value):
            return kind.name
    return "a non-finite number" if isinstance(value, float) else type(value).__name__


def _expected(spec: Any) -> str:
    if isinstance(spec, Kind):
        return spec.name
    return "an object" if isinstance(spec, dict) else "a list"


def check(value: Any, spec: Any, where: str = "") -> Any:
    """`value` if it has the shape `spec`, else a FieldProblem naming the first field that does not."""
    if isinstance(spec, Optional):
        return None if value is None else check(value, spec.spec, where)
    name = f"field '{where}'" if where else "the file"
    if isinstance(spec, Kind):
        if not spec.test(value):
            raise FieldProblem(f"{name} is {kind_of(value)}, not {spec.name}")
        return value
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise FieldProblem(f"{name} is {kind_of(value)}, not a list")
        for i, item in enumerate(value):
            check(item, spec[0], f"{where}[{i}]")
        return value
    if not isinstance(value, dict):
        raise FieldProblem(f"{name} holds {kind_of(value)}, not an object" if not where
                           else f"{name} is {kind_of(value)}, not an object")
    for key, sub in spec.items():
        path = f"{where}.{key}" if where else key
        if value.get(key) is None:
            if isinstance(sub, Optional):
                continue
            raise FieldProblem(f"field '{path}' is missing")
        check(value[key], sub, path)
    return value


def get(value: Any, dotted: str, spec: Any, *, optional: bool = False) -> Any:
    """value[a][b]... for dotted = 'a.b...', checked against `spec`; optional: missing (or null) reads as None."""
    node, parts = value, dotted.split(".")
    for depth, key in enumerate(parts):
        if not isinstance(node, dict):
            where = ".".join(parts[:depth])
            raise FieldProblem(f"field '{where}' is {kind_of(node)}, not an object" if where
                               else f"it holds {kind_of(node)}, not an object")
        if node.get(key) is None:
            if optional:
                return None
            raise FieldProblem(f"field '{dotted}' is missing")
        node = node[key]
    return check(node, spec, dotted)


def read_record(path: Path, spec: Any, *, repair: str) -> Any:
    """The JSON file at `path`, checked against `spec`; a file that is not JSON or not of that shape is a
    DamagedFile naming it, the field and `repair` (what to run)."""
    from pipeline.files import read_json

    return checked(read_json(path, repair=repair), spec, path=path, repair=repair)


def checked(value: Any, spec: Any, *, path: Path | str, repair: str) -> Any:
    """`check` whose problem is a DamagedFile naming `path` and `repair`."""
    try:
        return check(value, spec)
    except FieldProblem as e:
        raise DamagedFile(path, str(e), repair) from None
