"""The CUDA implementation of gather_cache_flash: ``kernel.cu`` (kvwrite's entry gather,
``kvw/gather_entry.cuh``, over two tensors) compiled at run time with NVRTC, launched on PyTorch's
current stream through :mod:`kvwrite.kernels.gather_cuda`.

Variants (template arguments): the conversion (a copy of the bits, or fp8 codes dequantized: e4m3
or e5m2 is a fixed argument), the output kind, and the chunk: the widest (16 bytes for copies, 8 codes for fp8) that divides the
head size and that every head and row start of both caches and both outputs is aligned to.
Per-head scales are read per chunk, per-tensor ones once per thread. By default each call
signature gets its own build with its fixed arguments compiled in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; index tensors and scales are read on the
device.
"""

from __future__ import annotations

import torch

from ...dtypes import CacheDType, scale_is_per_head
from ...kernels import gather_cuda, launch, nvrtc
from ...kernels.gather_cuda import DT_COPY, DT_E4M3, DT_E5M2, TUNING, CudaTuning

__all__ = ["CudaTuning", "TUNING", "SOURCE", "KERNEL", "available", "unsupported", "run", "plan",
           "all_kernel_names", "compile_kernel", "launch_args"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_gather_cache_flash")
KERNEL = "gather_cache_flash_kernel"
NDIM = 1  # outer dim 0: the heads (one of them where H == 1)
_CONV = {CacheDType.FP8_E4M3: DT_E4M3, CacheDType.FP8_E5M2: DT_E5M2}

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(key_cache, key_out, cache_dtype) -> str | None:
    """Every validated case runs (any strides and alignments)."""
    return None


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    return gather_cuda.entry_kernel_names(KERNEL, NDIM)


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 29 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def plan(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
         value_out: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
         seq_starts: torch.Tensor | None, cache_dtype: CacheDType, k_scale, v_scale,
         ) -> tuple[str, tuple[int, ...]]:
    """(kernel name expression, fixed arguments) of a validated call; no GPU needed."""
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    ies, oes = key_cache.element_size(), key_out.element_size()
    cs = (key_cache.stride(0) * ies if num_blocks > 1 else 0,
          key_cache.stride(1) * ies if block_size > 1 else 0)
    outer = [(1, 0, 0, 0)]
    if num_heads > 1:
        outer = [(num_heads, key_cache.stride(2) * ies, key_out.stride(1) * oes,
                  value_out.stride(1) * oes)]
    rows = key_out.shape[0] > 1
    drs = (key_out.stride(0) * oes if rows else 0, value_out.stride(0) * oes if rows else 0)
    fp8 = cache_dtype.is_fp8
    per_head = 0
    if fp8:
        per_head = int(scale_is_per_head(k_scale)) | (int(scale_is_per_head(v_scale)) << 1)
    ep = gather_cuda.entry_plan(
        conv=_CONV[cache_dtype] if fp8 else DT_COPY, out_dtype=key_out.dtype if fp8 else None,
        in_es=ies, run=head_size, outer=outer, cache_strides=cs, dst_row_strides=drs,
        num_tensors=2, per_head=per_head,
        src_align=gather_cuda.align([key_cache.data_ptr(), value_cache.data_ptr(), *cs,
                                     *(d[1] for d in outer)]),
        dst_align=gather_cuda.align([key_out.data_ptr(), value_out.data_ptr(), *drs,
                                     *(d[2] for d in outer), *(d[3] for d in outer)]))
    fixed = gather_cuda.row_fixed(cu_seq_lens, seq_starts, block_table, block_size,
                                  num_blocks) + ep.fixed
    return ep.name(KERNEL), fixed


def launch_args(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
                value_out: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                seq_starts: torch.Tensor | None, cache_dtype: CacheDType,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, *,
                tuning: CudaTuning = TUNING) -> gather_cuda.LaunchArgs:
    """What :func:`run` launches for these arguments, without building or launching it (see
    gather_and_maybe_dequant_cache's)."""
    name, fixed = plan(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens,
                       seq_starts, cache_dtype, k_scale, v_scale)
    return gather_cuda.LaunchArgs(
        name, fixed, gather_cuda.entry_round_rows(fixed, tuning),
        _pointers(key_cache, value_cache, key_out, value_out, cu_seq_lens, seq_starts,
                  block_table, k_scale, v_scale),
        key_out.shape[0], cu_seq_lens.shape[0] - 1, seq_starts is not None)


def _pointers(key_cache, value_cache, key_out, value_out, cu_seq_lens, seq_starts, block_table,
              k_scale, v_scale) -> tuple[int, ...]:
    return (key_cache.data_ptr(), value_cache.data_ptr(), key_out.data_ptr(),
            value_out.data_ptr(), 0 if k_scale is None else k_scale.data_ptr(),
            0 if v_scale is None else v_scale.data_ptr(), cu_seq_lens.data_ptr(),
            0 if seq_starts is None else seq_starts.data_ptr(), block_table.data_ptr())


LAUNCHES = launch.LaunchCache()


def run(key_cache: torch.Tensor, value_cache: torch.Tensor, key_out: torch.Tensor,
        value_out: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
        seq_starts: torch.Tensor | None, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    sig = (gather_cuda.signature(key_cache, value_cache, key_out, value_out, block_table,
                                 cu_seq_lens, seq_starts, k_scale, v_scale),
           cache_dtype, key_cache.get_device(), tuning)
    gather_cuda.run(LAUNCHES, sig, SOURCE, tuning, gather_cuda.entry_round_rows, plan,
                    (key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens,
                     seq_starts, cache_dtype, k_scale, v_scale),
                    _pointers(key_cache, value_cache, key_out, value_out, cu_seq_lens, seq_starts,
                              block_table, k_scale, v_scale),
                    key_out.shape[0], cu_seq_lens.shape[0] - 1, seq_starts is not None)
