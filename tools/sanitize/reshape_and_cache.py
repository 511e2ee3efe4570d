"""Cases for the memory checker: each runs the cuda implementation of reshape_and_cache on the
GPU over a case that stresses its bounds (padding and out-of-range slots, unaligned odd shapes,
key/value rows past T, strided and interleaved caches, an x-strided key cache, more tokens than
one wave, H = 64 with D = 128) and the torch reference on the CPU on the same inputs, and returns
None when both whole caches are byte-equal, else what differs.

    compute-sanitizer --tool memcheck ... python -m tools.sanitize   # runs every op's cases()
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["cases", "run_case"]


def _cases():
    from kvwrite.testing.legacy import LegacyCase
    return [
        LegacyCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
        LegacyCase(num_tokens=129, num_heads=5, head_size=46, x=2, block_size=7, num_blocks=24,
                   padding_slots=5, out_of_range_slots=4, extra_rows=3, cache_strides="padded"),
        LegacyCase(num_tokens=129, num_heads=13, head_size=80, kv_cache_dtype="fp8",
                   per_head_scale=True, cache_strides="interleaved", out_of_range_slots=3,
                   num_blocks=16),
        LegacyCase(num_tokens=33, num_heads=3, head_size=6, x=2, kv_cache_dtype="fp8_e5m2",
                   fused_qkv=True, cache_strides="x-strided", out_of_range_slots=2,
                   dtype=torch.float32),
        LegacyCase(num_tokens=64, num_heads=64, head_size=128, kv_cache_dtype="bfloat16",
                   dtype=torch.float16, cache_strides="slot-major", num_blocks=5,
                   out_of_range_slots=1),
        LegacyCase(num_tokens=20000, num_heads=2, head_size=64, block_size=16, num_blocks=1300,
                   kv_cache_dtype="fp8", padding_slots=100, out_of_range_slots=100),
    ]


def run_case(case) -> str | None:
    """None when the cuda implementation (GPU) and the reference (CPU) write the same bytes."""
    from kvwrite.ops.reshape_and_cache import reshape_and_cache
    from kvwrite.testing.legacy import assert_legacy_caches_equal, clone_caches, make_legacy_inputs
    gpu = make_legacy_inputs(case, "cuda")
    cpu = make_legacy_inputs(case, "cpu")
    reshape_and_cache(*gpu.args(), implementation="cuda")
    reshape_and_cache(*cpu.args(), implementation="torch")
    torch.cuda.synchronize()
    kc, vc = clone_caches(gpu, "cpu")
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    try:
        assert_legacy_caches_equal(kc, cpu.key_cache, "key_cache", fp8)
        assert_legacy_caches_equal(vc, cpu.value_cache, "value_cache", fp8)
    except AssertionError as e:
        return str(e)
    return None


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """``(id, check)`` per case: ``check()`` runs it and returns None or what differs."""
    return [(f"reshape_and_cache-{c.id}", lambda c=c: run_case(c)) for c in _cases()]

