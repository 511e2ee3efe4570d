"""The CUDA implementation of cp_gather_cache: ``kernel.cu`` (kvwrite's entry gather,
``kvw/gather_entry.cuh``, as a byte copy) compiled at run time with NVRTC, launched on PyTorch's
current stream through :mod:`kvwrite.kernels.gather_cuda`.

The entry's dims are coalesced (``kvwrite.gather.entry_dims``) into an inner run contiguous in the
cache and in ``dst`` and up to 3 outer dims (more: :func:`unsupported` says so, and the torch
implementation runs); every row moves as chunks of VB bytes, the widest power of two up to 16 that
divides the run's bytes and every entry, row and outer-dim start. By default each call signature
gets its own build with its fixed arguments compiled in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; index tensors are read on the device.
"""

from __future__ import annotations

import torch

from ...gather import entry_dims
from ...kernels import gather_cuda, launch, nvrtc
from ...kernels.gather_cuda import DT_COPY, TUNING, CudaTuning, entry_kernel_name

__all__ = ["CudaTuning", "TUNING", "SOURCE", "KERNEL", "available", "unsupported", "run", "plan",
           "all_kernel_names", "compile_kernel", "geometry", "launch_args"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_cp_gather_cache")
KERNEL = "cp_gather_cache_kernel"

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def geometry(src_cache: torch.Tensor, dst: torch.Tensor) -> tuple[int, list]:
    """(run elements, outer dims ``(n, src_stride, dst_stride)`` in elements) of the entry."""
    return entry_dims(src_cache.shape[2:], src_cache.stride()[2:], dst.stride()[1:])


def unsupported(src_cache, dst) -> str | None:
    """Entries whose dims coalesce to more than 3 outer dims around the contiguous run."""
    _, outer = geometry(src_cache, dst)
    if len(outer) > 3:
        return (f"the entry's dims {tuple(src_cache.shape[2:])} with src strides "
                f"{tuple(src_cache.stride()[2:])} and dst strides {tuple(dst.stride()[1:])} "
                f"coalesce to {len(outer)} strided dims; the kernel takes at most 3")
    return None


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    return [entry_kernel_name(KERNEL, DT_COPY, 0, vb, nd) for nd in range(4)
            for vb in (16, 8, 4, 2, 1)]


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 29 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def plan(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
         cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None) -> tuple[str, tuple[int, ...]]:
    """(kernel name expression, fixed arguments) of a validated, supported call; no GPU needed."""
    num_blocks, block_size = src_cache.shape[:2]
    es = src_cache.element_size()
    run, outer = geometry(src_cache, dst)
    cs = (src_cache.stride(0) * es if num_blocks > 1 else 0,
          src_cache.stride(1) * es if block_size > 1 else 0)
    drs = dst.stride(0) * es if dst.shape[0] > 1 else 0
    dims = [(n, s * es, d * es, 0) for n, s, d in outer]
    ep = gather_cuda.entry_plan(
        conv=DT_COPY, out_dtype=None, in_es=es, run=run, outer=dims, cache_strides=cs,
        dst_row_strides=(drs, 0), num_tensors=1, per_head=0,
        src_align=gather_cuda.align([src_cache.data_ptr(), *cs, *(d[1] for d in dims)]),
        dst_align=gather_cuda.align([dst.data_ptr(), drs, *(d[2] for d in dims)]))
    fixed = gather_cuda.row_fixed(cu_seq_lens, seq_starts, block_table, block_size,
                                  num_blocks) + ep.fixed
    return ep.name(KERNEL), fixed


def launch_args(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, *,
                tuning: CudaTuning = TUNING) -> gather_cuda.LaunchArgs:
    """What :func:`run` launches for these arguments, without building or launching it (see
    gather_and_maybe_dequant_cache's)."""
    name, fixed = plan(src_cache, dst, block_table, cu_seq_lens, seq_starts)
    return gather_cuda.LaunchArgs(
        name, fixed, gather_cuda.entry_round_rows(fixed, tuning),
        _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table), dst.shape[0],
        cu_seq_lens.shape[0] - 1, seq_starts is not None)


def _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table) -> tuple[int, ...]:
    return (src_cache.data_ptr(), 0, dst.data_ptr(), 0, 0, 0, cu_seq_lens.data_ptr(),
            0 if seq_starts is None else seq_starts.data_ptr(), block_table.data_ptr())


LAUNCHES = launch.LaunchCache()


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    gather_cuda.run(LAUNCHES, None, SOURCE, tuning, gather_cuda.entry_round_rows, plan,
                    (src_cache, dst, block_table, cu_seq_lens, seq_starts),
                    _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table),
                    dst.shape[0], cu_seq_lens.shape[0] - 1, seq_starts is not None)
