"""NVFP4 KV cache writes and readers (docs/ops/nvfp4.md): the group rule's reference against an
independent NumPy oracle (special groups, exact ties, the documented tie cases), the CUDA rule's
C code against the reference on the CPU (g++), every implementation byte for byte against the
reference over whole allocations (vLLM's page layout, NHD and HND, both V scale layouts,
FlashInfer's tuple / stacked / padded forms), readers and the allocator, validation, wrong
implementations caught, NVRTC compiles and the machine code; on the GPU the full matrix for the
three implementations, CUDA-graph replay and torch.compile.

On CPU this runs the torch reference and Triton's interpreter (exact here: the Triton kernel has
no float8 casts and widens bfloat16 from its bits); on a GPU (`gpu` marker) every implementation.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import CacheDType, parse_kv_cache_dtype
from kvwrite.ops.nvfp4 import OP, ScaleLayout, page_bytes
from kvwrite.ops.nvfp4 import op as nvfp4_op
from kvwrite.ops.nvfp4 import reference as torch_ref
from kvwrite.ops.nvfp4.rule import pack_codes, quantize_groups
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.compile import compiled_targets
from kvwrite.testing.nvfp4 import (
    NVFP4_CASES,
    NVFP4_GPU_CASES,
    Nvfp4Case,
    assert_storages_equal,
    clone_inputs,
    make_nvfp4_inputs,
    special_groups,
    tie_group_6_5,
)

IMPLS = [info.name for info in registry.all_impls(OP)]

# --- the independent oracle -----------------------------------------------------------------------
# Python floats and NumPy float32 scalars, step by step; E2M1 and E4M3 by their own tables.

F32 = np.float32
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_table() -> list[float]:
    """The 127 non-negative finite e4m3fn values by code (0x00 .. 0x7E), from the format."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = _e4m3_table()


def _nearest(table: list[float], v: float) -> int:
    """Index of the nearest table value to v >= 0 (exact: float32 values and the table are exact
    in float64), ties to the even index."""
    best = 0
    for i, t in enumerate(table):
        dt, db = abs(v - t), abs(v - table[best])
        if dt < db or (dt == db and i % 2 == 0 and best % 2 == 1):
            best = i
    return best


def oracle_e4m3(s: F32) -> int:
    s = float(s)
    assert not math.isnan(s) and s >= 0
    if s >= 448.0:
        return 0x7E
    return _nearest(E4M3, s)


def oracle_e2m1(v: F32) -> int:
    v = float(v)
    if math.isnan(v):
        return 0x7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    m = abs(v)
    return sign | (7 if m >= 6.0 else _nearest(E2M1_GRID, m))


def oracle_group(x, k: float, four_over_six: bool) -> tuple[list[int], int]:
    """(16 codes, S) of one group by the rule, one float32 operation at a time."""
    x = [F32(v) for v in x]
    k = F32(k)
    a = F32(0.0)
    for v in x:
        if not np.isnan(v) and abs(v) > a:
            a = F32(abs(v))

    def candidate(c: float):
        with np.errstate(all="ignore"):
            den = F32(F32(c) * k)
            s = F32(a / den)
            S = oracle_e4m3(s)
            d = F32(F32(E4M3[S]) * k)
            r = F32(0.0) if d == 0 else F32(F32(1.0) / d)
            return S, [oracle_e2m1(F32(v * r)) for v in x], d

    S, codes, d = candidate(6.0)
    if not four_over_six:
        return codes, S

    def error(cs, d):
        e = F32(0.0)
        with np.errstate(all="ignore"):
            for c, v in zip(cs, x, strict=True):
                val = F32(-E2M1_GRID[c & 7] if c & 8 else E2M1_GRID[c & 7])
                delta = F32(F32(val * d) - v)
                e = F32(e + F32(delta * delta))
        return e

    S4, codes4, d4 = candidate(4.0)
    if error(codes4, d4) < error(codes, d):
        return codes4, S4
    return codes, S


def oracle_bytes(x, k, four_over_six) -> tuple[bytes, int]:
    codes, S = oracle_group(x, k, four_over_six)
    return bytes(codes[2 * j] | codes[2 * j + 1] << 4 for j in range(8)), S


def _groups_tensor(groups, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(groups, dtype=torch.float32).to(dtype).float()


def _assert_groups_match(x: torch.Tensor, k: float, fos: bool):
    """quantize_groups against the oracle on every group of x [N, 16] (float32 values)."""
    codes, S = quantize_groups(x, k, fos)
    for i in range(x.shape[0]):
        want_codes, want_S = oracle_group(x[i].tolist(), k, fos)
        got = codes[i].tolist()
        assert (got, int(S[i])) == (want_codes, want_S), (
            f"group {i} {x[i].tolist()} k={k} 4over6={fos}: got codes {got} S {int(S[i]):#x}, "
            f"oracle {want_codes} S {want_S:#x}")


SCALES = [1.0, 2.0**-5, 0.003, 0.7, 0.1, 1 / 3, 2.0**-100, 2.0**100]


@pytest.mark.parametrize("fos", [False, True], ids=["nvfp4", "4over6"])
@pytest.mark.parametrize("k", SCALES)
def test_reference_matches_oracle_on_special_groups(k, fos):
    k = torch.tensor(k, dtype=torch.float32).item()
    _assert_groups_match(_groups_tensor(special_groups(k)), k, fos)


@pytest.mark.parametrize("fos", [False, True], ids=["nvfp4", "4over6"])
def test_reference_matches_oracle_on_random_groups(fos):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 16, generator=g) * torch.exp2(torch.randint(-12, 12, (300, 1),
                                                                     generator=g).float())
    x = x.to(torch.bfloat16).float()
    for k in (0.01, 2.0**-3, 0.37):
        _assert_groups_match(x, torch.tensor(k).item(), fos)


def test_documented_tie_cases():
    """k = 1, a = 11.25: x = 2.34375, 4.6875, 9.375 give codes 3, 5, 7 (2, 4, 6 by a true
    division), S = 1.875 (0x3F); reference, oracle, and the reciprocal's role shown."""
    x = _groups_tensor([tie_group_6_5()])
    codes, S = quantize_groups(x, 1.0)
    assert codes[0, 1:4].tolist() == [3, 5, 7] and int(S[0]) == 0x3F
    assert oracle_group(x[0].tolist(), 1.0, False)[0][1:4] == [3, 5, 7]
    assert [2.34375 / 1.875, 4.6875 / 1.875, 9.375 / 1.875] == [1.25, 2.5, 5.0]  # exact ties


def test_special_groups_give_the_documented_bytes():
    """All zero -> S 0x00, codes 0/8 by sign; s = 2^-10 -> S 0; a = inf -> S 0x7E, inf 0x7/0xF;
    NaN -> 0x7; saturating -> 0x7E; subnormal S."""
    k = 1.0
    g = {i: _groups_tensor([grp]) for i, grp in enumerate(special_groups(k))}

    def q(i):
        codes, S = quantize_groups(g[i], k)
        return codes[0].tolist(), int(S[0])

    assert q(0) == ([0] * 16, 0) and q(1) == ([8] * 16, 0) and q(2) == ([0, 8] * 8, 0)
    assert q(4)[1] < 0x08  # subnormal S
    assert q(5)[1] == 0x7E  # saturated
    assert q(6) == ([0] * 16, 0)  # s = 2^-10: a tie, to 0
    assert q(7)[1] == 0x01
    assert q(8)[1] == 0x38 and q(9)[1] == 0x3A and q(10)[1] == 0x02  # E4M3 ties to even
    codes, S = q(11)
    assert S == 0x38 and codes[1:8] == [0, 2, 2, 4, 4, 6, 6] and codes[8:15] == [8, 10, 10, 12, 12, 14, 14]
    assert q(13)[0][0] == 7 and q(14) == ([7] * 16, 0)
    assert q(15)[0][0] == 7  # -NaN: 0x7, no sign
    assert q(16)[1] == 0x7E and q(16)[0][:3] == [7, 0, 8]
    assert q(17)[0][0] == 0xF


# --- the CUDA rule's C code on the CPU (g++ -DKVWRITE_HOST_TEST) ---------------------------------

_HARNESS = r"""
#include "kvw/nvfp4.cuh"
extern "C" {
// n groups of 16 float32 values with scale k: 8 code bytes and S per group. pair: groups 2i and
// 2i+1 through nvfp4_group_pair (the kernel's path, fast and general), else nvfp4_group.
void kvw_nvfp4_groups(const float* x, float k, long long n, int fos, int pair,
                      unsigned char* data, unsigned char* scales) {
  const Fp8Scale d6 = make_fp8_scale(mul_rn(k, 6.0f)), d4 = make_fp8_scale(mul_rn(k, 4.0f));
  for (long long g = 0; g < n; g += (pair ? 2 : 1)) {
    float a[16], b[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = x[16 * g + i];
      b[i] = pair ? x[16 * (g + 1) + i] : 0.0f;
    }
    u32 oa[2], ob[2], sa, sb;
    if (pair) {
      if (fos) nvfp4_group_pair<true, 2>(a, b, k, k, d6, d4, d6, d4, oa, ob, &sa, &sb);
      else nvfp4_group_pair<false, 2>(a, b, k, k, d6, d4, d6, d4, oa, ob, &sa, &sb);
      __builtin_memcpy(data + 8 * g, oa, 8);
      __builtin_memcpy(data + 8 * (g + 1), ob, 8);
      scales[g] = sa;
      scales[g + 1] = sb;
    } else {
      sa = fos ? nvfp4_group<true, 2>(a, k, d6, d4, oa) : nvfp4_group<false, 2>(a, k, d6, d4, oa);
      __builtin_memcpy(data + 8 * g, oa, 8);
      scales[g] = sa;
    }
  }
}
// E2M1 by the thresholds (the rule's text), for every float32 bit pattern from lo to hi; one = 1
// (an argument, so that the compiler does not fold v * 1 to v and keep a signaling NaN).
long long kvw_nvfp4_sweep(unsigned lo, unsigned hi, float one, unsigned* first_bad) {
  long long bad = 0;
  for (unsigned long long b = lo; b <= hi; ++b) {
    const float v = bits_f32((u32)b);
    const float m = __builtin_fabsf(v);
    u32 want = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) +
               (m >= 3.5f) + (m > 5.0f);
    want |= (f32_bits(v) >> 28) & 8u;
    if (v != v) want = 7;
    u32 got = nvfp4_code(v, one);
    u32 fast = (f32_bits(nvfp4_e2m1_t(m)) & 7u) | ((f32_bits(v) >> 28) & 8u);
    if (got != want || (m < 7.0f && fast != want)) {
      if (bad == 0) *first_bad = (u32)b;
      ++bad;
    }
  }
  return bad;
}
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++) to build the rule harness")
    include = importlib.resources.files("kvwrite.kernels").joinpath("include")
    d = tmp_path_factory.mktemp("nvfp4host")
    (d / "harness.cpp").write_text(_HARNESS)
    lib = d / "libkvwnvfp4.so"
    # -ffp-contract=off: a*b stays a rounded product (no FMA), as mul.rn.f32 on the GPU.
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math",
                    "-Wno-unknown-pragmas", "-shared", "-fPIC", "-DKVWRITE_HOST_TEST",
                    f"-I{include}", str(d / "harness.cpp"), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.kvw_nvfp4_groups.restype = None
    so.kvw_nvfp4_sweep.restype = ctypes.c_longlong
    return so


def _host_groups(so, x: torch.Tensor, k: float, fos: bool, pair: bool):
    x = x.float().contiguous()
    n = x.shape[0]
    data = torch.zeros(n, 8, dtype=torch.uint8)
    sc = torch.zeros(n, dtype=torch.uint8)
    so.kvw_nvfp4_groups(ctypes.c_void_p(x.data_ptr()), ctypes.c_float(k), ctypes.c_longlong(n),
                        int(fos), int(pair), ctypes.c_void_p(data.data_ptr()),
                        ctypes.c_void_p(sc.data_ptr()))
    return data, sc


def _rule_groups(n: int, seed: int) -> torch.Tensor:
    """n random bfloat16 groups over many magnitudes, with special groups at both ends."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g) * torch.exp2(torch.randint(-24, 24, (n, 1),
                                                                   generator=g).float())
    x = x.to(torch.bfloat16).float()
    x[::97, 3] = float("nan")
    x[::89] = 0.0
    x[::83, :8] = -0.0
    x[::79, 5] = float("inf")
    x[::71, 2] = -float("inf")
    return x


@pytest.mark.parametrize("fos", [False, True], ids=["nvfp4", "4over6"])
def test_host_c_rule_matches_reference(host_lib, fos):
    """kvw/nvfp4.cuh's rule (one group, and the kernel's pair of groups with its fast path)
    against the reference, on random groups and every special group, for many scales."""
    for k in SCALES:
        k = torch.tensor(k, dtype=torch.float32).item()
        x = torch.cat([_rule_groups(4000, 1), _groups_tensor(special_groups(k))])
        if x.shape[0] % 2:
            x = torch.cat([x, x[:1]])
        codes, S = quantize_groups(x, k, fos)
        want = pack_codes(codes)
        for pair in (False, True):
            data, sc = _host_groups(host_lib, x, k, fos, pair)
            bad = torch.nonzero((data != want).any(1) | (sc != S)).flatten()
            assert bad.numel() == 0, (
                f"k={k} 4over6={fos} pair={pair}: {bad.numel()} groups differ; first "
                f"{x[bad[0]].tolist()}: got {data[bad[0]].tolist()} S {int(sc[bad[0]]):#x}, "
                f"want {want[bad[0]].tolist()} S {int(S[bad[0]]):#x}")


def test_host_e2m1_lines_equal_the_thresholds_on_every_float_near_the_grid(host_lib):
    """The kernel's E2M1 (three lines and their minimum) against the rule's thresholds on every
    float32 of [2^-3, 8] (every threshold and tie), within 2^16 ulps of each negative threshold,
    past 8, around inf and NaN (both signs), zero and subnormals; the fast path too where
    |v| < 7."""
    bad_at = ctypes.c_uint(0)
    ranges = [(0x3E000000, 0x41000000),  # [2^-3, 8]: every threshold and tie
              (0x41000000, 0x41100000), (0x7F700000, 0x7F900000),  # past 8; huge, inf, NaN
              (0xFF700000, 0xFF900000), (0x00000000, 0x00100000),  # -inf, -NaN; zero, subnormal
              (0x80000000, 0x80100000)]
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0):  # negatives near each threshold
        b = int(np.array(-t, dtype=np.float32).view(np.uint32))
        ranges.append((b - 65536, b + 65536))
    for lo, hi in ranges:
        n = host_lib.kvw_nvfp4_sweep(ctypes.c_uint(lo), ctypes.c_uint(hi), ctypes.c_float(1.0),
                                     ctypes.byref(bad_at))
        assert n == 0, f"{n} floats in [{lo:#x}, {hi:#x}] coded wrong, first {bad_at.value:#x}"


# --- whole allocations: the page-layout oracle and every implementation ---------------------------

def _scale_value(s) -> float:
    return float(s.reshape(-1)[0]) if isinstance(s, torch.Tensor) else float(s)


def page_oracle(inp) -> list[torch.Tensor]:
    """The expected allocations after the call, written token by token from the layout's text:
    vLLM's page (data byte rho*D/2 + j, scale byte bs*H*D/2 + rho(t', h)*D/16 + g', the 4-token
    swizzle for V where asked) or FlashInfer's [page, entry, head, byte] tensors."""
    case = inp.case
    exp = clone_tensors_cpu(inp)
    key, value = inp.key.cpu().float(), inp.value.cpu().float()
    slots = inp.slot_mapping.cpu().tolist()
    ks, vs = _scale_value(inp.k_scale), _scale_value(inp.v_scale)
    h_n, d = case.num_heads, case.head_size
    gs = d // 16
    nb, bs = case.num_blocks, case.block_size
    nhd = case.layout == "NHD"
    if case.form == "vllm":
        kc, vc = exp
        swz = case.v_scale_layout == "swizzled" or (
            case.v_scale_layout is None
            and nvfp4_op.default_v_scale_layout(inp.key.device) is ScaleLayout.SWIZZLED)
        sides = ((key, ks, kc, False), (value, vs, vc, swz))
    else:
        sides = (key, ks), (value, vs)
    for t, slot in enumerate(slots):
        if not 0 <= slot < nb * bs:
            continue
        b, off = divmod(slot, bs)
        for side, item in enumerate(sides):
            x, k = item[0], item[1]
            for h in range(h_n):
                for g in range(gs):
                    data, s = oracle_bytes(x[t, h, 16 * g:16 * g + 16].tolist(), k,
                                           case.four_over_six)
                    if case.form == "vllm":
                        cache, swizzled = item[2], item[3]
                        st = storage_bytes(cache)
                        base = cache.storage_offset() + b * cache.stride(0)

                        def rho(tt):
                            return tt * h_n + h if nhd else h * bs + tt

                        at = base + rho(off) * d // 2 + 8 * g
                        st[at:at + 8] = torch.tensor(list(data), dtype=torch.uint8)
                        tp, gp = off, g
                        if swizzled:
                            q = d // 64
                            tp, gp = 4 * (off // 4) + g // q, 4 * (g % q) + off % 4
                        st[base + bs * h_n * d // 2 + rho(tp) * gs + gp] = s
                    else:
                        data_t, sf_t = _fi_side(exp, case, side)
                        idx = (b, off, h) if nhd else (b, h, off)
                        data_t[idx][8 * g:8 * g + 8] = torch.tensor(list(data), dtype=torch.uint8)
                        sf_t.view(torch.uint8)[idx][g] = s
    return exp


def clone_tensors_cpu(inp) -> list[torch.Tensor]:
    return clone_inputs(inp, "cpu").tensors()


def _fi_side(exp: list[torch.Tensor], case: Nvfp4Case, side: int):
    """(data, scales) tensors of one side (0 = K, 1 = V) in FlashInfer's physical order."""
    if case.form == "stacked":
        return exp[0][:, side], exp[1][:, side]
    return exp[side], exp[2 + side]


@functools.cache
def expected(case: Nvfp4Case) -> list[torch.Tensor]:
    return page_oracle(make_nvfp4_inputs(case))


def _run(impl: str, case: Nvfp4Case, device: str):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_nvfp4_inputs(case, device)
    inp.call(implementation=impl)
    return inp


def test_matrix_covers_the_contract():
    cases = NVFP4_CASES
    assert {c.form for c in cases} == {"vllm", "tuple", "stacked", "padded"}
    assert {c.layout for c in cases} == {"NHD", "HND"}
    assert {c.v_scale_layout for c in cases if c.form == "vllm"} == {"linear", "swizzled", None}
    assert {c.kv_cache_dtype for c in cases} == {"nvfp4", "nvfp4_4over6"}
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16, torch.float32}
    assert {c.head_size for c in cases} >= {16, 48, 64, 80, 96, 128, 256}
    assert {c.block_size for c in cases} >= {1, 2, 3, 4, 5, 8, 16}
    assert any(c.qkv_slices for c in cases) and any(c.misaligned for c in cases)
    assert any(c.padding_slots and c.out_of_range_slots for c in cases)
    assert any(c.slot_dtype == torch.int32 for c in cases) and any(c.extra_rows for c in cases)
    assert any(c.scale_as_number for c in cases) and any(c.pad for c in cases)
    assert {c.num_tokens for c in cases} >= {0, 1, 7, 40}
    gpu = NVFP4_GPU_CASES
    assert {c.head_size for c in gpu} >= {16, 32, 48, 64, 80, 96, 112, 128, 144, 192, 256}
    assert {c.num_heads for c in gpu} >= {1, 2, 4, 5, 8, 16, 64}
    assert max(c.num_tokens for c in gpu) >= 16384


@pytest.mark.parametrize("case", NVFP4_CASES, ids=lambda c: c.id)
def test_reference_matches_page_oracle(case):
    inp = _run("torch", case, "cpu")
    assert_storages_equal(inp.tensors(), expected(case), f"{case.id}")


@pytest.mark.parametrize("case", NVFP4_CASES, ids=lambda c: c.id)
def test_triton_interpreter_matches_page_oracle(case):
    inp = _run("triton", case, "cpu")
    assert_storages_equal(inp.tensors(), expected(case), f"{case.id}")


def test_layout_oracle_by_hand():
    """One token, one head, D = 64, bs = 4, NHD, slot 6 (block 1, offset 2), V swizzled: the bytes
    where the layout's text puts them, nothing else moved."""
    case = Nvfp4Case(num_tokens=1, num_heads=1, head_size=64, block_size=4, num_blocks=2,
                     v_scale_layout="swizzled")
    inp = make_nvfp4_inputs(case)
    inp.slot_mapping.fill_(6)
    before = storage_bytes(inp.caches[0]).clone()
    inp.call("torch")
    after = storage_bytes(inp.caches[0])
    f = page_bytes(64)  # 36
    side = 4 * f        # 144 bytes a block side
    k0 = 2 * side       # block 1's K side
    changed = torch.nonzero(after != before).flatten().tolist()
    k_data = range(k0 + 2 * 32, k0 + 3 * 32)          # rho = 2: bytes 64..95
    k_sf = range(k0 + 128 + 2 * 4, k0 + 128 + 3 * 4)  # scales after 4 * 32 data bytes
    v0 = k0 + side
    v_data = range(v0 + 64, v0 + 96)
    # swizzle, t = 2, D/64 = 1: group g -> row g, byte 2 (4 * 0 + 2)
    v_sf = [v0 + 128 + g * 4 + 2 for g in range(4)]
    allowed = set(k_data) | set(k_sf) | set(v_data) | set(v_sf)
    assert set(changed) <= allowed
    codes, s = quantize_groups(inp.key[0, 0].reshape(4, 16), inp.k_scale)
    assert after[k0 + 64:k0 + 96].tolist() == pack_codes(codes).flatten().tolist()
    assert after[k0 + 136:k0 + 140].tolist() == s.tolist()
    codes, s = quantize_groups(inp.value[0, 0].reshape(4, 16), inp.v_scale)
    assert [int(after[i]) for i in v_sf] == s.tolist()


def test_flashinfer_form_equals_the_linear_page_layout():
    """The same inputs into vLLM's layout (V scales linear) and FlashInfer's tensors give the
    same data and scale bytes at every written (slot, head)."""
    base = dict(num_tokens=12, num_heads=3, head_size=64, block_size=8, num_blocks=3,
                special_values=True, padding_slots=1)
    v = make_nvfp4_inputs(Nvfp4Case(form="vllm", **base))
    f = make_nvfp4_inputs(Nvfp4Case(form="tuple", **base))
    v.call("torch")
    f.call("torch")
    (kd, ks, vd, vsf) = v.run_args()[2:6]
    (fkd, fks, fvd, fvsf) = f.run_args()[2:6]
    slots = v.slot_mapping[v.slot_mapping >= 0]
    b, o = slots // 8, slots % 8
    for a, c in ((kd, fkd), (ks, fks), (vd, fvd), (vsf, fvsf)):
        assert torch.equal(a[b, o], c[b, o])


def test_swizzle_is_a_permutation_within_four_tokens():
    """Every (t, g) of a 4-token tile lands on a distinct byte of the same tile, for D 64..256."""
    from kvwrite.ops.nvfp4.reference import swizzled_positions
    for d in (64, 128, 192, 256):
        gs = d // 16
        tp, gp = swizzled_positions(torch.arange(8), gs)
        pairs = {(int(a), int(b)) for a, b in zip(tp.flatten(), gp.flatten(), strict=True)}
        assert len(pairs) == 8 * gs
        assert all(4 * (t // 4) <= tp[t].min() and tp[t].max() < 4 * (t // 4) + 4
                   for t in range(8))
