"""Memcheck cases of cp_gather_indexer_k_quant_cache: the cuda implementation on the GPU against
the torch one on the CPU over inputs that stress the bounds (``kvwrite.testing.gather``'s
SANITIZE_SEQS without seq_starts), padded and unaligned pages, strided outputs.
``python -m tools.sanitize`` runs every op's ``cases()`` under compute-sanitizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvwrite.testing.gather import (
    SANITIZE_SEQS,
    IndexerCase,
    cuda_against_reference,
    make_indexer_inputs,
)

__all__ = ["cases"]


def _case(case: IndexerCase) -> Callable[[], str | None]:
    return lambda: cuda_against_reference(
        "cp_gather_indexer_k_quant_cache", lambda d: make_indexer_inputs(case, d),
        lambda i: i.args(), lambda i: (i.dst_k, i.dst_scale))


def cases() -> list[tuple[str, Callable[[], str | None]]]:
    seqs = {k: dataclasses.replace(s, starts=None) for k, s in SANITIZE_SEQS.items()}
    out = [(name, _case(IndexerCase(seqs=s, scale_dtype=torch.float32)))
           for name, s in seqs.items()]
    s = seqs["bounds"]
    out += [
        ("strided-unaligned", _case(IndexerCase(seqs=s, k_layout="strided",
                                                scale_layout="strided",
                                                scale_dtype=torch.float32, page_pad=3,
                                                cache_offset=1))),
        ("odd-dims", _case(IndexerCase(seqs=s, head_dim=24, groups=3, page_pad=1,
                                       cache_offset=2, k_layout="padded"))),
    ]
    return out
