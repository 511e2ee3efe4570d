"""concat_and_cache_mla (docs/ops/concat_and_cache_mla.md): every registered implementation over the
case matrix, byte-exact against an independent per-token NumPy oracle of the entry layout;
validation specifics; CUDA launch plans and builds. Wrong writers, bad input, CUDA graphs,
torch.compile and the NVRTC compile of every variant: tests/test_conformance.py
(kvwrite.testing.providers.concat_and_cache_mla).

On CPU this runs the torch reference (and Triton's interpreter where it rounds exactly); on a GPU
(`gpu` marker) every implementation available there. The whole allocation behind each cache is
compared, so stray writes are caught as well as wrong ones.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.ops.concat_and_cache_mla import OP, MlaMode
from kvwrite.ops.concat_and_cache_mla import reference as torch_ref
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.mla import (
    MLA_CASES,
    MlaCase,
    assert_mla_caches_equal,
    clone_cache,
    ds_midpoint_tiles,
    every_16_bit_pattern_tiles,
    make_mla_inputs,
)
from oracle import cache_slots, fp8_round
from params import DEVICES, impl_names
from sass import needs_nvrtc

IMPLS = impl_names(OP)


# --- the independent oracle -----------------------------------------------------------------------

def _bytes(x: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU row, from NumPy's view of its integer bit patterns."""
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.contiguous().view(ints).numpy().view(np.uint8)


def _pow2_at_least(v: np.float32) -> np.float32:
    """The smallest power of two >= v > 0 (+inf stays), from frexp: v = m * 2^e, m in [0.5, 1)."""
    if np.isinf(v):
        return v
    m, e = math.frexp(float(v))
    with np.errstate(over="ignore"):  # 2^128 (from above (2 - 2^-23) * 2^127) is +inf
        return np.float32(math.ldexp(1.0, e - 1 if m == 0.5 else e))


def _ds_entry(kv_c: torch.Tensor, k_pe: torch.Tensor, rule: str = "pow2") -> np.ndarray:
    """The 656 bytes of one fp8_ds_mla entry, tile by tile in float32 NumPy arithmetic, under the
    tile scale rule ``rule``; NoPE (an empty k_pe) leaves zeros in the rotary bytes."""
    x = kv_c.float().numpy().astype(np.float32)
    codes, scales = [], []
    for j in range(4):
        tile = x[128 * j:128 * (j + 1)]
        a = np.abs(tile)
        amax = np.float32(0.0)
        for v in a:  # fmaxf: a NaN operand is ignored
            if not np.isnan(v) and v > amax:
                amax = np.float32(v)
        with np.errstate(all="ignore"):
            s = np.float32(amax) / np.float32(448.0)
            if rule == "pow2":
                s = _pow2_at_least(max(s, np.float32(1e-4)))
            else:
                s = max(s, np.float32(2.0**-126))
            q = (tile / np.float32(s)).astype(np.float32)
        codes.append(fp8_round(q, torch.float8_e4m3fn))
        scales.append(np.float32(s))
    pe = _bytes(k_pe) if k_pe.numel() else np.zeros(128, np.uint8)
    return np.concatenate(codes + [np.array(scales, dtype="<f4").view(np.uint8), pe])


def mla_oracle(kv_c, k_pe, kv_cache, slot_mapping, mode: MlaMode, scale,
               ds_mla_scale: str = "pow2") -> None:
    """Writes into a CPU cache, one token at a time."""
    num_blocks, block_size, _ = kv_cache.shape
    for t, b, o in cache_slots(slot_mapping, num_blocks, block_size):
        if mode is MlaMode.AUTO:
            entry = np.concatenate([_bytes(kv_c[t]), _bytes(k_pe[t])])
        elif mode is MlaMode.FP8_DS_MLA:
            entry = _ds_entry(kv_c[t], k_pe[t], ds_mla_scale)
        else:
            row = torch.cat([kv_c[t], k_pe[t]]).float().numpy().astype(np.float32)
            with np.errstate(all="ignore"):
                q = row / np.float32(float(scale[0]))
            entry = fp8_round(q, mode.fp8_dtype)
        dst = kv_cache[b, o].view(torch.uint8)
        dst.copy_(torch.from_numpy(np.ascontiguousarray(entry)))


@functools.cache
def expected_cache(case: MlaCase) -> torch.Tensor:
    inp = make_mla_inputs(case)
    cache = clone_cache(inp.kv_cache)
    mla_oracle(inp.kv_c, inp.k_pe, cache, inp.slot_mapping, case.mode, inp.scale,
               case.ds_mla_scale)
    return cache


def run_case(impl: str, case: MlaCase, device: str):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_mla_inputs(case, device)
    if (reason := info.unsupported(inp.kv_c, inp.kv_cache, case.mode)) is not None:
        pytest.skip(reason)
    kvwrite.concat_and_cache_mla(*inp.args(), **inp.kwargs(), implementation=impl)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: c.id)
def test_matches_oracle(impl, case, device):
    inp = run_case(impl, case, device)
    assert_mla_caches_equal(clone_cache(inp.kv_cache, "cpu"), expected_cache(case), case.mode)


def test_nan_equal_only_in_the_fp8_codes():
    """Two different NaN codes count as equal inside an entry's fp8 codes, never in padding."""
    case = MlaCase(kv_cache_dtype="fp8", cache_pad=4, num_tokens=1)
    inp = make_mla_inputs(case)
    a, b = clone_cache(inp.kv_cache), clone_cache(inp.kv_cache)
    a[0, 0, 3], b[0, 0, 3] = 0x7F, 0xFF  # both e4m3 NaN
    assert_mla_caches_equal(a, b, case.mode)
    pad = storage_bytes(a)
    pad_b = storage_bytes(b)
    i = inp.kv_cache.stride(1) - 1  # the last padding byte of entry 0
    pad[i], pad_b[i] = 0x7F, 0xFF
    with pytest.raises(AssertionError, match="1 bytes differ"):
        assert_mla_caches_equal(a, b, case.mode)


def test_matrix_covers_the_contract():
    assert {c.kv_cache_dtype for c in MLA_CASES} >= {"auto", "fp8", "fp8_e5m2", "fp8_ds_mla"}
    assert {c.dtype for c in MLA_CASES} == {torch.float16, torch.bfloat16, torch.float32}
    assert {(c.kv_lora_rank, c.pe_dim) for c in MLA_CASES} >= {(512, 64), (10, 3), (1, 1)}
    for kv in ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla"):
        mine = [c for c in MLA_CASES if c.kv_cache_dtype == kv]
        assert any(c.latent_slices for c in mine) and any(c.cache_transposed for c in mine)
        assert any(c.cache_offset % 2 for c in mine) and any(c.special_values for c in mine)
        assert any(c.padding_slots and c.out_of_range_slots for c in mine)
        assert any(c.slot_dtype == torch.int32 for c in mine)
    assert any(c.fp8_storage == "float8" for c in MLA_CASES)
    assert {c.num_tokens for c in MLA_CASES} >= {0, 1, 7, 129}
    ds = [c for c in MLA_CASES if c.mode is MlaMode.FP8_DS_MLA]
    for rule in ("pow2", "amax"):
        mine = [c for c in ds if c.ds_mla_scale == rule]
        assert any(c.special_values and c.dtype == torch.float16 for c in mine)
        assert any(c.special_values and c.dtype == torch.bfloat16 for c in mine)
        assert any(c.pe_dim == 0 and c.latent_slices and c.special_values for c in mine)
        assert any(c.pe_dim == 0 and c.padding_slots and c.out_of_range_slots for c in mine)
    assert all(c.ds_mla_scale == "pow2" for c in MLA_CASES if c.mode is not MlaMode.FP8_DS_MLA)


def _hand_checked_row():
    kv_c = torch.zeros(512, dtype=torch.bfloat16)
    for j in range(4):
        kv_c[128 * j + 3] = j + 1.0
        kv_c[128 * j + 4] = -(j + 1.0) / 2
    kv_c[128] = float("nan")
    return kv_c, torch.arange(64, dtype=torch.bfloat16)


def test_oracle_writes_the_documented_ds_mla_layout():
    """A hand-checked entry ("amax"): tile j holds j+1 at one place (so s_j = (j+1)/448), k_pe
    its bits."""
    kv_c, k_pe = _hand_checked_row()
    e = _ds_entry(kv_c, k_pe, "amax")
    assert e.shape == (656,)
    scales = e[512:528].view("<f4")
    assert scales.tolist() == [np.float32(j + 1) / np.float32(448) for j in range(4)]
    for j in range(4):
        assert e[128 * j + 3] == 0x7E and e[128 * j + 4] == 0xF6  # 448 and -224 in e4m3
    assert e[128] == 0x7F and e[0] == 0
    assert bytes(e[528:]) == k_pe.view(torch.uint8).numpy().tobytes()


def test_oracle_writes_power_of_two_scales_and_nope_zeros():
    """The same row under "pow2": s_j = 2^ceil(log2((j+1)/448)) = 2^-8, 2^-7, 2^-7, 2^-6 (vLLM
    0.33), so the tile maxima become 256, 256, 384, 256; tiles below float32(1e-4) * 448 take
    2^-13, an exact power of two 448 * 2^k keeps 2^k, and a NoPE row's rotary bytes are zeros."""
    kv_c, k_pe = _hand_checked_row()
    e = _ds_entry(kv_c, k_pe, "pow2")
    assert e[512:528].view("<f4").tolist() == [2.0**-8, 2.0**-7, 2.0**-7, 2.0**-6]
    maxima = [(0x78, 0xF0), (0x78, 0xF0), (0x7C, 0xF4), (0x78, 0xF0)]  # 256/-128, 384/-192
    for j, (hi, lo) in enumerate(maxima):
        assert (e[128 * j + 3], e[128 * j + 4]) == (hi, lo)
    assert e[128] == 0x7F
    assert bytes(e[528:]) == k_pe.view(torch.uint8).numpy().tobytes()
    tiles = torch.zeros(512, dtype=torch.bfloat16)
    tiles[0] = 448.0 * 2.0**-3  # amax / 448 = 2^-3 exactly: kept
    tiles[128] = (torch.tensor([56.0], dtype=torch.bfloat16).view(torch.int16) + 1).view(
        torch.bfloat16)[0]  # one step above 448 * 2^-3: 2^-2
    tiles[256] = 0.01  # amax / 448 < 1e-4: the floor's power, 2^-13
    e = _ds_entry(tiles, torch.zeros(0, dtype=torch.bfloat16), "pow2")  # tile 3: zeros, 2^-13
    assert e[512:528].view("<f4").tolist() == [2.0**-3, 2.0**-2, 2.0**-13, 2.0**-13]
    assert e[0] == 0x7E and e[128] == 0x76  # 448, and 56.25 / 0.25 = 225 -> 224
    assert not e[528:].any() and e.shape == (656,)


# --- every 16-bit input through the tile scales -----------------------------------------------------

# Rows of kv_c for fp8_ds_mla: every 16-bit pattern once, and quotients on and next to the e4m3
# rounding boundaries.
DS_TILES = {"every-16-bit": every_16_bit_pattern_tiles, "boundaries": ds_midpoint_tiles}


def _ds_inputs(tiles: str, dtype, device):
    kv_c = DS_TILES[tiles](dtype).to(device)
    k_pe = kv_c[:, :64].flip(0).contiguous()
    cache = kvwrite.create_mla_cache(2, 64, 512, 64, "fp8_ds_mla", dtype, device)
    storage_bytes(cache).copy_(torch.randint(0, 256, (cache.numel(),), dtype=torch.uint8))
    slots = torch.randperm(128)[:kv_c.shape[0]].to(device)
    return kv_c, k_pe, cache, slots


RULES = ["pow2", "amax"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("tiles", list(DS_TILES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_ds_tiles_match_oracle(dtype, tiles, rule):
    kv_c, k_pe, cache, slots = _ds_inputs(tiles, dtype, "cpu")
    want = clone_cache(cache)
    mla_oracle(kv_c, k_pe, want, slots, MlaMode.FP8_DS_MLA, None, rule)
    kvwrite.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", ds_mla_scale=rule,
                                 implementation="torch")
    assert_mla_caches_equal(cache, want, MlaMode.FP8_DS_MLA)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("tiles", list(DS_TILES))
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ds_tiles(impl, dtype, tiles, rule):
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    kv_c, k_pe, cache, slots = _ds_inputs(tiles, dtype, "cuda")
    want = clone_cache(cache)
    kvwrite.concat_and_cache_mla(kv_c, k_pe, want, slots, "fp8_ds_mla", ds_mla_scale=rule,
                                 implementation="torch")
    kvwrite.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", ds_mla_scale=rule,
                                 implementation=impl)
    assert_mla_caches_equal(cache, want, MlaMode.FP8_DS_MLA)


def _ds_cuda_build(bracket: bool, rule: str = "amax", **tuning):
    """cuda_impl.run with fp8_ds_mla's bracket build forced on or off (and other CudaTuning
    fields), under the tile scale rule ``rule``."""
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, cuda_impl
    t = cuda_impl.CudaTuning(ds_bracket_bytes=0 if bracket else 2**62, **tuning)

    def run(kv_c, k_pe, cache, slots):
        cuda_impl.run(kv_c, k_pe, cache, slots, MlaMode.FP8_DS_MLA, None,
                      ds_scale=DsMlaScale(rule), tuning=t)
        torch.cuda.synchronize()
    return run


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("bracket", [True, False], ids=["bracket", "quotient"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ds_mla_cuda_builds_on_every_16_bit_input_and_midpoints(dtype, bracket, rule):
    """Both quantizer builds of the cuda fp8_ds_mla kernel (large calls take the bracket, small
    ones the quotient), forced on every 16-bit input and on quotients exactly at and next to the
    e4m3 rounding boundaries, against the reference."""
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    run = _ds_cuda_build(bracket, rule)
    for tiles in DS_TILES:
        kv_c, k_pe, cache, slots = _ds_inputs(tiles, dtype, "cuda")
        want = clone_cache(cache)
        kvwrite.concat_and_cache_mla(kv_c, k_pe, want, slots, "fp8_ds_mla", ds_mla_scale=rule,
                                     implementation="torch")
        run(kv_c, k_pe, cache, slots)
        assert_mla_caches_equal(cache, want, MlaMode.FP8_DS_MLA)


@pytest.mark.gpu
def test_gpu_ds_mla_midpoints_catch_an_inexact_quotient():
    """The midpoint tiles fail a build that multiplies by the reciprocal of the scale instead of
    dividing (about 730 of their codes differ on the CPU), so the test above can fail. Under
    "amax": "pow2"'s scales are powers of two, whose reciprocals are exact."""
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    kv_c, k_pe, cache, slots = _ds_inputs("boundaries", torch.bfloat16, "cuda")
    want = clone_cache(cache)
    kvwrite.concat_and_cache_mla(kv_c, k_pe, want, slots, "fp8_ds_mla", ds_mla_scale="amax",
                                 implementation="torch")
    _ds_cuda_build(False, inexact_quotient=True)(kv_c, k_pe, cache, slots)
    assert (storage_bytes(cache) != storage_bytes(want)).sum() > 100


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "torch"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_every_16_bit_input_fp8(impl, kv, dtype):
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    kv_c = every_16_bit_pattern_tiles(dtype).cuda()
    k_pe = kv_c[:, :64].flip(0).contiguous()
    for s in (0.37, 2.7, 1.0, 2.0**-10, 3e-41):
        cache = kvwrite.create_mla_cache(2, 64, 512, 64, kv, dtype, "cuda")
        want = cache.clone()
        slots = torch.randperm(128).cuda()
        scale = torch.tensor([s], dtype=torch.float32, device="cuda")
        kvwrite.concat_and_cache_mla(kv_c, k_pe, want, slots, kv, scale, implementation="torch")
        kvwrite.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv, scale, implementation=impl)
        assert_mla_caches_equal(cache, want, MlaMode(kv), f"kv_cache (scale {s})")


# --- validation -----------------------------------------------------------------------------------

def _base(kv="auto", dtype=torch.bfloat16):
    return make_mla_inputs(MlaCase(kv_cache_dtype=kv, dtype=dtype, num_tokens=5))


def test_named_implementation_that_cannot_run_says_why():
    inp = _base()
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call"):
        kvwrite.concat_and_cache_mla(*inp.args(), implementation="cuda")
    with pytest.raises(ValueError, match="implementation: expected one of"):
        kvwrite.concat_and_cache_mla(*inp.args(), implementation="nope")


def test_scale_is_ignored_outside_the_per_tensor_fp8_modes():
    for kv in ("auto", "fp8_ds_mla"):
        inp = _base(kv)
        want = clone_cache(inp.kv_cache)
        kvwrite.concat_and_cache_mla(inp.kv_c, inp.k_pe, want, inp.slot_mapping, kv, None)
        kvwrite.concat_and_cache_mla(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, kv,
                                     torch.full((3,), float("nan")))
        assert_mla_caches_equal(inp.kv_cache, want, MlaMode(kv))


def test_zero_tokens_is_a_no_op():
    inp = make_mla_inputs(MlaCase(num_tokens=0, extra_rows=2, kv_cache_dtype="fp8"))
    before = storage_bytes(inp.kv_cache).clone()
    kvwrite.concat_and_cache_mla(*inp.args())
    assert torch.equal(storage_bytes(inp.kv_cache), before)


@pytest.mark.parametrize("kv, dtype, e, cdt", [
    ("auto", torch.bfloat16, 576, torch.bfloat16), ("fp8", torch.float16, 576, torch.uint8),
    ("fp8_e5m2", torch.float32, 576, torch.uint8), ("fp8_ds_mla", torch.bfloat16, 656, torch.uint8),
    ("fp8_ds_mla-nope", torch.float16, 656, torch.uint8),
])
def test_create_mla_cache(kv, dtype, e, cdt):
    pe_dim = 0 if kv.endswith("-nope") else 64
    c = kvwrite.create_mla_cache(3, 16, 512, pe_dim, kv.removesuffix("-nope"), dtype, "cpu")
    assert c.shape == (3, 16, e) and c.dtype == cdt and c.is_contiguous()
    assert not c.view(torch.uint8).any()


def test_create_mla_cache_errors():
    with pytest.raises(ValueError, match="kv_lora_rank: kv_cache_dtype='fp8_ds_mla' needs kv_lora_rank 512, got 256"):
        kvwrite.create_mla_cache(3, 16, 256, 64, "fp8_ds_mla", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="dtype: kv_cache_dtype='fp8_ds_mla' needs float16 or bfloat16"):
        kvwrite.create_mla_cache(3, 16, 512, 64, "fp8_ds_mla", torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"pe_dim: kv_cache_dtype='fp8_ds_mla' needs pe_dim 64 \(or 0: NoPE\), got 32"):
        kvwrite.create_mla_cache(3, 16, 512, 32, "fp8_ds_mla", torch.bfloat16, "cpu")
    for kv in ("auto", "fp8"):  # NoPE is fp8_ds_mla's only
        with pytest.raises(ValueError, match="pe_dim: expected a positive integer, got 0"):
            kvwrite.create_mla_cache(3, 16, 512, 0, kv, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="num_blocks: expected a positive integer"):
        kvwrite.create_mla_cache(0, 16, 512, 64, "auto", torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        kvwrite.create_mla_cache(1, 16, 512, 64, "int4", torch.float32, "cpu")


# --- Triton's interpreter on exactly representable quotients -------------------------------------

def _exact_quotient_inputs(kv: str, dtype: torch.dtype, device: str, rule: str = "pow2",
                           pe_dim: int = 64):
    """Inputs whose quotients are fp8 values themselves, so any rounding gives the same code: the
    interpreter then runs the fp8 paths' indexing, scales and byte layout exactly on bfloat16
    rows too (whose fp8 modes the op refuses there: subnormal rows). fp8_ds_mla
    tiles: amax = 448 * 2^k under "amax" (s = 2^k); under "pow2" amax = 320 * 2^k or more
    (r = 5/7 * 2^k at least, rounded up to s = 2^k: an "amax" scale would not be 2^k)."""
    mode = MlaMode(kv) if kv != "fp8" else MlaMode.FP8_E4M3
    fp8 = mode.fp8_dtype
    gen = torch.Generator().manual_seed(3)
    codes = torch.arange(0, 127, dtype=torch.uint8).view(fp8).float()
    codes = codes[torch.isfinite(codes) & (codes >= 2.0**-6)]  # normal, exact in 16 bits
    n = 9
    pick = codes[torch.randint(0, codes.numel(), (n, 576), generator=gen)]
    pick *= torch.where(torch.rand(n, 576, generator=gen) < 0.5, -1.0, 1.0)
    if mode is MlaMode.FP8_DS_MLA:
        top = 448.0 if rule == "amax" else 320.0
        tiles = pick.view(n, 576)[:, :512].view(n, 4, 128)
        tiles[:, :, 0] = top  # amax 448 * 2^k ("amax"), in [320, 448] * 2^k ("pow2")
        if rule == "pow2":
            tiles[:, :, 1:] = tiles[:, :, 1:].clamp(-288.0, 288.0)  # amax exactly 320 * 2^k
        pick[:, :512] *= torch.exp2(torch.randint(-8, 8, (n, 4), generator=gen).float()
                                    ).repeat_interleave(128, dim=1)
        scale = None
    else:
        scale = torch.tensor([0.25])
        pick *= 0.25
    latent = pick.to(dtype)
    cache = kvwrite.create_mla_cache(3, 4, 512, pe_dim, kv, dtype, "cpu")
    storage_bytes(cache).copy_(torch.randint(0, 256, (storage_bytes(cache).numel(),),
                                             dtype=torch.uint8, generator=gen))
    slots = torch.tensor([3, -1, 11, 0, 7, 100, 5, 2, 9])
    return mode, latent[:, :512], latent[:, 512:512 + pe_dim], cache.to(device), slots, scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "fp8_ds_mla", "fp8_ds_mla-amax",
                                "fp8_ds_mla-nope", "fp8_ds_mla-amax-nope"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_paths_on_exact_quotients(kv, dtype, device):
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, triton_impl
    info = registry.get(OP, "triton")
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    rule = "amax" if "-amax" in kv else "pow2"
    pe_dim = 0 if kv.endswith("-nope") else 64
    kv = kv.split("-")[0]
    mode, kv_c, k_pe, cache, slots, scale = _exact_quotient_inputs(kv, dtype, device, rule,
                                                                   pe_dim)
    want = clone_cache(cache, "cpu")
    mla_oracle(kv_c, k_pe, want, slots, mode, scale, rule)

    def mv(t):
        return None if t is None else t.to(device)

    triton_impl.run(mv(kv_c), mv(k_pe), cache, mv(slots), mode, mv(scale),
                    ds_scale=DsMlaScale(rule))
    assert_mla_caches_equal(clone_cache(cache, "cpu"), want, mode)


# --- CUDA: NVRTC compiles (no GPU needed), launch plans ---------------------------------------------


@needs_nvrtc
def test_nvrtc_compiles_specialized_builds():
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, cuda_impl
    for case in (MlaCase(kv_cache_dtype="fp8_ds_mla"), MlaCase(kv_cache_dtype="fp8"),
                 MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax"),
                 MlaCase(kv_cache_dtype="fp8_ds_mla", pe_dim=0, dtype=torch.float16),
                 MlaCase(kv_cache_dtype="fp8_ds_mla", pe_dim=0, ds_mla_scale="amax"),
                 MlaCase(kv_cache_dtype="auto", kv_lora_rank=10, pe_dim=3, block_size=7)):
        inp = make_mla_inputs(case)
        for tuning in (cuda_impl.TUNING, cuda_impl.CudaTuning(small_call_bytes=0, ds_bracket_bytes=0)):
            p = cuda_impl.plan(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode, tuning,
                               DsMlaScale(case.ds_mla_scale))
            obj, _ = cuda_impl.compile_kernel("sm_90", p.name, fixed=p.fixed)
            assert len(bytes(obj.code)) > 0
    with pytest.raises(RuntimeError, match="9 values"):
        cuda_impl.compile_kernel("sm_90", p.name, fixed=(1, 2, 3))


def _mla_row_load(text: str) -> bool:
    """A row's load in the MLA kernels: the volatile loads of copies and the 16-byte read-only
    loads of conversions and fp8_ds_mla rows; not the slot's or the scale's 4- or 8-byte loads
    (an 8-byte chunk's read-only load is skipped with them, and the byte and half-word loads of
    fp8_ds_mla's unaligned builds, which assemble a row piece by piece)."""
    op = text.split()[0]
    return "STRONG.SYS" in op or op == "LDG.E.128.CONSTANT"


@needs_nvrtc
def test_cuda_mla_kernels_issue_the_row_loads_before_waiting_for_the_slot(tmp_path):
    """A small call's chain is one memory round trip (the slot's and the row's together), then
    the store. With int32 slots loaded first, ptxas placed the slot's sign extension before the
    row's load, so 17 of the 55 int32 variants waited for the slot before requesting their
    chunk; int32 slots are now loaded after the row (SLOT_FIRST). No variant, and no
    specialized build of int32 and int64 cases, waits for a global load before its last row
    load is issued (sass.waits_before_loads reads sm_90's scoreboards); the old order fails."""
    import sass as sass_tools
    from kvwrite.ops.concat_and_cache_mla import cuda_impl
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")

    def late(obj):
        return sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), tmp_path),
                                      _mla_row_load)

    names = cuda_impl.all_kernel_names()
    obj, _ = cuda_impl.compile_kernel("sm_90", names)
    assert not late(obj)
    for slot in (torch.int32, torch.int64):
        for kv in ("auto", "fp8", "fp8_ds_mla"):
            case = MlaCase(kv_cache_dtype=kv, slot_dtype=slot)
            inp = make_mla_inputs(case)
            p = cuda_impl.plan(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode)
            obj, _ = cuda_impl.compile_kernel("sm_90", p.name, fixed=p.fixed)
            assert not late(obj), (p.name, late(obj))
    # The old order: every slot loaded first (SLOT_FIRST, kvw/slot.cuh, true for int32 too).
    old = cuda_impl.SOURCE.text.replace("SLOT_FIRST<SlotT>", "true")
    assert old != cuda_impl.SOURCE.text
    obj, _ = cuda_impl.compile_kernel("sm_90", names, source=old)
    flagged = late(obj)
    assert flagged and all("EiE" in k for k in flagged), sorted(flagged)


@pytest.mark.parametrize("case, name, vec, align", [
    (MlaCase(kv_cache_dtype="fp8_ds_mla"), "concat_and_cache_ds_mla_kernel<1, 16, long long, false, true>", 0, 16),
    (MlaCase(kv_cache_dtype="fp8_ds_mla", dtype=torch.float16, cache_pad=4, slot_dtype=torch.int32),
     "concat_and_cache_ds_mla_kernel<0, 4, int, false, true>", 0, 4),
    (MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax"), "concat_and_cache_ds_mla_kernel<1, 16, long long, false, false>", 0, 16),
    (MlaCase(kv_cache_dtype="fp8_ds_mla", pe_dim=0), "concat_and_cache_ds_mla_kernel<1, 16, long long, false, true>", 0, 16),
    # NoPE: k_pe (a slice at an odd element of the latent) is never read, so it costs no alignment
    (MlaCase(kv_cache_dtype="fp8_ds_mla", pe_dim=0, latent_slices=True, latent_pad=8), None, 0, 16),
    (MlaCase(kv_cache_dtype="fp8_ds_mla", cache_offset=1, cache_pad=2), None, 0, 1),
    (MlaCase(kv_cache_dtype="fp8_ds_mla", latent_slices=True, latent_pad=1), None, 0, 2),
    (MlaCase(kv_cache_dtype="auto"), "concat_and_cache_mla_kernel<0, 5, 8, long long>", 8, 0),
    (MlaCase(kv_cache_dtype="auto", dtype=torch.float32), "concat_and_cache_mla_kernel<2, 5, 4, long long>", 4, 0),
    # small calls (these cases): 16-byte fp8 chunks
    (MlaCase(kv_cache_dtype="fp8"), "concat_and_cache_mla_kernel<1, 3, 8, long long>", 8, 0),
    (MlaCase(kv_cache_dtype="fp8_e5m2", dtype=torch.float32), "concat_and_cache_mla_kernel<2, 4, 4, long long>", 4, 0),
    (MlaCase(kv_cache_dtype="auto", kv_lora_rank=10, pe_dim=3), None, 1, 0),
    (MlaCase(kv_cache_dtype="auto", latent_slices=True, latent_pad=2), None, 2, 0),
    (MlaCase(kv_cache_dtype="fp8", cache_pad=3), None, 1, 0),
])
def test_cuda_plan_picks_the_widest_aligned_accesses(case, name, vec, align):
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, cuda_impl
    inp = make_mla_inputs(case)
    p = cuda_impl.plan(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode,
                       ds_scale=DsMlaScale(case.ds_mla_scale))
    if name is not None:
        assert p.name == name
    assert (p.vec, p.align) == (vec, align)
    if case.mode is MlaMode.FP8_DS_MLA:  # the lanes that load k_pe: 8, none for NoPE
        assert p.fixed[7] == (8 if case.pe_dim else 0) and p.fixed[1] == (
            inp.k_pe.stride(0) if case.pe_dim else 0)


def test_cuda_plan_wider_fp8_chunks_for_large_calls():
    from kvwrite.ops.concat_and_cache_mla import cuda_impl
    case = MlaCase(kv_cache_dtype="fp8")
    inp = make_mla_inputs(case)
    args = (inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode)
    large = cuda_impl.CudaTuning(small_call_bytes=0)
    assert cuda_impl.plan(*args, large).vec == 16  # 32 bytes: two 16-byte loads
    assert cuda_impl.plan(*args).vec == 8
    n = inp.slot_mapping.numel() * (case.kv_lora_rank + case.pe_dim) * 2
    assert cuda_impl.is_small_call(inp.slot_mapping.numel(), case.kv_lora_rank, case.pe_dim, 2,
                                   cuda_impl.CudaTuning(small_call_bytes=n))
    assert not cuda_impl.is_small_call(inp.slot_mapping.numel(), case.kv_lora_rank, case.pe_dim,
                                       2, cuda_impl.CudaTuning(small_call_bytes=n - 1))


def test_cuda_plan_bracket_for_large_ds_mla_calls():
    from kvwrite.ops.concat_and_cache_mla import cuda_impl
    case = MlaCase(kv_cache_dtype="fp8_ds_mla")
    inp = make_mla_inputs(case)
    args = (inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode)
    n = inp.slot_mapping.numel() * (case.kv_lora_rank + case.pe_dim) * 2
    assert cuda_impl.plan(*args).name.endswith(", false, true>")  # a small call: the quotient
    assert cuda_impl.plan(*args, cuda_impl.CudaTuning(ds_bracket_bytes=n - 1)).name.endswith(", true, true>")
    assert cuda_impl.plan(*args, cuda_impl.CudaTuning(ds_bracket_bytes=n)).name.endswith(", false, true>")
    assert cuda_impl.ds_uses_bracket(65536, 512, 64, 2)  # the benchmark's large calls


def test_triton_large_calls_take_two_tokens_per_warp():
    from kvwrite.ops.concat_and_cache_mla import triton_impl
    t, row = triton_impl.TUNING, 1152  # L=512, P=64, 16-bit
    ds = t.large_call_bytes_ds // row
    assert triton_impl._tiling(ds, row, t, triton_impl._DS) == (1, 2)
    assert triton_impl._tiling(ds + 1, row, t, triton_impl._DS) == (2, 1)
    fp8 = t.large_call_bytes // row
    assert triton_impl._tiling(fp8, row, t, triton_impl._E4M3) == (2, 4)
    assert triton_impl._tiling(fp8 + 1, row, t, triton_impl._E5M2) == (4, 2)
    assert triton_impl._tiling(65536, row, t, triton_impl._COPY) == (2, 4)  # copies keep their tiles


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in MLA_CASES if c.mode is not MlaMode.AUTO],
                         ids=lambda c: c.id)
def test_gpu_triton_large_call_tiles(case):
    """The large calls' tiles (two tokens per warp), forced on the fp8 cases of the matrix and,
    for fp8_ds_mla, on the every-16-bit and boundary tiles."""
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, triton_impl
    if (reason := registry.get(OP, "triton").available("cuda")) is not None:
        pytest.skip(reason)
    large = triton_impl.TritonTuning(large_call_bytes=0, large_call_bytes_ds=0)
    inp = make_mla_inputs(case, "cuda")
    kvwrite.ops.concat_and_cache_mla.validate(*inp.args())
    if inp.slot_mapping.numel():
        triton_impl.run(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode,
                        inp.scale if case.mode.uses_scale else None,
                        ds_scale=DsMlaScale(case.ds_mla_scale), tuning=large)
    assert_mla_caches_equal(clone_cache(inp.kv_cache, "cpu"), expected_cache(case), case.mode)
    if case.mode is MlaMode.FP8_DS_MLA and case.dtype in (torch.float16, torch.bfloat16):
        for tiles in DS_TILES:
            kv_c, k_pe, cache, slots = _ds_inputs(tiles, case.dtype, "cuda")
            want = clone_cache(cache)
            kvwrite.concat_and_cache_mla(kv_c, k_pe, want, slots, "fp8_ds_mla",
                                         ds_mla_scale=case.ds_mla_scale, implementation="torch")
            triton_impl.run(kv_c, k_pe, cache, slots, MlaMode.FP8_DS_MLA, None,
                            ds_scale=DsMlaScale(case.ds_mla_scale), tuning=large)
            assert_mla_caches_equal(cache, want, MlaMode.FP8_DS_MLA)


def test_cuda_unavailable_on_cpu_says_why():
    assert "CUDA devices only" in registry.get(OP, "cuda").available("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("small_call_bytes", [512 * 1024, 0], ids=["default-plan", "large-call-plan"])
@pytest.mark.parametrize("case", [c for c in MLA_CASES if c.num_tokens in (5, 6, 9, 33)],
                         ids=lambda c: c.id)
def test_gpu_generic_cuda_kernels(case, small_call_bytes):
    """The unspecialized builds (runtime arguments) over part of the matrix, with the small-call
    plan (these cases' default) and the large calls' one (fp8_ds_mla: the bracket build)."""
    from kvwrite.ops.concat_and_cache_mla import DsMlaScale, cuda_impl
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    inp = make_mla_inputs(case, "cuda")
    kvwrite.ops.concat_and_cache_mla.validate(*inp.args())
    if inp.slot_mapping.numel():
        cuda_impl.run(inp.kv_c, inp.k_pe, inp.kv_cache, inp.slot_mapping, case.mode,
                      inp.scale if case.mode.uses_scale else None,
                      ds_scale=DsMlaScale(case.ds_mla_scale),
                      tuning=cuda_impl.CudaTuning(specialize=False, ds_warps=8, threads=128,
                                                  small_call_bytes=small_call_bytes,
                                                  ds_bracket_bytes=small_call_bytes))
    assert_mla_caches_equal(clone_cache(inp.kv_cache, "cpu"), expected_cache(case), case.mode)


# --- the benchmark (CPU: small shapes, the torch implementation) ------------------------------------

SMALL = ["--device", "cpu", "--num-blocks", "8", "--block-size", "16", "--num-tokens", "1:8",
         "--iters", "3", "--time-budget", "0.01", "--graph-calls", "2"]


def test_bench_cli_cpu_table_json_csv_plot(tmp_path, capsys):
    import json

    from kvwrite.bench.cli import main
    out = tmp_path / "r.json"
    rc = main(["mla", *SMALL, "--kv-cache-dtype", "fp8_ds_mla", "--strided", "--json", str(out),
               "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert ("concat_and_cache_mla: dtype=bfloat16 kv_cache_dtype=fp8_ds_mla kv_lora_rank=512 "
            "pe_dim=64 strided=True") in text
    assert "num_tokens    latency (µs)" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["num_tokens"] for r in rows] == [1, 2, 4, 8]
    assert all(r["check"] == "passed" and r["status"] == "ok" for r in rows)
    assert rows[0]["bytes"] == 1 * (576 * 2 + 656 + 8)
    assert (tmp_path / "r.png").stat().st_size > 0
    assert (tmp_path / "r.csv").read_text().count("\n") == 5


def test_bench_check_catches_a_wrong_implementation(monkeypatch, capsys):
    from kvwrite.bench.cli import main
    from kvwrite.bench.ops import concat_and_cache_mla as bench_mla

    class TrueReference:
        run = staticmethod(torch_ref.run)

    def broken(kv_c, k_pe, kv_cache, slot_mapping, mode, scale, **kw):
        TrueReference.run(kv_c, k_pe.roll(1, 0), kv_cache, slot_mapping, mode, scale, **kw)

    monkeypatch.setattr(bench_mla, "torch_ref", TrueReference)
    monkeypatch.setattr(torch_ref, "run", broken)
    rc = main(["mla", *SMALL, "--kv-cache-dtype", "fp8", "--num-tokens", "2,8"])
    assert rc == 1
    assert "mismatch: " in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [
    (["--kv-cache-dtype", "fp8_ds_mla", "--kv-lora-rank", "256"], "--kv-cache-dtype fp8_ds_mla"),
    (["--kv-cache-dtype", "fp8_ds_mla", "--dtype", "float"], "--kv-cache-dtype fp8_ds_mla"),
    (["--kv-cache-dtype", "fp8_ds_mla", "--pe-dim", "32"], "--kv-cache-dtype fp8_ds_mla"),
    (["--kv-cache-dtype", "fp8_ds_mla", "--ds-mla-scales", "pow2,ue8m0"], "--ds-mla-scales"),
    (["--kv-cache-dtype", "fp8_ds_mla", "--ds-mla-scales", ","], "--ds-mla-scales"),
    (["--ds-mla-scales", "amax"], "--ds-mla-scales: only --kv-cache-dtype fp8_ds_mla"),
    (["--kv-cache-dtype", "fp8", "--pe-dim", "0"], "--pe-dim"),
    (["--implementation", "nope"], "--implementation"),
    (["--num-tokens", "0:4"], "--num-tokens"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--device", "tpu"], "--device"),
])
def test_bench_bad_flags_name_the_flag(capsys, argv, flag):
    from kvwrite.bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(["mla", *SMALL, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1


def test_bench_ds_mla_scale_rules_and_nope_rows(tmp_path, capsys):
    """--ds-mla-scales sweeps both rules (a column, a JSON field, each checked against the
    reference); --pe-dim 0 writes NoPE rows, which read no k_pe bytes."""
    import json

    from kvwrite.bench.cli import main
    out = tmp_path / "r.json"
    rc = main(["mla", *SMALL, "--num-tokens", "1,4", "--kv-cache-dtype", "fp8_ds_mla",
               "--ds-mla-scales", "amax,pow2", "--pe-dim", "0", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ds_mla_scale" in text and "ds_mla_scales=amax,pow2" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ds_mla_scale"], r["num_tokens"]) for r in rows] == [
        ("amax", 1), ("amax", 4), ("pow2", 1), ("pow2", 4)]
    assert all(r["check"] == "passed" and r["pe_dim"] == 0 for r in rows)
    assert rows[0]["bytes"] == 1 * (512 * 2 + 656 + 8)
    rc = main(["mla", *SMALL, "--num-tokens", "2", "--json", str(out)])
    assert rc == 0 and "ds_mla_scale" not in json.loads(out.read_text())["rows"][0]


def test_bench_script_runs_from_a_checkout(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(root / "benchmarks/kernels/benchmark_concat_and_cache_mla.py"),
                        *SMALL, "--kv_cache_dtype", "auto", "--dtype", "half"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "concat_and_cache_mla: dtype=half kv_cache_dtype=auto" in r.stdout


def test_bench_run_benchmark_on_cpu():
    from kvwrite.bench.ops.concat_and_cache_mla import run_benchmark
    us = run_benchmark(4, 512, 64, 16, 8, torch.bfloat16, "fp8", True, device="cpu",
                       implementation="torch")
    assert us > 0


def test_bench_slot_pattern_with_padding_runs_checks_and_rows_carry_it(tmp_path, capsys):
    import csv
    import json

    from kvwrite.bench.cli import main
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    rc = main(["mla", *SMALL, "--num-blocks", "64", "--num-tokens", "4,16", "--kv-cache-dtype",
               "fp8", "--slots", "decode", "--pad-fraction", "0.25", "--json", str(js),
               "--csv", str(cs)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "# slots: decode(context_len=4096, pad_fraction=0.25): " in out
    rows = json.loads(js.read_text())["rows"]
    assert [r["num_tokens"] for r in rows] == [4, 16]
    for r in rows:
        assert r["check"] == "passed" and r["status"] == "ok"
        assert (r["slots"], r["slot_params"], r["pad_fraction"]) == (
            "decode", "decode(context_len=4096, pad_fraction=0.25)", 0.25)
        n = r["num_tokens"] * 3 // 4  # padding moves only its slot
        assert r["bytes"] == n * (576 * 2 + 576) + r["num_tokens"] * 8
    with cs.open() as f:
        assert {line["slots"] for line in csv.DictReader(f)} == {"decode"}


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_bench_sets_take_the_patterns_slots(kind):
    from kvwrite.bench.ops import concat_and_cache_mla as bench_mla
    from kvwrite.testing.slots import SlotPattern, make_slots
    pat = SlotPattern(kind, pad_fraction=0.25, prefill_len=8, context_len=40)
    sets = bench_mla.make_sets(16, 512, 64, torch.bfloat16, True, 64, 16, 2, "cpu", pat)
    for i, s in enumerate(sets):
        assert s.slot_mapping.tolist() == make_slots(pat, 16, 64, 16, set_index=i).slots.tolist()
        assert s.slot_mapping[-4:].tolist() == [-1] * 4


def test_bench_check_catches_a_write_of_padding(monkeypatch, capsys):
    from kvwrite.bench.cli import main
    from kvwrite.bench.ops import concat_and_cache_mla as bench_mla

    class TrueReference:
        run = staticmethod(torch_ref.run)

    def writes_padding(kv_c, k_pe, kv_cache, slot_mapping, mode, scale, **kw):
        """Wrong: indexes with -1 as Python does, so padding lands in the last slot."""
        s = slot_mapping.clone()
        s[s < 0] = kv_cache.shape[0] * kv_cache.shape[1] - 1
        TrueReference.run(kv_c, k_pe, kv_cache, s, mode, scale, **kw)

    monkeypatch.setattr(bench_mla, "torch_ref", TrueReference)
    monkeypatch.setattr(torch_ref, "run", writes_padding)
    rc = main(["mla", *SMALL, "--num-tokens", "8", "--slots", "prefill", "--prefill-len", "4",
               "--pad-fraction", "0.25"])
    assert rc == 1
    assert "mismatch: " in capsys.readouterr().out


# --- the shared power-of-two rounding (kvwrite.dtypes, triton_fp8, kvw/fp8.cuh) -------------------

def _ue8m0_inputs() -> torch.Tensor:
    """Positive float32 values: random bit patterns (subnormals included), every power of two and
    its neighbours, the largest finite value (rounds up to +inf) and +inf."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(1, 0x7F800000, (1 << 16,), generator=gen, dtype=torch.int64)
    p2 = torch.arange(0, 255, dtype=torch.int64) << 23  # 0 (the subnormal binade) .. 2^127
    edges = torch.cat([p2[1:], p2[1:] + 1, p2[1:] - 1, p2 + 0x7FFFFF, torch.tensor([1])])
    v = torch.cat([bits, edges]).to(torch.int32).view(torch.float32)
    return torch.cat([v, torch.tensor([float("inf")])]).contiguous()


def test_ue8m0_round_up_is_the_smallest_power_of_two_at_least_s():
    """kvwrite.dtypes.ue8m0_round_up (the MLA pow2 rule's and the indexer's rounding) against
    frexp: normal powers of two stay, every other normal value goes up a binade, +inf
    stays, subnormals give 2^-126 (the bits' rule: a nonzero mantissa)."""
    from kvwrite.dtypes import ue8m0_round_up
    s = _ue8m0_inputs()
    got = ue8m0_round_up(s)
    normal = s >= 2.0**-126  # a subnormal s gives 2^-126 (the callers' floors keep s normal)
    want = torch.tensor([_pow2_at_least(np.float32(v)) for v in s[normal].tolist()],
                        dtype=torch.float32)
    assert torch.equal(got[normal].view(torch.int32), want.view(torch.int32))
    assert (got[~normal] == 2.0**-126).all() and (~normal).sum() > 100
    big = torch.tensor([3.4028234663852886e38, float("inf")])  # (2 - 2^-23) * 2^127 -> +inf
    assert torch.isinf(ue8m0_round_up(big)).all()


from kvwrite.kernels.triton_fp8 import triton as _triton  # noqa: E402

if _triton is not None:
    from kvwrite.kernels.triton_fp8 import tl, triton, ue8m0_round_up

    @triton.jit
    def _ue8m0_kernel(s_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(s_ptr + i, mask=i < n, other=1.0)
        tl.store(out_ptr + i, ue8m0_round_up(s), mask=i < n)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_ue8m0_round_up_matches_torch(device):
    from kvwrite.dtypes import ue8m0_round_up
    if (reason := registry.get(OP, "triton").available(device)) is not None:
        pytest.skip(reason)
    s = _ue8m0_inputs().to(device)
    out = torch.empty_like(s)
    _ue8m0_kernel[(triton.cdiv(s.numel(), 1024),)](s, out, s.numel(), BLOCK=1024)
    assert torch.equal(out.view(torch.int32).cpu(), ue8m0_round_up(s.cpu()).view(torch.int32))


_UE8M0_HARNESS = r"""
#include "kvw/fp8.cuh"
extern "C" void kvw_ue8m0(const float* s, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = ue8m0_round_up(s[i]);
}
"""


def test_cuda_ue8m0_round_up_on_the_host_matches_torch(tmp_path):
    """kvw/fp8.cuh's ue8m0_round_up, compiled for the host (-DKVWRITE_HOST_TEST)."""
    import ctypes
    import importlib.resources
    import shutil
    import subprocess

    from kvwrite.dtypes import ue8m0_round_up
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++)")
    include = importlib.resources.files("kvwrite.kernels").joinpath("include")
    (tmp_path / "h.cpp").write_text(_UE8M0_HARNESS)
    lib = tmp_path / "libue8m0.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas",
                    "-shared", "-fPIC", "-DKVWRITE_HOST_TEST", f"-I{include}",
                    str(tmp_path / "h.cpp"), "-o", str(lib)], check=True)
    s = _ue8m0_inputs()
    out = torch.empty_like(s)
    ctypes.CDLL(str(lib)).kvw_ue8m0(ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                    ctypes.c_longlong(s.numel()))
    assert torch.equal(out.view(torch.int32), ue8m0_round_up(s).view(torch.int32))
