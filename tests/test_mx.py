"""MXFP8/MXFP4 cache writes and the reader (SPEC §10.3): the torch reference against an
independent oracle (Python floats and NumPy float32 scalars, group by group: the exponent by
search, the elements by their own tables) over whole allocations for every case of
kvwrite.testing.mx (§1.2's data layouts and inline rows, both scale layouts, uint8 and
float8_e8m0fnu scale caches, uint8 and float8_e4m3fn mxfp8 caches, padding and out-of-range
slots, int32 slots, both rules, the special groups); the reader's exact decode; the round trip
bounds; an attention over the read-back cache; the mode parsing and the allocator. Every
implementation against the reference, wrong writers, bad input changing nothing, graph replay and
torch.compile: tests/test_conformance.py (kvwrite.testing.providers.mx_kv_write).
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch

import kvwrite
from kvwrite import formats
from kvwrite.dtypes import CacheDType, parse_kv_cache_dtype
from kvwrite.ops.mx_kv_write import create_mx_caches
from kvwrite.ops.mx_kv_write.rule import encode_groups
from kvwrite.testing.compare import assert_caches_equal, copy_allocations
from kvwrite.testing.mx import (
    MX_CASES,
    MX_GPU_CASES,
    MxCase,
    call_mx,
    make_mx_inputs,
    special_groups,
)
from params import impl_names

IMPLS = impl_names("mx_kv_write")
F32 = np.float32
NAN_E4M3 = (0x7F, 0xFF)

# --- the independent oracle -----------------------------------------------------------------------

# (M, e_M) of SPEC §10.3: the largest element and its exponent.
LIMITS = {"mxfp8": (448.0, 8), "mxfp4": (6.0, 2)}
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_table() -> list[float]:
    """The 127 non-negative finite e4m3fn values by code (0x00 .. 0x7E), from the format: 4
    exponent bits (bias 7), 3 mantissa bits, subnormals at exponent field 0."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3_GRID = _e4m3_table()


def _nearest_even(grid: list[float], m: float) -> int:
    """The index of the value of ``grid`` (increasing) nearest to ``m`` (<= grid[-1]); ties to
    the even index (the even code)."""
    i = bisect.bisect_left(grid, m)
    if i < len(grid) and grid[i] == m:
        return i
    lo, hi = i - 1, i
    dl, dh = m - grid[lo], grid[hi] - m
    if dl < dh:
        return lo
    if dh < dl:
        return hi
    return lo if lo % 2 == 0 else hi


def oracle_exponent(a: float, mode: str, rule: str) -> int:
    """E of SPEC §10.3 for the amax ``a`` (a Python float), without bit tricks: ``"ceil"`` the
    smallest E >= -127 with a <= M * 2^E, found by counting up; ``"floor"`` frexp's exponent."""
    big, e_m = LIMITS[mode]
    if a == 0:
        return -127
    if math.isinf(a):
        return 127
    if rule == "ceil":
        e = -127
        while a > math.ldexp(big, e):
            e += 1
        return e
    k = math.frexp(a)[1] - 1  # a = m * 2^k, 1 <= m < 2
    return max(-127, min(127, k - e_m))


def oracle_e4m3(v: float) -> int | None:
    """The e4m3fn code of float ``v`` by §1.1 (None for NaN: any NaN code)."""
    if math.isnan(v):
        return None
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    return sign | _nearest_even(E4M3_GRID, min(abs(v), 448.0))


def oracle_e2m1(v: float) -> int:
    if math.isnan(v):
        return 0x7
    sign = 0x8 if math.copysign(1.0, v) < 0 else 0
    return sign | _nearest_even(E2M1_GRID, min(abs(v), 6.0))


def oracle_group(xs: list[float], mode: str, rule: str) -> tuple[list[int | None], int]:
    """(codes, scale byte) of one group of 32 float32 values (Python floats): e4m3fn codes
    (None: a NaN code), or E2M1 codes one an element."""
    finite_or_inf = [abs(x) for x in xs if not math.isnan(x)]
    a = max(finite_or_inf, default=0.0)
    e = oracle_exponent(a, mode, rule)
    # x / 2^E is exact in double; one rounding to float32 (only results below 2^-126 round).
    vs = [float(F32(x / math.ldexp(1.0, e))) if not math.isnan(x) else x for x in xs]
    codes = [oracle_e4m3(v) if mode == "mxfp8" else oracle_e2m1(v) for v in vs]
    return codes, e + 127


def _rows(x: torch.Tensor) -> list[list[float]]:
    return x.float().tolist()


def expected_caches(args: tuple) -> tuple[list[torch.Tensor], list[tuple]]:
    """The oracle's writes of :func:`call_mx`'s ``args`` into copies of the four caches' whole
    allocations, token by token, head by head, group by group; and the (cache index, logical
    index) of every byte that must hold a NaN code (whichever)."""
    key, value, kc, vc, slots, mode, ks, vs, rule, layout = args
    copies = copy_allocations([kc, vc, ks, vs])
    nb, bs, num_heads, _ = kc.shape
    d = key.shape[2]
    nan_at = []
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < nb * bs:
            continue
        b, o = divmod(s, bs)
        for side, x in ((0, key), (1, value)):
            data, sc = copies[side].view(torch.uint8), copies[2 + side].view(torch.uint8)
            for h in range(num_heads):
                row = _rows(x[t, h])
                for g in range(d // 32):
                    codes, byte = oracle_group(row[32 * g:32 * g + 32], mode, rule)
                    if mode == "mxfp8":
                        for i, c in enumerate(codes):
                            j = 32 * g + i
                            if c is None:
                                nan_at.append((side, (b, o, h, j)))
                                c = 0x7F
                            data[b, o, h, j] = c
                    else:
                        for i in range(16):
                            data[b, o, h, 16 * g + i] = codes[2 * i] | codes[2 * i + 1] << 4
                    if layout == "linear":
                        sc[b, o, h, g] = byte
                    else:
                        sc[b, h, o // 128, o % 32, (o % 128) // 32, g] = byte
    return copies, nan_at


def assert_matches_oracle(args: tuple, got: list[torch.Tensor]) -> None:
    want, nan_at = expected_caches(args)
    for side, idx in nan_at:
        byte = int(got[side].view(torch.uint8)[idx])
        assert byte in NAN_E4M3, (side, idx, byte)
        want[side].view(torch.uint8)[idx] = byte
    for name, g, w in zip(("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"), got,
                          want, strict=True):
        assert_caches_equal(g, w, name)


# --- the reference against the oracle -------------------------------------------------------------

@pytest.mark.parametrize("case", MX_CASES, ids=lambda c: c.id)
def test_reference_matches_the_oracle_over_whole_allocations(case):
    args = make_mx_inputs(case, seed=3)
    got = copy_allocations(list(args[i] for i in (2, 3, 6, 7)))
    moved = list(args)
    for i, c in zip((2, 3, 6, 7), got, strict=True):
        moved[i] = c
    call_mx(*moved, implementation="torch")
    assert_matches_oracle(args, got)


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_special_groups_one_by_one(mode, rule):
    """Each special group of SPEC §10.3 through the group rule, against the oracle, with the
    consequences the SPEC lists."""
    big = LIMITS[mode][0]
    element = formats.lookup(mode).element
    for xs in special_groups(big):
        x = torch.tensor(xs, dtype=torch.float32)[None]
        codes, scale = encode_groups(x, element, rule)
        want_codes, want_byte = oracle_group(x[0].tolist(), mode, rule)
        assert int(scale[0]) == want_byte, (xs, int(scale[0]), want_byte)
        if mode == "mxfp8":
            got = codes[0].tolist()
            for c, w in zip(got, want_codes, strict=True):
                assert c in NAN_E4M3 if w is None else c == w, (xs, got, want_codes)
        else:
            packed = [want_codes[2 * i] | want_codes[2 * i + 1] << 4 for i in range(16)]
            assert codes[0].tolist() == packed, xs
    # The SPEC's consequences, spelled out.
    enc = lambda xs: encode_groups(torch.tensor(xs, dtype=torch.float32)[None], element, rule)  # noqa: E731
    codes, s = enc([0.0] * 32)
    assert int(s[0]) == 0 and not codes.any()
    codes, s = enc([-0.0] * 32)
    assert int(s[0]) == 0 and set(codes[0].tolist()) == ({0x80} if mode == "mxfp8" else {0x88})
    codes, s = enc([float("inf"), -float("inf")] + [1.0] * 30)
    assert int(s[0]) == 0xFE
    if mode == "mxfp8":
        assert codes[0, :2].tolist() == [0x7E, 0xFE] and codes[0, 2] == 0  # 1 / 2^127 -> +0
    else:
        assert codes[0, 0] == 0x7 | 0xF << 4 and codes[0, 1] == 0
    # amax exactly M * 2^3: E = 3 under both rules, the element exactly M.
    codes, s = enc([big * 8] + [0.0] * 31)
    assert int(s[0]) == 130
    assert int(codes[0, 0]) == (0x7E if mode == "mxfp8" else 0x7)
    # One float32 ulp above: "ceil" takes E = 4 (no saturation), "floor" keeps 3 and saturates.
    above = float(torch.nextafter(torch.tensor(big * 8), torch.tensor(math.inf)))
    codes, s = enc([above] + [0.0] * 31)
    assert int(s[0]) == (131 if rule == "ceil" else 130)
    if rule == "floor":
        assert int(codes[0, 0]) == (0x7E if mode == "mxfp8" else 0x7)
    # The largest mantissa: a = 1.999 * 2^10 saturates under "floor" only.
    codes, s = enc([1.999 * 2**10] + [1.0] * 31)
    e = int(s[0]) - 127
    assert e == (10 - LIMITS[mode][1] + 1 if rule == "ceil" else 10 - LIMITS[mode][1])
    if rule == "floor":
        assert int(codes[0, 0]) == (0x7E if mode == "mxfp8" else 0x7)


def test_tiny_groups_take_the_lowest_exponent():
    """bfloat16 subnormals (below 2^-126): E = -127 under "ceil" (M * 2^-127 covers them) and
    the elements are x * 2^127, rounded like any other."""
    xs = torch.tensor([2.0**-133, -(2.0**-130), 9.2e-41] + [0.0] * 29, dtype=torch.bfloat16)
    for mode in ("mxfp8", "mxfp4"):
        element = formats.lookup(mode).element
        codes, s = encode_groups(xs[None].float(), element, "ceil")
        assert int(s[0]) == 0
        want, byte = oracle_group(xs.float().tolist(), mode, "ceil")
        assert byte == 0
        got = codes[0].tolist() if mode == "mxfp8" else [
            v for b in codes[0].tolist() for v in (b & 15, b >> 4)]
        assert got == want


def test_exponent_of_every_float32_binade():
    """Amaxes m * 2^k over every binade of float32 (subnormals included), for m just below, at
    and just above m_M and at 1: the bit rule gives the oracle's exponent."""
    vals = []
    for k in range(-149, 128):
        for m in (1.0, 1.25, 1.5, 1.75, 1.5 + 2**-23, 1.75 + 2**-23, 1.75 - 2**-23, 2 - 2**-23):
            v = math.ldexp(m, k)
            if v < 3.5e38 and float(F32(v)) == v and v > 0:
                vals.append(v)
    a = torch.tensor(vals, dtype=torch.float32)
    x = torch.zeros(a.numel(), 32)
    x[:, 5] = -a
    for mode in ("mxfp8", "mxfp4"):
        element = formats.lookup(mode).element
        for rule in ("ceil", "floor"):
            _, s = encode_groups(x, element, rule)
            want = [oracle_exponent(v, mode, rule) + 127 for v in vals]
            assert s.tolist() == want, (mode, rule)


# --- the reader -------------------------------------------------------------------------------

def _decode_oracle(code: int, byte: int, mode: str) -> float:
    if byte == 255:
        return math.nan
    if mode == "mxfp8":
        if code & 0x7F == 0x7F:
            return math.nan
        v = E4M3_GRID[code & 0x7F]
        sign = -1.0 if code & 0x80 else 1.0
    else:
        v = E2M1_GRID[code & 7]
        sign = -1.0 if code & 8 else 1.0
    exact = math.copysign(v, sign) * math.ldexp(1.0, byte - 127)
    return exact if abs(exact) < 2.0**128 else math.copysign(math.inf, exact)  # float32 overflow


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu],
                         ids=["uint8", "e8m0"])
def test_reader_decodes_every_scale_byte_exactly(mode, scale_dtype):
    """One slot per scale byte 0..255 with every code: value(code) * 2^(B - 127) (byte 0 is
    2^-127, 255 NaN; overflow to +-inf), and its nearest-even cast to the output dtype."""
    nb, bs, h, d = 16, 16, 1, 256
    cache = torch.zeros(nb, bs, h, formats.lookup(mode).data_bytes(d), dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8) if mode == "mxfp8" else \
        torch.arange(128, dtype=torch.uint8)
    cache[:] = codes
    scale = torch.arange(256, dtype=torch.uint8).reshape(nb, bs, 1, 1).expand(nb, bs, h, 8)
    scale = scale.contiguous().view(scale_dtype)
    slots = torch.arange(nb * bs)
    out = kvwrite.mx_gather_cache(cache, scale, slots, mode)
    assert out.shape == (256, 1, d) and out.dtype == torch.float32
    for byte in (0, 1, 100, 126, 127, 128, 133, 200, 254, 255):
        row = out[byte, 0].tolist()
        if mode == "mxfp8":
            want = [_decode_oracle(c, byte, mode) for c in range(256)]
        else:
            want = [_decode_oracle(c, byte, mode) for b in range(128) for c in (b & 15, b >> 4)]
        for g, w in zip(row, want, strict=True):
            assert (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) ==
                                                         math.copysign(1, w)), (byte, g, w)
    for dt in (torch.bfloat16, torch.float16):
        low = kvwrite.mx_gather_cache(cache, scale, slots, mode, output_dtype=dt)
        assert low.dtype == dt
        assert torch.equal(low.float().nan_to_num(7.0), out.to(dt).float().nan_to_num(7.0))


def test_reader_interleaved128_reads_what_was_written():
    case = MxCase(kv_cache_dtype="mxfp4", head_size=128, block_size=256, num_blocks=2,
                  scale_layout="interleaved128", num_tokens=40)
    args = make_mx_inputs(case, seed=5)
    call_mx(*args)
    key, _, kc, _, slots, mode, ks, *_ = args
    got = kvwrite.mx_gather_cache(kc, ks, slots, mode, scale_layout="interleaved128")
    # The same rows through a linear write.
    lin = make_mx_inputs(MxCase(kv_cache_dtype="mxfp4", head_size=128, block_size=256,
                                num_blocks=2, num_tokens=40), seed=5)
    call_mx(*lin)
    want = kvwrite.mx_gather_cache(lin[2], lin[6], lin[4], mode)
    assert torch.equal(lin[0], key) and torch.equal(lin[4], slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad_slot", [-1, 64, 1000])
def test_reader_refuses_slots_out_of_range(bad_slot):
    kc, _, ks, _ = create_mx_caches(4, 16, 2, 64, "mxfp8", seed=0)
    before = (kc.clone(), ks.clone())
    with pytest.raises(ValueError, match=r"^slot_mapping: expected slots in \[0, num_blocks \* "
                                         r"block_size = 64\); 1 out of range at positions \[1\]"):
        kvwrite.mx_gather_cache(kc, ks, torch.tensor([3, bad_slot]), "mxfp8")
    assert torch.equal(kc, before[0]) and torch.equal(ks, before[1])


@pytest.mark.parametrize("change, text", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype: expected 'mxfp8' or 'mxfp4', got 'fp8_e4m3'"),
    (dict(scale_layout="tiled"), "scale_layout: expected one of ['linear', 'interleaved128']"),
    (dict(cache=lambda c: c[..., :48]), "cache: expected a last dim F = D for a head_size D "
                                        "that is a positive multiple of 32, got shape"),
    (dict(cache=lambda c: c.view(torch.int8)), "cache: kv_cache_dtype='mxfp8' expects dtype "
                                               "torch.uint8 or torch.float8_e4m3fn"),
    (dict(scale_cache=lambda s: s.view(torch.int8)), "scale_cache: expected dtype torch.uint8 "
                                                     "or torch.float8_e8m0fnu, got torch.int8"),
    (dict(scale_cache=lambda s: s[:2]), "scale_cache: expected shape (4, 16, 2, 2)"),
    (dict(scale_layout="interleaved128"), "scale_layout: 'interleaved128' needs head_size 128"),
    (dict(slot_mapping=lambda s: s.float()), "slot_mapping: expected dtype int64 or int32"),
    (dict(output_dtype=torch.float64), "output_dtype: expected torch.float32"),
])
def test_reader_errors_name_the_argument(change, text):
    kc, _, ks, _ = create_mx_caches(4, 16, 2, 64, "mxfp8", seed=0)
    kw = dict(cache=kc, scale_cache=ks, slot_mapping=torch.tensor([1, 2]),
              kv_cache_dtype="mxfp8")
    for name, v in change.items():
        kw[name] = v(kw[name]) if callable(v) else v
    with pytest.raises(ValueError) as e:
        kvwrite.mx_gather_cache(kw.pop("cache"), kw.pop("scale_cache"), kw.pop("slot_mapping"),
                                kw.pop("kv_cache_dtype"), **kw)
    assert str(e.value).startswith(text), str(e.value)


# --- the round trip and a consumer ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_round_trip_bounds(mode, dtype):
    """Under "ceil", finite groups: mxfp8 |x^ - x| <= max(|x| 2^-4, 2^(E-10)); mxfp4 half an
    E2M1 gap of |v| = |x| / 2^E times 2^E (0.25, 0.5, 1 for |v| <= 2, 4, 6)."""
    gen = torch.Generator().manual_seed(11)
    n, h, d = 64, 2, 64
    key = (torch.randn(n, h, d, generator=gen)
           * torch.logspace(-30, 30, n, base=2.0)[:, None, None]).to(dtype)
    kc, vc, ks, vs = create_mx_caches(8, 8, h, d, mode, seed=1)
    slots = torch.randperm(64, generator=gen)
    kvwrite.reshape_and_cache_flash(key, key, kc, vc, slots, mode, k_scale_cache=ks,
                                    v_scale_cache=vs)
    got = kvwrite.mx_gather_cache(kc, ks, slots, mode).double()
    x = key.double()
    e = (ks.view(torch.uint8)[slots // 8, slots % 8].long() - 127).double()  # [n, h, G]
    scale = torch.exp2(e).repeat_interleave(32, dim=-1)
    err = (got - x).abs()
    if mode == "mxfp8":
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    else:
        v = x.abs() / scale
        half_gap = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
        bound = half_gap * scale
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((err > 0).any())  # the bound is not vacuous


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
def test_attention_over_the_read_back_cache(mode):
    """softmax(q K^T / sqrt(D)) V over the cache as the reader returns it: the oracle's decode
    gives the same output exactly, and it stays near the unquantized attention."""
    gen = torch.Generator().manual_seed(2)
    t, h, d = 48, 2, 64
    key = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(h, d, generator=gen)
    kc, vc, ks, vs = create_mx_caches(4, 16, h, d, mode, inline=True, seed=4)
    slots = torch.randperm(64, generator=gen)[:t]
    kvwrite.reshape_and_cache_flash(key, value, kc, vc, slots, mode, k_scale_cache=ks,
                                    v_scale_cache=vs)
    k_hat = kvwrite.mx_gather_cache(kc, ks, slots, mode)
    v_hat = kvwrite.mx_gather_cache(vc, vs, slots, mode)

    def attention(k, v):
        w = torch.softmax(torch.einsum("hd,thd->ht", q, k) / d**0.5, dim=-1)
        return torch.einsum("ht,thd->hd", w, v)

    # The oracle's values: its codes decoded by its own tables.
    def oracle_rows(x):
        out = torch.empty(t, h, d)
        for i in range(t):
            for j in range(h):
                row = x[i, j].float().tolist()
                for g in range(d // 32):
                    codes, byte = oracle_group(row[32 * g:32 * g + 32], mode, "ceil")
                    out[i, j, 32 * g:32 * g + 32] = torch.tensor(
                        [_decode_oracle(c, byte, mode) for c in codes])
        return out

    assert torch.equal(k_hat, oracle_rows(key)) and torch.equal(v_hat, oracle_rows(value))
    got = attention(k_hat, v_hat)
    exact = attention(key.float(), value.float())
    tol = 0.05 if mode == "mxfp8" else 0.4
    assert torch.allclose(got, exact, atol=tol), float((got - exact).abs().max())


# --- parsing, routing, the allocator -------------------------------------------------------------

def test_mx_modes_are_gated_to_reshape_and_cache_flash():
    assert parse_kv_cache_dtype("mxfp8", mx=True) is CacheDType.MXFP8
    assert parse_kv_cache_dtype("mxfp4", mx=True) is CacheDType.MXFP4
    assert CacheDType.MXFP8.is_mx and not CacheDType.MXFP8.is_fp8 and not CacheDType.MXFP4.is_nvfp4
    for spelling in ("mxfp8", CacheDType.MXFP4):
        with pytest.raises(ValueError, match=r"the MX modes are written by "
                                             r"reshape_and_cache_flash only"):
            parse_kv_cache_dtype(spelling)
    for c in (CacheDType.MXFP8, CacheDType.MXFP4):
        with pytest.raises(ValueError, match="has no per-element dtype"):
            c.element_dtype(torch.bfloat16)
    # Another flash writer refuses the MX modes.
    k = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: expected one of .*, got 'mxfp8'"):
        kvwrite.reshape_and_cache(k, k, torch.zeros(4, 2, 16, 16, 8, dtype=torch.uint8),
                                  torch.zeros(4, 2, 64, 16, dtype=torch.uint8),
                                  torch.tensor([0, 1]), "mxfp8")


def test_records_are_what_the_kernels_receive():
    for name, element, f in (("mxfp8", formats.Element.FP8_E4M3, 128),
                             ("mxfp4", formats.Element.E2M1, 64)):
        mode = formats.lookup(name)
        assert (mode.name, mode.element, mode.data_bytes(128), mode.scale_bytes(128)) == (
            name, element, f, 4)
        (s,) = mode.scales
        assert (s.placement, s.granularity, s.nbytes, s.group) == (
            formats.Placement.SCALE_CACHE, formats.Granularity.BLOCK, 1, 32)
        assert mode.reader == "mx_gather_cache" and mode.head_size_multiple == 32


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("layout", ["linear", "interleaved128"])
def test_allocator_sizes_rows_by_the_record(layout, inline):
    if inline and layout != "linear":
        with pytest.raises(ValueError, match="^inline: "):
            create_mx_caches(2, 128, 2, 128, "mxfp8", scale_layout=layout, inline=True)
        return
    for mode in ("mxfp8", "mxfp4"):
        kc, vc, ks, vs = create_mx_caches(2, 128, 2, 128, mode, scale_layout=layout,
                                          inline=inline, seed=0)
        fmt = formats.lookup(mode)
        assert kc.shape == (2, 128, 2, fmt.data_bytes(128)) and kc.dtype == torch.uint8
        assert ks.numel() == 2 * 128 * 2 * fmt.scale_bytes(128)
        if inline:
            assert kc.stride(2) == fmt.row_bytes(128)
            assert ks.data_ptr() - kc.data_ptr() == fmt.data_bytes(128)
        # A write into them runs.
        x = torch.randn(3, 2, 128)
        kvwrite.reshape_and_cache_flash(x, x, kc, vc, torch.tensor([0, 5, 300]), mode,
                                        k_scale_cache=ks, v_scale_cache=vs,
                                        scale_layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", MX_CASES, ids=lambda c: c.id)
def test_every_implementation_matches_the_oracle_on_the_gpu(case, impl):
    info = kvwrite.registry.get("mx_kv_write", impl)
    if (why := info.available(torch.device("cuda"))) is not None:
        pytest.skip(why)
    args = make_mx_inputs(case, device="cuda", seed=9)
    call_mx(*args, implementation=impl)
    torch.cuda.synchronize()
    cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    before = make_mx_inputs(case, device="cpu", seed=9)
    got = copy_allocations([args[i] for i in (2, 3, 6, 7)], "cpu")
    assert torch.equal(cpu[0].view(torch.uint8), before[0].view(torch.uint8))  # NaN-safe
    assert_matches_oracle(before, got)


def test_every_gpu_case_builds_on_the_cpu():
    """The GPU matrix's inputs (300 tokens) fit their caches at every block size: the cases are
    built here, where CI runs, not first on the GPU machine."""
    for case in MX_GPU_CASES:
        make_mx_inputs(case)
