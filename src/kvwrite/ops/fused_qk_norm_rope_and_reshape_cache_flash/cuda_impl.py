"""The CUDA implementation of fused_qk_norm_rope_and_reshape_cache_flash: ``kernel.cu`` compiled at
run time with NVRTC; the per-head arithmetic is ``kvw/qk_norm.cuh`` (shared with
fused_qk_norm_rope, whose launcher's lane layout and widths this one takes, with query_out and
the caches among the tensors the row chunks must be aligned for), the cache element conversion
and fp8 rule ``kvw/vec_io.cuh`` and ``kvw/fp8.cuh`` (shared with reshape_and_cache_flash).

Variants (template arguments): row, table and weight dtypes, the cache element kind (copy, float
cast, fp8 e4m3 or e5m2), the query's destination (in place, query_out of qkv's dtype, fp8
query_out), the lane layout and widths (E, L, SEG, V, VW, VT, PS), pairing, position and slot
index types, the CTA's threads, the register bound and the value's order (VALUE_FIRST: the
large-call build). Each call signature takes its own build with the arguments it fixes (strides,
head counts, the caches' geometry, the table's shape, eps, the weight offset; qkv's head stride
among the strides, which also count for the chunks' alignment) compiled in
(``fixed_args``, ``CudaTuning.specialize``); calls of at least ``CudaTuning.large_call_bytes``
of query, key and value rows take the large-call build (fused_qk_norm_rope's, with the value
converted before the table's entries are requested). Launched on PyTorch's current stream;
scales are read on the device; no allocation and no host sync per call (graph-safe).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dtypes import FLOAT8_FORMAT, CacheDType, scale_is_per_head
from ...kernels import launch, nvrtc
from ...kernels.launch import int_type, kind
from ..fused_qk_norm_rope import cuda_impl as norm_cuda
from ..fused_qk_norm_rope.cuda_impl import (
    NO_WEIGHT,
    SMALL,
    Build,
    Plan,
    bounded,
    lane_layout,
    layout_plan,
    plan,
    weight_kind,
)
from ..fused_qk_norm_rope.op import float32_bits

__all__ = ["available", "unsupported", "run", "SOURCE", "KERNEL", "kernel_name",
           "all_kernel_names", "fixed_args", "CudaTuning", "TUNING", "IN_PLACE", "out_kind",
           "query_kind", "call_build", "call_kernel"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_qk_norm_rope_cache")
KERNEL = "qk_norm_rope_cache_kernel"
_COPY, _E4M3, _E5M2 = launch.DT_COPY, launch.DT_E4M3, launch.DT_E5M2
IN_PLACE = 7  # kvw/qk_norm.cuh's QKN_IN_PLACE

available = nvrtc.available  # None on a CUDA device with cuda.core and NVRTC, else why not


def unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox, key_cache, cache_dtype,
                query_out) -> str | None:
    return None


out_kind = launch.cache_kind  # the caches' element kind (DT_COPY: qkv's own dtype)


def query_kind(query_out: torch.Tensor | None) -> int:
    """The query's destination: in place, a copy to query_out, or fp8 e4m3 / e5m2."""
    if query_out is None:
        return IN_PLACE
    fmt = FLOAT8_FORMAT.get(query_out.dtype)
    return _COPY if fmt is None else launch.FP8_KIND[fmt]


def kernel_name(in_kind: int, cs_kind: int, wq: int, wk: int, out: int, qo: int, p: Plan,
                neox: bool, pos: torch.dtype, slot: torch.dtype, build: Build = SMALL,
                value_first: bool = False) -> str:
    return (f"{KERNEL}<{in_kind}, {cs_kind}, {wq}, {wk}, {out}, {qo}, {p.e}, {p.lanes}, {p.seg}, "
            f"{p.v}, {p.vw}, {p.vt}, {str(neox).lower()}, {p.ps}, {int_type(pos)}, "
            f"{int_type(slot)}, {build.cta}, {build.min_blocks}, {str(value_first).lower()}>")


def all_kernel_names() -> list[str]:
    """A representative set of variants (for the NVRTC compile test): every row dtype against
    every cache kind and every query destination at D = 128 with its layouts of the small-call
    and the large-call build, both pairings, partial rotary, D = 64, 80, 46 and 512, weights of
    other kinds and none, narrow widths (one-element chunks of the large-call build's fp8 caches
    too), int32 indices."""
    names = set()
    f32, bf16 = kind(torch.float32), kind(torch.bfloat16)
    i64, i32 = torch.int64, torch.int32
    # Generic builds (this set): the large-call build takes no register bound (bounded()).
    large = dataclasses.replace(TUNING.large_build(), min_blocks=1)
    for in_dt in (torch.float16, torch.bfloat16, torch.float32):
        k = kind(in_dt)
        es = in_dt.itemsize
        outs = [_COPY, _E4M3, _E5M2] + [kind(d) for d in (torch.float16, torch.bfloat16,
                                                          torch.float32) if d != in_dt]
        for build, vf in ((SMALL, False), (large, TUNING.large_call_value_first)):
            p = layout_plan(128, es, 128, True, build.chunks)
            for out in outs:
                names.add(kernel_name(k, f32, k, k, out, IN_PLACE, p, True, i64, i64, build, vf))
            for out, qo in ((_COPY, _COPY), (_COPY, _E4M3), (_E4M3, _E5M2), (_E5M2, _COPY)):
                names.add(kernel_name(k, f32, k, k, out, qo, p, True, i64, i64, build, vf))
            for neox, rot in ((True, 64), (False, 128)):
                q = layout_plan(128, es, rot, neox, build.chunks)
                names.add(kernel_name(k, f32, k, k, _E4M3, IN_PLACE, q, neox, i64, i64, build,
                                      vf))
            for d in (64, 80, 46, 512):
                names.add(kernel_name(k, f32, k, k, _COPY, IN_PLACE,
                                      layout_plan(d, es, d, True, build.chunks), True, i64, i64,
                                      build, vf))
                names.add(kernel_name(k, f32, k, k, _E5M2, _E4M3,
                                      layout_plan(d, es, d, False, build.chunks), False, i64,
                                      i64, build, vf))
        e, lanes = lane_layout(128, es)
        names.add(kernel_name(k, bf16, NO_WEIGHT, f32, _COPY, IN_PLACE,
                              Plan(e, lanes, e, 1, 2, 2, 0), True, i32, i32))
        names.add(kernel_name(k, k, f32, NO_WEIGHT, _E4M3, _COPY, Plan(e, lanes, e, 2, 1, 1, 0),
                              False, i64, i32))
        p = layout_plan(128, es, 128, True, large.chunks)
        names.add(kernel_name(k, bf16, NO_WEIGHT, f32, _E4M3, _E5M2, p, True, i32, i32, large,
                              True))
        # One-element chunks in the large-call build (rows aligned to their element only): its
        # fp8 paths (power of two, fp8_quantize_fast16, quotient) on single elements.
        for out in (_E4M3, _E5M2):
            names.add(kernel_name(k, f32, k, k, out, _COPY, dataclasses.replace(p, v=1), True,
                                  i64, i64, large, True))
    return sorted(names)


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(norm_cuda.CudaTuning):
    """The launch constants; ``TUNING`` unless a caller passes another to :func:`run`:
    fused_qk_norm_rope's (its ``specialize`` and large-call fields, the same predictions, not
    measured on this kernel yet) plus the cache's."""

    # With an fp8 cache or query_out the large-call build's __launch_bounds__ takes
    # large_call_min_blocks_fp8 (56 registers, where 48 spilled 40 bytes). With
    # large_call_value_first a key group of the large-call build converts its value before it
    # requests the table's entries and stores it then (or, where a head's cache row is 128 bytes,
    # right after the key's chunks), so it never holds the value's input and the entries at once
    # (the fused RoPE kernel's large build: tuning-log changes 35 and 53).
    large_call_min_blocks_fp8: int = 18
    large_call_value_first: bool = True

    def large_build(self, fp8: bool = False) -> Build:
        return Build(self.large_call_chunks, self.large_call_cta_threads,
                     self.large_call_min_blocks_fp8 if fp8 else self.large_call_min_blocks,
                     self.large_call_pdl_trigger)


TUNING = CudaTuning()


def call_build(row_bytes: int, fp8: bool, tuning: CudaTuning = TUNING) -> tuple[Build, bool]:
    """(build, value first) of a call that moves ``row_bytes`` of query, key and value rows;
    ``fp8``: an fp8 cache or query_out (the quotients' registers: a looser bound)."""
    if row_bytes >= tuning.large_call_bytes:
        return tuning.large_build(fp8), tuning.large_call_value_first
    return SMALL, False


def fixed_args(qkv, num_heads_q, num_heads_k, eps, cos_sin_cache, weight_offset, key_cache,
               rotate_key_in_place, query_out) -> tuple[int, ...]:
    """The kernel's arguments from qkv_stride on (kernel.cu's KVWRITE_FIXED_ARGS order), all set by
    the call signature: qkv's token and head strides, query_out's token stride, max_position,
    the caches' block, page and head strides, block_size, log2(block_size) or -1, num_slots, Hq,
    Hk, D, rot, the bits of float32(eps) and float32(weight_offset), whether the offset is
    added, whether the key is stored back."""
    num_blocks, block_size = key_cache.shape[:2]
    block_stride, page_stride, head_stride = key_cache.stride()[:3]
    qo_stride = 0 if query_out is None else query_out.stride(0)
    return (qkv.stride(0), qkv.stride(1), qo_stride, cos_sin_cache.shape[0], block_stride,
            page_stride, head_stride, block_size, launch.log2_or_minus_1(block_size),
            num_blocks * block_size, num_heads_q, num_heads_k, qkv.shape[2],
            cos_sin_cache.shape[1], float32_bits(eps),
            float32_bits(weight_offset), int(weight_offset != 0), int(rotate_key_in_place))


def _rows(qkv, key_cache, value_cache, query_out) -> tuple:
    """(address, element size, strides) of the tensors the kernel accesses in V-element chunks
    besides qkv: query_out and both caches."""
    rows = []
    if query_out is not None:
        rows.append((query_out.data_ptr(), query_out.element_size(),
                     (query_out.stride(0),) if query_out.shape[0] > 1 else ()))
    strides = tuple(s for s, n in zip(key_cache.stride()[:3], key_cache.shape[:3], strict=True)
                    if n > 1)
    for c in (key_cache, value_cache):
        rows.append((c.data_ptr(), c.element_size(), strides))
    return tuple(rows)


def call_kernel(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                position_ids, weight_offset, key_cache, value_cache, slot_mapping, cache_dtype,
                rotate_key_in_place, query_out, build: Build = SMALL, value_first: bool = False,
                specialize: bool = True) -> tuple[str, Plan, tuple[int, ...], Build]:
    """(kernel name, plan, fixed arguments, build) of a call taking ``build`` (CPU tensors too:
    the tests read the machine code of what calls take)."""
    p = plan(qkv, q_weight, k_weight, cos_sin_cache, is_neox,
             _rows(qkv, key_cache, value_cache, query_out), build.chunks)
    build = bounded(build, p, specialize, q_weight, k_weight, qkv.element_size())
    fixed = fixed_args(qkv, num_heads_q, num_heads_k, eps, cos_sin_cache, weight_offset,
                       key_cache, rotate_key_in_place, query_out)
    name = kernel_name(kind(qkv.dtype), kind(cos_sin_cache.dtype), weight_kind(q_weight),
                       weight_kind(k_weight), out_kind(cache_dtype, qkv.dtype, key_cache.dtype),
                       query_kind(query_out), p, is_neox, position_ids.dtype, slot_mapping.dtype,
                       build, value_first)
    return name, p, fixed, build


LAUNCHES = launch.LaunchCache()


def _launchable(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                position_ids, weight_offset, key_cache, value_cache, slot_mapping, cache_dtype,
                rotate_key_in_place, query_out, specialize, build,
                value_first) -> launch.Launchable:
    launch.require_setup()
    name, p, fixed, build = call_kernel(qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight,
                                        cos_sin_cache, is_neox, position_ids, weight_offset,
                                        key_cache, value_cache, slot_mapping, cache_dtype,
                                        rotate_key_in_place, query_out, build, value_first,
                                        specialize)
    return norm_cuda.load_build(SOURCE, name, fixed, p, build, num_heads_q + num_heads_k,
                                qkv.get_device(), specialize)


def run(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, eps: float,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
        weight_offset: float, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, cache_dtype: CacheDType, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None, q_scale: torch.Tensor | None, *,
        tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_rot = position_ids.numel()
    if num_rot == 0:
        return
    qw, kw, qo = launch.ptr(q_weight), launch.ptr(k_weight), launch.ptr(query_out)
    kc, vc = key_cache.data_ptr(), value_cache.data_ptr()
    fp8 = cache_dtype.is_fp8 or query_kind(query_out) in (_E4M3, _E5M2)
    build, value_first = call_build(num_rot * (num_heads_q + 2 * num_heads_k) * qkv.shape[2] *
                                    qkv.element_size(), fp8, tuning)
    sig = (qkv.dtype, cos_sin_cache.dtype, key_cache.dtype, cache_dtype, position_ids.dtype,
           slot_mapping.dtype, qkv.shape[1:], qkv.stride()[:2], num_heads_q, num_heads_k, eps,
           weight_offset, cos_sin_cache.shape, key_cache.shape, key_cache.stride(),
           None if q_weight is None else q_weight.dtype,
           None if k_weight is None else k_weight.dtype,
           None if query_out is None else (query_out.dtype, query_out.stride(0)),
           qkv.data_ptr() & 15, cos_sin_cache.data_ptr() & 15, qw & 15, kw & 15, qo & 15,
           kc & 15, vc & 15, is_neox, rotate_key_in_place, qkv.get_device(), tuning.specialize,
           build, value_first)
    lau = LAUNCHES.get(sig)
    if lau is None:
        lau = LAUNCHES[sig] = _launchable(
            qkv, num_heads_q, num_heads_k, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            position_ids, weight_offset, key_cache, value_cache, slot_mapping, cache_dtype,
            rotate_key_in_place, query_out, tuning.specialize, build, value_first)
    per_token, cta = lau.plan
    ctas = -(-(num_rot * per_token) // cta)
    kernel, pdl = lau.pick(ctas, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(ctas, 1, cta, 1, pdl)
    kss = vss = qss = 0
    if k_scale is not None:
        kss, vss = int(scale_is_per_head(k_scale)), int(scale_is_per_head(v_scale))
    if q_scale is not None:
        qss = int(scale_is_per_head(q_scale))
    nvrtc.launch(lau.device_index, config, kernel,
                 position_ids.data_ptr(), qkv.data_ptr(), qo, cos_sin_cache.data_ptr(), qw, kw,
                 kc, vc, slot_mapping.data_ptr(), launch.ptr(k_scale), launch.ptr(v_scale),
                 launch.ptr(q_scale),
                 num_rot, slot_mapping.numel(), kss, vss, qss, *lau.fixed)
