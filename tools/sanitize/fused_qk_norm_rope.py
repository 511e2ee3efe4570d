"""Memory-checker cases of fused_qk_norm_rope's cuda implementation: :func:`cases` lists
``(id, run)`` pairs; ``run()`` runs the cuda implementation on the GPU over a case that stresses
its bounds and the torch reference on the CPU over the same inputs, and returns None when qkv's
whole allocation holds the same bytes, else what differs. ``python -m tools.sanitize`` runs them
under compute-sanitizer. Each case runs in the build its call takes and, with the id's suffix
"-large", in the large-call build (cuda_impl.CudaTuning: two chunks per lane, 64-thread CTAs).

The cases: positions out of range (negative, past the table, the int32 extremes), rows past
T_rot, head sizes whose rows are not 16-byte aligned (46, 6) or not a power of two (80), token
strides of an odd number of elements, padded heads (head strides of 81 and 192 elements), D =
512 (one warp per head), partial rotary down to one pair, int32 positions, no weights, and more
tokens than one resident wave.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from kvwrite.testing.qk_norm import (
    QkNormCase,
    clone_inputs,
    differences,
    make_qk_norm_inputs,
)

__all__ = ["CASES", "cases", "run_case", "sides", "with_large_builds"]

CASES = [
    QkNormCase(num_tokens=9, bad_positions=4, extra_rows=5, pos_dtype=torch.int32),
    QkNormCase(num_tokens=33, head_size=46, rot_dim=18, num_q_heads=5, num_k_heads=3,
               row_pad=1, bad_positions=3),
    QkNormCase(num_tokens=17, head_size=80, rot_dim=20, is_neox=False, dtype=torch.float32,
               row_pad=3, q_weight=None),
    QkNormCase(num_tokens=6, head_size=6, rot_dim=2, num_q_heads=7, num_k_heads=1,
               dtype=torch.bfloat16, k_weight=torch.float32, weight_offset=1.0),
    QkNormCase(num_tokens=5, head_size=512, num_q_heads=3, num_k_heads=2, dtype=torch.float32,
               bad_positions=1, extra_rows=2),
    QkNormCase(num_tokens=20, head_size=128, num_q_heads=32, num_k_heads=8,
               dtype=torch.bfloat16, flat=True, bad_positions=2),
    QkNormCase(num_tokens=13, head_size=80, head_pad=1, num_q_heads=5, num_k_heads=3,
               dtype=torch.bfloat16, bad_positions=2),
    QkNormCase(num_tokens=11, head_size=128, head_pad=64, num_q_heads=8, num_k_heads=2,
               dtype=torch.bfloat16),
    QkNormCase(num_tokens=40_000, head_size=64, num_q_heads=4, num_k_heads=1, num_v_heads=1,
               dtype=torch.bfloat16, max_position=4096, bad_positions=50),
]


def sides(case: QkNormCase, cuda_impl, reference, large: bool) -> list[tuple]:
    """``[(want, run), (got, run)]``: the torch reference on the CPU and the cuda implementation
    on the GPU (with ``large``, in its large-call build whatever the call's size) over ``case``'s
    inputs, built once on the CPU and moved whole (every allocation once, its views re-created),
    so that the two sides have the same allocations, views and bytes to start from. For both
    QK-norm ops."""
    tuning = dataclasses.replace(cuda_impl.TUNING, large_call_bytes=0) if large else \
        cuda_impl.TUNING
    want = make_qk_norm_inputs(case, "cpu")
    got = clone_inputs(want, "cuda")
    return [(want, reference.run), (got, functools.partial(cuda_impl.run, tuning=tuning))]


def with_large_builds(cases: list[QkNormCase], run_case) -> list[tuple[str, Callable]]:
    """Each case in the build its call takes, and (but for those of more tokens than a wave,
    which take it anyway) in the large-call build (id suffix "-large"). For both QK-norm ops."""
    out = [(case.id, lambda case=case: run_case(case)) for case in cases]
    out += [(case.id + "-large", lambda case=case: run_case(case, large=True)) for case in cases
            if case.num_tokens < 10_000]
    return out


def run_case(case: QkNormCase, large: bool = False) -> str | None:
    """None when the cuda implementation writes the torch reference's bytes for ``case``; with
    ``large``, in its large-call build whatever the call's size."""
    from kvwrite.ops.fused_qk_norm_rope import cuda_impl, reference
    from kvwrite.ops.fused_qk_norm_rope.op import validate

    (want, _), (got, _) = pairs = sides(case, cuda_impl, reference, large)
    for inp, run in pairs:
        view, eps, offset = validate(*inp.norm_args(), weight_offset=inp.weight_offset)
        if inp.position_ids.numel():
            run(view, inp.num_heads_q, inp.num_heads_k, eps, inp.q_weight, inp.k_weight,
                inp.cos_sin_cache, inp.is_neox, inp.position_ids, offset)
    torch.cuda.synchronize()
    return differences(got, want, names=("qkv",))


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    return with_large_builds(CASES, run_case)
