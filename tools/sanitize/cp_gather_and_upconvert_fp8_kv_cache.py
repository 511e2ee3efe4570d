"""Memcheck cases of cp_gather_and_upconvert_fp8_kv_cache: the cuda implementation on the GPU
against the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS as workspace starts), unaligned entries and rows, and any tile scales.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import torch

from kvwrite.testing.gather import SANITIZE_SEQS, Seqs, UpconvertCase, make_upconvert_inputs
from tools.sanitize import Cases, gather_cases

__all__ = ["cases"]


def cases() -> Cases:
    seqs = dict(SANITIZE_SEQS)
    # As workspace starts the last request ends at T_out: a decreasing set without overlap.
    seqs["gaps"] = Seqs(lens=(4, -12, 5), first=8, rows_past=-7, block_size=7, num_blocks=5,
                        cu_dtype=torch.int64, strided=True)
    s = seqs["bounds"]
    by_id = {
        **{name: UpconvertCase(seqs=q, scales="random") for name, q in seqs.items()},
        "unaligned": UpconvertCase(seqs=s, dtype=torch.float16, cache_pad=3, cache_offset=1,
                                   dst_pad=1, dst_offset=1),
        "transposed": UpconvertCase(seqs=s, cache_pad=16, cache_transposed=True,
                                    scales="special", fp8_storage="float8"),
    }
    # NaN-aware in columns 0..512 only (assert_outputs_equal's nan_cols).
    return gather_cases("cp_gather_and_upconvert_fp8_kv_cache", make_upconvert_inputs,
                        lambda c, i: i.args(), lambda i: (i.dst,), by_id,
                        nan=lambda c: slice(0, 512))
