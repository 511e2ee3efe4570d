"""relayout_kv_cache for the conformance suite (vLLM's order against a dense one, every head or
a rank's slice; its rule against a byte-offset oracle: tests/test_transfer.py)."""

from __future__ import annotations

import dataclasses

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced
from .transfer_common import TransferCase, build, cases_of, skipping_last_pair, transfer_provider

OP = "relayout_kv_cache"


def _args() -> dict:
    src, dst, m, hr, _ = build(TransferCase("relayout", head_range=(1, 3)), "cpu", 0)
    return {"src": src, "dst": dst, "block_mapping": m, "head_range": hr}


BAD = tuple(BadInput(*b) for b in [
    ("head_range", replaced(_args, {"head_range": lambda a: (1, 6)}), ValueError,
     "head_range: (1, 6) expects src[0] with 5 heads (the slice) or at least 6 (full), got 4"),
    ("no head_range", replaced(_args, {"head_range": lambda a: None}), ValueError,
     "dst[0]: expected 4 heads (those of src[0]; or pass head_range), got 2"),
    ("dims", replaced(_args, {"dst": lambda a: [d[0] for d in a["dst"]]}), ValueError,
     "dst[0]: expected 4 dims (num_blocks, H, N, C)"),
])

_FULL = cases_of("relayout")
_SLICE = cases_of("relayout", head_range=(1, 3))
PROVIDER = transfer_provider(
    OP, mutates=1,
    cases=(*_FULL, *(dataclasses.replace(ex, id="slice-" + ex.id) for ex in _SLICE)),
    graph_cases=(Example("slice", TransferCase("relayout", gpu_mapping=True, head_range=(1, 3))),),
    compile_cases=(Example("slice", TransferCase("relayout", head_range=(2, 4))),),
    small_tile_cases=(
        Example("small-one-head-uint8",
                TransferCase("relayout", dtype=torch.uint8, head_range=(1, 2), layers=1)),),
    wrong=(WrongWriter("skips a pair", skipping_last_pair(OP), TransferCase("relayout")),),
    bad=BAD)
