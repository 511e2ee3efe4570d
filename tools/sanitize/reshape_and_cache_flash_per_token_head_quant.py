"""Memory-checker cases of reshape_and_cache_flash_per_token_head_quant's CUDA kernel.

:func:`cases` lists ``(id, check)`` pairs. Each ``check()`` runs the cuda implementation on the
GPU over a case that stresses the kernel's bounds (padding and out-of-range slots, rows past T,
unaligned and odd head sizes, narrow chunks and int4 codes paired across lanes, K and V of
different sizes, vLLM's rows with their inline scale bytes, a block size that is not a power of
two, heads that leave a warp partly idle, more tokens than one resident wave) and the torch
reference on the CPU over the same inputs (the case builder is deterministic), and returns None
when every allocation behind the four caches is byte-equal, else what differs. Run them under
``compute-sanitizer --tool memcheck``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.per_token_head import (
    FP8,
    INT4,
    INT8,
    PthCase,
    assert_pth_caches_equal,
    clone_pth_caches,
    make_pth_inputs,
)

__all__ = ["CASES", "cases", "run_case"]

CASES: list[PthCase] = [
    PthCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
    PthCase(kv_quant_mode=INT4, num_tokens=129, num_heads=5, head_size=46, head_size_v=80,
            num_blocks=16, layout="HND", alloc="separate", padding_slots=5,
            out_of_range_slots=4),
    PthCase(kv_quant_mode=FP8, num_tokens=33, num_heads=8, head_size=128, alloc="packed",
            vllm_rows=True, layout="HND", special_values=True, padding_slots=2,
            out_of_range_slots=2),
    PthCase(kv_quant_mode=INT4, num_tokens=7, extra_rows=5, fused_qkv=True, head_size=64,
            alloc="interleaved", vllm_rows=True),
    PthCase(kv_quant_mode=INT4, num_tokens=17, num_heads=3, head_size=30, head_pad=1,
            alloc="separate", row_pad=1),  # odd element offsets: codes paired across lanes
    PthCase(kv_quant_mode=INT8, num_tokens=5, num_heads=13, head_size=13, head_size_v=7,
            alloc="separate", block_size=12, num_blocks=3, padding_slots=1,
            dtype=torch.float32),
    PthCase(kv_quant_mode=FP8, num_tokens=9, num_heads=2, head_size=512, num_blocks=2,
            alloc="separate", out_of_range_slots=2),
    PthCase(kv_quant_mode=INT8, num_tokens=40_000, num_heads=1, head_size=64, num_blocks=2600,
            padding_slots=100, out_of_range_slots=100),  # more tokens than one resident wave
]


def run_case(case: PthCase) -> str | None:
    """Run the case (cuda on the GPU, torch on the CPU); None when both allocations agree."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import cuda_impl, reference
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.op import validate

    gpu = make_pth_inputs(case, "cuda")
    cpu = make_pth_inputs(case, "cpu")
    mode = validate(*gpu.args())
    if gpu.slot_mapping.numel():
        cuda_impl.run(gpu.key, gpu.value, *gpu.caches, gpu.slot_mapping, mode)
    torch.cuda.synchronize()
    want = clone_pth_caches(cpu.caches)
    if cpu.slot_mapping.numel():
        reference.run(cpu.key, cpu.value, *want, cpu.slot_mapping, mode)
    dq = (mode.quantized_size(case.dk), mode.quantized_size(case.dv))
    try:
        assert_pth_caches_equal(clone_pth_caches(gpu.caches, "cpu"), want, mode, dq)
    except AssertionError as e:
        return str(e)
    return None


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """``(id, check)`` for each case of :data:`CASES` (see the module doc)."""
    return [(case.id, (lambda c=case: run_case(c))) for case in CASES]
