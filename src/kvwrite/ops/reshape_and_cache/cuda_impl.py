"""The CUDA implementation of reshape_and_cache: ``kernel.cu`` compiled at run time with NVRTC
(through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

One kernel (see ``kernel.cu``): a thread per (token, chunk of VEC elements of one head), tokens
fastest within a warp, so that consecutive slots' stores into the slot-minor value cache
coalesce. Variants (template arguments): input dtype, cache element kind (a copy of the input
bits, a float cast, fp8 e4m3 or e5m2), VEC (the widest power of two of at most
``CudaTuning.chunk_bytes`` of input dividing D with every input row aligned to it, and dividing
x where the key cache's pieces are written whole), KP (VEC: the chunk is one piece of a key
cache row of x elements, stored in one access, where the key cache's last stride is 1 and the
stores are aligned; else 1: element by element), PAIR (fp8 caches with 8-element chunks: lane
pairs take a token's adjacent chunks and swap bytes, so that one value store writes d and d + 1
side by side) and the slot index type. By default each call signature gets its
own build with the arguments fixed by the caches and the inputs' layout compiled in
(``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; the scales are read on the device.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...dtypes import CacheDType
from ...kernels import launch, nvrtc

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "Plan",
           "all_kernel_names", "compile_kernel", "SOURCE", "kernel_name", "token_lanes"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_reshape_and_cache")
KERNEL = "reshape_and_cache_kernel"

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32, _E4M3, _E5M2, _COPY = range(6)
_KIND = launch.KIND
_OUT_BYTES = {_F16: 2, _BF16: 2, _F32: 4, _E4M3: 1, _E5M2: 1}


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a path); docs/tuning-log.md
    change 64 measured ``small_call_threads`` and ``pair_lanes``."""

    # Threads per CTA (at most the kernel's __launch_bounds__, 256).
    threads: int = 256
    # Threads per CTA of calls with fewer tokens than token_lanes: one warp, so that a small call
    # spreads over SMs (its stores, a sector each, all pass through its CTAs' SMs: T = 2 at H = 8
    # took 3.6 µs in one CTA of 256 threads, the Triton kernel 1.5 µs).
    small_call_threads: int = 32
    # Lane pairs for 1-byte cache elements (the kernel's PAIR): half the value stores' sectors
    # at random slots.
    pair_lanes: bool = True
    # Token lanes per CTA row: consecutive tokens share a warp (their value stores coalesce
    # where their slots are consecutive); fewer for calls of fewer tokens.
    token_lanes: int = 32
    # Input bytes per chunk (one access).
    chunk_bytes: int = 16
    # One build per call signature with the fixed arguments compiled in.
    # KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    max_grid_y: int = 65535


TUNING = CudaTuning()


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 17 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, out_kind: int, vec: int, kp: int, pair: bool,
                slot_dtype: torch.dtype) -> str:
    slot = "long long" if slot_dtype == torch.int64 else "int"
    return f"{KERNEL}<{in_kind}, {out_kind}, {vec}, {kp}, {str(pair).lower()}, {slot}>"


def _out_kinds(in_dtype: torch.dtype) -> list[int]:
    """The cache element kinds of inputs of ``in_dtype``: a copy, the other float types, fp8."""
    return [_COPY, *(k for d, k in _KIND.items() if d != in_dtype), _E4M3, _E5M2]


def all_kernel_names(tuning: CudaTuning = TUNING) -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for slot in (torch.int32, torch.int64):
        for in_dtype, in_kind in _KIND.items():
            for out_kind in _out_kinds(in_dtype):
                if out_kind == _COPY and in_kind == _BF16:
                    continue  # 2-byte copies share the float16 variant
                vec = max(1, tuning.chunk_bytes // in_dtype.itemsize)
                while vec >= 1:
                    for kp in sorted({vec, 1}, reverse=True):
                        for pair in (False, True) if _pairs(out_kind, vec) else (False,):
                            names.append(kernel_name(in_kind, out_kind, vec, kp, pair, slot))
                    vec //= 2
    return names


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key, key_cache, cache_dtype, k_scale) -> str | None:
    """Every validated case runs (any strides and head sizes; unaligned rows use narrower
    accesses)."""
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    vec: int            # elements per chunk
    kp: int             # elements per key-cache store
    token_lanes: int    # blockDim.x
    rows: int           # blockDim.y (chunks per CTA)
    grid_y: int
    fixed: tuple[int, ...]  # key_stride .. chunks (the 17 trailing kernel arguments)




def _pairs(out_kind: int, vec: int) -> bool:
    """Whether the kernel has a PAIR build for these: 1-byte cache elements, 8 a chunk."""
    return out_kind in (_E4M3, _E5M2) and vec == 8


def token_lanes(num_tokens: int, tuning: CudaTuning = TUNING) -> int:
    """blockDim.x: ``tuning.token_lanes``, or T rounded up to a power of two where smaller."""
    return min(tuning.token_lanes, 1 << max(0, num_tokens - 1).bit_length())


def plan(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
         value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_dtype: CacheDType,
         tuning: CudaTuning = TUNING) -> Plan:
    """The variant, CTA shape and fixed arguments for these (validated) arguments; no GPU needed."""
    t_pad, num_heads, head_size = key.shape
    num_blocks, _, _, block_size, x = key_cache.shape
    ib = key.element_size()
    in_kind = _KIND[key.dtype]
    out_kind = launch.cache_kind(cache_dtype, key.dtype, key_cache.dtype)
    ob = ib if out_kind == _COPY else _OUT_BYTES[out_kind]
    # Only strides along dims of size > 1 ever multiply a nonzero index.
    in_al = launch.align([key.data_ptr(), value.data_ptr()]
                   + ([key.stride(0) * ib, value.stride(0) * ib] if t_pad > 1 else []))
    vec = max(1, tuning.chunk_bytes // ib)
    while vec > 1 and (head_size % vec or in_al % min(vec * ib, 16)):
        vec //= 2
    ks = key_cache.stride()
    kc_al = launch.align([key_cache.data_ptr()] + [s * ob for s, n in zip(ks[:4],
                                                                          key_cache.shape[:4],
                                                                          strict=True) if n > 1])
    kp = math.gcd(vec, x) if (x == 1 or ks[4] == 1) else 1
    while kp > 1 and kc_al % min(kp * ob, 16):
        kp //= 2
    if kp > 1:
        vec = kp  # a chunk is one key piece: narrower loads, whole-piece stores
    if out_kind == _COPY and in_kind == _BF16:
        in_kind = _F16  # a 2-byte copy: one compiled variant for float16 and bfloat16
    cph = head_size // vec
    chunks = num_heads * cph
    lanes = token_lanes(slot_mapping.numel(), tuning)
    threads = tuning.threads if lanes == tuning.token_lanes else tuning.small_call_threads
    rows = max(1, min(threads // lanes, chunks))
    grid_y = -(-chunks // rows)
    if grid_y > tuning.max_grid_y:
        rows = -(-chunks // tuning.max_grid_y)
        if rows * lanes > tuning.threads:
            raise ValueError(f"key: at most {tuning.max_grid_y * tuning.threads} chunks of "
                             f"{vec} elements per token, got {chunks}")
        grid_y = -(-chunks // rows)
    pair = (tuning.pair_lanes and _pairs(out_kind, vec) and cph % 2 == 0 and rows % 2 == 0)
    vs = value_cache.stride()
    fixed = (key.stride(0) if t_pad > 1 else 0, value.stride(0) if t_pad > 1 else 0,
             ks[0] if num_blocks > 1 else 0, ks[1], ks[2], ks[3] if block_size > 1 else 0,
             ks[4] if x > 1 else 0, vs[0] if num_blocks > 1 else 0, vs[1], vs[2],
             vs[3] if block_size > 1 else 0, block_size, launch.log2_or_minus_1(block_size),
             num_blocks * block_size, x, cph, chunks)
    return Plan(kernel_name(in_kind, out_kind, vec, kp, pair, slot_mapping.dtype), vec, kp, lanes,
                rows, grid_y, fixed)


LAUNCHES = launch.LaunchCache()


def _launchable(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                tuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(key, value, key_cache, value_cache, slot_mapping, cache_dtype, tuning)
    index = key.get_device()
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    kp, vp = key.data_ptr(), value.data_ptr()
    kcp, vcp = key_cache.data_ptr(), value_cache.data_ptr()
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    sig = (key.dtype, key_cache.dtype, cache_dtype, slot_mapping.dtype, key.shape[1:],
           key.shape[0] > 1, key.stride(0), value.stride(0), key_cache.shape, key_cache.stride(),
           value_cache.stride(), (kp | vp) & 15, kcp & 15, key.get_device(),
           token_lanes(num_tokens, tuning), tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(key, value, key_cache, value_cache, slot_mapping,
                                          cache_dtype, tuning)
    p = lau.plan
    grid_x = -(-num_tokens // p.token_lanes)
    if grid_x >= 2**31:
        raise ValueError(f"slot_mapping: at most {(2**31 - 1) * p.token_lanes} tokens per call, "
                         f"got {num_tokens}")
    kernel, pdl = lau.pick(grid_x * p.grid_y, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid_x, p.grid_y, p.token_lanes, p.rows, pdl)
    ksp, vsp, kss, vss = launch.scale_args(k_scale, v_scale)
    nvrtc.launch(lau.device_index, config, kernel, kp, vp, kcp,
                 vcp, slot_mapping.data_ptr(), ksp, vsp, num_tokens, kss, vss, *lau.fixed)
