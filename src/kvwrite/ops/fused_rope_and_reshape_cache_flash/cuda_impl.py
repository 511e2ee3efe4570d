"""The CUDA implementation of fused_rope_and_reshape_cache_flash: ``kernel.cu`` compiled at run
time with NVRTC; the rotation is ``kvw/rope.cuh`` (shared with rotary_embedding), the cache
element conversion and fp8 rule ``kvw/vec_io.cuh`` and ``kvw/fp8.cuh`` (shared with
reshape_and_cache_flash).

Variants (template arguments): row dtype, table dtype, cache element kind (copy, float cast, fp8
e4m3 or e5m2), unit width W, pairing, position and slot index types, and the minimum of
resident CTAs that bounds the registers (``CudaTuning``: 1 for small calls, more for large, which
also take narrower CTAs and convert the value before the key's rotation, storing it then or, where
a head's cache row is 128 bytes, right after the key's chunks). W is
chosen as for rotary_embedding (kvwrite.ops.rotary_embedding.cuda_impl.unit_width): every row
tensor's pointer, token stride and head stride (each its own) and the caches' pointers and
strides among the aligned ones. Each call signature takes its own build
with the arguments it fixes (strides, head counts, the caches' geometry, the table's shape)
compiled in (``fixed_args``, ``CudaTuning.specialize``). Launched on PyTorch's current stream;
scales are read on the device; no allocation and no host sync per call (graph-safe).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dtypes import CacheDType
from ...kernels import launch, nvrtc
from ...kernels.launch import int_type, kind
from ..rotary_embedding.cuda_impl import available, launch_shape, unit_width, units
from ..rotary_embedding.op import head_stride as row_head_stride

__all__ = ["available", "unsupported", "run", "SOURCE", "KERNEL", "all_kernel_names",
           "kernel_name", "cta_shape", "call_build", "fixed_args", "CudaTuning", "TUNING"]

SOURCE = nvrtc.KernelSource(__package__, "kernel.cu", "kvwrite_fused_rope_cache")
KERNEL = "fused_rope_cache_kernel"
_COPY, _E4M3, _E5M2 = 5, 3, 4


@dataclasses.dataclass(frozen=True, eq=False)
class CudaTuning(launch.PdlPolicy):
    """The launch constants. ``TUNING`` is what every call uses unless a caller passes another
    one to :func:`run` (probes comparing variants, tests forcing a build)."""

    # Calls that move at least large_call_bytes of query, key and value rows take the build with
    # __launch_bounds__(256, large_call_min_blocks) whose key threads convert the value before they
    # rotate the key (kernel.cu's VALUE_FIRST; stored then, or held where a head's cache row is
    # 128 bytes, kernel.cu's value_after, tuning-log change 53): 48 registers instead of 57-62, none
    # spilled, so 8 instead of 6 CTAs of 160 threads per SM for GQA(32,8,128). Measured, H200,
    # bfloat16, rotated L2 (docs/tuning-log.md changes 34 and 35): T=16384 GQA auto 122.2 ->
    # 115.5 us, fp8 NHD 116.1 -> 108.2, fp8 HND 123.9 -> 114.3, MHA fp8 HND 244.6 -> 227.0;
    # value-first alone takes T=4096 1-5% below the bound alone (fp8 the most). At T=16 the bound
    # costs 0.03-0.13 us and value-first 0.04-0.05 us, so small calls keep the unbounded build. 6
    # CTAs (40 registers, spilled) was slower.
    large_call_bytes: int = 4 << 20
    large_call_min_blocks: int = 5
    # Large calls split a token's units into CTAs of large_call_cta_threads threads (a multiple
    # of 32, at most 256) instead of launch_shape's near-even parts of up to 256 (GQA(32,8,128):
    # 5 CTAs of 64 instead of 2 of 160, so no CTA mixes query and key warps; MHA: 8 of 64
    # instead of 2 of 256). Measured, H200, rotated L2 (tuning-log change 36): T=16384 fp8 GQA
    # HND 115.2 -> 109.9 us, MHA fp8 NHD 216.6 -> 210.0, MHA auto 255.3 -> 248.7, GQA auto 116.4
    # -> 116.0; T=1536-4096 1-5% less; but GQA fp8 at T=768-1024 0.02-0.16 us more, and small
    # GQA calls (T <= 64) 0.08-0.14 us more (MHA at T <= 16 0.25-0.34 us less), so small calls
    # keep launch_shape's CTAs. A token of at most 256 units that these CTAs do not tile keeps
    # launch_shape's one CTA (cta_shape): GQA(32,8,64)'s 160 units took 64 + 64 + a key CTA of
    # 32 busy threads out of 64, one CTA of 160 instead: fp8 T=4096 / 16384 77.7 -> 84.0% / 85.7
    # -> 95.4% of the copy bandwidth, auto 88.9 -> 88.9% / 94.2 -> 96.1% (tuning-log change 55).
    # Longer rows keep them: with 288 units (64,8,64 and 32,4,128) launch_shape's 2 CTAs of 144
    # won with fp8 (T=16384 +3 points) but lost with copies (T=4096 -2.2 to -2.5).
    large_call_cta_threads: int = 64
    # Calls of at most small_call_bytes (fp8 caches: small_call_bytes_fp8) of query, key and
    # value rows take units of at most small_call_unit_bytes (bfloat16: 4 elements instead of
    # 8): twice the threads, each with half the rotation and half the conversion after the
    # table's round trip. Measured, H200, bfloat16, specialized builds, 8 -> 4 elements, hot /
    # rotated L2 (tuning-log change 49): GQA(32,8,128) fp8 T=1 1.56 -> 1.41 / 2.26 -> 2.10 us,
    # T=16 1.72 -> 1.52 / 2.58 -> 2.41; auto T=16 1.47 -> 1.32 / 2.30 -> 2.20. The bounds (change
    # 50, the rope benchmark's L2 rotation corrected): copies win up to GQA T=256 (3 MiB; 2.66
    # -> 2.32 / 3.56 -> 3.50) and MHA(32,32,128) T=128 (3 MiB; 2.50 -> 2.42 / 3.48 -> 3.47), and
    # tie beyond; fp8 wins up to 1 MiB (GQA T=64 2.02 -> 1.86 / 2.91 -> 2.75) and loses hot
    # from 1.5 MiB (GQA T=128 2.23 -> 2.67, MHA T=64 2.71 -> 2.85).
    small_call_bytes: int = 3 << 20
    small_call_bytes_fp8: int = 1 << 20
    small_call_unit_bytes: int = 8
    # One build per call signature with the arguments from q_stride on compiled in (kernel.cu's
    # KVWRITE_FIXED_ARGS), as reshape_and_cache_flash's; KVWRITE_CUDA_SPECIALIZE=0: one generic
    # build per variant. sm_90, GQA(32,8,128) bfloat16, small-call build: auto 624 -> 352
    # instructions, 35 -> 12 parameter reads; fp8 880 -> 592. Measured, H200, generic ->
    # specialized (tuning-log change 48): hot L2 GQA auto T=1 1.42 -> 1.30 us, T=16 1.57 ->
    # 1.45, fp8 1.64 -> 1.56, 1.76 -> 1.71; MHA auto 1.62 -> 1.42; rotated T <= 64 0.5-6% less,
    # T=4096 0.3-0.9% less, T=16384 0-0.5% less.
    specialize: bool = dataclasses.field(default_factory=nvrtc.specialize_default)

    def __post_init__(self):
        c = self.large_call_cta_threads
        if not (isinstance(c, int) and 32 <= c <= 256 and c % 32 == 0):
            raise ValueError(f"large_call_cta_threads: expected a multiple of 32 in [32, 256], "
                             f"got {c!r}")


def cta_shape(units_per_token: int, cta_threads: int | None) -> tuple[int, int, int]:
    """(threads per token row, tokens per CTA, CTAs per token) of a launch: launch_shape's, or
    for cta_threads (the large-call build) CTAs of that many threads where a token has more
    units than that and they tile it exactly or it takes more than one CTA of launch_shape's
    (CudaTuning.large_call_cta_threads)."""
    c = units_per_token
    shape = launch_shape(c)
    if cta_threads is not None and c > cta_threads and (c % cta_threads == 0 or shape[2] > 1):
        return cta_threads, 1, -(-c // cta_threads)
    return shape


TUNING = CudaTuning()


_out_kind = launch.cache_kind


def kernel_name(in_kind: int, cs_kind: int, out_kind: int, w: int, neox: bool,
                pos: torch.dtype, slot: torch.dtype, min_blocks: int = 1) -> str:
    return (f"{KERNEL}<{in_kind}, {cs_kind}, {out_kind}, {w}, {str(neox).lower()}, "
            f"{int_type(pos)}, {int_type(slot)}, {min_blocks}>")


def all_kernel_names() -> list[str]:
    """The variants the tests and the benchmark launch (for the NVRTC compile test)."""
    names = []
    f32 = kind(torch.float32)
    for in_dt in (torch.float16, torch.bfloat16, torch.float32):
        k = kind(in_dt)
        outs = [_COPY, _E4M3, _E5M2] + [kind(d) for d in (torch.float16, torch.bfloat16,
                                                          torch.float32) if d != in_dt]
        w = 16 // in_dt.itemsize
        while w >= 1:
            for out in outs:
                for neox in (True, False):
                    if not neox and w < 2:
                        continue
                    names.append(kernel_name(k, f32, out, w, neox, torch.int64, torch.int64))
            w //= 2
        widest = 16 // in_dt.itemsize
        for pos, slot in ((torch.int32, torch.int32), (torch.int64, torch.int32)):
            names.append(kernel_name(k, k, _COPY, widest, True, pos, slot))
            names.append(kernel_name(k, k, _E4M3, widest, False, pos, slot))
        for out in (_COPY, _E4M3):  # the large-call build
            names.append(kernel_name(k, f32, out, widest, True, torch.int64, torch.int64,
                                     TUNING.large_call_min_blocks))
    return names


def _width(query, key, value, key_cache, value_cache, query_out, cos_sin_cache, is_neox,
           max_bytes: int = 16) -> int:
    rows = [query, key, value] + ([] if query_out is None else [query_out])
    ptrs = tuple((t.data_ptr(), t.element_size()) for t in rows)
    ptrs += tuple((c.data_ptr(), c.element_size()) for c in (key_cache, value_cache))
    strides = tuple(t.stride(0) for t in rows if t.shape[0] > 1)
    strides += tuple(row_head_stride(t) for t in rows)
    strides += tuple(s for s, n in zip(key_cache.stride()[:3], key_cache.shape[:3], strict=True)
                     if n > 1)
    return unit_width(query.shape[2], cos_sin_cache.shape[1], is_neox, query.element_size(),
                      cos_sin_cache.element_size(), cos_sin_cache.data_ptr(), ptrs, strides,
                      max_bytes)


def unsupported(query, key, key_cache, cache_dtype, cos_sin_cache, is_neox) -> str | None:
    if query.device.type != "cuda" or is_neox:
        return None
    # GPT-J needs an even W; the caches' and value's alignment is checked at launch as well.
    if _width(query, key, key, key_cache, key_cache, None, cos_sin_cache, is_neox) == 0:
        return ("GPT-J pairing needs rows aligned to 2 elements (even token strides and "
                "pointers); these are not")
    return None


def fixed_args(query, key, value, cos_sin_cache, is_neox, key_cache, rotate_key_in_place,
               query_out, w) -> tuple[int, ...]:
    """The kernel's arguments from q_stride on (kernel.cu's KVWRITE_FIXED_ARGS order), all set by
    the call signature: the row strides of query, query_out, key and value, max_position, the
    caches' block, page and head strides, block_size, log2(block_size) or -1, num_slots,
    num_q_heads, head_size, rot, units_per_head, rot_units, units_per_token, whether the key is
    stored back, whether the query is rotated in place, and the head strides of query,
    query_out, key and value (op.head_stride: head_size for dense heads)."""
    _, hq, d = query.shape
    rot = cos_sin_cache.shape[1]
    per_head, rot_units = units(d, rot, is_neox, w)
    num_blocks, block_size = key_cache.shape[:2]
    block_stride, page_stride, head_stride = key_cache.stride()[:3]
    qo = query if query_out is None else query_out
    return (query.stride(0), qo.stride(0), key.stride(0), value.stride(0), cos_sin_cache.shape[0],
            block_stride, page_stride, head_stride, block_size, launch.log2_or_minus_1(block_size),
            num_blocks * block_size, hq, d, rot, per_head, rot_units,
            (hq + key.shape[1]) * per_head, int(rotate_key_in_place), int(query_out is None),
            row_head_stride(query), row_head_stride(qo), row_head_stride(key),
            row_head_stride(value))


LAUNCHES = launch.LaunchCache()


def _launchable(query, key, value, positions, cos_sin_cache, is_neox, key_cache, value_cache,
                slot_mapping, cache_dtype, rotate_key_in_place, query_out, min_blocks,
                cta_threads, max_unit_bytes, specialize) -> launch.Launchable:
    launch.require_setup()
    w = _width(query, key, value, key_cache, value_cache, query_out, cos_sin_cache, is_neox,
               max_unit_bytes)
    if w == 0:
        raise ValueError("cuda: GPT-J pairing needs rows and caches aligned to 2 elements")
    fixed = fixed_args(query, key, value, cos_sin_cache, is_neox, key_cache, rotate_key_in_place,
                       query_out, w)
    row, tpc, parts = cta_shape(fixed[16], cta_threads)
    name = kernel_name(kind(query.dtype), kind(cos_sin_cache.dtype),
                       _out_kind(cache_dtype, query.dtype, key_cache.dtype), w, is_neox,
                       positions.dtype, slot_mapping.dtype, min_blocks)
    index = query.get_device()
    # The large-call build waits without triggering the next kernel early (CudaTuning).
    kernel, pdl_kernel = launch.load(SOURCE, name, fixed, index, specialize,
                                     trigger=min_blocks == 1)
    return launch.Launchable(kernel, pdl_kernel, index, fixed, (row, tpc, parts))


def call_build(row_bytes: int, cache_dtype: CacheDType, tuning: CudaTuning = TUNING) -> tuple:
    """(min CTAs per SM, CTA threads or None, unit bytes at most) of a call that moves
    ``row_bytes`` of query, key and value rows: the large-call build from
    ``tuning.large_call_bytes``, narrower units up to ``small_call_bytes`` (fp8 caches:
    ``small_call_bytes_fp8``), else the default build."""
    if row_bytes >= tuning.large_call_bytes:
        return (tuning.large_call_min_blocks, tuning.large_call_cta_threads, 16)
    small = tuning.small_call_bytes_fp8 if cache_dtype.is_fp8 else tuning.small_call_bytes
    return (1, None, tuning.small_call_unit_bytes if row_bytes <= small else 16)


def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, is_neox: bool, key_cache: torch.Tensor,
        value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_dtype: CacheDType,
        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, rotate_key_in_place: bool,
        query_out: torch.Tensor | None, *, tuning: CudaTuning = TUNING) -> None:
    """Launch on PyTorch's current stream (arguments validated by the public op)."""
    num_rot = positions.numel()
    if num_rot == 0:
        return
    qo = query if query_out is None else query_out
    ptrs = (query.data_ptr(), qo.data_ptr(), key.data_ptr(), value.data_ptr(),
            cos_sin_cache.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr())
    align = 0
    for p in ptrs:
        align |= p
    sig = (query.dtype, cos_sin_cache.dtype, key_cache.dtype, cache_dtype, positions.dtype,
           slot_mapping.dtype, query.shape[1:], key.shape[1:], query.stride(0), qo.stride(0),
           key.stride(0), value.stride(0), row_head_stride(query), row_head_stride(qo),
           row_head_stride(key), row_head_stride(value), key_cache.shape, key_cache.stride(),
           cos_sin_cache.shape, align & 15, is_neox, query.get_device(), rotate_key_in_place,
           query_out is None, tuning.specialize)
    row_bytes = num_rot * (query.shape[1] + 2 * key.shape[1]) * query.shape[2] * \
        query.element_size()
    build = call_build(row_bytes, cache_dtype, tuning)
    lau = LAUNCHES.get((sig, build))
    if lau is None:
        lau = LAUNCHES[sig, build] = _launchable(
            query, key, value, positions, cos_sin_cache, is_neox, key_cache, value_cache,
            slot_mapping, cache_dtype, rotate_key_in_place, query_out, *build,
            tuning.specialize)
    row, tpc, parts = lau.plan
    gx = -(-num_rot // tpc)
    kernel, pdl = lau.pick(gx * parts, tuning.pdl_max_ctas)
    config = nvrtc.launch_config(gx, parts, row, tpc, pdl)
    ksp, vsp, kss, vss = launch.scale_args(k_scale, v_scale)
    nvrtc.launch(lau.device_index, config, kernel,
                 positions.data_ptr(), ptrs[0], ptrs[1],
                 ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6], slot_mapping.data_ptr(), ksp, vsp,
                 num_rot, slot_mapping.numel(), kss, vss, *lau.fixed)
