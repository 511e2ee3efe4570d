"""reshape_and_cache_turboquant, turboquant_store, turboquant_gather_cache, turboquant_layout and
turboquant_tables (SPEC §10.1-10.2, §10.4): the reference against an independent per-(token,
head) oracle (NumPy float32 scalars and arrays: each operation one IEEE float32 rounding, trees
written out, the fp16 and e4m3fn encodings and the bit packing by hand) over every preset, head
sizes, layouts, slots and special rows; the tables against an independent re-implementation; the
slot sizes; the reader against its own oracle, the round trip within the bound and an attention
over the read-back cache; every implementation byte for byte against the reference (Triton's
interpreter on the CPU, all three on the GPU); validation; turboquant_store's mapping. Wrong
writers, bad input changing nothing, CUDA graphs and torch.compile: tests/test_conformance.py
(kvwrite.testing.providers.reshape_and_cache_turboquant)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.ops.reshape_and_cache_turboquant import OP
from kvwrite.ops.reshape_and_cache_turboquant import reference as torch_ref
from kvwrite.testing.compare import copy_allocations, storage_bytes
from kvwrite.testing.turboquant import (
    K3V4,
    K8V4,
    NC3,
    NC4,
    PRESETS,
    TqCase,
    assert_tq_caches_equal,
    canonical_nans,
    check_roundtrip,
    make_tq_inputs,
)

F32 = np.float32
HEAD_SIZES = (8, 16, 64, 128, 96)


# --- the oracle: one (token, head) at a time --------------------------------------------------

def np_tree(x: np.ndarray) -> np.ndarray:
    """Sum over axis 0 of float32 ``x`` in §7.1's tree: +0 leaves to a power of two, then
    neighbours, level by level (each addition one float32 rounding)."""
    n = x.shape[0]
    p = 1
    while p < n:
        p *= 2
    leaves = [x[i] for i in range(n)] + [np.zeros_like(x[0])] * (p - n)
    while len(leaves) > 1:
        leaves = [np.add(leaves[i], leaves[i + 1], dtype=F32) for i in range(0, len(leaves), 2)]
    return leaves[0]


def _e4m3_table() -> list[tuple[float, int]]:
    """(value, code) of every finite non-negative e4m3fn code, decoded by hand."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append((m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0**(e - 7), code))
    return out


E4M3 = _e4m3_table()


def e4m3_code(x: float) -> int:
    """§1.1 with no scale: nearest, ties to the even code, +-448 saturation (inf too), NaN 0x7F
    (any NaN code is allowed: the comparison makes them one), the sign of zero kept."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    best = min(E4M3, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return sign | best[1]


def fp16_bytes(x) -> bytes:
    """IEEE binary16 of a float32 (numpy's conversion: nearest even, overflow to inf,
    subnormals kept) as 2 little-endian bytes."""
    return np.array([np.float32(x)]).astype(np.float16).tobytes()


def pack(codes, bits: int) -> bytes:
    """Code i in bits [bits*i, bits*i + bits) of one little-endian integer."""
    n = sum(int(c) << (bits * i) for i, c in enumerate(codes))
    return n.to_bytes(-(-len(codes) * bits // 8), "little")


def rhu(q: float) -> float:
    if math.isinf(q):
        return q
    f = math.floor(q)
    return f + 1 if q - f >= 0.5 else f


def oracle_slot(k: np.ndarray, v: np.ndarray, preset: str, pit, midpoints) -> bytes:
    """The slot of one (token, head): ``k``, ``v`` float32 [D]."""
    slot = kvwrite.turboquant_layout(k.shape[0], preset)
    if slot.key_bits == 8:
        key = bytes(e4m3_code(float(x)) for x in k)
    else:
        ss = np_tree(np.multiply(k, k, dtype=F32))
        n = np.sqrt(F32(ss))  # IEEE square root, correctly rounded
        den = F32(n + F32(1e-8))
        u = np.divide(k, den, dtype=F32)
        y = np_tree(np.multiply(u[:, None], pit, dtype=F32))  # over i: y_j
        idx = [sum(1 for m in midpoints if not math.isnan(yj) and yj >= m) for yj in y]
        key = pack(idx, slot.key_bits) + fp16_bytes(n)
    assert len(key) == slot.key_packed_size
    finite = [float(x) for x in v if not math.isnan(x)]
    mn = F32(min(finite)) if finite else F32(0)
    mx = F32(max(finite)) if finite else F32(0)
    if mn == 0:
        mn = F32(0.0)
    levels = 2 ** slot.value_bits - 1
    s = F32(F32(mx - mn) / F32(levels))
    if not s > F32(1e-8):
        s = F32(1e-8)
    codes = []
    for x in v:
        q = F32(F32(x - mn) / s)
        q = 0.0 if math.isnan(q) else rhu(float(q))
        codes.append(int(min(max(q, 0), levels)))
    out = key + pack(codes, slot.value_bits) + fp16_bytes(s) + fp16_bytes(mn)
    assert len(out) == slot.slot_size
    return out


def oracle_write(inp) -> torch.Tensor:
    """The cache's whole allocation after the call, by the oracle: each written (token, head)'s
    slot bytes placed at the address the cache's strides give."""
    cache = inp.kv_cache
    out = storage_bytes(cache).clone().numpy()
    nb, bs, h, _ = cache.shape
    st = cache.stride()
    key = inp.key.float().numpy()
    value = inp.value.float().numpy()
    pit = None if inp.PiT is None else inp.PiT.numpy()
    mids = None if inp.midpoints is None else [F32(m) for m in inp.midpoints.tolist()]
    for t, s in enumerate(inp.slot_mapping.tolist()):
        if not 0 <= s < nb * bs:
            continue
        for head in range(h):
            with np.errstate(all="ignore"):  # inf - inf, overflow to inf: as IEEE says
                data = oracle_slot(key[t, head], value[t, head], inp.kv_cache_dtype, pit, mids)
            at = cache.storage_offset() + (s // bs) * st[0] + (s % bs) * st[1] + head * st[2]
            out[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(out)


def _oracle_cases() -> list[TqCase]:
    cases = []
    for p in PRESETS:
        for d in HEAD_SIZES:
            cases.append(TqCase(kv_cache_dtype=p, head_size=d, dtype=torch.float32,
                                special_values=True, num_tokens=12, num_heads=2,
                                padding_slots=1, out_of_range_slots=1))
        cases += [
            TqCase(kv_cache_dtype=p, head_size=16, layout="NHD", dtype=torch.bfloat16,
                   special_values=True, num_tokens=12, slot_dtype=torch.int32, row_pad=3),
            TqCase(kv_cache_dtype=p, head_size=16, dtype=torch.float16, special_values=True,
                   num_tokens=12, head_pad=5, extra_rows=2, pit_strided=True, own_tables=True),
            TqCase(kv_cache_dtype=p, head_size=32, num_tokens=6, block_size=4, num_blocks=2,
                   padding_slots=2, out_of_range_slots=2, magnitude=300.0),
        ]
    # Odd slot sizes: the pad byte of the aligned row is not written.
    cases += [TqCase(kv_cache_dtype=K8V4, head_size=10, special_values=True, num_tokens=12),
              TqCase(kv_cache_dtype=K3V4, head_size=8, special_values=True, num_tokens=12,
                     dtype=torch.float32)]
    return cases


ORACLE_CASES = _oracle_cases()


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c.id)
def test_reference_matches_the_oracle(case):
    inp = make_tq_inputs(case, seed=3)
    want = oracle_write(inp)
    kvwrite.reshape_and_cache_turboquant(*inp.args(), implementation="torch")
    got = storage_bytes(inp.kv_cache)
    # Which NaN k8v4's codes and the MSE norm hold is open: both made one.
    c = inp.kv_cache
    canonical_nans(c, case.slot)
    canonical_nans(want.as_strided(c.shape, c.stride(), c.storage_offset()), case.slot)
    diff = torch.nonzero(got != want).flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


def test_the_special_rows_store_what_the_spec_says():
    """SPEC §10.2's consequences, read from the slots of the 4-bit preset at D = 16."""
    d = 16
    inf, nan = float("inf"), float("nan")
    rows = {"zero": [0.0] * d, "nan": [nan] + [1.0] * (d - 1), "inf": [inf] + [1.0] * (d - 1),
            "overflow": [2.0**64] * d, "const": [3.0] * d, "vinf": [-inf] + [1.0] * (d - 1),
            "allinf": [inf] * d}
    key = torch.tensor(list(rows.values()))[:, None]
    pit, centroids, mids = kvwrite.turboquant_tables(d, NC4)
    slot = kvwrite.turboquant_layout(d, NC4)
    cache = torch.zeros(1, len(rows), 1, slot.slot_size, dtype=torch.uint8)
    kvwrite.reshape_and_cache_turboquant(key, key.clone(), cache, torch.arange(len(rows)), NC4,
                                         pit, mids)
    got = {name: cache[0, i, 0] for i, name in enumerate(rows)}

    def idx(r):
        return torch_ref.unpack_codes(r[:d // 2], 4, d).tolist()

    def f16(r, at):
        return struct.unpack("<e", bytes(r[at:at + 2].tolist()))[0]

    zero_idx = int((mids <= 0).sum())
    assert idx(got["zero"]) == [zero_idx] * d and f16(got["zero"], 8) == 0.0
    assert idx(got["nan"]) == [0] * d and math.isnan(f16(got["nan"], 8))
    assert idx(got["inf"]) == [0] * d and f16(got["inf"], 8) == inf
    assert idx(got["overflow"]) == [zero_idx] * d and f16(got["overflow"], 8) == inf
    vs, vz = slot.key_packed_size + slot.value_data_bytes, slot.key_packed_size + \
        slot.value_data_bytes + 2
    vcodes = slot.key_packed_size
    assert not got["const"][vcodes:vs].any()
    assert bytes(got["const"][vs:vs + 2].tolist()) == b"\x00\x00" and f16(got["const"], vz) == 3.0
    assert not got["vinf"][vcodes:vs].any()
    assert f16(got["vinf"], vs) == inf and f16(got["vinf"], vz) == -inf
    assert not got["allinf"][vcodes:vs].any()
    assert bytes(got["allinf"][vs:vs + 2].tolist()) == b"\x00\x00"


# --- the tables, the layout --------------------------------------------------------------------

def _lloyd_max_again(d: int, bits: int) -> list[float]:
    """SPEC §10.2's Lloyd-Max, written again (IEEE double): must give the same float32s."""
    var = 1.0 / d
    sd = math.sqrt(var)
    k = 2 ** bits
    a, b = -3.5 * sd, 3.5 * sd
    cents = [a + (b - a) * (i + 0.5) / k for i in range(k)]

    def density(x):
        return math.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)

    def integral(f, lo, hi):
        step = (hi - lo) / 200
        acc = 0.5 * (f(lo) + f(hi))
        for i in range(1, 200):
            acc += f(lo + i * step)
        return acc * step

    rounds = 0
    while rounds < 200:
        rounds += 1
        bounds = [3 * a] + [(cents[i] + cents[i + 1]) / 2 for i in range(k - 1)] + [3 * b]
        nxt = []
        for i in range(k):
            mass = integral(density, bounds[i], bounds[i + 1])
            if mass <= 1e-15:
                nxt.append(cents[i])
            else:
                nxt.append(integral(lambda x: x * density(x), bounds[i], bounds[i + 1]) / mass)
        if max(abs(x - y) for x, y in zip(nxt, cents, strict=True)) < 1e-10:
            break
        cents = nxt
    return cents


@pytest.mark.parametrize("d", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("preset", [NC4, K3V4, NC3])
def test_tables_match_an_independent_computation(d, preset):
    pit, centroids, mids = kvwrite.turboquant_tables(d, preset)
    bits = kvwrite.turboquant_layout(d, preset).key_bits
    assert pit.dtype == centroids.dtype == mids.dtype == torch.float32
    assert pit.shape == (d, d) and centroids.shape == (2**bits,) and mids.shape == (2**bits - 1,)
    # Sylvester: H[i, j] = (-1)^popcount(i & j), divided by sqrt(D) in float32.
    mag = np.float32(1.0) / np.float32(math.sqrt(d))
    i, j = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
    sign = np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i & j) == 1, -1, 1)
    assert np.array_equal(pit.numpy().view(np.uint32),
                          (sign * mag).astype(np.float32).view(np.uint32))
    want = np.array(_lloyd_max_again(d, bits), dtype=np.float32)
    assert np.array_equal(centroids.numpy().view(np.uint32), want.view(np.uint32))
    assert np.all(np.diff(want) > 0) and np.array_equal(want, -want[::-1])
    mid = np.array([np.float32(np.float32(want[k] + want[k + 1]) / np.float32(2))
                    for k in range(2**bits - 1)], dtype=np.float32)
    assert np.array_equal(mids.numpy().view(np.uint32), mid.view(np.uint32))


def test_hadamard_entries_at_128():
    pit, _, _ = kvwrite.turboquant_tables(128, NC4)
    bits = pit.view(torch.int32) & 0x7FFFFFFF
    assert bool((bits == 0x3DB504F3).all())
    assert int((pit > 0).sum()) == 128 * 64 + 64  # row 0 all positive, the others half


def test_tables_only_at_power_of_two_head_sizes():
    for d in (96, 24, 40):
        with pytest.raises(ValueError, match=r"^head_size: vLLM's TurboQuant tables exist only "
                                             r"for a power-of-two head size"):
            kvwrite.turboquant_tables(d, K3V4)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: expected one of"):
        kvwrite.turboquant_tables(128, "turboquant_2bit")
    assert kvwrite.turboquant_tables(128, K8V4) == (None, None, None)
    assert kvwrite.turboquant_tables(64, NC4, device="meta")[0].device.type == "meta"


def test_layout_sizes():
    """SPEC §10.1's table at D = 128, and the fields' rule at other head sizes."""
    got = {p: kvwrite.turboquant_layout(128, p) for p in PRESETS}
    assert [g.slot_size for g in got.values()] == [196, 134, 118, 102]
    assert [g.slot_size_aligned for g in got.values()] == [196, 134, 118, 102]
    assert got[K8V4] == (8, 4, False, 128, 64, 196, 196)
    assert got[NC4] == (4, 4, True, 66, 64, 134, 134)
    assert got[K3V4] == (3, 4, True, 50, 64, 118, 118)
    assert got[NC3] == (3, 3, True, 50, 48, 102, 102)
    assert isinstance(got[NC4], kvwrite.TurboQuantLayout) and got[NC4].key_packed_size == 66
    assert kvwrite.turboquant_layout(10, K8V4)[5:] == (19, 20)
    assert kvwrite.turboquant_layout(8, K3V4)[3:] == (5, 4, 13, 14)
    assert kvwrite.turboquant_layout(96, NC3)[3:] == (38, 36, 78, 78)
    for p, d in ((K8V4, 7), (NC4, 9), (K3V4, 12), (NC3, 4)):
        with pytest.raises(ValueError, match=r"^head_size: kv_cache_dtype="):
            kvwrite.turboquant_layout(d, p)
    for p in PRESETS:
        fmt = kvwrite.formats.lookup(p, kvwrite.formats.Family.TURBOQUANT)
        for d in (8, 16, 64, 128, 96):
            assert fmt.row_bytes(d) == kvwrite.turboquant_layout(d, p).slot_size


# --- the reader ---------------------------------------------------------------------------------

def oracle_read(row: bytes, preset: str, d: int, centroids, pit, unrotate: bool):
    slot = kvwrite.turboquant_layout(d, preset)
    if slot.key_bits == 8:
        table = {c: v for v, c in E4M3}
        key = []
        for b in row[:d]:
            mag = table.get(b & 0x7F, float("nan"))
            key.append(-mag if b & 0x80 else mag)
        key = np.array(key, dtype=F32)
    else:
        n = int.from_bytes(row[:-(-d * slot.key_bits // 8)], "little")
        idx = [(n >> (slot.key_bits * i)) & (2**slot.key_bits - 1) for i in range(d)]
        c = np.array([centroids[i] for i in idx], dtype=F32)
        if slot.norm_correction:
            w = np_tree(np.multiply(c, c, dtype=F32))
            r = F32(1) / np.sqrt(F32(w + F32(1e-16)))
            c = np.multiply(c, r, dtype=F32)
        at = slot.key_packed_size - 2
        norm = F32(np.frombuffer(row[at:at + 2], dtype=np.float16)[0])
        key = np.multiply(norm, c, dtype=F32)
        if unrotate:
            key = np_tree(np.multiply(key[:, None], pit.T, dtype=F32))
    v0 = slot.key_packed_size
    n = int.from_bytes(row[v0:v0 + slot.value_data_bytes], "little")
    q = [(n >> (slot.value_bits * i)) & (2**slot.value_bits - 1) for i in range(d)]
    at = v0 + slot.value_data_bytes
    scale = F32(np.frombuffer(row[at:at + 2], dtype=np.float16)[0])
    zero = F32(np.frombuffer(row[at + 2:at + 4], dtype=np.float16)[0])
    value = np.array([F32(F32(F32(x) * scale) + zero) for x in q], dtype=F32)
    return key, value


@pytest.mark.parametrize("unrotate", [True, False])
@pytest.mark.parametrize("preset", PRESETS)
def test_reader_matches_the_oracle(preset, unrotate):
    d = 16
    case = TqCase(kv_cache_dtype=preset, head_size=d, dtype=torch.float32, special_values=True,
                  num_tokens=24, num_heads=2, layout="NHD")
    inp = make_tq_inputs(case, seed=5)
    kvwrite.reshape_and_cache_turboquant(*inp.args())
    slots = torch.randint(0, case.num_slots, (9,), generator=torch.Generator().manual_seed(1))
    k, v = kvwrite.turboquant_gather_cache(inp.kv_cache, slots, preset, d, inp.centroids,
                                           inp.PiT, unrotate=unrotate)
    assert k.shape == v.shape == (9, 2, d) and k.dtype == v.dtype == torch.float32
    bs = case.block_size
    pit = None if inp.PiT is None else inp.PiT.numpy()
    cents = None if inp.centroids is None else inp.centroids.numpy()
    size = kvwrite.turboquant_layout(d, preset).slot_size
    for n, s in enumerate(slots.tolist()):
        for h in range(2):
            row = bytes(inp.kv_cache[s // bs, s % bs, h, :size].tolist())
            with np.errstate(all="ignore"):  # NaN and inf rows, as IEEE says
                wk, wv = oracle_read(row, preset, d, cents, pit, unrotate)
            for got, want in ((k[n, h].numpy(), wk), (v[n, h].numpy(), wv)):
                same = (got.view(np.uint32) == want.view(np.uint32)) | \
                    (np.isnan(got) & np.isnan(want))
                assert same.all(), (n, h, got, want)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_roundtrip_within_the_bound(preset, dtype):
    for d in (16, 128, 96):
        case = TqCase(kv_cache_dtype=preset, head_size=d, dtype=dtype, special_values=True,
                      num_tokens=40, num_heads=2, padding_slots=2, out_of_range_slots=1)
        inp = make_tq_inputs(case, seed=7)
        kvwrite.reshape_and_cache_turboquant(*inp.args())
        assert check_roundtrip(inp.key, inp.value, inp.kv_cache, inp.slot_mapping, preset,
                               inp.PiT, inp.midpoints, inp.centroids) is None


def test_roundtrip_check_catches_a_misread_cache():
    case = TqCase(kv_cache_dtype=NC4, head_size=64, num_tokens=20, dtype=torch.float32)
    inp = make_tq_inputs(case, seed=2)
    kvwrite.reshape_and_cache_turboquant(*inp.args())
    assert check_roundtrip(inp.key, inp.value, inp.kv_cache, inp.slot_mapping, NC4, inp.PiT,
                           inp.midpoints, inp.centroids) is None
    assert check_roundtrip(inp.key, inp.value.flip(-1), inp.kv_cache, inp.slot_mapping, NC4,
                           inp.PiT, inp.midpoints, inp.centroids) is not None
    assert check_roundtrip(inp.key.flip(-1), inp.value, inp.kv_cache, inp.slot_mapping, NC4,
                           inp.PiT, inp.midpoints, inp.centroids) is not None


def test_reader_refuses_slots_out_of_range():
    inp = make_tq_inputs(TqCase(kv_cache_dtype=NC4, head_size=16))
    for bad in (torch.tensor([0, -1]), torch.tensor([64])):
        with pytest.raises(ValueError, match=r"^slot_mapping: expected slots in \[0, "):
            kvwrite.turboquant_gather_cache(inp.kv_cache, bad, NC4, 16, inp.centroids, inp.PiT)
    with pytest.raises(ValueError, match=r"^centroids: expected shape \[2\^b\] = \[16\]"):
        kvwrite.turboquant_gather_cache(inp.kv_cache, torch.tensor([0]), NC4, 16, inp.midpoints,
                                        inp.PiT)
    with pytest.raises(ValueError, match=r"^PiT: kv_cache_dtype='turboquant_4bit_nc' rotates"):
        kvwrite.turboquant_gather_cache(inp.kv_cache, torch.tensor([0]), NC4, 16, inp.centroids)
    kvwrite.turboquant_gather_cache(inp.kv_cache, torch.tensor([0]), NC4, 16, inp.centroids,
                                    unrotate=False)
    with pytest.raises(ValueError, match=r"^kv_cache: expected a last dim S >= slot_size = 22"):
        kvwrite.turboquant_gather_cache(inp.kv_cache[..., :21], torch.tensor([0]), NC4, 16,
                                        inp.centroids, inp.PiT)


@pytest.mark.parametrize("preset", PRESETS)
def test_attention_over_the_read_back_cache(preset):
    """A consumer's view: scaled_dot_product_attention (GQA) over the keys and values read back
    stays within the format's error of attention over the original rows; a misread cache does
    not."""
    g = torch.Generator().manual_seed(11)
    t, hq, h, d = 64, 8, 2, 128
    q = torch.randn(1, hq, 8, d, generator=g)
    key = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    value = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    pit, centroids, mids = kvwrite.turboquant_tables(d, preset)
    size = kvwrite.turboquant_layout(d, preset).slot_size_aligned
    cache = torch.zeros(4, h, 16, size, dtype=torch.uint8).transpose(1, 2)
    slots = torch.randperm(64, generator=g)
    kvwrite.reshape_and_cache_turboquant(key, value, cache, slots, preset, pit, mids)

    def attend(k, v):
        k = k.float().permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
        v = v.float().permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    want = attend(key, value)
    gk, gv = kvwrite.turboquant_gather_cache(cache, slots, preset, d, centroids, pit)
    err = float((attend(gk, gv) - want).abs().max())
    dv = float((gv - value.float()).abs().max())
    dk = (gk - key.float()).permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
    dl = float((q @ dk.transpose(-1, -2)).abs().max()) / math.sqrt(d)
    bound = dv + float(value.float().abs().max()) * (math.exp(2 * dl) - 1)
    assert err <= bound, (err, bound)
    _, misread = kvwrite.turboquant_gather_cache(cache, slots.roll(1), preset, d, centroids, pit)
    assert float((attend(gk, misread) - want).abs().max()) > 2 * err
    if pit is not None:  # keys read without their rotation back are another thing
        rk, _ = kvwrite.turboquant_gather_cache(cache, slots, preset, d, centroids, pit,
                                                unrotate=False)
        assert float((attend(rk, gv) - want).abs().max()) > 2 * err


# --- every implementation against the reference ----------------------------------------------

IMPL_CASES = [TqCase(kv_cache_dtype=p, head_size=d, dtype=dt, special_values=True, num_tokens=24,
                     num_heads=2, padding_slots=2, out_of_range_slots=1, layout=lay)
              for p in PRESETS for d in (16, 128, 96)
              for dt, lay in ((torch.float32, "HND"), (torch.bfloat16, "NHD"))]


def _impl_params(gpu: bool):
    out = []
    for info in registry.all_impls(OP):
        if info.name == "torch":
            continue
        for c in IMPL_CASES:
            marks = (pytest.mark.gpu,) if gpu else ()
            out.append(pytest.param(info.name, c, marks=marks,
                                    id=f"{info.name}-{c.id}-{'cuda' if gpu else 'cpu'}"))
    return out


def _check_impl(name: str, case: TqCase, device: str) -> None:
    info = registry.get(OP, name)
    if (why := info.available(device)) is not None:
        pytest.skip(why)
    inp = make_tq_inputs(case, device, seed=4)
    want = copy_allocations((inp.kv_cache,))[0]
    args = list(inp.args())
    args[2] = want
    kvwrite.reshape_and_cache_turboquant(*args, implementation="torch")
    try:
        kvwrite.reshape_and_cache_turboquant(*inp.args(), implementation=name)
    except ValueError as e:
        if "cannot run this call" in str(e):
            pytest.skip(str(e))
        raise
    assert_tq_caches_equal(inp.kv_cache, want, case.slot)


@pytest.mark.parametrize(("impl", "case"), _impl_params(gpu=False))
def test_implementations_on_the_cpu(impl, case):
    _check_impl(impl, case, "cpu")


@pytest.mark.parametrize(("impl", "case"), _impl_params(gpu=True))
def test_implementations_on_the_gpu(impl, case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_impl(impl, case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_reference_on_the_gpu_writes_the_cpu_bytes(preset):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = TqCase(kv_cache_dtype=preset, head_size=128, dtype=torch.float32,
                  special_values=True, num_tokens=40, num_heads=4)
    cpu = make_tq_inputs(case, seed=9)
    gpu = make_tq_inputs(case, "cuda", seed=9)
    kvwrite.reshape_and_cache_turboquant(*cpu.args(), implementation="torch")
    kvwrite.reshape_and_cache_turboquant(*gpu.args(), implementation="torch")
    assert_tq_caches_equal(gpu.kv_cache.cpu(), cpu.kv_cache, case.slot)


# --- validation, turboquant_store ----------------------------------------------------------------

def test_k8v4_ignores_the_tables():
    case = TqCase(kv_cache_dtype=K8V4, head_size=16, special_values=True, num_tokens=24)
    a, b = make_tq_inputs(case), make_tq_inputs(case)
    kvwrite.reshape_and_cache_turboquant(*a.args())
    pit, _, mids = kvwrite.turboquant_tables(16, NC4)
    kvwrite.reshape_and_cache_turboquant(b.key, b.value, b.kv_cache, b.slot_mapping, K8V4, pit,
                                         mids)
    assert torch.equal(storage_bytes(a.kv_cache), storage_bytes(b.kv_cache))


def test_empty_slot_mapping_is_a_no_op():
    inp = make_tq_inputs(TqCase(kv_cache_dtype=NC3, head_size=16))
    before = storage_bytes(inp.kv_cache).clone()
    kvwrite.reshape_and_cache_turboquant(inp.key, inp.value, inp.kv_cache,
                                         inp.slot_mapping[:0], NC3, inp.PiT, inp.midpoints)
    assert torch.equal(storage_bytes(inp.kv_cache), before)


STORE = [(True, 4, 4, K8V4), (True, 3, 4, K8V4), (True, None, 4, K8V4), (False, 4, 4, NC4),
         (False, 3, 4, K3V4), (False, 3, 3, NC3)]


@pytest.mark.parametrize(("key_fp8", "mse_bits", "vbits", "preset"), STORE)
def test_turboquant_store_maps_to_the_preset(key_fp8, mse_bits, vbits, preset):
    case = TqCase(kv_cache_dtype=preset, head_size=64, special_values=True, num_tokens=24)
    a, b = make_tq_inputs(case), make_tq_inputs(case)
    kvwrite.reshape_and_cache_turboquant(*a.args())
    kps = kvwrite.turboquant_layout(64, preset).key_packed_size
    kvwrite.turboquant_store(b.key, b.value, b.kv_cache, b.slot_mapping, b.PiT, b.midpoints,
                             mse_bits, kps, vbits, key_fp8, kv_group_size=None)
    assert torch.equal(storage_bytes(a.kv_cache), storage_bytes(b.kv_cache))


@pytest.mark.parametrize(("change", "text"), [
    (dict(key_packed_size=66), r"^key_packed_size: expected 34, the key bytes of "
                               r"'turboquant_4bit_nc' at head_size 64, got 66"),
    (dict(kv_group_size=4), r"^kv_group_size: expected None or a size other than 4"),
    (dict(mse_bits=2), r"^mse_bits, value_quant_bits: expected \(key_fp8, mse_bits, "),
    (dict(value_quant_bits=3, key_fp8=True), r"^mse_bits, value_quant_bits: expected"),
    (dict(mse_bits=4, value_quant_bits=3), r"^mse_bits, value_quant_bits: expected"),
])
def test_turboquant_store_refuses(change, text):
    inp = make_tq_inputs(TqCase(kv_cache_dtype=NC4, head_size=64))
    before = storage_bytes(inp.kv_cache).clone()
    args = dict(key=inp.key, value=inp.value, kv_cache=inp.kv_cache,
                slot_mapping=inp.slot_mapping, PiT=inp.PiT, midpoints=inp.midpoints, mse_bits=4,
                key_packed_size=34, value_quant_bits=4, key_fp8=False, kv_group_size=None)
    with pytest.raises(ValueError, match=text):
        kvwrite.turboquant_store(**{**args, **change})
    assert torch.equal(storage_bytes(inp.kv_cache), before)


def test_turboquant_store_takes_other_group_sizes():
    for preset, group in ((NC3, 4), (NC4, 8), (K8V4, 4)):
        inp = make_tq_inputs(TqCase(kv_cache_dtype=preset, head_size=64))
        slot = inp.kv_cache_dtype
        layout = kvwrite.turboquant_layout(64, slot)
        kvwrite.turboquant_store(inp.key, inp.value, inp.kv_cache, inp.slot_mapping, inp.PiT,
                                 inp.midpoints, layout.key_bits if layout.key_bits != 8 else 3,
                                 layout.key_packed_size, layout.value_bits,
                                 layout.key_bits == 8, group)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_reader_on_the_gpu_reads_the_cpu_bits(preset):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = TqCase(kv_cache_dtype=preset, head_size=128, dtype=torch.float32,
                  special_values=True, num_tokens=40, num_heads=4)
    inp = make_tq_inputs(case, seed=9)
    kvwrite.reshape_and_cache_turboquant(*inp.args())
    slots = torch.arange(case.num_slots)
    want = kvwrite.turboquant_gather_cache(inp.kv_cache, slots, preset, 128, inp.centroids,
                                           inp.PiT)
    cuda = [None if t is None else t.cuda() for t in (inp.kv_cache, inp.centroids, inp.PiT)]
    got = kvwrite.turboquant_gather_cache(cuda[0], slots.cuda(), preset, 128, cuda[1], cuda[2])
    for g, w in zip(got, want, strict=True):
        g = g.cpu()
        assert bool(((g.view(torch.int32) == w.view(torch.int32)) |
                     (torch.isnan(g) & torch.isnan(w))).all())
