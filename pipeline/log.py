"""Logging and progress bars shared by every stage: one format, one place.

`DRAFTER_NO_PROGRESS=1` turns off every progress bar a run shows, the libraries' included: importing this module
then sets the switches the libraries read when they are imported (tqdm's `TQDM_DISABLE`, which also reaches
vLLM's engine processes; huggingface_hub's and datasets'), and `progress` / `no_progress` turn off the bars of
those already imported (transformers' "Loading weights" and "Writing model shards" among them). vLLM's own bars
are switched off where its engine is built (`pipeline.target.vllm_engine_kwargs`, `use_tqdm=False` per call).
"""

from __future__ import annotations

import logging
import os
import sys

LIBRARY_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def no_progress() -> bool:
    """True when DRAFTER_NO_PROGRESS=1; then also turns off the bars of the libraries imported so far."""
    if os.environ.get("DRAFTER_NO_PROGRESS") != "1":
        return False
    for name in LIBRARY_SWITCHES:
        os.environ.setdefault(name, "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # also huggingface_hub's
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    return True


no_progress()  # before tqdm is imported below: its defaults read TQDM_DISABLE once, at import

from tqdm.auto import tqdm  # noqa: E402

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
    """A tqdm bar on stderr; off when DRAFTER_NO_PROGRESS=1 (CI logs), and then so are the libraries' bars."""
    if disable is None:
        disable = no_progress()
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True, file=sys.stderr)


def summary(stage: str, text: str) -> None:
    """The one closing line of a stage, on stdout so scripts can grep it."""
    print(f"[{stage}] {text}", flush=True)
