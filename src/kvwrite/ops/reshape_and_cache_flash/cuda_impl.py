"""The CUDA implementation of reshape_and_cache_flash: ``kernel.cu`` compiled at run time with
NVRTC (through :mod:`kvwrite.kernels.nvrtc`).

No nvcc and no C++ toolchain at run time: the kernel source ships as package data, is compiled
for the current GPU's architecture the first time a variant is needed (once per process), and
is launched on PyTorch's current stream through ``cuda.core``.

Two kernels take the same arguments: ``reshape_and_cache_flash_kernel`` (one token's chunk per
thread, no loops), which every call runs unless a token's row is too long for its grid, and
``reshape_and_cache_flash_grid_stride_kernel`` (threads walk tokens and chunks with grid
strides) for those. By default each call signature gets its own build with the
arguments fixed by the caches and the inputs' layout compiled in (``CudaTuning.specialize``).

Variants (template arguments of both kernels): input dtype, cache element
kind (a plain copy of the input bits, a float cast, fp8 e4m3 or e5m2), the vector width VEC in
elements and the slot index type. VEC is the widest chunk of at most
``CudaTuning.chunk_input_bytes`` of input (16, or 32 as two 16-byte loads; fewer for small
calls) and 32 bytes of output, halving down to one element, such that every row chunk of VEC
elements is aligned in the inputs and the caches: ``head_size % VEC == 0``, data pointers and
every stride that moves (token, block, slot, head) multiples of VEC elements; otherwise one
element per access (e.g. bfloat16 with head_size 46: 92-byte rows are 4-byte but not 16-byte
aligned, so VEC = 2).

Launch constants live in one frozen :class:`CudaTuning` (``TUNING``, with the measured reason
next to each value); ``run(..., tuning=...)`` takes another one, which probes and tests pass
explicitly.

Graph-safe: a call does no allocation and no host sync; scales are read on the device.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ...dtypes import CacheDType
from ...kernels import launch, nvrtc

__all__ = ["CallSize", "CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "fixed_args",
           "kernel_source", "compile_kernel", "SOURCE"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_reshape_and_cache")
KERNEL = "reshape_and_cache_flash_kernel"  # no loops: one token's chunk per thread
GRID_STRIDE_KERNEL = "reshape_and_cache_flash_grid_stride_kernel"  # rows too long for KERNEL

# Element kinds, as DT_* in kvw/common.cuh.
_F16, _BF16, _F32, _E4M3, _E5M2, _COPY = range(6)
_KIND = launch.KIND


class CallSize(enum.Enum):
    """Which chunk width a call is planned with (:meth:`CudaTuning.call_size`)."""

    SMALL = "small"   # latency-bound: narrow chunks, many threads
    MID = "mid"
    LARGE = "large"   # bandwidth-bound: wide chunks


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants of the CUDA kernel. ``TUNING`` is what every call uses unless a
    caller passes another one to :func:`run` (probes comparing variants, tests forcing a path).
    Figures: H200, 20-call CUDA graphs, hot L2, bfloat16 input, unless said otherwise; the history
    is in docs/tuning-log.md."""

    # Threads per CTA (at most the kernel's __launch_bounds__, 256). Rows of more chunks than
    # max_threads are split over CTAs of up to max_threads threads; smaller rows are packed
    # several tokens to a CTA of up to small_row_threads. Copies at T=65536: H=128 rows 2163 us
    # with 256-thread CTAs vs 2171 us with 128; H=8 rows 136.3 us with 128-thread CTAs vs 142.8
    # us with 256; T=2: 128 is 0.05-0.1 us faster than 256.
    max_threads: int = 256
    small_row_threads: int = 128
    # The grid-stride kernel's grid: sized so that each thread handles about tokens_per_thread
    # tokens (two a step), amortizing its prologue, but never fewer than min_waves nor more than
    # max_waves waves of resident CTAs. Copies, 4 vs 16 tokens per thread: H=128 T=4096 136.1 vs
    # 139.1 us, H=8 136.3 vs 139.1 us; fp8, 16 vs 4: H=128 T=4096 105.6 vs 108.9 us, T=16384
    # 406.8 vs 424.9 us. Fixed caps instead (one CTA per token part, 64 waves) made fp8 slow (H=8
    # 135 vs 105 us with 4 waves).
    tokens_per_thread_copy: int = 4
    tokens_per_thread_fp8: int = 16
    min_waves: int = 4
    max_waves: int = 64
    # Input bytes per chunk (one thread's share of a row). fp8, 32 (two 16-byte loads) vs 16:
    # H=128 T=65536 NHD 1547 vs 1613 us (98.3 vs 94.3% of copy bandwidth), HND 1676 vs 1733 us;
    # H=8 T=65536 NHD 102.0 vs 106.3 us, T=1024 3.76 vs 4.23 us.
    chunk_bytes_copy: int = 16
    chunk_bytes_fp8: int = 32
    # Small calls (at most small_call_bytes of key input) are latency-bound: narrower chunks
    # spread each token over more threads and shorten every thread's chain. fp8, 8 vs 32 bytes a
    # chunk: H=128 T=2 1.98 vs 2.38 us, H=8 T=64 2.00 vs 2.17 us; copies gain nothing from 8
    # bytes (H=128 T=2 1.73-1.77 us either way). The limit, 512 KiB vs 128 KiB: H=128 T=8 2.13 vs
    # 2.42 us, H=8 T=256 2.28 vs 2.38 us; 2 MiB made H=128 T=64 slower (4.25 vs 3.36 us).
    small_call_bytes: int = 512 * 1024
    small_chunk_bytes_copy: int = 16
    small_chunk_bytes_fp8: int = 8
    # Mid-sized calls (above small_call_bytes, at most mid_call_bytes of key input) take
    # mid_chunk_bytes: one 16-byte load per tensor and thread, between the small calls' 8 and the
    # large calls' 32 bytes (mid_call_bytes == small_call_bytes: no mid-sized calls). fp8 H=128
    # T=32 (1 MiB; H200, hot L2), 16 vs 32 bytes: NHD 2.11 vs 2.25 us, HND 2.12 vs 2.22, packed
    # 2.09 vs 2.25; at T=64 (2 MiB) 2.72 either way, at T=128 (4 MiB) 3.84 vs 3.65. The limit,
    # 2 MiB vs 1 MiB: fp8 H=8 T=1024 (2 MiB) 2.28 vs 2.48 us; 4 MiB made T=2048 slower (3.39 vs
    # 2.81 us); copies unchanged (H=8 T=1024 2.19 us; tuning-log 86).
    mid_call_bytes: int = 2 * 1024 * 1024
    mid_chunk_bytes_copy: int = 16
    mid_chunk_bytes_fp8: int = 16
    # The loop-free kernel for every call whose row fits its grid (at most max_grid_y CTAs per
    # token), else the grid-stride kernel. Loop-free vs grid-stride: H=8 T=2 fp8 1.48 vs 1.65 us,
    # H=128 fp8 NHD T=512 13.14 vs 14.31 us, H=128 copies NHD T=65536 2146 vs 2192 us.
    loop_free: bool = True
    max_grid_y: int = 65535
    max_grid_x: int = 2**31 - 1
    # One build per call signature with the fixed arguments compiled in (about 0.3 s of NVRTC
    # once per signature and process): specialized vs generic, H=8 T=2 copies 1.47 vs 1.57 us,
    # fp8 1.71 vs 1.88 us; H=8 T=1024 2.66 vs 2.96 us; large T unchanged.
    # KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant instead.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    # One true division per fp8 element instead of the division-free quotient, for comparison;
    # both are bit-exact. KVWRITE_CUDA_EXACT_DIV=1 sets it.
    exact_div: bool = dataclasses.field(
        default_factory=lambda: nvrtc.env_flag("KVWRITE_CUDA_EXACT_DIV", "0"))

    # Measurement only, NOT exact (it breaks the fp8 rule): the fp8 quotient as x * (1 / s),
    # one rounded multiplication, as an approximate division computes it; `probe variants
    # --set cuda.inexact_quotient=True` uses it to time what the exact quotient costs.
    inexact_quotient: bool = False

    def tokens_per_thread(self, fp8: bool) -> int:
        return self.tokens_per_thread_fp8 if fp8 else self.tokens_per_thread_copy

    def chunk_input_bytes(self, fp8: bool, size: CallSize = CallSize.LARGE) -> int:
        if size is CallSize.SMALL:
            return self.small_chunk_bytes_fp8 if fp8 else self.small_chunk_bytes_copy
        if size is CallSize.MID:
            return self.mid_chunk_bytes_fp8 if fp8 else self.mid_chunk_bytes_copy
        return self.chunk_bytes_fp8 if fp8 else self.chunk_bytes_copy

    def call_size(self, key_bytes: int) -> CallSize:
        """The size class of a call that reads ``key_bytes`` of key input."""
        if key_bytes <= self.small_call_bytes:
            return CallSize.SMALL
        return CallSize.MID if key_bytes <= self.mid_call_bytes else CallSize.LARGE


TUNING = CudaTuning()


# --------------------------------------------------------------------------------------------
# Source and compilation
# --------------------------------------------------------------------------------------------
def kernel_source() -> str:
    """The text of ``kernel.cu``, found as package data (works from a wheel too)."""
    return SOURCE.text


def _macros(exact_div: bool, fixed, inexact_quotient: bool = False) -> tuple:
    macros: list = ["KVWRITE_EXACT_DIV"] if exact_div else []
    if inexact_quotient:
        macros.append("KVWRITE_PROBE_INEXACT_QUOTIENT")
    return tuple(macros) + nvrtc.fixed_args_macros(fixed)


def compile_kernel(arch: str, names, *, source: str | None = None, exact_div: bool = False,
                   fixed=None, ptxas_verbose: bool = False):
    """Compile kernel variants (name expressions) with NVRTC to one cubin for ``arch`` (e.g.
    "sm_90"); needs no GPU. ``fixed``: the trailing arguments compiled in (:func:`fixed_args`).
    Returns ``(object_code, log)`` (see :meth:`kvwrite.kernels.nvrtc.KernelSource.compile`)."""
    return SOURCE.compile(arch, names, source=source, macros=_macros(exact_div, fixed),
                          ptxas_verbose=ptxas_verbose)


def kernel_name(in_kind: int, out_kind: int, vec: int, slot_dtype: torch.dtype,
                loop_free: bool = True) -> str:
    """The name expression of one kernel variant (of the grid-stride kernel if not loop_free)."""
    slot = "long long" if slot_dtype == torch.int64 else "int"
    return f"{KERNEL if loop_free else GRID_STRIDE_KERNEL}<{in_kind}, {out_kind}, {vec}, {slot}>"


def all_kernel_names(tuning: CudaTuning = TUNING) -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for in_dtype, in_kind in _KIND.items():
        outs = [(_COPY, in_dtype.itemsize), (_E4M3, 1), (_E5M2, 1)]
        outs += [(k, d.itemsize) for d, k in _KIND.items() if d != in_dtype]
        for out_kind, out_bytes in outs:
            if out_kind == _COPY and in_kind == _BF16:
                continue  # 2-byte copies share the float16 variant
            vec = _widest_vec(in_dtype.itemsize, out_bytes, out_kind in (_E4M3, _E5M2),
                              tuning=tuning)
            while vec >= 1:
                for slot in (torch.int32, torch.int64):
                    names.append(kernel_name(in_kind, out_kind, vec, slot))
                    names.append(kernel_name(in_kind, out_kind, vec, slot, loop_free=False))
                vec //= 2
    return names


# --------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------
available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key, key_cache, cache_dtype, k_scale, v_scale) -> str | None:
    """Every validated case runs (any strides, dtypes, head sizes; unaligned rows fall back)."""
    return None


# --------------------------------------------------------------------------------------------
# Launch planning
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call shape is launched (cached per shape, strides, dtypes and alignment)."""

    name: str             # kernel name expression
    vec: int              # elements per vector access
    vec_bytes: int        # bytes per input vector access
    threads: int          # CTA size = tokens_per_cta * row
    tokens_per_cta: int   # several tokens per CTA when a row has few chunks
    grid_y: int           # CTAs per token when a row has many chunks
    chunks_per_head: int
    chunks_per_token: int
    block_shift: int      # log2(block_size), or -1
    loop_free: bool = False  # the loop-free kernel: one token per thread, grid_x = rows


def _widest_vec(in_bytes: int, out_bytes: int, fp8: bool, size: CallSize = CallSize.LARGE,
                tuning: CudaTuning = TUNING) -> int:
    """The widest VEC of a variant: ``tuning.chunk_input_bytes(fp8, size)`` of input per chunk
    (accesses of at most 16 bytes each, so 32 is two loads), and at most 32 bytes of output."""
    return max(1, min(tuning.chunk_input_bytes(fp8, size) // in_bytes, 32 // out_bytes))


def _vector_width(head_size: int, in_bytes: int, out_bytes: int, in_align: int, out_align: int,
                  in_strides: tuple[int, ...], cache_strides: tuple[int, ...],
                  fp8: bool = False, size: CallSize = CallSize.LARGE,
                  tuning: CudaTuning = TUNING) -> int:
    """The widest VEC whose accesses are all aligned (see the module docstring)."""
    vec = _widest_vec(in_bytes, out_bytes, fp8, size, tuning)
    while vec > 1:
        if (head_size % vec == 0 and in_align % min(vec * in_bytes, 16) == 0
                and out_align % min(vec * out_bytes, 16) == 0
                and all(s % vec == 0 for s in in_strides + cache_strides)):
            return vec
        vec //= 2
    return 1


def plan(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         slot_mapping: torch.Tensor, cache_dtype: CacheDType, size: CallSize | None = None,
         tuning: CudaTuning = TUNING) -> Plan:
    """The variant and CTA shape for these (validated) arguments; pure Python, needs no GPU.

    ``size``: plan for a call of that size class (chunk width); None decides from the call."""
    t_pad, num_heads, head_size = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    in_dtype = key.dtype
    in_kind = _KIND[in_dtype]
    out_kind = launch.cache_kind(cache_dtype, in_dtype, key_cache.dtype)
    out_bytes = 1 if cache_dtype.is_fp8 else key_cache.element_size()
    # Only strides along dims of size > 1 ever multiply a nonzero index.
    in_strides = tuple(t.stride(0) for t in (key, value) if t_pad > 1)
    cache_strides = tuple(s for s, n in zip(key_cache.stride()[:3], key_cache.shape[:3],
                                            strict=True) if n > 1)
    # The lowest set bit of the OR of the pointers is their common alignment (capped at 16).
    in_align = key.data_ptr() | value.data_ptr() | 16
    out_align = key_cache.data_ptr() | value_cache.data_ptr() | 16
    if size is None:
        size = tuning.call_size(slot_mapping.numel() * num_heads * head_size * in_dtype.itemsize)
    vec = _vector_width(head_size, in_dtype.itemsize, out_bytes, in_align & -in_align,
                        out_align & -out_align, in_strides, cache_strides, cache_dtype.is_fp8,
                        size, tuning)
    if out_kind == _COPY and in_kind == _BF16:
        in_kind = _F16  # a 2-byte copy: one compiled variant for float16 and bfloat16
    chunks_per_head = head_size // vec
    chunks = num_heads * chunks_per_head
    if chunks <= tuning.small_row_threads:
        row, tokens_per_cta, grid_y = chunks, tuning.small_row_threads // chunks, 1
    elif chunks <= tuning.max_threads:
        row, tokens_per_cta, grid_y = chunks, 1, 1
    else:
        parts = -(-chunks // tuning.max_threads)
        row, tokens_per_cta = -(-chunks // parts), 1
        grid_y = min(parts, tuning.max_grid_y)  # the grid-stride kernel loops over the rest
    shift = launch.log2_or_minus_1(block_size)
    loop_free = tuning.loop_free and grid_y * row >= chunks
    return Plan(name=kernel_name(in_kind, out_kind, vec, slot_mapping.dtype, loop_free), vec=vec,
                vec_bytes=vec * in_dtype.itemsize, threads=row * tokens_per_cta,
                tokens_per_cta=tokens_per_cta, grid_y=grid_y, chunks_per_head=chunks_per_head,
                chunks_per_token=chunks, block_shift=shift, loop_free=loop_free)


def _launchable(key, value, key_cache, value_cache, slot_mapping, cache_dtype, size: CallSize,
                tuning: CudaTuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(key, value, key_cache, value_cache, slot_mapping, cache_dtype, size, tuning)
    index = key.get_device()
    with nvrtc.capture_relaxed():
        nvrtc.cuda_core().Device(index).set_current()  # PyTorch's primary context, this thread
        arch, sm_count = nvrtc.device_arch(index)
        tail = fixed_args(key, value, key_cache, p)
        macros = _macros(tuning.exact_div, tail if tuning.specialize else None,
                         tuning.inexact_quotient)
        kernel = SOURCE.kernel(arch, p.name, macros)
        pdl_kernel = nvrtc.pdl_twin(SOURCE, arch, p.name, macros, index)
        per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(p.threads, 0)
    wave = sm_count * max(1, per_sm)  # resident CTAs, over grid_x * grid_y
    # bounds: the grid-stride kernel's (min grid_x, max grid_x, tokens per thread).
    return launch.Launchable(kernel, pdl_kernel, index, tail, p,
                             (max(1, wave * tuning.min_waves // p.grid_y),
                              max(1, wave * tuning.max_waves // p.grid_y),
                              tuning.tokens_per_thread(cache_dtype.is_fp8)))


def fixed_args(key, value, key_cache, p: Plan) -> tuple[int, ...]:
    """The kernel's trailing int64 arguments, fixed by the call signature (from key_stride on)."""
    num_blocks, block_size = key_cache.shape[:2]
    block_stride, page_stride, head_stride = key_cache.stride()[:3]
    return (key.stride(0), value.stride(0), block_stride, page_stride, head_stride, block_size,
            p.block_shift, num_blocks * block_size, p.chunks_per_head, p.chunks_per_token,
            launch.log2_or_minus_1(p.chunks_per_head))



LAUNCHES = launch.LaunchCache()


# --------------------------------------------------------------------------------------------
# The implementation
# --------------------------------------------------------------------------------------------
def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch the kernel on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    kp, vp = key.data_ptr(), value.data_ptr()
    kcp, vcp = key_cache.data_ptr(), value_cache.data_ptr()
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    _, num_heads, head_size = key.shape
    size = tuning.call_size(num_tokens * num_heads * head_size * key.element_size())
    sig = (key.dtype, key_cache.dtype, cache_dtype, slot_mapping.dtype, key.shape[1:],
           key.shape[0] > 1, key.stride(0), value.stride(0), key_cache.shape, key_cache.stride(),
           (kp | vp) & 15, (kcp | vcp) & 15, key.get_device(), size, tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(key, value, key_cache, value_cache, slot_mapping,
                                          cache_dtype, size, tuning)
    p = lau.plan
    rows = -(-num_tokens // p.tokens_per_cta)  # grid_x with one token per thread
    if p.loop_free:  # every thread one token
        if rows > tuning.max_grid_x:
            raise ValueError(f"slot_mapping: at most {tuning.max_grid_x * p.tokens_per_cta} "
                             f"tokens per call with this cache shape, got {num_tokens}")
        grid_x = rows
    else:
        min_grid_x, max_grid_x, tokens_per_thread = lau.bounds
        grid_x = min(rows, max_grid_x, max(min_grid_x, -(-rows // tokens_per_thread)))
    kernel, pdl = lau.pick(grid_x * p.grid_y, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid_x, p.grid_y, p.threads // p.tokens_per_cta,
                                 p.tokens_per_cta, pdl)
    ksp, vsp, kss, vss = launch.scale_args(k_scale, v_scale)
    # The kernel's arguments: 7 pointers, then int64s: num_tokens, the two scale strides and
    # fixed_args (test_cuda checks this against the compiled signature).
    nvrtc.launch(lau.device_index, config, kernel, kp, vp, kcp,
                 vcp, slot_mapping.data_ptr(), ksp, vsp, num_tokens, kss, vss, *lau.fixed)
