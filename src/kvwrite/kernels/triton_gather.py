"""Triton parts every gather shares (docs/ops/gather.md): the row rule and the fp8 read rule.

- :func:`gather_rows`: for a block of output rows, whether each is written, and its block id and
  offset in the cache. The owner of row ``t`` is found by comparing ``t`` with every request's
  ``[a_r, e_r)``, ``BLOCK_B`` requests at a time (the last owner wins; for non-decreasing starts
  there is at most one), so any starts give the contract's rows, with no search and no fallback.
- :func:`fp8_decode` and :func:`fp8_dequant`: ``D(c, s)``, the code decoded exactly by integer
  arithmetic on its bits (subnormal codes as an integer times 2^-9 or 2^-16, so no subnormal
  float32 is formed), one float32 product with the scale; the caller rounds to the output dtype
  (``.to``, round to nearest even, overflow to ±inf).
- :func:`byte_storage`: the storage behind a tensor as a flat tensor of 1-, 2-, 4- or 8-byte
  integers (copies move bits of any element type through it).
- :func:`row_prologue` and :func:`launch_rows`: a gather kernel's first statements (its rows and
  their rule) and its launch (grid, rows per program, the rule's constants, PDL, warps).
- :func:`availability`: a gather op's ``available``.

``triton`` is optional at import time, as in :mod:`kvwrite.kernels.triton_fp8`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from . import triton_support
from .triton_fp8 import IMPORT_ERROR, pdl_entry, tl, triton
from .triton_support import PdlTuning, pdl_launch, storage_view

__all__ = ["triton", "tl", "IMPORT_ERROR", "gather_rows", "fp8_decode", "fp8_dequant",
           "index_strides", "row_constants", "byte_storage", "E4M3", "E5M2",
           "TritonTuning", "TUNING", "rows_per_program", "interpreter_reason", "chunk_width",
           "native_fp8", "row_prologue", "launch_rows", "availability"]

# FMT codes of fp8_decode (as triton_fp8's E4M3 and E5M2).
E4M3, E5M2 = 1, 2

if triton is not None:

    @triton.jit
    def gather_rows(t, t_out, num_req, starts_ptr, ss_ptr, bt_ptr, ROW: tl.constexpr):
        """(valid, block, offset) of output rows ``t`` (int64 vectors; block and offset are
        meaningful where valid). ``starts_ptr``: cu_seq_lens (B + 1 entries) or, with WS,
        workspace_starts (B entries, the last request ending at ``t_out``); ``ss_ptr``:
        seq_starts when HAS_SS; ``bt_ptr``: the block table. ``ROW``: the rule's constants
        (:func:`row_constants`), strides in elements."""
        ST_STRIDE: tl.constexpr = ROW[0]
        SS_STRIDE: tl.constexpr = ROW[1]
        BT_S0: tl.constexpr = ROW[2]
        BT_S1: tl.constexpr = ROW[3]
        MAX_BLOCKS: tl.constexpr = ROW[4]
        BLOCK_SIZE: tl.constexpr = ROW[5]
        NUM_BLOCKS: tl.constexpr = ROW[6]
        HAS_SS: tl.constexpr = ROW[7]
        WS: tl.constexpr = ROW[8]
        BLOCK_B: tl.constexpr = ROW[9]
        t = t.to(tl.int64)
        owner = tl.full(t.shape, -1, tl.int64)
        a_own = tl.zeros(t.shape, tl.int64)
        s_own = tl.zeros(t.shape, tl.int64)
        for b0 in range(0, num_req, BLOCK_B):
            r = (b0 + tl.arange(0, BLOCK_B)).to(tl.int64)
            in_r = r < num_req
            a = tl.load(starts_ptr + r * ST_STRIDE, mask=in_r, other=0).to(tl.int64)
            if WS:
                e = tl.load(starts_ptr + (r + 1) * ST_STRIDE, mask=r + 1 < num_req,
                            other=t_out).to(tl.int64)
            else:
                e = tl.load(starts_ptr + (r + 1) * ST_STRIDE, mask=in_r, other=0).to(tl.int64)
            own = (a[None, :] <= t[:, None]) & (t[:, None] < e[None, :]) & in_r[None, :]
            best = tl.max(tl.where(own, r[None, :], -1), axis=1)
            pick = own & (r[None, :] == best[:, None])
            found = best >= 0
            owner = tl.where(found, best, owner)
            a_own = tl.where(found, tl.sum(tl.where(pick, a[None, :], 0), axis=1), a_own)
            if HAS_SS:
                s = tl.load(ss_ptr + r * SS_STRIDE, mask=in_r, other=0).to(tl.int64)
                s_own = tl.where(found, tl.sum(tl.where(pick, s[None, :], 0), axis=1), s_own)
        p = s_own + (t - a_own)
        ok = (owner >= 0) & (t < t_out) & (p >= 0)
        bi = tl.where(ok, p, 0) // BLOCK_SIZE
        ok = ok & (bi < MAX_BLOCKS)
        blk = tl.load(bt_ptr + owner * BT_S0 + bi * BT_S1, mask=ok, other=-1).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < NUM_BLOCKS)
        return ok, blk, p - bi * BLOCK_SIZE

    @triton.jit
    def row_prologue(t_out, num_req, starts_ptr, ss_ptr, bt_ptr, BLOCK_T: tl.constexpr,
                     ROW: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr):
        """A gather kernel's first statements (grid: one program per ``BLOCK_T`` output rows):
        ``pdl_entry``, then (t, valid, block, offset): the program's rows (int64) and
        :func:`gather_rows` of them."""
        pdl_entry(PDL, PDL_TRIGGER)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok, blk, off = gather_rows(t, t_out, num_req, starts_ptr, ss_ptr, bt_ptr, ROW)
        return t, ok, blk, off

    @triton.jit
    def fp8_decode(c, FMT: tl.constexpr):
        """The float32 value of fp8 codes ``c`` (uint8 or integers 0-255), exactly: E4M3
        (e4m3fn) or E5M2."""
        c = c.to(tl.int32) & 255
        sign = (c & 128) << 24
        em = c & 127
        if FMT == 1:
            sub = (em.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9
            bits = tl.where(em >= 8, (em << 20) + (120 << 23), sub)
            bits = tl.where(em == 127, 0x7FC00000, bits)
        else:
            sub = (em.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # m * 2^-16
            bits = tl.where(em >= 4, (em << 21) + (112 << 23), sub)
            bits = tl.where(em == 124, 0x7F800000, bits)
            bits = tl.where(em > 124, 0x7FC00000, bits)
        return (bits | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def fp8_dequant(c, s, FMT: tl.constexpr, NATIVE: tl.constexpr):
        """``D(c, s)`` in float32 (round it to the output dtype with ``.to``). NATIVE (compiled
        for sm_89 and later, not the interpreter: :func:`native_fp8`): the codes decoded by
        Triton's float8 conversion (cvt.rn.f16x2.e4m3x2 and float16 -> float32; e5m2 codes are
        float16's high byte), exact as fp8_decode and a few instructions per element instead of
        a dozen. The interpreter's conversion is not exact (it reads e4m3's NaN codes as 480,
        e5m2's infinities and NaNs as numbers), so it keeps fp8_decode."""
        if NATIVE:
            if FMT == 1:
                d = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                d = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            d = fp8_decode(c, FMT)
        return d * s


def index_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Element strides of an index tensor, 0 along dims of one element (one compiled variant
    whatever they are)."""
    return tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride(), strict=True))


def row_constants(starts: torch.Tensor, seq_starts: torch.Tensor | None, block_table: torch.Tensor,
                  block_size: int, num_blocks: int, num_req: int, workspace: bool = False) -> dict:
    """:func:`gather_rows`'s constexpr argument ``ROW`` for these index tensors (a gather
    kernel's ``ROW=``): (ST_STRIDE, SS_STRIDE, BT_S0, BT_S1, MAX_BLOCKS, BLOCK_SIZE, NUM_BLOCKS,
    HAS_SS, WS, BLOCK_B), in gather_rows' order."""
    bt = index_strides(block_table)
    return dict(ROW=(index_strides(starts)[0],
                     0 if seq_starts is None else index_strides(seq_starts)[0],
                     bt[0], bt[1], block_table.shape[1], block_size, num_blocks,
                     seq_starts is not None, workspace, _block_b(num_req)))


@functools.lru_cache(maxsize=64)
def _block_b(num_req: int) -> int:
    """Requests compared per step: the batch rounded up to a power of two, 2 to 64."""
    n = 2
    while n < min(num_req, 64):
        n *= 2
    return n


_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def byte_storage(t: torch.Tensor, unit: int = 1) -> tuple[torch.Tensor, int]:
    """(the whole storage behind ``t`` as a flat tensor of ``unit``-byte integers, ``t``'s first
    byte in it, in units): a view, no copy and no allocation on the device. ``unit`` must divide
    ``t``'s first byte (the storage's trailing bytes past a whole unit are not in the view)."""
    first = t.storage_offset() * t.element_size()
    assert first % unit == 0, (first, unit)
    return storage_view(t, _UNIT_DTYPES[unit]), first // unit


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch shapes of every gather's Triton kernel. ``TUNING`` is what every call uses unless a
    caller passes another one."""

    # Rows per program: small calls (at most large_rows rows) spread over more programs, large
    # ones amortize each program's pass over the starts.
    block_t_small: int = 16
    block_t_large: int = 32
    large_rows: int = 4096
    num_warps: int = 4


TUNING = TritonTuning()


def rows_per_program(t_out: int, tuning: TritonTuning = TUNING) -> int:
    """BLOCK_T of a call writing ``t_out`` rows."""
    return tuning.block_t_large if t_out > tuning.large_rows else tuning.block_t_small


def chunk_width(n: int, cap: int = 128) -> int:
    """Columns per step over a row of ``n`` elements: the largest power of two up to ``cap``
    dividing ``n`` when that is at least 32 (no masked lanes), else ``n`` rounded up to a power of
    two, at most ``cap``."""
    w = cap
    while w >= 32:
        if n % w == 0:
            return w
        w //= 2
    p = 1
    while p < min(n, cap):
        p *= 2
    return p


def launch_rows(kernel, device: torch.device, t_out: int, args: tuple, starts: torch.Tensor,
                seq_starts: torch.Tensor | None, block_table: torch.Tensor, block_size: int,
                num_blocks: int, num_req: int, tuning: TritonTuning, workspace: bool = False,
                **constants) -> None:
    """Launch a gather ``kernel`` writing ``t_out`` rows on PyTorch's current stream: grid
    ``(cdiv(t_out, BLOCK_T),)``, the positional ``args``, the kernel's own ``constants``, then
    ``BLOCK_T`` (:func:`rows_per_program`), :func:`gather_rows`'s constants
    (:func:`row_constants` of the index tensors), PDL and ``tuning.num_warps``."""
    block_t = rows_per_program(t_out, tuning)
    grid = (triton.cdiv(t_out, block_t),)
    pdl, trigger = pdl_launch(device, grid[0], tuning.pdl_max_programs,
                              tuning.pdl_trigger_max_programs)
    kernel[grid](*args, **constants, BLOCK_T=block_t,
                 **row_constants(starts, seq_starts, block_table, block_size, num_blocks, num_req,
                                 workspace),
                 PDL=pdl, PDL_TRIGGER=trigger, num_warps=tuning.num_warps, launch_pdl=pdl)


def native_fp8(device: torch.device) -> bool:
    """fp8_dequant's NATIVE for a call on ``device``: triton_support.native_fp8 (a GPU of sm_89
    or later: Triton has no e4m3 type below it, and its interpreter decodes float8 inexactly)."""
    return triton_support.native_fp8(device)


def interpreter_reason(device: torch.device, out_dtype: torch.dtype | None) -> str | None:
    """Why a dequantizing call into ``out_dtype`` cannot be exact under Triton's interpreter (its
    float32 -> bfloat16 cast does not round to nearest even), or None."""
    if device.type == "cuda" or out_dtype != torch.bfloat16:
        return None
    return ("Triton's interpreter (TRITON_INTERPRET=1) does not round float32 -> bfloat16 casts to "
            "nearest even, so an fp8 read into bfloat16 is not exact there; run on a CUDA device")


def availability(kernel: Callable[[], object]) -> Callable[[torch.device], str | None]:
    """A gather op's ``available(device)``: :func:`kvwrite.kernels.triton_support.available` of
    ``kernel()`` (its ``triton.jit`` function, looked up at each call)."""

    def available(device: torch.device) -> str | None:
        return triton_support.available(device, triton, kernel, IMPORT_ERROR)

    return available
