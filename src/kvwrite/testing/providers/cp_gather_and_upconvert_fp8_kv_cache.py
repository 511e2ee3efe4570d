"""cp_gather_and_upconvert_fp8_kv_cache for the conformance suite (its row rule against the
independent oracle: tests/test_gather.py)."""

from __future__ import annotations

import torch

from kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache import reference as torch_ref

from ..conformance import BadInput, Example, WrongWriter, replaced, small_tiles
from ..gather import Seqs, UpconvertCase, graph_seqs, make_upconvert_inputs
from .gather_common import SMALL_SEQS, gather_provider, reference_run, via_reference

OP = "cp_gather_and_upconvert_fp8_kv_cache"


# --- deliberately wrong writers: the reference's ``run`` replaced for one call ---------------------

_real_run = reference_run(OP)


def _tile_scales_shifted(src_cache, dst, block_table, ws, num_req, seq_starts):
    """Dequantizes tile j with the scale of tile j + 1 (mod 4)."""
    ref = torch_ref
    real = ref.fp8_dequant

    def wrong(codes, fp8, s, out):
        return real(codes, fp8, s.roll(1, dims=1), out)
    ref.fp8_dequant = wrong
    try:
        _real_run(src_cache, dst, block_table, ws, num_req, seq_starts)
    finally:
        ref.fp8_dequant = real


WRONG = (WrongWriter("tile-scales", via_reference(OP, _tile_scales_shifted), UpconvertCase()),)


# --- bad input -------------------------------------------------------------------------------------

def _up_args() -> dict:
    inp = make_upconvert_inputs(UpconvertCase(seqs=Seqs(starts=(1, 2, 3, 4, 5))))
    names = ("src_cache", "dst", "block_table", "workspace_starts", "batch_size",
             "seq_starts")
    return dict(zip(names, inp.args(), strict=True))


def _up(**changes):
    return replaced(_up_args, changes)


BAD = tuple(BadInput(*b) for b in [
    ("up entry", _up(src_cache=lambda a: a["src_cache"][:, :, :576]), ValueError, "src_cache: expected shape [num_blocks, block_size, 656]"),
    ("up e5m2", _up(src_cache=lambda a: a["src_cache"].view(torch.float8_e5m2)), ValueError, "src_cache: expected dtype torch.uint8 or torch.float8_e4m3fn"),
    ("up dst width", _up(dst=lambda a: a["dst"][:, :512]), ValueError, "dst: expected shape [T_out, 576]"),
    ("up dst dtype", _up(dst=lambda a: a["dst"].float()), ValueError, "dst: expected dtype bfloat16 or float16"),
    ("up ws short", _up(workspace_starts=lambda a: a["workspace_starts"][:4]), ValueError, "workspace_starts: expected at least 5 entries"),
    ("up batch_size", _up(batch_size=lambda a: -2), ValueError, "batch_size: expected a non-negative int"),
    ("up table rows", _up(batch_size=lambda a: 6, seq_starts=lambda a: None, workspace_starts=lambda a: torch.zeros(6, dtype=torch.int32)), ValueError, "block_table: expected at least 6 entries"),
])


# --- CUDA graphs (new lengths, starts, block ids and scales between the seeds) --------------------

def _graph_case(seed: int) -> UpconvertCase:
    return UpconvertCase(seqs=graph_seqs(seed), seed=seed)


GRAPH_CASES = (Example("default", _graph_case),)
COMPILE_CASES = (Example("default", UpconvertCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)))),)

PROVIDER = gather_provider(OP, make_upconvert_inputs, lambda inp, case: inp.args(), mutates=(1,),
                           names=("dst",), nan=slice(0, 512), wrong=WRONG, bad=BAD,
                           graph_cases=GRAPH_CASES, compile_cases=COMPILE_CASES,
                           variants=10,
                           # Its entry is fixed (656 bytes to 576 elements): few rows only.
                           small_tile_cases=small_tiles(UpconvertCase(), dict(seqs=SMALL_SEQS)))
