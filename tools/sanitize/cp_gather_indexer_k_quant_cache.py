"""Memcheck cases of cp_gather_indexer_k_quant_cache: the cuda implementation on the GPU against
the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS without seq_starts), padded and unaligned pages, strided outputs.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import dataclasses

import torch

from kvwrite.testing.gather import SANITIZE_SEQS, IndexerCase, make_indexer_inputs
from tools.sanitize import Cases, gather_cases

__all__ = ["cases"]


def cases() -> Cases:
    seqs = {k: dataclasses.replace(s, starts=None) for k, s in SANITIZE_SEQS.items()}
    s = seqs["bounds"]
    by_id = {
        **{name: IndexerCase(seqs=q, scale_dtype=torch.float32) for name, q in seqs.items()},
        "strided-unaligned": IndexerCase(seqs=s, k_layout="strided", scale_layout="strided",
                                         scale_dtype=torch.float32, page_pad=3, cache_offset=1),
        "odd-dims": IndexerCase(seqs=s, head_dim=24, groups=3, page_pad=1, cache_offset=2,
                                k_layout="padded"),
    }
    return gather_cases("cp_gather_indexer_k_quant_cache", make_indexer_inputs,
                        lambda c, i: i.args(), lambda i: (i.dst_k, i.dst_scale), by_id)
