"""What every op's CUDA launcher shares (beside :mod:`kvwrite.kernels.nvrtc`, which builds and
launches): the launch cache keyed by the call signature, the loaded-variant record it holds, the
programmatic-dependent-launch policy field of the tuning classes, and the host-side alignment
and block-shift helpers that choose variants and fixed arguments.

A launcher's ``run`` builds the signature of its call (everything that selects the variant, the
CTA shape or a fixed kernel argument, the tuning included) and looks it up in its
:class:`LaunchCache`::

    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(...)  # plan, launch.require_setup(), load

so that a call whose signature was seen before does one dict lookup and no planning, then
launches ``lau.pick(ctas, tuning.pdl_max_ctas)``'s kernel with ``lau.fixed`` as its trailing
arguments.
"""

from __future__ import annotations

import dataclasses

import torch

from ..dtypes import CacheDType, scale_is_per_head
from . import nvrtc

__all__ = ["Launchable", "LaunchCache", "BoundedMemo", "PdlPolicy", "require_setup", "load",
           "align", "aligned", "log2_or_minus_1", "DT_F16", "DT_BF16", "DT_F32", "DT_E4M3",
           "DT_E5M2", "DT_COPY", "KIND", "kind", "int_type", "ptr", "scale_args", "FP8_KIND",
           "cache_kind", "thread_grid"]

# Element kinds, as DT_* in kvw/common.cuh (template arguments of every op's kernels).
DT_F16, DT_BF16, DT_F32, DT_E4M3, DT_E5M2, DT_COPY = range(6)
KIND = {torch.float16: DT_F16, torch.bfloat16: DT_BF16, torch.float32: DT_F32}
FP8_KIND = {CacheDType.FP8_E4M3: DT_E4M3, CacheDType.FP8_E5M2: DT_E5M2}


def cache_kind(cache_dtype: CacheDType, in_dtype: torch.dtype, cache_tensor: torch.dtype) -> int:
    """The element kind a write op stores: the fp8 format of an fp8 ``cache_dtype``, DT_COPY
    where the cache tensor holds the input's own dtype, else the cache tensor's float kind."""
    if cache_dtype.is_fp8:
        return FP8_KIND[cache_dtype]
    if cache_tensor == in_dtype:
        return DT_COPY
    return KIND[cache_tensor]


def kind(dtype: torch.dtype) -> int:
    """The element kind of a 16- or 32-bit float dtype."""
    return KIND[dtype]


def int_type(dtype: torch.dtype) -> str:
    """The C++ type of an index tensor's elements in a kernel's name expression."""
    return "long long" if dtype == torch.int64 else "int"


def ptr(t: torch.Tensor | None) -> int:
    """A tensor argument's address, 0 for an absent one."""
    return 0 if t is None else t.data_ptr()


def scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, ...]:
    """The write kernels' scale arguments (k_scale, v_scale, k per head, v per head): the
    pointers and 1 where a scale holds one value per head (0 per tensor); all 0 without scales
    (k_scale None: v_scale is too)."""
    if k_scale is None:
        return 0, 0, 0, 0
    return (k_scale.data_ptr(), v_scale.data_ptr(), int(scale_is_per_head(k_scale)),
            int(scale_is_per_head(v_scale)))


def log2_or_minus_1(n: int) -> int:
    """log2(n) where n is a power of two, else -1 (the kernels' shift-or-divide arguments, e.g.
    the block size's shift)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def align(values, most: int = 16) -> int:
    """The largest power of two, at most ``most`` (a power of two), dividing every value (byte
    offsets: pointers and strides in bytes; none: ``most``)."""
    v = most
    for b in values:
        v |= int(b)
    return v & -v


def aligned(ptr: int, nbytes: int) -> bool:
    """Whether address ``ptr`` suits an access of ``nbytes`` bytes (at most 16: the widest
    access, whose alignment covers the wider chunks made of it)."""
    return ptr % min(nbytes, 16) == 0


@dataclasses.dataclass(frozen=True)
class Launchable:
    """One call signature's loaded variant (compiled, or read from the kernel cache)."""

    kernel: object
    pdl_kernel: object  # the KVWRITE_PDL build, None where the device cannot take it
    device_index: int
    fixed: tuple        # the kernel's trailing int64 arguments (fixed by the signature)
    plan: object = None  # what the launcher derives each call's grid from (its plan, CTA shape)
    bounds: tuple = ()   # launcher-specific grid bounds measured when loading (occupancy)

    def pick(self, ctas: int, max_ctas: int) -> tuple[object, bool]:
        """(kernel, pdl): the PDL twin where a launch of ``ctas`` CTAs takes it
        (:func:`nvrtc.takes_pdl` with the tuning's ``pdl_max_ctas``), else the plain build."""
        pdl = nvrtc.takes_pdl(self.pdl_kernel, ctas, max_ctas)
        return (self.pdl_kernel if pdl else self.kernel), pdl


class BoundedMemo(dict):
    """Values by key, the ``size`` latest insertions kept (the oldest dropped first): the
    transfer launchers' launches of the last few cached plans (kvwrite.transfer's plan cache
    gives the same ``launch_key`` for the same jobs, pointers included)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key, value):
        """Store ``value`` under ``key`` and return it."""
        self[key] = value
        while len(self) > self.size:
            del self[next(iter(self))]
        return value


class LaunchCache(dict):
    """:class:`Launchable` by call signature, one cache per op and process (a plain dict: a
    lookup is the C one; tests swap in a fresh one or read ``values()``)."""


def thread_grid(num_tokens: int, per_token: int, threads: int, rows: str) -> int:
    """CTAs of ``threads`` threads for ``per_token`` threads a token: ValueError naming
    slot_mapping where the call's threads do not fit the kernels' 32-bit thread index (``rows``
    says what sets ``per_token``, e.g. "with this row length")."""
    total = num_tokens * per_token
    if total >= 2**32:
        raise ValueError(f"slot_mapping: at most {(2**32 - 1) // per_token} tokens per call "
                         f"{rows}, got {num_tokens}")
    return -(-total // threads)


def spread_threads(threads: int, total: int, min_ctas: int) -> int:
    """Threads per CTA for a call of ``total`` threads: ``threads``, halved down to 64 while the
    call would have fewer than ``min_ctas`` CTAs (a mid-sized call's threads spread over more
    SMs; the NVFP4 and MX writes' policy)."""
    while threads > 64 and -(-total // threads) < min_ctas:
        threads //= 2
    return threads


def require_setup() -> None:
    """RuntimeError saying what is missing where cuda.core, NVRTC or a GPU is not usable
    (:func:`nvrtc.setup_reason`): the first step of loading a variant."""
    reason = nvrtc.setup_reason()
    if reason is not None:
        raise RuntimeError(reason)


def load(source: nvrtc.KernelSource, name: str, fixed: tuple, index: int, specialize: bool, *,
         before: tuple = (), after: tuple = (), trigger: bool = True) -> tuple[object, object]:
    """``(kernel, pdl_kernel)`` of variant ``name`` for CUDA device ``index``
    (:func:`nvrtc.load_kernels`): built with the macros ``before``, ``fixed`` compiled in where
    ``specialize`` (the tuning's; else the generic build), then ``after``."""
    macros = tuple(before) + nvrtc.fixed_args_macros(fixed if specialize else None) + tuple(after)
    return nvrtc.load_kernels(source, name, macros, index, trigger=trigger)


@dataclasses.dataclass(frozen=True, eq=False)
class PdlPolicy:
    """The base of every CUDA tuning class: its programmatic-dependent-launch policy.

    eq=False: a tuning is hashed and compared by identity (it is part of every launch-cache
    signature, and a lookup should hash no fields); subclasses keep ``eq=False``.
    """

    # Calls of at most pdl_max_ctas CTAs take the build that starts with KVW_PDL_ENTRY
    # (nvrtc.PDL_MACRO) and launch with programmatic stream serialization where the device allows
    # it (kernels/nvrtc.py): scheduled while the kernel before them still runs, they wait for it
    # before reading anything. 0: never. Every call by default: measured, H200, rotated L2
    # (docs/tuning-log.md change 44), off -> on, no op had a point slower with it, e.g.
    # reshape_and_cache_flash H=128 D=128 bfloat16 NHD T=2 1.75 -> 1.45 us, HND 2.12 -> 1.51, fp8
    # T=16 2.63 -> 2.04, T=1024 1.8-2.4% less, T=65536 equal; rotary_embedding GQA(32,8,128) T=1
    # 2.26 -> 1.59 us, T=16 2.50 -> 1.80, T=16384 84.8 -> 84.1; concat_and_cache_mla auto T=1
    # 1.38 -> 1.08 us, T=65536 41.08 -> 40.40, fp8_ds_mla T=16 1.56 -> 1.24. (The gathers take
    # it as the write ops do; fused_rope_and_reshape_cache_flash's large-call build waits without
    # triggering the next kernel early, see its CudaTuning.)
    pdl_max_ctas: int = 1 << 30
