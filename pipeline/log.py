"""Logging and progress bars shared by every stage: one format, one place."""

from __future__ import annotations

import logging
import os
import sys

from tqdm.auto import tqdm

_FMT = "%(asctime)s %(levelname).1s [%(name)s] %(message)s"


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(f"drafter.{name}")
    if not logging.getLogger("drafter").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FMT, "%H:%M:%S"))
        root = logging.getLogger("drafter")
        root.addHandler(handler)
        root.setLevel(os.environ.get("DRAFTER_LOG_LEVEL", "INFO"))
        root.propagate = False
    return logger


def progress(iterable=None, *, total=None, desc: str = "", unit: str = "it", disable: bool | None = None):
    """A tqdm bar on stderr; off when DRAFTER_NO_PROGRESS=1 (CI logs) or stderr is not a terminal and
    the work is tiny."""
    if disable is None:
        disable = os.environ.get("DRAFTER_NO_PROGRESS") == "1"
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True, file=sys.stderr)


def summary(stage: str, text: str) -> None:
    """The one closing line of a stage, on stdout so scripts can grep it."""
    print(f"[{stage}] {text}", flush=True)
