"""The MX cache write (the hidden op behind reshape_and_cache_flash's kv_cache_dtype="mxfp8" and
"mxfp4") for the conformance suite. Its rule against an independent oracle, the reader and the
round trip: tests/test_mx.py."""

from __future__ import annotations

import dataclasses

import torch

import kvwrite
from kvwrite.ops.mx_kv_write import OP
from kvwrite.ops.mx_kv_write import reference as torch_ref

from ..conformance import BadInput, Example, Provider, WrongWriter, replaced, small_tiles
from ..mx import (
    MUTATES,
    MX_CASES,
    MX_GPU_CASES,
    NAMES,
    MxCase,
    assert_mx_caches_equal,
    call_mx,
    make_mx_inputs,
    run_args,
)

# --- deliberately wrong writers: the reference on wrong arguments --------------------------------

def _broken(transform):
    def write(*args) -> None:
        torch_ref.run(*transform(list(run_args(args))))
    return write


def _set(i, value):
    def transform(a):
        a[i] = value
        return a
    return transform


def _k_scales_for_v(a):
    a[5] = a[4]
    return a


def _skip_last_token(a):
    a[6] = a[6][:-1]
    return a


def _hnd_as_nhd(a):
    for i in (2, 3):
        v = a[i]
        nb, bs, h, f = v.shape
        a[i] = v.as_strided(v.shape, (v.stride(0), h * f, f, 1), v.storage_offset())
    return a


def _e2m1_for_e4m3(a):
    a[7] = dataclasses.replace(a[7], element=kvwrite.formats.Element.E2M1)
    a[2], a[3] = (c[..., : c.shape[-1] // 2] for c in (a[2], a[3]))
    return a


WRONG = tuple(WrongWriter(i, _broken(t), c) for i, c, t in [
    ("floor-for-ceil", MxCase(special_values=True, num_tokens=9), _set(8, "floor")),
    ("ceil-for-floor", MxCase(kv_cache_dtype="mxfp4", scale_rule="floor", special_values=True,
                              num_tokens=9), _set(8, "ceil")),
    ("k-scales-for-v", MxCase(num_tokens=4), _k_scales_for_v),
    ("skip-last-token", MxCase(num_tokens=6, padding_slots=1), _skip_last_token),
    ("hnd-as-nhd", MxCase(layout="HND", num_tokens=6), _hnd_as_nhd),
    ("e2m1-for-e4m3", MxCase(num_tokens=4), _e2m1_for_e4m3),
])


def _interleaved_as_linear(*args) -> None:
    """Scale bytes of the interleaved128 layout written to its linear positions (through a
    linear view of the same bytes)."""
    a = list(run_args(args))
    for i in (4, 5):
        s = a[i]
        nb, h = s.shape[:2]
        bs, g = s.shape[2] * 128, s.shape[5]
        a[i] = s.as_strided((nb, bs, h, g), (s.stride(0), h * g, g, 1), s.storage_offset())
    a[9] = "linear"
    torch_ref.run(*a)


WRONG = (*WRONG, WrongWriter("linear-for-interleaved128", _interleaved_as_linear,
                             MxCase(head_size=128, block_size=128, num_blocks=2,
                                    scale_layout="interleaved128", num_tokens=5)))


# --- bad input ---------------------------------------------------------------------------------

_BASE = MxCase(num_tokens=5)  # H=2, D=64, bs=16, 4 blocks, NHD, linear uint8 scale caches


def _args(case: MxCase = _BASE):
    def make() -> dict:
        a = make_mx_inputs(case)
        return dict(key=a[0], value=a[1], key_cache=a[2], value_cache=a[3], slot_mapping=a[4],
                    kv_cache_dtype=a[5], k_scale_cache=a[6], v_scale_cache=a[7],
                    scale_rule=a[8], scale_layout=a[9])
    return make


def _mx(case: MxCase = _BASE, **changes):
    return replaced(_args(case), changes)


def _fp8(**changes):
    """A valid fp8 call (no MX keywords) changed by ``changes``."""
    def make() -> dict:
        a = _args()()
        kc = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
        return dict(key=a["key"], value=a["value"], key_cache=kc, value_cache=kc.clone(),
                    slot_mapping=a["slot_mapping"], kv_cache_dtype="fp8",
                    k_scale=torch.ones(1), v_scale=torch.ones(1))
    return replaced(make, changes)


_I128 = MxCase(num_tokens=5, head_size=128, block_size=128, num_blocks=2,
               scale_layout="interleaved128")
_MXFP4 = MxCase(num_tokens=5, kv_cache_dtype="mxfp4")
_F8 = MxCase(num_tokens=5, cache_storage="float8")

BAD_MX = [
    ("mode", _mx(kv_cache_dtype=lambda a: "mxfp6"), ValueError, "kv_cache_dtype: expected one of"),
    ("scale-rule", _mx(scale_rule=lambda a: "round"), ValueError, "scale_rule: expected one of ['ceil', 'floor'], got 'round'"),
    ("scale-layout", _mx(scale_layout=lambda a: "swizzled"), ValueError, "scale_layout: expected one of ['linear', 'interleaved128'], got 'swizzled'"),
    ("v-scale-layout", _mx(v_scale_layout=lambda a: "linear"), ValueError, "v_scale_layout: only the NVFP4 modes lay out V scales"),
    ("key-type", _mx(key=lambda a: a["key"].tolist()), TypeError, "key: expected a torch.Tensor"),
    ("key-dims", _mx(key=lambda a: a["key"][0]), ValueError, "key: expected 3 dims"),
    ("value-shape", _mx(value=lambda a: a["value"][:, :1]), ValueError, "value: expected the shape of key"),
    ("key-dtype", _mx(key=lambda a: a["key"].double(), value=lambda a: a["value"].double()), ValueError, "key: expected dtype float16, bfloat16 or float32, got torch.float64"),
    ("value-dtype", _mx(value=lambda a: a["value"].half()), ValueError, "value: expected the dtype of key"),
    ("head-size", _mx(key=lambda a: a["key"][..., :48], value=lambda a: a["value"][..., :48]), ValueError, "key: kv_cache_dtype='mxfp8' needs head_size a positive multiple of 32, got 48"),
    ("dense-heads", _mx(key=lambda a: a["key"].repeat(1, 1, 2)[..., :64], value=lambda a: a["value"].repeat(1, 1, 2)[..., :64]), ValueError, "key: expected dense heads"),
    ("cache-type", _mx(key_cache=lambda a: None), TypeError, "key_cache: expected a torch.Tensor"),
    ("cache-dims", _mx(key_cache=lambda a: a["key_cache"][0]), ValueError, "key_cache: expected 4 dims"),
    ("cache-dtype", _mx(key_cache=lambda a: a["key_cache"].view(torch.int8), value_cache=lambda a: a["value_cache"].view(torch.int8)), ValueError, "key_cache: kv_cache_dtype='mxfp8' expects a cache of dtype torch.uint8 or torch.float8_e4m3fn, got torch.int8"),
    ("mxfp4-cache-float8", _mx(_MXFP4, key_cache=lambda a: a["key_cache"].view(torch.float8_e4m3fn), value_cache=lambda a: a["value_cache"].view(torch.float8_e4m3fn)), ValueError, "key_cache: kv_cache_dtype='mxfp4' expects a cache of dtype torch.uint8, got torch.float8_e4m3fn"),
    ("cache-F", _mx(key_cache=lambda a: a["key_cache"][..., :32], value_cache=lambda a: a["value_cache"][..., :32]), ValueError, "key_cache: expected [num_blocks, block_size, 2, 64] (H of key, F = D for head_size 64)"),
    ("mxfp4-cache-F", _mx(_MXFP4, key_cache=lambda a: torch.zeros(4, 16, 2, 64, dtype=torch.uint8), value_cache=lambda a: torch.zeros(4, 16, 2, 64, dtype=torch.uint8)), ValueError, "key_cache: expected [num_blocks, block_size, 2, 32] (H of key, F = D/2 for head_size 64)"),
    ("cache-heads", _mx(key_cache=lambda a: a["key_cache"][:, :, :1], value_cache=lambda a: a["value_cache"][:, :, :1]), ValueError, "key_cache: expected [num_blocks, block_size, 2, 64]"),
    ("value-cache-shape", _mx(value_cache=lambda a: a["value_cache"][:2]), ValueError, "value_cache: expected the shape of key_cache"),
    ("value-cache-dtype", _mx(_F8, value_cache=lambda a: a["value_cache"].view(torch.uint8)), ValueError, "value_cache: expected the dtype of key_cache (torch.float8_e4m3fn), got torch.uint8"),
    ("value-cache-strides", _mx(value_cache=lambda a: a["value_cache"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "value_cache: expected the strides of key_cache"),
    ("cache-last-stride", _mx(key_cache=lambda a: a["key_cache"].repeat(1, 1, 1, 2)[..., ::2], value_cache=lambda a: a["value_cache"].repeat(1, 1, 1, 2)[..., ::2]), ValueError, "key_cache: expected a unit-stride last dim"),
    ("k-scale-cache-none", _mx(k_scale_cache=lambda a: None), ValueError, "k_scale_cache: kv_cache_dtype='mxfp8' needs a scale cache (uint8 or float8_e8m0fnu, one byte per 32 elements), got None"),
    ("v-scale-cache-none", _mx(v_scale_cache=lambda a: None), ValueError, "v_scale_cache: kv_cache_dtype='mxfp8' needs a scale cache"),
    ("scale-cache-type", _mx(k_scale_cache=lambda a: a["k_scale_cache"].tolist()), TypeError, "k_scale_cache: expected a torch.Tensor"),
    ("scale-cache-dtype", _mx(k_scale_cache=lambda a: a["k_scale_cache"].view(torch.int8), v_scale_cache=lambda a: a["v_scale_cache"].view(torch.int8)), ValueError, "k_scale_cache: expected dtype torch.uint8 or torch.float8_e8m0fnu, got torch.int8"),
    ("scale-cache-dtypes-differ", _mx(v_scale_cache=lambda a: a["v_scale_cache"].view(torch.float8_e8m0fnu)), ValueError, "v_scale_cache: expected the dtype of k_scale_cache (torch.uint8), got torch.float8_e8m0fnu"),
    ("scale-cache-shape", _mx(k_scale_cache=lambda a: a["k_scale_cache"][..., :1], v_scale_cache=lambda a: a["v_scale_cache"][..., :1]), ValueError, "k_scale_cache: expected [num_blocks, block_size, H, D/32] = (4, 16, 2, 2) (scale_layout='linear', those of key_cache and key), got shape (4, 16, 2, 1)"),
    ("scale-cache-blocks", _mx(k_scale_cache=lambda a: a["k_scale_cache"][:3], v_scale_cache=lambda a: a["v_scale_cache"][:3]), ValueError, "k_scale_cache: expected [num_blocks, block_size, H, D/32] = (4, 16, 2, 2)"),
    ("v-scale-cache-shape", _mx(v_scale_cache=lambda a: a["v_scale_cache"][:3]), ValueError, "v_scale_cache: expected the shape of k_scale_cache"),
    ("interleaved128-shape", _mx(_I128, k_scale_cache=lambda a: a["k_scale_cache"][:, :, :, :16], v_scale_cache=lambda a: a["v_scale_cache"][:, :, :, :16]), ValueError, "k_scale_cache: expected [num_blocks, H, block_size/128, 32, 4, 4] = (2, 2, 1, 32, 4, 4)"),
    ("interleaved128-head-size", _mx(scale_layout=lambda a: "interleaved128"), ValueError, "scale_layout: 'interleaved128' needs head_size 128 and block_size % 128 == 0, got head_size 64 and block_size 16"),
    ("interleaved128-block-size", _mx(_I128, key_cache=lambda a: a["key_cache"][:, :64], value_cache=lambda a: a["value_cache"][:, :64]), ValueError, "scale_layout: 'interleaved128' needs head_size 128 and block_size % 128 == 0, got head_size 128 and block_size 64"),
    ("slot-dtype", _mx(slot_mapping=lambda a: a["slot_mapping"].float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot-dims", _mx(slot_mapping=lambda a: a["slot_mapping"][None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot-count", _mx(slot_mapping=lambda a: torch.cat([a["slot_mapping"]] * 2)), ValueError, "slot_mapping: expected at most key.shape[0] = 5 entries, got 10"),
    ("device", _mx(k_scale_cache=lambda a: a["k_scale_cache"].to("meta"), v_scale_cache=lambda a: a["v_scale_cache"].to("meta")), ValueError, "k_scale_cache: expected device cpu (that of key), got meta"),
    ("overlap-caches", _mx(value_cache=lambda a: a["key_cache"]), ValueError, "value_cache: expected memory apart from key_cache's"),
    ("overlap-scale-caches", _mx(v_scale_cache=lambda a: a["k_scale_cache"]), ValueError, "v_scale_cache: expected memory apart from k_scale_cache's"),
    ("overlap-scales-data", _mx(k_scale_cache=lambda a: a["key_cache"][..., :2]), ValueError, "expected memory apart from key_cache's"),
    ("overlap-input", _mx(k_scale_cache=lambda a: a["key"].view(torch.uint8).reshape(-1)[:256].view(4, 16, 2, 2)), ValueError, "key: expected memory apart from k_scale_cache's"),
    ("requires-grad", _mx(key=lambda a: a["key"].float().requires_grad_(), value=lambda a: a["value"].float()), ValueError, "key: expected a tensor that does not require grad"),
    ("scale-cache-requires-grad", _mx(k_scale_cache=lambda a: torch.zeros(4, 16, 2, 2).requires_grad_(), v_scale_cache=lambda a: torch.zeros(4, 16, 2, 2)), ValueError, "k_scale_cache: expected dtype torch.uint8 or torch.float8_e8m0fnu, got torch.float32"),
    # A non-MX mode refuses the MX keywords.
    ("fp8-with-k-scale-cache", _fp8(k_scale_cache=lambda a: torch.zeros(4, 16, 2, 2, dtype=torch.uint8)), ValueError, "k_scale_cache: only the MX modes ('mxfp8', 'mxfp4') take scale caches; expected None with kv_cache_dtype='fp8', got a Tensor"),
    ("fp8-with-v-scale-cache", _fp8(v_scale_cache=lambda a: torch.zeros(4, 16, 2, 2, dtype=torch.uint8)), ValueError, "v_scale_cache: only the MX modes"),
    ("auto-with-scale-caches", _fp8(kv_cache_dtype=lambda a: "auto", key_cache=lambda a: torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), value_cache=lambda a: torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), k_scale_cache=lambda a: torch.zeros(4, 16, 2, 2, dtype=torch.uint8), v_scale_cache=lambda a: torch.zeros(4, 16, 2, 2, dtype=torch.uint8)), ValueError, "k_scale_cache: only the MX modes"),
    ("fp8-with-scale-rule", _fp8(scale_rule=lambda a: "floor"), ValueError, "scale_rule: only the MX modes take a scale rule; expected 'ceil' (the default) with kv_cache_dtype='fp8', got 'floor'"),
    ("fp8-with-scale-layout", _fp8(scale_layout=lambda a: "interleaved128"), ValueError, "scale_layout: only the MX modes lay out scale caches"),
    ("nvfp4-with-scale-cache", _fp8(kv_cache_dtype=lambda a: "nvfp4", k_scale_cache=lambda a: torch.zeros(4, 16, 2, 2, dtype=torch.uint8)), ValueError, "k_scale_cache: only the MX modes ('mxfp8', 'mxfp4') take scale caches; expected None with kv_cache_dtype='nvfp4'"),
]

BAD = tuple(BadInput(i, m, e, t, kvwrite.reshape_and_cache_flash) for i, m, e, t in BAD_MX)


def _graph_case(case: MxCase) -> MxCase:
    return dataclasses.replace(case, num_tokens=200, padding_slots=3, out_of_range_slots=2,
                               num_blocks=max(case.num_blocks, 16 if case.block_size < 128
                                              else 2), extra_rows=2)


PROVIDER = Provider(
    op=OP,
    call=call_mx,
    build=lambda case, device, seed: make_mx_inputs(case, device, seed),
    mutates=MUTATES,
    mutated_names=NAMES,
    check=assert_mx_caches_equal,
    public=kvwrite.reshape_and_cache_flash,
    cases=(*(Example(c.id, c) for c in MX_CASES),
           *(Example(f"gpu-{c.id}", c, gpu=True) for c in MX_GPU_CASES)),
    graph_cases=tuple(Example(c.id, _graph_case(c)) for c in (
        MxCase(special_values=True),
        MxCase(kv_cache_dtype="mxfp4", layout="HND", scale_rule="floor", special_values=True),
        MxCase(kv_cache_dtype="mxfp4", head_size=128, block_size=128, num_blocks=2,
               scale_layout="interleaved128"))),
    compile_cases=(Example("mxfp8", MxCase(num_tokens=4)),
                   Example("mxfp4-interleaved128", MxCase(kv_cache_dtype="mxfp4", head_size=128,
                                                          block_size=128, num_blocks=2,
                                                          scale_layout="interleaved128",
                                                          num_tokens=4))),
    # Groups of 32: D = 32.
    small_tile_cases=small_tiles(
        MxCase(num_tokens=3, num_heads=1, head_size=32, padding_slots=1), dict(),
        dict(num_tokens=2, num_heads=2, kv_cache_dtype="mxfp4", layout="HND",
             out_of_range_slots=0)),
    compiled=("kvwrite.reshape_and_cache_flash",),
    wrong_writers=WRONG,
    bad_inputs=BAD,
)
