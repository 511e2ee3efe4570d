"""The CUDA implementation of indexer_k_quant_and_cache: ``kernel.cu`` compiled at run time with
NVRTC (through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

One kernel (see ``kernel.cu``): a flat grid of threads, ``lanes`` per group of ``q`` elements
and ``G`` groups per token; each group's amax is a shuffle reduction within its lanes. Variants
(template arguments): the input dtype, VEC (elements per chunk: the widest power of two of at
most ``CudaTuning.chunk_bytes`` of input that divides ``q`` and keeps every load and code store
aligned), the slot index type, and ONE (each lane holds exactly one chunk: ``q / VEC`` is a power
of two of at most 32). The scale format is the last fixed argument (``_FMT_CODE``), not a variant. ``lanes`` is the largest power of two of at most 32 dividing ``q / VEC``.
For D = 128, q = 128 and 16-bit input: VEC = 16 (large calls), 8 lanes a token, two 16-byte
loads and one 16-byte code store each; small calls VEC = 8, 16 lanes. By default each call
signature gets its own build with the arguments fixed by the cache and the input's layout compiled
in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync.
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import launch, nvrtc
from .op import ScaleFormat

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "Plan",
           "all_kernel_names", "compile_kernel", "SOURCE", "kernel_name", "is_small_call"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_indexer_k_quant_and_cache")
KERNEL = "indexer_k_quant_and_cache_kernel"

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32 = range(3)
_KIND = launch.KIND
# The scale format as the kernel's last fixed argument scale_fmt (KVW_INDEXER_FMT_* in kernel.cu):
# a macro in specialized builds, a kernel argument in the generic ones.
_FMT_CODE = {ScaleFormat.FLOAT32: 0, ScaleFormat.UE8M0: 1, ScaleFormat.MXFP8: 2}


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a path). Not measured yet: the
    values follow concat_and_cache_mla's fp8_ds_mla kernel (32 input bytes a lane, 256-thread
    CTAs), whose per-token work is the same (a tile amax by shuffles, one scale, e4m3 codes)."""

    # Threads per CTA (a multiple of 32, at most 256).
    threads: int = 256
    # Input bytes per chunk: 32 (two 16-byte loads, 8 lanes a group of 128 16-bit elements, a
    # 16-byte code store each) for large calls, as the fp8_ds_mla kernel's 32 bytes a lane: twice
    # the bytes in flight per resident thread of 16-byte chunks. Small calls (at most
    # small_call_bytes of k) are latency-bound: 16-byte chunks spread a row over twice the lanes,
    # each with half the chain (concat_and_cache_mla's small-call rule).
    chunk_bytes: int = 32
    small_call_bytes: int = 512 * 1024
    small_chunk_bytes: int = 16
    # One build per call signature with the fixed arguments compiled in (NVRTC once per
    # signature and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)


TUNING = CudaTuning()


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 11 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, vec: int, slot_dtype: torch.dtype, one: bool) -> str:
    slot = "long long" if slot_dtype == torch.int64 else "int"
    return f"{KERNEL}<{in_kind}, {vec}, {slot}, {str(one).lower()}>"


def is_small_call(num_tokens: int, head_dim: int, in_bytes: int,
                  tuning: CudaTuning = TUNING) -> bool:
    """Whether a call is planned with the small calls' chunks."""
    return num_tokens * head_dim * in_bytes <= tuning.small_call_bytes


def _widest_vec(in_bytes: int, tuning: CudaTuning = TUNING, small: bool = False) -> int:
    return max(1, (tuning.small_chunk_bytes if small else tuning.chunk_bytes) // in_bytes)


def all_kernel_names(tuning: CudaTuning = TUNING) -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for slot in (torch.int32, torch.int64):
        for in_dtype, in_kind in _KIND.items():
            vec = max(_widest_vec(in_dtype.itemsize, tuning, small) for small in (False, True))
            while vec >= 1:
                for one in (True, False):
                    names.append(kernel_name(in_kind, vec, slot, one))
                vec //= 2
    return names


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(k, kv_cache, fmt) -> str | None:
    """Every validated case runs (any group size, strides and alignments; unaligned rows use
    narrower accesses)."""
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    vec: int            # elements per chunk
    lanes: int          # threads per group
    one: bool           # one chunk per lane (lanes == q / vec)
    threads_per_token: int
    threads: int        # CTA size
    fixed: tuple[int, ...]  # k_stride .. scale_fmt (the 11 trailing kernel arguments)




def plan(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
         quant_block_size: int, fmt: ScaleFormat, tuning: CudaTuning = TUNING) -> Plan:
    """The variant, CTA shape and fixed arguments for these (validated) arguments; no GPU needed."""
    if tuning.threads % 32 or not 32 <= tuning.threads <= 256:
        raise ValueError(f"tuning.threads: expected a multiple of 32 in [32, 256] (whole warps: "
                         f"each group's amax is a warp shuffle), got {tuning.threads}")
    t_pad, head_dim = k.shape
    num_blocks, block_size, _ = kv_cache.shape
    q = quant_block_size
    ib = k.element_size()
    # Only strides along dims of size > 1 ever multiply a nonzero index.
    in_al = launch.align([k.data_ptr()] + ([k.stride(0) * ib] if t_pad > 1 else []))
    out_al = launch.align([kv_cache.data_ptr()] + ([kv_cache.stride(0)] if num_blocks > 1 else [])
                    + ([head_dim] if block_size > 1 else []))
    vec = _widest_vec(ib, tuning, is_small_call(slot_mapping.numel(), head_dim, ib, tuning))
    while vec > 1:
        if q % vec == 0 and in_al % min(vec * ib, 16) == 0 and out_al % min(vec, 16) == 0:
            break
        vec //= 2
    chunks = q // vec
    lanes = min(32, chunks & -chunks)
    groups = head_dim // q
    tpt = groups * lanes
    fixed = (k.stride(0) if t_pad > 1 else 0, kv_cache.stride(0) if num_blocks > 1 else 0,
             block_size, launch.log2_or_minus_1(block_size), num_blocks * block_size, head_dim, q,
             groups, lanes, tpt, _FMT_CODE[fmt])
    one = lanes == chunks
    return Plan(kernel_name(_KIND[k.dtype], vec, slot_mapping.dtype, one), vec, lanes, one, tpt,
                tuning.threads, fixed)


LAUNCHES = launch.LaunchCache()


def _launchable(k, kv_cache, slot_mapping, quant_block_size, fmt, tuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(k, kv_cache, slot_mapping, quant_block_size, fmt, tuning)
    index = k.get_device()
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def run(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        quant_block_size: int, fmt: ScaleFormat, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    kp, cp = k.data_ptr(), kv_cache.data_ptr()
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    sig = (k.dtype, slot_mapping.dtype, k.shape[1], k.shape[0] > 1, k.stride(0), quant_block_size,
           fmt, kv_cache.shape, kv_cache.stride(), kp & 15, cp & 15, k.get_device(),
           is_small_call(num_tokens, k.shape[1], k.element_size(), tuning), tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(k, kv_cache, slot_mapping, quant_block_size, fmt,
                                          tuning)
    p = lau.plan
    grid = -(-(num_tokens * p.threads_per_token) // p.threads)
    if grid * p.threads >= 2**32:  # the kernel's thread index is 32-bit
        most = (2**32 - p.threads) // p.threads_per_token
        raise ValueError(f"slot_mapping: at most {most} tokens per call with this head dim and "
                         f"group size, got {num_tokens}")
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid, 1, p.threads, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel, kp, cp,
                 slot_mapping.data_ptr(), num_tokens, *lau.fixed)
