"""The CUDA implementation of the NVFP4 writes: ``kernel.cu`` compiled at run time with NVRTC
(through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current stream.

Two kernels (see ``kernel.cu``), both with the same arguments:

- ``nvfp4_kernel<IN, MODE, SlotT, FOUR_OVER_SIX>``: one thread per group of 16 elements, K and V
  together, or per two adjacent groups of one head (MODE 2: 16-byte stores of codes, the
  per-thread setup paid once for two groups). MODE 0 takes inputs that are not 16-byte aligned
  or data that is not 8-byte aligned (element loads, byte stores); MODE 1 the rest.
- ``nvfp4_small_kernel<IN, SlotT, E>``: small and mid-sized calls (``CudaTuning``'s
  ``small_call_groups`` and ``mid_call_groups``) of the "nvfp4" rule with MODE 1's alignment:
  each group of one side spread over 16 / E threads of E elements, for a short chain per thread.
- ``nvfp4_kv_kernel<IN, SlotT, OFF32, TABLE, NG>``: wide calls (``CudaTuning.wide_call_groups``)
  of the "nvfp4" rule with 16-bit inputs and MODE 1's alignment: one thread a group of K and of V
  (NG = 2: two of each), each side's rule in turn; OFF32: the views' byte offsets fit 32 bits;
  TABLE: the scale constants and reciprocals once per CTA in shared memory.

Whether V's scales are swizzled is an argument. By default each call signature gets its own build
with the arguments fixed by the views and the inputs' layout compiled in
(``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; scale tensors are read on the device (a
Python-number scale, FlashInfer's form, is a kernel argument).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import torch

from ...dtypes import CacheDType
from ...kernels import launch, nvrtc
from .op import ScaleLayout
from .rule import GROUP

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "all_kernel_names",
           "compile_kernel", "SOURCE", "Plan", "FIXED_ARGS", "cta_threads"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_nvfp4")
KERNEL = "nvfp4_kernel"
SMALL_KERNEL = "nvfp4_small_kernel"
# The kernel's trailing arguments that a specialized build compiles in, in order.
FIXED_ARGS = ("key_stride", "value_stride", "groups", "head_groups", "kd_sb", "kd_ss", "kd_sh",
              "ks_sb", "ks_ss", "ks_sh", "vd_sb", "vd_ss", "vd_sh", "vs_sb", "vs_ss", "vs_sh",
              "block_size", "block_shift", "num_slots", "v_swizzle")
# nvfp4_kernel's MODE: element accesses; 16-byte loads and 8-byte stores; two groups a thread.
MODE_UNALIGNED, MODE_ALIGNED, MODE_PAIR = 0, 1, 2
SMALL_ELEMS = (4, 8, 16)  # nvfp4_small_kernel's E
KV_KERNEL = "nvfp4_kv_kernel"
KV_TABLE_THREADS = 256  # nvfp4_kv_kernel's CTA size with its per-CTA table
KV_ELEMS = 32  # the *_elems value that selects nvfp4_kv_kernel (16 elements of K and 16 of V)
MODE_SMALL, MODE_KV = -1, -2  # Plan.mode of nvfp4_small_kernel and nvfp4_kv_kernel

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32 = range(3)
_KIND = launch.KIND


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)).strip() or default)


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a path). Not measured yet: the
    values follow the other ops' kernels. The environment variables below let a benchmark
    run (``kvwrite-bench nvfp4``) compare the kernel shapes without code."""

    # Threads per CTA (a multiple of 32, at most 256) of nvfp4_kernel, halved (down to 64)
    # while the call would have fewer than min_ctas CTAs: a mid-sized call's threads, each a
    # long chain, spread over more SMs (2 CTAs an SM of an H200 or H100).
    threads: int = 256
    min_ctas: int = 264
    # Small calls (at most small_call_groups groups of K: 64 tokens of H=8, D=128) take CTAs of
    # small_threads threads and, for "nvfp4" with aligned inputs and data, nvfp4_small_kernel.
    # Estimated (not measured) from the instruction counts: nvfp4_small_kernel issues about 3.8
    # times the instructions of nvfp4_kernel's two groups a thread per token, but each thread's
    # chain is a quarter as long; by that estimate they break even near 128 tokens of that
    # shape, and the limit stays below it. KVWRITE_NVFP4_SMALL_CALL_GROUPS sets the default.
    small_call_groups: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_SMALL_CALL_GROUPS", 4096))
    small_threads: int = 64
    # Elements per thread of nvfp4_small_kernel (4 or 8: a group of a side over 4 or 2 threads)
    # for the small calls that it takes; 0: nvfp4_kernel for those too. KVWRITE_NVFP4_SMALL_ELEMS
    # sets the default.
    small_elems: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_SMALL_ELEMS", 4))
    # Mid-sized calls (more than small_call_groups groups of K, at most mid_call_groups: 1024
    # tokens of H=8, D=128, 64 of H=128) take CTAs of `threads` threads, spread as
    # nvfp4_kernel's, and, for "nvfp4" with aligned inputs and data, nvfp4_small_kernel with
    # mid_elems elements a thread (4, 8 or 16; 0: nvfp4_kernel for those too). nvfp4_kernel's
    # MODE 2 (two groups of K and V, about 850 instructions a thread) has one wave of few warps
    # at mid sizes (T = 1024: 8 an SM), each waiting for all its rows and then running a long
    # chain; 16 elements a thread (one group of one side: 32 registers, about 290 instructions
    # on the fast path, sm_90 bfloat16) gives four times the warps, each chain a third as long.
    # Measured (H200, H=8 D=128 bf16 NHD, hot L2, µs; tuning-log 79): T = 256 / 1024 / 4096,
    # 16 elements 1.59 / 2.74 / 6.35, 8 elements 1.81 / 3.04 / 9.42, MODE 2 2.02 / 3.83 / 6.08,
    # one group of K and V a thread 1.69 / 2.99 / 5.98, the fp8 write 1.65-1.73 / 3.10 / 5.07;
    # H=128 T=256 (2^18 groups, as H=8 T=4096): 16 elements 6.35, MODE 2 6.10. So up to 2^16
    # groups (measured at 2^16 and below; 2^17 not measured). KVWRITE_NVFP4_MID_CALL_GROUPS and
    # KVWRITE_NVFP4_MID_ELEMS set the defaults.
    mid_call_groups: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_MID_CALL_GROUPS", 1 << 16))
    mid_elems: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_MID_ELEMS", 16))
    # Wide calls (more than mid_call_groups groups of K, at most wide_call_groups: 4096 tokens of
    # H=8, D=128, 256 of H=128) take wide_elems: 32 (16 elements of K and 16 of V), for "nvfp4"
    # with 16-bit inputs and aligned inputs and data, nvfp4_kv_kernel (a group of K and V a
    # thread, or two: kv_groups); 4, 8 or 16 nvfp4_small_kernel as mid_elems (which also takes
    # 32); 0: nvfp4_kernel as the large calls (before the wide tier). At 2^18 groups (H=8
    # T=4096, H=128 T=256) the measured shapes (tuning-log 79) issue, a group of one side on the
    # fast path (sm_90 bfloat16): MODE 2 ~220 (32 warps an SM, one wave; 6.08 µs), one group of
    # K and V a thread ~234 (64 registers; 5.98), 16 elements ~293 (6.35); fp8 5.07.
    # nvfp4_kv_kernel: ~224 with 40 warps an SM, ~193 with kv_groups=2 (32 warps). Measured
    # (H200, hot, tuning-log 84), T = 2048 / 4096: 4.08 / 5.78 µs (MODE 2 before: 4.69 / 6.09;
    # kv_groups=2 4.88 / 6.05; without kv_table 4.36 / 6.02); H=128 T=256 5.79 (6.09).
    # KVWRITE_NVFP4_WIDE_CALL_GROUPS and KVWRITE_NVFP4_WIDE_ELEMS set the defaults.
    wide_call_groups: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_WIDE_CALL_GROUPS", 1 << 18))
    wide_elems: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_WIDE_ELEMS", KV_ELEMS))
    # nvfp4_kv_kernel's minimum of resident 256-thread CTAs an SM (__launch_bounds__): 0, no
    # bound (48 registers in the specialized bfloat16 build: 5 CTAs, 40 warps an SM; 5 measured
    # the same, tuning-log 126); 6 caps it at 40 (48 warps, spilling). KVWRITE_NVFP4_KV_MIN_CTAS
    # sets the default.
    kv_min_ctas: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_KV_MIN_CTAS", 0))
    # nvfp4_kv_kernel's TABLE: the scale constants and reciprocals once per CTA in shared memory
    # (about 25 instructions a thread less); False: each thread computes its own.
    # KVWRITE_NVFP4_KV_TABLE=0 sets False.
    kv_table: bool = dataclasses.field(
        default_factory=lambda: nvrtc.env_flag("KVWRITE_NVFP4_KV_TABLE", "1"))
    # nvfp4_kv_kernel's OFF32 where the views' byte offsets fit 32 bits; False: 64-bit offsets
    # always (tests force that build, which large caches take).
    kv_off32: bool = True
    # nvfp4_kv_kernel's groups of each side a thread: 1, or 2 (adjacent groups of one head, one
    # 16-byte store of codes a side, as MODE 2, where the data is 16-byte aligned, D % 32 == 0
    # and kv_table is set; the rule of each group in turn). KVWRITE_NVFP4_KV_GROUPS sets the
    # default. sm_90 bfloat16, the benchmark's layout, fast path: 1: ~447 instructions a thread
    # (~224 a group of one side), 48 registers (40 warps an SM); 2: ~771 (~193), 64 registers
    # (32 warps), no spill (MODE 2: ~859, ~215, 8 bytes spilled). Measured slower: see
    # wide_call_groups.
    kv_groups: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_KV_GROUPS", 1))
    # Two groups a thread (nvfp4_kernel's MODE 2) for the "nvfp4" rule with 16-bit inputs where
    # the data is 16-byte aligned and D % 32 == 0; False: one. KVWRITE_NVFP4_PAIR_GROUPS=0 sets
    # False.
    pair_groups: bool = dataclasses.field(
        default_factory=lambda: nvrtc.env_flag("KVWRITE_NVFP4_PAIR_GROUPS", "1"))
    # nvfp4_kernel MODE 2's minimum of resident 256-thread CTAs an SM (__launch_bounds__): 4
    # caps it at 64 registers (8 bytes spilled in the bfloat16 build; 80 unbounded, 3 CTAs);
    # 0: no bound. KVWRITE_NVFP4_PAIR_MIN_CTAS sets the default. Not measured.
    pair_min_ctas: int = dataclasses.field(
        default_factory=lambda: _env_int("KVWRITE_NVFP4_PAIR_MIN_CTAS", 4))
    # One build per call signature with the fixed arguments compiled in (NVRTC once per
    # signature and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)

    def __post_init__(self):
        if self.small_elems not in (0, *SMALL_ELEMS):
            raise ValueError(f"small_elems: expected 0, 4, 8 or 16, got {self.small_elems}")
        for name in ("mid_elems", "wide_elems"):
            if getattr(self, name) not in (0, *SMALL_ELEMS, KV_ELEMS):
                raise ValueError(f"{name}: expected 0, 4, 8, 16 or 32, got "
                                 f"{getattr(self, name)}")
        if self.kv_groups not in (1, 2):
            raise ValueError(f"kv_groups: expected 1 or 2, got {self.kv_groups}")
        for name in ("pair_min_ctas", "kv_min_ctas"):
            if not 0 <= getattr(self, name) <= 8:
                raise ValueError(f"{name}: expected 0 to 8, got {getattr(self, name)}")


TUNING = CudaTuning()


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 20 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, mode: int, slot_dtype: torch.dtype, four_over_six: bool) -> str:
    slot = launch.int_type(slot_dtype)
    return f"{KERNEL}<{in_kind}, {mode}, {slot}, {str(four_over_six).lower()}>"


def small_kernel_name(in_kind: int, slot_dtype: torch.dtype, elems: int) -> str:
    return f"{SMALL_KERNEL}<{in_kind}, {launch.int_type(slot_dtype)}, {elems}>"


def kv_kernel_name(in_kind: int, slot_dtype: torch.dtype, off32: bool, table: bool,
                   ng: int) -> str:
    return (f"{KV_KERNEL}<{in_kind}, {launch.int_type(slot_dtype)}, {str(off32).lower()}, "
            f"{str(table).lower()}, {ng}>")


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests): nvfp4_kernel in MODE 0 and 1 for both
    rules and MODE 2 for "nvfp4" with 16-bit inputs, nvfp4_small_kernel with 4, 8 and 16
    elements a thread, nvfp4_kv_kernel for 16-bit inputs with 32- and 64-bit offsets."""
    names = []
    for slot in (torch.int32, torch.int64):
        for kind in (_F16, _BF16, _F32):
            for fos in (False, True):
                pair = () if fos or kind == _F32 else (MODE_PAIR,)
                modes = (MODE_UNALIGNED, MODE_ALIGNED) + pair
                names += [kernel_name(kind, mode, slot, fos) for mode in modes]
            names += [small_kernel_name(kind, slot, e) for e in SMALL_ELEMS]
            if kind != _F32:
                names += [kv_kernel_name(kind, slot, off32, table, ng) for off32 in (False, True)
                          for table in (False, True) for ng in ((1, 2) if table else (1,))]
    return names


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key, k_data, cache_dtype, v_scale_layout) -> str | None:
    """Every validated case runs (any strides and alignments; unaligned rows and data use
    narrower accesses)."""
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    mode: int  # nvfp4_kernel's MODE, or MODE_SMALL / MODE_KV
    threads: int  # per CTA
    per_token: int  # threads per token
    fixed: tuple[int, ...]  # key_stride .. v_swizzle (the 20 trailing kernel arguments)
    spread: bool = True  # CTAs halved while few (cta_threads); small calls keep theirs




def _strides(view: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, head) strides of a byte view, 0 along dims of size 1 (they never multiply a
    nonzero index, and so compile no other variant)."""
    return tuple(st if n > 1 else 0 for st, n in zip(view.stride()[:3], view.shape[:3],
                                                     strict=True))


def is_small_call(num_tokens: int, groups: int, tuning: CudaTuning = TUNING) -> bool:
    return num_tokens * groups <= tuning.small_call_groups


def call_size(num_tokens: int, groups: int, tuning: CudaTuning = TUNING) -> int:
    """0: a small call (``is_small_call``), 1: a mid-sized one (at most ``mid_call_groups``
    groups of K), 3: a wide one (at most ``wide_call_groups``), 2: a large one."""
    if is_small_call(num_tokens, groups, tuning):
        return 0
    n = num_tokens * groups
    return 1 if n <= tuning.mid_call_groups else 3 if n <= tuning.wide_call_groups else 2


def _fits_32_bits(*views: torch.Tensor) -> bool:
    """Whether every byte offset into each byte view (from its own pointer) is below 2^32."""
    return all(sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True)) < 1 << 32
               for v in views)


def plan(key, value, k_data, k_sf, v_data, v_sf, slot_mapping, cache_dtype: CacheDType,
         v_scale_layout: ScaleLayout, tuning: CudaTuning = TUNING) -> Plan:
    """The kernel, CTA size and fixed arguments for these (validated) arguments; no GPU
    needed."""
    t_pad, num_heads, head_size = key.shape
    num_blocks, block_size = k_data.shape[:2]
    ib = key.element_size()
    head_groups = head_size // GROUP
    groups = num_heads * head_groups
    in_strides = [t.stride(0) * ib for t in (key, value)] if t_pad > 1 else []
    kd, ks, vd, vs = (_strides(x) for x in (k_data, k_sf, v_data, v_sf))
    in_aligned = launch.align(in_strides + [key.data_ptr(), value.data_ptr()], 16) == 16
    data_align = launch.align([*kd, *vd, k_data.data_ptr(), v_data.data_ptr()], 16)
    fos = cache_dtype is CacheDType.NVFP4_4OVER6
    kind = _KIND[key.dtype]
    size = call_size(slot_mapping.numel(), groups, tuning)
    small = size == 0
    elems = (tuning.small_elems, tuning.mid_elems, 0, tuning.wide_elems)[size]
    fixed = (key.stride(0) if t_pad > 1 else 0, value.stride(0) if t_pad > 1 else 0, groups,
             head_groups, *kd, *ks, *vd, *vs, block_size, launch.log2_or_minus_1(block_size),
             num_blocks * block_size, int(v_scale_layout is ScaleLayout.SWIZZLED))
    threads = tuning.small_threads if small else tuning.threads
    if not in_aligned or data_align < 8:
        mode = MODE_UNALIGNED
    elif elems == KV_ELEMS and not fos and ib == 2:
        off32 = (tuning.kv_off32 and _fits_32_bits(k_data, k_sf, v_data, v_sf)
                 and num_blocks * block_size < 1 << 32)
        # TABLE: CTAs of 256 threads, one entry of the per-CTA table each (kernel.cu). Two
        # groups of each side a thread where MODE 2 could take them, with the table only (the
        # builds without it waited for the scales before some row loads).
        table = tuning.kv_table
        ng = 2 if (tuning.kv_groups == 2 and table and data_align == 16
                   and head_groups % 2 == 0) else 1
        return Plan(kv_kernel_name(kind, slot_mapping.dtype, off32, table, ng), MODE_KV,
                    KV_TABLE_THREADS if table else threads, groups // ng, fixed,
                    spread=not table)
    elif elems and not fos:
        e = min(elems, GROUP)  # 32 (K and V a thread) for float32 inputs: one side a thread
        return Plan(small_kernel_name(kind, slot_mapping.dtype, e), MODE_SMALL, threads,
                    2 * groups * (GROUP // e), fixed, spread=not small)
    elif (data_align == 16 and head_groups % 2 == 0 and ib == 2 and not fos
          and tuning.pair_groups):
        mode = MODE_PAIR
    else:
        mode = MODE_ALIGNED
    per_token = groups // 2 if mode == MODE_PAIR else groups
    return Plan(kernel_name(kind, mode, slot_mapping.dtype, fos), mode, threads, per_token, fixed,
                spread=not small)


def cta_threads(p: Plan, total: int, tuning: CudaTuning = TUNING) -> int:
    """Threads per CTA for a call of ``total`` threads: the plan's, for mid-sized and large calls
    spread (:func:`launch.spread_threads`) while there would be fewer than ``tuning.min_ctas``
    CTAs."""
    if not p.spread:
        return p.threads
    return launch.spread_threads(p.threads, total, tuning.min_ctas)


LAUNCHES = launch.LaunchCache()


def _launchable(args, tuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(*args, tuning=tuning)
    index = args[0].get_device()
    after = ()
    if p.mode == MODE_PAIR and tuning.pair_min_ctas != 4:
        after = (("KVW_NVFP4_PAIR_MIN_CTAS", str(tuning.pair_min_ctas)),)
    if p.mode == MODE_KV and tuning.kv_min_ctas != 0:
        after = (("KVW_NVFP4_KV_MIN_CTAS", str(tuning.kv_min_ctas)),)
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize,
                                     after=after)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def _scale_args(s) -> tuple[int, int]:
    """(pointer, float32 bits) of a scale: a tensor's pointer, or a Python number's bits."""
    if isinstance(s, torch.Tensor):
        return s.data_ptr(), 0
    return 0, struct.unpack("<I", struct.pack("<f", s))[0]


def run(key: torch.Tensor, value: torch.Tensor, k_data: torch.Tensor, k_sf: torch.Tensor,
        v_data: torch.Tensor, v_sf: torch.Tensor, slot_mapping: torch.Tensor,
        cache_dtype: CacheDType, k_scale, v_scale, v_scale_layout: ScaleLayout, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    views = (k_data, k_sf, v_data, v_sf)
    groups = key.shape[1] * (key.shape[2] // GROUP)
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    sig = (key.dtype, key.shape[1:], key.shape[0] > 1, key.stride(0), value.stride(0),
           key.data_ptr() & 15, value.data_ptr() & 15, slot_mapping.dtype, cache_dtype,
           v_scale_layout, k_data.shape, *(x.stride() for x in views),
           k_data.data_ptr() & 15, v_data.data_ptr() & 15, key.get_device(),
           call_size(num_tokens, groups, tuning), tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(
            (key, value, *views, slot_mapping, cache_dtype, v_scale_layout), tuning)
    p = lau.plan
    threads = cta_threads(p, num_tokens * p.per_token, tuning)
    grid = launch.thread_grid(num_tokens, p.per_token, threads, "with this row length")
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid, 1, threads, 1, pdl)
    kp, kb = _scale_args(k_scale)
    vp, vb = _scale_args(v_scale)
    nvrtc.launch(lau.device_index, config, kernel,
                 key.data_ptr(), value.data_ptr(), k_data.data_ptr(), k_sf.data_ptr(),
                 v_data.data_ptr(), v_sf.data_ptr(), slot_mapping.data_ptr(), kp, vp, kb, vb,
                 num_tokens, *p.fixed)
