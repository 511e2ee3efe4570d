"""Memcheck cases of gather_and_maybe_dequant_cache: the cuda implementation on the GPU against
the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS: out-of-range positions and block ids, rows no request owns, T_out below the total,
more rows than a wave, batches past the shared memory), unaligned odd entries and padded rows.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwrite.testing.gather import (
    SANITIZE_SEQS,
    EntryCase,
    cuda_against_reference,
    make_entry_inputs,
)

__all__ = ["cases"]


def _case(case: EntryCase) -> Callable[[], str | None]:
    return lambda: cuda_against_reference(
        "gather_and_maybe_dequant_cache", lambda d: make_entry_inputs(case, d),
        lambda i: i.dequant_args(case), lambda i: (i.dst,), None if case.fp8 else False)


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    out = []
    for name, seqs in SANITIZE_SEQS.items():
        out.append((f"{name}-auto", _case(EntryCase(seqs=seqs))))
        out.append((f"{name}-fp8", _case(EntryCase(seqs=seqs, kv_cache_dtype="fp8",
                                                   dtype=torch.float16))))
    s = SANITIZE_SEQS["bounds"]
    out += [
        ("odd-entry-unaligned", _case(EntryCase(seqs=s, entry=(33,), kv_cache_dtype="fp8_e5m2",
                                                dtype=torch.float32, cache_pad=1, cache_offset=1,
                                                dst_pad=3, dst_offset=1, dst_rows_extra=5))),
        ("transposed-padded", _case(EntryCase(seqs=s, entry=(320,), cache_transposed=True,
                                              cache_pad=16, dst_pad=8))),
    ]
    return out
