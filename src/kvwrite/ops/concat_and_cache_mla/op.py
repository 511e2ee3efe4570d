"""concat_and_cache_mla: the public op, its validation, its torch.compile custom op, the mode enum
and the cache allocation helper (docs/ops/concat_and_cache_mla.md)."""

from __future__ import annotations

import enum

import torch

from ... import formats, registry
from ...dtypes import INPUT_DTYPES
from ...formats import (  # noqa: F401  (re-exported: their home was here)
    DS_MLA_ENTRY,
    DS_MLA_L,
    DS_MLA_P,
    DS_MLA_PE_DIMS,
    DS_MLA_PE_OFFSET,
    DS_MLA_SCALES_OFFSET,
    DS_MLA_TILE,
    MlaMode,
)
from ...validation import (
    check_like,
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape

__all__ = ["OP", "MlaMode", "parse_mla_mode", "DsMlaScale", "DEFAULT_DS_MLA_SCALE",
           "parse_ds_mla_scale", "concat_and_cache_mla", "validate", "create_mla_cache",
           "entry_size", "DS_MLA_L", "DS_MLA_P", "DS_MLA_ENTRY", "DS_MLA_TILE",
           "select_implementation"]

OP = "concat_and_cache_mla"

# The modes' formats: kvwrite.formats (fp8_ds_mla's fixed geometry, the DS_MLA_* constants and
# MlaMode live there; imported here so their old names keep working).


def parse_mla_mode(kv_cache_dtype: str | MlaMode) -> MlaMode:
    if isinstance(kv_cache_dtype, MlaMode):
        return kv_cache_dtype
    return MlaMode(formats.lookup(kv_cache_dtype, formats.Family.MLA).name)


class DsMlaScale(enum.Enum):
    """fp8_ds_mla's tile scale rule (docs/ops/concat_and_cache_mla.md), from ``r = RN(amax / 448)``:
    ``POW2`` (vLLM 0.33 and later) the smallest power of two ``>= max(r, float32(1e-4))``,
    ``AMAX`` (earlier vLLM) ``max(r, FLT_MIN)``."""

    POW2 = "pow2"
    AMAX = "amax"


# The public op's default (vLLM 0.33's rule); outside fp8_ds_mla ds_mla_scale must be left at it.
DEFAULT_DS_MLA_SCALE = DsMlaScale.POW2


def parse_ds_mla_scale(ds_mla_scale: str | DsMlaScale, mode: MlaMode) -> DsMlaScale:
    """The :class:`DsMlaScale` of a spelling (or the enum itself), for a call in ``mode``:
    ValueError naming ``ds_mla_scale`` for any other value, and for a value other than the default
    outside fp8_ds_mla (only fp8_ds_mla has tile scales)."""
    if isinstance(ds_mla_scale, DsMlaScale):
        rule = ds_mla_scale
    else:
        names = [r.value for r in DsMlaScale]
        if not isinstance(ds_mla_scale, str) or ds_mla_scale not in names:
            raise ValueError(f"ds_mla_scale: expected one of {names}, got {ds_mla_scale!r}")
        rule = DsMlaScale(ds_mla_scale)
    if mode is not MlaMode.FP8_DS_MLA and rule is not DEFAULT_DS_MLA_SCALE:
        raise ValueError(f"ds_mla_scale: only kv_cache_dtype='fp8_ds_mla' has tile scales; with "
                         f"kv_cache_dtype={mode.value!r} leave it at its default "
                         f"{DEFAULT_DS_MLA_SCALE.value!r}, got {rule.value!r}")
    return rule


def entry_size(mode: MlaMode, kv_lora_rank: int, pe_dim: int) -> int:
    """The cache's last dim: ``L + P`` elements, or 656 bytes for fp8_ds_mla (the mode's format's
    row, counted in cache elements)."""
    f = mode.format
    return f.entry_bytes if f.entry_bytes is not None else kv_lora_rank + pe_dim


def _allowed_cache_dtypes(mode: MlaMode, input_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return mode.format.storage_dtypes(input_dtype)


def create_mla_cache(num_blocks: int, block_size: int, kv_lora_rank: int, pe_dim: int,
                     kv_cache_dtype: str | MlaMode = "auto", dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cuda") -> torch.Tensor:
    """A zeroed contiguous ``[num_blocks, block_size, E]`` cache for ``kv_cache_dtype``: ``E = L + P``
    of ``dtype`` ("auto") or uint8 (fp8 modes, vLLM's storage), ``E = 656`` uint8 (fp8_ds_mla, which
    needs L = 512, P = 64 or 0 (NoPE) and a 16-bit ``dtype``)."""
    mode = parse_mla_mode(kv_cache_dtype)
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("kv_lora_rank", kv_lora_rank), ("pe_dim", pe_dim)):
        if name == "pe_dim" and mode is MlaMode.FP8_DS_MLA and v == 0:
            continue  # NoPE: fp8_ds_mla only (_check_ds_geometry)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    if mode is MlaMode.FP8_DS_MLA:
        _check_ds_geometry(kv_lora_rank, pe_dim, dtype)
    cache_dtype = mode.format.storage_dtypes(dtype)[0]  # vLLM's storage: uint8 when quantized
    return torch.zeros(num_blocks, block_size, entry_size(mode, kv_lora_rank, pe_dim),
                       dtype=cache_dtype, device=device)


def _check_ds_geometry(kv_lora_rank: int, pe_dim: int, dtype: torch.dtype,
                       names: tuple[str, str, str] = ("kv_lora_rank", "pe_dim", "dtype")) -> None:
    if kv_lora_rank != DS_MLA_L:
        raise ValueError(f"{names[0]}: kv_cache_dtype='fp8_ds_mla' needs kv_lora_rank {DS_MLA_L}, "
                         f"got {kv_lora_rank}")
    if pe_dim not in DS_MLA_PE_DIMS:
        raise ValueError(f"{names[1]}: kv_cache_dtype='fp8_ds_mla' needs pe_dim {DS_MLA_P} (or 0: "
                         f"NoPE), got {pe_dim}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{names[2]}: kv_cache_dtype='fp8_ds_mla' needs float16 or bfloat16 input, "
                         f"got {dtype}")


def validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale=None, *,
             ds_mla_scale: str | DsMlaScale = DEFAULT_DS_MLA_SCALE) -> MlaMode:
    """Check every argument of :func:`concat_and_cache_mla`; return the parsed mode.

    Raises TypeError/ValueError naming the argument, what was expected and what came.
    """
    mode = parse_mla_mode(kv_cache_dtype)
    parse_ds_mla_scale(ds_mla_scale, mode)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                    ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    if kv_c.dim() != 2:
        raise ValueError(f"kv_c: expected 2 dims [num_tokens, kv_lora_rank], got shape {_shape(kv_c)}")
    if k_pe.dim() != 2:
        raise ValueError(f"k_pe: expected 2 dims [num_tokens, pe_dim], got shape {_shape(k_pe)}")
    if kv_c.dtype not in INPUT_DTYPES:
        raise ValueError(f"kv_c: expected dtype float16, bfloat16 or float32, got {kv_c.dtype}")
    check_like("k_pe", k_pe, "kv_c", kv_c, "dtype")
    t_pad, kv_lora_rank = kv_c.shape
    pe_dim = k_pe.shape[1]
    if k_pe.shape[0] != t_pad:
        raise ValueError(f"k_pe: expected {t_pad} rows (those of kv_c), got shape {_shape(k_pe)}")
    # pe_dim 0 (NoPE layers) is fp8_ds_mla's only (_check_ds_geometry below).
    if kv_lora_rank < 1 or (pe_dim < 1 and mode is not MlaMode.FP8_DS_MLA):
        raise ValueError(f"kv_c, k_pe: expected kv_lora_rank >= 1 and pe_dim >= 1 (pe_dim 0 only "
                         f"with kv_cache_dtype='fp8_ds_mla'), got {kv_lora_rank} and {pe_dim}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: expected a unit-stride last dim, got strides {tuple(t.stride())}")
    if mode is MlaMode.FP8_DS_MLA:
        _check_ds_geometry(kv_lora_rank, pe_dim, kv_c.dtype,
                           ("kv_c", "k_pe", "kv_c"))

    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected 3 dims [num_blocks, block_size, entry_size], got "
                         f"shape {_shape(kv_cache)}")
    entry = entry_size(mode, kv_lora_rank, pe_dim)
    what = "656 bytes (fp8_ds_mla)" if mode is MlaMode.FP8_DS_MLA else \
        f"kv_lora_rank + pe_dim = {kv_lora_rank} + {pe_dim}"
    if kv_cache.shape[2] != entry:
        raise ValueError(f"kv_cache: expected a last dim of {what} = {entry}, got shape "
                         f"{_shape(kv_cache)}")
    if kv_cache.stride(2) != 1:
        raise ValueError(f"kv_cache: expected a unit-stride last dim, got strides "
                         f"{tuple(kv_cache.stride())}")
    allowed = _allowed_cache_dtypes(mode, kv_c.dtype)
    if kv_cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise ValueError(f"kv_cache: kv_cache_dtype={mode.value!r} with {kv_c.dtype} input expects "
                         f"a cache of dtype {names}, got {kv_cache.dtype}")

    check_token_indices("slot_mapping", slot_mapping, t_pad, "kv_c.shape[0]")
    device = kv_c.device
    require_same_device(device, "kv_c", (("k_pe", k_pe), ("kv_cache", kv_cache),
                                         ("slot_mapping", slot_mapping)))
    if mode.uses_scale:
        if scale is None:
            raise ValueError(f"scale: kv_cache_dtype={mode.value!r} needs a float32 tensor of 1 "
                             "element, got None")
        require_tensor("scale", scale)
        if scale.dtype != torch.float32:
            raise ValueError(f"scale: expected dtype float32, got {scale.dtype}")
        if scale.numel() != 1:
            raise ValueError(f"scale: expected 1 element (one per-tensor scale), got {scale.numel()}")
        if scale.device != device:
            raise ValueError(f"scale: expected device {device} (that of kv_c), got {scale.device}")
    check_mutation_safe(outputs=(("kv_cache", kv_cache),),
                        inputs=(("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping),
                                ("scale", scale if mode.uses_scale else None)))
    return mode


def select_implementation(kv_c, kv_cache, mode: MlaMode, implementation: str | None = None,
                          ) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (kv_c, kv_cache, mode), implementation)


@registry.custom_op(OP, mutates=("kv_cache",))
def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                         scale: torch.Tensor | None = None, *,
                         ds_mla_scale: str = DEFAULT_DS_MLA_SCALE.value,
                         implementation: str | None = None) -> None:
    """Write one latent row per token into an MLA cache; mutates ``kv_cache``.

    For each token ``t < T = slot_mapping.numel()`` whose slot ``s`` satisfies
    ``0 <= s < num_blocks * block_size``, entry ``kv_cache[s // block_size, s % block_size]`` gets:

    - "auto": ``kv_c[t]`` then ``k_pe[t]`` (bits copied; cache dtype = input dtype);
    - "fp8"/"fp8_e4m3"/"fp8_e5m2": both quantized by the fp8 rule with the one ``scale``
      (``fp8(float32(x) / scale)``, saturating), into a uint8 or float8 cache;
    - "fp8_ds_mla" (L = 512, P = 64 or 0, float16/bfloat16 input, uint8 cache of last dim 656):
      bytes ``[0, 512)`` the 4 tiles of 128 ``kv_c`` values as e4m3 of ``x / s_j``, from
      ``r_j = amax_j / 448`` (``amax_j`` the largest ``|x|`` of tile j, NaN ignored; an all-NaN
      tile has amax 0) by ``ds_mla_scale``: "pow2" (the default, vLLM 0.33) ``s_j`` = the
      smallest power of two ``>= max(r_j, float32(1e-4))``, "amax" (earlier vLLM)
      ``s_j = max(r_j, 2^-126)``; bytes ``[512, 528)`` ``s_0..s_3`` as float32, bytes
      ``[528, 656)`` the 16-bit patterns of ``k_pe[t]``, zeros when ``P = 0`` (NoPE layers).
      ``scale`` is not used; ``ds_mla_scale`` must be left at its default in the other modes.

    No other byte of the cache changes. Negative slots (padding) and slots past the cache are
    skipped; rows past T are never read; T == 0 is a no-op; which of two tokens with one slot wins
    is undefined.

    Shapes: ``kv_c`` ``[T_pad, L]``, ``k_pe`` ``[T_pad, P]`` (float16/bfloat16/float32, unit last
    stride, any token stride: ``k_pe`` may be ``latent[:, L:]``); ``kv_cache``
    ``[num_blocks, block_size, E]`` with any strides but a unit last one; ``slot_mapping`` ``[T]``
    int64 or int32; ``scale`` a 1-element float32 tensor on the device (fp8 modes), read there (no
    host sync), so a captured CUDA graph sees new values. :func:`create_mla_cache` allocates.
    """
    mode = validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                    ds_mla_scale=ds_mla_scale)
    rule = parse_ds_mla_scale(ds_mla_scale, mode)
    info = select_implementation(kv_c, kv_cache, mode, implementation)
    if slot_mapping.numel() == 0:
        return
    info.run(kv_c, k_pe, kv_cache, slot_mapping, mode, scale if mode.uses_scale else None,
             ds_scale=rule)
