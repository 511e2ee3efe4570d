"""Cache dtypes and the quantization rule (the fp8 rule).

`kv_cache_dtype` strings are parsed into :class:`CacheDType` at the API edge; everything past the
public op works with the enum.

The fp8 rule: convert ``x`` to float32 exactly, divide by the scale (a true IEEE division),
round to nearest even and saturate to the largest finite value (±448 for e4m3fn, ±57344 for
e5m2). ±inf saturates too, NaN stays NaN, the sign of zero is kept and subnormals are rounded,
not flushed. The scale is the dequantization multiplier: ``x ≈ fp8_value * scale``.
"""

from __future__ import annotations

import enum

import torch

from . import formats
from .formats import scale_is_per_head

__all__ = [
    "CacheDType",
    "FP8_MAX",
    "FLOAT8_FORMAT",
    "INPUT_DTYPES",
    "parse_kv_cache_dtype",
    "allowed_cache_dtypes",
    "quantize",
    "scale_is_per_head",
    "MODEL_DTYPES",
    "BENCH_DTYPES",
    "parse_model_dtype",
    "SCALE_FLOOR_1E4_BITS",
    "ue8m0_round_up",
]

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one table of model (input) dtype spellings: torch's names and vLLM's ("half", "float").
MODEL_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
# The spellings vLLM's benchmark scripts accept for --dtype (a subset of MODEL_DTYPES).
BENCH_DTYPES = ("half", "bfloat16", "float")


def parse_model_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """A float16/bfloat16/float32 torch dtype from a torch dtype or one of MODEL_DTYPES's names;
    ValueError naming ``name`` otherwise."""
    if isinstance(dtype, torch.dtype):
        dt = dtype
    elif isinstance(dtype, str) and dtype in MODEL_DTYPES:
        dt = MODEL_DTYPES[dtype]
    else:
        raise ValueError(f"{name}: expected a torch dtype or one of {sorted(MODEL_DTYPES)}, "
                         f"got {dtype!r}")
    if dt not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {dt}")
    return dt


class CacheDType(enum.Enum):
    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    # NVFP4 (docs/ops/nvfp4.md): 4-bit E2M1 codes with an E4M3 scale per 16 elements, in
    # vLLM's page layout; reshape_and_cache_flash only (parse_kv_cache_dtype(..., nvfp4=True)).
    NVFP4 = "nvfp4"
    NVFP4_4OVER6 = "nvfp4_4over6"
    # MXFP8/MXFP4 (SPEC §10.3): E4M3/E2M1 codes with an E8M0 scale per 32 elements in scale
    # caches; reshape_and_cache_flash only (parse_kv_cache_dtype(..., mx=True)).
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"

    @property
    def is_fp8(self) -> bool:
        return self in (CacheDType.FP8_E4M3, CacheDType.FP8_E5M2)

    @property
    def is_nvfp4(self) -> bool:
        return self in (CacheDType.NVFP4, CacheDType.NVFP4_4OVER6)

    @property
    def is_mx(self) -> bool:
        return self in (CacheDType.MXFP8, CacheDType.MXFP4)

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The torch float8 dtype whose bits the cache holds (fp8 modes only)."""
        if not self.is_fp8:
            raise KeyError(self)
        return _FORMATS[self].element.dtype

    def element_dtype(self, input_dtype: torch.dtype) -> torch.dtype:
        """The dtype of one cache element's value (float8 for fp8 modes, whatever the storage).
        The NVFP4 modes have none (4-bit codes with block scales): ValueError."""
        if self.is_nvfp4:
            raise ValueError(f"kv_cache_dtype={self.value!r} has no per-element dtype (4-bit codes "
                             f"and a scale byte per 16 elements in uint8 pages)")
        if self.is_mx:
            raise ValueError(f"kv_cache_dtype={self.value!r} has no per-element dtype (codes "
                             f"scaled by an E8M0 byte per 32 elements in scale caches)")
        return _FORMATS[self].element.dtype or input_dtype

    def element_size(self, input_dtype: torch.dtype) -> int:
        """Bytes of one cache element (its format's code bytes)."""
        self.element_dtype(input_dtype)  # the NVFP4 and MX modes have none
        return _FORMATS[self].data_bytes(1, input_dtype)


# Every spelling the API accepts, including vLLM's aliases ("fp8", "half", "float"): the flash
# formats' spellings (kvwrite.formats).
_ALIASES = {s: CacheDType(f.name) for f in formats.formats_of(formats.Family.FLASH)
            for s in f.spellings
            if not (CacheDType(f.name).is_nvfp4 or CacheDType(f.name).is_mx)}
# The NVFP4 spellings, accepted only where the caller says it writes them (nvfp4=True).
_NVFP4_ALIASES = {s: CacheDType(f.name) for f in formats.formats_of(formats.Family.FLASH)
                  for s in f.spellings if CacheDType(f.name).is_nvfp4}
# The MX spellings, accepted only where the caller says it writes them (mx=True).
_MX_ALIASES = {s: CacheDType(f.name) for f in formats.formats_of(formats.Family.FLASH)
               for s in f.spellings if CacheDType(f.name).is_mx}
# Each mode's format (the table's record: storage, scales, row bytes, reader).
_FORMATS = {c: formats.lookup(c.value) for c in CacheDType}

# torch's float8 dtypes and the fp8 format whose codes each holds (a float8 cache or query
# tensor): every check for "a float8 tensor" and every dtype -> format step asks this table.
FLOAT8_FORMAT = {torch.float8_e4m3fn: CacheDType.FP8_E4M3, torch.float8_e5m2: CacheDType.FP8_E5M2}

FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# float32(1e-4) (0x38D1B717), the floor of vLLM's power-of-two scales (DeepSeek's indexer and
# fp8_ds_mla's "pow2" rule apply it, the indexer before its division by 448, fp8_ds_mla after).
SCALE_FLOOR_1E4_BITS = 0x38D1B717


def ue8m0_round_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= s`` of positive float32 ``s``, from the bits as DeepSeek's
    ``fast_log2_ceil`` does: ``s`` itself when its 23 mantissa bits are zero (a power of two, and
    +inf), else ``2^(e+1)`` for ``s`` in ``(2^e, 2^(e+1))`` (a carry past 2^127 gives +inf; a
    subnormal ``s`` gives 2^-126, which callers' floors never reach).
    The Triton and CUDA twins: ``kvwrite.kernels.triton_fp8.ue8m0_round_up`` and kvw/fp8.cuh's
    ``ue8m0_round_up``; a float32 ``exp2(ceil(log2(s)))`` is not this (it can return ``2^e`` for
    ``s`` a few ulps above ``2^e``)."""
    bits = s.view(torch.int32)
    up = ((bits >> 23) + 1) << 23
    return torch.where((bits & 0x7FFFFF) != 0, up, bits).view(torch.float32)


def parse_kv_cache_dtype(kv_cache_dtype: str | CacheDType, *, nvfp4: bool = False,
                         mx: bool = False) -> CacheDType:
    """The :class:`CacheDType` of a spelling (or the enum itself). The NVFP4 modes ("nvfp4",
    "nvfp4_4over6") only with ``nvfp4=True`` (reshape_and_cache_flash and the allocator write
    them; every other op and the benchmark's per-element modes refuse them here); the MX modes
    ("mxfp8", "mxfp4") only with ``mx=True`` (reshape_and_cache_flash writes them)."""
    names = {**_ALIASES, **(_NVFP4_ALIASES if nvfp4 else {}), **(_MX_ALIASES if mx else {})}
    gated = ((nvfp4, _NVFP4_ALIASES, "the NVFP4 modes"), (mx, _MX_ALIASES, "the MX modes"))
    if isinstance(kv_cache_dtype, CacheDType):
        for allowed, spelled, what in gated:
            if kv_cache_dtype.value in spelled and not allowed:
                raise ValueError(f"kv_cache_dtype: expected one of {sorted(names)}, got "
                                 f"{kv_cache_dtype.value!r} ({what} are written by "
                                 f"reshape_and_cache_flash only)")
        return kv_cache_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in names:
        return names[kv_cache_dtype]
    hint = ""
    for _, spelled, what in gated:
        if isinstance(kv_cache_dtype, str) and kv_cache_dtype in spelled:
            hint = f" ({what} are written by reshape_and_cache_flash only)"
    raise ValueError(
        f"kv_cache_dtype: expected one of {sorted(names)}, got {kv_cache_dtype!r}{hint}"
    )


def allowed_cache_dtypes(cache_dtype: CacheDType, input_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache tensor dtypes that fit `cache_dtype` for inputs of `input_dtype` (its format's
    storage dtypes)."""
    return _FORMATS[cache_dtype].storage_dtypes(input_dtype)


def quantize(x: torch.Tensor, cache_dtype: CacheDType, scale: torch.Tensor | None,
             out_dtype: torch.dtype) -> torch.Tensor:
    """`Q(x)` of the fp8 rule for rows ``x`` of shape ``[T, H, D]``; returns ``out_dtype`` bits.

    ``scale`` (fp8 only) holds 1 or H float32 values; head h uses ``scale[h]``.
    """
    if cache_dtype.is_nvfp4:
        raise ValueError(f"kv_cache_dtype={cache_dtype.value!r}: not a per-element rule (see "
                         f"kvwrite.ops.nvfp4)")
    if cache_dtype.is_mx:
        raise ValueError(f"kv_cache_dtype={cache_dtype.value!r}: not a per-element rule (see "
                         f"kvwrite.ops.mx_kv_write)")
    if cache_dtype is CacheDType.AUTO:
        return x
    if not cache_dtype.is_fp8:
        return x.to(cache_dtype.element_dtype(x.dtype))
    fp8 = cache_dtype.fp8_dtype
    s = scale.reshape(1, -1, 1) if scale_is_per_head(scale) else scale.reshape(1, 1, 1)
    y = x.float() / s
    # Clamp before the cast: some PyTorch versions cast overflow (and inf) to NaN.
    y = y.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    return y.view(torch.uint8) if out_dtype == torch.uint8 else y
