"""What every op's Triton implementation shares besides the fp8 rule: whether Triton can run a
kernel on a device here, which casts its interpreter rounds differently from the GPU, the
power-of-two rounding of tile sizes, and whether a launch takes programmatic dependent launch (and
the tuning field that bounds it)."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch

from ..dtypes import FLOAT8_FORMAT
from . import nvrtc

__all__ = ["available", "interpreter_inexact", "inexact_cast_reason", "native_fp8", "next_pow2",
           "pdl_launch", "PdlTuning", "storage_view"]


def available(device: torch.device, triton, kernel: Callable[[], object],
              import_error: Exception | None = None) -> str | None:
    """None where Triton can run ``kernel()`` (a ``triton.jit`` function, looked up only when
    triton imported) on ``device``, else why not: triton missing; a CPU without
    ``TRITON_INTERPRET=1``; or the variable set only after the kernel was defined."""
    if triton is None:
        return f"triton is not installed (pip install triton): {import_error}"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton runs on CPU only under its interpreter (set TRITON_INTERPRET=1)"
        if type(kernel()).__name__ != "InterpretedFunction":
            return ("TRITON_INTERPRET=1 was set after kvwrite's triton implementation was "
                    "imported; set it before importing triton")
        return None
    return f"triton runs on CUDA devices (or CPU under TRITON_INTERPRET=1), got device {device}"


# Casts that Triton's interpreter (TRITON_INTERPRET=1, checked with Triton 3.9) rounds differently
# from the GPU, as (input dtype, cache element dtype). Established by running
# reshape_and_cache_flash's kernel under the interpreter against the torch reference on all 65536
# patterns of each 16-bit input dtype and on 2^20 random float32 bit patterns plus rounding ties
# and overflow edges (tests/test_triton.py keeps checking the exact ones): its float32->bfloat16
# cast truncates instead of rounding to nearest even (float16->bfloat16 goes through it), and its
# bfloat16->float32 cast mangles bfloat16 subnormals (their sign kept). Exact there (NaN payloads
# aside): copies, float16->float32, bfloat16->float16 and float32->float16. Its float32->fp8 cast
# rounds ties away from zero and mishandles mantissa carries, subnormals and NaN, but no kernel
# takes it there: fp8 codes come from the input widened to float32 by integer steps where
# native_fp8 is false (kvwrite.kernels.triton_fp8.fp8_code), so an fp8 element is as exact as a
# float32 one.
def interpreter_inexact(input_dtype: torch.dtype, element_dtype: torch.dtype) -> bool:
    if element_dtype in FLOAT8_FORMAT:
        element_dtype = torch.float32
    if element_dtype == torch.bfloat16:
        return input_dtype != torch.bfloat16
    return input_dtype == torch.bfloat16 and element_dtype == torch.float32


def inexact_cast_reason(input_dtype: torch.dtype, element_dtype: torch.dtype,
                        short_names: bool = True) -> str | None:
    """Why the interpreter cannot write ``input_dtype`` -> ``element_dtype`` casts exactly
    (:func:`interpreter_inexact`), or None; the dtypes named without ``torch.`` unless
    ``short_names`` is false (the fused ops' messages)."""
    if not interpreter_inexact(input_dtype, element_dtype):
        return None
    src, dst = str(input_dtype), str(element_dtype)
    if short_names:
        src, dst = src.removeprefix("torch."), dst.removeprefix("torch.")
    return (f"Triton's interpreter (TRITON_INTERPRET=1) rounds {src}->{dst} casts differently "
            "from the GPU; run on a CUDA device")


def native_fp8(device: torch.device) -> bool:
    """Whether a Triton kernel on ``device`` is compiled for a GPU with float32 -> float8
    conversion instructions (sm_89 and later: cvt.rn.satfinite.e4m3x2.f32): true on such CUDA
    devices; false on older ones (Triton has no e4m3 type there: a float8 cast does not compile)
    and on the CPU, where Triton's interpreter rounds those casts differently. Every kernel with
    a float8 conversion takes this as its ``NATIVE`` constexpr: the conversion where it holds
    (fewer instructions), integer steps that give the same bytes elsewhere
    (kvwrite.kernels.triton_fp8.fp8_code, kvwrite.kernels.triton_gather.fp8_dequant)."""
    if device.type != "cuda":
        return False
    return _native_fp8_device(device.index if device.index is not None
                              else torch.cuda.current_device())


@functools.cache
def _native_fp8_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def programs_to_fill(device: torch.device, programs_per_sm: int) -> int:
    """Programs of a persistent launch that fill ``device``: its SMs x ``programs_per_sm`` (off
    the GPU, under the interpreter, one SM)."""
    if device.type != "cuda":
        return programs_per_sm
    return _sm_count(device.index if device.index is not None
                     else torch.cuda.current_device()) * programs_per_sm


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pdl_launch(device: torch.device, programs: int, max_programs: int,
               trigger_max_programs: int) -> tuple[bool, bool]:
    """(PDL, TRIGGER) of a Triton launch of ``programs`` programs: programmatic dependent launch
    (``PDL=True, launch_pdl=True``) where it is on (kvwrite.kernels.nvrtc.use_pdl,
    ``KVWRITE_PDL``), for at most ``max_programs`` programs, on a CUDA device of compute
    capability 9.0 or later with a Triton that has grid dependency control; and with it the early
    trigger of the next kernel (``pdl_entry``'s TRIGGER) for at most ``trigger_max_programs``."""
    if device.type != "cuda" or programs > max_programs:
        return False, False
    pdl = nvrtc.pdl_on() and _pdl_device(device.index if device.index is not None
                                          else torch.cuda.current_device())
    return pdl, pdl and programs <= trigger_max_programs


@functools.cache
def _pdl_device(index: int) -> bool:
    try:
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return False
    return (torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents"))


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class PdlTuning:
    """The programmatic-dependent-launch fields of every Triton tuning class (a base of each):
    launches of at most ``pdl_max_programs`` programs take programmatic dependent launch where it
    is on and the device allows it (:func:`pdl_launch`); those of at most
    ``pdl_trigger_max_programs`` also let the next kernel be scheduled early (``pdl_entry``'s
    TRIGGER). A tuning whose own measurements say otherwise redeclares a default, with its
    figures (reshape_and_cache_flash's and the RoPE kernels' do)."""

    # Every launch (reshape_and_cache_flash: faster at small T, equal at T=65536).
    pdl_max_programs: int = 1 << 30
    # concat_and_cache_mla's measurement, taken by the kernels not measured on their own (the
    # indexer's, NVFP4's, per-token-head's, the gathers'). H200, bfloat16, rotated L2
    # (docs/tuning-log.md change 44), off / with the trigger / without it, us: auto T=16 1.47 /
    # 1.16 / 1.33, T=2048 (1024 programs) 2.95 / 2.60 / 2.76, T=65536 40.6 / 41.1 / 40.0;
    # fp8_ds_mla T=256 2.03 / 1.62 / 1.89, T=2048 (2048 programs) 3.08 / 3.49 / 3.11, T=8192 6.60
    # / 6.78 / 5.99, T=65536 36.0 / 40.0 / 35.4.
    pdl_trigger_max_programs: int = 1024


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class GroupTuning(PdlTuning):
    """Launch shapes of a Triton write that quantizes each row in groups (NVFP4's 16 elements,
    the MX formats' 32), for :func:`group_tiling`; each op's ``TritonTuning`` derives from it and
    sets its defaults beside its reasons."""

    # Input bytes of K per program (as many of V).
    tile_bytes: int = 4096
    # Input bytes of K per warp.
    bytes_per_warp: int = 1024
    max_warps: int = 8


@functools.lru_cache(maxsize=512)
def group_tiling(num_tokens: int, groups: int, group_bytes: int, tuning: GroupTuning
                 ) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_Q, num_warps) of a group-quantizing write: BLOCK_Q of a token's ``groups``
    groups of ``group_bytes`` input bytes (its whole row when it fits ``tuning.tile_bytes``),
    BLOCK_T tokens (at most T rounded up to a power of two), a warp per
    ``tuning.bytes_per_warp`` of the tile, a power of two up to ``tuning.max_warps``."""
    per_tile = max(1, tuning.tile_bytes // group_bytes)
    block_q = min(next_pow2(groups), next_pow2(per_tile))
    block_t = 1
    while block_t * 2 * block_q <= per_tile and block_t < next_pow2(num_tokens):
        block_t *= 2
    warps = min(tuning.max_warps, max(1, block_t * block_q * group_bytes // tuning.bytes_per_warp))
    return block_t, block_q, 1 << (warps.bit_length() - 1)


def storage_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage behind ``t`` as a flat tensor of ``dtype`` (its trailing bytes past a
    whole element left out): a view, nothing allocated or copied, on ``t``'s device (pinned
    host memory stays pinned host memory). Triton kernels address a tensor's storage through it
    with byte or element offsets of their own."""
    s = t.untyped_storage()
    n = s.nbytes() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=t.device).set_(s, 0, (n,))
