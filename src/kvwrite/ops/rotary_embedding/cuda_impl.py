"""The CUDA implementation of rotary_embedding: ``kernel.cu`` compiled at run time with NVRTC
(kvwrite.kernels.nvrtc); the rotation lives in ``kvw/rope.cuh``, shared with the fused op.

Variants (template arguments): row dtype IN, table dtype CS, unit width W (elements per access),
pairing (neox or GPT-J), position index type, and LINEAR, the large-call grid (``CudaTuning``).
W is the widest of ``16 / element size`` down to 1 whose accesses are all aligned: W divides
rot_dim/2 (neox) or rot_dim with W even (GPT-J), and head_size - rot_dim; data pointers, token
strides and head strides (of tensors with more than one head: padded heads, docs/ops/
rotary_embedding.md) are multiples of W elements, the table's pointer of its entries per unit.
GPT-J rows that allow no even W (odd strides) are refused with that reason. Each call signature
takes its own build with the arguments it fixes (strides, head counts, the table's shape)
compiled in (``fixed_args``, ``CudaTuning.specialize``). Launched on PyTorch's current stream; no
allocation and no host sync per call (graph-safe).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...kernels import launch, nvrtc
from ...kernels.launch import int_type, kind
from .op import head_stride

__all__ = ["available", "unsupported", "run", "SOURCE", "KERNEL", "unit_width", "launch_shape",
           "kind", "all_kernel_names", "kernel_name", "int_type", "call_unit_bytes", "fixed_args",
           "CudaTuning", "TUNING"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_rotary_embedding")
KERNEL = "rotary_embedding_kernel"

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unit_width(head_size: int, rot: int, is_neox: bool, in_bytes: int, table_bytes: int,
               table_ptr: int, ptrs: tuple[tuple[int, int], ...], strides: tuple[int, ...],
               max_bytes: int = 16) -> int:
    """The widest unit W of at most ``max_bytes`` (see the module doc), or 0 where none fits
    (GPT-J with odd rows). ``ptrs``: (address, element size) of every row tensor and cache;
    ``strides``: every stride in elements that moves (token and head strides, cache strides)."""
    w = max(min(16, max_bytes) // in_bytes, 1)
    while w >= 1:
        nc = w if is_neox else w // 2
        ok = ((rot // 2) % w == 0 if is_neox else (w % 2 == 0 and rot % w == 0))
        ok = ok and (head_size - rot) % w == 0 and head_size % w == 0
        ok = ok and all(launch.align((p,)) % min(w * e, 16) == 0 for p, e in ptrs)
        ok = ok and all(s % w == 0 for s in strides)
        ok = ok and launch.align((table_ptr,)) % min(max(nc, 1) * table_bytes, 16) == 0
        if ok:
            return w
        w //= 2
    return 0


def units(head_size: int, rot: int, is_neox: bool, w: int) -> tuple[int, int]:
    """(units per head, rotated units per head)."""
    rot_units = (rot // 2) // w if is_neox else rot // w
    return rot_units + (head_size - rot) // w, rot_units


@functools.cache
def launch_shape(units_per_token: int, max_threads: int = 256, small_row_threads: int = 128,
                 tile_threads: int = 128) -> tuple[int, int, int]:
    """(threads per token row, tokens per CTA, CTAs per token): several tokens per CTA for short
    rows, several CTAs per token for long ones (as reshape_and_cache_flash's kernel). A row split
    across CTAs takes CTAs of tile_threads where they tile it exactly, else near-even parts.
    Measured (H200, docs/tuning-log.md change 36): MHA(32,32,128) bfloat16, 512 units, 4 CTAs
    of 128 instead of 2 of 256: rotary_embedding T=16384 142.4 -> 138.9 us, T=4096 37.05 ->
    36.32, T=1 1.49 -> 1.35; for GQA(32,8,128) (320 units) 3 CTAs of 128 (or near-even 107)
    lost to 2 of 160, which it keeps."""
    c = units_per_token
    if c <= small_row_threads:
        return c, small_row_threads // c, 1
    if c <= max_threads:
        return c, 1, 1
    if c % tile_threads == 0:
        return tile_threads, 1, c // tile_threads
    parts = -(-c // max_threads)
    return -(-c // parts), 1, parts


def kernel_name(in_kind: int, cs_kind: int, w: int, neox: bool, pos: torch.dtype,
                linear: bool = False) -> str:
    return (f"{KERNEL}<{in_kind}, {cs_kind}, {w}, {str(neox).lower()}, {int_type(pos)}, "
            f"{str(linear).lower()}>")


def all_kernel_names() -> list[str]:
    """The variants the tests and the benchmark launch (for the NVRTC compile test)."""
    names = []
    for in_dt, in_kind in launch.KIND.items():
        for cs_kind in sorted({launch.KIND[torch.float32], in_kind}):
            w = 16 // in_dt.itemsize
            while w >= 1:
                for neox in (True, False):
                    if neox or w >= 2:
                        for pos in (torch.int64, torch.int32):
                            names.append(kernel_name(in_kind, cs_kind, w, neox, pos))
                w //= 2
            # the large-call build
            names.append(kernel_name(in_kind, cs_kind, 16 // in_dt.itemsize, True, torch.int64,
                                     True))
    return names


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants; ``TUNING`` unless a caller passes another to :func:`run`."""

    # Calls with at least linear_grid_bytes of query and key rows, one token per CTA, launch a
    # 1-D grid with a token's CTAs adjacent (kernel.cu's LINEAR) instead of a [tokens, parts]
    # grid, whose launch order runs through every token's first part before any second one.
    # Measured, H200, bfloat16, rotated L2 (docs/tuning-log.md change 38): GQA(32,8,128) T=16384
    # 86.2 -> 84.3 us, T=4096 23.3 -> 23.0; MHA(32,32,128) 139.0 -> 134.3, 36.0 -> 35.4; equal at
    # T=3072 (GQA 31 MB, MHA 50 MB), 0.5-2.5% slower at 1024-2048 and 0.13-0.15 us at T=16 (its
    # two divisions come first on the latency path).
    linear_grid_bytes: int = 32 << 20
    # Calls of at most small_call_bytes of query and key rows take units of at most
    # small_call_unit_bytes (bfloat16: 4 elements instead of 8), twice the threads with half the
    # rotation each: the arithmetic after the table's round trip is on a small call's latency
    # path. Measured, H200, bfloat16, specialized builds, 8 -> 4 elements, hot / rotated L2
    # (tuning-log change 49): GQA(32,8,128) T=1 1.09 -> 0.96 / 1.56 -> 1.41 us, T=16 1.15 ->
    # 1.01 / 1.75 -> 1.60. The bound (change 50, the rope benchmark's L2 rotation corrected):
    # 4-element units still win at GQA T=256 (2.5 MiB; 2.28 -> 2.08 / 2.65 -> 2.49) and MHA(32,
    # 32,128) T=192 (3 MiB; 2.71 -> 2.22 / 2.72 -> 2.23) and lose from MHA T=256 (4 MiB; 2.68 ->
    # 2.86 / 2.75 -> 2.87).
    small_call_bytes: int = 3 << 20
    small_call_unit_bytes: int = 8
    # One build per call signature with the arguments from q_stride on compiled in (kernel.cu's
    # KVWRITE_FIXED_ARGS), as reshape_and_cache_flash's; KVWRITE_CUDA_SPECIALIZE=0: one generic
    # build per variant. sm_90, GQA(32,8,128) bfloat16: 208 -> 152 instructions, 16 -> 6
    # parameter reads. Measured, H200, generic -> specialized (tuning-log change 48): hot L2
    # T=1 1.12 -> 1.07 us, T=16 1.20 -> 1.15; rotated T=1024 6.72 -> 6.47, T=16384 within 0.4%.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)


TUNING = CudaTuning()


def fixed_args(query: torch.Tensor, key: torch.Tensor | None, cos_sin_cache: torch.Tensor,
               is_neox: bool, w: int) -> tuple[int, ...]:
    """The kernel's arguments from q_stride on (kernel.cu's KVWRITE_FIXED_ARGS order), all set by
    the call signature: q_stride, k_stride, max_position, num_q_heads, head_size, rot,
    units_per_head, rot_units, units_per_token, q_head_stride, k_head_stride (op.head_stride:
    head_size for dense heads)."""
    _, hq, d = query.shape
    h = 0 if key is None else key.shape[1]
    rot = cos_sin_cache.shape[1]
    per_head, rot_units = units(d, rot, is_neox, w)
    return (query.stride(0), 0 if key is None else key.stride(0), cos_sin_cache.shape[0], hq, d,
            rot, per_head, rot_units, (hq + h) * per_head, head_stride(query),
            d if key is None else head_stride(key))


LAUNCHES = launch.LaunchCache()


def unsupported(query, key, cos_sin_cache, is_neox) -> str | None:
    if query.device.type != "cuda":
        return None
    if _width(query, key, cos_sin_cache, is_neox) == 0:
        return ("GPT-J pairing needs rows aligned to 2 elements (even token strides and "
                "pointers); these are not")
    return None


def _width(query, key, cos_sin_cache, is_neox, max_bytes: int = 16) -> int:
    rows = (query,) if key is None else (query, key)
    ptrs = tuple((t.data_ptr(), t.element_size()) for t in rows)
    strides = tuple(t.stride(0) for t in rows if t.shape[0] > 1)
    strides += tuple(head_stride(t) for t in rows)
    return unit_width(query.shape[2], cos_sin_cache.shape[1], is_neox, query.element_size(),
                      cos_sin_cache.element_size(), cos_sin_cache.data_ptr(), ptrs, strides,
                      max_bytes)


def _launchable(positions, query, key, cos_sin_cache, is_neox, linear, max_unit_bytes,
                specialize) -> launch.Launchable:
    launch.require_setup()
    w = _width(query, key, cos_sin_cache, is_neox, max_unit_bytes)
    fixed = fixed_args(query, key, cos_sin_cache, is_neox, w)
    row, tpc, parts = launch_shape(fixed[8])
    index = query.get_device()
    linear = linear and tpc == 1
    name = kernel_name(kind(query.dtype), kind(cos_sin_cache.dtype), w, is_neox, positions.dtype,
                       linear)
    kernel, pdl_kernel = launch.load(SOURCE, name, fixed, index, specialize)
    return launch.Launchable(kernel, pdl_kernel, index, fixed, (row, tpc, parts, linear))


def call_unit_bytes(row_bytes: int, tuning: CudaTuning = TUNING) -> int:
    """The widest unit (bytes) a call that moves ``row_bytes`` of query and key rows may take:
    ``tuning.small_call_unit_bytes`` up to ``small_call_bytes``, else 16."""
    return tuning.small_call_unit_bytes if row_bytes <= tuning.small_call_bytes else 16


def run(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_rot = positions.numel()
    if num_rot == 0:
        return
    qp = query.data_ptr()
    kp = 0 if key is None else key.data_ptr()
    sig = (query.dtype, cos_sin_cache.dtype, positions.dtype, query.shape[1:],
           None if key is None else key.shape[1], query.stride(0),
           None if key is None else key.stride(0), head_stride(query),
           None if key is None else head_stride(key), cos_sin_cache.shape,
           (qp | kp | cos_sin_cache.data_ptr()) & 15, is_neox, query.get_device())
    heads = query.shape[1] + (0 if key is None else key.shape[1])
    row_bytes = num_rot * heads * query.shape[2] * query.element_size()
    large = row_bytes >= tuning.linear_grid_bytes
    unit_bytes = call_unit_bytes(row_bytes, tuning)
    build = (large, unit_bytes, tuning.specialize)
    lau = LAUNCHES.get((sig, build))
    if lau is None:
        lau = LAUNCHES[sig, build] = _launchable(positions, query, key, cos_sin_cache,
                                                 is_neox, *build)
    row, tpc, parts, linear = lau.plan
    gx, gy, bx, by = ((num_rot * parts, 1, row, 1) if linear
                      else (-(-num_rot // tpc), parts, row, tpc))
    kernel, pdl = lau.pick(gx * gy, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(gx, gy, bx, by, pdl)
    nvrtc.launch(lau.device_index, config, kernel,
                 positions.data_ptr(), qp, kp or qp, cos_sin_cache.data_ptr(), num_rot,
                 *lau.fixed)
