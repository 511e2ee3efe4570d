"""gather_cache_flash for the conformance suite (its row rule against the
independent oracle: tests/test_gather.py)."""

from __future__ import annotations

import functools

import torch

from kvwrite.layouts import KVAlloc, Layout

from ..conformance import BadInput, Example, WrongWriter, replaced, small_tiles
from ..gather import FlashCase, Seqs, graph_seqs, make_flash_inputs
from .gather_common import SMALL_SEQS, gather_provider, reference_run, via_reference

OP = "gather_cache_flash"


# --- deliberately wrong writers: the reference's ``run`` replaced for one call ---------------------

_real_run = reference_run(OP)


def _saturates(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens, seq_starts,
               cache_dtype, k_scale, v_scale):
    """Clamps the dequantized values to the output's finite range (the read rule does not)."""
    _real_run(key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens, seq_starts,
                cache_dtype, k_scale, v_scale)
    fin = torch.finfo(key_out.dtype).max
    for out in (key_out, value_out):
        out.copy_(out.clamp(-fin, fin))


WRONG = (WrongWriter("saturates", via_reference(OP, _saturates), FlashCase(kv_cache_dtype="fp8_e5m2", dtype=torch.float16)),)


# --- bad input -------------------------------------------------------------------------------------

def _fl_args(kv="fp8") -> dict:
    case = FlashCase(kv_cache_dtype=kv, per_head_scale=True, seqs=Seqs(starts=(1, 2, 3, 4, 5)))
    inp = make_flash_inputs(case)
    names = ("key_cache", "value_cache", "key_out", "value_out", "block_table", "cu_seq_lens",
             "kv_cache_dtype", "k_scale", "v_scale", "seq_starts")
    return dict(zip(names, inp.args(case), strict=True))


def _fl(kv="fp8", **changes):
    return replaced(lambda: _fl_args(kv), changes)


BAD = tuple(BadInput(*b) for b in [
    ("fl mode", _fl(kv_cache_dtype=lambda a: "fp4"), ValueError, "kv_cache_dtype: expected one of"),
    ("fl cache dims", _fl(key_cache=lambda a: a["key_cache"][0]), ValueError, "key_cache: expected 4 dims"),
    ("fl v shape", _fl(value_cache=lambda a: a["value_cache"][:1]), ValueError, "value_cache: expected the shape of key_cache"),
    ("fl v strides", _fl(value_cache=lambda a: a["value_cache"].clone(memory_format=torch.contiguous_format).transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "value_cache: expected the strides of key_cache"),
    ("fl out heads", _fl(key_out=lambda a: a["key_out"][:, :2]), ValueError, "key_out: expected shape [T_out, 4, 32]"),
    ("fl out dtypes", _fl(value_out=lambda a: a["value_out"].half()), ValueError, "value_out: expected the dtype of key_out"),
    ("fl fp8 cache", _fl(key_cache=lambda a: a["key_cache"].view(torch.float8_e5m2), value_cache=lambda a: a["value_cache"].view(torch.float8_e5m2)), ValueError, "key_cache: kv_cache_dtype='fp8_e4m3' with torch.bfloat16 outputs expects a cache of dtype torch.uint8 or torch.float8_e4m3fn"),
    ("fl auto out dtype", _fl("auto", key_out=lambda a: a["key_out"].float(), value_out=lambda a: a["value_out"].float()), ValueError, "key_cache: kv_cache_dtype='auto' with torch.float32 outputs expects a cache of dtype torch.float32"),
    ("fl k_scale numel", _fl(k_scale=lambda a: a["k_scale"][:2]), ValueError, "k_scale: expected 1 (per tensor) or 4 (per head) elements, got 2"),
    ("fl v_scale none", _fl(v_scale=lambda a: None), ValueError, "v_scale: kv_cache_dtype='fp8_e4m3' needs a float32 tensor"),
    ("fl outputs overlap", _fl(value_out=lambda a: a["key_out"]), ValueError, "value_out: expected memory apart from key_out's"),
    ("fl out stride", _fl(key_out=lambda a: a["key_out"].repeat(1, 1, 2)[:, :, ::2]), ValueError, "key_out: expected a unit-stride last dim"),
])


# --- CUDA graphs (new lengths, starts, block ids and scales between the seeds) --------------------

def _graph_case(kv: str, seed: int) -> FlashCase:
    return FlashCase(seqs=graph_seqs(seed), kv_cache_dtype=kv, per_head_scale=True, seed=seed,
                     layout=Layout.HND, alloc=KVAlloc.PACKED)


GRAPH_CASES = (*(Example(kv, functools.partial(_graph_case, kv)) for kv in ("auto", "fp8_e5m2")),)
COMPILE_CASES = (Example("fp8-per-head", FlashCase(seqs=Seqs(starts=(1, 2, 3, 4, 5)), kv_cache_dtype="fp8", per_head_scale=True)),)

PROVIDER = gather_provider(OP, make_flash_inputs, lambda inp, case: inp.args(case), mutates=(2, 3),
                           names=("key_out", "value_out"), nan=None, wrong=WRONG, bad=BAD,
                           graph_cases=GRAPH_CASES, compile_cases=COMPILE_CASES,
                           variants=17,
                           small_tile_cases=small_tiles(
                               FlashCase(seqs=SMALL_SEQS), dict(num_heads=1, head_size=8),
                               dict(num_heads=2, head_size=10, kv_cache_dtype="fp8"),
                               dict(num_heads=1, head_size=16, kv_cache_dtype="fp8_e5m2",
                                    dtype=torch.float16)))
