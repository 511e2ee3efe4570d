"""cp_gather_and_upconvert_fp8_kv_cache for the conformance suite (its row rule against the independent oracle:
tests/test_gather.py)."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache import reference as torch_ref

from ..conformance import BadInput, Example, Provider, WrongWriter
from ..gather import Seqs, UpconvertCase, assert_outputs_equal, graph_seqs, make_upconvert_inputs

OP = "cp_gather_and_upconvert_fp8_kv_cache"


def _case(case, seed: int):
    """A graph case is a function of the seed (new lengths, starts and block ids), else fixed."""
    return case(seed) if callable(case) else case


def _build(case, device, seed):
    case = _case(case, seed)
    inp = make_upconvert_inputs(case, device)
    return inp.args()


def _check(case, got, want) -> None:
    for name, g, w in zip(("dst",), got, want, strict=True):
        assert_outputs_equal(g, w, f"{OP} {name}", slice(0, 512))


# --- deliberately wrong writers: the reference's ``run`` replaced for one call --------------------

_real_run = torch_ref.run


def _via_reference(broken):
    def write(*args):
        torch_ref.run = broken
        try:
            kvwrite.cp_gather_and_upconvert_fp8_kv_cache(*args, implementation="torch")
        finally:
            torch_ref.run = _real_run
    return write


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


WRONG = (WrongWriter("tile-scales", _via_reference(_tile_scales_shifted), UpconvertCase()),)


# --- bad input -------------------------------------------------------------------------------------

def _up(**changes):
    def make():
        inp = make_upconvert_inputs(UpconvertCase(seqs=Seqs(starts=(1, 2, 3, 4, 5))))
        names = ("src_cache", "dst", "block_table", "workspace_starts", "batch_size",
                 "seq_starts")
        args = dict(zip(names, inp.args(), strict=True))
        for k, f in changes.items():
            args[k] = f(args)
        return (), args
    return make


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


PROVIDER = Provider(
    op=OP,
    call=kvwrite.cp_gather_and_upconvert_fp8_kv_cache,
    build=_build,
    mutates=(1,),
    mutated_names=("dst",),
    check=_check,
    graph_seeds=(0, 1),
    graph_cases=(Example("default", _graph_case),),
    compile_cases=(Example("default", UpconvertCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)))),),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
