"""The CUDA implementation of gather_and_maybe_dequant_cache: ``kernel.cu`` (kvwrite's entry
gather, ``kvw/gather_entry.cuh``) compiled at run time with NVRTC, launched on PyTorch's current
stream through :mod:`kvwrite.kernels.gather_cuda`.

Variants (template arguments): the conversion (a copy of the bits, or fp8 codes dequantized: e4m3
or e5m2 is a fixed argument), the output kind, and the chunk: the widest (16 bytes for copies, 8
codes for fp8) that divides the entry and that every entry and row start is aligned to. By default each call signature gets
its own build with the row rule's and the geometry's fixed arguments compiled in
(``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; index tensors and the scale are read on
the device.
"""

from __future__ import annotations

import torch

from ...kernels import gather_cuda, launch, nvrtc
from ...kernels.gather_cuda import DT_COPY, DT_E4M3, DT_E5M2, TUNING, CudaTuning
from ..concat_and_cache_mla.op import MlaMode

__all__ = ["CudaTuning", "TUNING", "SOURCE", "KERNEL", "available", "unsupported", "run", "plan",
           "all_kernel_names", "compile_kernel", "launch_args"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_gather_and_maybe_dequant_cache")
KERNEL = "gather_and_maybe_dequant_cache_kernel"
NDIM = 0  # the entry is one run: no outer dims
_CONV = {MlaMode.AUTO: DT_COPY, MlaMode.FP8_E4M3: DT_E4M3, MlaMode.FP8_E5M2: DT_E5M2}

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(src_cache, dst, mode) -> str | None:
    """Every validated case runs (any strides and alignments: narrower chunks where rows are not
    16-byte aligned)."""
    return None


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    return gather_cuda.entry_kernel_names(KERNEL, NDIM)


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 29 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def plan(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
         cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None,
         mode: MlaMode) -> tuple[str, tuple[int, ...]]:
    """(kernel name expression, fixed arguments) of a validated call; no GPU needed."""
    num_blocks, block_size, entry = src_cache.shape
    es = src_cache.element_size()
    cs = (src_cache.stride(0) * es if num_blocks > 1 else 0,
          src_cache.stride(1) * es if block_size > 1 else 0)
    drs = dst.stride(0) * dst.element_size() if dst.shape[0] > 1 else 0
    ep = gather_cuda.entry_plan(
        conv=_CONV[mode], out_dtype=None if mode is MlaMode.AUTO else dst.dtype, in_es=es,
        run=entry, outer=[], cache_strides=cs, dst_row_strides=(drs, 0), num_tensors=1,
        per_head=0, src_align=gather_cuda.align([src_cache.data_ptr(), *cs]),
        dst_align=gather_cuda.align([dst.data_ptr(), drs]))
    fixed = gather_cuda.row_fixed(cu_seq_lens, seq_starts, block_table, block_size,
                                  num_blocks) + ep.fixed
    return ep.name(KERNEL), fixed


def launch_args(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, num_tokens: int,
                mode: MlaMode, scale: torch.Tensor | None, *,
                tuning: CudaTuning = TUNING) -> gather_cuda.LaunchArgs:
    """What :func:`run` launches for these arguments (its kernel, fixed arguments, round rows,
    pointers and per-call scalars), without building or launching it: for tests that run the
    kernel's code elsewhere (tests/test_gather_emu.py)."""
    name, fixed = plan(src_cache, dst, block_table, cu_seq_lens, seq_starts, mode)
    return gather_cuda.LaunchArgs(
        name, fixed, gather_cuda.entry_round_rows(fixed, tuning),
        _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table, scale), num_tokens,
        cu_seq_lens.shape[0] - 1, seq_starts is not None)


def _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table, scale) -> tuple[int, ...]:
    return (src_cache.data_ptr(), 0, dst.data_ptr(), 0, 0 if scale is None else scale.data_ptr(),
            0, cu_seq_lens.data_ptr(), 0 if seq_starts is None else seq_starts.data_ptr(),
            block_table.data_ptr())


LAUNCHES = launch.LaunchCache()


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, num_tokens: int,
        mode: MlaMode, scale: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    sig = (gather_cuda.signature(src_cache, dst, block_table, cu_seq_lens, seq_starts), mode,
           src_cache.get_device(), tuning)
    gather_cuda.run(LAUNCHES, sig, SOURCE, tuning, gather_cuda.entry_round_rows, plan,
                    (src_cache, dst, block_table, cu_seq_lens, seq_starts, mode),
                    _pointers(src_cache, dst, cu_seq_lens, seq_starts, block_table, scale),
                    num_tokens, cu_seq_lens.shape[0] - 1, seq_starts is not None)
