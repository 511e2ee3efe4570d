"""Memcheck cases of cp_gather_and_upconvert_fp8_kv_cache: the cuda implementation on the GPU
against the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS as workspace starts), unaligned entries and rows, and any tile scales.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.gather import (
    SANITIZE_SEQS,
    Seqs,
    UpconvertCase,
    cuda_against_reference,
    make_upconvert_inputs,
)

__all__ = ["cases"]


def _case(case: UpconvertCase) -> Callable[[], str | None]:
    return lambda: cuda_against_reference(
        "cp_gather_and_upconvert_fp8_kv_cache", lambda d: make_upconvert_inputs(case, d),
        lambda i: i.args(), lambda i: (i.dst,), slice(0, 512))


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    seqs = dict(SANITIZE_SEQS)
    # As workspace starts the last request ends at T_out: a decreasing set without overlap.
    seqs["gaps"] = Seqs(lens=(4, -12, 5), first=8, rows_past=-7, block_size=7, num_blocks=5,
                        cu_dtype=torch.int64, strided=True)
    out = [(name, _case(UpconvertCase(seqs=s, scales="random"))) for name, s in seqs.items()]
    s = seqs["bounds"]
    out += [
        ("unaligned", _case(UpconvertCase(seqs=s, dtype=torch.float16, cache_pad=3,
                                          cache_offset=1, dst_pad=1, dst_offset=1))),
        ("transposed", _case(UpconvertCase(seqs=s, cache_pad=16, cache_transposed=True,
                                           scales="special", fp8_storage="float8"))),
    ]
    return out
