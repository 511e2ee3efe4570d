"""The NVFP4 cache write (the hidden op behind reshape_and_cache_flash's kv_cache_dtype="nvfp4"
and FlashInfer's nvfp4_quantize_append_paged_kv_cache_with_slot_mapping) for the conformance
suite; a case's ``form`` picks the entry point. Its rule and page layout against independent
oracles: tests/test_nvfp4.py."""

from __future__ import annotations

import dataclasses
import math

import torch

import kvwrite
from kvwrite.ops.nvfp4 import OP, ScaleLayout
from kvwrite.ops.nvfp4 import reference as torch_ref

from ..conformance import (
    BadInput,
    Example,
    Provider,
    WrongWriter,
    compile_every_variant,
    replaced,
    small_tiles,
)
from ..nvfp4 import Nvfp4Case, assert_storages_equal, make_nvfp4_inputs


def _call(inp, implementation=None) -> None:
    inp.call(implementation)


def _tensors(args: tuple) -> list[torch.Tensor]:
    inp = args[0]
    given = (inp.key, inp.value, inp.slot_mapping, inp.k_scale, inp.v_scale)
    return [t for t in given if isinstance(t, torch.Tensor)] + inp.tensors()


def _with_written(args: tuple, copies: list[torch.Tensor]) -> tuple:
    inp = args[0]
    it = iter(copies)
    caches = tuple(tuple(next(it) for _ in c) if isinstance(c, tuple) else next(it)
                   for c in inp.caches)
    return (inp.with_caches(caches),)


def _check(case: Nvfp4Case, got, want) -> None:
    assert_storages_equal(list(got), list(want), f"{case.form} caches")


# --- deliberately wrong writers: another group rule, or the reference on wrong arguments --------

def _broken(rule=None, transform=None):
    """The reference with ``rule`` for its group quantizer and/or its internal ``run``
    arguments changed by ``transform``."""
    def write(inp) -> None:
        args = list(inp.run_args())
        if transform is not None:
            args = transform(args)
        real = torch_ref.quantize_groups
        if rule is not None:
            torch_ref.quantize_groups = rule
        try:
            torch_ref.run(*args)
        finally:
            torch_ref.quantize_groups = real
    return write


def _divide(x, k, four_over_six=False):
    """The codes of x / d (a true division), as both upstreams' divisions would."""
    from kvwrite.ops.nvfp4 import rule
    codes, s = rule.quantize_groups(x, k, four_over_six)
    d = rule.e4m3_value(s) * rule.scale_tensor(k, x.device)
    q = torch.where(d[:, None] == 0, x * 0, x.float() / d[:, None])
    return rule.e2m1_codes(q), s


def _nan_to_zero(x, k, four_over_six=False):
    from kvwrite.ops.nvfp4 import rule
    codes, s = rule.quantize_groups(x, k, four_over_six)
    return torch.where(torch.isnan(x.float()), torch.zeros_like(codes), codes), s


def _no_tie_to_even(x, k, four_over_six=False):
    """E2M1 with ties away from zero."""
    from kvwrite.ops.nvfp4 import rule
    codes, s = rule.quantize_groups(x, k, four_over_six)
    d = rule.e4m3_value(s) * rule.scale_tensor(k, x.device)
    r = torch.where(d == 0, d, 1 / d)
    m = (x.float() * r[:, None]).abs()
    up = torch.zeros_like(codes)
    for t in (0.25, 1.25, 2.5, 5.0):
        up |= (m == t).to(torch.uint8)
    return codes + up, s



def _swizzle_ignored(args):
    args[10] = ScaleLayout.LINEAR
    return args


def _hnd_as_nhd(args):
    for i in (2, 3, 4, 5):
        v = args[i]
        nb, bs, h, n = v.shape
        args[i] = v.as_strided(v.shape, (v.stride(0), h * n, n, 1), v.storage_offset())
    return args


def _skip_last_token(args):
    args[6] = args[6][:-1]
    return args


def _k_scale_for_v(args):
    args[9] = args[8]
    return args



WRONG = tuple(WrongWriter(i, _broken(r, t), c) for i, c, r, t in [
    ("division", Nvfp4Case(special_values=True, num_tokens=20), _divide, None),
    ("nan-to-zero", Nvfp4Case(special_values=True, num_tokens=20), _nan_to_zero, None),
    ("ties-away", Nvfp4Case(special_values=True, num_tokens=20), _no_tie_to_even, None),
    ("swizzle-ignored", Nvfp4Case(v_scale_layout="swizzled", num_tokens=9), None, _swizzle_ignored),
    ("hnd-as-nhd", Nvfp4Case(layout="HND", num_tokens=9), None, _hnd_as_nhd),
    ("hnd-as-nhd-fi", Nvfp4Case(layout="HND", form="stacked", num_tokens=9), None, _hnd_as_nhd),
    ("skip-last-token", Nvfp4Case(num_tokens=9, form="padded", pad=4), None, _skip_last_token),
    ("k-scale-for-v", Nvfp4Case(num_tokens=4), None, _k_scale_for_v),
])


# --- bad input: vLLM's form (reshape_and_cache_flash) and FlashInfer's --------------------------

def _vllm_args() -> dict:
    """A valid vLLM-form call (H=2, D=64, bs=16); bad input replaces some of its arguments."""
    inp = make_nvfp4_inputs(Nvfp4Case(num_tokens=5))
    kc, vc = inp.caches
    return dict(key=inp.key, value=inp.value, key_cache=kc, value_cache=vc,
                slot_mapping=inp.slot_mapping, kv_cache_dtype="nvfp4", k_scale=inp.k_scale,
                v_scale=inp.v_scale, v_scale_layout="linear")


def _vllm(**changes):
    return replaced(_vllm_args, changes)


def _strided(c: torch.Tensor, stride) -> torch.Tensor:
    return c.as_strided(c.shape, stride, c.storage_offset())


BAD_VLLM = [
    ("kv-cache-dtype", _vllm(kv_cache_dtype=lambda a: "nvfp5"), ValueError, "kv_cache_dtype: expected one of"),
    ("key-type", _vllm(key=lambda a: a["key"].tolist()), TypeError, "key: expected a torch.Tensor"),
    ("key-dims", _vllm(key=lambda a: a["key"][0]), ValueError, "key: expected 3 dims"),
    ("value-shape", _vllm(value=lambda a: a["value"][:, :1]), ValueError, "value: expected the shape of key"),
    ("key-dtype", _vllm(key=lambda a: a["key"].double(), value=lambda a: a["value"].double()), ValueError, "key: expected dtype float16, bfloat16 or float32"),
    ("value-dtype", _vllm(value=lambda a: a["value"].half()), ValueError, "value: expected the dtype of key"),
    ("head-size", _vllm(key=lambda a: a["key"][..., :40], value=lambda a: a["value"][..., :40]), ValueError, "key: kv_cache_dtype='nvfp4' needs head_size a positive multiple of 16, got 40"),
    ("dense-heads", _vllm(key=lambda a: a["key"].repeat(1, 1, 2)[..., :64], value=lambda a: a["value"].repeat(1, 1, 2)[..., :64]), ValueError, "key: expected dense heads"),
    ("cache-dtype", _vllm(key_cache=lambda a: a["key_cache"].view(torch.float8_e4m3fn), value_cache=lambda a: a["value_cache"].view(torch.float8_e4m3fn)), ValueError, "key_cache: kv_cache_dtype='nvfp4' expects a cache of dtype torch.uint8"),
    ("cache-dims", _vllm(key_cache=lambda a: a["key_cache"][0]), ValueError, "key_cache: expected 4 dims"),
    ("cache-F", _vllm(key_cache=lambda a: a["key_cache"][..., :35], value_cache=lambda a: a["value_cache"][..., :35]), ValueError, "key_cache: expected [num_blocks, block_size, 2, 36]"),
    ("value-cache-shape", _vllm(value_cache=lambda a: a["value_cache"][:2]), ValueError, "value_cache: expected the shape of key_cache"),
    ("value-cache-strides", _vllm(value_cache=lambda a: a["value_cache"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "value_cache: expected the strides of key_cache"),
    ("cache-physical-hnd", _vllm(key_cache=lambda a: _strided(a["key_cache"], (2304, 37, 36, 1)), value_cache=lambda a: _strided(a["value_cache"], (2304, 37, 36, 1))), ValueError, "key_cache: expected a logical [num_blocks, block_size, H, F] view whose inner dims are dense NHD"),
    ("cache-s0", _vllm(key_cache=lambda a: _strided(a["key_cache"], (1000, 72, 36, 1)), value_cache=lambda a: _strided(a["value_cache"], (1000, 72, 36, 1))), ValueError, "key_cache: expected a block stride s0 >= block_size * H * F = 1152"),
    ("overlap", _vllm(value_cache=lambda a: a["key_cache"]), ValueError, "value_cache: expected memory apart from key_cache's"),
    ("slot-dtype", _vllm(slot_mapping=lambda a: a["slot_mapping"].float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot-dims", _vllm(slot_mapping=lambda a: a["slot_mapping"][None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot-count", _vllm(slot_mapping=lambda a: torch.cat([a["slot_mapping"]] * 2)), ValueError, "slot_mapping: expected at most key.shape[0] = 5 entries, got 10"),
    ("k-scale-none", _vllm(k_scale=lambda a: None), ValueError, "k_scale: kv_cache_dtype='nvfp4' needs a one-element float32 tensor, got None"),
    ("k-scale-number", _vllm(k_scale=lambda a: 0.5), TypeError, "k_scale: expected a torch.Tensor"),
    ("k-scale-dtype", _vllm(k_scale=lambda a: a["k_scale"].double()), ValueError, "k_scale: expected dtype float32"),
    ("v-scale-per-head", _vllm(v_scale=lambda a: torch.ones(2)), ValueError, "v_scale: expected exactly one element"),
    ("v-scale-2d", _vllm(v_scale=lambda a: torch.ones(1, 1)), ValueError, "v_scale: expected exactly one element (shape [] or [1]"),
    ("v-scale-layout", _vllm(v_scale_layout=lambda a: "tiled"), ValueError, "v_scale_layout: expected None, 'linear' or 'swizzled', got 'tiled'"),
    ("swizzle-block-size", _vllm(key_cache=lambda a: a["key_cache"][:, :6], value_cache=lambda a: a["value_cache"][:, :6], v_scale_layout=lambda a: "swizzled"), ValueError, "v_scale_layout: 'swizzled' (asked for) needs block_size % 4 == 0"),
    ("swizzle-default-d80", lambda: ((), _d80(None)), ValueError, "v_scale_layout: 'swizzled' (the default on cpu) needs block_size % 4 == 0 and head_size % 64 == 0, got block_size 16 and head_size 80"),
    ("requires-grad", _vllm(key=lambda a: a["key"].float().requires_grad_(), value=lambda a: a["value"].float()), ValueError, "key: expected a tensor that does not require grad"),
]


def _d80(v_layout):
    inp = make_nvfp4_inputs(Nvfp4Case(num_tokens=3, head_size=80, v_scale_layout=v_layout))
    kc, vc = inp.caches
    return dict(key=inp.key, value=inp.value, key_cache=kc, value_cache=vc,
                slot_mapping=inp.slot_mapping, kv_cache_dtype="nvfp4", k_scale=inp.k_scale,
                v_scale=inp.v_scale, v_scale_layout=v_layout)


def _fi_args() -> dict:
    """A valid FlashInfer-form call (tuple, NHD, H=2, D=64); bad input replaces some of its
    arguments."""
    inp = make_nvfp4_inputs(Nvfp4Case(num_tokens=5, form="tuple"))
    return dict(append_key=inp.key, append_value=inp.value, slot_mapping=inp.slot_mapping,
                paged_kv_cache=inp.caches[0], kv_cache_sf=inp.caches[1],
                k_scale=inp.k_scale, v_scale=inp.v_scale, kv_layout="NHD")


def _fi(**changes):
    return replaced(_fi_args, changes)


BAD_FI = [
    ("kv-layout", _fi(kv_layout=lambda a: "NDH"), ValueError, "kv_layout: expected 'NHD' or 'HND', got 'NDH'"),
    ("append-key-dims", _fi(append_key=lambda a: a["append_key"][0]), ValueError, "append_key: expected 3 dims"),
    ("append-key-d", _fi(append_key=lambda a: a["append_key"][..., :24], append_value=lambda a: a["append_value"][..., :24]), ValueError, "append_key: NVFP4 needs head_size a positive multiple of 16, got 24"),
    ("data-dtype", _fi(paged_kv_cache=lambda a: tuple(x.view(torch.float8_e4m3fn) for x in a["paged_kv_cache"])), ValueError, "paged_kv_cache[0]: expected dtype torch.uint8, got torch.float8_e4m3fn"),
    ("sf-dtype", _fi(kv_cache_sf=lambda a: tuple(x.view(torch.uint8) for x in a["kv_cache_sf"])), ValueError, "kv_cache_sf[0]: expected dtype torch.float8_e4m3fn, got torch.uint8"),
    ("data-last-dim", _fi(paged_kv_cache=lambda a: tuple(x[..., :16] for x in a["paged_kv_cache"])), ValueError, "paged_kv_cache[0]: expected a last dim of 32"),
    ("data-last-stride", _fi(paged_kv_cache=lambda a: tuple(x.repeat(1, 1, 1, 2)[..., ::2] for x in a["paged_kv_cache"])), ValueError, "paged_kv_cache[0]: expected a contiguous last dim"),
    ("data-pair", _fi(paged_kv_cache=lambda a: (*a["paged_kv_cache"], a["paged_kv_cache"][0])), ValueError, "paged_kv_cache: expected a tuple (k, v) or one 5-D tensor, got a tuple of 3 items"),
    ("data-5d", _fi(paged_kv_cache=lambda a: torch.stack(a["paged_kv_cache"] * 2, dim=1)), ValueError, "paged_kv_cache: expected a tuple (k, v) or one 5-D tensor with K/V on dim 1 ([P, 2, page, H, 32])"),
    ("data-v-shape", _fi(paged_kv_cache=lambda a: (a["paged_kv_cache"][0], a["paged_kv_cache"][1][:2])), ValueError, "paged_kv_cache[1]: expected the shape of paged_kv_cache[0]"),
    ("heads", _fi(paged_kv_cache=lambda a: tuple(x[:, :, :1] for x in a["paged_kv_cache"]), kv_cache_sf=lambda a: tuple(x[:, :, :1] for x in a["kv_cache_sf"])), ValueError, "paged_kv_cache: expected 2 heads (those of append_key), got 1"),
    ("sf-pages", _fi(kv_cache_sf=lambda a: tuple(x[:2] for x in a["kv_cache_sf"])), ValueError, "kv_cache_sf: expected [P, page, H] = (4, 16, 2) as paged_kv_cache"),
    ("k-scale-negative", _fi(k_scale=lambda a: -0.5), ValueError, "k_scale: expected a positive finite number, got -0.5"),
    ("k-scale-inf", _fi(k_scale=lambda a: math.inf), ValueError, "k_scale: expected a positive finite number"),
    ("k-scale-nan", _fi(k_scale=lambda a: math.nan), ValueError, "k_scale: expected a positive finite number"),
    ("k-scale-zero", _fi(k_scale=lambda a: 0), ValueError, "k_scale: expected a positive finite number"),
    ("v-scale-underflow", _fi(v_scale=lambda a: 1e-50), ValueError, "v_scale: expected a number whose float32 rounding is positive and finite"),
    ("v-scale-overflow", _fi(v_scale=lambda a: 1e39), ValueError, "v_scale: expected a number whose float32 rounding is positive and finite"),
    ("v-scale-bool", _fi(v_scale=lambda a: True), TypeError, "v_scale: expected a Python number or a one-element float32 tensor, got bool"),
    ("v-scale-str", _fi(v_scale=lambda a: "1"), TypeError, "v_scale: expected a Python number"),
    ("k-scale-tensor-dtype", _fi(k_scale=lambda a: torch.ones(1, dtype=torch.float16)), ValueError, "k_scale: expected dtype float32"),
    ("k-scale-tensor-numel", _fi(k_scale=lambda a: torch.ones(3)), ValueError, "k_scale: expected exactly one element"),
    ("slot-count", _fi(slot_mapping=lambda a: torch.cat([a["slot_mapping"]] * 2)), ValueError, "slot_mapping: expected at most append_key.shape[0] = 5 entries"),
    ("overlap", _fi(paged_kv_cache=lambda a: (a["paged_kv_cache"][0], a["paged_kv_cache"][0])), ValueError, "expected memory apart from paged_kv_cache (K data)'s"),
]



BAD = (*(BadInput(f"vllm-{i}", m, e, t, kvwrite.reshape_and_cache_flash)
         for i, m, e, t in BAD_VLLM),
       *(BadInput(f"flashinfer-{i}", m, e, t,
                  kvwrite.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping)
         for i, m, e, t in BAD_FI))


# --- CUDA graphs ---------------------------------------------------------------------------------

def _graph_case(form: str, tokens: int) -> Nvfp4Case:
    """A small call (cuda's small-call kernel) or a large one (two groups a thread)."""
    return Nvfp4Case(form=form, num_tokens=tokens, num_heads=4, head_size=128, block_size=16,
                     num_blocks=-(-tokens // 16) + 2, padding_slots=3, out_of_range_slots=2,
                     special_values=True, extra_rows=2, layout="HND", v_scale_layout="swizzled")


def _replay_case(case: Nvfp4Case) -> Nvfp4Case:
    """New scale values in the scale tensors; Python-number scales are part of the capture."""
    return case if case.scale_as_number else dataclasses.replace(case, k_scale=0.05,
                                                                 v_scale=0.0007)


PROVIDER = Provider(
    op=OP,
    call=_call,
    build=lambda case, device, seed: (make_nvfp4_inputs(case, device, seed),),
    mutates=(),
    mutated_names=(),
    check=_check,
    tensors_of=_tensors,
    written_of=lambda args: args[0].tensors(),
    with_written=_with_written,
    replay_case=_replay_case,
    graph_cases=(*(Example(f"{form}-{size}", _graph_case(form, tokens))
                   for form in ("vllm", "stacked")
                   for size, tokens in (("small-call", 64), ("large-call", 600))),
                 Example("tuple-python-number-scales",
                         Nvfp4Case(form="tuple", num_tokens=32, scale_as_number=True,
                                   padding_slots=2))),
    # Groups of 16: D = 16 and 32.
    small_tile_cases=small_tiles(
        Nvfp4Case(num_tokens=3, num_heads=1, head_size=16, padding_slots=1),
        dict(), dict(num_tokens=2, num_heads=2, head_size=32, form="stacked")),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    # nvfp4_kernel by dtype x MODE x slot type x rule (28), nvfp4_small_kernel by dtype x slot
    # type x 4 or 8 elements a thread (12).
    compile_variants=compile_every_variant("kvwrite.ops.nvfp4", 70),
)
