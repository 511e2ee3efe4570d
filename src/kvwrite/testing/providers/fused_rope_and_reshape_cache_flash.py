"""fused_rope_and_reshape_cache_flash for the conformance suite (the rotation and the cache write
against independent oracles: tests/test_rope.py). Every tensor of the call is compared, so a
write to one the op only reads is caught too."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.ops.fused_rope_and_reshape_cache_flash import OP
from kvwrite.ops.fused_rope_and_reshape_cache_flash import reference as fused_ref
from kvwrite.ops.rotary_embedding import reference as rope_ref

from ..compare import assert_caches_equal
from ..conformance import Provider, WrongWriter, bad_inputs
from ..rope import RopeCase, make_rope_inputs
from .rope_common import COMMON_BAD, VCASE, graph_and_compile_cases, heads

NAMES = ("query", "key", "value", "positions", "cos_sin_cache", "is_neox", "key_cache",
         "value_cache", "slot_mapping", "k_scale", "v_scale", "kv_cache_dtype",
         "rotate_key_in_place", "query_out")
TENSORS = (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 13)


def _call(*args, implementation=None) -> None:
    """The public function with its keyword-only ``rotate_key_in_place`` and ``query_out`` as
    the 13th and 14th arguments."""
    *fused, rotate_key_in_place, query_out = args
    kvwrite.fused_rope_and_reshape_cache_flash(*fused, rotate_key_in_place=rotate_key_in_place,
                                               query_out=query_out,
                                               implementation=implementation)


def _build(case: RopeCase, device, seed) -> tuple:
    inp = make_rope_inputs(case, device, seed)
    return (*inp.fused_args(), inp.rotate_key_in_place, inp.query_out)


def _check(case, got, want) -> None:
    for i, g, w in zip(TENSORS, got, want, strict=True):
        if w is not None:
            assert_caches_equal(g, w, NAMES[i])


def _skip(info, case: RopeCase, args: tuple) -> str | None:
    d = case.head_size
    return info.unsupported(heads(args[0], d), heads(args[1], d), args[6], case.cache_dtype,
                            args[4], case.is_neox)


# --- deliberately wrong writers (the reference's arguments: [T, H, D] views, a CacheDType) --------

def _wrong(write, case: RopeCase):
    def run(q, k, v, pos, cs, neox, kc, vc, slots, ks, vs, kv_cache_dtype, in_place, qo):
        d = case.head_size
        write(heads(q, d), heads(k, d), heads(v, d), pos, cs, neox, kc, vc, slots,
              case.cache_dtype, ks, vs, in_place, heads(qo, d))
    return run


def _unrotated_key_cached(q, k, v, pos, cs, neox, kc, vc, slots, cdt, ks, vs, in_place, qo):
    fused_ref.cache_write.run(k, v, kc, vc, slots, cdt, ks, vs)
    rope_ref.run(pos, q, k if in_place else None, cs, neox)


def _bad_position_cached(q, k, v, pos, cs, neox, kc, vc, slots, cdt, ks, vs, in_place, qo):
    """Caches the unrotated key of a token whose position is out of range (the pair's effect)."""
    rope_ref.run(pos, q, k, cs, neox)
    fused_ref.cache_write.run(k, v, kc, vc, slots, cdt, ks, vs)


def _query_in_place_too(q, k, v, pos, cs, neox, kc, vc, slots, cdt, ks, vs, in_place, qo):
    fused_ref.run(q, k, v, pos, cs, neox, kc, vc, slots, cdt, ks, vs, in_place, qo)
    rope_ref.run(pos, q, None, cs, neox)



WRONG = tuple(WrongWriter(i, _wrong(w, c), c) for i, w, c in [
    ("unrotated-key-cached", _unrotated_key_cached, RopeCase(num_tokens=9, kv_cache_dtype="fp8")),
    ("bad-position-cached", _bad_position_cached, RopeCase(num_tokens=9, bad_positions=3)),
    ("query-out-and-in-place", _query_in_place_too, RopeCase(num_tokens=9, query_out=True)),
])


# --- bad input -------------------------------------------------------------------------------------

FUSED_BAD = COMMON_BAD + [
    # The head size comes from key (3-D) or the caches: query's mismatch is query's.
    ("query-head-size", lambda a: {"query": a["query"][..., :8]}, ValueError,
     "query: expected head size 16 in dim 2, got shape (5, 4, 8)"),
    ("query-flat-size", lambda a: {"query": a["query"].flatten(1)[:, :24]}, ValueError,
     "query: expected [num_tokens, num_heads * 16]"),
    ("value-head-size", lambda a: {"value": a["value"][..., :8]}, ValueError,
     "value: expected head size 16 in dim 2, got shape (5, 2, 8)"),
    ("key-sparse-heads", lambda a: {"key": torch.cat([a["key"], a["key"]], -1)[..., ::2]},
     ValueError, "key: expected a unit-stride head dim"),
    ("value-sparse-heads", lambda a: {"value": torch.cat([a["value"], a["value"]], -1)[..., ::2]},
     ValueError, "value: expected a unit-stride head dim"),
    ("key-overlapping-heads", lambda a: {"key": a["key"].as_strided((5, 2, 16), (32, 8, 1))},
     ValueError, "key: expected every element in its own memory"),
    ("key-cache-head-size", lambda a: {"key_cache": a["key_cache"][..., :8],
                                       "value_cache": a["value_cache"][..., :8]}, ValueError,
     "key_cache: expected [num_blocks, block_size, 2, 16] to match key"),
    ("value-shape", lambda a: {"value": a["value"][:, :1]}, ValueError,
     "value: expected the shape of key"),
    ("key-cache-heads", lambda a: {"key_cache": a["key_cache"][:, :, :1],
                                   "value_cache": a["value_cache"][:, :, :1]}, ValueError,
     "key_cache: expected [num_blocks, block_size, 2, 16] to match key"),
    ("auto-with-uint8-cache", lambda a: {"kv_cache_dtype": "auto"}, ValueError,
     "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects a cache of dtype"),
    ("no-scale", lambda a: {"k_scale": None}, ValueError, "k_scale: kv_cache_dtype='fp8_e4m3' needs"),
    ("slots-more-than-positions", lambda a: {"positions": a["positions"][:3]}, ValueError,
     "slot_mapping: expected at most positions.numel() = 3 entries, got 5"),
    ("slots-float", lambda a: {"slot_mapping": a["slot_mapping"].float()}, ValueError,
     "slot_mapping: expected dtype int64 or int32"),
    ("key-2d-no-cache", lambda a: {"key": a["key"].flatten(1), "key_cache": None}, TypeError,
     "key_cache: expected a torch.Tensor, got NoneType"),
    ("rotate-key-int", lambda a: {"rotate_key_in_place": 0}, TypeError,
     "rotate_key_in_place: expected a bool, got int"),
    ("query-out-shape", lambda a: {"query_out": torch.zeros(5, 4, 8, dtype=torch.bfloat16)},
     ValueError, "query_out: expected head size 16"),
    ("query-out-rows", lambda a: {"query_out": torch.zeros(4, 4, 16, dtype=torch.bfloat16)},
     ValueError, "query_out: expected the shape of query (5, 4, 16), got (4, 4, 16)"),
    ("query-out-dtype", lambda a: {"query_out": torch.zeros(5, 4, 16)}, ValueError,
     "query_out: expected the dtype of query (torch.bfloat16), got torch.float32"),
    ("query-out-is-query", lambda a: {"query_out": a["query"]}, ValueError,
     "query: expected memory apart from query_out's"),
    ("query-out-sparse-heads", lambda a: {"query_out": torch.zeros(5, 4, 32,
                                                                   dtype=torch.bfloat16)[..., ::2]},
     ValueError, "query_out: expected a unit-stride head dim"),
    ("implementation", lambda a: {"implementation": "nope"}, ValueError,
     "implementation: expected one of"),
]


BAD = bad_inputs(FUSED_BAD,
                 lambda: dict(zip(NAMES[:12], make_rope_inputs(VCASE).fused_args(), strict=True)))

PROVIDER = Provider(
    op=OP,
    call=_call,
    public=kvwrite.fused_rope_and_reshape_cache_flash,
    build=_build,
    mutates=TENSORS,
    mutated_names=tuple(NAMES[i] for i in TENSORS),
    check=_check,
    skip=_skip,
    **graph_and_compile_cases(fused=True),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
