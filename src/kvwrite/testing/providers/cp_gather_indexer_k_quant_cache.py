"""cp_gather_indexer_k_quant_cache for the conformance suite (its row rule against the
independent oracle: tests/test_gather.py)."""

from __future__ import annotations

import dataclasses

import torch

from ..conformance import BadInput, Example, WrongWriter, replaced, small_tiles
from ..gather import IndexerCase, Seqs, graph_seqs, make_indexer_inputs
from .gather_common import SMALL_SEQS, gather_provider, reference_run, via_reference

OP = "cp_gather_indexer_k_quant_cache"


# --- deliberately wrong writers: the reference's ``run`` replaced for one call ---------------------

_real_run = reference_run(OP)


def _table_bounds_unchecked(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    """Reads block ids modulo num_blocks (a kernel that wraps instead of skipping)."""
    _real_run(kv_cache, dst_k, dst_scale, block_table.remainder(kv_cache.shape[0]),
                  cu_seq_lens)


def _whole_rows(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    """Reads the scales from the entry's own row (the [bs, D + 4G] shape) instead of the page's
    scale region."""
    nb, bs, width = kv_cache.shape
    d = dst_k.shape[1]
    from kvwrite.gather import request_rows
    t, blk, off = request_rows(cu_seq_lens, None, block_table, block_table.shape[0],
                               dst_k.shape[0], bs, nb)
    dst_k.view(torch.uint8)[t] = kv_cache[blk, off, :d]
    dst_scale.view(torch.uint8)[t] = kv_cache[blk, off, d:].reshape(-1, *dst_scale.view(
        torch.uint8).shape[1:])


WRONG = (WrongWriter("wraps-block-ids", via_reference(OP, _table_bounds_unchecked),
                     IndexerCase(seqs=Seqs(bad_blocks=(-1, 12, 100, -7)))),
          WrongWriter("row-layout", via_reference(OP, _whole_rows), IndexerCase()))


# --- bad input -------------------------------------------------------------------------------------

def _ix_args() -> dict:
    inp = make_indexer_inputs(IndexerCase(scale_dtype=torch.float32))
    names = ("kv_cache", "dst_k", "dst_scale", "block_table", "cu_seq_lens")
    return dict(zip(names, inp.args(), strict=True))


def _ix(**changes):
    return replaced(_ix_args, changes)


BAD = tuple(BadInput(*b) for b in [
    ("ix width", _ix(kv_cache=lambda a: a["kv_cache"][:, :, :-4]), ValueError, "kv_cache: expected shape [num_blocks, block_size, 132]"),
    ("ix pages", _ix(kv_cache=lambda a: a["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "kv_cache: expected dense pages"),
    ("ix k dtype", _ix(dst_k=lambda a: a["dst_k"].float()), ValueError, "dst_k: expected dtype torch.uint8 or torch.float8_e4m3fn"),
    ("ix scale dtype", _ix(dst_scale=lambda a: a["dst_scale"].half()), ValueError, "dst_scale: expected dtype torch.uint8 or torch.float32"),
    ("ix scale bytes", _ix(dst_scale=lambda a: torch.zeros(a["dst_k"].shape[0], 3, dtype=torch.uint8)), ValueError, "dst_scale: expected [T_out, 4 * G] bytes"),
    ("ix scale rows", _ix(dst_scale=lambda a: a["dst_scale"][:-1]), ValueError, "dst_scale: expected"),
    ("ix cu short", _ix(cu_seq_lens=lambda a: a["cu_seq_lens"][:-1]), ValueError, "cu_seq_lens: expected at least 6 entries"),
    ("ix cache dtype", _ix(kv_cache=lambda a: a["kv_cache"].view(torch.int8)), ValueError, "kv_cache: expected dtype torch.uint8"),
])


# --- CUDA graphs (new lengths, starts, block ids and scales between the seeds) --------------------

def _graph_case(seed: int) -> IndexerCase:
    s = dataclasses.replace(graph_seqs(seed), starts=None)
    return IndexerCase(seqs=s, seed=seed, scale_dtype=torch.float32)


GRAPH_CASES = (Example("float32-scales", _graph_case),)
COMPILE_CASES = (Example("default", IndexerCase(seqs=Seqs(starts=None))),)

PROVIDER = gather_provider(OP, make_indexer_inputs, lambda inp, case: inp.args(), mutates=(1, 2),
                           names=("dst_k", "dst_scale"), nan=False, wrong=WRONG, bad=BAD,
                           graph_cases=GRAPH_CASES, compile_cases=COMPILE_CASES,
                           variants=15,
                           small_tile_cases=small_tiles(
                               IndexerCase(seqs=dataclasses.replace(SMALL_SEQS, starts=None)),
                               dict(head_dim=16), dict(head_dim=8, groups=2)))
