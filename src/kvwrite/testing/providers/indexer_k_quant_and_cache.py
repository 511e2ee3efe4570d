"""indexer_k_quant_and_cache for the conformance suite (its case matrix against the independent
oracle: tests/test_indexer.py)."""

from __future__ import annotations

import torch

import kvwrite
from kvwrite.ops.indexer_k_quant_and_cache import OP, ScaleFormat, parse_scale_fmt
from kvwrite.ops.indexer_k_quant_and_cache import reference as torch_ref

from ..conformance import (
    BadInput,
    Example,
    Provider,
    WrongWriter,
    compile_every_variant,
    small_tiles,
)
from ..indexer import IndexerCase, assert_indexer_caches_equal, clone_cache, make_indexer_inputs


def _check(case: IndexerCase, got, want) -> None:
    assert_indexer_caches_equal(got[0], want[0], case.head_dim)


def _skip(info, case: IndexerCase, args: tuple) -> str | None:
    return info.unsupported(args[0], args[1], parse_scale_fmt(case.scale_fmt))


# --- deliberately wrong writers (the reference's arguments: a ScaleFormat) -----------------------

def _wrong(write, case: IndexerCase):
    def run(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
        write(k, kv_cache, slot_mapping, case.quant_block_size, parse_scale_fmt(case.scale_fmt))
    return run


def _skip_last_token(k, kv_cache, slots, q, fmt):
    torch_ref.run(k, kv_cache, slots[:-1], q, fmt)


def _reference_with(name: str, replacement):
    """The reference with its ``<name>`` replaced by ``replacement(the real one)`` for the call."""
    def write(k, kv_cache, slots, q, fmt):
        real = getattr(torch_ref, name)
        try:
            setattr(torch_ref, name, replacement(real))
            torch_ref.run(k, kv_cache, slots, q, fmt)
        finally:
            setattr(torch_ref, name, real)
    return write


# amax by torch.amax, which propagates NaN (the rule ignores it).
_amax_with_nan = _reference_with("group_scales", lambda real: lambda x, f: real(torch.where(
    torch.isnan(x).any(dim=2, keepdim=True), float("nan"), x), f))
# s = amax / 448 without the 1e-4 floor (zero groups: NaN codes, zero scales).
_no_floor = _reference_with("SCALE_FLOOR_BITS", lambda real: 0)
# ue8m0 as exp2f(ceilf(log2f(s))) in float32.
_log2_ue8m0 = _reference_with("ue8m0",
                              lambda real: lambda s: torch.exp2(torch.ceil(torch.log2(s))))


def _scales_beside_codes(k, kv_cache, slots, q, fmt):
    """Each slot as [D codes, 4G scale bytes] (a per-token entry), not the page layout."""
    nb, bs, _ = kv_cache.shape
    d = k.shape[1]
    for t in range(slots.numel()):
        s = int(slots[t])
        if 0 <= s < nb * bs:
            codes, scales = torch_ref.quantize_rows(k[t:t + 1], q, fmt)
            kv_cache[s // bs, s % bs, :d] = codes[0]
            kv_cache[s // bs, s % bs, d:] = scales[0].contiguous().view(torch.uint8)


# vLLM's kernel: the amax always spans the first 128 elements (every group gets one scale).
_one_group_amax = _reference_with("group_scales", lambda real: lambda x, f: real(
    x.reshape(x.shape[0], 1, -1), f).expand(x.shape[0], x.shape[1]))


def _mxfp8_float_bits(k, kv_cache, slots, q, fmt):
    """"mxfp8" storing the power-of-two scale's float32 bits ("ue8m0"'s bytes)."""
    torch_ref.run(k, kv_cache, slots, q, ScaleFormat.UE8M0)


def _mxfp8_one_byte(k, kv_cache, slots, q, fmt):
    """"mxfp8" writing the exponent into the first byte of each group's slot only."""
    before = clone_cache(kv_cache)
    torch_ref.run(k, kv_cache, slots, q, fmt)
    _, got = torch_ref.page_views(kv_cache, k.shape[1])
    _, old = torch_ref.page_views(before, k.shape[1])
    n = got.shape[0]
    got.view(n, -1, 4)[..., 1:] = old.view(n, -1, 4)[..., 1:]


WRONG = tuple(WrongWriter(i, _wrong(w, c), c) for i, w, c in [
    ("skip-last-token", _skip_last_token, IndexerCase()),
    ("mxfp8-float-bits", _mxfp8_float_bits, IndexerCase(scale_fmt="mxfp8")),
    ("mxfp8-one-byte", _mxfp8_one_byte, IndexerCase(scale_fmt="mxfp8", head_dim=256)),
    ("amax-propagates-nan", _amax_with_nan,
     IndexerCase(special_values=True, num_tokens=12, num_blocks=8)),
    ("no-floor", _no_floor, IndexerCase(special_values=True, num_tokens=12, num_blocks=8)),
    ("log2-ue8m0", _log2_ue8m0,
     IndexerCase(special_values=True, num_tokens=96, num_blocks=8, dtype=torch.float32)),
    ("per-token-entries", _scales_beside_codes, IndexerCase(head_dim=64, quant_block_size=32)),
    ("one-group-amax", _one_group_amax, IndexerCase(quant_block_size=64)),
])


# --- bad input -------------------------------------------------------------------------------------

def _base():
    return make_indexer_inputs(IndexerCase(num_tokens=5, num_blocks=4, block_size=4))


def _bad(**changes):
    def make():
        inp = _base()
        args = dict(k=inp.k, kv_cache=inp.kv_cache, slot_mapping=inp.slot_mapping,
                    quant_block_size=128, scale_fmt="ue8m0")
        for key, f in changes.items():
            args[key] = f(inp)
        return (), args
    return make


def _mxfp8_group(head_dim: int, q: int):
    """"mxfp8" with a group size other than 128 and a cache of the right entry size for it."""
    def make():
        inp = make_indexer_inputs(IndexerCase(num_tokens=5, num_blocks=4, block_size=4,
                                              head_dim=head_dim, quant_block_size=q))
        return (), dict(k=inp.k, kv_cache=inp.kv_cache, slot_mapping=inp.slot_mapping,
                         quant_block_size=q, scale_fmt="mxfp8")
    return make


BAD = tuple(BadInput(*b) for b in [
    ("mxfp8 q64", _mxfp8_group(128, 64), ValueError, "quant_block_size: expected 128 with scale_fmt 'mxfp8' (4 UE8M0 bytes a group, one per 32 elements), got 64"),
    ("mxfp8 q32", _mxfp8_group(128, 32), ValueError, "quant_block_size: expected 128 with scale_fmt 'mxfp8'"),
    ("mxfp8 q256", _mxfp8_group(256, 256), ValueError, "quant_block_size: expected 128 with scale_fmt 'mxfp8'"),
    ("k type", _bad(k=lambda i: i.k.tolist()), TypeError, "k: expected a torch.Tensor"),
    ("k dims", _bad(k=lambda i: i.k[None]), ValueError, "k: expected 2 dims"),
    ("k dtype", _bad(k=lambda i: i.k.double()), ValueError, "k: expected dtype"),
    ("k stride", _bad(k=lambda i: i.k.repeat(1, 2)[:, ::2]), ValueError, "k: expected a unit-stride last dim"),
    ("q not dividing", _bad(quant_block_size=lambda i: 48), ValueError, "quant_block_size: expected a positive divisor of the head dim k.shape[1] = 128, got 48"),
    ("q zero", _bad(quant_block_size=lambda i: 0), ValueError, "quant_block_size: expected a positive divisor"),
    ("q float", _bad(quant_block_size=lambda i: 128.0), TypeError, "quant_block_size: expected a positive int"),
    ("q bool", _bad(quant_block_size=lambda i: True), TypeError, "quant_block_size: expected a positive int dividing the head dim, got bool"),
    ("scale_fmt None", _bad(scale_fmt=lambda i: None), ValueError, "scale_fmt: expected a string ('ue8m0' for power-of-two scales"),
    ("scale_fmt int", _bad(scale_fmt=lambda i: 8), TypeError, "scale_fmt: expected a string, got int"),
    ("cache dims", _bad(kv_cache=lambda i: i.kv_cache[0]), ValueError, "kv_cache: expected 3 dims"),
    ("cache dtype", _bad(kv_cache=lambda i: i.kv_cache.view(torch.float8_e4m3fn)), ValueError, "kv_cache: expected dtype torch.uint8"),
    ("cache entry", _bad(quant_block_size=lambda i: 64), ValueError, "kv_cache: expected a last dim of head_dim + 4 * head_dim / quant_block_size = 128 + 4 * 2 = 136"),
    ("cache entry short", _bad(kv_cache=lambda i: i.kv_cache[..., :-1]), ValueError, "kv_cache: expected a last dim of"),
    ("page not dense", _bad(kv_cache=lambda i: torch.zeros(2, 4, 264, dtype=torch.uint8)[..., :132]), ValueError, "kv_cache: expected dense pages (stride(2) == 1, stride(1) == 132)"),
    ("slot dtype", _bad(slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad(slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot count", _bad(slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most k.shape[0] = 5 entries, got 10"),
    ("slot stride", _bad(slot_mapping=lambda i: i.slot_mapping.repeat(2)[::2]), ValueError, "slot_mapping: expected a contiguous tensor"),
    ("slot device", _bad(slot_mapping=lambda i: i.slot_mapping.to("meta")), ValueError, "slot_mapping: expected device cpu (that of k), got meta"),
    ("k in the cache", _bad(k=lambda i: i.kv_cache.view(-1)[:1280].view(torch.bfloat16).view(5, 128)), ValueError, "k: expected memory apart from kv_cache's"),
    ("k requires grad", _bad(k=lambda i: i.k.float().requires_grad_()), ValueError, "k: expected a tensor that does not require grad"),
])


# --- CUDA graphs, torch.compile, NVRTC ---------------------------------------------------------------

PROVIDER = Provider(
    op=OP,
    call=kvwrite.indexer_k_quant_and_cache,
    build=lambda case, device, seed: make_indexer_inputs(case, device, seed).args(),
    mutates=(1,),
    mutated_names=("kv_cache",),
    check=_check,
    skip=_skip,
    graph_cases=tuple(Example(fmt, IndexerCase(num_tokens=300, scale_fmt=fmt, padding_slots=3,
                                               out_of_range_slots=2, k_pad=8, page_pad=16,
                                               num_blocks=32, special_values=True))
                      for fmt in ("ue8m0", "mxfp8", "float32")),
    compile_cases=(Example("ue8m0", IndexerCase(num_tokens=9, padding_slots=2, k_pad=8)),),
    # mxfp8 takes groups of 128 only.
    small_tile_cases=small_tiles(
        IndexerCase(num_tokens=3, padding_slots=1), dict(head_dim=16, quant_block_size=16),
        dict(num_tokens=2, head_dim=6, quant_block_size=3, scale_fmt="float32", padding_slots=0),
        dict(head_dim=8, quant_block_size=8, dtype=torch.float16)),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    compile_variants=compile_every_variant("kvwrite.ops.indexer_k_quant_and_cache", 56),
)
