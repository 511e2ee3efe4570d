"""Memcheck cases of gather_and_maybe_dequant_cache: the cuda implementation on the GPU against
the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS: out-of-range positions and block ids, rows no request owns, T_out below the total,
more rows than a wave, batches past the shared memory), unaligned odd entries and padded rows.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import torch

from kvwrite.testing.gather import SANITIZE_SEQS, EntryCase, make_entry_inputs
from tools.sanitize import Cases, gather_cases

__all__ = ["cases"]


def cases() -> Cases:
    by_id = {}
    for name, seqs in SANITIZE_SEQS.items():
        by_id[f"{name}-auto"] = EntryCase(seqs=seqs)
        by_id[f"{name}-fp8"] = EntryCase(seqs=seqs, kv_cache_dtype="fp8", dtype=torch.float16)
    s = SANITIZE_SEQS["bounds"]
    by_id["odd-entry-unaligned"] = EntryCase(seqs=s, entry=(33,), kv_cache_dtype="fp8_e5m2",
                                             dtype=torch.float32, cache_pad=1, cache_offset=1,
                                             dst_pad=3, dst_offset=1, dst_rows_extra=5)
    by_id["transposed-padded"] = EntryCase(seqs=s, entry=(320,), cache_transposed=True,
                                           cache_pad=16, dst_pad=8)
    return gather_cases("gather_and_maybe_dequant_cache", make_entry_inputs,
                        lambda c, i: i.dequant_args(c), lambda i: (i.dst,), by_id,
                        nan=lambda c: None if c.fp8 else False)
