"""The CUDA implementation of reshape_and_cache_flash_per_token_head_quant: ``kernel.cu`` compiled
at run time with NVRTC (through :mod:`kvwrite.kernels.nvrtc`), launched on PyTorch's current
stream.

One kernel, ``pth_quant_kernel<IN, MODE, VEC, CPL>`` (see ``kernel.cu``): a group of
``lanes`` threads per (token, head, K or V) row, each holding CPL chunks of VEC elements. VEC is
the widest chunk of at most 16 bytes of input such that both head sizes are multiples of it and
every input row start is aligned to its bytes (halving down to one element; int4 codes of single
elements are paired across lanes); a chunk's codes are stored in accesses as wide as every cache
row start's alignment allows (the fixed argument ``store_shift``: vLLM's packed rows put V's
codes 4 bytes off alignment, and loads need not be narrowed for it). ``lanes`` is the power of
two (at most 32) that covers the row's chunks with ``CudaTuning.chunks_per_lane`` chunks per
lane (large calls: ``large_elems_per_lane`` elements), and CPL (1, 2, 4 or 8, at most 64
elements per lane) what is left; rows longer than that (head sizes above 256 that no wider chunk
divides, above 512 or 1024 where 4- or 8-byte chunks are the widest, above 2048 otherwise) are
unsupported here (torch and triton run them). The slot width (int32 or int64) is a fixed
argument, not a template one: the variants stay few enough to compile all of them in a test. By
default each call signature gets its own build with the arguments fixed by the caches and the
inputs' layout compiled in (``CudaTuning.specialize``).

The kernel runs a row by one of two paths: the fast path for rows of finite values (int4: whose
range also holds zero), the general path for the others (NaN, infinities, int4 rows of one
sign); see kernel.cu. ``CudaTuning.general_path_only`` (tests) sends every row down the general
path.

Graph-safe: a call does no allocation and no host sync.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ...kernels import launch, nvrtc
from .op import PerTokenHeadMode

__all__ = ["CudaTuning", "TUNING", "available", "unsupported", "run", "plan", "Plan",
           "all_kernel_names", "compile_kernel", "kernel_name", "SOURCE", "NUM_FIXED",
           "MAX_ELEMS_PER_LANE", "GENERAL_ONLY_MACRO", "FAST_ONLY_MACRO"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_pth_quant")
KERNEL = "pth_quant_kernel"

# Element kinds, as DT_* in kvw/common.cuh; modes as PTH_* in kernel.cu.
_F16, _BF16, _F32 = 0, 1, 2
_KIND = launch.KIND
_MODE = {PerTokenHeadMode.INT8_PER_TOKEN_HEAD: 0, PerTokenHeadMode.FP8_PER_TOKEN_HEAD: 1,
         PerTokenHeadMode.INT4_PER_TOKEN_HEAD: 2}
_CPLS = (1, 2, 4, 8)
MAX_ELEMS_PER_LANE = 64
NUM_FIXED = 25  # slot64 .. store_shift (kernel.cu's KVW_PTH_PARAMS after num_tokens)
# Builds of kernel.cu for tests and machine-code counts: every row down the general path; the
# fast path alone (wrong on NaN and infinite rows: never launched).
GENERAL_ONLY_MACRO = "KVWRITE_PTH_GENERAL_ONLY"
FAST_ONLY_MACRO = "KVWRITE_PTH_FAST_ONLY"


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a path).

    Not measured yet (no GPU when this kernel was written): the values follow the other ops'
    measured choices and are the first thing to tune on an H200."""

    # Threads per CTA (a multiple of 32, at most 256).
    threads: int = 256
    # Chunks per lane of small calls: one 16-byte chunk per lane keeps a row's lanes at one
    # memory round trip each (as the other ops' small calls).
    chunks_per_lane: int = 1
    # Calls reading more than large_call_bytes of key and value take large_elems_per_lane
    # elements per lane (fewer lanes per row): every lane of a row computes the row's scale and
    # the quotient's constants and addresses its stores, so the instructions per element fall
    # with more elements per lane (static sm_90 SASS of the fast path, packed H=8 D=128 bf16, at
    # 32 / 64 elements: int8 12.1 / 10.3, fp8 9.8 / 8.1, int4 11.7 / 9.7 per element), but a
    # lane's chain grows. Measured (H200, kvwrite-bench per-token-head, cold L2, H=8 D=128 bf16
    # packed NHD; T=16384 / 65536, µs) at 8 / 16 / 32 elements per lane: int8 34.6 / 133.1,
    # 27.4 / 104.1, 36.6 / 132.7; fp8 32.2 / 124.2, 26.9 / 102.0, 40.2 / 149.1; int4 36.7 /
    # 141.7, 26.0 / 98.3, 23.4 / 83.5 (64: about 360 µs at 65536 for int8 and fp8). None: 16 for
    # int8 and fp8, 32 for int4; KVWRITE_PTH_LARGE_ELEMS=N sets one value for every mode.
    large_call_bytes: int = 8 << 20
    large_elems_per_lane: int | None = dataclasses.field(
        default_factory=lambda: (int(os.environ["KVWRITE_PTH_LARGE_ELEMS"])
                                 if os.environ.get("KVWRITE_PTH_LARGE_ELEMS") else None))
    # One build per call signature with the fixed arguments compiled in (NVRTC once per
    # signature and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)
    # Tests only: every row down the kernel's general path (KVWRITE_PTH_GENERAL_ONLY), which
    # otherwise runs only rows with NaN or infinite values (int4: also rows of one sign).
    general_path_only: bool = False


TUNING = CudaTuning()


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 25 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def kernel_name(in_kind: int, mode: int, vec: int, cpl: int) -> str:
    return f"{KERNEL}<{in_kind}, {mode}, {vec}, {cpl}>"


def _code_bytes(mode: int, vec: int) -> int:
    """Code bytes of a chunk of ``vec`` elements (kernel.cu's OUT_N)."""
    return (vec // 2 if vec >= 2 else 1) if mode == _MODE[PerTokenHeadMode.INT4_PER_TOKEN_HEAD] \
        else vec


def _vecs(in_bytes: int) -> list[int]:
    v, out = 16 // in_bytes, []
    while v >= 1:
        out.append(v)
        v //= 2
    return out


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    names = []
    for dtype, kind in _KIND.items():
        for mode in _MODE.values():
            for vec in _vecs(dtype.itemsize):
                for cpl in _CPLS:
                    if vec * cpl <= MAX_ELEMS_PER_LANE:
                        names.append(kernel_name(kind, mode, vec, cpl))
    return names


available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    vec: int            # elements per chunk
    cpl: int            # chunks per lane
    sw: int             # bytes per store of a chunk's codes
    lanes: int          # threads per row
    fixed: tuple[int, ...]  # slot64 .. store_shift (the 25 trailing kernel arguments)




def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_large_call(num_tokens: int, key: torch.Tensor, value: torch.Tensor,
                  tuning: CudaTuning = TUNING) -> bool:
    """Whether a call is planned with the large calls' chunks per lane."""
    h = key.shape[1]
    return num_tokens * h * (key.shape[2] + value.shape[2]) * key.element_size() > \
        tuning.large_call_bytes


def plan(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
         mode: PerTokenHeadMode, tuning: CudaTuning = TUNING) -> Plan | str:
    """The variant, lanes and fixed arguments for these (validated) arguments, or why none fits;
    no GPU needed."""
    t_pad = min(key.shape[0], value.shape[0])
    h, dk, dv = key.shape[1], key.shape[2], value.shape[2]
    nb, bs = key_cache.shape[:2]
    ib = key.element_size()
    int4 = mode.is_int4
    # Strides along dims of size 1 never multiply a nonzero index: 0 there (fewer builds).
    k_tok = key.stride(0) if t_pad > 1 else 0
    v_tok = value.stride(0) if t_pad > 1 else 0
    k_head = key.stride(1) if h > 1 else 0
    v_head = value.stride(1) if h > 1 else 0

    def cache_strides(c):
        return tuple(st if n > 1 else 0 for st, n in zip(c.stride()[:3], (nb, bs, h), strict=True))

    kc, vc = cache_strides(key_cache), cache_strides(value_cache)
    ks, vs = cache_strides(k_scale_cache), cache_strides(v_scale_cache)
    in_al = launch.align([key.data_ptr(), value.data_ptr()]
                         + [s * ib for s in (k_tok, v_tok, k_head, v_head)])
    out_al = launch.align([key_cache.data_ptr(), value_cache.data_ptr()] + list(kc) + list(vc))
    vec = 16 // ib
    while vec > 1:
        if dk % vec == 0 and dv % vec == 0 and in_al % (vec * ib) == 0:
            break
        vec //= 2
    # The stores as wide as the cache rows' alignment allows, at most a chunk's code bytes.
    sw = min(_code_bytes(_MODE[mode], vec), out_al)
    chunks = max(dk, dv) // vec
    large = is_large_call(slot_mapping.numel(), key, value, tuning)
    elems = tuning.large_elems_per_lane or (32 if int4 else 16)
    target = elems // vec if large else tuning.chunks_per_lane
    target = max(1, min(target, _CPLS[-1]))
    lanes = min(32, _next_pow2(-(-chunks // max(1, target))))
    if int4 and vec == 1:
        lanes = max(2, lanes)  # a code's odd neighbour comes from lane + 1
    cpl = _next_pow2(-(-chunks // lanes))
    if cpl > _CPLS[-1] or cpl * vec > MAX_ELEMS_PER_LANE:
        return (f"head size {max(dk, dv)} in chunks of {vec} element(s) needs {cpl} chunks per "
                f"lane; the cuda kernel holds at most {MAX_ELEMS_PER_LANE} elements and "
                f"{_CPLS[-1]} chunks per lane (torch and triton run it)")
    fixed = (int(slot_mapping.dtype == torch.int64), h, dk, dv, lanes.bit_length() - 1, k_tok, k_head, v_tok, v_head, *kc, *vc, *ks, *vs,
             bs, launch.log2_or_minus_1(bs), nb * bs, sw.bit_length() - 1)
    assert len(fixed) == NUM_FIXED
    return Plan(kernel_name(_KIND[key.dtype], _MODE[mode], vec, cpl), vec, cpl, sw, lanes, fixed)


_NO_SLOTS = torch.empty(0, dtype=torch.int64)


def unsupported(key, value, key_cache, value_cache, mode) -> str | None:
    """Rows longer than a warp's registers hold (see the module doc); every other validated case
    runs."""
    if max(key.shape[2], value.shape[2]) <= 32 * _CPLS[-1]:
        return None  # fits even in chunks of one element
    # The plan's chunk width does not depend on the scale caches or the call size's lanes.
    p = plan(key, value, key_cache, value_cache, key_cache, value_cache, _NO_SLOTS, mode)
    return p if isinstance(p, str) else None


LAUNCHES = launch.LaunchCache()


def _launchable(args, mode, tuning) -> launch.Launchable:
    launch.require_setup()
    p = plan(*args, mode, tuning)
    if isinstance(p, str):
        raise ValueError(f"implementation='cuda' cannot run this call: {p}")
    index = args[0].get_device()
    after = (GENERAL_ONLY_MACRO,) if tuning.general_path_only else ()
    kernel, pdl_kernel = launch.load(SOURCE, p.name, p.fixed, index, tuning.specialize,
                                     after=after)
    return launch.Launchable(kernel, pdl_kernel, index, p.fixed, p)


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode: PerTokenHeadMode, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    ptrs = (key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            k_scale_cache.data_ptr(), v_scale_cache.data_ptr())
    # Everything that selects the variant, the lanes or a fixed kernel argument.
    sig = (key.dtype, mode, slot_mapping.dtype, key.shape[1:], value.shape[1:],
           min(key.shape[0], value.shape[0]) > 1, key.stride(), value.stride(),
           key_cache.shape[:3], key_cache.stride(), value_cache.stride(), k_scale_cache.stride(),
           v_scale_cache.stride(), ptrs[0] & 15, ptrs[1] & 15, ptrs[2] & 15, ptrs[3] & 15,
           key.get_device(), is_large_call(num_tokens, key, value, tuning), tuning)
    lau = LAUNCHES.get(sig)
    if lau is None:
        args = (key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping)
        lau = LAUNCHES[sig] = _launchable(args, mode, tuning)
    p = lau.plan
    grid = launch.thread_grid(num_tokens, key.shape[1] * 2 * p.lanes, tuning.threads,
                              "with these heads")
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(grid, 1, tuning.threads, 1, pdl)
    nvrtc.launch(lau.device_index, config, kernel, *ptrs,
                 slot_mapping.data_ptr(), num_tokens, *p.fixed)
