"""The CUDA implementation of cp_gather_indexer_k_quant_cache: ``kernel.cu`` compiled at run time
with NVRTC, launched on PyTorch's current stream through :mod:`kvwrite.kernels.gather_cuda`.

Variants (template arguments): VK and VS, the bytes per chunk of the codes and of the scales: the
widest power of two (16 at most for the codes, 4 for the scales) that divides the part and every
page, row and output start; one byte for dst_k with a non-unit last stride, at most one element
of dst_scale's where its last stride is not 1. By default each call signature gets its own build
with its fixed arguments compiled in (``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; index tensors are read on the device.
"""

from __future__ import annotations

import torch

from ...kernels import gather_cuda, launch, nvrtc
from ...kernels.gather_cuda import TUNING, CudaTuning

__all__ = ["CudaTuning", "TUNING", "SOURCE", "KERNEL", "available", "unsupported", "run", "plan",
           "all_kernel_names", "compile_kernel", "launch_args"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_cp_gather_indexer_k_quant_cache")
KERNEL = "cp_gather_indexer_k_quant_cache_kernel"
_WIDTHS = (16, 8, 4, 2, 1)
_SCALE_WIDTHS = (4, 2, 1)

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(kv_cache, dst_k, dst_scale) -> str | None:
    """Every validated case runs (any output strides and alignments)."""
    return None


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    return [f"{KERNEL}<{vk}, {vs}>" for vk in _WIDTHS for vs in _SCALE_WIDTHS]


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 20 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def plan(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
         block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """(kernel name expression, fixed arguments) of a validated call; no GPU needed."""
    num_blocks, block_size, width = kv_cache.shape
    t_out, head_dim = dst_k.shape
    scale_bytes = width - head_dim
    cbs = kv_cache.stride(0) if num_blocks > 1 else 0
    rows = t_out > 1
    base = kv_cache.data_ptr()
    # Codes: page + o * D + k * VK.
    krs = dst_k.stride(0) if rows else 0
    if head_dim == 1 or dst_k.stride(1) == 1:
        vk = gather_cuda.align([base, cbs, head_dim, dst_k.data_ptr(), krs])
        kcs = vk
    else:
        vk, kcs = 1, dst_k.stride(1)
    # Scales: page + bs * D + o * 4G + k * VS, into elements of `unit` bytes `sus` apart.
    unit = dst_scale.element_size()
    srs = dst_scale.stride(0) * unit if rows else 0
    contiguous = dst_scale.shape[1] == 1 or dst_scale.stride(1) == 1
    sus = unit if contiguous else dst_scale.stride(1) * unit
    # A contiguous dst_scale's elements are consecutive bytes: a chunk may span several (its
    # element stride says nothing of the chunk's alignment).
    vs = min(4 if contiguous else unit, gather_cuda.align(
        [base, cbs, block_size * head_dim, scale_bytes, dst_scale.data_ptr(), srs]
        + ([] if contiguous else [sus])))
    fixed = gather_cuda.row_fixed(cu_seq_lens, None, block_table, block_size, num_blocks) + (
        cbs, head_dim, scale_bytes, block_size * head_dim, krs, kcs, srs, unit.bit_length() - 1,
        sus, head_dim // vk, scale_bytes // vs)
    return f"{KERNEL}<{vk}, {vs}>", fixed


def launch_args(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                block_table: torch.Tensor, cu_seq_lens: torch.Tensor, *,
                tuning: CudaTuning = TUNING) -> gather_cuda.LaunchArgs:
    """What :func:`run` launches for these arguments, without building or launching it (see
    gather_and_maybe_dequant_cache's)."""
    name, fixed = plan(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    return gather_cuda.LaunchArgs(
        name, fixed, gather_cuda.indexer_round_rows(fixed, tuning),
        _pointers(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens), dst_k.shape[0],
        block_table.shape[0], False)


def _pointers(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> tuple[int, ...]:
    return (kv_cache.data_ptr(), dst_k.data_ptr(), dst_scale.data_ptr(), cu_seq_lens.data_ptr(),
            block_table.data_ptr())


LAUNCHES = launch.LaunchCache()


def run(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
        block_table: torch.Tensor, cu_seq_lens: torch.Tensor, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    args = (kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    gather_cuda.run(LAUNCHES, None, SOURCE, tuning, gather_cuda.indexer_round_rows, plan, args,
                    _pointers(*args), dst_k.shape[0], block_table.shape[0], False)
