"""What the five gathers' CUDA launchers share (kernels in ``ops/<op>/kernel.cu`` over
``kvw/gather.cuh``): the row rule's fixed arguments, the launch shape (rows per warp, CTAs,
dynamic shared memory), the widest aligned chunk, the entry geometry of the entry kernel
(``kvw/gather_entry.cuh``), and building and launching a variant.

A call does no allocation and no host sync: every index tensor is read on the device, so a
captured CUDA graph sees new block tables, sequence lengths and starts.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import nvrtc
from .launch import (
    DT_BF16,
    DT_COPY,
    DT_E4M3,
    DT_E5M2,
    DT_F16,
    DT_F32,
    KIND,
    Launchable,
    LaunchCache,
    PdlPolicy,
    align,
    log2_or_minus_1,
    require_setup,
)

__all__ = ["THREADS", "SMEM_ROWS", "CudaTuning", "TUNING", "row_fixed", "uses_smem",
           "rows_per_warp", "align", "EntryPlan", "entry_plan", "Launchable", "build", "launch",
           "DT_F16", "DT_BF16", "DT_F32", "DT_E4M3", "DT_E5M2", "DT_COPY", "OUT_KIND",
           "ENTRY_FIXED", "ROW_FIXED", "signature", "entry_kernel_name", "entry_kernel_names",
           "ENTRY_UNROLL", "UPCONVERT_ROWS", "INDEXER_UNROLL", "entry_round_rows",
           "indexer_round_rows", "tuning_macros", "launch_shape", "WARP_REQS", "LaunchArgs", "run",
           "upconvert_round_rows"]

# kvw/gather.cuh's KVW_GATHER_THREADS and KVW_GATHER_SMEM_ROWS.
THREADS = 128
WARPS = THREADS // 32
SMEM_ROWS = 2048
ROW_FIXED = 9     # KVW_GATHER_ROW_FIXED
WARP_REQS = 31    # KVW_GATHER_WARP_REQS: larger batches share their starts through the CTA
ENTRY_FIXED = 20  # KVW_ENTRY_FIXED
# The kernels' round sizes when no macro overrides them: kvw/gather_entry.cuh's
# KVW_ENTRY_UNROLL (chunks per lane), the upconvert kernel's KVW_UPCONVERT_ROWS (rows per warp),
# the indexer kernel's KVW_INDEXER_CODE_UNROLL and KVW_INDEXER_SCALE_UNROLL (chunks per lane).
ENTRY_UNROLL = 9
UPCONVERT_ROWS = 4
INDEXER_UNROLL = (8, 1)

# Element kinds, as DT_* in kvw/common.cuh.
OUT_KIND = KIND  # the output dtypes of the dequantizing gathers

# kvw/gather.cuh's flags.
_STARTS64, _SS64, _BT64, _HAS_SS, _WS = 1, 2, 4, 8, 16


# eq=False: hashed and compared by identity, so a call's cache lookups hash no fields.
@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(PdlPolicy):
    """The launch constants of every gather kernel. ``TUNING`` is what every call uses unless a
    caller passes another one (tests forcing a path)."""

    # Rows per warp: the rows one round of the kernel covers (each lane issues all its loads,
    # then stores: gather_cuda.entry_round_rows and the like), times at most max_rounds, and for
    # small calls fewer: a power of two from 1 to max_rows_per_warp, the largest that still gives
    # ctas_per_sm CTAs per SM (small calls spread one row per warp over the whole GPU). One round
    # per warp makes large calls many short CTAs: the GPU starts the next ones as others finish,
    # so one CTA's index loads overlap other CTAs' rows, and no warp waits for memory twice.
    max_rows_per_warp: int = 32
    ctas_per_sm: int = 4
    max_rounds: int = 1
    # The round sizes (compiled in: a build per value; the defaults are the kernels' own, see
    # ENTRY_UNROLL, UPCONVERT_ROWS, INDEXER_UNROLL).
    entry_unroll: int = ENTRY_UNROLL
    upconvert_rows: int = UPCONVERT_ROWS
    indexer_unroll: tuple[int, int] = INDEXER_UNROLL
    # Batches of at most SMEM_ROWS - 1 requests keep their starts in shared memory (one round
    # trip per CTA); larger ones binary-search global memory. Tests set 0 to force that path.
    smem_rows: int = SMEM_ROWS
    # One build per call signature with the fixed arguments compiled in (NVRTC once per signature
    # and process). KVWRITE_CUDA_SPECIALIZE=0 builds one generic kernel per variant.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)


TUNING = CudaTuning()


def _dim_stride(t: torch.Tensor, d: int) -> int:
    """Stride of dim ``d``, 0 where that dim has one element (never multiplies a nonzero index:
    one compiled variant whatever it is)."""
    return t.stride(d) if t.shape[d] > 1 else 0


def row_fixed(starts: torch.Tensor, seq_starts: torch.Tensor | None, block_table: torch.Tensor,
              block_size: int, num_blocks: int, workspace: bool = False) -> tuple[int, ...]:
    """The row rule's 9 fixed kernel arguments (kvw/gather.cuh's KVW_GATHER_ROW_PARAMS)."""
    flags = ((_STARTS64 if starts.dtype == torch.int64 else 0)
             | (_BT64 if block_table.dtype == torch.int64 else 0) | (_WS if workspace else 0))
    ss_stride = 0
    if seq_starts is not None:
        flags |= _HAS_SS | (_SS64 if seq_starts.dtype == torch.int64 else 0)
        ss_stride = _dim_stride(seq_starts, 0)
    return (_dim_stride(starts, 0), ss_stride, _dim_stride(block_table, 0),
            _dim_stride(block_table, 1), block_table.shape[1], block_size,
            log2_or_minus_1(block_size), num_blocks, flags)


def uses_smem(num_req: int, tuning: CudaTuning = TUNING) -> bool:
    """Whether a batch of ``num_req`` requests keeps its starts in shared memory."""
    return num_req + 1 <= min(tuning.smem_rows, SMEM_ROWS)


def rows_per_warp(t_out: int, sm_count: int, round_rows: int = 32,
                  tuning: CudaTuning = TUNING) -> int:
    """Rows per warp of a call writing ``t_out`` rows whose kernel covers ``round_rows`` rows per
    warp in one round (see CudaTuning; ``ctas_per_sm`` 0: ``max_rows_per_warp`` before the round
    cap). At most 32: lane j locates row j."""
    target = WARPS * tuning.ctas_per_sm * max(1, sm_count)
    per_warp = t_out // target if target else tuning.max_rows_per_warp
    rpw = 1
    while rpw * 2 <= min(per_warp, tuning.max_rows_per_warp, 32):
        rpw *= 2
    return max(1, min(rpw, round_rows * max(1, tuning.max_rounds), 32))


def entry_round_rows(fixed: tuple[int, ...], tuning: CudaTuning = TUNING) -> int:
    """Rows of one round of the entry kernel (kvw/gather_entry.cuh) for its fixed arguments: as
    many whole rows as 32 lanes of ``entry_unroll`` chunks hold (at least 1, at most 32)."""
    cpr = fixed[ROW_FIXED + 16] * fixed[ROW_FIXED + 17]  # tensor_chunks * num_tensors
    return max(1, min(32, 32 * tuning.entry_unroll // max(1, cpr)))


def indexer_round_rows(fixed: tuple[int, ...], tuning: CudaTuning = TUNING) -> int:
    """Rows of one round of the indexer kernel: its code and scale chunks both fit the lanes'
    ``indexer_unroll`` chunks (at least 1, at most 32)."""
    kc, sc = fixed[ROW_FIXED + 9], fixed[ROW_FIXED + 10]
    uk, us = tuning.indexer_unroll
    return max(1, min(32, 32 * uk // max(1, kc), 32 * us // max(1, sc)))


def tuning_macros(tuning: CudaTuning) -> tuple:
    """The macros of a build with ``tuning``'s round sizes (none for the kernels' defaults, so
    that those builds are the kernels' own)."""
    out = []
    if tuning.entry_unroll != ENTRY_UNROLL:
        out.append(("KVW_ENTRY_UNROLL", str(tuning.entry_unroll)))
    if tuning.upconvert_rows != UPCONVERT_ROWS:
        out.append(("KVW_UPCONVERT_ROWS", str(tuning.upconvert_rows)))
    if tuning.indexer_unroll[0] != INDEXER_UNROLL[0]:
        out.append(("KVW_INDEXER_CODE_UNROLL", str(tuning.indexer_unroll[0])))
    if tuning.indexer_unroll[1] != INDEXER_UNROLL[1]:
        out.append(("KVW_INDEXER_SCALE_UNROLL", str(tuning.indexer_unroll[1])))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class EntryPlan:
    """A call of the entry kernel (kvw/gather_entry.cuh): its variant and its 20 entry arguments."""

    conv: int   # DT_COPY, or DT_E4M3 for fp8 codes (either format: a fixed argument says which)
    out: int    # DT_F16/DT_BF16/DT_F32 (dequantization), 0 for copies
    vb: int     # input bytes per chunk
    ndim: int   # outer dims decomposed
    fixed: tuple[int, ...]

    def name(self, kernel: str) -> str:
        return entry_kernel_name(kernel, self.conv, self.out, self.vb, self.ndim)


def entry_kernel_name(kernel: str, conv: int, out: int, vb: int, ndim: int) -> str:
    """The name expression of an entry-kernel variant."""
    return f"{kernel}<{conv}, {out}, {vb}, {ndim}>"


def entry_kernel_names(kernel: str, ndim: int) -> list[str]:
    """Every variant of an entry kernel with ``ndim`` outer dims that copies (every chunk width)
    or dequantizes fp8 codes (e4m3 or e5m2: a fixed argument) to each output dtype."""
    names = [entry_kernel_name(kernel, DT_COPY, 0, vb, ndim) for vb in (16, 8, 4, 2, 1)]
    for out in (0, 1, 2):
        names += [entry_kernel_name(kernel, DT_E4M3, out, vb, ndim) for vb in (8, 4, 2, 1)]
    return names


def entry_plan(*, conv: int, out_dtype: torch.dtype | None, in_es: int, run: int,
               outer: list[tuple[int, int, int, int]], cache_strides: tuple[int, int],
               dst_row_strides: tuple[int, int], num_tensors: int, per_head: int,
               src_align: int, dst_align: int) -> EntryPlan:
    """The entry kernel's plan (``conv``: DT_COPY, DT_E4M3 or DT_E5M2). ``run``: elements of the inner run (contiguous in cache and
    output); ``outer``: up to 3 outer dims ``(n, src_stride, dst0_stride, dst1_stride)`` in bytes,
    innermost first; ``cache_strides``: (block, offset) in bytes; ``per_head``: bit k set where
    tensor k's scale is per head (indexed by outer dim 0); ``src_align``/``dst_align``: the
    alignment of every entry and row start (pointers and strides)."""
    if len(outer) > 3:
        raise ValueError(f"at most 3 outer entry dims, got {len(outer)}")
    ndim = len(outer)
    outer = list(outer) + [(1, 0, 0, 0)] * (3 - len(outer))
    if conv == DT_COPY:
        run_bytes = run * in_es
        vb = align([run_bytes, src_align, dst_align])
        out, ob = 0, vb
        run_chunks = run_bytes // vb
    else:
        oe = out_dtype.itemsize
        out = OUT_KIND[out_dtype]
        vb = 8
        while vb > 1 and not (run % vb == 0 and src_align % vb == 0
                              and dst_align % min(vb * oe, 16) == 0):
            vb //= 2
        ob = vb * oe
        run_chunks = run // vb
    del ob
    n = [d[0] for d in outer]
    tensor_chunks = run_chunks * n[0] * n[1] * n[2]
    fixed = (cache_strides[0], cache_strides[1], dst_row_strides[0], dst_row_strides[1],
             run_chunks, n[0], n[1], outer[0][1], outer[1][1], outer[2][1],
             outer[0][2], outer[1][2], outer[2][2], outer[0][3], outer[1][3], outer[2][3],
             tensor_chunks, num_tensors, per_head, int(conv == DT_E5M2))
    return EntryPlan(DT_E4M3 if conv == DT_E5M2 else conv, out, vb, ndim, fixed)


def build(source: nvrtc.KernelSource, name: str, fixed: tuple[int, ...], index: int,
          tuning: CudaTuning, macros: tuple = (), round_rows: int = 32) -> Launchable:
    """Load (compile or read from the kernel cache) variant ``name`` for device ``index``: the
    specialized build with ``fixed`` compiled in where ``tuning.specialize``, and its PDL twin;
    ``tuning``'s round sizes as macros (:func:`tuning_macros`). The launchable's ``plan`` is
    ``name``, its ``bounds`` (SM count, rows of one round per warp: rows_per_warp's cap)."""
    require_setup()
    macros = tuple(macros) + tuning_macros(tuning)
    if tuning.specialize:
        macros = macros + nvrtc.fixed_args_macros(fixed)
    kernel, pdl_kernel = nvrtc.load_kernels(source, name, macros, index)
    sms = nvrtc.device_arch(index)[1]
    return Launchable(kernel, pdl_kernel, index, tuple(fixed), name, (sms, round_rows))


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    """What a cuda implementation launches for one call: the kernel variant, its fixed arguments,
    the rows of one round per warp, the leading pointer arguments and the per-call scalars
    (:func:`launch_shape` gives the rest)."""

    name: str
    fixed: tuple[int, ...]
    round_rows: int
    pointers: tuple[int, ...]
    t_out: int
    num_req: int
    has_seq_starts: bool


@functools.cache
def _config(grid: int, shmem: int, pdl: bool):
    extra = {"programmatic_stream_serialization": True} if pdl else {}
    return nvrtc.cuda_core().LaunchConfig(grid=(grid, 1, 1), block=(THREADS, 1, 1),
                                          shmem_size=shmem, **extra)


def launch_shape(t_out: int, num_req: int, has_seq_starts: bool, sm_count: int,
                 round_rows: int, tuning: CudaTuning = TUNING) -> tuple[int, int, int, int]:
    """(CTAs, dynamic shared memory bytes, shared-memory rows, rows per warp) of a call."""
    rpw = rows_per_warp(t_out, sm_count, round_rows, tuning)
    grid = -(-t_out // (WARPS * rpw))
    # Batches of at most WARP_REQS requests keep their starts in registers (gather_rule_warp).
    smem_rows = num_req + 1 if num_req > WARP_REQS and uses_smem(num_req, tuning) else 0
    shmem = 8 * (smem_rows + (num_req if has_seq_starts and smem_rows else 0))
    return grid, shmem, smem_rows, rpw


def launch(lau: Launchable, tuning: CudaTuning, pointers: tuple[int, ...], t_out: int,
           num_req: int, has_seq_starts: bool) -> None:
    """Launch a gather kernel on PyTorch's current stream: ``pointers`` (the kernel's leading
    pointer arguments), then T_out, B, the shared-memory rows, the rows per warp and the fixed
    arguments."""
    grid, shmem, smem_rows, rpw = launch_shape(t_out, num_req, has_seq_starts, *lau.bounds,
                                               tuning)
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    nvrtc.launch(lau.device_index, _config(grid, shmem, pdl), kernel, *pointers, t_out, num_req,
                 smem_rows, rpw, *lau.fixed)


def upconvert_round_rows(fixed: tuple[int, ...], tuning: CudaTuning = TUNING) -> int:
    """Rows of one round of the upconvert kernel: ``tuning.upconvert_rows`` whatever the call."""
    return tuning.upconvert_rows


def run(cache: LaunchCache, sig: tuple | None, source: nvrtc.KernelSource, tuning: CudaTuning,
        round_rows, plan, plan_args: tuple, pointers: tuple[int, ...], t_out: int, num_req: int,
        has_seq_starts: bool) -> None:
    """A gather's call: its launchable ``cache[sig]`` (on a miss: ``plan(*plan_args)`` gives the
    variant's name and fixed arguments, ``round_rows(fixed, tuning)`` the rows of one round per
    warp, built for the device of ``plan_args[0]``), then :func:`launch`. ``sig`` None: the
    :func:`signature` of ``plan_args`` (all tensors or None), their device and ``tuning``."""
    if sig is None:
        sig = (signature(*plan_args), plan_args[0].get_device(), tuning)
    lau = cache.get(sig)
    if lau is None:
        name, fixed = plan(*plan_args)
        lau = cache[sig] = build(source, name, fixed, plan_args[0].get_device(), tuning,
                                 round_rows=round_rows(fixed, tuning))
    launch(lau, tuning, pointers, t_out, num_req, has_seq_starts)


def signature(*tensors) -> tuple:
    """What of these tensors selects a variant or a fixed argument: dtype, shape, strides and the
    alignment of the first byte (None for an absent tensor)."""
    return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() & 15)
                 for t in tensors)
