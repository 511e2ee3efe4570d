"""concat_and_cache_mla for the conformance suite (its case matrix against the independent
oracle: tests/test_mla.py)."""

from __future__ import annotations

import dataclasses

import torch

import kvwrite
from kvwrite.ops.concat_and_cache_mla import OP
from kvwrite.ops.concat_and_cache_mla import reference as torch_ref

from ..conformance import BadInput, Example, Provider, WrongWriter, small_tiles
from ..mla import MlaCase, assert_mla_caches_equal, make_mla_inputs


def _call(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, ds_mla_scale,
          implementation=None):
    """The public function with ``ds_mla_scale`` (keyword-only there) as a 7th argument."""
    kvwrite.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                                 ds_mla_scale=ds_mla_scale, implementation=implementation)


def _build(case: MlaCase, device, seed):
    inp = make_mla_inputs(case, device, seed)
    return (*inp.args(), inp.ds_mla_scale)


def _check(case: MlaCase, got, want) -> None:
    assert_mla_caches_equal(got[0], want[0], case.mode)


def _skip(info, case: MlaCase, args: tuple) -> str | None:
    return info.unsupported(args[0], args[2], case.mode)


# --- deliberately wrong writers (the reference's arguments: the case's MlaMode) -------------------

def _wrong(write, case: MlaCase):
    def run(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, ds_mla_scale):
        write(kv_c, k_pe, kv_cache, slot_mapping, case.mode, scale)
    return run


def _skip_last_token(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    torch_ref.run(kv_c, k_pe, kv_cache, slot_mapping[:-1], mode, scale)


def _ignore_strides(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """Writes as if the cache were contiguous."""
    nb, bs, e = kv_cache.shape
    torch_ref.run(kv_c, k_pe, kv_cache.as_strided((nb, bs, e), (bs * e, e, 1)), slot_mapping,
                  mode, scale)


def _ds_rows_with(kv_c, k_pe, kv_cache, slot_mapping, tile_scales):
    """fp8_ds_mla entries whose 4 tile scales are ``tile_scales(tiles)`` of the row's float32
    tiles ``[4, 128]`` (the wrong writers below differ only there)."""
    nb, bs, _ = kv_cache.shape
    for t in range(slot_mapping.numel()):
        s = int(slot_mapping[t])
        if not 0 <= s < nb * bs:
            continue
        x = kv_c[t].float().view(4, 128)
        sc = tile_scales(x)
        q = (x / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        kv_cache[s // bs, s % bs] = torch.cat([q.view(-1), sc.view(torch.uint8),
                                               k_pe[t].contiguous().view(torch.uint8)])


def _amax(x):
    """Each tile's largest |x|, NaN ignored (the contract's amax)."""
    return torch.where(x.isnan(), 0.0, x.abs()).amax(dim=1)


def _amax_with_nan(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """amax by torch.amax, which propagates NaN (the contract: NaN is ignored)."""
    _ds_rows_with(kv_c, k_pe, kv_cache, slot_mapping,
                  lambda x: (x.abs().amax(dim=1) / 448.0).clamp_min(2.0**-126))


def _no_scale_floor(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """s_j = amax_j / 448 without the FLT_MIN floor."""
    _ds_rows_with(kv_c, k_pe, kv_cache, slot_mapping, lambda x: _amax(x) / 448.0)


def _multiply_by_reciprocal(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """fp8 with x * (1/s) instead of x / s."""
    torch_ref.run(kv_c, k_pe, kv_cache, slot_mapping, mode, scale)
    nb, bs, _ = kv_cache.shape
    fp8 = mode.fp8_dtype
    for t in range(slot_mapping.numel()):
        s = int(slot_mapping[t])
        if 0 <= s < nb * bs:
            row = torch.cat([kv_c[t], k_pe[t]]).float() * (1.0 / scale)
            q = row.clamp(-57344, 57344).clamp(-448, 448) if fp8 == torch.float8_e4m3fn else \
                row.clamp(-57344, 57344)
            kv_cache[s // bs, s % bs] = q.to(fp8).view(torch.uint8)


def _pe_quantized(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """The rotary part stored as a copy of the wrong row (k_pe of the previous token)."""
    torch_ref.run(kv_c, k_pe.roll(1, 0), kv_cache, slot_mapping, mode, scale)


def _rule_ignored(rule):
    """fp8_ds_mla written by the other tile scale rule than the case's ``rule``."""
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale
    other = DsMlaScale.AMAX if rule == "pow2" else DsMlaScale.POW2

    def run(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
        torch_ref.run(kv_c, k_pe, kv_cache, slot_mapping, mode, scale, ds_scale=other)
    return run


def _pow2_rows_with(kv_c, k_pe, kv_cache, slot_mapping, scale_fn):
    """"pow2" entries whose tile scales come from ``scale_fn(amax)``."""
    _ds_rows_with(kv_c, k_pe, kv_cache, slot_mapping, lambda x: scale_fn(_amax(x)))


def _pow2_without_floor(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """"pow2" rounding amax / 448 up without the float32(1e-4) floor."""
    from kvwrite.dtypes import ue8m0_round_up
    _pow2_rows_with(kv_c, k_pe, kv_cache, slot_mapping,
                    lambda a: ue8m0_round_up((a / 448.0).clamp_min(2.0**-126)))


def _pow2_floor_before_division(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """"pow2" with the floor applied to amax, as the indexer does (max(amax, 1e-4) / 448)."""
    from kvwrite.dtypes import ue8m0_round_up
    _pow2_rows_with(kv_c, k_pe, kv_cache, slot_mapping,
                    lambda a: ue8m0_round_up(a.clamp_min(1e-4) / 448.0))


def _pow2_rounded_down(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """"pow2" rounding to the power of two below (2^floor(log2 s)) instead of above."""
    _pow2_rows_with(kv_c, k_pe, kv_cache, slot_mapping,
                    lambda a: torch.exp2(torch.floor(torch.log2((a / 448.0).clamp_min(1e-4)))))


def _nope_pe_left(kv_c, k_pe, kv_cache, slot_mapping, mode, scale):
    """NoPE: the rotary bytes left as they were instead of zeroed."""
    before = kv_cache.clone()
    torch_ref.run(kv_c, k_pe, kv_cache, slot_mapping, mode, scale)
    kv_cache[..., 528:] = before[..., 528:]


WRONG = tuple(WrongWriter(i, _wrong(w, c), c) for i, w, c in [
    ("skip-last-token", _skip_last_token, MlaCase(num_tokens=7)),
    ("skip-last-token-ds", _skip_last_token, MlaCase(num_tokens=7, kv_cache_dtype="fp8_ds_mla")),
    ("transposed-as-contiguous-ds", _ignore_strides,
     MlaCase(cache_transposed=True, kv_cache_dtype="fp8_ds_mla")),
    ("padded-as-contiguous-fp8", _ignore_strides, MlaCase(cache_pad=16, kv_cache_dtype="fp8")),
    ("amax-propagates-nan", _amax_with_nan,
     MlaCase(kv_cache_dtype="fp8_ds_mla", special_values=True, ds_mla_scale="amax")),
    ("no-flt-min-floor", _no_scale_floor,
     MlaCase(kv_cache_dtype="fp8_ds_mla", special_values=True, ds_mla_scale="amax")),
    ("reciprocal-e4m3", _multiply_by_reciprocal,
     MlaCase(kv_cache_dtype="fp8", special_values=True, dtype=torch.float32, num_tokens=6)),
    ("wrong-pe-row", _pe_quantized, MlaCase(kv_cache_dtype="fp8_ds_mla", num_tokens=5)),
    ("amax-for-pow2", _rule_ignored("pow2"), MlaCase(kv_cache_dtype="fp8_ds_mla", num_tokens=5)),
    ("pow2-for-amax", _rule_ignored("amax"),
     MlaCase(kv_cache_dtype="fp8_ds_mla", num_tokens=5, ds_mla_scale="amax")),
    ("pow2-no-floor", _pow2_without_floor,
     MlaCase(kv_cache_dtype="fp8_ds_mla", special_values=True)),
    ("pow2-floor-before-division", _pow2_floor_before_division,
     MlaCase(kv_cache_dtype="fp8_ds_mla", special_values=True)),
    ("pow2-rounded-down", _pow2_rounded_down, MlaCase(kv_cache_dtype="fp8_ds_mla", num_tokens=5)),
    ("nope-pe-left", _nope_pe_left, MlaCase(kv_cache_dtype="fp8_ds_mla", pe_dim=0, num_tokens=5)),
])


# --- bad input -------------------------------------------------------------------------------------

def _base(kv="auto", dtype=torch.bfloat16):
    return make_mla_inputs(MlaCase(kv_cache_dtype=kv, dtype=dtype, num_tokens=5))


def _bad(kv, **changes):
    def make():
        inp = _base(kv)
        args = dict(kv_c=inp.kv_c, k_pe=inp.k_pe, kv_cache=inp.kv_cache,
                    slot_mapping=inp.slot_mapping, kv_cache_dtype=kv, scale=inp.scale)
        for k, f in changes.items():
            args[k] = f(inp)
        return (), args
    return make


BAD = tuple(BadInput(*b) for b in [
    ("kv_cache_dtype", _bad("auto", kv_cache_dtype=lambda i: "int8"), ValueError, "kv_cache_dtype: expected one of"),
    ("kv_c type", _bad("auto", kv_c=lambda i: i.kv_c.tolist()), TypeError, "kv_c: expected a torch.Tensor"),
    ("kv_c dims", _bad("auto", kv_c=lambda i: i.kv_c[None]), ValueError, "kv_c: expected 2 dims"),
    ("kv_c dtype", _bad("auto", kv_c=lambda i: i.kv_c.double()), ValueError, "kv_c: expected dtype"),
    ("k_pe dtype", _bad("auto", k_pe=lambda i: i.k_pe.half()), ValueError, "k_pe: expected the dtype of kv_c"),
    ("k_pe rows", _bad("auto", k_pe=lambda i: i.k_pe[:-1]), ValueError, "k_pe: expected 5 rows"),
    ("kv_c stride", _bad("auto", kv_c=lambda i: i.kv_c.repeat(1, 2)[:, ::2]), ValueError, "kv_c: expected a unit-stride"),
    ("cache entry", _bad("auto", kv_cache=lambda i: i.kv_cache[..., :-1]), ValueError, "kv_cache: expected a last dim"),
    ("cache dims", _bad("auto", kv_cache=lambda i: i.kv_cache[0]), ValueError, "kv_cache: expected 3 dims"),
    ("cache stride", _bad("auto", kv_cache=lambda i: i.kv_cache.repeat(1, 1, 2)[..., ::2]), ValueError, "kv_cache: expected a unit-stride"),
    ("cache dtype auto", _bad("auto", kv_cache=lambda i: i.kv_cache.half()), ValueError, "kv_cache: kv_cache_dtype='auto'"),
    ("cache dtype fp8", _bad("fp8", kv_cache=lambda i: i.kv_cache.view(torch.float8_e5m2)), ValueError, "kv_cache: kv_cache_dtype='fp8_e4m3'"),
    ("slot dtype", _bad("auto", slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad("auto", slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot count", _bad("auto", slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most"),
    ("scale missing", _bad("fp8", scale=lambda i: None), ValueError, "scale: kv_cache_dtype='fp8_e4m3' needs"),
    ("scale dtype", _bad("fp8", scale=lambda i: i.scale.double()), ValueError, "scale: expected dtype float32"),
    ("scale numel", _bad("fp8", scale=lambda i: i.scale.repeat(2)), ValueError, "scale: expected 1 element"),
    ("scale type", _bad("fp8_e5m2", scale=lambda i: 0.5), TypeError, "scale: expected a torch.Tensor"),
    ("ds rank", _bad("fp8_ds_mla", kv_c=lambda i: i.kv_c[:, :256]), ValueError, "kv_c: kv_cache_dtype='fp8_ds_mla' needs kv_lora_rank 512, got 256"),
    ("ds pe", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:, :32]), ValueError, "k_pe: kv_cache_dtype='fp8_ds_mla' needs pe_dim 64"),
    ("ds float32", _bad("fp8_ds_mla", kv_c=lambda i: i.kv_c.float(), k_pe=lambda i: i.k_pe.float()), ValueError, "kv_c: kv_cache_dtype='fp8_ds_mla' needs float16 or bfloat16 input, got torch.float32"),
    ("ds entry", _bad("fp8_ds_mla", kv_cache=lambda i: i.kv_cache[..., :576]), ValueError, "kv_cache: expected a last dim of 656 bytes"),
    ("ds dtype", _bad("fp8_ds_mla", kv_cache=lambda i: i.kv_cache.view(torch.float8_e4m3fn)), ValueError, "kv_cache: kv_cache_dtype='fp8_ds_mla' with torch.bfloat16 input expects a cache of dtype torch.uint8"),
    ("ds_mla_scale", _bad("fp8_ds_mla", ds_mla_scale=lambda i: "ue8m0"), ValueError, "ds_mla_scale: expected one of ['pow2', 'amax'], got 'ue8m0'"),
    ("ds_mla_scale None", _bad("fp8_ds_mla", ds_mla_scale=lambda i: None), ValueError, "ds_mla_scale: expected one of ['pow2', 'amax'], got None"),
    ("ds_mla_scale case", _bad("fp8_ds_mla", ds_mla_scale=lambda i: "POW2"), ValueError, "ds_mla_scale: expected one of ['pow2', 'amax'], got 'POW2'"),
    ("ds_mla_scale auto", _bad("auto", ds_mla_scale=lambda i: "amax"), ValueError, "ds_mla_scale: only kv_cache_dtype='fp8_ds_mla' has tile scales; with kv_cache_dtype='auto' leave it at its default 'pow2', got 'amax'"),
    ("ds_mla_scale fp8", _bad("fp8", ds_mla_scale=lambda i: "amax"), ValueError, "ds_mla_scale: only kv_cache_dtype='fp8_ds_mla' has tile scales; with kv_cache_dtype='fp8_e4m3' leave"),
    ("ds_mla_scale bad auto", _bad("auto", ds_mla_scale=lambda i: "fast"), ValueError, "ds_mla_scale: expected one of ['pow2', 'amax'], got 'fast'"),
    ("nope auto", _bad("auto", k_pe=lambda i: i.k_pe[:, :0]), ValueError, "kv_c, k_pe: expected kv_lora_rank >= 1 and pe_dim >= 1 (pe_dim 0 only with kv_cache_dtype='fp8_ds_mla'), got 512 and 0"),
    ("nope fp8", _bad("fp8", k_pe=lambda i: i.k_pe[:, :0], kv_cache=lambda i: i.kv_cache[..., :512]), ValueError, "kv_c, k_pe: expected kv_lora_rank >= 1 and pe_dim >= 1 (pe_dim 0 only"),
    ("nope rows", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:-1, :0]), ValueError, "k_pe: expected 5 rows (those of kv_c), got shape (4, 0)"),
    ("nope dtype", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:, :0].half()), ValueError, "k_pe: expected the dtype of kv_c (torch.bfloat16), got torch.float16"),
    ("nope dims", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:, :0, None]), ValueError, "k_pe: expected 2 dims"),
    ("nope rank", _bad("fp8_ds_mla", kv_c=lambda i: i.kv_c[:, :256], k_pe=lambda i: i.k_pe[:, :0]), ValueError, "kv_c: kv_cache_dtype='fp8_ds_mla' needs kv_lora_rank 512, got 256"),
    ("nope entry", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:, :0], kv_cache=lambda i: i.kv_cache[..., :512]), ValueError, "kv_cache: expected a last dim of 656 bytes (fp8_ds_mla) = 656, got shape"),
    ("ds pe 1", _bad("fp8_ds_mla", k_pe=lambda i: i.k_pe[:, :1]), ValueError, "k_pe: kv_cache_dtype='fp8_ds_mla' needs pe_dim 64 (or 0: NoPE), got 1"),
])


# --- CUDA graphs, torch.compile, NVRTC ---------------------------------------------------------------

def _graph_case(kv, rule, pe_dim):
    return MlaCase(num_tokens=40, kv_cache_dtype=kv, latent_slices=True, padding_slots=3,
                   out_of_range_slots=2, cache_pad=16, num_blocks=4, block_size=16,
                   special_values=True, ds_mla_scale=rule, pe_dim=pe_dim)


GRAPH = [("auto", "pow2", 64), ("fp8", "pow2", 64), ("fp8_e5m2", "pow2", 64),
         ("fp8_ds_mla", "pow2", 64), ("fp8_ds_mla", "amax", 64), ("fp8_ds_mla", "pow2", 0),
         ("fp8_ds_mla", "amax", 0)]
GRAPH_IDS = ["auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "fp8_ds_mla-amax", "fp8_ds_mla-nope",
             "fp8_ds_mla-amax-nope"]
COMPILE = [("auto", "pow2", 64), ("fp8_ds_mla", "pow2", 64), ("fp8_ds_mla", "amax", 64),
           ("fp8_ds_mla", "amax", 0)]
COMPILE_IDS = ["auto", "fp8_ds_mla", "fp8_ds_mla-amax", "fp8_ds_mla-amax-nope"]


def _compile_variants() -> None:
    from kvwrite.ops.concat_and_cache_mla import cuda_impl
    names = cuda_impl.all_kernel_names()
    obj, _ = cuda_impl.compile_kernel("sm_90", names)  # one program: raises if any fails
    # 80 fp8_ds_mla builds: 2 dtypes, 5 alignments, 2 slot types, bracket or not, 2 scale rules.
    assert len(names) == 150 and len(bytes(obj.code)) > 0
    assert sum(", true>" in n and "ds_mla" in n for n in names) == 40  # the "pow2" builds


PROVIDER = Provider(
    op=OP,
    call=_call,
    public=kvwrite.concat_and_cache_mla,
    build=_build,
    mutates=(2,),
    mutated_names=("kv_cache",),
    check=_check,
    skip=_skip,
    # The new inputs of a replay come with another scale value.
    replay_case=lambda case: dataclasses.replace(case, scale=2.7),
    graph_cases=tuple(Example(i, _graph_case(*c)) for i, c in zip(GRAPH_IDS, GRAPH, strict=True)),
    compile_cases=tuple(Example(i, MlaCase(num_tokens=9, kv_cache_dtype=kv, padding_slots=2,
                                           latent_slices=True, ds_mla_scale=rule, pe_dim=pe))
                        for i, (kv, rule, pe) in zip(COMPILE_IDS, COMPILE, strict=True)),
    # fp8_ds_mla's entry is fixed (kv_lora_rank 512, pe_dim 64): the other modes.
    small_tile_cases=small_tiles(
        MlaCase(num_tokens=3, padding_slots=1), dict(kv_lora_rank=8, pe_dim=8),
        dict(num_tokens=2, kv_lora_rank=10, pe_dim=2, kv_cache_dtype="fp8", padding_slots=0),
        dict(kv_lora_rank=16, pe_dim=8, kv_cache_dtype="fp8_e5m2")),
    wrong_writers=WRONG,
    bad_inputs=BAD,
    compile_variants=_compile_variants,
)
