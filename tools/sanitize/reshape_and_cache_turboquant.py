"""Memory-checker cases of reshape_and_cache_turboquant's CUDA kernel.

:func:`cases` lists ``(id, check)`` pairs. Each ``check()`` runs the cuda implementation on the
GPU over a case that stresses the kernel's bounds (padding and out-of-range slots, rows past T,
odd slot sizes whose pad byte must stay, head sizes that are no power of two, 3-bit fields, a
block size that is not a power of two, rows wider than the slot, more tokens than one resident
wave) and the torch reference on the CPU over the same inputs (the case builder is
deterministic), and returns None when the cache's whole allocation is byte-equal (NaNs whose
bits the contract leaves open aside), else what differs. Run them under ``compute-sanitizer
--tool memcheck``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.compare import copy_allocations
from kvwrite.testing.turboquant import (
    K3V4,
    K8V4,
    NC3,
    NC4,
    TqCase,
    assert_tq_caches_equal,
    make_tq_inputs,
)

__all__ = ["CASES", "cases", "run_case"]

CASES: list[TqCase] = [
    TqCase(kv_cache_dtype=NC4, num_tokens=9, padding_slots=3, out_of_range_slots=2,
           slot_dtype=torch.int32, head_size=128, special_values=True),
    TqCase(kv_cache_dtype=K8V4, num_tokens=17, num_heads=3, head_size=10, extra_rows=4,
           block_size=12, num_blocks=3, padding_slots=1, layout="NHD"),  # slot 19, pad byte
    TqCase(kv_cache_dtype=K3V4, num_tokens=33, num_heads=5, head_size=8, row_pad=3,
           head_pad=1, out_of_range_slots=2),  # slot 13
    TqCase(kv_cache_dtype=NC3, num_tokens=65, num_heads=8, head_size=96, num_blocks=8,
           special_values=True, pit_strided=True, dtype=torch.float32),
    TqCase(kv_cache_dtype=NC4, num_tokens=9, num_heads=2, head_size=256, num_blocks=2,
           out_of_range_slots=2, dtype=torch.float16),
    TqCase(kv_cache_dtype=K3V4, num_tokens=20_000, num_heads=1, head_size=64, num_blocks=1300,
           padding_slots=100, out_of_range_slots=100),  # more tokens than one resident wave
]


def run_case(case: TqCase) -> str | None:
    """Run the case (cuda on the GPU, torch on the CPU); None when both allocations agree."""
    from kvwrite.ops.reshape_and_cache_turboquant import cuda_impl, reference
    from kvwrite.ops.reshape_and_cache_turboquant.op import validate

    gpu = make_tq_inputs(case, "cuda")
    cpu = make_tq_inputs(case, "cpu")
    slot = validate(*gpu.args())
    tables = (gpu.PiT, gpu.midpoints) if slot.mse else (None, None)
    if gpu.slot_mapping.numel():
        cuda_impl.run(gpu.key, gpu.value, gpu.kv_cache, gpu.slot_mapping, slot, *tables)
    torch.cuda.synchronize()
    want = copy_allocations((cpu.kv_cache,))[0]
    tables = (cpu.PiT, cpu.midpoints) if slot.mse else (None, None)
    if cpu.slot_mapping.numel():
        reference.run(cpu.key, cpu.value, want, cpu.slot_mapping, slot, *tables)
    try:
        assert_tq_caches_equal(copy_allocations((gpu.kv_cache,), "cpu")[0], want, slot)
    except AssertionError as e:
        return str(e)
    return None


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """``(id, check)`` for each case of :data:`CASES` (see the module doc)."""
    return [(case.id, (lambda c=case: run_case(c))) for case in CASES]
