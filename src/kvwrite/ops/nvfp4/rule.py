"""The NVFP4 group rule in plain PyTorch (docs/ops/nvfp4.md, "One group of 16 elements"): the
reference every implementation, reader and test compares against.

Each step is one IEEE binary32 operation rounded to nearest even, written as one PyTorch op on
float32 tensors of one device, so nothing fuses and nothing is approximated. Every divisor is a
tensor on the data's device: PyTorch's CUDA division by a CPU scalar multiplies by a reciprocal.
The in-order error sum of "nvfp4_4over6" is an explicit loop (``tensor.sum`` reduces pairwise).
"""

from __future__ import annotations

import torch

from ...formats import NVFP4_GROUP

__all__ = ["GROUP", "E2M1_VALUES", "E4M3_MAX", "e2m1_codes", "e2m1_values", "e4m3_code",
           "e4m3_value", "quantize_groups", "pack_codes", "unpack_codes", "scale_tensor"]

GROUP = NVFP4_GROUP  # elements per E4M3 scale byte (kvwrite.formats)
# value(c) of the E2M1 codes 0-7; bit 3 is the sign (0x8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
# E2M1(|v|) is the number of these thresholds |v| passes: (t, strict). Ties go to the even code.
E2M1_THRESHOLDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
                   (3.5, False), (5.0, True))


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0-15 of float32 ``v``: NaN -> 0x7; else bit 3 = signbit(v), bits 0-2 the
    nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 to |v| (ties to the even code, saturating at 6)."""
    m = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t, strict in E2M1_THRESHOLDS:
        code += (m > t) if strict else (m >= t)
    code |= torch.signbit(v).to(torch.uint8) << 3
    return torch.where(torch.isnan(v), torch.full_like(code, 0x7), code)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value(c) of uint8 codes (0x8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long() & 15]


def e4m3_code(s: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn codes of float32 ``s``: nearest even, subnormals rounded, +-448 and beyond
    (inf too) saturating to +-448."""
    return s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of uint8 e4m3fn codes (exact)."""
    return codes.view(torch.float8_e4m3fn).float()


def scale_tensor(k, device: torch.device) -> torch.Tensor:
    """``k`` (a one-element float32 tensor or a float32-representable Python float) as a 0-dim
    float32 tensor on ``device``."""
    if isinstance(k, torch.Tensor):
        return k.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(k, dtype=torch.float32, device=device)


def _candidate(x: torch.Tensor, a: torch.Tensor, k: torch.Tensor, c: float):
    """(S codes, E2M1 codes, d) of the groups ``x`` [N, 16] with amax ``a`` [N] for the
    denominator ``c`` (6 for "nvfp4", 6 and 4 for "nvfp4_4over6")."""
    ones = torch.ones_like(a)
    ka = k.expand(a.shape)
    den = ka * torch.full_like(a, c)                    # RN(c * k)
    s = a / den                                         # RN(a / RN(c * k))
    S = e4m3_code(s)                                    # E4M3, saturating
    d = e4m3_value(S) * ka                              # RN(float(S) * k)
    r = torch.where(d == 0, torch.zeros_like(d), ones / d)  # 0, or RN(1 / d)
    codes = e2m1_codes(x * r[:, None])                  # E2M1(RN(x_i * r))
    return S, codes, d


def _error(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """e = sum over i = 0..15, in order, of RN(delta_i^2), delta_i = RN(RN(value(c_i) * d) - x_i);
    each addition rounded."""
    prod = e2m1_values(codes) * d[:, None]
    delta = prod - x
    sq = delta * delta
    e = sq[:, 0].clone()
    for i in range(1, GROUP):
        e = e + sq[:, i]
    return e


def quantize_groups(x: torch.Tensor, k, four_over_six: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on ``x`` [N, 16] (any float dtype, converted to float32 exactly) with the
    per-tensor scale ``k`` (one-element float32 tensor or float32 Python number): returns
    (codes uint8 [N, 16] with values 0-15, S uint8 [N] e4m3fn codes)."""
    x = x.float()
    if x.dim() != 2 or x.shape[1] != GROUP:
        raise ValueError(f"x: expected [N, {GROUP}], got {tuple(x.shape)}")
    k = scale_tensor(k, x.device)
    # amax with NaN skipped (fmaxf's rule), from 0; +inf counts.
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(dim=1) \
        if x.shape[0] else torch.zeros(0, dtype=torch.float32, device=x.device)
    S, codes, d = _candidate(x, a, k, 6.0)
    if not four_over_six:
        return codes, S
    S4, codes4, d4 = _candidate(x, a, k, 4.0)
    use4 = _error(x, codes4, d4) < _error(x, codes, d)  # NaN or equal errors keep 6
    return torch.where(use4[:, None], codes4, codes), torch.where(use4, S4, S)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes: element 2j in the low nibble, 2j + 1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (the inverse of :func:`pack_codes`)."""
    lo, hi = data & 15, data >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)
