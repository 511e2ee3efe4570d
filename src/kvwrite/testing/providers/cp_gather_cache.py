"""cp_gather_cache for the conformance suite (its row rule against the
independent oracle: tests/test_gather.py)."""

from __future__ import annotations

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced, small_tiles
from ..gather import EntryCase, Seqs, graph_seqs, make_entry_inputs
from .gather_common import SMALL_SEQS, gather_provider, reference_run, via_reference

OP = "cp_gather_cache"


# --- deliberately wrong writers: the reference's ``run`` replaced for one call ---------------------

_real_run = reference_run(OP)


def _ignores_seq_starts(src_cache, dst, block_table, cu_seq_lens, seq_starts):
    _real_run(src_cache, dst, block_table, cu_seq_lens, None)


WRONG = (WrongWriter("ignores-seq-starts", via_reference(OP, _ignores_seq_starts), EntryCase(seqs=Seqs(starts=(3, 0, 40, 15, 2)), seed=2)),)


# --- bad input -------------------------------------------------------------------------------------

def _cpv_args() -> dict:
    case = EntryCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)), entry=(4, 8), dtype=torch.float32)
    inp = make_entry_inputs(case)
    names = ("src_cache", "dst", "block_table", "cu_seq_lens", "batch_size", "seq_starts")
    return dict(zip(names, inp.cp_args(), strict=True))


def _cpv(**changes):
    return replaced(_cpv_args, changes)


BAD = tuple(BadInput(*b) for b in [
    ("cp batch_size", _cpv(batch_size=lambda a: a["batch_size"] + 1), ValueError, "batch_size: expected cu_seq_lens.numel() - 1 = 5, got 6"),
    ("cp entry shape", _cpv(dst=lambda a: a["dst"][:, :, :-1]), ValueError, "dst: expected shape [T_out, 4, 8]"),
    ("cp dtype", _cpv(dst=lambda a: a["dst"].double()), ValueError, "dst: expected the dtype of src_cache"),
    ("cp cache dims", _cpv(src_cache=lambda a: a["src_cache"][0, 0, 0]), ValueError, "src_cache: expected at least 2 dims"),
    ("cp seq_starts device", _cpv(seq_starts=lambda a: a["seq_starts"].to("meta")), ValueError, "seq_starts: expected device cpu"),
    ("cp dst self-overlap", _cpv(dst=lambda a: a["dst"][:, :1].expand(-1, 4, 8)), ValueError, "dst: expected every element in its own memory"),
])


# --- CUDA graphs (new lengths, starts, block ids and scales between the seeds) --------------------

def _graph_case(seed: int) -> EntryCase:
    return EntryCase(seqs=graph_seqs(seed), seed=seed, entry=(8, 24), entry_perm=(1, 0))


GRAPH_CASES = (Example("entry-8x24-hnd", _graph_case),)
COMPILE_CASES = (Example("auto", EntryCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)), kv_cache_dtype="auto")),)

PROVIDER = gather_provider(OP, make_entry_inputs, lambda inp, case: inp.cp_args(), mutates=(1,),
                           names=("dst",), nan=False, wrong=WRONG, bad=BAD,
                           graph_cases=GRAPH_CASES, compile_cases=COMPILE_CASES,
                           variants=20,
                           small_tile_cases=small_tiles(
                               EntryCase(seqs=SMALL_SEQS), dict(entry=(8,)),
                               dict(entry=(10,), dtype=torch.float16), dict(entry=(2, 8))))
