"""Memcheck cases of gather_cache_flash: the cuda implementation on the GPU against the torch one
on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s SANITIZE_SEQS), every
layout, per-head fp8 scales, odd head sizes and padded outputs.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import torch

from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing.gather import SANITIZE_SEQS, FlashCase, make_flash_inputs
from tools.sanitize import Cases, gather_cases

__all__ = ["cases"]


def cases() -> Cases:
    s = SANITIZE_SEQS["bounds"]
    by_id = {
        **{name: FlashCase(seqs=seqs, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED)
           for name, seqs in SANITIZE_SEQS.items()},
        "packed-fp8-per-head": FlashCase(seqs=s, alloc=KVAlloc.PACKED, kv_cache_dtype="fp8",
                                         per_head_scale=True),
        "odd-heads-padded": FlashCase(seqs=s, num_heads=3, head_size=20,
                                      kv_cache_dtype="fp8_e5m2", dtype=torch.float32,
                                      outputs="padded", layout=Layout.HND, alloc=KVAlloc.PACKED),
        "one-head-odd-size": FlashCase(seqs=s, num_heads=1, head_size=7, kv_cache_dtype="float16",
                                       dtype=torch.float16, outputs="fused"),
    }
    return gather_cases("gather_cache_flash", make_flash_inputs, lambda c, i: i.args(c),
                        lambda i: (i.key_out, i.value_out), by_id,
                        nan=lambda c: None if c.cache_dtype.is_fp8 else False)
