"""The MX group rule in plain PyTorch (SPEC §10.3): the scale exponent of a group of 32 elements
from the float32 bits of its amax, the elements scaled by it, their E4M3 or E2M1 codes; and the
exact decode the reader uses. The reference every implementation, reader and test compares with.

No logarithm and no division: the exponent comes from the amax's exponent field and mantissa
bits (integer operations), and ``x / 2^E`` is one float32 multiplication by the power of two
``2^-E`` built from its bits (exact but for results below 2^-126, which round once, as the
division would).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dtypes import CacheDType, quantize
from ...formats import MX_GROUP, Element
from ..nvfp4.rule import e2m1_codes, e2m1_values, pack_codes, unpack_codes

__all__ = ["GROUP", "SCALE_RULES", "SCALE_LAYOUTS", "ElementLimits", "LIMITS", "group_amax",
           "scale_exponent", "pow2", "encode_groups", "decode_groups", "scale_positions"]

GROUP = MX_GROUP  # elements per E8M0 scale byte (kvwrite.formats)
SCALE_RULES = ("ceil", "floor")
SCALE_LAYOUTS = ("linear", "interleaved128")
E_MIN, E_MAX = -127, 127  # the scale exponents a byte E + 127 holds (255, NaN, is never written)


@dataclasses.dataclass(frozen=True)
class ElementLimits:
    """The largest element ``M = m_M * 2^e_M`` (``max_value``, ``max_exp``), and ``m_M``'s 23
    float32 mantissa bits (``max_mantissa_bits``): ``"ceil"`` adds 1 to ``k - e_M`` where the
    amax's mantissa bits exceed them."""

    max_value: float
    max_exp: int
    max_mantissa_bits: int


LIMITS = {Element.FP8_E4M3: ElementLimits(448.0, 8, 0x600000),   # 1.75 * 2^8
          Element.E2M1: ElementLimits(6.0, 2, 0x400000)}         # 1.5 * 2^2


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 [N] max |x_i| over each row of ``x`` [N, 32] (float32), NaN skipped, +inf
    counted, 0 where none."""
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    return a.amax(dim=1)


def _bit_length(m: torch.Tensor) -> torch.Tensor:
    """Number of bits of non-negative int32 ``m`` < 2^23 (0 for 0): integer comparisons."""
    n = torch.zeros_like(m)
    for i in range(23):
        n += (m >= (1 << i)).to(m.dtype)
    return n


def scale_exponent(a: torch.Tensor, element: Element, rule: str) -> torch.Tensor:
    """int32 E [N] of amax ``a`` (float32 [N], >= 0 or +inf): -127 for 0, 127 for +inf; else
    with ``a = m * 2^k`` (1 <= m < 2, subnormals normalized), ``max(-127, k - e_M + [m > m_M])``
    (``"ceil"``) or ``clamp(k - e_M, -127, 127)`` (``"floor"``)."""
    lim = LIMITS[element]
    bits = a.contiguous().view(torch.int32)
    field = bits >> 23
    mant = bits & 0x7FFFFF
    # Subnormals (field 0): a = mant * 2^-149 = 1.f * 2^(p - 149) with p = bit_length(mant) - 1.
    # (Both rules then give E = -127: k <= -127 and e_M >= 2. Normalized as SPEC §10.3 writes
    # it; a kernel may take -127 for every amax below 2^-126.)
    p = _bit_length(mant) - 1
    sub = field == 0
    k = torch.where(sub, p - 149, field - 127)
    frac = torch.where(sub, (mant << (23 - p).clamp(min=0)) & 0x7FFFFF, mant)
    if rule == "ceil":
        e = (k - lim.max_exp + (frac > lim.max_mantissa_bits).to(torch.int32)).clamp(min=E_MIN)
    elif rule == "floor":
        e = (k - lim.max_exp).clamp(E_MIN, E_MAX)
    else:
        raise ValueError(f"scale_rule: expected one of {list(SCALE_RULES)}, got {rule!r}")
    e = torch.where(a == 0, torch.full_like(e, E_MIN), e)
    return torch.where(field == 255, torch.full_like(e, E_MAX), e)


def pow2(n: torch.Tensor) -> torch.Tensor:
    """float32 2^n of int32 ``n`` in [-127, 127], from its bits (2^-127 is the subnormal
    0x00400000)."""
    n = n.to(torch.int32)
    bits = torch.where(n >= -126, (n + 127) << 23, torch.full_like(n, 1 << 22))
    return bits.view(torch.float32)


def encode_groups(x: torch.Tensor, element: Element, rule: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on ``x`` [N, 32] (any float dtype, widened to float32 exactly): returns (uint8
    [N, 32] e4m3fn codes, or [N, 16] bytes of E2M1 codes, element 2j in the low nibble; uint8
    [N] scale bytes E + 127)."""
    x = x.float()
    if x.dim() != 2 or x.shape[1] != GROUP:
        raise ValueError(f"x: expected [N, {GROUP}], got {tuple(x.shape)}")
    e = scale_exponent(group_amax(x), element, rule)
    v = x * pow2(-e)[:, None]                 # RN(x / 2^E): one rounding, only below 2^-126
    if element is Element.FP8_E4M3:
        # §1.1 (clamp to +-448, then the nearest-even cast) with a unit scale: exact.
        one = torch.ones(1, dtype=torch.float32, device=x.device)
        codes = quantize(v[None], CacheDType.FP8_E4M3, one, torch.uint8)[0]
    elif element is Element.E2M1:
        codes = pack_codes(e2m1_codes(v))
    else:
        raise ValueError(f"element: expected E4M3 or E2M1, got {element}")
    return codes, (e + 127).to(torch.uint8)


def decode_groups(codes: torch.Tensor, scales: torch.Tensor, element: Element) -> torch.Tensor:
    """float32 [..., G, 32] ``RN(value(code) * 2^(B - 127))`` of codes (uint8 [..., G, 32]
    e4m3fn codes, or [..., G, 16] E2M1 bytes) and scale bytes B (uint8 [..., G]): byte 0 is
    2^-127, 255 is NaN; the product is exact but for overflow to +-inf."""
    if element is Element.FP8_E4M3:
        vals = codes.view(torch.float8_e4m3fn).float()
    else:
        vals = e2m1_values(unpack_codes(codes))
    b = scales.to(torch.int32)
    s = torch.where(b == 255, torch.full(b.shape, float("nan"), device=b.device),
                    pow2((b - 127).clamp(max=127)))
    return vals * s[..., None]


def scale_positions(offsets: torch.Tensor, num_heads: int, groups: int
                    ) -> tuple[torch.Tensor, ...]:
    """The interleaved128 index of (token offset o [n], head h, group g): ``(o // 128, o % 32,
    (o % 128) // 32, g)`` per dim 2-5 of ``[nb, H, bs/128, 32, 4, 4]``, each broadcast to
    [n, H, groups]; the head is dim 1."""
    o = offsets[:, None, None]
    h = torch.arange(num_heads, device=offsets.device)[None, :, None]
    g = torch.arange(groups, device=offsets.device)[None, None, :]
    return h, o // 128, o % 32, (o % 128) // 32, g
