"""swap_blocks_multi_layer for the conformance suite (each layer its own block shape and
dtype-sized strides; its rule against a byte-offset oracle: tests/test_transfer.py)."""

from __future__ import annotations

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced
from .transfer_common import TransferCase, build, cases_of, skipping_last_pair, transfer_provider

OP = "swap_blocks_multi_layer"


def _args() -> dict:
    src, dst, m, _ = build(TransferCase("multi"), "cpu", 0)
    return {"src_caches": src, "dst_caches": tuple(dst), "block_mapping": m}


BAD = tuple(BadInput(*b) for b in [
    ("lengths", replaced(_args, {"dst_caches": lambda a: a["dst_caches"][:1]}), ValueError,
     "dst_caches: expected 2 tensors (as many as src_caches), got 1"),
    ("last layer's shape", replaced(_args, {"dst_caches": lambda a: (a["dst_caches"][0], a["dst_caches"][1][:, :2])}),
     ValueError, "dst_caches[1]: expected the block shape of src_caches[1]"),
    ("max_ctas", replaced(_args, {"max_ctas": lambda a: -1}), ValueError,
     "max_ctas: expected None or an int >= 1, got -1"),
])

PROVIDER = transfer_provider(
    OP, mutates=1, cases=cases_of("multi"),
    graph_cases=(Example("gpu-mapping", TransferCase("multi", gpu_mapping=True)),
                 Example("h2d", TransferCase("multi", gpu_mapping=True, host="src"))),
    compile_cases=(Example("two-layers", TransferCase("multi")),),
    small_tile_cases=(Example("small-one-layer-uint8",
                              TransferCase("multi", dtype=torch.uint8, layers=1)),),
    wrong=(WrongWriter("skips a pair", skipping_last_pair(OP), TransferCase("multi")),),
    bad=BAD)
