"""Bounds-stressing cases of the NVFP4 writes for the memory checker (``python -m tools.sanitize``
runs every op's :func:`cases` under compute-sanitizer).

Each case runs the cuda implementation on the GPU and the torch reference on the CPU on the same
inputs (:func:`kvwrite.testing.nvfp4.make_nvfp4_inputs` is deterministic) and compares every byte
of the written allocations: padding and out-of-range slots, inputs and pages that are not 16- or
8-byte aligned (the element-wise build), HND pages with swizzled V scales, FlashInfer's padded
and stacked tensors with Python-number scales, input rows past T, slices of a fused qkv, block
sizes that are not powers of two, the 4over6 rule, more tokens than one resident wave, the
small calls' kernel with a partial last warp, the mid-sized calls' one group of one side a thread,
the wide calls' group of K and V a thread (with its per-CTA table and threads past the last
token) and the large calls' two groups a thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.nvfp4 import Nvfp4Case, clone_inputs, make_nvfp4_inputs

__all__ = ["CASES", "cases", "run_case"]

CASES = [
    Nvfp4Case(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
    Nvfp4Case(num_tokens=129, num_heads=5, head_size=80, num_blocks=16, block_size=12,
              layout="HND", padding_slots=5, out_of_range_slots=4, special_values=True),
    Nvfp4Case(num_tokens=33, num_heads=8, head_size=128, layout="HND", v_scale_layout="swizzled",
              kv_cache_dtype="nvfp4_4over6", extra_rows=5, qkv_slices=True,
              out_of_range_slots=2),
    Nvfp4Case(num_tokens=17, num_heads=3, head_size=48, misaligned=True, pad=5, block_size=3,
              num_blocks=9, padding_slots=2, out_of_range_slots=2),
    Nvfp4Case(form="padded", pad=3, misaligned=True, num_tokens=21, head_size=256, num_heads=2,
              layout="HND", scale_as_number=True, out_of_range_slots=3),
    Nvfp4Case(form="stacked", num_tokens=40, num_heads=4, head_size=64, block_size=1,
              num_blocks=64, dtype=torch.float32, special_values=True, padding_slots=4),
    Nvfp4Case(num_tokens=40_000, num_heads=1, head_size=64, num_blocks=2600, padding_slots=100,
              out_of_range_slots=100, v_scale_layout="swizzled"),  # more than one wave
    # The small calls' kernel with a partial last warp (3 tokens x 2 sides x 6 groups x 4 parts).
    Nvfp4Case(num_tokens=3, num_heads=3, head_size=32, block_size=4, num_blocks=2,
              padding_slots=1, special_values=True),
    # A mid-sized call (12600 groups of K): one group of one side a thread (HND, D/16 = 6).
    Nvfp4Case(num_tokens=700, num_heads=3, head_size=96, layout="HND", num_blocks=50,
              padding_slots=5, out_of_range_slots=7, special_values=True),
    # A wide call (2^16 < 127360 <= 2^18 groups of K: 1990 tokens of 64): a group of K and V a
    # thread, the last CTA part past the last token; swizzled V scales, special values.
    Nvfp4Case(num_tokens=1990, num_heads=8, head_size=128, num_blocks=130,
              v_scale_layout="swizzled", padding_slots=20, out_of_range_slots=30,
              special_values=True),
    # A large call (360000 groups of K): two groups a thread, out-of-range and padding slots.
    Nvfp4Case(num_tokens=20_000, num_heads=3, head_size=96, layout="HND", num_blocks=1300,
              padding_slots=50, out_of_range_slots=70, special_values=True),
]


def run_case(case: Nvfp4Case) -> str | None:
    """None where the cuda implementation's bytes equal the reference's, else what differs."""
    gpu = make_nvfp4_inputs(case, "cuda")
    cpu = make_nvfp4_inputs(case, "cpu")
    gpu.call("cuda")
    torch.cuda.synchronize()
    cpu.call("torch")
    got = clone_inputs(gpu, "cpu").tensors()
    for i, (a, b) in enumerate(zip(got, cpu.tensors(), strict=True)):
        x, y = storage_bytes(a), storage_bytes(b)
        if x.numel() != y.numel():
            return f"{case.id}: tensor {i}: allocation sizes differ ({x.numel()} vs {y.numel()})"
        diff = torch.nonzero(x != y).flatten()
        if diff.numel():
            first = diff[:6].tolist()
            return (f"{case.id}: tensor {i}: {diff.numel()} bytes differ, first at {first}: "
                    f"got {x[diff[:6]].tolist()}, expected {y[diff[:6]].tolist()}")
    return None


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """(id, run) of every case: run() returns None where the whole allocations are byte-equal."""
    return [(c.id, (lambda c=c: run_case(c))) for c in CASES]
