"""swap_blocks in plain PyTorch (the reference; also the only implementation of host-to-host
calls): each layer's mapped blocks gathered with ``index_select`` and scattered with
``index_copy_`` on integer views of the elements' bits, moved between the host and the GPU, or
between two GPUs, with ``.to()``."""

from __future__ import annotations

import torch

from ...gather import bits_view
from ...transfer import TransferPlan, byte_blocks, mapped_pairs

__all__ = ["available", "unsupported", "run", "copy_blocks"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(plan: TransferPlan) -> str | None:
    return None


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> None:
    """``dst[j[m]] = src[i[m]]`` bit for bit, for every m (ids int64 on the host)."""
    if i.numel() == 0:
        return
    if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
        # A call across two GPUs is ordered by the destination's current stream (the caller
        # makes it wait for the source's writers): the gather, which runs on the source's
        # current stream, waits for it too. PyTorch's copy between the devices then orders the
        # destination's stream after the gather.
        torch.cuda.current_stream(src.device).wait_stream(torch.cuda.current_stream(dst.device))
    vals = bits_view(src).index_select(0, i.to(src.device))
    bits_view(dst).index_copy_(0, j.to(dst.device), vals.to(dst.device))


def run(plan: TransferPlan) -> None:
    src, dst = plan.args["src"], plan.args["dst"]
    i, j = mapped_pairs(plan, [t.shape[0] for t in src], [t.shape[0] for t in dst])
    size = plan.args.get("block_size_in_bytes")
    for a, b in zip(src, dst, strict=True):
        if size is not None:  # vLLM's form: the bytes of each block, whatever its dims
            a, b = byte_blocks(a, size), byte_blocks(b, size)
        copy_blocks(a, b, i, j)
