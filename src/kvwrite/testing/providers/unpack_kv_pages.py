"""unpack_kv_pages for the conformance suite (pages a pack wrote, raw, fp8 and NVFP4, into every
head or a rank's slice, h2d; the decodes by hand: tests/test_transfer.py)."""

from __future__ import annotations

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced
from .transfer_common import TransferCase, build, page_cases, skipping_last_pair, transfer_provider

OP = "unpack_kv_pages"


def _args() -> dict:
    pages, caches, m, hr, fmt, _ = build(TransferCase("unpack", page_format="nvfp4"), "cpu", 0)
    return {"pages": pages, "caches": tuple(caches), "block_mapping": m, "kv_split": 2,
            "head_range": hr, "page_format": fmt}


BAD = tuple(BadInput(*b) for b in [
    ("nvfp4 E", replaced(_args, {"kv_split": lambda a: 4}), ValueError,
     "page_format: 'nvfp4' expects E = C / kv_split a multiple of 16, got E = 8"),
    ("pages dtype", replaced(_args, {"pages": lambda a: a["pages"].view(torch.int8)}),
     ValueError, "pages: expected dtype uint8, got torch.int8"),
    ("same view twice", replaced(_args, {"caches": lambda a: (a["caches"][0], a["caches"][0])}),
     ValueError, "caches[1]: expected a destination apart from caches[0], got the same view"),
    ("page id", replaced(_args, {"block_mapping": lambda a: a["block_mapping"] + 7}), ValueError,
     "block_mapping: expected ids in [0, 7) in column 0 (the block count of pages)"),
])


def _cases():
    out = page_cases("unpack")
    out.append(Example("nvfp4-slice", TransferCase("unpack", page_format="nvfp4", head_range=(2, 4))))
    out.append(Example("fp8-float16-slice", TransferCase("unpack", page_format="fp8",
                                                        dtype=torch.float16, head_range=(1, 2))))
    return tuple(out)


PROVIDER = transfer_provider(
    OP, mutates=1, cases=_cases(),
    graph_cases=(Example("fp8-h2d", TransferCase("unpack", page_format="fp8", gpu_mapping=True,
                                                 host="src")),
                 Example("raw", TransferCase("unpack", gpu_mapping=True))),
    compile_cases=(Example("nvfp4", TransferCase("unpack", page_format="nvfp4")),),
    small_tile_cases=(
        Example("small-fp8-one-head",
                TransferCase("unpack", page_format="fp8", head_range=(1, 2), layers=1)),
        Example("small-nvfp4-float16",
                TransferCase("unpack", page_format="nvfp4", dtype=torch.float16, layers=1))),
    wrong=(WrongWriter("skips a pair", skipping_last_pair(OP), TransferCase("unpack")),),
    bad=BAD)
