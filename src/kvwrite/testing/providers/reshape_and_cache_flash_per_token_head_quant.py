"""reshape_and_cache_flash_per_token_head_quant for the conformance suite (its case matrix against
the independent oracle and its row arithmetic: tests/test_per_token_head.py)."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import OP, PerTokenHeadMode
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import reference as torch_ref

from ..compare import storage_bytes
from ..conformance import (
    BadInput,
    Example,
    Provider,
    WrongWriter,
    compile_every_variant,
    small_tiles,
)
from ..per_token_head import (
    FP8,
    INT4,
    INT8,
    PthCase,
    assert_pth_caches_equal,
    check_roundtrip,
    make_pth_inputs,
)


def _dq(case: PthCase) -> tuple[int, int]:
    return case.mode.quantized_size(case.dk), case.mode.quantized_size(case.dv)


def _check(case: PthCase, got, want) -> None:
    assert_pth_caches_equal(tuple(got), tuple(want), case.mode, _dq(case))


def _skip(info, case: PthCase, args: tuple) -> str | None:
    return info.unsupported(args[0], args[1], args[2], args[3], case.mode)


def _roundtrip(args: tuple) -> None:
    """After a replay the caches also read back within half a step of the rows."""
    assert check_roundtrip(*args) is None


# --- deliberately wrong writers (the reference's arguments: the case's PerTokenHeadMode) ---------

def _wrong(write, case: PthCase):
    def run(key, value, kc, vc, ks, vs, slot_mapping, kv_quant_mode):
        write(key, value, kc, vc, ks, vs, slot_mapping, case.mode)
    return run


def _rows_writer(quantize):
    """A writer with the reference's addressing and another row quantizer."""
    def run(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, mode):
        nb, bs = key_cache.shape[:2]
        slots = slot_mapping.long()
        keep = (slots >= 0) & (slots < nb * bs)
        tokens = torch.nonzero(keep).flatten()
        slots = slots[keep]
        for src, cache, scales in ((key, key_cache, k_scale_cache),
                                   (value, value_cache, v_scale_cache)):
            codes, entries = quantize(src[tokens], mode)
            cache[..., :codes.shape[-1]].view(torch.uint8)[slots // bs, slots % bs] = codes
            scales[slots // bs, slots % bs] = entries
    return run


def _skip_last_token(key, value, kc, vc, ks, vs, slot_mapping, mode):
    torch_ref.run(key, value, kc, vc, ks, vs, slot_mapping[:-1], mode)


def _clobber_row_tail(key, value, kc, vc, ks, vs, slot_mapping, mode):
    """Writes whole rows [..., :E] (codes then zeros), over vLLM's inline scale bytes."""
    torch_ref.run(key, value, kc, vc, ks, vs, slot_mapping, mode)
    nb, bs = kc.shape[:2]
    for s in slot_mapping.tolist():
        if 0 <= s < nb * bs:
            dq = mode.quantized_size(key.shape[2])
            kc[s // bs, s % bs, :, dq:].view(torch.uint8).zero_()


def _half_to_even(x, mode):
    codes, entries = torch_ref.quantize_rows(x, mode)
    if mode is PerTokenHeadMode.INT8_PER_TOKEN_HEAD:
        q = (x.float() / entries[..., None]).nan_to_num(0.0).clamp(-200, 200)
        codes = torch.round(q).clamp(-128, 127).to(torch.int8).view(torch.uint8)
    return codes, entries


def _nibbles_swapped(x, mode):
    codes, entries = torch_ref.quantize_rows(x, mode)
    return (codes >> 4) | (codes << 4), entries


def _zero_point_not_stored(x, mode):
    codes, entries = torch_ref.quantize_rows(x, mode)
    return codes, (entries.view(torch.int32) & -16).view(torch.float32)


def _amax_with_nan(x, mode):
    """amax by torch.amax, which propagates NaN (the contract ignores NaN)."""
    codes, entries = torch_ref.quantize_rows(x, mode)
    nan_rows = torch.isnan(x.float()).any(dim=-1)
    return codes, torch.where(nan_rows, float("nan"), entries)


def _reciprocal(x, mode):
    """Codes from x * (1 / s) instead of x / s."""
    codes, s = torch_ref.quantize_rows(x, mode)
    y = x.float() * (1.0 / s[..., None])
    if mode is PerTokenHeadMode.FP8_PER_TOKEN_HEAD:
        codes = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch_ref.rhaz(y.nan_to_num(0.0).clamp(-200, 200)).clamp(-128, 127).to(
            torch.int8).view(torch.uint8)
    return codes, s


def _no_floor(x, mode):
    codes, s = torch_ref.quantize_rows(x, mode)
    amax = torch.where(torch.isnan(x.float()), 0.0, x.float().abs()).amax(-1)
    return codes, amax / torch.full_like(amax, 127.0)


def _layout_ignored(key, value, kc, vc, ks, vs, slot_mapping, mode):
    """Writes an HND cache as if it were NHD (contiguous strides)."""
    nb, bs, h, e = kc.shape
    torch_ref.run(key, value, kc.as_strided((nb, bs, h, e), (kc.stride(0), h * e, e, 1)), vc, ks,
                  vs, slot_mapping, mode)


def _scales_swapped(key, value, kc, vc, ks, vs, slot_mapping, mode):
    torch_ref.run(key, value, kc, vc, vs, ks, slot_mapping, mode)


_SPECIAL = dict(special_values=True, num_tokens=8, num_heads=4, head_size=16,
                dtype=torch.float32)



WRONG = tuple(WrongWriter(i, _wrong(w, c), c) for i, w, c in [
    ("skip-last-token", _skip_last_token, PthCase(num_tokens=7)),
    ("clobber-inline-scale", _clobber_row_tail, PthCase(vllm_rows=True, kv_quant_mode=INT4)),
    ("int8-half-to-even", _rows_writer(_half_to_even), PthCase(**_SPECIAL)),
    ("int4-nibbles-swapped", _rows_writer(_nibbles_swapped), PthCase(kv_quant_mode=INT4)),
    ("int4-zero-point-missing", _rows_writer(_zero_point_not_stored), PthCase(kv_quant_mode=INT4)),
    ("amax-propagates-nan", _rows_writer(_amax_with_nan), PthCase(**_SPECIAL, kv_quant_mode=FP8)),
    ("reciprocal-quotient", _rows_writer(_reciprocal), PthCase(**_SPECIAL)),
    ("no-floor", _rows_writer(_no_floor), PthCase(**_SPECIAL)),
    ("hnd-as-nhd", _layout_ignored, PthCase(layout="HND", alloc="separate")),
    ("k-v-scales-swapped", _scales_swapped, PthCase(kv_quant_mode=FP8)),
])


# --- bad input -------------------------------------------------------------------------------------

def _bad(mode=INT8, **changes):
    def make():
        inp = make_pth_inputs(PthCase(kv_quant_mode=mode, num_tokens=5, num_heads=2,
                                      head_size=16, alloc="packed", vllm_rows=True))
        args = dict(key=inp.key, value=inp.value, key_cache=inp.key_cache,
                    value_cache=inp.value_cache, k_scale_cache=inp.k_scale_cache,
                    v_scale_cache=inp.v_scale_cache, slot_mapping=inp.slot_mapping,
                    kv_quant_mode=mode)
        for k, f in changes.items():
            args[k] = f(inp)
        return (), args
    return make


def _overlapping_scale(i):
    """A float32 view of the key codes' first 4 bytes of every row."""
    kc = i.key_cache
    return storage_bytes(kc).view(torch.float32).as_strided(
        i.k_scale_cache.shape, tuple(s // 4 for s in kc.stride()[:3]), 0)


BAD = tuple(BadInput(*b) for b in [
    ("mode", _bad(kv_quant_mode=lambda i: "int8"), ValueError, "kv_quant_mode: expected one of"),
    ("mode none int4", _bad(INT4, kv_quant_mode=lambda i: None), ValueError, "kv_quant_mode: None infers the mode from key_cache.dtype"),
    ("mode enum", _bad(kv_quant_mode=lambda i: kvwrite.MlaMode.AUTO), ValueError, "kv_quant_mode: expected one of"),
    ("key type", _bad(key=lambda i: i.key.tolist()), TypeError, "key: expected a torch.Tensor"),
    ("scale type", _bad(k_scale_cache=lambda i: 1.0), TypeError, "k_scale_cache: expected a torch.Tensor"),
    ("key dims", _bad(key=lambda i: i.key[0]), ValueError, "key: expected 3 dims"),
    ("key dtype", _bad(key=lambda i: i.key.double(), value=lambda i: i.value.double()), ValueError, "key: expected dtype float16, bfloat16 or float32"),
    ("value dtype", _bad(value=lambda i: i.value.half()), ValueError, "value: expected the dtype of key"),
    ("value heads", _bad(value=lambda i: i.value[:, :1]), ValueError, "value: expected 2 heads (those of key)"),
    ("key stride", _bad(key=lambda i: i.key.repeat(1, 1, 2)[..., ::2]), ValueError, "key: expected a unit-stride last dim"),
    ("int4 odd", _bad(INT4, key=lambda i: i.key[..., :15]), ValueError, "key: kv_quant_mode='int4_per_token_head' packs two elements per byte"),
    ("cache dims", _bad(key_cache=lambda i: i.key_cache[0]), ValueError, "key_cache: expected 4 dims"),
    ("cache E", _bad(key_cache=lambda i: i.key_cache[..., :15]), ValueError, "key_cache: expected a last dim E >= Dq = 16"),
    ("value cache E", _bad(INT4, value_cache=lambda i: i.value_cache[..., :7]), ValueError, "value_cache: expected a last dim E >= Dq = 8"),
    ("cache stride", _bad(key_cache=lambda i: i.key_cache.repeat(1, 1, 1, 2)[..., ::2]), ValueError, "key_cache: expected a unit-stride last dim"),
    ("cache dtype", _bad(key_cache=lambda i: i.key_cache.view(torch.uint8)), ValueError, "key_cache: kv_quant_mode='int8_per_token_head' expects a cache of dtype torch.int8, got torch.uint8"),
    ("fp8 e5m2", _bad(FP8, key_cache=lambda i: i.key_cache.view(torch.float8_e5m2)), ValueError, "key_cache: kv_quant_mode='fp8_per_token_head' expects a cache of dtype torch.uint8 or torch.float8_e4m3fn"),
    ("value cache dtype", _bad(INT4, value_cache=lambda i: i.value_cache.view(torch.int8)), ValueError, "value_cache: expected the dtype of key_cache (torch.uint8)"),
    ("cache heads", _bad(key_cache=lambda i: i.key_cache[:, :, :1], value_cache=lambda i: i.value_cache[:, :, :1]), ValueError, "key_cache: expected 2 heads (those of key)"),
    ("value cache blocks", _bad(value_cache=lambda i: i.value_cache[:2]), ValueError, "value_cache: expected [num_blocks, block_size, num_heads] = [4, 16, 2] (those of key_cache)"),
    ("scale dtype", _bad(k_scale_cache=lambda i: i.k_scale_cache.double()), ValueError, "k_scale_cache: expected dtype float32"),
    ("scale shape", _bad(v_scale_cache=lambda i: i.v_scale_cache[:, :8]), ValueError, "v_scale_cache: expected shape [num_blocks, block_size, num_heads] = [4, 16, 2]"),
    ("slot dtype", _bad(slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad(slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot stride", _bad(slot_mapping=lambda i: i.slot_mapping.repeat(2)[::2]), ValueError, "slot_mapping: expected a contiguous tensor"),
    ("slots > key rows", _bad(slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most key.shape[0] = 5"),
    ("slots > value rows", _bad(value=lambda i: i.value[:3]), ValueError, "slot_mapping: expected at most value.shape[0] = 3"),
    ("scale over codes", _bad(k_scale_cache=_overlapping_scale), ValueError, "k_scale_cache: expected memory apart from key_cache's"),
    ("same cache", _bad(value_cache=lambda i: i.key_cache), ValueError, "value_cache: expected memory apart from key_cache's"),
    ("scales alias", _bad(v_scale_cache=lambda i: i.k_scale_cache), ValueError, "v_scale_cache: expected memory apart from k_scale_cache's"),
    ("key in cache", _bad(key=lambda i: storage_bytes(i.key_cache)[:5 * 2 * 16 * 2].view(torch.bfloat16).view(5, 2, 16)), ValueError, "key: expected memory apart from key_cache's"),
    ("grad", _bad(k_scale_cache=lambda i: i.k_scale_cache.clone().requires_grad_()), ValueError, "k_scale_cache: expected a tensor that does not require grad"),
    ("meta", _bad(value_cache=lambda i: torch.empty(i.value_cache.shape, dtype=torch.int8, device="meta")), ValueError, "device"),
    ("implementation", _bad(implementation=lambda i: "nope"), ValueError, "implementation: expected one of"),
    ("cuda on cpu", _bad(implementation=lambda i: "cuda"), ValueError, "implementation='cuda' cannot run this call"),
])


# --- CUDA graphs, torch.compile, NVRTC ---------------------------------------------------------------

def _graph_case(mode):
    return PthCase(kv_quant_mode=mode, num_tokens=40, num_heads=8, head_size=128,
                   fused_qkv=True, padding_slots=3, out_of_range_slots=2, alloc="packed",
                   vllm_rows=True, num_blocks=8, special_values=True)


def _compile_case(mode):
    return PthCase(kv_quant_mode=mode, num_tokens=9, padding_slots=2, fused_qkv=True,
                   alloc="separate", head_size=32)


PROVIDER = Provider(
    op=OP,
    call=kvwrite.reshape_and_cache_flash_per_token_head_quant,
    build=lambda case, device, seed: make_pth_inputs(case, device, seed).args(),
    mutates=(2, 3, 4, 5),
    mutated_names=("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"),
    check=_check,
    skip=_skip,
    graph_check=_roundtrip,
    graph_cases=tuple(Example(m, _graph_case(m)) for m in (INT8, FP8, INT4)),
    # INT4 on the CPU too (the other modes: GPU).
    compile_cases=(Example(INT8, _compile_case(INT8), gpu=True),
                   Example(FP8, _compile_case(FP8), gpu=True),
                   Example(INT4, _compile_case(INT4))),
    small_tile_cases=small_tiles(
        PthCase(num_tokens=3, num_heads=1, padding_slots=1), dict(head_size=8),
        dict(num_tokens=2, num_heads=2, head_size=10, kv_quant_mode=INT4, padding_slots=0),
        dict(head_size=16, kv_quant_mode=FP8)),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    compile_variants=compile_every_variant(
        "kvwrite.ops.reshape_and_cache_flash_per_token_head_quant", 132),
)
