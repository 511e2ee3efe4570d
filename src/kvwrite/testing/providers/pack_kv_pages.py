"""pack_kv_pages for the conformance suite (raw, fp8 and NVFP4 pages of two layers, every head or
a rank's slice, d2h; the page layout by hand: tests/test_transfer.py)."""

from __future__ import annotations

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced
from .transfer_common import TransferCase, build, page_cases, skipping_last_pair, transfer_provider

OP = "pack_kv_pages"


def _args() -> dict:
    caches, pages, m, hr, fmt, scale, _ = build(TransferCase("pack", page_format="fp8"), "cpu", 0)
    return {"caches": tuple(caches), "pages": pages, "block_mapping": m, "kv_split": 2,
            "head_range": hr, "page_format": fmt, "scale": scale}


BAD = tuple(BadInput(*b) for b in [
    ("scale none", replaced(_args, {"scale": lambda a: None}), ValueError,
     "scale: page_format='fp8_e4m3' needs a float32 tensor"),
    ("pages P", replaced(_args, {"pages": lambda a: a["pages"][:, :-16]}), ValueError,
     "pages: expected P a positive multiple of the head chunk"),
    ("kv_split", replaced(_args, {"kv_split": lambda a: 5}), ValueError,
     "kv_split: expected an int dividing C = 32, got 5"),
    ("ce", replaced(_args, {"engine": lambda a: "ce"}), ValueError,
     "engine: 'ce' copies raw bytes only"),
    ("cache dtype", replaced(_args, {"caches": lambda a: tuple(c.view(torch.int16) for c in a["caches"])}),
     ValueError, "caches[0]: page_format='fp8_e4m3' expects caches of dtype"),
])


def _cases():
    out = page_cases("pack")
    out.append(Example("fp8-slice", TransferCase("pack", page_format="fp8", head_range=(1, 3))))
    out.append(Example("nvfp4-float32-slice", TransferCase("pack", page_format="nvfp4",
                                                          dtype=torch.float32, head_range=(0, 2))))
    return tuple(out)


PROVIDER = transfer_provider(
    OP, mutates=1, cases=_cases(),
    graph_cases=(Example("fp8-d2h", TransferCase("pack", page_format="fp8", gpu_mapping=True,
                                                 host="dst")),
                 Example("nvfp4", TransferCase("pack", page_format="nvfp4", gpu_mapping=True))),
    compile_cases=(Example("fp8", TransferCase("pack", page_format="fp8")),),
    small_tile_cases=(
        Example("small-fp8-one-head",
                TransferCase("pack", page_format="fp8", head_range=(1, 2), layers=1)),
        Example("small-nvfp4-float16",
                TransferCase("pack", page_format="nvfp4", dtype=torch.float16, layers=1))),
    wrong=(WrongWriter("skips a pair", skipping_last_pair(OP), TransferCase("pack")),),
    bad=BAD)
