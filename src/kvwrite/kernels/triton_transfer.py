"""The Triton implementation of every transfer op (SPEC §9, kvwrite.transfer): ``run(plan)``
executes a :class:`kvwrite.transfer.TransferPlan` on PyTorch's current stream.

Raw copies (``plan.jobs``): one launch of :func:`_copy_kernel` per group of at most
:data:`SLOTS` jobs of one compiled shape (:func:`copy_launches`: a multi-layer call of one layout
is one launch). Triton takes a fixed argument list and a device table of pointers would need a
host-to-device copy per call (no CUDA-graph capture without a warm-up call), so a launch passes
its first job's storages as the pointers and every job's first vector of a side as an offset
past them, in tuple arguments (one flat address space: device memory, a peer's and pinned host
memory under unified addressing); the kernel walks the launch's jobs in turn, choosing each
job's offsets from the tuples once. A side is addressed through its whole storage viewed as
integers of the vector width ``W`` (the largest of 16/8/4/2/1 bytes dividing both storages'
base, both sides' first byte, every byte stride in use and the run length), with its first byte
and strides in vectors; a vector of 8 or 16 bytes is 2 or 4 int32 lanes (``VEC``), offsets
multiplied by ``VEC`` so the compiler sees their alignment. A job's work is ``pairs x rows``
rows of ``RUN`` contiguous lanes (a row of ``row_bytes`` where the elements are dense on both
sides, else one element), cut into tiles of ``BLOCK_R`` rows x
``BLOCK_C`` lanes: small rows are stacked, long rows (swap_blocks' four-argument form: one row of
a block's bytes) are split into chunks that different programs copy. A persistent grid (at most
``plan.max_ctas`` programs, else enough to fill the GPU) walks the tiles with a grid-stride loop.

Quantized pages (``plan.page_job``): one launch of :func:`_pack_kernel` or :func:`_unpack_kernel`
per run of consecutive layers with equal strides (:func:`page_launches`,
:meth:`PageJob.layer_runs`; each layer is its own tensor, addressed as a copy launch's jobs are:
the run's first storage the pointer, each layer's first element an offset slot); the kernel walks
the run's layers in turn, writing each layer's share of every head chunk (its ``sigma(l, s)``
floats, its rows' codes and, NVFP4, scale bytes), and layer 0's pack also the chunk's zero tail, so
the launches together write whole chunks. fp8 codes are ``Q(x)`` by kernels.triton_fp8's exact
quotient, encoded by its ``fp8_code`` (the float8 cast on GPUs that have it, sm_89 and later:
triton_support.native_fp8; unpack decodes by it there too; elsewhere integer operations on its
bits: Triton has no e4m3 type below sm_89, and its interpreter rounds float8 casts otherwise than
the GPU), NaN as 0x7F with its sign; NVFP4 is kernels.triton_nvfp4's group rule with ``k = sigma``
(group_rule_halves, each thread holding whole groups loaded as two halves and storing their codes
as two words, where a tile's rows are wide enough: ``nvfp4_halves_groups``; else group_rule, a
group across two threads); unpack decodes exactly and rounds to the cache dtype (bfloat16 by
integer operations on the float32 bits). So Triton's interpreter writes the GPU's bytes, and the
CPU tests compare everything. Where :meth:`PageJob.code_align` allows, the kernels declare their
row addresses aligned, so the compiler moves the cache as 16-byte vectors; under an SM budget a
program's tile is larger and has more warps (``budget_page_*``: its loads in flight).

The mapping is read by the kernels (int32 or int64, any strides); a pair whose source or
destination id is outside its side's ``[0, blocks)`` is skipped (for pages, ``blocks`` of the
cache side is the smallest over the layers, so a pair writes all of a chunk or nothing). Nothing
is read on the host, nothing allocated on the device and nothing copied per call: ``run`` is
CUDA-graph capturable on its first call. A pinned host side is passed like a device tensor: its
pointer is valid on the device (unified addressing; Triton's launcher asks the driver for its
device pointer), so the kernel reads or writes it directly (zero-copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch

from ..transfer import consecutive_runs
from . import copy_engine, nvrtc, triton_support
from .launch import BoundedMemo, align
from .triton_fp8 import IMPORT_ERROR, fp8_code, fp8_quotient, fp8_scale, pdl_entry, tl, triton
from .triton_gather import fp8_decode, fp8_dequant
from .triton_nvfp4 import e2m1_value, group_rule, group_rule_halves, store_code_words, widen
from .triton_support import PdlTuning, next_pow2, pdl_launch, storage_view

if TYPE_CHECKING:
    from ..transfer import CopyJob, PageJob, Side, TransferPlan

__all__ = ["TritonTuning", "TUNING", "SLOTS", "CopyLaunch", "copy_launches", "available",
           "unsupported", "run"]

# Jobs of one copy launch, at most: its offsets are tuples of SLOTS values (one compiled variant a
# power of two up to it); a 64-layer call of one layout (Qwen3-32B's K and V) in two launches.
SLOTS = 32
# A launch passes an offset x as 16 * x + _OFFSET_BIAS (the kernel takes it back): Triton
# specializes an int argument on its value (int32 where it fits, else int64; divisible by 16 or
# not), also inside a tuple (which do_not_specialize cannot name), so raw offsets would compile a
# variant per pattern; encoded, every one is an int64 divisible by 16: one variant (|x| < 2^37
# vectors: 2 TiB).
_OFFSET_BIAS = 1 << 44
_OFFSET_MOST = 1 << 37


# FMT codes of the page kernels.
_FMT = {"fp8_e4m3": 1, "fp8_e5m2": 2, "nvfp4": 3}
# Cache element codes of the page kernels: float32, float16, bfloat16 (moved as int16 bits).
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class TritonTuning(PdlTuning):
    """Launch shapes. ``TUNING`` is what every call uses unless a caller passes another one. Not
    measured yet: a copy tile of 32 KiB over 16 warps keeps 64 B (four 16-B vectors) of loads in
    flight per thread before its stores, >100 KB over 4 programs (SPEC §9.5's d2h/h2d budget at
    PCIe latency)."""

    copy_tile_bytes: int = 32768
    # The tile of a job that reads pinned host memory (h2d): its loads wait a PCIe round trip, so
    # a program's bytes in flight bound it (as the CUDA kernel's loads_in_flight_host): 64 KiB.
    # Measured (H200, a launch a job, 32 Llama-3-8B layers, h2d, tuning-log 101), GB/s at 1 / 2
    # programs, 16 / 128 blocks: 32 KiB 19 / 20, 35 / 36; 64 KiB 33 / 35, 45 / 51; 128 KiB 40 /
    # 47, 46 / 51 but raw pages unpacked from the host 23 / 23 (64 KiB: 28 / 32); 256 KiB 35 / 42.
    host_read_tile_bytes: int = 65536
    copy_warps: int = 16
    # Page kernels: elements of a tile (rows x elements of one part; at most a head's rows of a
    # layer: Llama-3-8B's 2 x 16 rows of 128 make 4096). Measured (H200, aligned pages, every
    # program, 128 blocks, GB/s of page bytes, Llama-3-8B / DeepSeek-V3; tuning-log 102): 2048
    # elements over 4 warps fp8 pack 690 / 569, unpack 736 / 746, nvfp4 pack 303 / 266, unpack
    # 262 / 301; 4096 over 4 847 / 651, 941 / 909, 339 / 330, 342 / 351 (8192 and 16384 the
    # same); 4096 over 2 777 / 536; over 8 751 / 626.
    page_tile_elems: int = 4096
    page_warps: int = 4
    # The page kernels' tile and warps under an SM budget (max_ctas): a program's loads in flight
    # bound it. Measured (H200, 32 Llama-3-8B layers d2d, 4 programs, 16 / 128 blocks, GB/s of
    # page bytes; tuning-log 102): 2048 elements over 4 warps fp8 pack 10.7 / 10.1, unpack 12.1
    # / 11.1, nvfp4 pack 4.5 / 4.2, unpack 3.0 / 2.8; 8192 over 8 19.4 / 18.5, 18.3 / 16.0, 6.8 /
    # 6.4, 3.7 / 3.5; 8192 over 16 20.1 / 19.6, 28.2 / 27.1, 6.8 / 6.6, 3.3 / 3.2 (16384 the
    # same).
    budget_page_tile_elems: int = 8192
    budget_page_warps: int = 16
    # NVFP4 pack: groups loaded as two halves a thread (group_rule_halves) where a tile's row
    # holds at least this many groups, else whole across two threads (group_rule). Measured
    # (H200, every program / 4, 16 and 128 blocks, tuning-log 104): halves against whole,
    # Llama-3-8B (8 groups a row) 0.73 / 0.74 of the time, 0.93 / 0.95 at 4 programs;
    # DeepSeek-V3 (4 a row: 576 elements) 0.89 / 1.14, 1.06 / 1.08.
    nvfp4_halves_groups: int = 8
    # Warps of a program that writes pinned host memory (d2h): a launch's host_write_launch_warps
    # spread over its programs, from host_write_least_warps to host_write_warps a program. A
    # program of a copy launch stays on its SM for the whole call, and fewer warps leave room on
    # it for a concurrent kernel's CTAs (the CUDA kernel's host_cta_threads), but one program
    # needs its warps' loads in flight. Measured (H200, 32 Llama-3-8B layers d2h, beside bf16
    # causal SDPA [1, 32, 8192, 128], 16 / 128 blocks, tuning-log 101 and 103): 4 programs, the
    # attention's time against alone, 16 warps 1.06 / 1.12, 8 1.03 / 1.09, 4 1.01 / 1.06 (three
    # alternating runs at 128 blocks: 1.053-1.058), 2 1.032-1.044 at 128 blocks; alone 52.3-52.6
    # GB/s at every count; 1 program alone 38.9 / 35.7 GB/s with 4 warps, 31.9 / 29.5 with 2; 2
    # programs 52.3 / 52.4 with 4 warps, the attention 1.001 / 1.008.
    host_write_warps: int = 4
    host_write_launch_warps: int = 8
    host_write_least_warps: int = 2
    # Jobs per copy launch, at most SLOTS: every slot. Measured (H200, 32 Llama-3-8B layers' K
    # and V: 64 jobs, 16 / 128 blocks, tuning-log 101), GB/s at 1 / 4 / every program(s) a
    # launch, 1 / 4 / 32 jobs a launch: d2d 16 blocks 42 / 44 / 46, 124 / 153 / 169, 459 / 972 /
    # 1289; 128 blocks, every program 1278 / 1749 / 1805; h2d 16 blocks 34 / 38 / 39, 45 / 49 /
    # 51 (the link: 55).
    jobs_per_launch: int = SLOTS
    # Programs per SM without max_ctas, where one_tile_programs does not apply.
    programs_per_sm: int = 4
    # Without max_ctas, launches within the memory of the GPU they run on (no pinned host or
    # peer side) take a program a tile, of one_tile_copy_bytes for copies, instead of
    # programs_per_sm (page_programs_per_sm) persistent programs an SM: the GPU deals the
    # tiles, and no program's loads wait behind its previous tile's. Measured (H200, Triton 3.6,
    # every program, against the persistent programs, 16 / 128 blocks; tuning-log 125): copies
    # (swap, relayout, raw pages) with 8 KiB tiles Llama-3-8B 1.26-1.95 / 1.07-1.14 (relayout
    # 1749 -> 1953 GB/s), DeepSeek-V3 bf16 1.30-1.32 / 1.09-1.10, fp8 1.83-1.85 / 1.10-1.11
    # (32 KiB tiles: 0.59-0.98 at 128); unpacks fp8 1.25-1.26 / 1.10-1.22, NVFP4 1.20-1.21 /
    # 1.08-1.10; Llama-3-8B packs fp8 1.23 / 1.06, NVFP4 1.20 / 1.09; but DeepSeek-V3's packs
    # (part rows in 9 steps) fp8 0.97 / 0.88, NVFP4 1.07 / 0.92: such packs keep the persistent
    # programs.
    one_tile_programs: bool = True
    one_tile_copy_bytes: int = 8192
    # The page kernels' programs per SM without max_ctas (4 warps each: a quarter of the SM's
    # warps, whose loads wait). Measured (H200, 32 Llama-3-8B / 61 DeepSeek-V3 layers, 16 / 128
    # blocks, GB/s of page bytes, tuning-log 104): 4: fp8 pack 589 / 849 and 530 / 660, fp8
    # unpack 669 / 948 and 717 / 918, nvfp4 unpack 259 / 345 and 279 / 352; 8: 547 / 857, 480 /
    # 690, 638 / 1083, 687 / 1017; 16: 448 / 855, 399 / 708, 501 / 1059, 544 / 896, nvfp4 unpack
    # 210 / 370, 225 / 371; 32 slower again at 16 blocks. More programs gain up to 14% at 128
    # blocks and lose as much at 16: 4 kept.
    page_programs_per_sm: int = 4


TUNING = TritonTuning()


def _base(side: Side) -> int:
    """Bytes from the start of ``side``'s storage to its element [0, 0, 0, 0]."""
    return side.ptr - side.tensor.untyped_storage().data_ptr()


if triton is not None:

    @triton.jit
    def _pair(map_ptr, m, map_s0, map_s1, src_blocks, dst_blocks, ok):
        """(i, j, valid) of mapping rows ``m`` (masked by ``ok``): both ids in range."""
        mo = m.to(tl.int64) * map_s0
        i = tl.load(map_ptr + mo, mask=ok, other=-1).to(tl.int64)
        j = tl.load(map_ptr + mo + map_s1, mask=ok, other=-1).to(tl.int64)
        return i, j, ok & (i >= 0) & (i < src_blocks) & (j >= 0) & (j < dst_blocks)

    @triton.jit
    def _first_tile(n, tiles):
        """This program's first tile of a launch's job or layer ``n`` (``tiles`` tiles each): the
        launch's tiles job after job are dealt to its programs in turn (tile x of the launch to
        program x mod programs), so a program takes the tiles from the returned one in steps of
        the program count."""
        programs = tl.num_programs(0)
        return (tl.program_id(0) + programs - (n * tiles) % programs) % programs

    @triton.jit
    def _runs_of_program(n, tiles, ONE_TILE: tl.constexpr):
        """The range [lo, hi) of a launch's ``n`` jobs or layers in which this program has tiles
        (:func:`_first_tile`): with ``ONE_TILE`` (a program a tile: ``tiles`` tiles a job or
        layer and ``n * tiles`` programs, :func:`_one_tile`) only job ``program_id // tiles``,
        the others' offsets not decoded; else every one."""
        if ONE_TILE:
            lo = tl.program_id(0) // tiles
            hi = lo + 1
        else:
            lo = 0
            hi = n
        return lo, hi

    @triton.jit
    def _slot(offs, n, SLOTS: tl.constexpr, OFFSET_BIAS: tl.constexpr):
        """Offset ``n`` of the tuple ``offs`` of a launch's :data:`SLOTS` slots (n a scalar
        below the launch's jobs or layers), decoded (see :func:`_encoded`)."""
        x = offs[0]
        for k in tl.static_range(1, SLOTS):
            x = tl.where(n == k, offs[k], x)
        return (x - OFFSET_BIAS) // 16

    @triton.jit(do_not_specialize=["pairs", "jobs", "job_tiles", "src_blocks", "dst_blocks",
                                   "map_s0", "map_s1"])
    def _copy_kernel(
        src_ptr, dst_ptr,  # the first job's storages as uint8 / int16 / int32 lanes
        map_ptr, pairs, jobs, job_tiles, map_s0, map_s1, src_blocks, dst_blocks,
        src_offs, dst_offs,  # each job's first byte of a side past its pointer (_offsets)
        SLOTS: tl.constexpr, OFFSET_BIAS: tl.constexpr,  # the offsets' length, their encoding
        S_SB: tl.constexpr, S_SH: tl.constexpr, S_ST: tl.constexpr, S_SC: tl.constexpr,  # vectors
        D_SB: tl.constexpr, D_SH: tl.constexpr, D_ST: tl.constexpr, D_SC: tl.constexpr,
        HEADS: tl.constexpr, TOKENS: tl.constexpr, ELEMS: tl.constexpr,  # rows of a pair
        RUN: tl.constexpr,  # lanes of a row (contiguous on both sides)
        VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        ONE_TILE: tl.constexpr,  # a program a tile (_one_tile)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        ROWS: tl.constexpr = HEADS * TOKENS * ELEMS
        NCH: tl.constexpr = (RUN + BLOCK_C - 1) // BLOCK_C
        total = pairs.to(tl.int64) * ROWS
        programs = tl.num_programs(0)
        # The launch's tiles job after job, dealt to the programs in turn (_first_tile). A job's
        # offsets are chosen once a job, not once a tile:
        # measured (H200, 64 Llama-3-8B jobs of 16 blocks, d2d), the choice among 32 slots made
        # a tile took 1 / 4 programs 15.3 / 61 GB/s against 39 / 119 with a launch a job.
        lo, hi = _runs_of_program(jobs, job_tiles, ONE_TILE)
        for job in range(lo, hi):
            src_off = _slot(src_offs, job, SLOTS, OFFSET_BIAS)
            dst_off = _slot(dst_offs, job, SLOTS, OFFSET_BIAS)
            for tile in range(_first_tile(job, job_tiles), job_tiles, programs):
                rt = tile // NCH
                ch = tile - rt * NCH
                r = rt.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
                r_ok = r < total
                m = r // ROWS
                rem = r - m * ROWS
                c = rem % ELEMS
                rem = rem // ELEMS
                t = rem % TOKENS
                h = rem // TOKENS
                i, j, ok = _pair(map_ptr, m, map_s0, map_s1, src_blocks, dst_blocks, r_ok)
                so = (src_off + i * S_SB + h * S_SH + t * S_ST + c * S_SC) * VEC
                do = (dst_off + j * D_SB + h * D_SH + t * D_ST + c * D_SC) * VEC
                col = ch * BLOCK_C + tl.arange(0, BLOCK_C)
                if RUN % BLOCK_C == 0:  # no column mask: the compiler sees whole vectors
                    mask = tl.broadcast_to(ok[:, None], (BLOCK_R, BLOCK_C))
                else:
                    mask = ok[:, None] & (col < RUN)[None, :]
                x = tl.load(src_ptr + so[:, None] + col[None, :], mask=mask)
                tl.store(dst_ptr + do[:, None] + col[None, :], x, mask=mask)

    @triton.jit
    def _round_out(v, OUT: tl.constexpr):
        """float32 ``v`` rounded to nearest even in the cache's element type (OUT: 0 float32, 1
        float16, 2 bfloat16 as its int16 bits, rounded from the float32 bits: any NaN -> a
        quiet NaN)."""
        if OUT == 0:
            out = v
        elif OUT == 1:
            out = v.to(tl.float16)
        else:
            b = v.to(tl.int32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            out = tl.where(v != v, 0x7FC0, r).to(tl.int16)
        return out

    @triton.jit
    def _row_mask(ok, e, E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
        """[BLOCK_R, BLOCK_E] mask of rows ``ok`` and a part's elements ``e < E``; no element
        mask where BLOCK_E divides E (the compiler sees whole vectors)."""
        if E % BLOCK_E == 0:
            mask = tl.broadcast_to(ok[:, None], (BLOCK_R, BLOCK_E))
        else:
            mask = ok[:, None] & (e < E)[None, :]
        return mask

    @triton.jit
    def _page_tile(tile, layer, cache_off, page_off, map_ptr, map_s0, map_s1, src_blocks,
                   dst_blocks, pairs, PACK: tl.constexpr,
                   C_SB: tl.constexpr, C_SH: tl.constexpr, C_ST: tl.constexpr,
                   C_SC: tl.constexpr, P_SB: tl.constexpr, HB: tl.constexpr, K: tl.constexpr,
                   L: tl.constexpr, S: tl.constexpr, N: tl.constexpr, E: tl.constexpr,
                   FMT: tl.constexpr, NCH: tl.constexpr, BLOCK_R: tl.constexpr,
                   ALIGN: tl.constexpr, VE: tl.constexpr):
        """A page kernel's tile ``tile`` of layer ``layer`` (the pairs' cache ids are the
        mapping's sources where ``PACK``, else its destinations): (k: the head, ok: row valid
        (pair valid, row in the part's rows), s: the rows' part, t: their token, ch: the step
        over a part's elements (scalar), first_ch: ``ch == 0``, lead: layer 0's first valid row
        of the first step (writes the zero tail), chunk: the head chunk's first byte, row: the
        page's row ``(layer*S + s)*N + t``, base: the row part's first cache element, at: its
        codes' first byte); vectors over the ``BLOCK_R`` rows, since Triton's interpreter
        mishandles masks made of scalar comparisons. Where ``ALIGN`` (PageJob.code_align) is
        nonzero, base is declared a multiple of ``VE`` elements (16 bytes) and at of ALIGN, so
        the compiler moves whole vectors."""
        SN: tl.constexpr = S * N
        RT: tl.constexpr = (SN + BLOCK_R - 1) // BLOCK_R
        lanes = tl.zeros([BLOCK_R], tl.int32)
        ch = tile % NCH
        rest = tile // NCH
        rt = rest % RT
        rest = rest // RT
        k = (rest % K + lanes).to(tl.int64)
        m = rest // K + lanes
        rr = rt * BLOCK_R + tl.arange(0, BLOCK_R)
        i, j, ok = _pair(map_ptr, m, map_s0, map_s1, src_blocks, dst_blocks,
                         (m < pairs) & (rr < SN))
        if PACK:
            b, p = i, j
        else:
            b, p = j, i
        s = rr // N
        t = rr - s * N
        first_ch = ch + lanes == 0
        lead = ok & first_ch & (rr == 0) & (layer + lanes == 0)
        chunk = page_off + p * P_SB + k * HB
        row = (layer * S + s) * N + t
        base = cache_off + b * C_SB + k * C_SH + t * C_ST + s * (E * C_SC)
        # The codes of the rows' part: fp8 a byte an element, nvfp4 a byte per two.
        at = chunk + 4 * L * S + row * (E // 2 if FMT == 3 else E)
        if ALIGN:
            base = tl.multiple_of(base, VE)
            at = tl.multiple_of(at, ALIGN)
        return k, ok, s, t, ch, first_ch, lead, chunk, row, base, at

    @triton.jit(do_not_specialize=["pairs", "tiles", "layers", "src_blocks", "dst_blocks",
                                   "map_s0", "map_s1", "l0", "page_off", "scale_off"])
    def _pack_kernel(
        cache_ptr,  # layer l0's cache storage: float32 / float16 / int16 (bfloat16 bits)
        page_ptr,  # the pages' storage as uint8
        scale_ptr,  # float32
        map_ptr, pairs, tiles, layers, map_s0, map_s1, src_blocks, dst_blocks, l0,
        cache_offs, page_off, scale_off,  # elements (a layer each, _encoded), bytes, elements
        SLOTS: tl.constexpr, OFFSET_BIAS: tl.constexpr,
        C_SB: tl.constexpr, C_SH: tl.constexpr, C_ST: tl.constexpr, C_SC: tl.constexpr,
        P_SB: tl.constexpr, HB: tl.constexpr,  # page row stride, head chunk bytes
        SC_L: tl.constexpr, SC_S: tl.constexpr, SC_K: tl.constexpr,
        K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, N: tl.constexpr, E: tl.constexpr,
        FMT: tl.constexpr, IN: tl.constexpr, STEPS: tl.constexpr, DATA_END: tl.constexpr,
        NATIVE: tl.constexpr, ALIGN: tl.constexpr,  # float8 casts; PageJob.code_align
        HALVES: tl.constexpr,  # nvfp4: groups as two halves a thread (_plan_pages says where)
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,  # rows x elements (nvfp4: groups of 16)
        NCH: tl.constexpr,  # steps of BLOCK_E over a part
        ONE_TILE: tl.constexpr,  # a program a tile (_one_tile)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        HDR: tl.constexpr = 4 * L * S
        VE: tl.constexpr = 4 if IN == 0 else 8  # cache elements of 16 bytes
        programs = tl.num_programs(0)
        # The launch's layers one after the other, their tiles dealt as _copy_kernel deals a
        # job's (a layer's offset chosen once).
        lo, hi = _runs_of_program(layers, tiles, ONE_TILE)
        for li in range(lo, hi):
            layer = l0 + li
            cache_off = _slot(cache_offs, li, SLOTS, OFFSET_BIAS)
            for tile in range(_first_tile(li, tiles), tiles, programs):
                k, ok, s, t, ch, first_ch, lead, chunk, row, base, at = _page_tile(
                    tile, layer, cache_off, page_off, map_ptr, map_s0, map_s1, src_blocks,
                    dst_blocks, pairs, True, C_SB, C_SH, C_ST, C_SC, P_SB, HB, K, L, S, N, E,
                    FMT, NCH, BLOCK_R, ALIGN, VE)
                sig = tl.load(scale_ptr + scale_off + layer * SC_L + s * SC_S + k * SC_K,
                              mask=ok, other=1.0)
                if FMT == 3:
                    g = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                    ok2 = ok[:, None] & (g < E // 16)[None, :]
                    ok3 = ok2[:, :, None]
                    if HALVES:
                        # Each group as its halves (elements 0-7, 8-15: where aligned, 16-byte
                        # vectors of 16-bit elements), so a thread holds whole groups
                        # (group_rule_halves: no shuffles, a group's scale computed once).
                        half = base[:, None, None] + ((g * 16)[None, :, None]
                                                      + tl.arange(0, 8)[None, None, :]) * C_SC
                        x0 = widen(tl.load(cache_ptr + half, mask=ok3, other=0), IN == 2)
                        x1 = widen(tl.load(cache_ptr + half + 8 * C_SC, mask=ok3, other=0),
                                   IN == 2)
                        sc, c0, c1 = group_rule_halves(x0, x1, sig[:, None], False, BLOCK_R,
                                                       BLOCK_E, NATIVE)
                        store_code_words(page_ptr + (at[:, None] + g[None, :] * 8)[:, :, None],
                                         c0, c1, ok3, ALIGN >= 4)
                    else:
                        col = (g * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
                        x = tl.load(cache_ptr + base[:, None, None] + col * C_SC, mask=ok3,
                                    other=0)
                        sc, codes = group_rule(widen(x, IN == 2), sig[:, None], False, BLOCK_R,
                                               BLOCK_E)
                        jj = tl.arange(0, 8)
                        cd = at[:, None, None] + (g * 8)[None, :, None] + jj[None, None, :]
                        tl.store(page_ptr + cd, codes, mask=ok3)
                    sd = (chunk + HDR + L * N * S * E // 2 + row * (E // 16))[:, None] \
                        + g[None, :]
                    tl.store(page_ptr + sd, sc.to(tl.uint8), mask=ok2)
                else:
                    e = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                    ok2 = _row_mask(ok, e, E, BLOCK_R, BLOCK_E)
                    x = tl.load(cache_ptr + base[:, None] + (e * C_SC)[None, :], mask=ok2,
                                other=0)
                    m, s2, y = fp8_scale(sig)
                    top = 448.0 if FMT == 1 else 57344.0
                    q = fp8_quotient(widen(x, IN == 2), m[:, None], s2[:, None], y[:, None], top,
                                     STEPS)
                    cd = at[:, None] + e[None, :]
                    tl.store(page_ptr + cd, fp8_code(q, FMT, NATIVE).to(tl.uint8), mask=ok2)
                # sigma(l, s) by the first chunk of each part's token 0, as 4 little-endian bytes.
                nb = tl.arange(0, 4)
                sbits = sig.to(tl.int32, bitcast=True)
                sb = ((sbits[:, None] >> (nb * 8)[None, :]) & 255).to(tl.uint8)
                first = ok & (t == 0) & first_ch
                tl.store(page_ptr + (chunk + 4 * (layer * S + s))[:, None] + nb[None, :], sb,
                         mask=first[:, None])
                # The chunk's zero tail (HB - DATA_END < 16 bytes) by layer 0's first row.
                z = tl.arange(0, 16)
                tl.store(page_ptr + (chunk + DATA_END)[:, None] + z[None, :],
                         tl.zeros([BLOCK_R, 16], tl.uint8),
                         mask=lead[:, None] & (z < HB - DATA_END)[None, :])

    @triton.jit(do_not_specialize=["pairs", "tiles", "layers", "src_blocks", "dst_blocks",
                                   "map_s0", "map_s1", "l0", "page_off"])
    def _unpack_kernel(
        page_ptr,  # the pages' storage as uint8
        cache_ptr,  # layer l0's cache storage: float32 / float16 / int16 (bfloat16 bits)
        map_ptr, pairs, tiles, layers, map_s0, map_s1, src_blocks, dst_blocks, l0,
        page_off, cache_offs,  # bytes, elements (a layer each, _encoded)
        SLOTS: tl.constexpr, OFFSET_BIAS: tl.constexpr,
        C_SB: tl.constexpr, C_SH: tl.constexpr, C_ST: tl.constexpr, C_SC: tl.constexpr,
        P_SB: tl.constexpr, HB: tl.constexpr,
        K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, N: tl.constexpr, E: tl.constexpr,
        FMT: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr, ALIGN: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, NCH: tl.constexpr,
        ONE_TILE: tl.constexpr,  # a program a tile (_one_tile)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        HDR: tl.constexpr = 4 * L * S
        VE: tl.constexpr = 4 if OUT == 0 else 8  # cache elements of 16 bytes
        programs = tl.num_programs(0)
        # The launch's layers one after the other, their tiles dealt as _copy_kernel deals a
        # job's (a layer's offset chosen once).
        lo, hi = _runs_of_program(layers, tiles, ONE_TILE)
        for li in range(lo, hi):
            layer = l0 + li
            cache_off = _slot(cache_offs, li, SLOTS, OFFSET_BIAS)
            for tile in range(_first_tile(li, tiles), tiles, programs):
                k, ok, s, t, ch, first_ch, lead, chunk, row, base, at = _page_tile(
                    tile, layer, cache_off, page_off, map_ptr, map_s0, map_s1, src_blocks,
                    dst_blocks, pairs, False, C_SB, C_SH, C_ST, C_SC, P_SB, HB, K, L, S, N, E,
                    FMT, NCH, BLOCK_R, ALIGN, VE)
                nb = tl.arange(0, 4)
                sb = tl.load(page_ptr + (chunk + 4 * (layer * S + s))[:, None] + nb[None, :],
                             mask=ok[:, None], other=0)
                sig = tl.sum(sb.to(tl.int32) << (nb * 8)[None, :], axis=1).to(tl.float32,
                                                                              bitcast=True)
                if FMT == 3:
                    g = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                    e = tl.arange(0, 16)
                    ok2 = ok[:, None] & (g < E // 16)[None, :]
                    ok3 = ok2[:, :, None]
                    col = (g * 16)[None, :, None] + e[None, None, :]
                    # A group's 8 code bytes (one vector where aligned), element 2j in byte j's
                    # low nibble and 2j + 1 in its high one.
                    jj = tl.arange(0, 8)
                    byte = tl.load(page_ptr + at[:, None, None] + (g * 8)[None, :, None]
                                   + jj[None, None, :], mask=ok3, other=0).to(tl.int32)
                    code = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_R, BLOCK_E, 16))
                    sc = tl.load(page_ptr + (chunk + HDR + L * N * S * E // 2
                                             + row * (E // 16))[:, None] + g[None, :],
                                 mask=ok2, other=0)
                    # value(c) * float(S) is exact; the one rounding is the product with sigma.
                    v = (e2m1_value(code) * fp8_decode(sc, 1)[:, :, None]) * sig[:, None, None]
                    tl.store(cache_ptr + base[:, None, None] + col * C_SC, _round_out(v, OUT),
                             mask=ok3)
                else:
                    e = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                    ok2 = _row_mask(ok, e, E, BLOCK_R, BLOCK_E)
                    c = tl.load(page_ptr + at[:, None] + e[None, :], mask=ok2, other=0)
                    v = fp8_dequant(c, sig[:, None], FMT, NATIVE)
                    tl.store(cache_ptr + base[:, None] + (e * C_SC)[None, :],
                             _round_out(v, OUT), mask=ok2)


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _copy_kernel, IMPORT_ERROR)


def unsupported(plan: TransferPlan) -> str | None:
    """Why this implementation cannot run ``plan``, or None. Both sides on the host: the torch
    implementation's (no kernel runs). Pinned host sides are supported (zero-copy)."""
    if plan.device is None:
        return "both sides are in host memory: a plain host copy (the torch implementation)"
    return None


def _programs(device: torch.device, tiles: int, max_ctas: int | None, per_sm: int,
              one_tile: bool = False) -> int:
    """Programs of a launch over ``tiles`` tiles: a program a tile where ``one_tile``
    (:func:`_one_tile`: no budget), else at most ``max_ctas``, or without one enough to fill
    the GPU (SMs x ``per_sm``; the interpreter counts one SM)."""
    if one_tile:
        return max(1, tiles)
    cap = max_ctas if max_ctas is not None else triton_support.programs_to_fill(device, per_sm)
    return max(1, min(tiles, cap))


def _one_tile(plan: TransferPlan, tuning: TritonTuning, *sides: Side) -> bool:
    """Whether a launch over ``sides`` takes a program a tile (:attr:`TritonTuning.
    one_tile_programs`): no SM budget, and every side in the memory of the device the launch
    runs on (not pinned host memory, not a peer GPU's)."""
    return (tuning.one_tile_programs and plan.max_ctas is None
            and all(x.tensor.device == plan.device for x in sides))


_LANES = {1: (torch.uint8, 1), 2: (torch.int16, 1), 4: (torch.int32, 1), 8: (torch.int32, 2),
          16: (torch.int32, 4)}


def _used(stride: int, size: int) -> int:
    """A stride along a dim of size 1 never multiplies a nonzero index: 0 there (no alignment
    limit, no other compiled variant)."""
    return stride if size > 1 else 0


def _pdl(plan: TransferPlan, programs: int, tuning: TritonTuning) -> tuple[bool, bool]:
    """(PDL, TRIGGER) of a launch of ``programs`` programs of ``plan``: the tuning's policy, the
    early trigger only where the plan allows it (``plan.early_trigger``: not under an SM
    budget)."""
    pdl, trigger = pdl_launch(plan.device, programs, tuning.pdl_max_programs,
                              tuning.pdl_trigger_max_programs)
    return pdl, trigger and plan.early_trigger


@dataclasses.dataclass(frozen=True)
class CopyLaunch:
    """One launch of :func:`_copy_kernel` over ``jobs`` (indices into ``plan.jobs``, all of one
    compiled shape): the first job's storages are the pointers, each job's first vector of a
    side is an offset past them (``src_offs``, ``dst_offs``: encoded as :data:`_OFFSET_BIAS`
    says, padded to a power of two); ``job_tiles`` tiles a job, ``grid`` programs."""

    jobs: tuple[int, ...]
    lane_dtype: torch.dtype
    grid: tuple[int]
    job_tiles: int
    src_offs: tuple[int, ...]
    dst_offs: tuple[int, ...]
    kw: dict


def _copy_shape(job: CopyJob, plan: TransferPlan, tuning: TritonTuning) -> tuple:
    """What a job's launch computes from its geometry and ``plan.pairs`` alone: (vector width
    W in bytes, lane dtype, tiles, constants); ``()`` where the job moves nothing."""
    dense = job.dense_rows
    run_bytes = job.row_bytes if dense else job.elem_bytes
    elems = 1 if dense else job.elems
    rows = job.heads * job.tokens * elems
    if rows == 0 or run_bytes == 0:
        return ()
    sides = (job.src, job.dst)
    strides = [(_used(s.strides[0], s.blocks), _used(s.strides[1], job.heads),
                _used(s.strides[2], job.tokens), _used(s.strides[3], elems)) for s in sides]
    w = align([*(x.tensor.untyped_storage().data_ptr() for x in sides),
               *(_base(x) for x in sides), *strides[0], *strides[1], run_bytes])
    lane_dtype, vec = _LANES[w]
    run = run_bytes // w * vec
    one = _one_tile(plan, tuning, job.src, job.dst)
    tile_bytes = (tuning.one_tile_copy_bytes if one
                  else tuning.host_read_tile_bytes if job.src.on_host
                  else tuning.copy_tile_bytes)
    tile = tile_bytes // (w // vec)
    block_c = min(next_pow2(run), tile)
    total = plan.pairs * rows
    block_r = max(1, min(tile // block_c, next_pow2(total)))
    tiles = triton.cdiv(total, block_r) * triton.cdiv(run, block_c)
    (ss, ds) = ([x // w for x in st] for st in strides)
    kw = dict(S_SB=ss[0], S_SH=ss[1], S_ST=ss[2], S_SC=ss[3], D_SB=ds[0], D_SH=ds[1],
              D_ST=ds[2], D_SC=ds[3], HEADS=job.heads, TOKENS=job.tokens, ELEMS=elems, RUN=run,
              VEC=vec, BLOCK_R=block_r, BLOCK_C=block_c, ONE_TILE=one)
    return w, lane_dtype, tiles, kw


def _delta(first: Side, side: Side) -> int:
    """Bytes from the start of ``first``'s storage to ``side``'s element [0, 0, 0, 0]: a slot's
    offset past a launch's pointer (one flat address space: device memory, peers and pinned host
    memory alike under unified addressing)."""
    return side.tensor.untyped_storage().data_ptr() - first.tensor.untyped_storage().data_ptr() \
        + _base(side)


def _slot_units(first: Side, side: Side, unit: int) -> int | None:
    """:func:`_delta` in units of ``unit`` bytes: the offset slot by which a launch whose pointer
    is ``first``'s storage, viewed as such units, reaches ``side``; None where it cannot (not
    whole units, or beyond the encoding's range)."""
    delta = _delta(first, side)
    return delta // unit if delta % unit == 0 and abs(delta // unit) < _OFFSET_MOST else None


def _reachable(first: Side, side: Side, unit: int) -> bool:
    """Whether :func:`_slot_units` reaches ``side`` from ``first``."""
    return _slot_units(first, side, unit) is not None


def _encoded(sides: list[Side], unit: int) -> tuple[int, ...]:
    """Each side's :func:`_slot_units` past the first side's storage (each reachable), encoded
    as :data:`_OFFSET_BIAS` says and padded to a power of two: a launch's offset slots."""
    offs = []
    for x in sides:
        units = _slot_units(sides[0], x, unit)
        assert units is not None, (_delta(sides[0], x), unit)
        offs.append(16 * units + _OFFSET_BIAS)
    return tuple(offs) + (_OFFSET_BIAS,) * (next_pow2(len(offs)) - len(offs))


def _memoized(keyed: tuple, what: str, plan: TransferPlan, tuning: TritonTuning, build):
    """``build()``, memoized for cached plans (kvwrite.transfer's plan cache: ``launch_key`` of
    ``keyed``, a plan's jobs or a page job's caches, is the same for the same tensors, pointers
    included) by (key, what, tuning, pairs, max_ctas, device); not where the device is CUDA's
    current one (its SM count is the current device's)."""
    memo = getattr(keyed, "launch_key", None)
    if memo is None or (plan.device.index is None and plan.device.type == "cuda"):
        return build()
    key = (memo, what, tuning, plan.pairs, plan.max_ctas, plan.device)
    hit = _LAUNCHES.get(key)
    return _LAUNCHES.put(key, build()) if hit is None else hit


def _per_launch(tuning: TritonTuning) -> int:
    """Jobs of a copy launch or layers of a page launch, at most."""
    return max(1, min(SLOTS, tuning.jobs_per_launch))


def copy_launches(plan: TransferPlan, tuning: TritonTuning = TUNING) -> tuple[CopyLaunch, ...]:
    """The copy launches of ``plan``: its jobs grouped by compiled shape (constants, lane type,
    vector width, block counts, the memory each side lies in), in their first job's order, each
    group cut into launches of at most ``tuning.jobs_per_launch`` (at most :data:`SLOTS`) jobs,
    so a multi-layer call of one layout is one launch, not a launch per layer (a job whose
    storages the launch's pointers do not reach starts another). No GPU needed. Memoized
    (:func:`_memoized`)."""
    return _memoized(plan.jobs, "copy", plan, tuning, lambda: _plan_copy_launches(plan, tuning))


def _plan_copy_launches(plan: TransferPlan, tuning: TritonTuning) -> tuple[CopyLaunch, ...]:
    groups: dict[tuple, list[int]] = {}
    shapes = {}
    for n, job in enumerate(plan.jobs):
        shape = _copy_shape(job, plan, tuning)
        if not shape:
            continue
        w, lane_dtype, tiles, kw = shapes[n] = shape
        key = (w, lane_dtype, tiles, tuple(kw.items()), job.src.blocks, job.dst.blocks,
               job.src.tensor.device, job.dst.tensor.device)
        groups.setdefault(key, []).append(n)
    out = []
    for (w, lane_dtype, tiles, *_), members in groups.items():
        kw = shapes[members[0]][3]
        tile_bytes = kw["BLOCK_R"] * kw["BLOCK_C"] * (w // kw["VEC"])
        group = [plan.jobs[n] for n in members]
        # A launch's jobs are those its first job's storages reach (each side).
        for i, count in consecutive_runs(group, _per_launch(tuning), lambda f, j, w=w: (
                _reachable(f.src, j.src, w) and _reachable(f.dst, j.dst, w))):
            jobs = group[i:i + count]
            total = tiles * count
            assert total < 2**31, total
            grid = (_programs(plan.device, total, plan.max_ctas, tuning.programs_per_sm,
                              kw["ONE_TILE"]),)
            warps = _copy_warps(tile_bytes, jobs[0].dst.on_host, grid[0], tuning)
            out.append(CopyLaunch(tuple(members[i:i + count]), lane_dtype, grid, tiles,
                                  _encoded([j.src for j in jobs], w),
                                  _encoded([j.dst for j in jobs], w), {**kw, "num_warps": warps}))
    return tuple(out)


# The copy and page launches of the last few cached plans (see _memoized).
_LAUNCHES = BoundedMemo(16)


def _launch_copy(cl: CopyLaunch, plan: TransferPlan, tuning: TritonTuning) -> None:
    first = plan.jobs[cl.jobs[0]]
    pdl, trigger = _pdl(plan, cl.grid[0], tuning)
    mapping = plan.mapping
    _copy_kernel[cl.grid](
        storage_view(first.src.tensor, cl.lane_dtype),
        storage_view(first.dst.tensor, cl.lane_dtype),
        mapping, plan.pairs, len(cl.jobs), cl.job_tiles, mapping.stride(0),
        mapping.stride(1), first.src.blocks, first.dst.blocks, cl.src_offs, cl.dst_offs,
        SLOTS=len(cl.src_offs), OFFSET_BIAS=_OFFSET_BIAS, **cl.kw, PDL=pdl, PDL_TRIGGER=trigger,
        launch_pdl=pdl)


def _copy_warps(tile_bytes: int, writes_host: bool, programs: int, tuning: TritonTuning) -> int:
    """Warps of a copy program: 64 bytes (four 16-B vectors) of its tile a thread (a smaller
    tile spread over more threads would give each less than a vector), at most ``copy_warps``;
    where the destination is pinned host memory, at most the launch's
    ``host_write_launch_warps`` spread over its ``programs``, from ``host_write_least_warps``
    to ``host_write_warps`` a program."""
    most = tuning.copy_warps
    if writes_host:
        most = max(tuning.host_write_least_warps,
                   min(tuning.host_write_warps, tuning.host_write_launch_warps // programs))
    return max(1, min(most, tile_bytes // (32 * 64)))


def _cache_view(side: Side, dtype: torch.dtype) -> torch.Tensor:
    """A cache side's storage as the page kernels' element type (bfloat16 as int16 bits)."""
    return storage_view(side.tensor, torch.int16 if dtype == torch.bfloat16 else dtype)


@dataclasses.dataclass(frozen=True)
class PageLaunch:
    """One launch of :func:`_pack_kernel` or :func:`_unpack_kernel` over the ``layers``
    consecutive layers from ``l0`` (one run of :meth:`PageJob.layer_runs`: equal strides): layer
    ``l0``'s cache storage is the pointer, each layer's first element an offset past it
    (``cache_offs``, in elements, encoded as :data:`_OFFSET_BIAS` says); ``tiles`` tiles a layer,
    ``grid`` programs, ``kw`` the kernel's constants."""

    l0: int
    layers: int
    grid: tuple[int]
    tiles: int
    cache_offs: tuple[int, ...]
    kw: dict


def page_launches(plan: TransferPlan, tuning: TritonTuning = TUNING) -> tuple[PageLaunch, ...]:
    """The page launches of ``plan``: a launch per run of at most ``tuning.jobs_per_launch``
    consecutive layers of equal strides whose storages the run's first reaches, so a call of
    one layout is one launch, not a launch per layer. No GPU needed. Memoized
    (:func:`_memoized`)."""
    job = plan.page_job
    return _memoized(job.caches, "pages", plan, tuning, lambda: _plan_pages(job, plan, tuning))


def _plan_pages(job: PageJob, plan: TransferPlan, tuning: TritonTuning
                ) -> tuple[PageLaunch, ...]:
    fmt = _FMT[job.page_format]
    L, S, N, K, E = job.layers, job.parts, job.tokens, job.heads, job.part_elems
    es = job.cache_dtype.itemsize
    width = E // 16 if fmt == 3 else E  # groups of 16 (nvfp4) or elements (fp8) of a part
    budget = plan.max_ctas is not None
    tile_elems = tuning.budget_page_tile_elems if budget else tuning.page_tile_elems
    per = tile_elems // 16 if fmt == 3 else tile_elems
    block_e = min(next_pow2(width), per)
    if width % block_e and width & -width >= (1 if fmt == 3 else 8):
        # A power of two dividing the part (DeepSeek-V3's 576 elements: 64, not 1024 with 448
        # masked), at least a group or a 16-byte vector of the cache.
        block_e = min(width & -width, per)
    block_r = max(1, min(per // block_e, next_pow2(S * N)))
    tiles = plan.pairs * K * triton.cdiv(S * N, block_r) * triton.cdiv(width, block_e)
    warps = tuning.budget_page_warps if budget else tuning.page_warps
    # NVFP4 pack: a thread's groups whole (group_rule_halves: no shuffles) where a tile's row
    # holds nvfp4_halves_groups groups or more, at most a warp per 32 of the tile's groups.
    halves = fmt == 3 and job.direction == "pack" and block_e >= tuning.nvfp4_halves_groups
    if halves:
        warps = min(warps, max(1, block_r * block_e // 32))
    data_end = 4 * L * S + (L * N * S * E // 2 + L * N * S * E // 16 if fmt == 3
                            else L * N * S * E)
    common = dict(P_SB=_used(job.pages.strides[0], job.pages.blocks), HB=job.chunk_bytes, K=K,
                  L=L, S=S, N=N, E=E, FMT=fmt, BLOCK_R=block_r, BLOCK_E=block_e,
                  NCH=triton.cdiv(width, block_e),
                  NATIVE=triton_support.native_fp8(plan.device),
                  ALIGN=job.code_align(),
                  num_warps=warps, enable_fp_fusion=False)
    if job.direction == "pack":
        sst = job.scale_strides
        common.update(SC_L=_used(sst[0], L), SC_S=_used(sst[1], S), SC_K=_used(sst[2], K),
                      IN=_DT[job.cache_dtype],
                      STEPS=2 if job.cache_dtype == torch.float32 else 1, DATA_END=data_end,
                      HALVES=halves)
    else:
        common.update(OUT=_DT[job.cache_dtype])
    out = []
    for l0, n in job.layer_runs(_per_launch(tuning),
                                lambda first, side: _reachable(first, side, es)):
        sides = list(job.caches[l0:l0 + n])
        cs = [x // es for x in sides[0].strides]
        # A stride along blocks multiplies a nonzero id where any layer of the run has two.
        kw = dict(C_SB=_used(cs[0], max(x.blocks for x in sides)), C_SH=_used(cs[1], K),
                  C_ST=_used(cs[2], N), C_SC=cs[3], **common)
        assert tiles * n < 2**31, (tiles, n)
        # A pack whose part rows take several steps (DeepSeek-V3's 576 elements: 9 of 64)
        # keeps the persistent programs (see one_tile_programs).
        kw["ONE_TILE"] = (_one_tile(plan, tuning, job.pages, *sides)
                          and not (job.direction == "pack" and common["NCH"] > 1))
        grid = (_programs(plan.device, tiles * n, plan.max_ctas, tuning.page_programs_per_sm,
                          kw["ONE_TILE"]),)
        out.append(PageLaunch(l0, n, grid, tiles, _encoded(sides, es), kw))
    return tuple(out)


def _launch_pages(pl: PageLaunch, plan: TransferPlan, tuning: TritonTuning) -> None:
    job = plan.page_job
    pdl, trigger = _pdl(plan, pl.grid[0], tuning)
    cache = _cache_view(job.caches[pl.l0], job.cache_dtype)
    pages = storage_view(job.pages.tensor, torch.uint8)
    # A pair writes all of a chunk or nothing: the cache side's id bound is every layer's.
    cache_blocks = min(c.blocks for c in job.caches)
    mapping = plan.mapping
    kw = dict(SLOTS=len(pl.cache_offs), OFFSET_BIAS=_OFFSET_BIAS, **pl.kw, PDL=pdl,
              PDL_TRIGGER=trigger, launch_pdl=pdl)
    if job.direction == "pack":
        _pack_kernel[pl.grid](
            cache, pages, job.scale, mapping, plan.pairs, pl.tiles, pl.layers, mapping.stride(0),
            mapping.stride(1), cache_blocks, job.pages.blocks, pl.l0, pl.cache_offs,
            _base(job.pages), job.scale_offset, **kw)
    else:
        _unpack_kernel[pl.grid](
            pages, cache, mapping, plan.pairs, pl.tiles, pl.layers, mapping.stride(0),
            mapping.stride(1), job.pages.blocks, cache_blocks, pl.l0, _base(job.pages),
            pl.cache_offs, **kw)


def run(plan: TransferPlan, *, tuning: TritonTuning = TUNING) -> None:
    """Enqueue ``plan`` on PyTorch's current stream of ``plan.device`` (no host sync, nothing
    allocated on the device: capturable in a CUDA graph on the first call)."""
    if plan.device is None:
        raise ValueError(f"plan: {unsupported(plan)}")
    if plan.pairs == 0:
        return
    # A variant's first launch loads its module: inside torch.cuda.graph that needs relaxed
    # capture mode (nvrtc.capture_relaxed), so a first call can be the captured one.
    on_gpu = plan.device.type == "cuda"
    if plan.peer is not None:
        # A call across two GPUs runs on the destination's device (plan.device), reading the
        # source through peer addressing: Triton's launcher accepts a peer pointer
        # (cuPointerGetAttribute in the current context) once peer access is enabled.
        copy_engine.enable_peer_access(plan.device, plan.peer)
    with (torch.cuda.device(plan.device) if on_gpu else contextlib.nullcontext(),
          nvrtc.capture_relaxed() if on_gpu else contextlib.nullcontext()):
        for cl in copy_launches(plan, tuning):
            _launch_copy(cl, plan, tuning)
        if plan.page_job is not None:
            for pl in page_launches(plan, tuning):
                _launch_pages(pl, plan, tuning)
