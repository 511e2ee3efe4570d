"""reshape_and_cache_flash's memcheck cases (``python -m tools.sanitize``): each runs the cuda
implementation on the GPU and the torch reference on the CPU over the same inputs
(:func:`kvwrite.testing.make_inputs` is deterministic) and compares both whole caches byte for
byte. The cases stress the bounds: padding and out-of-range slots, rows that are not 16-byte
aligned (head size 46), HND, interleaved and packed caches, per-head fp8 scales, key/value rows
past T, slices of a fused qkv, rows split over several CTAs, a block size that is not a power of
two, and more tokens than one resident wave. Every case runs through the loop-free kernel and
through the grid-stride kernel (``CudaTuning.loop_free``)."""

from __future__ import annotations

import dataclasses

import torch

from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing import Case, clone_caches, make_inputs
from kvwrite.testing.sanitize import SanitizeCase, compare_outputs

__all__ = ["CASES", "KERNELS", "cases", "run_case"]

CASES = [
    Case(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
    Case(num_tokens=129, num_heads=5, head_size=46, num_blocks=16, layout=Layout.HND,
         padding_slots=5, out_of_range_slots=4),
    Case(num_tokens=129, num_heads=5, head_size=46, num_blocks=16, kv_cache_dtype="fp8",
         per_head_scale=True, alloc=KVAlloc.PACKED, out_of_range_slots=3),
    Case(num_tokens=7, extra_rows=5, fused_qkv=True, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED),
    Case(num_tokens=9, num_heads=4, head_size=32, dtype=torch.float32, kv_cache_dtype="fp8_e5m2",
         per_head_scale=True, fp8_storage="float8", layout=Layout.HND, alloc=KVAlloc.PACKED,
         special_values=True),
    Case(num_tokens=33, num_heads=8, head_size=128, kv_cache_dtype="fp8", layout=Layout.HND,
         alloc=KVAlloc.PACKED, per_head_scale=True, padding_slots=2, out_of_range_slots=2),
    Case(num_tokens=5, num_heads=128, head_size=120, num_blocks=2, kv_cache_dtype="fp8",
         out_of_range_slots=1),  # 8 CTAs per token, the last one partly idle
    Case(num_tokens=5, num_heads=13, head_size=80, dtype=torch.float16, kv_cache_dtype="bfloat16",
         block_size=12, num_blocks=3, padding_slots=1),  # block_size not a power of two
    Case(num_tokens=40_000, num_heads=1, head_size=64, num_blocks=2600, padding_slots=100,
         out_of_range_slots=100),  # more tokens than one resident wave
]

KERNELS = ("loop-free", "grid-stride")


def run_case(case: Case, kernel: str) -> str | None:
    """None when the cuda implementation (``kernel``: loop-free or grid-stride) writes the torch
    reference's bytes over both whole caches for ``case``, else what differs."""
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl, validate
    from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref

    gpu = make_inputs(case, "cuda")
    cpu = make_inputs(case, "cpu")
    ref_k, ref_v = clone_caches(cpu)
    cd = validate(*cpu.args())
    scales = (cpu.k_scale, cpu.v_scale) if cd.is_fp8 else (None, None)
    torch_ref.run(cpu.key, cpu.value, ref_k, ref_v, cpu.slot_mapping, cd, *scales)
    gcd = validate(*gpu.args())
    gscales = (gpu.k_scale, gpu.v_scale) if gcd.is_fp8 else (None, None)
    tuning = dataclasses.replace(cuda_impl.TUNING, loop_free=kernel == "loop-free")
    cuda_impl.run(gpu.key, gpu.value, gpu.key_cache, gpu.value_cache, gpu.slot_mapping, gcd,
                  *gscales, tuning=tuning)
    nan = {"key_cache": cd.fp8_dtype, "value_cache": cd.fp8_dtype} if cd.is_fp8 else None
    return compare_outputs({"key_cache": gpu.key_cache, "value_cache": gpu.value_cache},
                           {"key_cache": ref_k, "value_cache": ref_v}, nan)


def cases() -> list[SanitizeCase]:
    return [(f"{kernel} {case.id}", lambda case=case, kernel=kernel: run_case(case, kernel))
            for kernel in KERNELS for case in CASES]
