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
multiplied by ``VEC`` so the compiler sees their alignment. A job's work is ``pairs x rows`` rows of ``RUN`` contiguous lanes (a row of ``row_bytes`` where
the elements are dense on both sides, else one element), cut into tiles of ``BLOCK_R`` rows x
``BLOCK_C`` lanes: small rows are stacked, long rows (swap_blocks' four-argument form: one row of
a block's bytes) are split into chunks that different programs copy. A persistent grid (at most
``plan.max_ctas`` programs, else enough to fill the GPU) walks the tiles with a grid-stride loop.

Quantized pages (``plan.page_job``): one launch per layer of :func:`_pack_kernel` or
:func:`_unpack_kernel` (each layer is its own tensor); a launch writes its layer's share of every
head chunk (its ``sigma(l, s)`` floats, its rows' codes and, NVFP4, scale bytes), and layer 0's
pack also the chunk's zero tail, so the launches together write whole chunks. fp8 codes are
``Q(x)`` by kernels.triton_fp8's exact quotient, encoded by integer operations on its bits
(nearest even, subnormals, saturation; no float8 cast); NVFP4 is kernels.triton_nvfp4's group
rule with ``k = sigma``; unpack decodes exactly and rounds to the cache dtype (bfloat16 by integer
operations on the float32 bits). So Triton's interpreter writes the GPU's bytes, and the CPU
tests compare everything.

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

from . import copy_engine, nvrtc, triton_support
from .launch import BoundedMemo, align
from .triton_fp8 import IMPORT_ERROR, fp8_quotient, fp8_scale, pdl_entry, tl, triton
from .triton_gather import fp8_decode, fp8_dequant
from .triton_nvfp4 import e2m1_value, e4m3, group_rule, widen
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
    # Page kernels: elements of a tile (rows x elements of one part).
    page_tile_elems: int = 2048
    page_warps: int = 4
    # Warps of a program that writes pinned host memory (d2h): 4. A program of a copy launch
    # stays on its SM for the whole call, and fewer warps leave room on it for a concurrent
    # kernel's CTAs (the CUDA kernel's host_cta_threads). Measured (H200, 32 Llama-3-8B layers
    # d2h, max_ctas = 4, beside bf16 causal SDPA [1, 32, 8192, 128], tuning-log 101), the
    # attention's time against alone at 16 / 128 blocks: 16 warps 1.06 / 1.12, 8 1.03 / 1.09, 4
    # 1.01 / 1.06; alone 52.3-52.6 GB/s at every count.
    host_write_warps: int = 4
    # Jobs per copy launch, at most SLOTS: every slot. Measured (H200, 32 Llama-3-8B layers' K
    # and V: 64 jobs, 16 / 128 blocks, tuning-log 101), GB/s at 1 / 4 / every program(s) a
    # launch, 1 / 4 / 32 jobs a launch: d2d 16 blocks 42 / 44 / 46, 124 / 153 / 169, 459 / 972 /
    # 1289; 128 blocks, every program 1278 / 1749 / 1805; h2d 16 blocks 34 / 38 / 39, 45 / 49 /
    # 51 (the link: 55).
    jobs_per_launch: int = SLOTS
    # Programs per SM without max_ctas.
    programs_per_sm: int = 4


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
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        ROWS: tl.constexpr = HEADS * TOKENS * ELEMS
        NCH: tl.constexpr = (RUN + BLOCK_C - 1) // BLOCK_C
        total = pairs.to(tl.int64) * ROWS
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        # The launch's tiles job after job, dealt to the programs in turn (tile n of the launch
        # to program n mod programs). A job's offsets are chosen once a job, not once a tile:
        # measured (H200, 64 Llama-3-8B jobs of 16 blocks, d2d), the choice among 32 slots made
        # a tile took 1 / 4 programs 15.3 / 61 GB/s against 39 / 119 with a launch a job.
        for job in range(0, jobs):
            src_off = src_offs[0]
            dst_off = dst_offs[0]
            for k in tl.static_range(1, SLOTS):
                src_off = tl.where(job == k, src_offs[k], src_off)
                dst_off = tl.where(job == k, dst_offs[k], dst_off)
            src_off = (src_off - OFFSET_BIAS) // 16
            dst_off = (dst_off - OFFSET_BIAS) // 16
            first = (pid + programs - (job * job_tiles) % programs) % programs
            for tile in range(first, job_tiles, programs):
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
    def _fp8_bits(q, FMT: tl.constexpr):
        """fp8 codes (int32, 0-255) of float32 ``q`` already clamped to the format's ±MAX (NaN
        kept; fp8_quotient's result): nearest even, subnormals rounded, the sign kept (-0 too),
        NaN -> 0x7F, by integer operations (Triton's interpreter rounds float8 casts otherwise
        than the GPU). E4M3 is triton_nvfp4's e4m3 of |q|; E5M2 the same steps with 2 mantissa
        bits and bias 15."""
        a = tl.abs(q)
        if FMT == 1:
            code, _ = e4m3(a)
        else:
            b = a.to(tl.int32, bitcast=True)
            normal = ((b + 0xFFFFF + ((b >> 21) & 1)) >> 21) - (112 << 2)
            # Below 2^-14: RN(a / 2^-16) is the last bits of a + 2^7 (whose ulp is 2^-16).
            sub = (a + 128.0).to(tl.int32, bitcast=True) - 0x43000000
            code = tl.where(a < 6.103515625e-05, sub, normal)
            code = tl.where(a >= 57344.0, 0x7B, code)
            code = tl.where(a != a, 0x7F, code)
        return code | ((q.to(tl.int32, bitcast=True) >> 24) & 128)

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
    def _page_tile(tile, map_ptr, map_s0, map_s1, src_blocks, dst_blocks, pairs,
                   K: tl.constexpr, SN: tl.constexpr, N: tl.constexpr, NCH: tl.constexpr,
                   BLOCK_R: tl.constexpr):
        """A page kernel's tile ``tile``: (i, j: its pair's ids, k: the head, ok: row valid
        (pair valid, row in the part's rows), s: the rows' part, t: their token, ch: the step
        over a part's elements (scalar), first_ch: ``ch == 0``, lead: the first valid row of the
        first step (writes the zero tail)); vectors over the ``BLOCK_R`` rows, since Triton's
        interpreter mishandles masks made of scalar comparisons."""
        RT: tl.constexpr = (SN + BLOCK_R - 1) // BLOCK_R
        lanes = tl.zeros([BLOCK_R], tl.int32)
        ch = tile % NCH
        rest = tile // NCH
        rt = rest % RT
        rest = rest // RT
        k = rest % K + lanes
        m = rest // K + lanes
        rr = rt * BLOCK_R + tl.arange(0, BLOCK_R)
        i, j, ok = _pair(map_ptr, m, map_s0, map_s1, src_blocks, dst_blocks,
                         (m < pairs) & (rr < SN))
        s = rr // N
        t = rr - s * N
        first_ch = ch + lanes == 0
        return i, j, k.to(tl.int64), ok, s, t, ch, first_ch, ok & first_ch & (rr == 0)

    @triton.jit(do_not_specialize=["pairs", "tiles", "src_blocks", "dst_blocks", "map_s0",
                                   "map_s1", "layer", "cache_off", "page_off", "scale_off"])
    def _pack_kernel(
        cache_ptr,  # layer `layer`'s cache storage: float32 / float16 / int16 (bfloat16 bits)
        page_ptr,  # the pages' storage as uint8
        scale_ptr,  # float32
        map_ptr, pairs, tiles, map_s0, map_s1, src_blocks, dst_blocks, layer,
        cache_off, page_off, scale_off,  # elements, bytes, elements
        C_SB: tl.constexpr, C_SH: tl.constexpr, C_ST: tl.constexpr, C_SC: tl.constexpr,
        P_SB: tl.constexpr, HB: tl.constexpr,  # page row stride, head chunk bytes
        SC_L: tl.constexpr, SC_S: tl.constexpr, SC_K: tl.constexpr,
        K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, N: tl.constexpr, E: tl.constexpr,
        FMT: tl.constexpr, IN: tl.constexpr, STEPS: tl.constexpr, ZERO_TAIL: tl.constexpr,
        DATA_END: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,  # rows x elements (nvfp4: groups of 16)
        NCH: tl.constexpr,  # steps of BLOCK_E over a part
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        HDR: tl.constexpr = 4 * L * S
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            b, p, k, ok, s, t, ch, first_ch, lead = _page_tile(
                tile, map_ptr, map_s0, map_s1, src_blocks, dst_blocks, pairs, K, S * N, N, NCH,
                BLOCK_R)
            chunk = page_off + p * P_SB + k * HB
            row = (layer * S + s) * N + t  # the page's row r of (layer, s, t)
            sig = tl.load(scale_ptr + scale_off + layer * SC_L + s * SC_S + k * SC_K, mask=ok,
                          other=1.0)
            base = cache_off + b * C_SB + k * C_SH + t * C_ST + s * (E * C_SC)
            if FMT == 3:
                g = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                e = tl.arange(0, 16)
                ok2 = ok[:, None] & (g < E // 16)[None, :]
                ok3 = ok2[:, :, None]
                col = (g * 16)[None, :, None] + e[None, None, :]
                x = tl.load(cache_ptr + base[:, None, None] + col * C_SC, mask=ok3, other=0)
                sc, codes = group_rule(widen(x, IN == 2), sig[:, None], False, BLOCK_R, BLOCK_E)
                jj = tl.arange(0, 8)
                cd = (chunk + HDR + row * (E // 2))[:, None, None] + (g * 8)[None, :, None] \
                    + jj[None, None, :]
                tl.store(page_ptr + cd, codes, mask=ok3)
                sd = (chunk + HDR + L * N * S * E // 2 + row * (E // 16))[:, None] + g[None, :]
                tl.store(page_ptr + sd, sc.to(tl.uint8), mask=ok2)
            else:
                e = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                ok2 = ok[:, None] & (e < E)[None, :]
                x = tl.load(cache_ptr + base[:, None] + (e * C_SC)[None, :], mask=ok2, other=0)
                m, s2, y = fp8_scale(sig)
                if FMT == 1:
                    q = fp8_quotient(widen(x, IN == 2), m[:, None], s2[:, None], y[:, None], 448.0,
                                     STEPS)
                else:
                    q = fp8_quotient(widen(x, IN == 2), m[:, None], s2[:, None], y[:, None],
                                     57344.0, STEPS)
                cd = (chunk + HDR + row * E)[:, None] + e[None, :]
                tl.store(page_ptr + cd, _fp8_bits(q, FMT).to(tl.uint8), mask=ok2)
            # sigma(l, s) by the first chunk of each part's token 0, as 4 little-endian bytes.
            nb = tl.arange(0, 4)
            sbits = sig.to(tl.int32, bitcast=True)
            sb = ((sbits[:, None] >> (nb * 8)[None, :]) & 255).to(tl.uint8)
            first = ok & (t == 0) & first_ch
            tl.store(page_ptr + (chunk + 4 * (layer * S + s))[:, None] + nb[None, :], sb,
                     mask=first[:, None])
            if ZERO_TAIL:  # HB - DATA_END < 16 bytes, by the chunk's first row
                z = tl.arange(0, 16)
                tl.store(page_ptr + (chunk + DATA_END)[:, None] + z[None, :],
                         tl.zeros([BLOCK_R, 16], tl.uint8),
                         mask=lead[:, None] & (z < HB - DATA_END)[None, :])

    @triton.jit(do_not_specialize=["pairs", "tiles", "src_blocks", "dst_blocks", "map_s0",
                                   "map_s1", "layer", "cache_off", "page_off"])
    def _unpack_kernel(
        page_ptr,  # the pages' storage as uint8
        cache_ptr,  # layer `layer`'s cache storage: float32 / float16 / int16 (bfloat16 bits)
        map_ptr, pairs, tiles, map_s0, map_s1, src_blocks, dst_blocks, layer,
        page_off, cache_off,  # bytes, elements
        C_SB: tl.constexpr, C_SH: tl.constexpr, C_ST: tl.constexpr, C_SC: tl.constexpr,
        P_SB: tl.constexpr, HB: tl.constexpr,
        K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, N: tl.constexpr, E: tl.constexpr,
        FMT: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, NCH: tl.constexpr,
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        pdl_entry(PDL, PDL_TRIGGER)
        HDR: tl.constexpr = 4 * L * S
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            p, b, k, ok, s, t, ch, first_ch, lead = _page_tile(
                tile, map_ptr, map_s0, map_s1, src_blocks, dst_blocks, pairs, K, S * N, N, NCH,
                BLOCK_R)
            chunk = page_off + p * P_SB + k * HB
            row = (layer * S + s) * N + t
            nb = tl.arange(0, 4)
            sb = tl.load(page_ptr + (chunk + 4 * (layer * S + s))[:, None] + nb[None, :],
                         mask=ok[:, None], other=0)
            sig = tl.sum(sb.to(tl.int32) << (nb * 8)[None, :], axis=1).to(tl.float32,
                                                                          bitcast=True)
            base = cache_off + b * C_SB + k * C_SH + t * C_ST + s * (E * C_SC)
            if FMT == 3:
                g = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                e = tl.arange(0, 16)
                ok2 = ok[:, None] & (g < E // 16)[None, :]
                ok3 = ok2[:, :, None]
                col = (g * 16)[None, :, None] + e[None, None, :]
                byte = tl.load(page_ptr + (chunk + HDR + row * (E // 2))[:, None, None]
                               + col // 2, mask=ok3, other=0).to(tl.int32)
                code = (byte >> ((col & 1) * 4)) & 15
                sc = tl.load(page_ptr + (chunk + HDR + L * N * S * E // 2
                                         + row * (E // 16))[:, None] + g[None, :],
                             mask=ok2, other=0)
                # value(c) * float(S) is exact; the one rounding is the product with sigma.
                v = (e2m1_value(code) * fp8_decode(sc, 1)[:, :, None]) * sig[:, None, None]
                tl.store(cache_ptr + base[:, None, None] + col * C_SC, _round_out(v, OUT),
                         mask=ok3)
            else:
                e = ch * BLOCK_E + tl.arange(0, BLOCK_E)
                ok2 = ok[:, None] & (e < E)[None, :]
                c = tl.load(page_ptr + (chunk + HDR + row * E)[:, None] + e[None, :], mask=ok2,
                            other=0)
                v = fp8_dequant(c, sig[:, None], FMT, NATIVE)
                tl.store(cache_ptr + base[:, None] + (e * C_SC)[None, :], _round_out(v, OUT),
                         mask=ok2)


def available(device: torch.device) -> str | None:
    return triton_support.available(device, triton, lambda: _copy_kernel, IMPORT_ERROR)


def unsupported(plan: TransferPlan) -> str | None:
    """Why this implementation cannot run ``plan``, or None. Both sides on the host: the torch
    implementation's (no kernel runs). Pinned host sides are supported (zero-copy)."""
    if plan.device is None:
        return "both sides are in host memory: a plain host copy (the torch implementation)"
    return None


def _programs(device: torch.device, tiles: int, max_ctas: int | None,
              tuning: TritonTuning) -> int:
    """Programs of a launch over ``tiles`` tiles: at most ``max_ctas``, else enough to fill the
    GPU (SMs x ``programs_per_sm``; the interpreter counts one SM)."""
    cap = max_ctas if max_ctas is not None else triton_support.programs_to_fill(
        device, tuning.programs_per_sm)
    return max(1, min(tiles, cap))


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
    tile_bytes = tuning.host_read_tile_bytes if job.src.on_host else tuning.copy_tile_bytes
    tile = tile_bytes // (w // vec)
    block_c = min(next_pow2(run), tile)
    total = plan.pairs * rows
    block_r = max(1, min(tile // block_c, next_pow2(total)))
    tiles = triton.cdiv(total, block_r) * triton.cdiv(run, block_c)
    (ss, ds) = ([x // w for x in st] for st in strides)
    kw = dict(S_SB=ss[0], S_SH=ss[1], S_ST=ss[2], S_SC=ss[3], D_SB=ds[0], D_SH=ds[1],
              D_ST=ds[2], D_SC=ds[3], HEADS=job.heads, TOKENS=job.tokens, ELEMS=elems, RUN=run,
              VEC=vec, BLOCK_R=block_r, BLOCK_C=block_c,
              num_warps=_copy_warps(block_r * block_c * (w // vec), job.dst.on_host, tuning))
    return w, lane_dtype, tiles, kw


def _offsets(jobs: list[CopyJob], w: int, side: str) -> tuple[int, ...]:
    """Each job's first byte of ``side`` ("src" or "dst") past the first job's storage, in
    vectors of ``w`` bytes (w divides every storage pointer and first byte: :func:`align`),
    encoded as :data:`_OFFSET_BIAS` says; padded to a power of two. The kernel adds them to the
    first job's storage pointer: one flat address space (device memory, peers and pinned host
    memory alike under unified addressing)."""
    sides = [getattr(j, side) for j in jobs]
    origin = sides[0].tensor.untyped_storage().data_ptr()
    offs = []
    for x in sides:
        delta = x.tensor.untyped_storage().data_ptr() - origin + _base(x)
        assert delta % w == 0 and abs(delta // w) < 2**37, (delta, w)
        offs.append(16 * (delta // w) + _OFFSET_BIAS)
    return tuple(offs) + (_OFFSET_BIAS,) * (next_pow2(len(offs)) - len(offs))


def copy_launches(plan: TransferPlan, tuning: TritonTuning = TUNING) -> tuple[CopyLaunch, ...]:
    """The copy launches of ``plan``: its jobs grouped by compiled shape (constants, lane type,
    vector width, block counts, the memory each side lies in), in their first job's order, each
    group cut into launches of at most ``tuning.jobs_per_launch`` (at most :data:`SLOTS`) jobs,
    so a multi-layer call of one layout is one launch, not a launch per layer. No GPU needed.

    Memoized for cached plans (kvwrite.transfer's plan cache: ``jobs.launch_key`` is the same
    for the same jobs, pointers included), by (key, tuning, pairs, max_ctas, device)."""
    memo = getattr(plan.jobs, "launch_key", None)
    if memo is not None and not (plan.device.index is None and plan.device.type == "cuda"):
        key = (memo, tuning, plan.pairs, plan.max_ctas, plan.device)
        hit = _LAUNCHES.get(key)
        return _LAUNCHES.put(key, _plan_copy_launches(plan, tuning)) if hit is None else hit
    return _plan_copy_launches(plan, tuning)


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
        per = max(1, min(SLOTS, tuning.jobs_per_launch))
        for i in range(0, len(members), per):
            part = members[i:i + per]
            jobs = [plan.jobs[n] for n in part]
            total = tiles * len(part)
            assert total < 2**31, total
            grid = (_programs(plan.device, total, plan.max_ctas, tuning),)
            out.append(CopyLaunch(tuple(part), lane_dtype, grid, tiles, _offsets(jobs, w, "src"),
                                  _offsets(jobs, w, "dst"), kw))
    return tuple(out)


# The copy launches of the last few cached plans (see copy_launches).
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


def _copy_warps(tile_bytes: int, writes_host: bool, tuning: TritonTuning) -> int:
    """Warps of a copy tile: 64 bytes (four 16-B vectors) a thread, at most ``copy_warps``
    (``host_write_warps`` where the destination is pinned host memory; a smaller tile spread over
    more threads would give each less than a vector)."""
    most = tuning.host_write_warps if writes_host else tuning.copy_warps
    return max(1, min(most, tile_bytes // (32 * 64)))


def _cache_storage(side: Side, dtype: torch.dtype) -> tuple[torch.Tensor, int, tuple]:
    """(storage view as the kernel's element type, first element, strides in elements) of a
    cache side (bfloat16 as int16 bits)."""
    es = dtype.itemsize
    view = storage_view(side.tensor, torch.int16 if dtype == torch.bfloat16 else dtype)
    return view, _base(side) // es, tuple(x // es for x in side.strides)


def _launch_pages(job: PageJob, plan: TransferPlan, tuning: TritonTuning) -> None:
    fmt = _FMT[job.page_format]
    L, S, N, K, E = job.layers, job.parts, job.tokens, job.heads, job.part_elems
    pack = job.direction == "pack"
    width = E // 16 if fmt == 3 else E  # groups of 16 (nvfp4) or elements (fp8) of a part
    per = tuning.page_tile_elems // 16 if fmt == 3 else tuning.page_tile_elems
    block_e = min(next_pow2(width), per)
    block_r = max(1, min(per // block_e, next_pow2(S * N)))
    tiles = plan.pairs * K * triton.cdiv(S * N, block_r) * triton.cdiv(width, block_e)
    assert tiles < 2**31, tiles
    grid = (_programs(plan.device, tiles, plan.max_ctas, tuning),)
    pdl, trigger = _pdl(plan, grid[0], tuning)
    # A pair writes all of a chunk or nothing: the cache side's id bound is every layer's.
    cache_blocks = min(c.blocks for c in job.caches)
    pages = storage_view(job.pages.tensor, torch.uint8)
    p_sb = _used(job.pages.strides[0], job.pages.blocks)
    mapping = plan.mapping
    if fmt == 3:
        data_end = 4 * L * S + L * N * S * E // 2 + L * N * S * E // 16
    else:
        data_end = 4 * L * S + L * N * S * E
    common = dict(HB=job.chunk_bytes, K=K, L=L, S=S, N=N, E=E, FMT=fmt, BLOCK_R=block_r,
                  BLOCK_E=block_e, NCH=triton.cdiv(width, block_e), PDL=pdl, PDL_TRIGGER=trigger,
                  num_warps=tuning.page_warps, launch_pdl=pdl, enable_fp_fusion=False)
    for layer, side in enumerate(job.caches):
        cache, c_off, cs = _cache_storage(side, job.cache_dtype)
        geometry = dict(C_SB=_used(cs[0], side.blocks), C_SH=_used(cs[1], K),
                        C_ST=_used(cs[2], N), C_SC=cs[3], P_SB=p_sb)
        if pack:
            sst = job.scale_strides
            _pack_kernel[grid](
                cache, pages, job.scale, mapping, plan.pairs, tiles, mapping.stride(0),
                mapping.stride(1), cache_blocks, job.pages.blocks, layer, c_off,
                _base(job.pages), job.scale_offset, **geometry,
                SC_L=_used(sst[0], L), SC_S=_used(sst[1], S), SC_K=_used(sst[2], K),
                IN=_DT[job.cache_dtype], STEPS=2 if job.cache_dtype == torch.float32 else 1,
                ZERO_TAIL=layer == 0, DATA_END=data_end, **common)
        else:
            _unpack_kernel[grid](
                pages, cache, mapping, plan.pairs, tiles, mapping.stride(0), mapping.stride(1),
                job.pages.blocks, cache_blocks, layer, _base(job.pages), c_off, **geometry,
                OUT=_DT[job.cache_dtype], NATIVE=plan.device.type == "cuda", **common)


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
            _launch_pages(plan.page_job, plan, tuning)
