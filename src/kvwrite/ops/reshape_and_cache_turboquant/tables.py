"""vLLM's TurboQuant tables, computed as SPEC §10.2 "Tables" states: the Sylvester Hadamard
rotation and the Lloyd-Max codebook of N(0, 1/D), in IEEE double, then rounded to float32."""

from __future__ import annotations

import functools
import math

import torch

from ...formats import turboquant_preset

__all__ = ["turboquant_tables", "hadamard", "lloyd_max_centroids"]

_ROUNDS = 200
_STEPS = 200
_TOLERANCE = 1e-10
_EMPTY = 1e-15


def hadamard(head_size: int) -> torch.Tensor:
    """The Sylvester Hadamard ``H_D`` in float32 divided by ``sqrt(D)`` as torch divides by a
    Python float (``H / math.sqrt(D)``), on the CPU; ``head_size`` a power of two."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < head_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(head_size)


def _trapezoid(f, a: float, b: float) -> float:
    h = (b - a) / _STEPS
    total = 0.5 * (f(a) + f(b))
    for i in range(1, _STEPS):
        total += f(a + i * h)
    return total * h


@functools.cache
def lloyd_max_centroids(head_size: int, bits: int) -> tuple[float, ...]:
    """The Lloyd-Max centroids (Python floats, ascending) of N(0, 1/D) at ``2^bits`` levels."""
    sigma2 = 1.0 / head_size
    sigma = math.sqrt(sigma2)
    norm = math.sqrt(2 * math.pi * sigma2)

    def p(x: float) -> float:
        return math.exp(-x * x / (2 * sigma2)) / norm

    def xp(x: float) -> float:
        return x * p(x)

    n = 1 << bits
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(_ROUNDS):
        edges = [3 * lo, *((c[i] + c[i + 1]) / 2 for i in range(n - 1)), 3 * hi]
        new = []
        for i in range(n):
            mass = _trapezoid(p, edges[i], edges[i + 1])
            new.append(_trapezoid(xp, edges[i], edges[i + 1]) / mass if mass > _EMPTY else c[i])
        if all(abs(a - b) < _TOLERANCE for a, b in zip(new, c, strict=True)):
            break
        c = new
    return tuple(c)


def turboquant_tables(head_size: int, kv_cache_dtype, device="cpu"
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(PiT, centroids, midpoints)`` of an MSE preset at ``head_size`` (a power of two, as
    vLLM's): float32 ``[D, D]``, ``[2^b]`` and ``[2^b - 1]`` on ``device``, with
    ``midpoints_k = RN(RN(c_k + c_{k+1}) / 2)``. ``turboquant_k8v4`` reads no tables: (None, None,
    None). ValueError naming ``kv_cache_dtype`` or ``head_size`` otherwise."""
    preset = turboquant_preset(kv_cache_dtype)
    if not preset.mse:
        return None, None, None
    slot = preset.at(head_size)
    d = slot.head_size
    if d & (d - 1):
        raise ValueError(f"head_size: vLLM's TurboQuant tables exist only for a power-of-two "
                         f"head size (its Sylvester Hadamard), got {d}; pass your own [D, D] "
                         f"PiT and midpoints to the op")
    centroids = torch.tensor(lloyd_max_centroids(d, preset.key_bits), dtype=torch.float32)
    pair = centroids[:-1] + centroids[1:]
    midpoints = pair / torch.full_like(pair, 2.0)
    return hadamard(d).to(device), centroids.to(device), midpoints.to(device)
