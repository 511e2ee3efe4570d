"""What every op's Triton implementation shares besides the fp8 rule: whether Triton can run a
kernel on a device here, the power-of-two rounding of tile sizes, and whether a launch takes
programmatic dependent launch."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from . import nvrtc

__all__ = ["available", "next_pow2", "pdl_launch"]


def available(device: torch.device, triton, kernel: Callable[[], object],
              import_error: Exception | None = None) -> str | None:
    """None where Triton can run ``kernel()`` (a ``triton.jit`` function, looked up only when
    triton imported) on ``device``, else why not: triton missing; a CPU without
    ``TRITON_INTERPRET=1``; or the variable set only after the kernel was defined."""
    if triton is None:
        return f"triton is not installed (pip install triton): {import_error}"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton runs on CPU only under its interpreter (set TRITON_INTERPRET=1)"
        if type(kernel()).__name__ != "InterpretedFunction":
            return ("TRITON_INTERPRET=1 was set after kvwrite's triton implementation was "
                    "imported; set it before importing triton")
        return None
    return f"triton runs on CUDA devices (or CPU under TRITON_INTERPRET=1), got device {device}"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def pdl_launch(device: torch.device, programs: int, max_programs: int,
               trigger_max_programs: int) -> tuple[bool, bool]:
    """(PDL, TRIGGER) of a Triton launch of ``programs`` programs: programmatic dependent launch
    (``PDL=True, launch_pdl=True``) where it is on (kvwrite.kernels.nvrtc.use_pdl,
    ``KVWRITE_PDL``), for at most ``max_programs`` programs, on a CUDA device of compute
    capability 9.0 or later with a Triton that has grid dependency control; and with it the early
    trigger of the next kernel (``pdl_entry``'s TRIGGER) for at most ``trigger_max_programs``."""
    if device.type != "cuda" or programs > max_programs:
        return False, False
    pdl = nvrtc.pdl_on() and _pdl_device(device.index if device.index is not None
                                          else torch.cuda.current_device())
    return pdl, pdl and programs <= trigger_max_programs


@functools.cache
def _pdl_device(index: int) -> bool:
    try:
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return False
    return (torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents"))
