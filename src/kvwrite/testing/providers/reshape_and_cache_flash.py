"""reshape_and_cache_flash for the conformance suite (its case matrix against the independent
oracle: tests/test_matrix.py)."""

from __future__ import annotations

import dataclasses
import importlib

import torch

import kvwrite
from kvwrite.dtypes import FP8_MAX, parse_kv_cache_dtype
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref

from ..cases import Case, make_inputs
from ..compare import assert_caches_equal
from ..conformance import Example, Provider, WrongWriter, small_tiles


def _check(case: Case, got, want) -> None:
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    # NaN's sign and payload are not part of the contract (the fp8 rule: "NaN stays NaN").
    for name, g, w in zip(("key_cache", "value_cache"), got, want, strict=True):
        assert_caches_equal(g, w, name, fp8, nan_equal=fp8 is not None)


def _skip(info, case: Case, args: tuple) -> str | None:
    key, value, kc, vc, slots, _, ks, vs = args
    reason = info.unsupported(key, kc, case.cache_dtype, ks, vs)
    if reason is None:  # a peer's slot conversion (FlashInfer: no padding) says what it refuses
        reason = info.prepare(key, value, kc, vc, slots, case.cache_dtype, ks, vs)
    return reason


def _graph_skip(info, case: Case, args: tuple) -> str | None:
    if hasattr(importlib.import_module(info.module), "prepare"):
        return (f"{info.name} converts its slots before capture (prepare); new slots need a new "
                "conversion, as its users rebuild their page table before a replay")
    return _skip(info, case, args)


# --- deliberately wrong writers ------------------------------------------------------------------

def _wrong(write):
    def run(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, ks, vs):
        write(key, value, key_cache, value_cache, slot_mapping,
              parse_kv_cache_dtype(kv_cache_dtype), ks, vs)
    return run


def _skip_last_token(key, value, key_cache, value_cache, slot_mapping, *rest):
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping[:-1], *rest)


def _ignore_strides(key, value, key_cache, value_cache, slot_mapping, *rest):
    """Writes as if every cache were a separate, contiguous NHD tensor."""
    nb, bs, h, d = key_cache.shape
    flat_k = key_cache.as_strided((nb, bs, h, d), (bs * h * d, h * d, d, 1))
    flat_v = value_cache.as_strided((nb, bs, h, d), (bs * h * d, h * d, d, 1))
    torch_ref.run(key, value, flat_k, flat_v, slot_mapping, *rest)


def _key_into_value(key, value, key_cache, value_cache, slot_mapping, *rest):
    torch_ref.run(key, key, key_cache, value_cache, slot_mapping, *rest)


def _multiply_by_reciprocal(key, value, key_cache, value_cache, slot_mapping, cache_dtype, ks, vs):
    """fp8 with x * (1/s) instead of x / s: differs from the rule on some values."""
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, ks, vs)
    if cache_dtype.is_fp8:
        fp8 = cache_dtype.fp8_dtype
        for src, cache, s in ((key, key_cache, ks), (value, value_cache, vs)):
            sl = slot_mapping.long()
            keep = (sl >= 0) & (sl < cache.shape[0] * cache.shape[1])
            t, sl = torch.nonzero(keep).flatten(), sl[keep]
            r = 1.0 / s.reshape(1, -1, 1)
            q = (src[t].float() * r).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
            cache[sl // cache.shape[1], sl % cache.shape[1]] = q.view(torch.uint8) if cache.dtype == torch.uint8 else q


WRONG = (
    WrongWriter("skip-last-token", _wrong(_skip_last_token), Case(num_tokens=7)),
    WrongWriter("hnd-as-nhd", _wrong(_ignore_strides), Case(layout=Layout.HND)),
    WrongWriter("packed-as-separate", _wrong(_ignore_strides), Case(alloc=KVAlloc.PACKED)),
    WrongWriter("key-into-value", _wrong(_key_into_value), Case()),
    WrongWriter("reciprocal-e4m3", _wrong(_multiply_by_reciprocal),
                Case(kv_cache_dtype="fp8", num_tokens=9, num_heads=4, head_size=32,
                     dtype=torch.float32, special_values=True)),
    WrongWriter("reciprocal-e5m2-per-head", _wrong(_multiply_by_reciprocal),
                Case(kv_cache_dtype="fp8_e5m2", num_tokens=9, num_heads=4, head_size=32,
                     dtype=torch.float32, special_values=True, per_head_scale=True)),
)

GRAPH_CASE = Case(num_tokens=40, num_heads=4, head_size=64, kv_cache_dtype="fp8",
                  per_head_scale=True, layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=3,
                  out_of_range_slots=2, num_blocks=8)

PROVIDER = Provider(
    op=OP,
    call=kvwrite.reshape_and_cache_flash,
    build=lambda case, device, seed: make_inputs(case, device, seed).args(),
    mutates=(2, 3),
    mutated_names=("key_cache", "value_cache"),
    check=_check,
    skip=_skip,
    graph_skip=_graph_skip,
    graph_cases=tuple(Example(kv, dataclasses.replace(GRAPH_CASE, kv_cache_dtype=kv))
                      for kv in ("auto", "fp8")),
    compile_cases=(Example("hnd-padding", Case(num_tokens=9, kv_cache_dtype="auto",
                                               layout=Layout.HND, padding_slots=2)),),
    small_tile_cases=small_tiles(
        Case(num_tokens=3, num_heads=1, padding_slots=1), dict(head_size=8),
        dict(num_tokens=2, num_heads=2, head_size=10, dtype=torch.float16, layout=Layout.HND,
             padding_slots=0),
        dict(head_size=16, kv_cache_dtype="fp8")),
    wrong_writers=WRONG,
)
