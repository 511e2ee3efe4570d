"""Bounds-stressing cases of the MX writes for the memory checker (``python -m tools.sanitize``
runs every op's :func:`cases` under compute-sanitizer).

Each case runs the cuda implementation on the GPU and the torch reference on the CPU on the same
inputs (:func:`kvwrite.testing.mx.make_mx_inputs` is deterministic) and compares every byte of
the written allocations (mxfp8 NaN codes either way): padding and out-of-range slots, int32
slots, HND and packed data caches, inline rows, interleaved128 and permuted linear scale caches,
float8 storage, input rows past T, block sizes that are not powers of two, more tokens than one
resident wave.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.compare import copy_allocations
from kvwrite.testing.mx import MUTATES, MxCase, call_mx, make_mx_inputs, mx_differences

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    MxCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32,
           special_values=True),
    MxCase(kv_cache_dtype="mxfp4", num_tokens=129, num_heads=5, head_size=96, num_blocks=16,
           block_size=12, layout="HND", padding_slots=5, out_of_range_slots=4,
           special_values=True, scale_rule="floor"),
    MxCase(num_tokens=33, num_heads=8, head_size=128, layout="inline", extra_rows=5,
           cache_storage="float8", scale_storage="e8m0", out_of_range_slots=2),
    MxCase(kv_cache_dtype="mxfp4", num_tokens=300, num_heads=4, head_size=128, block_size=128,
           num_blocks=4, layout="HND-packed", scale_layout="interleaved128",
           scale_alloc="interleaved", padding_slots=7, out_of_range_slots=3),
    MxCase(num_tokens=17, num_heads=3, head_size=32, block_size=3, num_blocks=9,
           scale_alloc="permuted", dtype=torch.float32, padding_slots=2, out_of_range_slots=2),
    MxCase(kv_cache_dtype="mxfp4", num_tokens=40_000, num_heads=1, head_size=64,
           num_blocks=2600, padding_slots=100, out_of_range_slots=100),  # more than one wave
]


def run_case(case: MxCase) -> str | None:
    """None where the cuda implementation's bytes equal the reference's, else what differs."""
    gpu = make_mx_inputs(case, "cuda")
    cpu = make_mx_inputs(case, "cpu")
    call_mx(*gpu, implementation="cuda")
    torch.cuda.synchronize()
    call_mx(*cpu, implementation="torch")
    got = copy_allocations([gpu[i] for i in MUTATES], "cpu")
    why = mx_differences(case.kv_cache_dtype, got, [cpu[i] for i in MUTATES])
    return None if why is None else f"{case.id}: {why}"


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """(id, run) of every case: run() returns None where the whole allocations are byte-equal."""
    return [(c.id, (lambda c=c: run_case(c))) for c in CASES]
