"""The CUDA implementation of cp_gather_and_upconvert_fp8_kv_cache: ``kernel.cu`` compiled at run
time with NVRTC, launched on PyTorch's current stream through :mod:`kvwrite.kernels.gather_cuda`.

Variants (template arguments): the output dtype and ALIGN, the alignment in bytes (16 at most) of
every entry and row start, which sets the width of the accesses (the stores' at least 2 bytes: the
output is 16-bit, its rows 2-byte aligned even where odd cache strides make ALIGN 1). By default
each call signature gets its own build with its fixed arguments compiled in
(``CudaTuning.specialize``).

Graph-safe: a call does no allocation and no host sync; index tensors are read on the device.
"""

from __future__ import annotations

import torch

from ...kernels import gather_cuda, launch, nvrtc
from ...kernels.gather_cuda import DT_BF16, DT_F16, OUT_KIND, TUNING, CudaTuning

__all__ = ["CudaTuning", "TUNING", "SOURCE", "KERNEL", "available", "unsupported", "run", "plan",
           "all_kernel_names", "compile_kernel", "launch_args"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_cp_gather_and_upconvert")
KERNEL = "cp_gather_and_upconvert_fp8_kv_cache_kernel"

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(src_cache, dst) -> str | None:
    """Every validated case runs (unaligned entries and rows take narrower accesses)."""
    return None


def all_kernel_names() -> list[str]:
    """Every variant `run` can launch (for compile tests)."""
    return [f"{KERNEL}<{out}, {a}>" for out in (DT_F16, DT_BF16) for a in (16, 8, 4, 2, 1)]


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed), ``fixed``: the
# 12 trailing arguments compiled in (KernelSource.compile_fixed); tests and probes.
compile_kernel = SOURCE.compile_fixed


def plan(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
         workspace_starts: torch.Tensor, seq_starts: torch.Tensor | None,
         ) -> tuple[str, tuple[int, ...]]:
    """(kernel name expression, fixed arguments) of a validated call; no GPU needed."""
    num_blocks, block_size = src_cache.shape[:2]
    cs = (src_cache.stride(0) if num_blocks > 1 else 0, src_cache.stride(1) if block_size > 1 else 0)
    drs = dst.stride(0) * 2 if dst.shape[0] > 1 else 0
    a = gather_cuda.align([src_cache.data_ptr(), *cs, dst.data_ptr(), drs])
    fixed = gather_cuda.row_fixed(workspace_starts, seq_starts, block_table, block_size,
                                  num_blocks, workspace=True) + (cs[0], cs[1], drs)
    return f"{KERNEL}<{OUT_KIND[dst.dtype]}, {a}>", fixed


def launch_args(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                workspace_starts: torch.Tensor, num_req: int, seq_starts: torch.Tensor | None, *,
                tuning: CudaTuning = TUNING) -> gather_cuda.LaunchArgs:
    """What :func:`run` launches for these arguments, without building or launching it (see
    gather_and_maybe_dequant_cache's)."""
    name, fixed = plan(src_cache, dst, block_table, workspace_starts, seq_starts)
    return gather_cuda.LaunchArgs(
        name, fixed, tuning.upconvert_rows,
        _pointers(src_cache, dst, workspace_starts, seq_starts, block_table), dst.shape[0],
        num_req, seq_starts is not None)


def _pointers(src_cache, dst, workspace_starts, seq_starts, block_table) -> tuple[int, ...]:
    return (src_cache.data_ptr(), dst.data_ptr(), workspace_starts.data_ptr(),
            0 if seq_starts is None else seq_starts.data_ptr(), block_table.data_ptr())


LAUNCHES = launch.LaunchCache()


def run(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
        workspace_starts: torch.Tensor, num_req: int, seq_starts: torch.Tensor | None, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    gather_cuda.run(LAUNCHES, None, SOURCE, tuning, gather_cuda.upconvert_round_rows, plan,
                    (src_cache, dst, block_table, workspace_starts, seq_starts),
                    _pointers(src_cache, dst, workspace_starts, seq_starts, block_table),
                    dst.shape[0], num_req, seq_starts is not None)
