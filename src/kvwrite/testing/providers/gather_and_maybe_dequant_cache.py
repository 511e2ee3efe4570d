"""gather_and_maybe_dequant_cache for the conformance suite (its row rule against the
independent oracle: tests/test_gather.py)."""

from __future__ import annotations

import functools

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced, small_tiles
from ..gather import EntryCase, Seqs, graph_seqs, make_entry_inputs
from .gather_common import SMALL_SEQS, gather_provider, reference_run, via_reference

OP = "gather_and_maybe_dequant_cache"


# --- deliberately wrong writers: the reference's ``run`` replaced for one call ---------------------

_real_run = reference_run(OP)


def _skip_last_request(src_cache, dst, block_table, cu_seq_lens, seq_starts, num_tokens, mode,
                       scale):
    _real_run(src_cache, dst, block_table, cu_seq_lens[:-1], seq_starts, num_tokens, mode,
                  scale)


WRONG = (WrongWriter("skips-last-request", via_reference(OP, _skip_last_request), EntryCase(seqs=Seqs(starts=(3, 0, 40, 15, 2)))),)


# --- bad input -------------------------------------------------------------------------------------

def _entry_base(kv="auto"):
    case = EntryCase(kv_cache_dtype=kv, seqs=Seqs(starts=(1, 2, 3, 4, 5)), entry=(32,))
    return case, make_entry_inputs(case)


def _dq_args(kv="auto") -> dict:
    case, inp = _entry_base(kv)
    a = inp.dequant_args(case)
    names = ("src_cache", "dst", "block_table", "cu_seq_lens", "token_to_seq", "num_tokens",
             "kv_cache_dtype", "scale", "seq_starts")
    return dict(zip(names, a, strict=True))


def _dq(kv="auto", **changes):
    return replaced(lambda: _dq_args(kv), changes)


BAD = tuple(BadInput(*b) for b in [
    ("dq mode", _dq(kv_cache_dtype=lambda a: "int8"), ValueError, "kv_cache_dtype: expected one of"),
    ("dq ds_mla", _dq(kv_cache_dtype=lambda a: "fp8_ds_mla"), ValueError, "kv_cache_dtype: expected 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got 'fp8_ds_mla'"),
    ("dq cache type", _dq(src_cache=lambda a: 3), TypeError, "src_cache: expected a torch.Tensor"),
    ("dq cache dims", _dq(src_cache=lambda a: a["src_cache"][0]), ValueError, "src_cache: expected 3 dims"),
    ("dq dst dims", _dq(dst=lambda a: a["dst"][None]), ValueError, "dst: expected 2 dims"),
    ("dq dst dtype", _dq(dst=lambda a: a["dst"].double()), ValueError, "dst: expected dtype float16, bfloat16 or float32"),
    ("dq entry", _dq(dst=lambda a: a["dst"][:, :-1]), ValueError, "dst: expected a last dim of 32"),
    ("dq dst stride", _dq(dst=lambda a: a["dst"].repeat(1, 2)[:, ::2]), ValueError, "dst: expected a unit-stride last dim"),
    ("dq auto dtype", _dq(dst=lambda a: a["dst"].half()), ValueError, "src_cache: kv_cache_dtype='auto' expects the dtype of dst"),
    ("dq fp8 dtype", _dq("fp8", src_cache=lambda a: a["src_cache"].view(torch.float8_e5m2)), ValueError, "src_cache: kv_cache_dtype='fp8_e4m3' expects a cache of dtype torch.uint8 or torch.float8_e4m3fn"),
    ("dq num_tokens big", _dq(num_tokens=lambda a: a["dst"].shape[0] + 1), ValueError, "num_tokens: expected at most dst.shape[0]"),
    ("dq num_tokens neg", _dq(num_tokens=lambda a: -1), ValueError, "num_tokens: expected a non-negative int"),
    ("dq num_tokens float", _dq(num_tokens=lambda a: 2.0), TypeError, "num_tokens: expected a non-negative int, got float"),
    ("dq cu dtype", _dq(cu_seq_lens=lambda a: a["cu_seq_lens"].float()), ValueError, "cu_seq_lens: expected dtype int64 or int32"),
    ("dq cu dims", _dq(cu_seq_lens=lambda a: a["cu_seq_lens"][None]), ValueError, "cu_seq_lens: expected 1 dim"),
    ("dq cu empty", _dq(cu_seq_lens=lambda a: a["cu_seq_lens"][:0]), ValueError, "cu_seq_lens: expected at least 1 entries"),
    ("dq table rows", _dq(block_table=lambda a: a["block_table"][:2]), ValueError, "block_table: expected at least 5 entries along dim 0"),
    ("dq table dims", _dq(block_table=lambda a: a["block_table"][0]), ValueError, "block_table: expected 2 dims"),
    ("dq seq_starts short", _dq(seq_starts=lambda a: a["seq_starts"][:4]), ValueError, "seq_starts: expected at least 5 entries"),
    ("dq seq_starts dtype", _dq(seq_starts=lambda a: a["seq_starts"].short()), ValueError, "seq_starts: expected dtype int64 or int32"),
    ("dq token_to_seq short", _dq(token_to_seq=lambda a: a["token_to_seq"][:3]), ValueError, "token_to_seq: expected at least"),
    ("dq scale missing", _dq("fp8", scale=lambda a: None), ValueError, "scale: kv_cache_dtype='fp8_e4m3' needs a float32 tensor"),
    ("dq scale dtype", _dq("fp8_e5m2", scale=lambda a: a["scale"].double()), ValueError, "scale: expected dtype float32"),
    ("dq scale numel", _dq("fp8", scale=lambda a: a["scale"].repeat(2)), ValueError, "scale: expected 1 element"),
    ("dq dst overlaps cache", _dq(dst=lambda a: a["src_cache"].view(-1, 32)[:a["dst"].shape[0]]), ValueError, "src_cache: expected memory apart from dst's"),
    ("dq dst grad", _dq(dst=lambda a: a["dst"].clone().requires_grad_()), ValueError, "dst: expected a tensor that does not require grad"),
])


# --- CUDA graphs (new lengths, starts, block ids and scales between the seeds) --------------------

def _graph_case(kv: str, seed: int) -> EntryCase:
    return EntryCase(seqs=graph_seqs(seed), kv_cache_dtype=kv, seed=seed,
                     scale=0.37 if seed == 0 else 2.5)


GRAPH_CASES = (*(Example(kv, functools.partial(_graph_case, kv)) for kv in ("auto", "fp8")),)
COMPILE_CASES = (Example("fp8", EntryCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)), kv_cache_dtype="fp8")),)

PROVIDER = gather_provider(OP, make_entry_inputs, lambda inp, case: inp.dequant_args(case), mutates=(1,),
                           names=("dst",), nan=None, wrong=WRONG, bad=BAD,
                           graph_cases=GRAPH_CASES, compile_cases=COMPILE_CASES,
                           variants=17,
                           small_tile_cases=small_tiles(
                               EntryCase(seqs=SMALL_SEQS), dict(entry=(8,), kv_cache_dtype="fp8"),
                               dict(entry=(10,), dtype=torch.float16, kv_cache_dtype="fp8_e5m2"),
                               dict(entry=(16,))))
