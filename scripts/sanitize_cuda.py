"""A few cases through the cuda implementation, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/sanitize_cuda.py

Each case runs the kernel on the GPU and the torch reference on the CPU (same inputs: make_inputs
is deterministic per seed) and compares both whole caches byte for byte. The cases stress the
bounds: out-of-range and padding slots, rows that are not 16-byte aligned (head size 46),
HND, interleaved and packed caches, per-head fp8 scales, extra key/value rows past T, slices of
a fused qkv, rows split over several CTAs, and (in the grid-stride kernel) a grid that walks
tokens in a loop. Every case runs through both kernels.
Exits 1 on a mismatch (memcheck's own errors exit with --error-exitcode).
"""

from __future__ import annotations

import sys

import torch

import kvwrite
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.testing import Case, assert_caches_equal, clone_caches, make_inputs

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


def main() -> int:
    if kvwrite.registry.get("cuda").available("cuda") is not None:
        print(kvwrite.registry.get("cuda").available("cuda"), file=sys.stderr)
        return 2
    from kvwrite.ops.reshape_and_cache_flash import cuda_impl

    failures = runs = 0
    # Every case through the loop-free kernel, then through the grid-stride kernel.
    for loop_free, case in [(lf, c) for lf in (True, False) for c in CASES]:
        cuda_impl._LOOP_FREE = loop_free
        cuda_impl._LAUNCHABLES.clear()
        runs += 1
        gpu = make_inputs(case, "cuda")
        cpu = make_inputs(case, "cpu")
        ref_k, ref_v = clone_caches(cpu)
        cd = case.cache_dtype
        scales = (cpu.k_scale, cpu.v_scale) if cd.is_fp8 else (None, None)
        torch_ref.run(cpu.key, cpu.value, ref_k, ref_v, cpu.slot_mapping, cd, *scales)
        kvwrite.reshape_and_cache_flash(*gpu.args(), implementation="cuda")
        torch.cuda.synchronize()
        fp8 = cd.fp8_dtype if cd.is_fp8 else None
        try:
            got_k, got_v = clone_caches(gpu, "cpu")
            assert_caches_equal(got_k, ref_k, "key_cache", fp8, nan_equal=cd.is_fp8)
            assert_caches_equal(got_v, ref_v, "value_cache", fp8, nan_equal=cd.is_fp8)
            print(f"ok       {'loop-free  ' if loop_free else 'grid-stride'} {case.id}")
        except AssertionError as e:
            failures += 1
            print(f"MISMATCH {'loop-free  ' if loop_free else 'grid-stride'} {case.id}: {e}")
    print(f"{runs - failures}/{runs} runs match the torch reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
