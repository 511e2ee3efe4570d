"""reshape_and_cache (the legacy layout) for the conformance suite."""

from __future__ import annotations

import dataclasses

import torch

import kvwrite
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.ops.reshape_and_cache import OP
from kvwrite.ops.reshape_and_cache import reference as torch_ref

from ..conformance import (
    BadInput,
    Example,
    Provider,
    WrongWriter,
    compile_every_variant,
    small_tiles,
)
from ..legacy import LegacyCase, assert_legacy_caches_equal, make_legacy_inputs


def _check(case: LegacyCase, got, want) -> None:
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    for name, g, w in zip(("key_cache", "value_cache"), got, want, strict=True):
        assert_legacy_caches_equal(g, w, name, fp8)


def _skip(info, case: LegacyCase, args: tuple) -> str | None:
    return info.unsupported(args[0], args[2], case.cache_dtype, args[6])


# --- deliberately wrong writers (the reference's arguments: a CacheDType, scales only for fp8) ---

def _wrong(write):
    def run(key, value, kc, vc, slots, kv_cache_dtype, ks, vs):
        cdt = parse_kv_cache_dtype(kv_cache_dtype)
        write(key, value, kc, vc, slots, cdt, ks if cdt.is_fp8 else None,
              vs if cdt.is_fp8 else None)
    return run


def _skip_last_token(key, value, kc, vc, slots, cdt, ks, vs):
    torch_ref.run(key, value, kc, vc, slots[:-1], cdt, ks, vs)


def _heads_past_512_threads(key, value, kc, vc, slots, cdt, ks, vs):
    """vLLM's launch: min(H * D / x, 512) threads and no loop, so heads past 512 * x / D stay."""
    x, d = kc.shape[4], key.shape[2]
    h = max(1, 512 * x // d)
    torch_ref.run(key[:, :h], value[:, :h], kc[:, :h], vc[:, :h], slots, cdt,
                  None if ks is None else ks[:h], None if vs is None else vs[:h])


def _first_scale_only(key, value, kc, vc, slots, cdt, ks, vs):
    """vLLM reads k_scale[0] only."""
    torch_ref.run(key, value, kc, vc, slots, cdt, ks[:1], vs[:1])


def _contiguous_strides(key, value, kc, vc, slots, cdt, ks, vs):
    """Writes as if both caches were contiguous."""
    torch_ref.run(key, value, kc.as_strided(kc.shape, torch.empty(kc.shape).stride()),
                  vc.as_strided(vc.shape, torch.empty(vc.shape).stride()), slots, cdt, ks, vs)


def _value_as_key_layout(key, value, kc, vc, slots, cdt, ks, vs):
    """The value written with the key's x-split: value_cache's memory as [nb, H, D/x, bs, x]."""
    torch_ref.run(key, value, kc, torch.empty_like(vc), slots, cdt, ks, vs)
    nb, h, d, bs = vc.shape
    x = kc.shape[4]
    torch_ref.run(value, value, vc.view(nb, h, d // x, bs, x), torch.empty_like(vc), slots, cdt,
                  vs, vs)


WRONG = (
    WrongWriter("skip-last-token", _wrong(_skip_last_token), LegacyCase()),
    WrongWriter("heads-past-512-threads", _wrong(_heads_past_512_threads),
                LegacyCase(num_heads=64, head_size=128, num_tokens=3, kv_cache_dtype="bfloat16",
                           dtype=torch.float32)),
    WrongWriter("first-scale-only", _wrong(_first_scale_only),
                LegacyCase(kv_cache_dtype="fp8", per_head_scale=True)),
    WrongWriter("padded-as-contiguous", _wrong(_contiguous_strides),
                LegacyCase(cache_strides="padded")),
    WrongWriter("slot-major-as-contiguous", _wrong(_contiguous_strides),
                LegacyCase(cache_strides="slot-major", kv_cache_dtype="fp8")),
    WrongWriter("value-x-split", _wrong(_value_as_key_layout), LegacyCase(x=4)),
)


# --- bad input -------------------------------------------------------------------------------------

def _base(kv="auto", dtype=torch.bfloat16):
    return make_legacy_inputs(LegacyCase(kv_cache_dtype=kv, dtype=dtype, num_tokens=5,
                                         num_heads=2, head_size=32, num_blocks=2, block_size=4))


def _bad(kv, **changes):
    def make():
        inp = _base(kv)
        args = dict(key=inp.key, value=inp.value, key_cache=inp.key_cache,
                    value_cache=inp.value_cache, slot_mapping=inp.slot_mapping,
                    kv_cache_dtype=kv, k_scale=inp.k_scale, v_scale=inp.v_scale)
        for k, f in changes.items():
            args[k] = f(inp)
        return (), args
    return make


def _x_not_dividing(i):
    nb, h, _, bs, _ = i.key_cache.shape
    return torch.zeros(nb, h, 10, bs, 3, dtype=i.key_cache.dtype)


BAD = tuple(BadInput(*b) for b in [
    ("kv_cache_dtype", _bad("auto", kv_cache_dtype=lambda i: "int8"), ValueError, "kv_cache_dtype: expected one of"),
    ("key type", _bad("auto", key=lambda i: i.key.tolist()), TypeError, "key: expected a torch.Tensor"),
    ("key dims", _bad("auto", key=lambda i: i.key[0]), ValueError, "key: expected 3 dims"),
    ("key dtype", _bad("auto", key=lambda i: i.key.double()), ValueError, "key: expected dtype"),
    ("value dtype", _bad("auto", value=lambda i: i.value.half()), ValueError, "value: expected the dtype of key"),
    ("value shape", _bad("auto", value=lambda i: i.value[:, :1]), ValueError, "value: expected the shape of key"),
    ("key heads", _bad("auto", key=lambda i: i.key.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "key: expected dense heads"),
    ("key_cache dims", _bad("auto", key_cache=lambda i: i.key_cache[0]), ValueError, "key_cache: expected 5 dims"),
    ("x not dividing D", _bad("auto", key_cache=_x_not_dividing), ValueError, "key_cache: expected x = key_cache.size(4) dividing head_size 32"),
    ("key_cache heads", _bad("auto", key_cache=lambda i: i.key_cache[:, :1]), ValueError, "key_cache: expected [num_blocks, 2, 4, block_size, 8]"),
    ("key_cache D/x", _bad("auto", key_cache=lambda i: i.key_cache[:, :, :3]), ValueError, "key_cache: expected [num_blocks, 2, 4, block_size, 8]"),
    ("value_cache dims", _bad("auto", value_cache=lambda i: i.value_cache[..., None]), ValueError, "value_cache: expected 4 dims"),
    ("value_cache block size", _bad("auto", value_cache=lambda i: i.value_cache[..., :3]), ValueError, "value_cache: expected [num_blocks, num_heads, head_size, block_size] = (2, 2, 32, 4)"),
    ("value_cache head size", _bad("auto", value_cache=lambda i: i.value_cache[:, :, :16]), ValueError, "value_cache: expected [num_blocks, num_heads, head_size, block_size]"),
    ("value_cache dtype", _bad("auto", value_cache=lambda i: i.value_cache.half()), ValueError, "value_cache: expected the dtype of key_cache"),
    ("cache dtype auto", _bad("auto", key_cache=lambda i: i.key_cache.half(), value_cache=lambda i: i.value_cache.half()), ValueError, "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects"),
    ("cache dtype fp8", _bad("fp8", key_cache=lambda i: i.key_cache.view(torch.float8_e5m2), value_cache=lambda i: i.value_cache.view(torch.float8_e5m2)), ValueError, "key_cache: kv_cache_dtype='fp8_e4m3'"),
    ("slot dtype", _bad("auto", slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad("auto", slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot count", _bad("auto", slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most key.shape[0] = 5"),
    ("slot device", _bad("auto", slot_mapping=lambda i: i.slot_mapping.to("meta")), ValueError, "slot_mapping: expected device cpu"),
    ("scale missing", _bad("fp8", k_scale=lambda i: None), ValueError, "k_scale: kv_cache_dtype='fp8_e4m3' needs"),
    ("scale dtype", _bad("fp8", v_scale=lambda i: i.v_scale.double()), ValueError, "v_scale: expected dtype float32"),
    ("scale numel", _bad("fp8", k_scale=lambda i: i.k_scale.repeat(3)), ValueError, "k_scale: expected 1 (per tensor) or 2 (per head)"),
    ("caches overlap", _bad("auto", value_cache=lambda i: i.key_cache.view(2, 2, 32, 4)), ValueError, "expected memory apart from key_cache's"),
    ("key in the cache", _bad("auto", key=lambda i: i.key_cache.view(-1)[:320].view(5, 2, 32)), ValueError, "key: expected memory apart from key_cache's"),
])


# --- CUDA graphs, torch.compile, NVRTC ---------------------------------------------------------------

GRAPH_CASE = LegacyCase(num_tokens=40, num_heads=4, head_size=64, kv_cache_dtype="fp8",
                        per_head_scale=True, cache_strides="padded", padding_slots=3,
                        out_of_range_slots=2, num_blocks=8)


PROVIDER = Provider(
    op=OP,
    call=kvwrite.reshape_and_cache,
    build=lambda case, device, seed: make_legacy_inputs(case, device, seed=seed).args(),
    mutates=(2, 3),
    mutated_names=("key_cache", "value_cache"),
    check=_check,
    skip=_skip,
    cases=tuple(Example(f"graph-{kv}", dataclasses.replace(GRAPH_CASE, kv_cache_dtype=kv))
                for kv in ("auto", "fp8", "float32")),
    graph_cases=tuple(Example(kv, dataclasses.replace(GRAPH_CASE, kv_cache_dtype=kv))
                      for kv in ("auto", "fp8", "float32")),
    compile_cases=(Example("padded", LegacyCase(num_tokens=9, padding_slots=2,
                                                cache_strides="padded")),),
    small_tile_cases=small_tiles(
        LegacyCase(num_tokens=3, num_heads=1, padding_slots=1), dict(head_size=8),
        dict(num_tokens=2, num_heads=2, head_size=10, x=2, dtype=torch.float16, padding_slots=0),
        dict(head_size=16, kv_cache_dtype="fp8")),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    compile_variants=compile_every_variant("kvwrite.ops.reshape_and_cache", 192),
)
