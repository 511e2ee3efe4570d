"""fused_rope_and_reshape_cache_flash's memcheck cases (``python -m tools.sanitize``): the cuda
implementation on the GPU against the torch reference on the CPU over the same inputs; query,
key, query_out and both caches compared byte for byte over their whole allocations. The cases
stress the bounds: bad positions and padding and out-of-range slots together, fewer cache tokens
than rotated ones, rows past T, odd head sizes and partial rotation, HND, interleaved and packed
caches, fp8 with per-head scales, query_out and rotate_key_in_place=False, more tokens than one
wave (the large-call build), padded heads."""

from __future__ import annotations

import torch

from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing.rope import RopeCase, make_rope_inputs
from kvwrite.testing.sanitize import SanitizeCase, compare_outputs

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    RopeCase(num_tokens=9, bad_positions=3, padding_slots=2, out_of_range_slots=2,
             slot_dtype=torch.int32, pos_dtype=torch.int32, extra_rows=2),
    RopeCase(num_tokens=21, cache_tokens=15, num_q_heads=5, num_heads=3, head_size=46,
             rot_dim=30, is_neox=False, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED,
             bad_positions=2, out_of_range_slots=3, fused_qkv=True),
    RopeCase(num_tokens=17, num_heads=4, head_size=128, kv_cache_dtype="fp8",
             per_head_scale=True, alloc=KVAlloc.PACKED, padding_slots=3, out_of_range_slots=2,
             query_out=True, rotate_key_in_place=False),
    RopeCase(num_tokens=12_000, num_q_heads=4, num_heads=1, head_size=64, num_blocks=1600,
             max_position=4096, bad_positions=4, padding_slots=50, out_of_range_slots=50,
             kv_cache_dtype="fp8_e5m2"),  # the large-call build, more tokens than one wave
    # padded heads, each tensor its own padding (value's and query_out's break 16-byte alignment)
    RopeCase(num_tokens=13, num_q_heads=4, num_heads=2, head_size=80, head_pad=(64, 64, 5, 7),
             query_out=True, kv_cache_dtype="fp8", bad_positions=2, padding_slots=2,
             dtype=torch.float16),
]


def run_case(case: RopeCase, device: str = "cuda",
             implementation: str = "cuda") -> str | None:
    """None when ``implementation`` on ``device`` writes the torch reference's bytes (on the
    CPU) for ``case``, else what differs."""
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import fused_rope_and_reshape_cache_flash

    gpu, cpu = make_rope_inputs(case, device), make_rope_inputs(case, "cpu")
    fused_rope_and_reshape_cache_flash(*gpu.fused_args(), **gpu.fused_kwargs(),
                                       implementation=implementation)
    fused_rope_and_reshape_cache_flash(*cpu.fused_args(), **cpu.fused_kwargs(),
                                       implementation="torch")
    names = ["query", "key", "key_cache", "value_cache"] + (["query_out"] if case.query_out
                                                             else [])
    cd = case.cache_dtype
    nan = {"key_cache": cd.fp8_dtype, "value_cache": cd.fp8_dtype} if cd.is_fp8 else None
    return compare_outputs({n: getattr(gpu, n) for n in names},
                           {n: getattr(cpu, n) for n in names}, nan)


def cases() -> list[SanitizeCase]:
    return [(c.id, lambda c=c: run_case(c)) for c in CASES]
