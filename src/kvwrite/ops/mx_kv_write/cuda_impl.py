"""The CUDA implementation of the MX writes (SPEC §10.3): ``kernel.cu`` compiled at run time with
NVRTC (through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

Two kernels (see ``kernel.cu``): ``mx_kernel<IN, FP4, ALIGNED, SlotT>``, one thread per group of
32 elements, K and V together; ``mx_small_kernel<IN, FP4, SlotT>``, small calls
(``CudaTuning.small_call_groups``) with aligned inputs and data, a group of one side over 4
threads (8 elements each). ALIGNED takes 16-byte aligned inputs and 16-byte aligned data with a
unit byte stride (16-byte loads and stores); the rest takes element loads and byte stores. The
scale rule and both scale layouts are arguments (the layouts as six strides each: the linear
layout's address is the interleaved formula with derived strides). By default each call
signature gets its own build with the arguments fixed by the views and the inputs' layout
compiled in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; slots are read on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from ...gather import bits_view
from ...kernels import launch, nvrtc
from ...kernels.mx_views import (
    GROUP,
    data_strides,
    is_floor,
    is_fp4,
    is_interleaved,
    scale_strides,
)

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "all_kernel_names",
           "compile_kernel", "SOURCE", "Plan", "FIXED_ARGS", "cta_threads"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_mx")
KERNEL = "mx_kernel"
SMALL_KERNEL = "mx_small_kernel"
# The kernel's trailing arguments that a specialized build compiles in, in order.
FIXED_ARGS = ("key_stride", "value_stride", "groups", "head_groups",
              "kd_sb", "kd_ss", "kd_sh", "kd_se", "vd_sb", "vd_ss", "vd_sh", "vd_se",
              "ks_sb", "ks_sh", "ks_128", "ks_32", "ks_4", "ks_g",
              "vs_sb", "vs_sh", "vs_128", "vs_32", "vs_4", "vs_g",
              "block_size", "block_shift", "num_slots", "floor_rule")

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32 = range(3)
_KIND = launch.KIND


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run`. ``threads`` and ``min_ctas`` follow nvfp4_kv_write's kernel;
    ``small_call_groups`` is measured."""

    # Threads per CTA (a multiple of 32, at most 256), halved (down to 64) while the call would
    # have fewer than min_ctas CTAs: a mid-sized call's threads spread over more SMs. Measured
    # (H200, H=8 D=128 bf16, cold, tuning-log 89): 64 / 128 / 256 within 2% at T = 16384 and
    # 65536 (mxfp8 28.4-28.5 and 104.1-104.4 µs; mxfp4 22.8-23.2, 82.2-82.7): nvfp4's 256 kept.
    threads: int = 256
    min_ctas: int = 264
    # Calls of at most small_call_groups groups of K (T * H * D/32; 8192: 256 tokens of H=8,
    # D=128) with aligned inputs and data take mx_small_kernel (a group of one side over 4
    # threads; mx_kernel: one thread a group's K and V). Measured (H200, H=8 D=128 bf16, cold L2, scale_rule ceil, µs at
    # T = 1 / 128 / 256, small kernel up to 2048 groups vs never vs up to 16384): mxfp4 1.49 vs
    # 1.84 at T=1, 2.29 / 2.30 / 2.01 at T=128, 2.46 / 2.46 / 2.22 at T=256; mxfp8 1.98 / 1.98 /
    # 1.94 at T=128, 2.15 / 2.15 / 2.11 at T=256. Above 256 tokens not measured.
    small_call_groups: int = 8192
    # One build per call signature with the fixed arguments compiled in (NVRTC once per
    # signature and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)


TUNING = CudaTuning()

# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 28 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, fp4: bool, aligned: bool, slot_dtype: torch.dtype) -> str:
    return (f"{KERNEL}<{in_kind}, {str(fp4).lower()}, {str(aligned).lower()}, "
            f"{launch.int_type(slot_dtype)}>")


def small_kernel_name(in_kind: int, fp4: bool, slot_dtype: torch.dtype) -> str:
    return f"{SMALL_KERNEL}<{in_kind}, {str(fp4).lower()}, {launch.int_type(slot_dtype)}>"


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests): mx_kernel's input dtype x format x
    alignment x slot type (24), then mx_small_kernel's input dtype x format x slot type (12)."""
    return [kernel_name(kind, fp4, aligned, slot)
            for slot in (torch.int32, torch.int64) for kind in (_F16, _BF16, _F32)
            for fp4 in (False, True) for aligned in (False, True)] + [
        small_kernel_name(kind, fp4, slot)
        for slot in (torch.int32, torch.int64) for kind in (_F16, _BF16, _F32)
        for fp4 in (False, True)]


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key, key_cache, mode, scale_layout) -> str | None:
    """Every validated case runs (any strides and alignments: unaligned rows and data use
    element accesses)."""
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    threads: int  # per CTA
    per_token: int  # threads per token: H * D/32 (mx_kernel), 8 * H * D/32 (mx_small_kernel)
    fixed: tuple[int, ...]  # key_stride .. floor_rule (the 28 trailing kernel arguments)


def is_small_call(num_tokens: int, groups: int, tuning: CudaTuning = TUNING) -> bool:
    return num_tokens * groups <= tuning.small_call_groups


def plan(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, mode,
         scale_rule, scale_layout, tuning: CudaTuning = TUNING) -> Plan:
    """The kernel, CTA size and fixed arguments for these (validated) arguments (the kernel
    depends on the call's size: ``is_small_call``); no GPU needed."""
    t_pad, num_heads, head_size = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    ib = key.element_size()
    head_groups = head_size // GROUP
    groups = num_heads * head_groups
    kd, vd = data_strides(key_cache), data_strides(value_cache)
    inter = is_interleaved(scale_layout)
    ks, vs = scale_strides(k_scale_cache, inter), scale_strides(v_scale_cache, inter)
    in_strides = [t.stride(0) * ib for t in (key, value)] if t_pad > 1 else []
    in_aligned = launch.align(in_strides + [key.data_ptr(), value.data_ptr()], 16) == 16
    data_aligned = (kd[3] == 1 and vd[3] == 1 and launch.align(
        [*kd[:3], *vd[:3], key_cache.data_ptr(), value_cache.data_ptr()], 16) == 16)
    fixed = (key.stride(0) if t_pad > 1 else 0, value.stride(0) if t_pad > 1 else 0, groups,
             head_groups, *kd, *vd, *ks, *vs, block_size,
             launch.log2_or_minus_1(block_size), num_blocks * block_size,
             int(is_floor(scale_rule)))
    aligned = in_aligned and data_aligned
    if aligned and is_small_call(slot_mapping.numel(), groups, tuning):
        return Plan(small_kernel_name(_KIND[key.dtype], is_fp4(mode), slot_mapping.dtype),
                    tuning.threads, 8 * groups, fixed)
    name = kernel_name(_KIND[key.dtype], is_fp4(mode), aligned, slot_mapping.dtype)
    return Plan(name, tuning.threads, groups, fixed)


def cta_threads(p: Plan, total: int, tuning: CudaTuning = TUNING) -> int:
    """Threads per CTA for a call of ``total`` threads: the plan's, spread
    (:func:`launch.spread_threads`) while there would be fewer than ``tuning.min_ctas`` CTAs."""
    return launch.spread_threads(p.threads, total, tuning.min_ctas)


LAUNCHES = launch.LaunchCache()


def _launchable(args, tuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(*args, tuning=tuning)
    index = args[0].get_device()
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode, scale_rule, scale_layout, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    # One-byte caches (op.py checks their dtypes), so their uint8 views, same strides.
    views = tuple(bits_view(x) for x in (key_cache, value_cache, k_scale_cache, v_scale_cache))
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    sig = (key.dtype, key.shape[1:], key.shape[0] > 1, key.stride(0), value.stride(0),
           key.data_ptr() & 15, value.data_ptr() & 15, slot_mapping.dtype, mode.name,
           is_floor(scale_rule), is_interleaved(scale_layout), *(x.shape for x in views),
           *(x.stride() for x in views), views[0].data_ptr() & 15, views[1].data_ptr() & 15,
           key.get_device(), is_small_call(num_tokens, key.shape[1] * key.shape[2] // GROUP,
                                           tuning), tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(
            (key, value, *views, slot_mapping, mode, scale_rule, scale_layout), tuning)
    p = lau.plan
    threads = cta_threads(p, num_tokens * p.per_token, tuning)
    grid = launch.thread_grid(num_tokens, p.per_token, threads, "with this row length")
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid, 1, threads, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel,
                 key.data_ptr(), value.data_ptr(), *(x.data_ptr() for x in views),
                 slot_mapping.data_ptr(), num_tokens, *p.fixed)
