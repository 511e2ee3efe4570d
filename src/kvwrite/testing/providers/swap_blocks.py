"""swap_blocks for the conformance suite (three- and four-argument forms; its rule against a
byte-offset oracle: tests/test_transfer.py)."""

from __future__ import annotations

import dataclasses

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced
from ..transfer import mapping
from .transfer_common import TransferCase, build, cases_of, skipping_last_pair, transfer_provider

OP = "swap_blocks"


def _args() -> dict:
    src, dst, m, _ = build(TransferCase("swap"), "cpu", 0)
    return {"src": src, "dst": dst, "block_mapping": m}


BAD = tuple(BadInput(*b) for b in [
    ("mapping dtype", replaced(_args, {"block_mapping": lambda a: a["block_mapping"].float()}),
     ValueError, "block_mapping: expected dtype int64 or int32, got torch.float32"),
    ("duplicate destination", replaced(_args, {"block_mapping": lambda a: mapping([[0, 1], [2, 1]])}),
     ValueError, "block_mapping: expected distinct destination ids"),
    ("block shape", replaced(_args, {"dst": lambda a: a["dst"][:, :, :1]}), ValueError,
     "dst: expected the block shape of src"),
    ("engine", replaced(_args, {"engine": lambda a: "copy"}), ValueError, "engine: expected one of"),
])

_SWAP = cases_of("swap")
_BYTES = cases_of("swap_bytes")
PROVIDER = transfer_provider(
    OP, mutates=1,
    cases=(*_SWAP, *(dataclasses.replace(ex, id="bytes-" + ex.id) for ex in _BYTES),
           Example("fp8-bits", TransferCase("swap", dtype=torch.float8_e5m2))),
    graph_cases=(Example("gpu-mapping", TransferCase("swap", gpu_mapping=True)),
                 Example("bytes-d2h", TransferCase("swap_bytes", gpu_mapping=True, host="dst"))),
    compile_cases=(Example("swap", TransferCase("swap")),),
    small_tile_cases=(Example("small-uint8", TransferCase("swap", dtype=torch.uint8)),
                      Example("small-bytes-float32", TransferCase("swap_bytes",
                                                                  dtype=torch.float32))),
    wrong=(WrongWriter("skips a pair", skipping_last_pair(OP), TransferCase("swap")),),
    bad=BAD)
