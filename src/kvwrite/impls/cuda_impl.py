"""The CUDA implementation: ``reshape_and_cache.cu`` compiled at run time with NVRTC (cuda.core).

No nvcc and no C++ toolchain at run time: the kernel source ships as package data, is compiled
for the current GPU's architecture the first time a variant is needed (once per process), and
is launched on PyTorch's current stream through ``cuda.core``.

Two kernels take the same arguments: ``reshape_and_cache_flash_kernel`` (one token's chunk per
thread, no loops), which every call runs unless a token's row is too long for its grid, and
``reshape_and_cache_flash_grid_stride_kernel`` (threads walk tokens and chunks with grid
strides) for those. By default each call signature gets its own build with the
arguments fixed by the caches and the inputs' layout compiled in (see ``_SPECIALIZE``).

Variants (template arguments of both kernels): input dtype, cache element
kind (a plain copy of the input bits, a float cast, fp8 e4m3 or e5m2), the vector width VEC in
elements and the slot index type. VEC is the widest chunk of at most ``CHUNK_INPUT_BYTES`` of
input (16, or 32 as two 16-byte loads; fewer for small calls) and 32 bytes of output, halving
down to one element, such that every row chunk of VEC elements is aligned in the inputs and the
caches: ``head_size % VEC == 0``, data pointers and every stride that moves (token, block, slot,
head) multiples of VEC elements; otherwise one element per access (e.g. bfloat16 with head_size
46: 92-byte rows are 4-byte but not 16-byte aligned, so VEC = 2).

Graph-safe: a call does no allocation and no host sync; scales are read on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.resources
import os
from collections.abc import Sequence

import torch

from ..dtypes import CacheDType

__all__ = ["available", "unsupported", "run", "plan", "fixed_args", "kernel_source",
           "compile_kernel"]

INSTALL_HINT = "pip install cuda-core cuda-bindings nvidia-cuda-nvrtc"
SOURCE_NAME = "reshape_and_cache.cu"
KERNEL = "reshape_and_cache_flash_kernel"  # no loops: one token's chunk per thread
GRID_STRIDE_KERNEL = "reshape_and_cache_flash_grid_stride_kernel"  # rows too long for KERNEL

# Element kinds, as DT_* in the .cu file.
_F16, _BF16, _F32, _E4M3, _E5M2, _COPY = range(6)
_KIND = {torch.float16: _F16, torch.bfloat16: _BF16, torch.float32: _F32}
_FP8_KIND = {CacheDType.FP8_E4M3: _E4M3, CacheDType.FP8_E5M2: _E5M2}

# Threads per CTA (at most the kernel's __launch_bounds__, 256). Rows of more chunks than
# MAX_THREADS are split over CTAs of up to MAX_THREADS threads; smaller rows are packed several
# tokens to a CTA of up to SMALL_ROW_THREADS. Measured on H200 (scripts/perf_probe.py, 20-call
# graphs, hot L2, bf16 copies, T=65536): H=128 rows 2163 us with 256-thread CTAs vs 2171 us with
# 128; H=8 rows 136.3 us with 128-thread CTAs vs 142.8 us with 256; T=2: 128 is 0.05-0.1 us
# faster than 256.
MAX_THREADS = 256
SMALL_ROW_THREADS = 128
# Grid: sized so that each thread handles about _TOKENS_PER_THREAD tokens (it walks them with a
# grid stride, two a step), which amortizes its prologue (index setup; for fp8, two scale loads
# and two reciprocals), but never fewer than _MIN_WAVES nor more than _MAX_WAVES waves of
# resident CTAs (by the occupancy API). Measured on H200 (hot L2, bf16, T=65536 unless said):
# - fixed caps instead: one CTA per token part (64 waves) made fp8 slow (H=8 135 vs 105 us with
#   4 waves) and copies at T=4096 slower (H=128 143.5 vs 139.9 us), but copies at T=65536 faster
#   (H=128 2153 vs 2195 us): a cap that suits one T starves another, hence a target per thread;
# - copies, 4 vs 16 tokens per thread: H=128 T=4096 136.1 vs 139.1 us, H=8 136.3 vs 139.1 us;
# - fp8, 16 vs 4: H=128 T=4096 105.6 vs 108.9 us, T=16384 406.8 vs 424.9 us.
_TOKENS_PER_THREAD = {False: 4, True: 16}  # keyed by "is fp8"
# Input bytes per chunk (one thread's share of a row), keyed by "is fp8". 32 bytes (two 16-byte
# loads) halves the threads, and so the per-thread setup (indices; for fp8 the scales' constants)
# per byte moved. Measured on H200 (hot L2, bf16 -> e4m3, scripts/perf_probe.py), 32 vs 16:
# H=128 T=65536 NHD 1547 vs 1613 us (98.3 vs 94.3%), HND 1676 vs 1733 us (90.8 vs 87.8%);
# H=8 T=65536 NHD 102.0 vs 106.3 us, T=1024 3.76 vs 4.23 us.
CHUNK_INPUT_BYTES = {False: 16, True: 32}
# Small calls (at most _SMALL_CALL_BYTES of key input) are latency-bound: there, narrower chunks
# spread each token's work over more threads, which shortens every thread's chain of loads,
# conversions and stores. Measured on H200 (hot L2, bf16 -> e4m3), 8 vs 32 input bytes a chunk:
# H=128 T=2 1.98 vs 2.38 us, T=4 1.96 vs 2.35 us; H=8 T=2 1.91 vs 2.03 us, T=64 2.00 vs 2.17 us.
# Copies gain nothing from 8 bytes (H=128 T=2 1.73-1.77 us either way), so they keep 16. The
# limit, 512 KiB vs 128 KiB: H=128 T=8 2.13 vs 2.42 us, T=16 2.32 vs 2.48 us, H=8 T=256 2.28 vs
# 2.38 us; 2 MiB made H=128 T=64 (4.25 vs 3.36 us) and H=8 T=1024 (4.24 vs 3.39 us) slower.
_SMALL_CALL_BYTES = 512 * 1024
_SMALL_CALL_INPUT_BYTES = {False: 16, True: 8}
_MIN_WAVES = 4
_MAX_WAVES = 64

# KVWRITE_CUDA_EXACT_DIV=1 compiles the fp8 kernels with one true division per element instead of
# the division-free quotient, for comparison; both are bit-exact.
_EXACT_DIV = os.environ.get("KVWRITE_CUDA_EXACT_DIV", "") not in ("", "0")
# Each call signature (dtypes, shapes, strides, alignment) gets its own build with the kernel's
# fixed arguments compiled in as constants (``fixed_args``; NVRTC, about 0.3 s once per signature
# and process), so the kernel reads only its pointers, num_tokens and the scale strides from
# the parameter bank and its index math folds. Measured on H200 (hot L2, mean over 5 slot sets,
# scripts/small_t_probe.py), specialized vs generic: H=8 T=2 copies 1.47 vs 1.57 us, fp8 1.71 vs
# 1.88 us; H=128 T=2 copies 1.57 vs 1.75 us, fp8 1.84 vs 1.97 us; H=8 T=1024 2.66 vs 2.96 us
# (scripts/perf_probe.py); large T unchanged. KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel
# per variant instead (fewer compilations when many cache geometries are used).
_SPECIALIZE = os.environ.get("KVWRITE_CUDA_SPECIALIZE", "1").strip() != "0"
# Calls run the kernel without loops (reshape_and_cache_flash_kernel: one token's chunk
# per thread, loads issued before the slot is tested) whenever its grid can hold a token's row
# (at most _MAX_GRID_Y CTAs per token), else the grid-stride kernel. Measured on H200 (hot L2),
# loop-free vs grid-stride, same chunk sizes: small calls (scripts/small_t_probe.py, mean over 5
# slot sets) H=8 T=2 copies 1.34 vs 1.41 us, fp8 1.48 vs 1.65 us, H=128 T=2 copies 1.46 vs
# 1.55 us, fp8 1.57 vs 1.74 us; mid-size (scripts/perf_probe.py) H=128 fp8 NHD T=512 13.14 vs
# 14.31 us, T=1024 29.4 vs 30.7 us, H=8 fp8 T=4096 5.45 vs 6.59 us; large, T=65536: H=128
# copies NHD 2146 vs 2192 us, HND 2142 vs 2173 us, fp8 NHD 1555 vs 1561 us, HND 1677 vs 1684 us,
# packed 1556 vs 1567 us, H=8 copies 134.8 vs 136.1 us, fp8 NHD 97.9 vs 100.5 us, HND 104.1 vs
# 106.5 us. (With the loop-free kernel, 16-byte fp8 chunks were faster at some mid sizes and
# slower at others, e.g. H=128 NHD T=65536 1595 vs 1555 us; 32 bytes stays. Reading the inputs
# with plain loads instead of the read-only path, 0.05-0.1 us faster for small fp8 calls with
# the grid-stride kernel, makes no difference with this one.)
_LOOP_FREE = True
_MAX_GRID_Y = 65535
_MAX_GRID_X = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Source and compilation
# --------------------------------------------------------------------------------------------
@functools.cache
def kernel_source() -> str:
    """The text of ``reshape_and_cache.cu``, found as package data (works from a wheel too)."""
    return importlib.resources.files(__package__).joinpath(SOURCE_NAME).read_text(encoding="utf-8")


def kernel_name(in_kind: int, out_kind: int, vec: int, slot_dtype: torch.dtype,
                loop_free: bool = True) -> str:
    """The name expression of one kernel variant (of the grid-stride kernel if not loop_free)."""
    slot = "long long" if slot_dtype == torch.int64 else "int"
    return f"{KERNEL if loop_free else GRID_STRIDE_KERNEL}<{in_kind}, {out_kind}, {vec}, {slot}>"


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for in_dtype, in_kind in _KIND.items():
        outs = [(_COPY, in_dtype.itemsize), (_E4M3, 1), (_E5M2, 1)]
        outs += [(k, d.itemsize) for d, k in _KIND.items() if d != in_dtype]
        for out_kind, out_bytes in outs:
            if out_kind == _COPY and in_kind == _BF16:
                continue  # 2-byte copies share the float16 variant
            vec = _widest_vec(in_dtype.itemsize, out_bytes, out_kind in (_E4M3, _E5M2))
            while vec >= 1:
                for slot in (torch.int32, torch.int64):
                    names.append(kernel_name(in_kind, out_kind, vec, slot))
                    names.append(kernel_name(in_kind, out_kind, vec, slot, loop_free=False))
                vec //= 2
    return names


@functools.cache
def _cuda_core():
    try:
        import cuda.core as cc
    except ImportError as e:
        raise ImportError(f"the cuda implementation needs cuda.core ({e}); {INSTALL_HINT}") from e
    return cc


class _Log:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, text) -> None:
        self.parts.append(text.decode(errors="replace") if isinstance(text, bytes) else str(text))


def compile_kernel(arch: str, names: str | Sequence[str], *, source: str | None = None,
                   exact_div: bool = False, fixed: Sequence[int] | None = None,
                   ptxas_verbose: bool = False):
    """Compile kernel variants (name expressions) with NVRTC to one cubin for ``arch`` (e.g.
    "sm_90"); needs no GPU.

    Returns ``(object_code, log)``: a cuda.core ``ObjectCode`` (``.code`` is the cubin,
    ``.get_kernel(name)`` a kernel) and NVRTC's log (with ``ptxas_verbose``, ptxas's register
    and spill report). A compile error raises RuntimeError carrying NVRTC's log.
    """
    names = (names,) if isinstance(names, str) else tuple(names)
    cc = _cuda_core()
    macros: list = ["KVWRITE_EXACT_DIV"] if exact_div else []
    if fixed is not None:
        macros.append(("KVWRITE_FIXED_ARGS", ",".join(str(int(v)) for v in fixed)))
    options = cc.ProgramOptions(name="kvwrite_reshape_and_cache", arch=arch, std="c++17",
                                define_macro=macros or None,
                                ptxas_options="-v" if ptxas_verbose else None)
    program = cc.Program(kernel_source() if source is None else source, "c++", options)
    log = _Log()
    try:
        obj = program.compile("cubin", name_expressions=names, logs=log)
    except Exception as e:  # cuda.core's NVRTCError carries the compilation log in its text
        what = names[0] if len(names) == 1 else f"{len(names)} kernel variants"
        text = f"{e}\n{''.join(log.parts)}".replace("\x00", "").strip()
        raise RuntimeError(f"cuda: NVRTC could not compile {what} for {arch}:\n{text}") from e
    finally:
        program.close()
    return obj, "".join(log.parts).replace("\x00", "")


@functools.cache
def _kernel(arch: str, name: str, exact_div: bool, fixed: tuple[int, ...] | None = None):
    obj, _ = compile_kernel(arch, name, exact_div=exact_div, fixed=fixed)
    return obj.get_kernel(name)


# --------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------
@functools.cache
def _setup_reason() -> str | None:
    try:
        _cuda_core()
    except ImportError as e:
        return str(e)
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        if int(err) != 0:
            raise RuntimeError(f"nvrtcVersion returned {err}")
    except Exception as e:  # the library itself is missing or broken
        return f"the cuda implementation cannot load NVRTC ({e}); {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return ("the cuda implementation needs a CUDA GPU visible to PyTorch "
                "(none found: no GPU, no NVIDIA driver, or a CPU-only PyTorch build)")
    return None


@functools.cache
def available(device: torch.device) -> str | None:
    """None on a CUDA device with cuda.core and NVRTC loadable, else why not (what to install)."""
    if device.type != "cuda":
        return f"the cuda implementation runs on CUDA devices only, got {device.type!r}"
    return _setup_reason()


def unsupported(key, key_cache, cache_dtype, k_scale) -> str | None:
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


def _out_kind(cache_dtype: CacheDType, in_dtype: torch.dtype, cache_tensor: torch.dtype) -> int:
    if cache_dtype.is_fp8:
        return _FP8_KIND[cache_dtype]
    if cache_tensor == in_dtype:
        return _COPY
    return _KIND[cache_tensor]


def _widest_vec(in_bytes: int, out_bytes: int, fp8: bool, small: bool = False) -> int:
    """The widest VEC of a variant: CHUNK_INPUT_BYTES[fp8] (_SMALL_CALL_INPUT_BYTES[fp8] for a
    small call) of input per chunk (accesses of at most 16 bytes each, so 32 is two loads), and
    at most 32 bytes of output."""
    limit = (_SMALL_CALL_INPUT_BYTES if small else CHUNK_INPUT_BYTES)[fp8]
    return max(1, min(limit // in_bytes, 32 // out_bytes))


def _vector_width(head_size: int, in_bytes: int, out_bytes: int, in_align: int, out_align: int,
                  in_strides: tuple[int, ...], cache_strides: tuple[int, ...],
                  fp8: bool = False, small: bool = False) -> int:
    """The widest VEC whose accesses are all aligned (see the module docstring)."""
    vec = _widest_vec(in_bytes, out_bytes, fp8, small)
    while vec > 1:
        if (head_size % vec == 0 and in_align % min(vec * in_bytes, 16) == 0
                and out_align % min(vec * out_bytes, 16) == 0
                and all(s % vec == 0 for s in in_strides + cache_strides)):
            return vec
        vec //= 2
    return 1


def plan(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         slot_mapping: torch.Tensor, cache_dtype: CacheDType, small: bool | None = None) -> Plan:
    """The variant and CTA shape for these (validated) arguments; pure Python, needs no GPU.

    ``small``: plan for a small call (narrower chunks); None decides from the call's size."""
    t_pad, num_heads, head_size = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    in_dtype = key.dtype
    in_kind = _KIND[in_dtype]
    out_kind = _out_kind(cache_dtype, in_dtype, key_cache.dtype)
    out_bytes = 1 if cache_dtype.is_fp8 else key_cache.element_size()
    # Only strides along dims of size > 1 ever multiply a nonzero index.
    in_strides = tuple(t.stride(0) for t in (key, value) if t_pad > 1)
    cache_strides = tuple(s for s, n in zip(key_cache.stride()[:3], key_cache.shape[:3],
                                            strict=True) if n > 1)
    # The lowest set bit of the OR of the pointers is their common alignment (capped at 16).
    in_align = key.data_ptr() | value.data_ptr() | 16
    out_align = key_cache.data_ptr() | value_cache.data_ptr() | 16
    if small is None:
        small = is_small_call(slot_mapping.numel(), num_heads, head_size, in_dtype.itemsize)
    vec = _vector_width(head_size, in_dtype.itemsize, out_bytes, in_align & -in_align,
                        out_align & -out_align, in_strides, cache_strides, cache_dtype.is_fp8,
                        small)
    if out_kind == _COPY and in_kind == _BF16:
        in_kind = _F16  # a 2-byte copy: one compiled variant for float16 and bfloat16
    chunks_per_head = head_size // vec
    chunks = num_heads * chunks_per_head
    if chunks <= SMALL_ROW_THREADS:
        row, tokens_per_cta, grid_y = chunks, SMALL_ROW_THREADS // chunks, 1
    elif chunks <= MAX_THREADS:
        row, tokens_per_cta, grid_y = chunks, 1, 1
    else:
        parts = -(-chunks // MAX_THREADS)
        row, tokens_per_cta = -(-chunks // parts), 1
        grid_y = min(parts, _MAX_GRID_Y)  # the grid-stride kernel loops over the rest
    shift = _log2_or_minus_1(block_size)
    loop_free = _LOOP_FREE and grid_y * row >= chunks
    return Plan(name=kernel_name(in_kind, out_kind, vec, slot_mapping.dtype, loop_free), vec=vec,
                vec_bytes=vec * in_dtype.itemsize, threads=row * tokens_per_cta,
                tokens_per_cta=tokens_per_cta, grid_y=grid_y, chunks_per_head=chunks_per_head,
                chunks_per_token=chunks, block_shift=shift, loop_free=loop_free)


@dataclasses.dataclass(frozen=True)
class _Launchable:
    plan: Plan
    kernel: object
    min_grid_x: int
    max_grid_x: int
    tokens_per_thread: int
    device_index: int
    tail: tuple  # fixed_args(...)


@contextlib.contextmanager
def _capture_relaxed():
    """Let this thread load a module while PyTorch captures a CUDA graph (first call of a variant
    inside torch.cuda.graph): global capture mode forbids it, relaxed mode allows it."""
    if not torch.cuda.is_current_stream_capturing():
        yield
        return
    from cuda.bindings import driver

    modes = driver.CUstreamCaptureMode
    _, previous = driver.cuThreadExchangeStreamCaptureMode(modes.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


@functools.cache
def _device_arch(index: int) -> tuple[str, int]:
    """(arch, SM count) of CUDA device ``index``."""
    dev = _cuda_core().Device(index)
    major, minor = dev.compute_capability
    return f"sm_{major}{minor}", dev.properties.multiprocessor_count


def is_small_call(num_tokens: int, num_heads: int, head_size: int, in_bytes: int) -> bool:
    """Whether a call is planned as a small (latency-bound) one."""
    return num_tokens * num_heads * head_size * in_bytes <= _SMALL_CALL_BYTES


def _launchable(key, value, key_cache, value_cache, slot_mapping, cache_dtype,
                exact_div: bool, small: bool) -> _Launchable:
    reason = _setup_reason()
    if reason is not None:
        raise RuntimeError(reason)
    p = plan(key, value, key_cache, value_cache, slot_mapping, cache_dtype, small)
    index = key.get_device()
    with _capture_relaxed():
        _cuda_core().Device(index).set_current()  # PyTorch's primary context, on this thread
        arch, sm_count = _device_arch(index)
        tail = fixed_args(key, value, key_cache, p)
        kernel = _kernel(arch, p.name, exact_div, tail if _SPECIALIZE else None)
        per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(p.threads, 0)
    wave = sm_count * max(1, per_sm)  # resident CTAs, over grid_x * grid_y
    return _Launchable(p, kernel, max(1, wave * _MIN_WAVES // p.grid_y),
                       max(1, wave * _MAX_WAVES // p.grid_y),
                       _TOKENS_PER_THREAD[cache_dtype.is_fp8], index, tail)


def fixed_args(key, value, key_cache, p: Plan) -> tuple[int, ...]:
    """The kernel's trailing int64 arguments, fixed by the call signature (from key_stride on)."""
    num_blocks, block_size = key_cache.shape[:2]
    block_stride, page_stride, head_stride = key_cache.stride()[:3]
    return (key.stride(0), value.stride(0), block_stride, page_stride, head_stride, block_size,
            p.block_shift, num_blocks * block_size, p.chunks_per_head, p.chunks_per_token,
            _log2_or_minus_1(p.chunks_per_head))


def _log2_or_minus_1(n: int) -> int:
    return n.bit_length() - 1 if n & (n - 1) == 0 else -1


@functools.cache
def _config(grid_x: int, grid_y: int, row: int, tokens_per_cta: int):
    return _cuda_core().LaunchConfig(grid=(grid_x, grid_y, 1), block=(row, tokens_per_cta, 1))


_STREAMS: dict[int, object] = {}
_LAUNCHABLES: dict[tuple, _Launchable] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int):
    # torch._C._cuda_getCurrentRawStream skips building a torch.cuda.Stream per call.
    handle = (_raw_stream(device_index) if _raw_stream is not None
              else torch.cuda.current_stream(device_index).cuda_stream)
    stream = _STREAMS.get(handle)
    if stream is None:
        with _capture_relaxed():
            stream = _STREAMS[handle] = _cuda_core().Stream.from_handle(handle)
    return stream


# --------------------------------------------------------------------------------------------
# The implementation
# --------------------------------------------------------------------------------------------
def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None) -> None:
    """Launch the kernel on PyTorch's current stream (arguments validated by kvwrite.op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    kp, vp = key.data_ptr(), value.data_ptr()
    kcp, vcp = key_cache.data_ptr(), value_cache.data_ptr()
    # Everything that selects the variant, the CTA shape or a fixed kernel argument.
    _, num_heads, head_size = key.shape
    small = is_small_call(num_tokens, num_heads, head_size, key.element_size())
    sig = (key.dtype, key_cache.dtype, cache_dtype, slot_mapping.dtype, key.shape[1:],
           key.shape[0] > 1, key.stride(0), value.stride(0), key_cache.shape, key_cache.stride(),
           (kp | vp) & 15, (kcp | vcp) & 15, key.get_device(), _EXACT_DIV, _SPECIALIZE, small)
    lau = _LAUNCHABLES.get(sig)
    if lau is None:
        lau = _LAUNCHABLES[sig] = _launchable(key, value, key_cache, value_cache, slot_mapping,
                                              cache_dtype, _EXACT_DIV, small)
    p = lau.plan
    rows = -(-num_tokens // p.tokens_per_cta)  # grid_x with one token per thread
    if p.loop_free:  # every thread one token
        if rows > _MAX_GRID_X:
            raise ValueError(f"slot_mapping: at most {_MAX_GRID_X * p.tokens_per_cta} tokens "
                             f"per call with this cache shape, got {num_tokens}")
        grid_x = rows
    else:
        grid_x = min(rows, lau.max_grid_x,
                     max(lau.min_grid_x, -(-rows // lau.tokens_per_thread)))
    config = _config(grid_x, p.grid_y, p.threads // p.tokens_per_cta, p.tokens_per_cta)
    if k_scale is None:
        ksp = vsp = kss = vss = 0
    else:
        ksp, vsp = k_scale.data_ptr(), v_scale.data_ptr()
        kss, vss = int(k_scale.numel() > 1), int(v_scale.numel() > 1)
    stream = _current_stream(lau.device_index)
    launch = _cuda_core().launch
    # The kernel's arguments: 7 pointers, then int64s: num_tokens, the two scale strides and
    # fixed_args (test_cuda checks this against the compiled signature).
    try:
        launch(stream, config, lau.kernel, kp, vp, kcp, vcp, slot_mapping.data_ptr(), ksp, vsp,
               num_tokens, kss, vss, *lau.tail)
    except Exception:
        # A thread on which nothing made the device's context current yet: do it and retry
        # once (a launch error of any other kind raises again).
        _cuda_core().Device(lau.device_index).set_current()
        launch(stream, config, lau.kernel, kp, vp, kcp, vcp, slot_mapping.data_ptr(), ksp, vsp,
               num_tokens, kss, vss, *lau.tail)
