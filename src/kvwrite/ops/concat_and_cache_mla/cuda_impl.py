"""The CUDA implementation of concat_and_cache_mla: ``kernel.cu`` compiled at run time with NVRTC
(through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

Two kernels (see ``kernel.cu``): ``concat_and_cache_mla_kernel`` for "auto" and the per-tensor
fp8 modes (one thread per chunk of VEC elements of a token's row), and
``concat_and_cache_ds_mla_kernel`` for "fp8_ds_mla" (one warp per token; the tile amax is a warp
reduction over the registers that hold the row).

Variants (template arguments): for the first, the input dtype, the element kind written (a copy
of the input bits, fp8 e4m3 or e5m2), VEC and the slot index type; VEC is the widest chunk of at
most ``CudaTuning.chunk_bytes_copy``/``chunk_bytes_fp8`` of input (16 B: one access; 32 B: two)
such that ``L`` and ``P`` are multiples of it and every row start (inputs and cache) is aligned
to it, halving down to one element. For the second, the input dtype, ALIGN (the common
alignment in bytes of every row start, 16 at most: the widths of its accesses), the slot
type, BRACKET (large calls quantize through the bracket, ``CudaTuning.ds_bracket_bytes``) and
POW2 (the tile scale rule, ``ds_mla_scale``); NoPE rows (P = 0) are a fixed argument (the lanes
that load ``k_pe``: 8 or 0), not a variant.
By default each call signature gets its own build with the arguments fixed by the caches and the
inputs' layout compiled in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; the scale is read on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import launch, nvrtc
from .op import DEFAULT_DS_MLA_SCALE, DsMlaScale, MlaMode

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "all_kernel_names",
           "compile_kernel", "SOURCE", "Plan", "is_small_call", "ds_uses_bracket"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_concat_and_cache_mla")
KERNEL = "concat_and_cache_mla_kernel"
DS_KERNEL = "concat_and_cache_ds_mla_kernel"

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32, _E4M3, _E5M2, _COPY = range(6)
_KIND = launch.KIND
_OUT = {MlaMode.AUTO: _COPY, MlaMode.FP8_E4M3: _E4M3, MlaMode.FP8_E5M2: _E5M2}
_ALIGNS = (16, 8, 4, 2, 1)


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a path)."""

    # Threads per CTA of the per-chunk kernel (a multiple of 32, at most 256).
    threads: int = 256
    # Input bytes per chunk: 16 (one access) for copies, 32 (two 16-byte loads, 16 bytes of fp8
    # out) for fp8, as reshape_and_cache_flash measured best for its copies and fp8 writes.
    chunk_bytes_copy: int = 16
    chunk_bytes_fp8: int = 32
    # Small fp8 calls (at most small_call_bytes of kv_c and k_pe input) take 16-byte chunks:
    # twice the threads, each with half the chain. H200, T=16: 1.40 vs 1.57 us (hot L2), 1.99
    # vs 2.14 us (rotated); at T=16384 and 65536 16-byte chunks are slower (9.9 vs 9.0 us, 34.0
    # vs 29.4 us, rotated).
    small_call_bytes: int = 512 * 1024
    small_chunk_bytes_fp8: int = 16
    # Tokens (warps) per CTA of the fp8_ds_mla kernel (at most 8).
    ds_warps: int = 4
    # fp8_ds_mla calls with more than ds_bracket_bytes of kv_c and k_pe input (bfloat16: more
    # than 10922 tokens) quantize through the bracket (kernel.cu's BRACKET): fewer instructions
    # per token. H200, rotated L2, quotient -> bracket: T=65536 32.3 -> 30.6 us with consecutive
    # slots, 34.0 -> 33.5 with random ones; T=32768 17.19 -> 16.33, 18.11 -> 17.94; T=12288
    # 7.73 -> 7.58, 8.18 -> 8.18. Smaller calls are latency-bound and the bracket's longer
    # chain costs them: T=16 1.54 -> 1.75 us hot, T=6144 4.95 -> 5.04 rotated.
    ds_bracket_bytes: int = 12 * 2**20
    # One build per call signature with the fixed arguments compiled in (NVRTC once per
    # signature and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    # Measurement and tests only, NOT exact (breaks the fp8 rule): the fp8 quotient as x * (1 / s),
    # one rounded multiplication (KVWRITE_PROBE_INEXACT_QUOTIENT, as reshape_and_cache_flash's
    # CudaTuning.inexact_quotient); a test shows the fp8_ds_mla boundary tiles catch it.
    inexact_quotient: bool = False


TUNING = CudaTuning()


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 9 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, out_kind: int, vec: int, slot_dtype: torch.dtype) -> str:
    return f"{KERNEL}<{in_kind}, {out_kind}, {vec}, {launch.int_type(slot_dtype)}>"


def ds_kernel_name(in_kind: int, align: int, slot_dtype: torch.dtype, bracket: bool,
                   ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE) -> str:
    pow2 = ds_scale is DsMlaScale.POW2
    return (f"{DS_KERNEL}<{in_kind}, {align}, {launch.int_type(slot_dtype)}, "
            f"{str(bracket).lower()}, {str(pow2).lower()}>")


def _widest_vec(in_bytes: int, fp8: bool, tuning: CudaTuning = TUNING, small: bool = False) -> int:
    chunk = tuning.chunk_bytes_copy
    if fp8:
        chunk = tuning.small_chunk_bytes_fp8 if small else tuning.chunk_bytes_fp8
    return max(1, chunk // in_bytes)


def is_small_call(num_tokens: int, L: int, P: int, in_bytes: int,
                  tuning: CudaTuning = TUNING) -> bool:
    """Whether a call is planned with the small calls' chunks."""
    return num_tokens * (L + P) * in_bytes <= tuning.small_call_bytes


def ds_uses_bracket(num_tokens: int, L: int, P: int, in_bytes: int,
                    tuning: CudaTuning = TUNING) -> bool:
    """Whether an fp8_ds_mla call quantizes through the bracket (a large call)."""
    return num_tokens * (L + P) * in_bytes > tuning.ds_bracket_bytes


def all_kernel_names(tuning: CudaTuning = TUNING) -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for slot in (torch.int32, torch.int64):
        for in_dtype, in_kind in _KIND.items():
            for out_kind in (_COPY, _E4M3, _E5M2):
                if out_kind == _COPY and in_kind == _BF16:
                    continue  # 2-byte copies share the float16 variant
                vec = _widest_vec(in_dtype.itemsize, out_kind != _COPY, tuning)
                while vec >= 1:
                    names.append(kernel_name(in_kind, out_kind, vec, slot))
                    vec //= 2
        for in_kind in (_F16, _BF16):
            names += [ds_kernel_name(in_kind, a, slot, b, r) for a in _ALIGNS
                      for b in (False, True) for r in DsMlaScale]
    return names


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(kv_c, kv_cache, mode) -> str | None:
    """Every validated case runs (any strides and alignments; unaligned rows use narrower
    accesses)."""
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    ds: bool
    vec: int            # elements per chunk (per-chunk kernel), 0 for fp8_ds_mla
    align: int          # fp8_ds_mla: bytes of alignment of every row start
    threads: int        # CTA size
    per_cta: int        # chunks (per-chunk kernel) or tokens (fp8_ds_mla) per CTA
    fixed: tuple[int, ...]  # kv_c_stride .. chunks (the 9 trailing kernel arguments)




def plan(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
         slot_mapping: torch.Tensor, mode: MlaMode, tuning: CudaTuning = TUNING,
         ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE) -> Plan:
    """The variant, CTA shape and fixed arguments for these (validated) arguments; no GPU needed.
    A NoPE k_pe (P = 0, fp8_ds_mla) is never read: its pointer and stride count for nothing."""
    t_pad, L = kv_c.shape
    P = k_pe.shape[1]
    num_blocks, block_size = kv_cache.shape[:2]
    ib, ob = kv_c.element_size(), kv_cache.element_size()
    # Only strides along dims of size > 1 ever multiply a nonzero index.
    pe_read = P > 0
    inputs = (kv_c, k_pe) if pe_read else (kv_c,)
    in_strides = [t.stride(0) * ib for t in inputs if t_pad > 1]
    cache_strides = [s * ob for s, n in zip(kv_cache.stride()[:2], (num_blocks, block_size),
                                            strict=True) if n > 1]
    in_ptrs = [t.data_ptr() for t in inputs]
    common = (kv_c.stride(0) if t_pad > 1 else 0, k_pe.stride(0) if t_pad > 1 and pe_read else 0,
              kv_cache.stride(0) if num_blocks > 1 else 0,
              kv_cache.stride(1) if block_size > 1 else 0, block_size,
              launch.log2_or_minus_1(block_size), num_blocks * block_size)
    if mode is MlaMode.FP8_DS_MLA:
        align = launch.align(in_strides + cache_strides + in_ptrs + [kv_cache.data_ptr()])
        warps = tuning.ds_warps
        bracket = ds_uses_bracket(slot_mapping.numel(), L, P, ib, tuning)
        pe_lanes = 2 * P // 16  # 8 lanes of 16 bytes, or 0 (NoPE)
        return Plan(ds_kernel_name(_KIND[kv_c.dtype], align, slot_mapping.dtype, bracket,
                                   ds_scale), True, 0, align, 32 * warps, warps,
                    common + (pe_lanes, 0))
    out_kind = _OUT[mode]
    in_kind = _KIND[kv_c.dtype]
    if out_kind == _COPY and in_kind == _BF16:
        in_kind = _F16  # a 2-byte copy: one compiled variant for float16 and bfloat16
    small = is_small_call(slot_mapping.numel(), L, P, ib, tuning)
    vec = _widest_vec(ib, out_kind != _COPY, tuning, small)
    in_al = launch.align(in_strides + in_ptrs)
    out_al = launch.align(cache_strides + [kv_cache.data_ptr()])
    while vec > 1:
        if (L % vec == 0 and P % vec == 0 and in_al % min(vec * ib, 16) == 0
                and out_al % min(vec * ob, 16) == 0):
            break
        vec //= 2
    chunks = (L + P) // vec
    return Plan(kernel_name(in_kind, out_kind, vec, slot_mapping.dtype), False, vec, 0,
                tuning.threads, tuning.threads, common + (L // vec, chunks))


LAUNCHES = launch.LaunchCache()


def _launchable(kv_c, k_pe, kv_cache, slot_mapping, mode, tuning, ds_scale) -> launch.Launchable:
    launch.require_setup()
    p = plan(kv_c, k_pe, kv_cache, slot_mapping, mode, tuning, ds_scale)
    index = kv_c.get_device()
    probe = ("KVWRITE_PROBE_INEXACT_QUOTIENT",) if tuning.inexact_quotient else ()
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize,
                                     before=probe)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def run(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        mode: MlaMode, scale: torch.Tensor | None, *,
        ds_scale: DsMlaScale = DEFAULT_DS_MLA_SCALE, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    if mode is not MlaMode.FP8_DS_MLA:
        ds_scale = DEFAULT_DS_MLA_SCALE  # no tile scales: one signature either way
    kp, cp = kv_c.data_ptr(), kv_cache.data_ptr()
    # NoPE (fp8_ds_mla, P = 0): k_pe is never read; kv_c's pointer stands in for its own.
    pp = k_pe.data_ptr() if k_pe.shape[1] else kp
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    sig = (kv_c.dtype, kv_cache.dtype, mode, ds_scale, slot_mapping.dtype, kv_c.shape[1],
           k_pe.shape[1], kv_c.shape[0] > 1, kv_c.stride(0), k_pe.stride(0), kv_cache.shape, kv_cache.stride(),
           kp & 15, pp & 15, cp & 15, kv_c.get_device(),
           is_small_call(num_tokens, kv_c.shape[1], k_pe.shape[1], kv_c.element_size(), tuning),
           ds_uses_bracket(num_tokens, kv_c.shape[1], k_pe.shape[1], kv_c.element_size(), tuning),
           tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(kv_c, k_pe, kv_cache, slot_mapping, mode, tuning,
                                          ds_scale)
    p = lau.plan
    if p.ds:
        grid = -(-num_tokens // p.per_cta)
    else:
        grid = launch.thread_grid(num_tokens, p.fixed[8], p.threads, "with this row length")
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid, 1, p.threads, 1, pdl)
    sp = scale.data_ptr() if scale is not None else 0
    nvrtc.launch(lau.device_index, config, kernel, kp, pp, cp,
                 slot_mapping.data_ptr(), sp, num_tokens, *lau.fixed)
