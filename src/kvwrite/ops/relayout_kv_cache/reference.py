"""relayout_kv_cache in plain PyTorch: swap_blocks' block copy over each side's head slice
(``[:, h0 : h0 + K]``)."""

from __future__ import annotations

import torch

from ...transfer import TransferPlan, mapped_pairs
from ..swap_blocks.reference import copy_blocks

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(plan: TransferPlan) -> str | None:
    return None


def run(plan: TransferPlan) -> None:
    a = plan.args
    k = a["heads"]
    i, j = mapped_pairs(plan, [t.shape[0] for t in a["src"]], [t.shape[0] for t in a["dst"]])
    for s, d in zip(a["src"], a["dst"], strict=True):
        copy_blocks(s.narrow(1, a["src_head"], k), d.narrow(1, a["dst_head"], k), i, j)
