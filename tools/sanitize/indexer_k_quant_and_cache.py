"""Cases for the memory checker: each runs the cuda implementation of indexer_k_quant_and_cache on
the GPU over a case that stresses its bounds (padding and out-of-range slots, unaligned pages and
k rows, odd group sizes, one-slot blocks, k rows past T, more tokens than one wave, "mxfp8"
scale bytes) and the torch reference on the CPU on the same inputs, and returns None when the
whole caches are byte-equal, else what differs.

    compute-sanitizer --tool memcheck ... python -m tools.sanitize   # runs every op's cases()
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["cases", "run_case"]


def _cases():
    from kvwrite.testing.indexer import IndexerCase
    return [
        IndexerCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
        IndexerCase(num_tokens=129, k_pad=1, page_pad=3, cache_offset=1, extra_rows=5,
                    padding_slots=5, out_of_range_slots=4, block_size=7, num_blocks=24),
        IndexerCase(num_tokens=65, head_dim=80, quant_block_size=16, dtype=torch.float32,
                    block_size=1, num_blocks=70, out_of_range_slots=3, scale_fmt="float32"),
        IndexerCase(num_tokens=33, head_dim=6, quant_block_size=3, k_pad=1, page_pad=1,
                    cache_offset=3, out_of_range_slots=2, special_values=True),
        IndexerCase(num_tokens=40, head_dim=512, quant_block_size=512, block_size=8,
                    num_blocks=6, special_values=True, dtype=torch.float32),
        IndexerCase(num_tokens=70000, block_size=64, num_blocks=1100, padding_slots=100,
                    out_of_range_slots=100),
        # "mxfp8" exponent bytes on unaligned pages (byte-by-byte scale stores), two groups.
        IndexerCase(num_tokens=33, head_dim=256, scale_fmt="mxfp8", k_pad=1, page_pad=1,
                    cache_offset=3, block_size=5, num_blocks=9, out_of_range_slots=2,
                    special_values=True, slot_dtype=torch.int32),
    ]


def run_case(case) -> str | None:
    """None when the cuda implementation (GPU) and the reference (CPU) write the same bytes."""
    from kvwrite.ops.indexer_k_quant_and_cache import indexer_k_quant_and_cache
    from kvwrite.testing.indexer import (
        assert_indexer_caches_equal,
        clone_cache,
        make_indexer_inputs,
    )
    gpu = make_indexer_inputs(case, "cuda")
    cpu = make_indexer_inputs(case, "cpu")
    indexer_k_quant_and_cache(*gpu.args(), implementation="cuda")
    indexer_k_quant_and_cache(*cpu.args(), implementation="torch")
    torch.cuda.synchronize()
    try:
        assert_indexer_caches_equal(clone_cache(gpu.kv_cache, "cpu"), cpu.kv_cache, case.head_dim)
    except AssertionError as e:
        return str(e)
    return None


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    """``(id, check)`` per case: ``check()`` runs it and returns None or what differs."""
    return [(f"indexer_k_quant_and_cache-{c.id}", lambda c=c: run_case(c)) for c in _cases()]

