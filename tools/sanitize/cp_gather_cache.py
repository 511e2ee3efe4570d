"""Memcheck cases of cp_gather_cache: the cuda implementation on the GPU against the torch one on
the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s SANITIZE_SEQS), entries
of several dtypes and shapes with permuted and padded strides, and unaligned rows.
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
    return lambda: cuda_against_reference("cp_gather_cache", lambda d: make_entry_inputs(case, d),
                                          lambda i: i.cp_args(), lambda i: (i.dst,))


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    out = [(name, _case(EntryCase(seqs=seqs))) for name, seqs in SANITIZE_SEQS.items()]
    s = SANITIZE_SEQS["bounds"]
    out += [
        ("3-dims-permuted", _case(EntryCase(seqs=s, entry=(3, 5, 7), dtype=torch.float16,
                                            entry_perm=(2, 0, 1)))),
        ("hnd-entry", _case(EntryCase(seqs=s, entry=(8, 24), dtype=torch.float32,
                                      entry_perm=(1, 0)))),
        ("odd-bytes-unaligned", _case(EntryCase(seqs=s, entry=(13,), dtype=torch.uint8,
                                                cache_pad=1, cache_offset=1, dst_pad=2,
                                                dst_offset=3))),
        ("complex128", _case(EntryCase(seqs=s, entry=(3,), dtype=torch.complex128))),
    ]
    return out
