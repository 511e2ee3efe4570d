"""Memory-checker cases of fused_qk_norm_rope_and_reshape_cache_flash's cuda implementation:
:func:`cases` lists ``(id, run)`` pairs; ``run()`` runs the cuda implementation on the GPU over a
case that stresses its bounds and the torch reference on the CPU over the same inputs, and
returns None when every tensor the call touches (qkv, query_out, both caches, whole allocations)
holds the same bytes, else what differs. ``python -m tools.sanitize`` runs them under
compute-sanitizer. Each case runs in the build its call takes and, with the id's suffix
"-large", in the large-call build (cuda_impl.CudaTuning: two chunks per lane, 64-thread CTAs).

The cases: padding and out-of-range slots, positions out of range, T < T_rot and T = 0, rows
past T_rot, head sizes whose rows are not 16-byte aligned (46, 6) or not a power of two (80),
D = 512, odd token strides, padded heads (head strides of 81 and 192 elements), HND,
interleaved and packed caches, a block size that is not a power of two, per-head fp8 scales,
fp8 query_out with per-head scales, query_out in a spare region of
qkv's allocation, int32 slots and positions, and more tokens than one resident wave.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing.qk_norm import QkNormCase, differences

from .fused_qk_norm_rope import sides, with_large_builds

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    QkNormCase(num_tokens=20, padding_slots=3, out_of_range_slots=3, bad_positions=3,
               slot_dtype=torch.int32, pos_dtype=torch.int32, kv_cache_dtype="fp8",
               num_blocks=2, extra_rows=4),
    QkNormCase(num_tokens=33, cache_tokens=20, head_size=46, rot_dim=18, num_q_heads=5,
               num_k_heads=3, row_pad=1, layout=Layout.HND, alloc=KVAlloc.PACKED,
               out_of_range_slots=4, num_blocks=3),
    QkNormCase(num_tokens=17, head_size=80, rot_dim=20, is_neox=False, dtype=torch.float32,
               kv_cache_dtype="fp8_e5m2", per_head_scale=True, block_size=12, num_blocks=3,
               alloc=KVAlloc.INTERLEAVED, query_out="fp8_e4m3", q_scale_per_head=True),
    QkNormCase(num_tokens=6, head_size=6, rot_dim=2, num_q_heads=7, num_k_heads=1,
               dtype=torch.bfloat16, kv_cache_dtype="float32", block_size=5, num_blocks=2,
               query_out="spare", rotate_key_in_place=False),
    QkNormCase(num_tokens=5, head_size=512, num_q_heads=3, num_k_heads=2, dtype=torch.float32,
               kv_cache_dtype="bfloat16", bad_positions=1, num_blocks=1, query_out="same"),
    QkNormCase(num_tokens=9, cache_tokens=0, head_size=128, num_q_heads=32, num_k_heads=8,
               dtype=torch.bfloat16, kv_cache_dtype="fp8"),
    QkNormCase(num_tokens=13, head_size=80, head_pad=1, num_q_heads=5, num_k_heads=3,
               dtype=torch.bfloat16, kv_cache_dtype="fp8", num_blocks=2, query_out="spare",
               bad_positions=2),
    QkNormCase(num_tokens=11, head_size=128, head_pad=64, num_q_heads=8, num_k_heads=2,
               dtype=torch.bfloat16, layout=Layout.HND, num_blocks=2),
    QkNormCase(num_tokens=40_000, head_size=64, num_q_heads=4, num_k_heads=1,
               dtype=torch.bfloat16, max_position=4096, bad_positions=50, block_size=16,
               num_blocks=2600, padding_slots=100, out_of_range_slots=100,
               kv_cache_dtype="fp8", alloc=KVAlloc.PACKED),
]


def run_case(case: QkNormCase, large: bool = False) -> str | None:
    """None when the cuda implementation writes the torch reference's bytes for ``case``; with
    ``large``, in its large-call build whatever the call's size."""
    from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl, reference
    from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash.op import validate

    (want, _), (got, _) = pairs = sides(case, cuda_impl, reference, large)
    for inp, run in pairs:
        view, eps, offset, cache_dtype, qo, qs = validate(*inp.fused_args(),
                                                          **inp.fused_kwargs())
        scales = (inp.k_scale, inp.v_scale) if cache_dtype.is_fp8 else (None, None)
        if inp.position_ids.numel():
            run(view, inp.num_heads_q, inp.num_heads_k, eps, inp.q_weight, inp.k_weight,
                inp.cos_sin_cache, inp.is_neox, inp.position_ids, offset, inp.key_cache,
                inp.value_cache, inp.slot_mapping, cache_dtype, *scales,
                inp.rotate_key_in_place, qo, qs)
    torch.cuda.synchronize()
    return differences(got, want)


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """Each case in the build its call takes, and in the large-call build (as the norm op's)."""
    return with_large_builds(CASES, run_case)
