"""fused_qk_norm_rope_and_reshape_cache_flash for the conformance suite: wrong writers caught,
bad input (the norm, rotation and cache write against independent oracles, CUDA graphs and
torch.compile: tests/test_qk_norm_rope.py)."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.layouts import Layout
from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import OP

from ..conformance import Provider, WrongWriter, bad_inputs
from ..qk_norm import QkNormCase, QkNormInputs, make_qk_norm_inputs
from .qk_norm_common import (
    COMMON_BAD,
    FUSED_NAMES,
    VCASE,
    build,
    check_all,
    meta,
    small_tile_cases,
    tensors_of,
    with_written,
)


def _call(inp: QkNormInputs, implementation=None) -> None:
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation=implementation)


# --- deliberately wrong writers --------------------------------------------------------------------

def _fused_then(inp: QkNormInputs, change) -> None:
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation="torch")
    change(inp)


def _unnormalized_key_cached(inp):
    """Caches the key before the norm (the rotation only)."""
    fresh = make_qk_norm_inputs(CHECK_FUSED)
    v = fresh.heads()
    hq, hk = fresh.num_heads_q, fresh.num_heads_k
    kvwrite.rotary_embedding(fresh.position_ids, v[:, :hq], v[:, hq:hq + hk], fresh.head_dim,
                             fresh.cos_sin_cache, fresh.is_neox)
    kvwrite.reshape_and_cache_flash(v[:, hq:hq + hk], v[:, hq + hk:], inp.key_cache,
                                    inp.value_cache, inp.slot_mapping, inp.kv_cache_dtype,
                                    inp.k_scale, inp.v_scale)


def _bad_position_cached(inp):
    """Caches the unnormalized key of a token whose position is out of range (the pair's
    effect)."""
    v = make_qk_norm_inputs(CHECK_FUSED).heads()
    hq, hk = inp.num_heads_q, inp.num_heads_k
    kvwrite.reshape_and_cache_flash(v[:, hq:hq + hk], v[:, hq + hk:], inp.key_cache,
                                    inp.value_cache, inp.slot_mapping, inp.kv_cache_dtype,
                                    inp.k_scale, inp.v_scale)
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation="torch")


def _query_quantized_unrounded(inp):
    """An fp8 query quantized from the float32 result, not from the value as rounded to qkv's
    dtype."""
    fresh = make_qk_norm_inputs(CHECK_FP8_QUERY)
    from kvwrite.dtypes import CacheDType, quantize
    from kvwrite.ops.fused_qk_norm_rope.reference import norm_rope
    view = fresh.heads()
    hq = fresh.num_heads_q
    out, valid = norm_rope(view.float(), hq, fresh.num_heads_k, fresh.eps, fresh.q_weight,
                           fresh.k_weight, fresh.cos_sin_cache, fresh.is_neox,
                           fresh.position_ids, fresh.weight_offset)
    codes = quantize(out[:, :hq], CacheDType.FP8_E4M3, fresh.q_scale, torch.uint8)
    qo = inp.query_out.view(torch.uint8)
    qo = qo if qo.dim() == 3 else qo.unflatten(1, (hq, -1))
    qo[:codes.shape[0]] = torch.where(valid[:, None, None], codes, qo[:codes.shape[0]])


CHECK_FUSED = QkNormCase(num_tokens=9, kv_cache_dtype="fp8", bad_positions=2)
CHECK_FP8_QUERY = QkNormCase(num_tokens=9, query_out="fp8_e4m3", dtype=torch.bfloat16)



WRONG = (
    WrongWriter("unnormalized-key-cached", lambda inp: _fused_then(inp, _unnormalized_key_cached),
                CHECK_FUSED),
    WrongWriter("bad-position-cached", _bad_position_cached, CHECK_FUSED),
    WrongWriter("fp8-query-from-float32",
                lambda inp: _fused_then(inp, _query_quantized_unrounded), CHECK_FP8_QUERY),
)


# --- bad input -------------------------------------------------------------------------------------

FUSED_BAD = COMMON_BAD + [
    ("num-heads-v-not-k", lambda a: {"num_heads_v": 1, "qkv": a["qkv"][:, :7]}, ValueError,
     "num_heads_v: expected num_heads_k = 2"),
    ("key-cache-heads", lambda a: {"key_cache": a["key_cache"][:, :, :1],
                                   "value_cache": a["value_cache"][:, :, :1]}, ValueError,
     "key_cache: expected [num_blocks, block_size, num_heads_k = 2, head_dim = 16]"),
    ("key-cache-head-size", lambda a: {"key_cache": a["key_cache"][..., :8],
                                       "value_cache": a["value_cache"][..., :8]}, ValueError,
     "key_cache: expected [num_blocks, block_size, 2, 16] to match key"),
    ("key-cache-none", lambda a: {"key_cache": None}, TypeError,
     "key_cache: expected a torch.Tensor, got NoneType"),
    ("value-cache-dtype", lambda a: {"value_cache": a["value_cache"].view(torch.int8)},
     ValueError, "value_cache: expected the dtype of key_cache"),
    ("auto-with-uint8-cache", lambda a: {"kv_cache_dtype": "auto"}, ValueError,
     "key_cache: kv_cache_dtype='auto' with torch.float16 input expects a cache of dtype"),
    ("kv-cache-dtype-bad", lambda a: {"kv_cache_dtype": "int4"}, ValueError,
     "kv_cache_dtype: expected one of"),
    ("no-k-scale", lambda a: {"k_scale": None}, ValueError,
     "k_scale: kv_cache_dtype='fp8_e4m3' needs"),
    ("v-scale-heads", lambda a: {"v_scale": torch.ones(3)}, ValueError,
     "v_scale: expected 1 (per tensor) or 2 (per head) elements, got 3"),
    ("slots-more-than-positions", lambda a: {"position_ids": a["position_ids"][:3]}, ValueError,
     "slot_mapping: expected at most position_ids.numel() = 3 entries, got 5"),
    ("slots-float", lambda a: {"slot_mapping": a["slot_mapping"].float()}, ValueError,
     "slot_mapping: expected dtype int64 or int32"),
    ("rotate-key-int", lambda a: {"rotate_key_in_place": 0}, TypeError,
     "rotate_key_in_place: expected a bool, got int"),
    ("query-out-shape", lambda a: {"query_out": torch.zeros(5, 4, 8, dtype=torch.float16)},
     ValueError, "query_out: expected [qkv.shape[0], num_heads_q, head_dim] = [5, 4, 16]"),
    ("query-out-rows", lambda a: {"query_out": torch.zeros(4, 64, dtype=torch.float16)},
     ValueError, "query_out: expected [qkv.shape[0], num_heads_q * head_dim] = [5, 64]"),
    ("query-out-1d", lambda a: {"query_out": torch.zeros(320, dtype=torch.float16)},
     ValueError, "query_out: expected 2 or 3 dims"),
    ("query-out-strided", lambda a: {"query_out": torch.zeros(5, 128, dtype=torch.float16)[:, ::2]},
     ValueError, "query_out: expected a unit stride in dim 1"),
    ("query-out-sparse-heads",
     lambda a: {"query_out": torch.zeros(5, 4, 32, dtype=torch.float16)[..., ::2]}, ValueError,
     "query_out: expected dense heads"),
    ("query-out-dtype", lambda a: {"query_out": torch.zeros(5, 4, 16)}, ValueError,
     "query_out: expected the dtype of qkv (torch.float16), float8_e4m3fn or float8_e5m2, got "
     "torch.float32"),
    ("query-out-device", lambda a: {"query_out": meta(a["query_out"])}, ValueError,
     "query_out: expected device cpu (that of qkv), got meta"),
    ("query-out-is-qkv", lambda a: {"query_out": a["qkv"][:, :4]}, ValueError,
     "query_out: expected memory apart from qkv's"),
    ("query-out-overlaps-key", lambda a: {"query_out": a["qkv"][:, 2:6],
                                          "rotate_key_in_place": False}, ValueError,
     "qkv: expected memory apart from query_out's"),
    ("query-out-is-cache", lambda a: {"query_out": a["key_cache"].view(torch.float8_e4m3fn)
                                      .flatten()[:320].view(5, 4, 16)}, ValueError,
     "key_cache: expected memory apart from query_out's"),
    ("fp8-query-no-scale", lambda a: {"q_scale": None}, ValueError,
     "q_scale: an fp8 query_out (torch.float8_e4m3fn) needs a float32 scale tensor"),
    ("q-scale-dtype", lambda a: {"q_scale": a["q_scale"].double()}, ValueError,
     "q_scale: expected dtype float32, got torch.float64"),
    ("q-scale-heads", lambda a: {"q_scale": torch.ones(3)}, ValueError,
     "q_scale: expected 1 (per tensor) or num_heads_q = 4 (per head) elements, got 3"),
    ("q-scale-device", lambda a: {"q_scale": meta(a["q_scale"])}, ValueError,
     "q_scale: expected device cpu (that of qkv), got meta"),
    ("q-scale-strided", lambda a: {"q_scale": torch.ones(8)[::2]}, ValueError,
     "q_scale: expected a contiguous tensor"),
    ("q-scale-not-tensor", lambda a: {"q_scale": 1.0}, TypeError,
     "q_scale: expected a torch.Tensor, got float"),
]



def _valid_args() -> dict:
    """The valid call on VCASE's inputs, its keyword arguments too."""
    inp = make_qk_norm_inputs(VCASE)
    return {**dict(zip(FUSED_NAMES, inp.fused_args(), strict=True)), **inp.fused_kwargs()}


BAD = bad_inputs(FUSED_BAD, _valid_args)

PROVIDER = Provider(
    op=OP,
    call=_call,
    public=kvwrite.fused_qk_norm_rope_and_reshape_cache_flash,
    build=build,
    mutates=(),
    mutated_names=(),
    check=check_all(lambda inp: None),
    tensors_of=tensors_of,
    written_of=tensors_of,
    with_written=with_written,
    small_tile_cases=small_tile_cases(kv_cache_dtype="fp8", layout=Layout.HND),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
