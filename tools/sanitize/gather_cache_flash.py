"""Memcheck cases of gather_cache_flash: the cuda implementation on the GPU against the torch one
on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s SANITIZE_SEQS), every
layout, per-head fp8 scales, odd head sizes and padded outputs.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing.gather import (
    SANITIZE_SEQS,
    FlashCase,
    cuda_against_reference,
    make_flash_inputs,
)

__all__ = ["cases"]


def _case(case: FlashCase) -> Callable[[], str | None]:
    return lambda: cuda_against_reference(
        "gather_cache_flash", lambda d: make_flash_inputs(case, d),
        lambda i: i.args(case), lambda i: (i.key_out, i.value_out),
        None if case.cache_dtype.is_fp8 else False)


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    out = [(name, _case(FlashCase(seqs=seqs, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED)))
           for name, seqs in SANITIZE_SEQS.items()]
    s = SANITIZE_SEQS["bounds"]
    out += [
        ("packed-fp8-per-head", _case(FlashCase(seqs=s, alloc=KVAlloc.PACKED,
                                                kv_cache_dtype="fp8", per_head_scale=True))),
        ("odd-heads-padded", _case(FlashCase(seqs=s, num_heads=3, head_size=20,
                                             kv_cache_dtype="fp8_e5m2", dtype=torch.float32,
                                             outputs="padded", layout=Layout.HND,
                                             alloc=KVAlloc.PACKED))),
        ("one-head-odd-size", _case(FlashCase(seqs=s, num_heads=1, head_size=7,
                                              kv_cache_dtype="float16", dtype=torch.float16,
                                              outputs="fused"))),
    ]
    return out
