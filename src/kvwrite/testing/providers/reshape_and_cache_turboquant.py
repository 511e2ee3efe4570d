"""reshape_and_cache_turboquant for the conformance suite (its arithmetic against the independent
oracle, the tables, the reader and turboquant_store: tests/test_turboquant.py)."""

from __future__ import annotations

import contextlib

import torch

import kvwrite
from kvwrite.ops.reshape_and_cache_turboquant import OP
from kvwrite.ops.reshape_and_cache_turboquant import reference as torch_ref

from ..compare import storage_bytes
from ..conformance import (
    BadInput,
    Example,
    Provider,
    WrongWriter,
    compile_every_variant,
    small_tiles,
)
from ..turboquant import (
    K3V4,
    K8V4,
    NC3,
    NC4,
    PRESETS,
    TqCase,
    assert_tq_caches_equal,
    make_tq_inputs,
)


def _check(case: TqCase, got, want) -> None:
    assert_tq_caches_equal(got[0], want[0], case.slot)


def _skip(info, case: TqCase, args: tuple) -> str | None:
    return info.unsupported(args[0], args[2], case.slot)


def _reference(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints) -> None:
    kvwrite.reshape_and_cache_turboquant(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT,
                                         midpoints, implementation="torch")


# --- deliberately wrong writers (the public arguments) -----------------------------------------

@contextlib.contextmanager
def _replaced(name: str, fn):
    """The reference with one of its parts replaced (for one call)."""
    old = getattr(torch_ref, name)
    setattr(torch_ref, name, fn)
    try:
        yield
    finally:
        setattr(torch_ref, name, old)


def _with(name: str, fn):
    def write(*args):
        with _replaced(name, fn):
            _reference(*args)
    return write


def _skip_last_token(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
    _reference(key, value, kv_cache, slot_mapping[:-1], kv_cache_dtype, PiT, midpoints)


def _pad_byte_written(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
    """Whole aligned rows written: the pad byte after an odd slot zeroed."""
    _reference(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints)
    size = kvwrite.turboquant_layout(key.shape[2], kv_cache_dtype).slot_size
    nb, bs = kv_cache.shape[:2]
    for s in slot_mapping.tolist():
        if 0 <= s < nb * bs:
            kv_cache[s // bs, s % bs, :, size] = 0


def _ties_to_lower(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
    """idx_j = #{k : y_j > m_k}: a y_j on a midpoint takes the lower centroid."""
    up = torch.nextafter(midpoints, torch.full_like(midpoints, float("inf")))
    _reference(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, up)


def _sequential_sum(x):
    return x.sum(-1)


def _reciprocal_division(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
    """The values' quotient as RN(v - mn) * RN(1 / s) (vLLM's approximate division may)."""
    real = torch_ref.value_codes

    def value_codes(v, slot):
        out = real(v, slot)
        v = v.float()
        nan = torch.isnan(v)
        none = nan.all(-1)
        mn = torch.where(nan, float("inf"), v).amin(-1)
        mx = torch.where(nan, -float("inf"), v).amax(-1)
        mn = torch.where(none | (mn == 0), 0.0, mn)
        mx = torch.where(none, 0.0, mx)
        s = (mx - mn) / torch.full_like(mx, slot.value_levels)
        s = torch.where(s > 1e-8, s, torch.full_like(s, 1e-8))
        q = (v - mn[:, None]) * (torch.ones_like(s) / s)[:, None]
        q = torch_ref.rhu(torch.where(torch.isnan(q), 0.0, q)).clamp(0, slot.value_levels)
        codes = torch_ref.pack_codes(q.to(torch.uint8), slot.value_bits)
        return torch.cat([codes, out[:, -4:]], dim=-1)
    _with("value_codes", value_codes)(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT,
                                      midpoints)


def _half_to_even(v):
    return torch.round(v)


def _bytes_writer(change):
    """The reference's slots, changed by ``change(slots, slot)``, at the reference's addresses."""
    def write(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
        slot = kvwrite.formats.turboquant_preset(kv_cache_dtype).at(key.shape[2])
        nb, bs = kv_cache.shape[:2]
        tokens, blocks, offsets = kvwrite.layouts.written_slots(slot_mapping, nb, bs)
        rows = torch_ref.encode_slots(key[tokens], value[tokens], slot,
                                      PiT if slot.mse else None, midpoints if slot.mse else None)
        kv_cache[..., :slot.slot_size][blocks, offsets] = change(rows, slot)
    return write


def _scale_zero_swapped(rows, slot):
    out = rows.clone()
    out[..., slot.scale_offset:slot.scale_offset + 2] = rows[..., slot.zero_offset:]
    out[..., slot.zero_offset:] = rows[..., slot.scale_offset:slot.scale_offset + 2]
    return out


def _value_nibbles_swapped(rows, slot):
    out = rows.clone()
    v = rows[..., slot.value_offset:slot.scale_offset]
    out[..., slot.value_offset:slot.scale_offset] = (v >> 4) | (v << 4)
    return out


def _norm_as_bfloat16(rows, slot):
    """The norm's top 16 bits (bfloat16 by truncation) in place of its fp16."""
    out = rows.clone()
    at = slot.norm_offset
    norm = rows[..., at:at + 2].contiguous().view(torch.float16).float()
    out[..., at:at + 2] = (norm.view(torch.int32) >> 16).to(torch.int16).view(torch.uint8)
    return out


def _layout_ignored(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints):
    """Writes an HND cache as if it were NHD (dense strides)."""
    nb, bs, h, s = kv_cache.shape
    _reference(key, value, kv_cache.as_strided((nb, bs, h, s), (kv_cache.stride(0), h * s, s, 1)),
               slot_mapping, kv_cache_dtype, PiT, midpoints)


_SPECIAL = dict(special_values=True, num_tokens=16, num_heads=2, head_size=16,
                dtype=torch.float32)

WRONG = tuple(WrongWriter(*w) for w in [
    ("skip-last-token", _skip_last_token, TqCase(num_tokens=7)),
    ("pad-byte-written", _pad_byte_written, TqCase(kv_cache_dtype=K3V4, head_size=8)),
    ("midpoint-ties-to-lower", _ties_to_lower, TqCase(**_SPECIAL)),
    ("sequential-sum", _with("tree_sum", _sequential_sum), TqCase(**_SPECIAL)),
    ("value-reciprocal-quotient", _reciprocal_division,
     TqCase(**_SPECIAL)),
    ("value-half-to-even", _with("rhu", _half_to_even), TqCase(**_SPECIAL)),
    ("scale-zero-swapped", _bytes_writer(_scale_zero_swapped), TqCase(kv_cache_dtype=K8V4)),
    ("value-nibbles-swapped", _bytes_writer(_value_nibbles_swapped), TqCase()),
    ("norm-as-bfloat16", _bytes_writer(_norm_as_bfloat16), TqCase(kv_cache_dtype=NC3)),
    ("hnd-as-nhd", _layout_ignored, TqCase(layout="HND")),
])


# --- bad input ----------------------------------------------------------------------------------

def _bad(preset=NC4, **changes):
    def make():
        inp = make_tq_inputs(TqCase(kv_cache_dtype=preset, num_tokens=5, num_heads=2,
                                    head_size=16))
        args = dict(key=inp.key, value=inp.value, kv_cache=inp.kv_cache,
                    slot_mapping=inp.slot_mapping, kv_cache_dtype=preset, PiT=inp.PiT,
                    midpoints=inp.midpoints)
        for k, f in changes.items():
            args[k] = f(inp)
        return (), args
    return make


def _key_in_cache(i):
    return storage_bytes(i.kv_cache)[:5 * 2 * 16 * 2].view(torch.bfloat16).view(5, 2, 16)


def _folded_cache(i):
    c = i.kv_cache
    return c.as_strided(c.shape, (c.stride(0), 0, c.stride(2), 1))


BAD = tuple(BadInput(*b) for b in [
    ("preset", _bad(kv_cache_dtype=lambda i: "turboquant_2bit"), ValueError, "kv_cache_dtype: expected one of ['turboquant_3bit_nc', 'turboquant_4bit_nc', 'turboquant_k3v4_nc', 'turboquant_k8v4'], got 'turboquant_2bit'"),
    ("flash preset", _bad(kv_cache_dtype=lambda i: "fp8"), ValueError, "kv_cache_dtype: expected one of"),
    ("key type", _bad(key=lambda i: i.key.tolist()), TypeError, "key: expected a torch.Tensor"),
    ("cache type", _bad(kv_cache=lambda i: None), TypeError, "kv_cache: expected a torch.Tensor"),
    ("key dims", _bad(key=lambda i: i.key[0]), ValueError, "key: expected 3 dims"),
    ("key dtype", _bad(key=lambda i: i.key.double(), value=lambda i: i.value.double()), ValueError, "key: expected dtype float16, bfloat16 or float32, got torch.float64"),
    ("value dtype", _bad(value=lambda i: i.value.half()), ValueError, "value: expected the dtype of key (torch.bfloat16), got torch.float16"),
    ("value heads", _bad(value=lambda i: i.value[:, :1]), ValueError, "value: expected the shape of key (5, 2, 16), got (5, 1, 16)"),
    ("value head size", _bad(value=lambda i: i.value[..., :8]), ValueError, "value: expected the shape of key"),
    ("key stride", _bad(key=lambda i: i.key.repeat(1, 1, 2)[..., ::2]), ValueError, "key: expected a unit-stride last dim"),
    ("4-bit odd D", _bad(key=lambda i: i.key[..., :15], value=lambda i: i.value[..., :15]), ValueError, "key: kv_cache_dtype='turboquant_4bit_nc': 4-bit fields need an even head_size, got 15"),
    ("3-bit D % 8", _bad(NC3, key=lambda i: i.key[..., :12], value=lambda i: i.value[..., :12]), ValueError, "key: kv_cache_dtype='turboquant_3bit_nc': 3-bit fields need head_size % 8 == 0, got 12"),
    ("k3v4 D % 8", _bad(K3V4, key=lambda i: i.key[..., :10], value=lambda i: i.value[..., :10]), ValueError, "key: kv_cache_dtype='turboquant_k3v4_nc': 3-bit fields need head_size % 8 == 0, got 10"),
    ("k8v4 odd D", _bad(K8V4, key=lambda i: i.key[..., :15], value=lambda i: i.value[..., :15]), ValueError, "4-bit fields need an even head_size, got 15"),
    ("cache dims", _bad(kv_cache=lambda i: i.kv_cache[0]), ValueError, "kv_cache: expected 4 dims"),
    ("cache dtype", _bad(kv_cache=lambda i: i.kv_cache.view(torch.int8)), ValueError, "kv_cache: expected dtype torch.uint8, got torch.int8"),
    ("cache heads", _bad(kv_cache=lambda i: i.kv_cache[:, :, :1]), ValueError, "kv_cache: expected 2 heads (those of key) in dim 2"),
    ("cache S", _bad(kv_cache=lambda i: i.kv_cache[..., :21]), ValueError, "kv_cache: expected a last dim S >= slot_size = 22 (kv_cache_dtype='turboquant_4bit_nc', head_size 16)"),
    ("k8v4 cache S", _bad(K8V4, kv_cache=lambda i: i.kv_cache[..., :27]), ValueError, "kv_cache: expected a last dim S >= slot_size = 28"),
    ("cache stride", _bad(kv_cache=lambda i: i.kv_cache.repeat(1, 1, 1, 2)[..., ::2]), ValueError, "kv_cache: expected a unit-stride last dim"),
    ("PiT missing", _bad(PiT=lambda i: None), ValueError, "PiT: kv_cache_dtype='turboquant_4bit_nc' rotates and quantizes keys to a codebook and needs a float32 [D, D] = [16, 16] tensor, got None"),
    ("midpoints missing", _bad(NC3, midpoints=lambda i: None), ValueError, "midpoints: kv_cache_dtype='turboquant_3bit_nc' rotates and quantizes keys to a codebook and needs a float32 [2^b - 1] = [7] (b = 3) tensor, got None"),
    ("PiT type", _bad(PiT=lambda i: i.PiT.tolist()), TypeError, "PiT: expected a torch.Tensor"),
    ("PiT dtype", _bad(PiT=lambda i: i.PiT.double()), ValueError, "PiT: expected dtype float32, got torch.float64"),
    ("PiT shape", _bad(PiT=lambda i: i.PiT[:8]), ValueError, "PiT: expected shape [D, D] = [16, 16] for kv_cache_dtype='turboquant_4bit_nc' and head_size 16, got (8, 16)"),
    ("midpoints dtype", _bad(midpoints=lambda i: i.midpoints.half()), ValueError, "midpoints: expected dtype float32, got torch.float16"),
    ("midpoints shape", _bad(midpoints=lambda i: i.centroids), ValueError, "midpoints: expected shape [2^b - 1] = [15] (b = 4) for kv_cache_dtype='turboquant_4bit_nc' and head_size 16, got (16,)"),
    ("k3v4 midpoints", _bad(K3V4, midpoints=lambda i: torch.zeros(15)), ValueError, "midpoints: expected shape [2^b - 1] = [7] (b = 3)"),
    ("slot dtype", _bad(slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad(slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slots > key rows", _bad(slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most key.shape[0] = 5 entries, got 10"),
    ("key device", _bad(key=lambda i: torch.empty(i.key.shape, dtype=i.key.dtype, device="meta"), value=lambda i: torch.empty(i.key.shape, dtype=i.key.dtype, device="meta")), ValueError, "key: expected device cpu (that of kv_cache), got meta"),
    ("PiT device", _bad(PiT=lambda i: torch.empty(16, 16, device="meta")), ValueError, "PiT: expected device cpu (that of kv_cache), got meta"),
    ("meta cache", _bad(kv_cache=lambda i: torch.empty(i.kv_cache.shape, dtype=torch.uint8, device="meta")), ValueError, "device"),
    ("key in cache", _bad(key=_key_in_cache), ValueError, "key: expected memory apart from kv_cache's"),
    ("PiT in cache", _bad(PiT=lambda i: storage_bytes(i.kv_cache)[:1024].view(torch.float32).view(16, 16)), ValueError, "PiT: expected memory apart from kv_cache's"),
    ("cache folds", _bad(kv_cache=_folded_cache), ValueError, "kv_cache: expected every element in its own memory"),
    ("PiT grad", _bad(PiT=lambda i: i.PiT.clone().requires_grad_()), ValueError, "PiT: expected a tensor that does not require grad"),
    ("implementation", _bad(implementation=lambda i: "nope"), ValueError, "implementation: expected one of"),
    ("cuda on cpu", _bad(implementation=lambda i: "cuda"), ValueError, "implementation='cuda' cannot run this call"),
])


# --- cases, CUDA graphs, torch.compile --------------------------------------------------------------

CASES = tuple(Example(c.id, c) for c in [
    *(TqCase(kv_cache_dtype=p, head_size=d, dtype=dt, special_values=True, num_tokens=24,
             padding_slots=2, out_of_range_slots=1, layout=lay, slot_dtype=sd)
      for p in PRESETS
      for d, dt, lay, sd in ((16, torch.float32, "HND", torch.int32),
                             (128, torch.bfloat16, "NHD", torch.int64),
                             (96, torch.float16, "HND", torch.int64))),
    TqCase(kv_cache_dtype=K3V4, head_size=8, row_pad=3, head_pad=3, extra_rows=2,
           pit_strided=True),
])
GPU_CASES = tuple(Example(c.id, c, gpu=True) for c in [
    TqCase(kv_cache_dtype=p, head_size=128, num_heads=8, num_tokens=300, num_blocks=32,
           special_values=True, padding_slots=5, out_of_range_slots=3)
    for p in PRESETS
])


def _graph_case(preset):
    """Tables of another rotation and codebook for each seed: the replay reads the new ones."""
    return TqCase(kv_cache_dtype=preset, head_size=128, num_heads=4, num_tokens=40,
                  num_blocks=8, padding_slots=3, out_of_range_slots=2, special_values=True,
                  own_tables=True)


PROVIDER = Provider(
    op=OP,
    call=kvwrite.reshape_and_cache_turboquant,
    build=lambda case, device, seed: make_tq_inputs(case, device, seed).args(),
    mutates=(2,),
    mutated_names=("kv_cache",),
    check=_check,
    skip=_skip,
    cases=(*CASES, *GPU_CASES),
    graph_cases=tuple(Example(p, _graph_case(p)) for p in PRESETS),
    # One MSE preset on the CPU too (the others: GPU).
    compile_cases=(Example(NC4, TqCase(kv_cache_dtype=NC4, head_size=32, num_tokens=9,
                                       padding_slots=2)),
                   *(Example(p, TqCase(kv_cache_dtype=p, head_size=32, num_tokens=9,
                                       padding_slots=2), gpu=True) for p in (K8V4, K3V4, NC3))),
    # 3-bit fields need D % 8 == 0. Last: the k8v4 rows kernel's smallest call (512 rows,
    # TritonTuning.k8v4_rows_min) at D = 8.
    small_tile_cases=small_tiles(
        TqCase(num_tokens=3, num_heads=1), dict(head_size=8, kv_cache_dtype=K3V4),
        dict(num_tokens=2, num_heads=2, head_size=10, kv_cache_dtype=NC4, padding_slots=0),
        dict(head_size=16, kv_cache_dtype=NC3),
        dict(num_heads=2, head_size=10, kv_cache_dtype=K8V4),
        dict(num_tokens=64, num_heads=8, num_blocks=8, head_size=8, kv_cache_dtype=K8V4,
             special_values=True)),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    # The input kinds (3) x presets (4) x slot types (2) x E, two CTA sizes at E = 8; the check;
    # the split kernel: input kinds x the 3 MSE presets x slot types x E = 2, 4.
    compile_variants=compile_every_variant("kvwrite.ops.reshape_and_cache_turboquant", 157),
)
