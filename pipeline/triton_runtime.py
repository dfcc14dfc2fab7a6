"""Whether the project's Triton kernels run, and the one rule for when one fails.

Every kernel (`<module>_triton.py` in eval/engine/, each beside the torch function it must equal, and the regen
decoder's `pipeline/regen/varlen_attention.py`) runs on CUDA with
Triton only: `available(device)` says whether to call it, `run(kernel, *args)` calls it and returns None on a build
or launch failure, after which every kernel is off for the process and the callers take their torch versions (the
reference, and the CPU path). `triton` / `tl` are None on installs without Triton.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch versions run
    triton = tl = None


_FAILED: list[str] = []  # the first kernel failure of this process, if any


def available(device) -> bool:
    """Triton is installed, `device` is CUDA, and no kernel has failed in this process."""
    return triton is not None and not _FAILED and torch.device(device).type == "cuda"


def run(kernel, *args):
    """`kernel(*args)`, or None if it raises (a Triton build or launch failure on this GPU): the failure is logged
    once and every kernel is switched off for the process, so callers fall back to their torch versions."""
    try:
        return kernel(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler/driver error means: use the torch version
        if not _FAILED:
            from pipeline.log import get_logger

            get_logger("triton_runtime").warning(
                "Triton kernel %s failed (%s: %s): using the torch versions from now on", kernel.__name__,
                type(exc).__name__, exc)
        _FAILED.append(f"{kernel.__name__}: {exc}")
        return None


def pow2(n: int) -> int:
    """The smallest power of two >= n (Triton block sizes)."""
    return 1 << max(0, (n - 1).bit_length())
