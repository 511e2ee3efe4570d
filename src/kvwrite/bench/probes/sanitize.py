"""``sanitize``: cases through both CUDA kernels that stress their bounds, for the memory checker.

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \\
        kvwrite-bench sanitize
    compute-sanitizer ... python -m kvwrite.bench sanitize     # from a checkout, PYTHONPATH=src

Each case runs the cuda implementation on the GPU and the torch reference on the CPU (the same
inputs: :func:`kvwrite.testing.make_inputs` is deterministic) and compares both whole caches byte
for byte. The cases stress the bounds: padding and out-of-range slots, rows that are not 16-byte
aligned (head size 46), HND, interleaved and packed caches, per-head fp8 scales, key/value rows
past T, slices of a fused qkv, rows split over several CTAs, a block size that is not a power of
two, and more tokens than one resident wave. Every case runs through the loop-free kernel and
through the grid-stride kernel (``CudaTuning.loop_free``). Exit status 1 on a mismatch (the
memory checker's own errors exit with its ``--error-exitcode``), 2 where it cannot run.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from ...layouts import KVAlloc, Layout
from ...ops.reshape_and_cache_flash import validate
from ...testing import Case, assert_caches_equal, clone_caches, make_inputs
from . import common

__all__ = ["CASES", "KERNELS", "run_cases", "build_parser", "main"]

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


def _tuning(kernel: str):
    from ...ops.reshape_and_cache_flash import cuda_impl

    return dataclasses.replace(cuda_impl.TUNING, loop_free=kernel == "loop-free")


def run_case(case: Case, kernel: str) -> str | None:
    """None when the cuda implementation (``kernel``: loop-free or grid-stride) writes the torch
    reference's bytes over both whole caches for ``case``, else what differs."""
    from ...ops.reshape_and_cache_flash import cuda_impl
    from ...ops.reshape_and_cache_flash import reference as torch_ref

    gpu = make_inputs(case, "cuda")
    cpu = make_inputs(case, "cpu")
    ref_k, ref_v = clone_caches(cpu)
    cd = validate(*cpu.args())
    scales = (cpu.k_scale, cpu.v_scale) if cd.is_fp8 else (None, None)
    torch_ref.run(cpu.key, cpu.value, ref_k, ref_v, cpu.slot_mapping, cd, *scales)
    gcd = validate(*gpu.args())
    gscales = (gpu.k_scale, gpu.v_scale) if gcd.is_fp8 else (None, None)
    cuda_impl.run(gpu.key, gpu.value, gpu.key_cache, gpu.value_cache, gpu.slot_mapping, gcd,
                  *gscales, tuning=_tuning(kernel))
    torch.cuda.synchronize()
    fp8 = cd.fp8_dtype if cd.is_fp8 else None
    got_k, got_v = clone_caches(gpu, "cpu")
    try:
        assert_caches_equal(got_k, ref_k, "key_cache", fp8, nan_equal=cd.is_fp8)
        assert_caches_equal(got_v, ref_v, "value_cache", fp8, nan_equal=cd.is_fp8)
    except AssertionError as e:
        return str(e)
    return None


def run_cases(cases=CASES, kernels=KERNELS, out=print) -> tuple[int, int]:
    """Every case through every kernel; ``out`` gets one line per run. Returns (runs, failures)."""
    from ... import registry
    from ...ops.reshape_and_cache_flash import OP

    reason = registry.get(OP, "cuda").available(torch.device("cuda"))
    if reason is not None:
        raise common.ProbeError(reason)
    runs = failures = 0
    for kernel in kernels:
        for case in cases:
            runs += 1
            diff = run_case(case, kernel)
            failures += diff is not None
            out(f"{'ok      ' if diff is None else 'MISMATCH'} {kernel:<11} {case.id}"
                + ("" if diff is None else f": {diff}"))
    out(f"{runs - failures}/{runs} runs match the torch reference")
    return runs, failures


def build_parser(prog: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description="Run cases that stress the bounds through both CUDA kernels and "
                               "compare whole caches with the torch reference; meant to run "
                               "under `compute-sanitizer --tool memcheck --report-api-errors no "
                               "--error-exitcode 3`.")


def main(argv: list[str], prog: str) -> int:
    build_parser(prog).parse_args(argv)
    common.require_gpu()
    _, failures = run_cases(out=lambda line: print(line, flush=True))
    return 1 if failures else 0
