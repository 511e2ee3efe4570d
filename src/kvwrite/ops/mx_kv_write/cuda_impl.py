"""The CUDA implementation of the MX writes: not written yet (every call is refused, so the
preferred implementation that can run is the next one)."""

from __future__ import annotations

import torch

from ...formats import Format
from ...kernels import nvrtc

__all__ = ["available", "unsupported", "run"]

_NOT_YET = "not written yet"


def available(device: torch.device) -> str | None:
    return nvrtc.available(torch.device(device)) or _NOT_YET


def unsupported(key, key_cache, mode: Format, scale_layout: str) -> str | None:
    return _NOT_YET


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode: Format, scale_rule: str, scale_layout: str) -> None:
    raise NotImplementedError(f"{__name__}: {_NOT_YET}")
