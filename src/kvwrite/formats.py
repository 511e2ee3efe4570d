"""The cache formats: one record per format, the one place their facts live.

A *format* is what one cache row holds and how it is read back: the element each value becomes,
the tensor dtype that stores it, where its scales sit and what they cover, the bytes a row takes
and the op that reads it. The writers parse their mode argument into a :class:`Format` (or into
their own enum, whose value is the format's name) and ask it; the allocators size caches from
:meth:`Format.row_bytes`, the readers check rows with it, the benchmarks count bytes with it.

A row is one (token, head) of a flash cache (``head_size`` = D), one token of an MLA cache
(``head_size`` = L + P) or of the indexer's cache (``head_size`` = its D). Its bytes are the codes
plus every scale stored in the cache's memory (in the row, in the page, or in a scale cache: one
entry per row); scales passed as arguments (``k_scale``, ``scale``) are not part of a row.

Formats are grouped by the argument that names them (:class:`Family`): ``kv_cache_dtype`` of
the flash writers (``reshape_and_cache_flash`` and the ops that share its cache), ``kv_quant_mode``
of the per-token-head writer, ``kv_cache_dtype`` of ``concat_and_cache_mla`` and ``scale_fmt`` of
the indexer. The same spelling may name different formats in two families ("fp8" is per tensor or
per head in a flash cache, per tensor only in an MLA cache), so :func:`lookup` takes the family.

Adding a format: CONTRIBUTING.md, "Add a format".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from fractions import Fraction
from typing import NamedTuple

import torch

__all__ = [
    "Family",
    "Element",
    "Placement",
    "Granularity",
    "Scale",
    "Format",
    "FORMATS",
    "lookup",
    "formats_of",
    "spellings",
    "scale_is_per_head",
    "MlaMode",
    "DS_MLA_L",
    "DS_MLA_P",
    "DS_MLA_PE_DIMS",
    "DS_MLA_TILE",
    "DS_MLA_SCALES_OFFSET",
    "DS_MLA_PE_OFFSET",
    "DS_MLA_ENTRY",
    "NVFP4_GROUP",
    "MX_GROUP",
    "INDEXER_MXFP8_GROUP",
    "TurboQuantLayout",
    "TurboQuantPreset",
    "TurboQuantSlot",
    "TURBOQUANT_PRESETS",
    "turboquant_preset",
]


def scale_is_per_head(scale: torch.Tensor | None) -> bool:
    """Whether a validated fp8 scale (1 or H float32 values; None where there is none) is per
    head: head h uses ``scale[h]``; else every head uses ``scale[0]``.

    The one place that decides a scale's kind (the fp8 formats' :attr:`Scale.kind`; also
    importable as ``kvwrite.dtypes.scale_is_per_head``). Every launcher asks it of each scale
    tensor on its own: the contract lets ``k_scale`` and ``v_scale`` (and ``q_scale``) each be per
    tensor or per head, so one scale's kind never says another's. With H = 1 both kinds read the
    same value, so a [1] scale is per tensor.
    """
    return scale is not None and scale.numel() > 1


class Family(enum.Enum):
    """The writer whose argument names a format, and that argument."""

    FLASH = ("reshape_and_cache_flash", "kv_cache_dtype")
    PER_TOKEN_HEAD = ("reshape_and_cache_flash_per_token_head_quant", "kv_quant_mode")
    MLA = ("concat_and_cache_mla", "kv_cache_dtype")
    INDEXER = ("indexer_k_quant_and_cache", "scale_fmt")
    TURBOQUANT = ("reshape_and_cache_turboquant", "kv_cache_dtype")

    @property
    def writer(self) -> str:
        return self.value[0]

    @property
    def argument(self) -> str:
        return self.value[1]


class Element(enum.Enum):
    """What one value becomes, and its bits (None: the input's, a plain copy)."""

    COPY = ("copy", None)
    FLOAT16 = ("float16", 16)
    BFLOAT16 = ("bfloat16", 16)
    FLOAT32 = ("float32", 32)
    FP8_E4M3 = ("e4m3fn", 8)
    FP8_E5M2 = ("e5m2", 8)
    INT8 = ("int8", 8)
    INT4 = ("int4", 4)      # two a byte, even element in the low nibble
    E2M1 = ("e2m1", 4)      # NVFP4's and MXFP4's codes, two a byte, even element in the low nibble
    # TurboQuant's slot holds one coordinate's key code and value code (SPEC §10.1): the bits
    # of both, each packed in its own field of the slot.
    TQ_E4M3_U4 = ("e4m3fn key, 4-bit value", 12)
    TQ_I4_U4 = ("4-bit key index, 4-bit value", 8)
    TQ_I3_U4 = ("3-bit key index, 4-bit value", 7)
    TQ_I3_U3 = ("3-bit key index, 3-bit value", 6)

    @property
    def bits(self) -> int | None:
        return self.value[1]

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of one element's value (None: the input's, or a packed 4-bit code)."""
        return _ELEMENT_DTYPES.get(self)


_ELEMENT_DTYPES = {Element.FLOAT16: torch.float16, Element.BFLOAT16: torch.bfloat16,
                   Element.FLOAT32: torch.float32, Element.FP8_E4M3: torch.float8_e4m3fn,
                   Element.FP8_E5M2: torch.float8_e5m2, Element.INT8: torch.int8}


class Placement(enum.Enum):
    """Where a scale lives."""

    ARGUMENT = "argument"        # a tensor argument of the writer and the reader (k_scale, scale)
    IN_ROW = "in-row"            # bytes of the row itself, after (or between) its codes
    IN_PAGE = "in-page"          # the page's scale region, after the page's data region
    SCALE_CACHE = "scale-cache"  # its own cache tensor, one entry per row (may view the row's bytes)


class Granularity(enum.Enum):
    """Which values one scale covers."""

    TENSOR = "tensor"
    TENSOR_OR_HEAD = "tensor or head"  # decided per scale tensor by Scale.kind (scale_is_per_head)
    TOKEN_HEAD = "token-head"          # one per row
    BLOCK = "block"                    # one per Scale.group consecutive elements of a row


@dataclasses.dataclass(frozen=True)
class Scale:
    """One level of scales of a format.

    ``nbytes``: bytes of one stored scale (0 for arguments: not in the cache); ``group``: the
    elements one BLOCK scale covers (None: the writer's argument, the indexer's
    ``quant_block_size``); ``encoding``: how its bytes read; ``kind``: for TENSOR_OR_HEAD, the
    function that decides a scale tensor's kind."""

    placement: Placement
    granularity: Granularity
    encoding: str
    nbytes: int = 0
    group: int | None = None
    kind: object = None


@dataclasses.dataclass(frozen=True)
class Format:
    """One cache format. ``name`` is the canonical spelling (the writer's enum value);
    ``spellings`` every spelling users write (``name`` among them); ``storage`` the cache dtypes
    accepted, the first being what the allocators make (None: the input dtype); ``reader`` the op
    or function that reads it back; ``entry_bytes`` a fixed row size (fp8_ds_mla) that the head
    size does not change; ``head_size_multiple`` what D must divide into."""

    name: str
    family: Family
    spellings: tuple[str, ...]
    element: Element
    storage: tuple[torch.dtype, ...] | None
    scales: tuple[Scale, ...]
    reader: str
    entry_bytes: int | None = None
    head_size_multiple: int = 1

    # Derived once (the writers ask per call): the element's bits (None: the input's), the bytes
    # of stored per-row scales, and (bytes, elements) of each stored block scale.
    _bits: int | None = dataclasses.field(init=False, repr=False, compare=False)
    _row_scale_bytes: int = dataclasses.field(init=False, repr=False, compare=False)
    _blocks: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stored = [s for s in self.scales if s.placement is not Placement.ARGUMENT]
        derived = {
            "_bits": self.element.bits,
            "_row_scale_bytes": sum(s.nbytes for s in stored
                                    if s.granularity is Granularity.TOKEN_HEAD),
            "_blocks": tuple((s.nbytes, s.group) for s in stored
                             if s.granularity is Granularity.BLOCK),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def storage_dtypes(self, input_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The cache dtypes that fit this format for inputs of ``input_dtype``."""
        return (input_dtype,) if self.storage is None else self.storage

    def element_bits(self, input_dtype: torch.dtype | None = None) -> int:
        """Bits of one element's code (4 for the packed 4-bit elements)."""
        bits = self._bits
        if bits is None:
            if input_dtype is None:
                raise ValueError(f"input_dtype: format {self.name!r} stores the input's bits; "
                                 f"pass its dtype, got None")
            bits = 8 * input_dtype.itemsize
        return bits

    def element_bytes(self, input_dtype: torch.dtype | None = None) -> Fraction:
        """Bytes of one element's code (1/2 for the packed 4-bit elements)."""
        return Fraction(self.element_bits(input_dtype), 8)

    def data_bytes(self, head_size: int, input_dtype: torch.dtype | None = None) -> int:
        """Bytes of a row's codes (4-bit elements: an odd head size's last half byte is not
        counted; the writers refuse odd head sizes there)."""
        return head_size * self.element_bits(input_dtype) // 8

    def scale_bytes(self, head_size: int, group: int | None = None) -> int:
        """Bytes of the scales one row stores in the cache's memory (in the row, in its page or
        in a scale cache); ``group``: the writer's block size where the format takes one."""
        total = self._row_scale_bytes
        for nbytes, n in self._blocks:
            n = n if n is not None else group
            if n is None:
                raise ValueError(f"group: format {self.name!r} has a scale per block of the "
                                 f"writer's size; pass it, got None")
            total += head_size // n * nbytes
        return total

    def row_bytes(self, head_size: int, input_dtype: torch.dtype | None = None,
                  group: int | None = None) -> int:
        """Bytes one row takes: codes plus stored scales (fp8_ds_mla: its fixed entry)."""
        if self.entry_bytes is not None:
            return self.entry_bytes
        return self.data_bytes(head_size, input_dtype) + self.scale_bytes(head_size, group)

    def head_size_of(self, row_bytes: int, input_dtype: torch.dtype | None = None,
                     group: int | None = None) -> int | None:
        """The head size whose rows take ``row_bytes`` bytes (a multiple of
        ``head_size_multiple``), or None where there is none."""
        if self.entry_bytes is not None:
            raise ValueError(f"row_bytes: format {self.name!r} has a fixed entry of "
                             f"{self.entry_bytes} bytes; its head size is not a function of it")
        per_element = self.element_bytes(input_dtype)
        for nbytes, n in self._blocks:
            per_element += Fraction(nbytes, n if n is not None else group)
        fixed = self._row_scale_bytes
        d = (row_bytes - fixed) / per_element
        if d.denominator != 1 or d < 1 or d % self.head_size_multiple:
            return None
        d = int(d)
        return d if self.row_bytes(d, input_dtype, group) == row_bytes else None


# --- fp8_ds_mla's fixed geometry --------------------------------------------------------------
# 4 tiles of 128 latent values as e4m3, their 4 float32 scales, then the 64 rotary values' 16-bit
# patterns: 512 + 16 + 128 = 656 bytes per token. NoPE layers (k_pe [T, 0]) write the 128 rotary
# bytes as zeros.
DS_MLA_L = 512
DS_MLA_P = 64
DS_MLA_PE_DIMS = (DS_MLA_P, 0)
DS_MLA_TILE = 128
DS_MLA_SCALES_OFFSET = DS_MLA_L
DS_MLA_PE_OFFSET = DS_MLA_L + 4 * (DS_MLA_L // DS_MLA_TILE)
DS_MLA_ENTRY = DS_MLA_PE_OFFSET + 2 * DS_MLA_P

# NVFP4: one E4M3 scale byte per 16 elements.
NVFP4_GROUP = 16
# MXFP8/MXFP4 (OCP microscaling): one E8M0 scale byte per 32 elements, in a scale cache.
MX_GROUP = 32
# The indexer's "mxfp8" stores one UE8M0 byte per 32 elements of a group, 4 per slot: only
# groups of 128.
INDEXER_MXFP8_GROUP = 128


class MlaMode(enum.Enum):
    """How a cache entry is written: ``AUTO`` copies, ``FP8_E4M3``/``FP8_E5M2`` quantize with the one
    per-tensor scale (the fp8 rule), ``FP8_DS_MLA`` is DeepSeek's tiled format
    (docs/ops/concat_and_cache_mla.md). Each member's value is its format's name in
    :attr:`Family.MLA`."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP8_DS_MLA = "fp8_ds_mla"

    @property
    def format(self) -> Format:
        return _MLA_FORMATS[self]

    @property
    def uses_scale(self) -> bool:
        """Whether the writer takes the ``scale`` argument (the fp8 modes)."""
        return _MLA_USES_SCALE[self]

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The float8 dtype of the quantized latent values (None for AUTO)."""
        return self.format.element.dtype if self is not MlaMode.AUTO else None


# --- the table -----------------------------------------------------------------------------------

_F, _PTH, _MLA, _IDX = Family.FLASH, Family.PER_TOKEN_HEAD, Family.MLA, Family.INDEXER
_U8 = torch.uint8
# The fp8 argument scales: float32, per tensor or per head (kvwrite.dtypes' fp8 rule).
_FP8_SCALE = Scale(Placement.ARGUMENT, Granularity.TENSOR_OR_HEAD, "float32 multiplier",
                   kind=scale_is_per_head)
_MLA_FP8_SCALE = Scale(Placement.ARGUMENT, Granularity.TENSOR, "float32 multiplier")
_PTH_SCALE = Scale(Placement.SCALE_CACHE, Granularity.TOKEN_HEAD, "float32", 4)
_PTH_INT4_SCALE = Scale(Placement.SCALE_CACHE, Granularity.TOKEN_HEAD,
                        "float32, zero point in its low 4 bits", 4)
_NVFP4_SCALES = (Scale(Placement.IN_PAGE, Granularity.BLOCK, "e4m3fn", 1, NVFP4_GROUP),
                 Scale(Placement.ARGUMENT, Granularity.TENSOR, "float32 multiplier"))
_MX_SCALE = Scale(Placement.SCALE_CACHE, Granularity.BLOCK, "E8M0", 1, MX_GROUP)
_TQ = Family.TURBOQUANT
_TQ_NORM = Scale(Placement.IN_ROW, Granularity.TOKEN_HEAD, "float16 key norm", 2)
_TQ_VALUE_SCALES = (Scale(Placement.IN_ROW, Granularity.TOKEN_HEAD, "float16 value scale", 2),
                    Scale(Placement.IN_ROW, Granularity.TOKEN_HEAD, "float16 value zero", 2))
_TQ_READER = "turboquant_gather_cache"
_GATHER_FLASH = "gather_cache_flash"
_GATHER_MLA = "gather_and_maybe_dequant_cache"

FORMATS: tuple[Format, ...] = (
    # reshape_and_cache_flash's kv_cache_dtype (also reshape_and_cache and the fused writers).
    Format("auto", _F, ("auto",), Element.COPY, None, (), _GATHER_FLASH),
    Format("float16", _F, ("float16", "half"), Element.FLOAT16, (torch.float16,), (),
           _GATHER_FLASH),
    Format("bfloat16", _F, ("bfloat16",), Element.BFLOAT16, (torch.bfloat16,), (), _GATHER_FLASH),
    Format("float32", _F, ("float32", "float"), Element.FLOAT32, (torch.float32,), (),
           _GATHER_FLASH),
    Format("fp8_e4m3", _F, ("fp8_e4m3", "fp8"), Element.FP8_E4M3, (_U8, torch.float8_e4m3fn),
           (_FP8_SCALE,), _GATHER_FLASH),
    Format("fp8_e5m2", _F, ("fp8_e5m2",), Element.FP8_E5M2, (_U8, torch.float8_e5m2),
           (_FP8_SCALE,), _GATHER_FLASH),
    # vLLM's page layout: a block side is all its rows' codes, then all their scale bytes.
    Format("nvfp4", _F, ("nvfp4",), Element.E2M1, (_U8,), _NVFP4_SCALES, "nvfp4_gather_cache",
           head_size_multiple=NVFP4_GROUP),
    Format("nvfp4_4over6", _F, ("nvfp4_4over6",), Element.E2M1, (_U8,), _NVFP4_SCALES,
           "nvfp4_gather_cache", head_size_multiple=NVFP4_GROUP),
    # SGLang's microscaling caches: E4M3 or E2M1 codes in the data caches, one E8M0 byte per 32
    # elements in separate scale caches (which may view an inline row's tail).
    Format("mxfp8", _F, ("mxfp8",), Element.FP8_E4M3, (_U8, torch.float8_e4m3fn), (_MX_SCALE,),
           "mx_gather_cache", head_size_multiple=MX_GROUP),
    Format("mxfp4", _F, ("mxfp4",), Element.E2M1, (_U8,), (_MX_SCALE,), "mx_gather_cache",
           head_size_multiple=MX_GROUP),
    # reshape_and_cache_flash_per_token_head_quant's kv_quant_mode. vLLM's inline rows are the
    # codes then the 4 scale bytes (the scale cache views them); "separate" keeps them apart.
    Format("int8_per_token_head", _PTH, ("int8_per_token_head",), Element.INT8, (torch.int8,),
           (_PTH_SCALE,), "dequantize_per_token_head"),
    Format("fp8_per_token_head", _PTH, ("fp8_per_token_head",), Element.FP8_E4M3,
           (_U8, torch.float8_e4m3fn), (_PTH_SCALE,), "dequantize_per_token_head"),
    Format("int4_per_token_head", _PTH, ("int4_per_token_head",), Element.INT4, (_U8, torch.int8),
           (_PTH_INT4_SCALE,), "dequantize_per_token_head", head_size_multiple=2),
    # concat_and_cache_mla's kv_cache_dtype: one latent row (L + P values) per token.
    Format("auto", _MLA, ("auto",), Element.COPY, None, (), _GATHER_MLA),
    Format("fp8_e4m3", _MLA, ("fp8_e4m3", "fp8"), Element.FP8_E4M3, (_U8, torch.float8_e4m3fn),
           (_MLA_FP8_SCALE,), _GATHER_MLA),
    Format("fp8_e5m2", _MLA, ("fp8_e5m2",), Element.FP8_E5M2, (_U8, torch.float8_e5m2),
           (_MLA_FP8_SCALE,), _GATHER_MLA),
    Format("fp8_ds_mla", _MLA, ("fp8_ds_mla",), Element.FP8_E4M3, (_U8,),
           (Scale(Placement.IN_ROW, Granularity.BLOCK, "float32", 4, DS_MLA_TILE),),
           "cp_gather_and_upconvert_fp8_kv_cache", entry_bytes=DS_MLA_ENTRY),
    # indexer_k_quant_and_cache's scale_fmt: e4m3 codes, then 4 scale bytes per group of
    # quant_block_size elements, in the page's scale region. Any other string is "float32".
    Format("ue8m0", _IDX, ("ue8m0",), Element.FP8_E4M3, (_U8,),
           (Scale(Placement.IN_PAGE, Granularity.BLOCK, "float32 power of two", 4),),
           "cp_gather_indexer_k_quant_cache"),
    Format("mxfp8", _IDX, ("mxfp8",), Element.FP8_E4M3, (_U8,),
           (Scale(Placement.IN_PAGE, Granularity.BLOCK, "UE8M0 byte, 4 times", 4,
                  INDEXER_MXFP8_GROUP),),
           "cp_gather_indexer_k_quant_cache"),
    Format("float32", _IDX, ("float32",), Element.FP8_E4M3, (_U8,),
           (Scale(Placement.IN_PAGE, Granularity.BLOCK, "float32", 4),),
           "cp_gather_indexer_k_quant_cache"),
    # reshape_and_cache_turboquant's kv_cache_dtype: one slot per (token, head) holds K and V
    # (SPEC §10.1): the key codes (and the MSE presets' fp16 norm), the value codes, then the
    # values' fp16 scale and zero. TurboQuantPreset has the slot's fields and offsets.
    Format("turboquant_k8v4", _TQ, ("turboquant_k8v4",), Element.TQ_E4M3_U4, (_U8,),
           _TQ_VALUE_SCALES, _TQ_READER, head_size_multiple=2),
    Format("turboquant_4bit_nc", _TQ, ("turboquant_4bit_nc",), Element.TQ_I4_U4, (_U8,),
           (_TQ_NORM, *_TQ_VALUE_SCALES), _TQ_READER, head_size_multiple=2),
    Format("turboquant_k3v4_nc", _TQ, ("turboquant_k3v4_nc",), Element.TQ_I3_U4, (_U8,),
           (_TQ_NORM, *_TQ_VALUE_SCALES), _TQ_READER, head_size_multiple=8),
    Format("turboquant_3bit_nc", _TQ, ("turboquant_3bit_nc",), Element.TQ_I3_U3, (_U8,),
           (_TQ_NORM, *_TQ_VALUE_SCALES), _TQ_READER, head_size_multiple=8),
)

_BY_SPELLING = {(f.family, s): f for f in FORMATS for s in f.spellings}
# The indexer takes any string: vLLM stores plain float32 scales for all but its two names.
_FALLBACK = {Family.INDEXER: "float32"}


_MLA_FORMATS = {m: _BY_SPELLING[(Family.MLA, m.value)] for m in MlaMode}
_MLA_USES_SCALE = {m: any(s.placement is Placement.ARGUMENT for s in f.scales)
                   for m, f in _MLA_FORMATS.items()}


def formats_of(family: Family) -> tuple[Format, ...]:
    """The family's formats, in table order."""
    return tuple(f for f in FORMATS if f.family is family)


def spellings(family: Family) -> list[str]:
    """Every spelling of the family's formats, sorted (what error messages list)."""
    return sorted(s for f in formats_of(family) for s in f.spellings)


def lookup(spelling, family: Family = Family.FLASH) -> Format:
    """The :class:`Format` a spelling (a string, or a Format of the family) names in ``family``.
    The indexer maps any other string to "float32" (vLLM's rule). Raises ValueError naming the
    family's argument otherwise; the writers' enums are looked up by their ``.value``."""
    if isinstance(spelling, Format) and spelling.family is family:
        return spelling
    if isinstance(spelling, str):
        found = _BY_SPELLING.get((family, spelling))
        if found is None and family in _FALLBACK:
            found = _BY_SPELLING[(family, _FALLBACK[family])]
        if found is not None:
            return found
    raise ValueError(f"{family.argument}: expected one of {spellings(family)}, got {spelling!r}")


# --- TurboQuant's presets (SPEC §10.1) -------------------------------------------------------------

class TurboQuantLayout(NamedTuple):
    """The slot of a TurboQuant preset at one head size (SPEC §10.1): ``key_bits`` (8 for
    k8v4's e4m3fn codes, else the MSE index bits), ``value_bits``, ``norm_correction`` (the
    reader renormalizes the centroids), ``key_packed_size`` (KPS: key bytes, the MSE norm
    included), ``value_data_bytes`` (VDB), ``slot_size = KPS + VDB + 4`` and
    ``slot_size_aligned`` (rounded up to even: what vLLM allocates)."""

    key_bits: int
    value_bits: int
    norm_correction: bool
    key_packed_size: int
    value_data_bytes: int
    slot_size: int
    slot_size_aligned: int


@dataclasses.dataclass(frozen=True)
class TurboQuantSlot:
    """A preset at one head size: what the implementations' ``run`` receives as ``preset``.

    Byte offsets in the slot: the key codes at 0 (``key_index_bytes`` of them: D e4m3fn codes,
    or the MSE indices packed at ``key_bits`` each), the MSE presets' fp16 norm at
    ``norm_offset``, the value codes at ``value_offset`` (``value_data_bytes``, packed at
    ``value_bits``), the fp16 scale at ``scale_offset`` and the fp16 zero at ``zero_offset``.
    ``num_midpoints`` (2^b - 1, MSE presets; 0 for k8v4) and ``value_levels`` (L = 2^bv - 1)."""

    name: str
    head_size: int
    key_bits: int
    value_bits: int
    mse: bool
    norm_correction: bool
    key_index_bytes: int
    key_packed_size: int
    value_data_bytes: int
    slot_size: int
    slot_size_aligned: int
    num_midpoints: int
    value_levels: int

    @property
    def norm_offset(self) -> int:
        return self.key_index_bytes

    @property
    def value_offset(self) -> int:
        return self.key_packed_size

    @property
    def scale_offset(self) -> int:
        return self.key_packed_size + self.value_data_bytes

    @property
    def zero_offset(self) -> int:
        return self.scale_offset + 2

    @property
    def layout(self) -> TurboQuantLayout:
        return TurboQuantLayout(self.key_bits, self.value_bits, self.norm_correction,
                                self.key_packed_size, self.value_data_bytes, self.slot_size,
                                self.slot_size_aligned)


@dataclasses.dataclass(frozen=True)
class TurboQuantPreset:
    """One ``kv_cache_dtype`` of ``reshape_and_cache_turboquant``: key bits (8: k8v4's e4m3fn
    codes; 3 or 4: MSE indices with an fp16 norm), value bits, whether the reader renormalizes
    (the ``_nc`` presets). :meth:`at` gives its slot at a head size."""

    name: str
    key_bits: int
    value_bits: int
    norm_correction: bool

    @property
    def mse(self) -> bool:
        """Whether the keys are rotated and quantized to a codebook (all but k8v4)."""
        return self.key_bits != 8

    @property
    def format(self) -> Format:
        return lookup(self.name, Family.TURBOQUANT)

    def head_size_error(self, head_size: int) -> str | None:
        """Why the preset cannot take ``head_size`` (None: it can): 4-bit fields need D even,
        3-bit fields D % 8 == 0 (SPEC §10.1)."""
        m = self.format.head_size_multiple
        if head_size < 1 or head_size % m:
            what = "3-bit fields need head_size % 8 == 0" if m == 8 else \
                "4-bit fields need an even head_size"
            return f"kv_cache_dtype={self.name!r}: {what}, got {head_size}"
        return None

    def at(self, head_size: int) -> TurboQuantSlot:
        """The slot at ``head_size`` (ValueError naming ``head_size`` where the bit packing
        cannot take it)."""
        return _slot(self, head_size)


@functools.cache
def _slot(preset: TurboQuantPreset, head_size: int) -> TurboQuantSlot:
    why = preset.head_size_error(head_size)
    if why is not None:
        raise ValueError(f"head_size: {why}")
    d = head_size
    index_bytes = -(-d * preset.key_bits // 8)
    kps = index_bytes + (2 if preset.mse else 0)
    vdb = -(-d * preset.value_bits // 8)
    slot = kps + vdb + 4
    return TurboQuantSlot(preset.name, d, preset.key_bits, preset.value_bits, preset.mse,
                          preset.norm_correction, index_bytes, kps, vdb, slot, slot + slot % 2,
                          (1 << preset.key_bits) - 1 if preset.mse else 0,
                          (1 << preset.value_bits) - 1)


TURBOQUANT_PRESETS: tuple[TurboQuantPreset, ...] = (
    TurboQuantPreset("turboquant_k8v4", 8, 4, False),
    TurboQuantPreset("turboquant_4bit_nc", 4, 4, True),
    TurboQuantPreset("turboquant_k3v4_nc", 3, 4, True),
    TurboQuantPreset("turboquant_3bit_nc", 3, 3, True),
)
_TQ_PRESETS = {p.name: p for p in TURBOQUANT_PRESETS}


def turboquant_preset(kv_cache_dtype) -> TurboQuantPreset:
    """The preset a ``kv_cache_dtype`` string (or a preset, or its slot) names; ValueError naming
    ``kv_cache_dtype`` otherwise."""
    if isinstance(kv_cache_dtype, TurboQuantPreset):
        return kv_cache_dtype
    if isinstance(kv_cache_dtype, TurboQuantSlot):
        return _TQ_PRESETS[kv_cache_dtype.name]
    return _TQ_PRESETS[lookup(kv_cache_dtype, Family.TURBOQUANT).name]
