"""Inputs of the transfer ops' tests (SPEC §9): tensors over random bytes with any strides,
offsets and padding, and the cases the conformance providers and tests/test_transfer.py share."""

from __future__ import annotations

import math

import torch

__all__ = ["random_view", "random_values", "mapping"]


def _elements(shape, stride, offset: int, pad: int) -> int:
    if any(n == 0 for n in shape):
        return offset + pad
    return offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1 + pad


def random_view(shape, stride=None, dtype=torch.bfloat16, *, offset: int = 0, pad: int = 5,
                seed: int = 0, device="cpu") -> torch.Tensor:
    """A view ``(shape, stride, offset)`` into an allocation of random bytes (``pad`` more
    elements past its last one): NaN and inf patterns included."""
    if stride is None:
        stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    es = torch.empty(0, dtype=dtype).element_size()
    n = _elements(shape, stride, offset, pad)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g).to(device)
    return raw.view(dtype).as_strided(tuple(shape), tuple(stride), offset)


def random_values(shape, stride=None, dtype=torch.bfloat16, *, offset: int = 0, pad: int = 5,
                  seed: int = 0, device="cpu", scale: float = 3.0) -> torch.Tensor:
    """As :func:`random_view` with finite normal values (what quantized pages are tested on)."""
    if stride is None:
        stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    n = _elements(shape, stride, offset, pad)
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(n, generator=g) * scale).to(dtype).to(device)
    return raw.as_strided(tuple(shape), tuple(stride), offset)


def mapping(pairs, dtype=torch.int64, *, odd_strides: bool = False, device="cpu") -> torch.Tensor:
    """An ``[n, 2]`` mapping of ``pairs``; ``odd_strides``: a transposed, strided view of a
    larger tensor (strides (2, 2n+1)... as the caller may hand one)."""
    m = torch.tensor(pairs, dtype=dtype).reshape(-1, 2)
    if odd_strides:
        big = torch.full((3, 2 * m.shape[0] + 1), -7, dtype=dtype)
        big[0:2, : 2 * m.shape[0]:2] = m.t()
        m = big[0:2, : 2 * m.shape[0]:2].t()
    return m.to(device)
