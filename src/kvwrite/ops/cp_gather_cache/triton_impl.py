"""The Triton implementation of cp_gather_cache.

One program writes ``BLOCK_T`` output rows: the row rule (``kernels.triton_gather.gather_rows``),
then the entry as integers of UNIT bytes (the widest power of two up to 8 that divides the run's
bytes and every entry, row and outer-dim start) through the entry's coalesced dims
(``kvwrite.gather.entry_dims``: an inner run and up to 3 outer dims, more: :func:`unsupported`).
Both tensors are read through flat views of their storage as UNIT-byte integers, so any dtype
moves as its bits, and every offset is in units. Where the run is long (at least 16 units) or the
only dim, the kernel steps through each outer index's run ``CHUNK`` units at a time: the units of
a step are consecutive in both tensors and Triton sees it (16-byte accesses; MLA's 1152-byte
entries took 8-byte ones, one per row and thread, through the per-element form below, 3.5x
slower). Short runs under outer dims take ``CHUNK`` units of the flattened entry per step, each
unit's indices by division. Strides and geometry are compile-time constants; T_out and B are not,
and nothing is read on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from ...kernels import gather_cuda, triton_gather
from ...kernels.triton_gather import TUNING, TritonTuning, row_prologue, tl, triton
from . import cuda_impl

__all__ = ["TritonTuning", "TUNING", "available", "unsupported", "run"]


available = triton_gather.availability(lambda: _kernel)


unsupported = cuda_impl.unsupported  # at most 3 outer dims, as the CUDA kernel


if triton is not None:

    @triton.jit(do_not_specialize=["t_out", "num_req"])
    def _kernel(
        src_ptr, src_base,  # the cache's storage as UNIT-byte integers, and its first unit
        dst_ptr, dst_base,  # dst's storage as UNIT-byte integers, and its first unit
        bt_ptr, starts_ptr, ss_ptr,  # block_table, cu_seq_lens, seq_starts (or None)
        t_out, num_req,
        CBS: tl.constexpr, CPS: tl.constexpr, DRS: tl.constexpr,  # units
        RUN: tl.constexpr,  # units per run
        N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,  # outer dims, innermost first
        S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,  # their cache strides (units)
        D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,  # their dst strides (units)
        RUN_MAJOR: tl.constexpr,  # step through each run (else through the flattened entry)
        CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
        ROW: tl.constexpr,  # the row rule's constants (triton_gather.row_constants)
        PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr,
    ):
        t, ok, blk, off = row_prologue(t_out, num_req, starts_ptr, ss_ptr, bt_ptr, BLOCK_T, ROW,
                                       PDL, PDL_TRIGGER)
        src_row = src_base + blk * CBS + off * CPS
        dst_row = dst_base + t * DRS
        if RUN_MAJOR:
            for o in tl.range(0, N0 * N1 * N2):
                i0 = o % N0
                i1 = (o // N0) % N1
                i2 = o // (N0 * N1)
                so = i0 * S0 + i1 * S1 + i2 * S2
                do = i0 * D0 + i1 * D1 + i2 * D2
                for c0 in tl.range(0, RUN, CHUNK):
                    ru = c0 + tl.arange(0, CHUNK)
                    m = ok[:, None] & (ru < RUN)[None, :]
                    x = tl.load(src_ptr + (src_row + so)[:, None] + ru[None, :], mask=m)
                    tl.store(dst_ptr + (dst_row + do)[:, None] + ru[None, :], x, mask=m)
        else:
            M: tl.constexpr = RUN * N0 * N1 * N2
            for c0 in tl.range(0, M, CHUNK):
                i = c0 + tl.arange(0, CHUNK)
                ru = i % RUN
                q = i // RUN
                i0 = q % N0
                q = q // N0
                i1 = q % N1
                i2 = q // N1
                i0, i1, i2, ru = i0.to(tl.int64), i1.to(tl.int64), i2.to(tl.int64), ru.to(tl.int64)
                so = i0 * S0 + i1 * S1 + i2 * S2 + ru
                do = i0 * D0 + i1 * D1 + i2 * D2 + ru
                m = ok[:, None] & (i < M)[None, :]
                x = tl.load(src_ptr + src_row[:, None] + so[None, :], mask=m)
                tl.store(dst_ptr + dst_row[:, None] + do[None, :], x, mask=m)


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, *,
        tuning: TritonTuning = TUNING) -> None:
    """Launch on PyTorch's current stream; arguments as validated by the public op."""
    num_blocks, block_size = src_cache.shape[:2]
    num_req = cu_seq_lens.shape[0] - 1
    t_out = dst.shape[0]
    es = src_cache.element_size()
    run_elems, outer = cuda_impl.geometry(src_cache, dst)
    dims = [(n, s * es, d * es) for n, s, d in outer] + [(1, 0, 0)] * (3 - len(outer))
    src_first = src_cache.storage_offset() * es
    dst_first = dst.storage_offset() * es
    cbs = src_cache.stride(0) * es if num_blocks > 1 else 0
    cps = src_cache.stride(1) * es if block_size > 1 else 0
    drs = dst.stride(0) * es if t_out > 1 else 0
    unit = min(8, gather_cuda.align([run_elems * es, src_first, dst_first, cbs, cps, drs,
                                     *(d[1] for d in dims), *(d[2] for d in dims)]))
    src, src_base = triton_gather.byte_storage(src_cache, unit)
    out, dst_base = triton_gather.byte_storage(dst, unit)
    run_units = run_elems * es // unit
    u = [(n, s // unit, d // unit) for n, s, d in dims]
    run_major = len(outer) == 0 or run_units >= 16
    # Run-major: steps of at most 128 bytes of a run (16-byte accesses, 32 rows a program: 4 KiB
    # a step, as gather_and_maybe_dequant_cache's copies).
    chunk = (max(1, triton_gather.chunk_width(run_units * unit) // unit) if run_major
             else triton_gather.chunk_width(run_units * u[0][0] * u[1][0] * u[2][0]))
    triton_gather.launch_rows(
        _kernel, dst.device, t_out,
        (src, src_base, out, dst_base, block_table, cu_seq_lens, seq_starts, t_out, num_req),
        cu_seq_lens, seq_starts, block_table, block_size, num_blocks, num_req, tuning,
        CBS=cbs // unit, CPS=cps // unit, DRS=drs // unit, RUN=run_units,
        N0=u[0][0], N1=u[1][0], N2=u[2][0], S0=u[0][1], S1=u[1][1], S2=u[2][1],
        D0=u[0][2], D1=u[1][2], D2=u[2][2], RUN_MAJOR=run_major, CHUNK=chunk,
    )
