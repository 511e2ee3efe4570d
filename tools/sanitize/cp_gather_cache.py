"""Memcheck cases of cp_gather_cache: the cuda implementation on the GPU against the torch one on
the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s SANITIZE_SEQS), entries
of several dtypes and shapes with permuted and padded strides, and unaligned rows.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import torch

from kvwrite.testing.gather import SANITIZE_SEQS, EntryCase, make_entry_inputs
from tools.sanitize import Cases, gather_cases

__all__ = ["cases"]


def cases() -> Cases:
    s = SANITIZE_SEQS["bounds"]
    by_id = {
        **{name: EntryCase(seqs=seqs) for name, seqs in SANITIZE_SEQS.items()},
        "3-dims-permuted": EntryCase(seqs=s, entry=(3, 5, 7), dtype=torch.float16,
                                     entry_perm=(2, 0, 1)),
        "hnd-entry": EntryCase(seqs=s, entry=(8, 24), dtype=torch.float32, entry_perm=(1, 0)),
        "odd-bytes-unaligned": EntryCase(seqs=s, entry=(13,), dtype=torch.uint8, cache_pad=1,
                                         cache_offset=1, dst_pad=2, dst_offset=3),
        "complex128": EntryCase(seqs=s, entry=(3,), dtype=torch.complex128),
    }
    return gather_cases("cp_gather_cache", make_entry_inputs, lambda c, i: i.cp_args(),
                        lambda i: (i.dst,), by_id)
