"""Argument checks shared by every public op: each raises TypeError or ValueError naming the
argument, what was expected and what came, before anything is written."""

from __future__ import annotations

import torch

__all__ = ["shape_str", "require_tensor", "require_same_device", "check_slot_dtype"]


def shape_str(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def require_same_device(device: torch.device, what: str, named: tuple) -> None:
    """Every ``(name, tensor)`` of ``named`` is on ``device`` (``what`` names whose device it is)."""
    for name, t in named:
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of {what}), got {t.device}")


def check_slot_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected dtype int64 or int32, got {t.dtype}")
