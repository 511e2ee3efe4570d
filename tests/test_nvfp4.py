"""NVFP4 KV cache writes and readers (docs/ops/nvfp4.md): the group rule's reference against an
independent NumPy oracle (special groups, exact ties, the documented tie cases), the CUDA rule's
C code against the reference on the CPU (g++), every implementation byte for byte against the
reference over whole allocations (vLLM's page layout, NHD and HND, both V scale layouts,
FlashInfer's tuple / stacked / padded forms), readers and the allocator, validation specifics,
NVRTC compiles and the machine code, torch.compile of both entry points; on the GPU the full
matrix for the three implementations. Wrong writers, bad input and CUDA-graph replay:
tests/test_conformance.py (kvwrite.testing.providers.nvfp4_kv_write).

On CPU this runs the torch reference and Triton's interpreter (exact here: the Triton kernel has
no float8 casts and widens bfloat16 from its bits); on a GPU (`gpu` marker) every implementation.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.resources
import math
import re

import numpy as np
import pytest
import torch

import kvwrite
from host import RCP_RN_S2_C, build_host_lib, run_c, run_triton_script
from kvwrite import registry
from kvwrite.dtypes import CacheDType, parse_kv_cache_dtype
from kvwrite.ops.nvfp4 import OP, ScaleLayout, page_bytes
from kvwrite.ops.nvfp4 import op as nvfp4_op
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
from params import impl_names
from sass import MEMORY_OPS, needs_nvrtc, nvrtc_reason

IMPLS = impl_names(OP)

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
  const Nvfp4Den d6 = nvfp4_den(mul_rn(k, 6.0f)), d4 = nvfp4_den(mul_rn(k, 4.0f));
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
// n groups of 16 through the small calls' kernel's rule: each group as 16 / E parts of E elements
// (nvfp4_part_rule), their amax combined as the kernel's shuffles combine them (max_nan, and
// max_num where that is NaN; E = 16: the group's own). Returns the number of groups whose parts
// disagree on S.
}  // extern "C"
template <int E>
static long long parts(const float* x, float k, long long n, unsigned char* data,
                       unsigned char* scales) {
  const Nvfp4Den d6 = nvfp4_den(mul_rn(k, 6.0f));
  long long disagree = 0;
  for (long long g = 0; g < n; ++g) {
    const float* gx = x + 16 * g;
    float a = 0.0f, a_num = 0.0f;
    for (int p = 0; p < 16 / E; ++p) {
      float v[E];
      for (int i = 0; i < E; ++i) v[i] = gx[E * p + i];
      const float pa = nvfp4_amax_nan(v), pn = nvfp4_amax_num(v);
      a = p ? max_nan(a, pa) : pa;
      a_num = p ? max_num(a_num, pn) : pn;
    }
    u32 S0 = 0;
    for (int p = 0; p < 16 / E; ++p) {
      float v[E];
      u32 w[(E + 7) / 8];
      for (int i = 0; i < E; ++i) v[i] = gx[E * p + i];
      const u32 S = nvfp4_part_rule<E, 2>(v, a, a != a ? a_num : 0.0f, k, d6, w);
      __builtin_memcpy(data + 8 * g + (E / 2) * p, w, E / 2);
      if (p == 0) S0 = S;
      else if (S != S0) ++disagree;
    }
    scales[g] = S0;
  }
  return disagree;
}
extern "C" {
// The small calls' kernel's rule for n groups of 16 (parts<E> above) with e = 4, 8 or 16.
long long kvw_nvfp4_parts(const float* x, float k, long long n, int e, unsigned char* data,
                          unsigned char* scales) {
  if (e == 4) return parts<4>(x, k, n, data, scales);
  if (e == 8) return parts<8>(x, k, n, data, scales);
  return parts<16>(x, k, n, data, scales);
}
// n groups of 16 (16-bit values) through nvfp4_kv_kernel's rule, in pairs as its threads take a
// key's and a value's group (2i and 2i + 1; a last odd group alone): both groups'
// nvfp4_group_fast<1> from their nvfp4_amax_nan, then, where either needs it, both by
// nvfp4_group_rare<1>; the reciprocals computed (table = 0) or looked up in a table built as the
// kernel's TABLE build builds it (S = 0..0x7E; the entry 0x7F, a NaN amax's, holds a value here
// that would show in the bytes if a group kept it).
long long kvw_nvfp4_kv_groups(const float* x, float k, long long n, int table,
                              unsigned char* data, unsigned char* scales) {
  float tab[128];
  for (u32 S = 0; S < 127; ++S) tab[S] = nvfp4_scale_rcp(S, k);
  tab[127] = 1e30f;
  const Nvfp4Den d6 = nvfp4_den(mul_rn(k, 6.0f));
  const auto looked_up = [&](u32 c) { return tab[c & 127]; };
  const auto computed = [k](u32 c) { return nvfp4_scale_rcp(c, k); };
  for (long long g = 0; g < n; g += 2) {
    const int m = g + 1 < n ? 2 : 1;
    float v[2][16], a[2];
    u32 w[2][2], S[2];
    bool rare = false;
    for (int j = 0; j < m; ++j) {
      for (int i = 0; i < 16; ++i) v[j][i] = x[16 * (g + j) + i];
      a[j] = nvfp4_amax_nan(v[j]);
      rare |= table ? nvfp4_group_fast<1>(v[j], a[j], d6, looked_up, w[j], &S[j])
                    : nvfp4_group_fast<1>(v[j], a[j], d6, computed, w[j], &S[j]);
    }
    for (int j = 0; j < m; ++j) {
      if (rare) {
        S[j] = table ? nvfp4_group_rare<1>(v[j], a[j], d6, looked_up, w[j])
                     : nvfp4_group_rare<1>(v[j], a[j], d6, computed, w[j]);
      }
      __builtin_memcpy(data + 8 * (g + j), w[j], 8);
      scales[g + j] = S[j];
    }
  }
  return 0;
}
// nvfp4_amax_nan16 (bfloat16 words) against nvfp4_amax_nan of the widened floats for n groups of
// 8 words: the number that differ (NaN equals NaN), the first in *first_bad.
long long kvw_nvfp4_amax16(const unsigned* w, long long n, long long* first_bad) {
  long long bad = 0;
  for (long long g = 0; g < n; ++g) {
    u32 words[8];
    float x[16];
    for (int i = 0; i < 8; ++i) words[i] = w[8 * g + i];
    for (int i = 0; i < 16; ++i) x[i] = bits_f32(i & 1 ? words[i >> 1] & 0xFFFF0000u
                                                       : words[i >> 1] << 16);
    const float got = nvfp4_amax_nan16<true>(words), want = nvfp4_amax_nan(x);
    if (!(got == want || (got != got && want != want)) || f32_bits(got) >> 31) {
      if (bad == 0) *first_bad = g;
      ++bad;
    }
  }
  return bad;
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
    so = build_host_lib(tmp_path_factory, _HARNESS, "kvwnvfp4", "rule harness")
    so.kvw_nvfp4_groups.restype = None
    so.kvw_nvfp4_sweep.restype = ctypes.c_longlong
    so.kvw_nvfp4_parts.restype = ctypes.c_longlong
    so.kvw_nvfp4_amax16.restype = ctypes.c_longlong
    so.kvw_nvfp4_kv_groups.restype = ctypes.c_longlong
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


@pytest.mark.parametrize("e", [4, 8, 16])
def test_host_c_part_rule_matches_reference(host_lib, e):
    """The small and mid-sized calls' kernel's rule (kvw/nvfp4.cuh's nvfp4_part_rule: a group as
    16 / e parts, their amax combined as the kernel's shuffles do; e = 16, the mid-sized calls'
    default: the whole group in one thread) against the reference, random and special groups,
    many scales; every part computes the same S."""
    for k in SCALES:
        k = torch.tensor(k, dtype=torch.float32).item()
        x = torch.cat([_rule_groups(2000, 2), _groups_tensor(special_groups(k))]).float()
        x = x.contiguous()
        codes, S = quantize_groups(x, k, False)
        want = pack_codes(codes)
        n = x.shape[0]
        data = torch.zeros(n, 8, dtype=torch.uint8)
        sc = torch.zeros(n, dtype=torch.uint8)
        disagree = host_lib.kvw_nvfp4_parts(ctypes.c_void_p(x.data_ptr()), ctypes.c_float(k),
                                            ctypes.c_longlong(n), e,
                                            ctypes.c_void_p(data.data_ptr()),
                                            ctypes.c_void_p(sc.data_ptr()))
        assert disagree == 0, f"k={k} e={e}: {disagree} groups whose parts disagree on S"
        bad = torch.nonzero((data != want).any(1) | (sc != S)).flatten()
        assert bad.numel() == 0, (
            f"k={k} e={e}: {bad.numel()} groups differ; first {x[bad[0]].tolist()}: got "
            f"{data[bad[0]].tolist()} S {int(sc[bad[0]]):#x}, want {want[bad[0]].tolist()} S "
            f"{int(S[bad[0]]):#x}")


@pytest.mark.parametrize("table", [False, True], ids=["computed", "table"])
@pytest.mark.parametrize("pairs", ["apart", "mixed"])
def test_host_c_kv_rule_matches_reference(host_lib, table, pairs):
    """The wide calls' kernel's rule (nvfp4_kv_kernel: kvw/nvfp4.cuh's nvfp4_group_fast for a
    key's and a value's group, then nvfp4_group_rare for both where either needs it; one
    quotient correction, as for 16-bit inputs) with its reciprocals computed or from the per-CTA
    table, against the reference: random and special bfloat16 groups, many scales. "mixed" pairs
    each special group (most take the rare path) with a random one (the fast path's), so the
    general path also writes groups whose fast path held."""
    for k in SCALES:
        k = torch.tensor(k, dtype=torch.float32).item()
        rand, special = _rule_groups(2000, 3), _groups_tensor(special_groups(k))
        if pairs == "mixed":
            n = special.shape[0]
            x = torch.cat([torch.stack([special, rand[:n]], 1).flatten(0, 1), rand[n:]])
        else:
            x = torch.cat([rand, special])
        x = x.to(torch.bfloat16).float().contiguous()
        codes, S = quantize_groups(x, k, False)
        want = pack_codes(codes)
        n = x.shape[0]
        data = torch.zeros(n, 8, dtype=torch.uint8)
        sc = torch.zeros(n, dtype=torch.uint8)
        host_lib.kvw_nvfp4_kv_groups(ctypes.c_void_p(x.data_ptr()), ctypes.c_float(k),
                                     ctypes.c_longlong(n), int(table),
                                     ctypes.c_void_p(data.data_ptr()),
                                     ctypes.c_void_p(sc.data_ptr()))
        bad = torch.nonzero((data != want).any(1) | (sc != S)).flatten()
        assert bad.numel() == 0, (
            f"k={k} table={table}: {bad.numel()} groups differ; first {x[bad[0]].tolist()}: got "
            f"{data[bad[0]].tolist()} S {int(sc[bad[0]]):#x}, want {want[bad[0]].tolist()} S "
            f"{int(S[bad[0]]):#x}")


def test_host_amax16_equals_the_float_amax(host_lib):
    """nvfp4_amax_nan16's rule (sign bits cleared, the largest 16-bit pattern; the host build's
    loop, the device's SIMD maximum computes the same) equals the float amax with NaN propagated
    on every bfloat16 pattern (each group: one pattern beside random ones) and on groups of
    infinities, NaNs, zeros and subnormals."""
    g = torch.Generator().manual_seed(5)
    every = torch.arange(65536, dtype=torch.int64)
    rest = torch.randint(0, 65536, (65536, 15), generator=g)
    halves = torch.cat([every[:, None], rest], 1)[:, torch.randperm(16, generator=g)]
    special = torch.tensor([[0x7F80] * 16, [0xFF80] * 16, [0x7FC0] + [0] * 15, [0x8000] * 16,
                            [1] * 16, [0x8001, 0x7F7F] + [0] * 14, [0xFFFF] * 16])
    halves = torch.cat([halves, special])
    words = (halves[:, 0::2] | (halves[:, 1::2] << 16)).to(torch.int64)
    words = words.numpy().astype(np.uint32)
    words = np.ascontiguousarray(words)
    first = ctypes.c_longlong(-1)
    bad = host_lib.kvw_nvfp4_amax16(words.ctypes.data_as(ctypes.c_void_p),
                                    ctypes.c_longlong(words.shape[0]), ctypes.byref(first))
    assert bad == 0, f"{bad} groups differ, first {halves[first.value].tolist()}"


# nvfp4_rcp_rn's steps in C (as tests/test_fp8_division.py checks them on [2^-22, 4)): the
# device's rcp_rn_s2 arithmetic applied to d itself, from every approximation within 4 ulp of
# 1/d, on every binade of d in [2^-109, 2^109) (every 997th significand, the all-ones one and
# 1.0), against the host's 1.0f / d (IEEE RN).
_RCP_C = RCP_RN_S2_C + r"""
static long n, bad, raw_bad;
static void check(float d) {
  const float want = 1.0f / d;
  for (int k = -4; k <= 4; ++k) {
    const float r0 = f(u(want) + k);
    bad += u(rcp_rn_s2_steps(d, r0)) != u(want);
    const float r = fmaf(r0, fmaf(-d, r0, 1.0f), r0);
    raw_bad += u(fmaf(r, fmaf(-d, r, 1.0f), r)) != u(want);
    ++n;
  }
}
int main(void) {
  for (uint32_t e = 127u - 109u; e < 127u + 109u; ++e) {
    for (uint32_t m = 0; m < (1u << 23); m += 997u) check(f((e << 23) | m));
    check(f((e << 23) | 0x7FFFFFu));
  }
  printf("%ld %ld %ld\n", n, bad, raw_bad);
  return 0;
}
"""


def test_reciprocal_steps_on_every_binade_of_d(tmp_path):
    """nvfp4_rcp_rn applies rcp_rn_s2's steps to d itself: RN(1/d) from every approximation
    within 4 ulp on every binade d can take; without the all-ones fix the steps miss (so the
    check can fail)."""
    n, bad, raw_bad = (int(v) for v in run_c(tmp_path, "rcp", _RCP_C).split())
    assert n == 9 * 218 * (-(-(2**23) // 997) + 1)
    assert bad == 0
    assert raw_bad > 0


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

                        def rho(tt, h=h):
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


# --- readers ----------------------------------------------------------------------------------------

def _roundtrip_inputs(layout="NHD", v_layout="swizzled", head_size=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    t, h = 24, 4
    key = (torch.randn(t, h, head_size, generator=g) * 3).to(dtype)
    value = torch.randn(t, h, head_size, generator=g).to(dtype)
    kc, vc = kvwrite.create_kv_caches_with_random_flash(8, 16, 1, h, head_size, "nvfp4", seed=1,
                                                        device="cpu", cache_layout=layout)
    slots = torch.randperm(128, generator=g)[:t]
    # Scales that keep every group's S a normal e4m3 value (no saturation, no coarse subnormal).
    ks = (key.float().abs().amax() / (6 * 256)).reshape(1)
    vs = (value.float().abs().amax() / (6 * 256)).reshape(1)
    kvwrite.reshape_and_cache_flash(key, value, kc[0], vc[0], slots, "nvfp4", ks, vs,
                                    v_scale_layout=v_layout)
    return key, value, kc[0], vc[0], slots, ks, vs


def _half_step_bound(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 step at |x|/d times d, per element, with d = float(S) * k of its group."""
    groups = x.float().reshape(-1, 16)
    _, s = quantize_groups(groups, k)
    d = (s.view(torch.float8_e4m3fn).float() * k.float())[:, None]
    y = groups.abs() / d
    half = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    return (half * d * (1 + 2.0**-20)).reshape(x.shape)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("v_layout", ["linear", "swizzled"])
def test_gather_round_trip_within_half_a_step(layout, v_layout):
    key, value, kc, vc, slots, ks, vs = _roundtrip_inputs(layout, v_layout)
    gk = kvwrite.nvfp4_gather_cache(kc, slots, ks)
    gv = kvwrite.nvfp4_gather_cache(vc, slots, vs, scale_layout=v_layout)
    for x, got, k in ((key, gk, ks), (value, gv, vs)):
        err = (got - x.float()).abs()
        bound = _half_step_bound(x, k)
        assert bool((err <= bound).all()), float((err - bound).max())
    # The wrong scale layout reads other scales: not within the bound.
    other = "linear" if v_layout == "swizzled" else "swizzled"
    wrong = kvwrite.nvfp4_gather_cache(vc, slots, vs, scale_layout=other)
    assert not bool(((wrong - value.float()).abs() <= _half_step_bound(value, vs)).all())


def test_gather_skipped_rows_are_zero_and_dtypes():
    key, value, kc, vc, slots, ks, vs = _roundtrip_inputs()
    s = slots.clone()
    s[3] = -1
    s[5] = 10**6
    g = kvwrite.nvfp4_gather_cache(kc, s, float(ks), output_dtype=torch.bfloat16)
    assert g.dtype == torch.bfloat16 and g.shape == key.shape
    assert not g[3].any() and not g[5].any()
    full = kvwrite.nvfp4_gather_cache(kc, s, ks)
    assert torch.equal(g, full.to(torch.bfloat16))
    assert kvwrite.nvfp4_gather_cache(kc, s.int(), ks).equal(full)


def test_gather_keeps_negative_zero():
    case = Nvfp4Case(num_tokens=1, num_heads=1, head_size=16, block_size=1, num_blocks=1)
    inp = make_nvfp4_inputs(case)
    inp.key.fill_(-0.0)
    inp.slot_mapping.fill_(0)
    inp.call("torch")
    got = kvwrite.nvfp4_gather_cache(inp.caches[0], inp.slot_mapping, inp.k_scale)
    assert bool(torch.signbit(got).all()) and not got.any()


def test_attention_over_the_gathered_cache():
    """A consumer's view: scaled_dot_product_attention over the gathered K/V (GQA) stays within
    the format's error of attention over the original rows; a misread cache does not."""
    g = torch.Generator().manual_seed(11)
    t, hq, h, d = 64, 8, 2, 128
    q = torch.randn(1, hq, 8, d, generator=g)
    key = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    value = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    kc, vc = kvwrite.create_kv_caches_with_random_flash(4, 16, 1, h, d, "nvfp4", seed=2,
                                                        device="cpu", cache_layout="HND")
    slots = torch.randperm(64, generator=g)
    ks = (key.float().abs().amax() / (6 * 448)).reshape(1)
    vs = torch.tensor([value.float().abs().amax() / (6 * 448)])
    kvwrite.reshape_and_cache_flash(key, value, kc[0], vc[0], slots, "nvfp4", ks, vs)

    def attend(k, v):
        k = k.float().permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
        v = v.float().permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    want = attend(key, value)
    gk = kvwrite.nvfp4_gather_cache(kc[0], slots, ks)
    gv = kvwrite.nvfp4_gather_cache(vc[0], slots, vs, scale_layout="swizzled")
    err = float((attend(gk, gv) - want).abs().max())
    # The format's error carried through: the values' largest error, plus what the logits'
    # largest error can move a softmax-weighted average of values.
    dv = float((gv - value.float()).abs().max())
    dk = (gk - key.float()).permute(1, 0, 2)[None].repeat_interleave(hq // h, dim=1)
    dl = float((q @ dk.transpose(-1, -2)).abs().max()) / math.sqrt(d)
    bound = dv + float(value.float().abs().max()) * (math.exp(2 * dl) - 1)
    assert err <= bound and err < 0.2, (err, bound)
    for misread in (kvwrite.nvfp4_gather_cache(vc[0], slots, vs, scale_layout="linear"),
                    kvwrite.nvfp4_gather_cache(vc[0], slots.roll(1), vs,
                                               scale_layout="swizzled")):
        assert float((attend(gk, misread) - want).abs().max()) > 2 * err


@pytest.mark.parametrize("fos", [False, True])
def test_kv_quantize_and_dequantize(fos):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 64, generator=g) * 4).to(torch.bfloat16)
    x[0, :16] = 0.0
    x[1, 3] = float("nan")
    fp4, sc = kvwrite.nvfp4_kv_quantize(x, 0.01, four_over_six=fos)
    assert fp4.shape == (6, 32) and sc.shape == (6, 4)
    assert fp4.dtype == sc.dtype == torch.uint8
    k = torch.tensor(0.01, dtype=torch.float32).item()
    for r in range(6):
        for grp in range(4):
            data, s = oracle_bytes(x[r, 16 * grp:16 * grp + 16].float().tolist(), k, fos)
            assert bytes(fp4[r, 8 * grp:8 * grp + 8].tolist()) == data and int(sc[r, grp]) == s
    assert torch.equal(kvwrite.nvfp4_kv_quantize(x, torch.tensor([0.01]), four_over_six=fos)[0],
                       fp4)
    out = kvwrite.nvfp4_kv_dequantize(fp4, sc, 0.01, output_dtype=torch.float32)
    # Each element by hand: value(c) * float(S) * k, one rounding.
    codes = torch.stack([fp4 & 15, fp4 >> 4], dim=-1).reshape(6, 64).tolist()
    for r in range(6):
        for i in range(64):
            c = codes[r][i]
            val = (-1 if c & 8 else 1) * E2M1_GRID[c & 7]
            s = E4M3[int(sc[r, i // 16])]
            want = F32(F32(val * s) * F32(k))
            assert np.float32(out[r, i].item()).tobytes() == want.tobytes(), (r, i)
    bf = kvwrite.nvfp4_kv_dequantize(fp4, sc.view(torch.float8_e4m3fn), torch.tensor(0.01))
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.to(torch.bfloat16))


def test_kv_quantize_equals_the_cache_bytes():
    """nvfp4_kv_quantize's rows are the bytes the FlashInfer form stores for those rows."""
    case = Nvfp4Case(form="tuple", num_tokens=5, num_heads=2, head_size=64, block_size=4,
                     num_blocks=2, scale_as_number=True)
    inp = make_nvfp4_inputs(case)
    inp.call("torch")
    fp4, sc = kvwrite.nvfp4_kv_quantize(inp.key.reshape(5 * 2, 64), case.k_scale)
    (kd, _), (ksf, _) = inp.caches
    for t, slot in enumerate(inp.slot_mapping.tolist()):
        if 0 <= slot < 8:
            assert torch.equal(kd[slot // 4, slot % 4].reshape(2, 32), fp4[2 * t:2 * t + 2])
            assert torch.equal(ksf[slot // 4, slot % 4].view(torch.uint8), sc[2 * t:2 * t + 2])


@pytest.mark.parametrize("call, exc, text", [
    (lambda: kvwrite.nvfp4_kv_quantize(torch.zeros(2, 40), 1.0), ValueError, "input: expected K a positive multiple of 16"),
    (lambda: kvwrite.nvfp4_kv_quantize(torch.zeros(2, 32), -1.0), ValueError, "global_scale: expected a positive finite number"),
    (lambda: kvwrite.nvfp4_kv_quantize(torch.zeros(2, 32), torch.ones(2)), ValueError, "global_scale: expected exactly one element"),
    (lambda: kvwrite.nvfp4_kv_quantize(torch.zeros(2, 32, dtype=torch.int32), 1.0), ValueError, "input: expected dtype"),
    (lambda: kvwrite.nvfp4_kv_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), 1.0), ValueError, "block_scales: expected shape (2, 2)"),
    (lambda: kvwrite.nvfp4_kv_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), 1.0, torch.int8), ValueError, "output_dtype"),
    (lambda: kvwrite.nvfp4_gather_cache(torch.zeros(2, 4, 1, 40, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), 1.0), ValueError, "cache: expected a last dim F = D/2 + D/16"),
    (lambda: kvwrite.nvfp4_gather_cache(torch.zeros(2, 6, 1, 36, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), 1.0, scale_layout="swizzled"), ValueError, "scale_layout: 'swizzled' needs block_size % 4 == 0"),
    (lambda: kvwrite.nvfp4_gather_cache(torch.zeros(2, 4, 1, 36, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), 1.0, scale_layout="tiled"), ValueError, "scale_layout: expected None, 'linear' or 'swizzled'"),
    (lambda: kvwrite.nvfp4_gather_cache(torch.zeros(2, 4, 1, 36, dtype=torch.uint8), torch.zeros(1), 1.0), ValueError, "slot_mapping: expected dtype int64 or int32"),
], ids=["quantize-K", "quantize-scale", "quantize-scale-numel", "quantize-dtype",
        "dequantize-scales-shape", "dequantize-output-dtype", "gather-F", "gather-swizzle",
        "gather-layout", "gather-slots"])
def test_reader_errors(call, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        call()


# --- the allocator ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", ["nvfp4", "nvfp4_4over6"])
def test_allocator_pages(layout, kv):
    kc, vc = kvwrite.create_kv_caches_with_random_flash(5, 16, 2, 4, 128, kv, seed=3,
                                                        device="cpu", cache_layout=layout)
    f = page_bytes(128)
    assert len(kc) == len(vc) == 2 and f == 72
    for k, v in zip(kc, vc, strict=True):
        assert k.shape == v.shape == (5, 16, 4, f) and k.dtype == torch.uint8
        assert v.data_ptr() - k.data_ptr() == 16 * 4 * f
        assert k.stride() == ((2 * 16 * 4 * f, 4 * f, f, 1) if layout == "NHD"
                              else (2 * 16 * 4 * f, f, 16 * f, 1))
        nvfp4_op.flash_run_args(torch.zeros(1, 4, 128), torch.zeros(1, 4, 128), k, v,
                                torch.zeros(1, dtype=torch.long), kv, torch.ones(1),
                                torch.ones(1))  # the write accepts them
    again = kvwrite.create_kv_caches_with_random_flash(5, 16, 2, 4, 128, kv, seed=3,
                                                       device="cpu", cache_layout=layout)
    other = kvwrite.create_kv_caches_with_random_flash(5, 16, 2, 4, 128, kv, seed=4,
                                                       device="cpu", cache_layout=layout)
    assert torch.equal(storage_bytes(kc[1]), storage_bytes(again[0][1]))
    assert not torch.equal(storage_bytes(kc[0]), storage_bytes(other[0][0]))


def test_allocator_needs_a_multiple_of_16():
    with pytest.raises(ValueError, match="head_size: the NVFP4 cache dtypes need a positive "
                                         "multiple of 16, got 40"):
        kvwrite.create_kv_caches_with_random_flash(1, 16, 1, 1, 40, "nvfp4", device="cpu")


# --- the cache dtype: only where it is written --------------------------------------------------------

def test_nvfp4_spellings_parse_only_where_written():
    assert parse_kv_cache_dtype("nvfp4", nvfp4=True) is CacheDType.NVFP4
    assert parse_kv_cache_dtype("nvfp4_4over6", nvfp4=True) is CacheDType.NVFP4_4OVER6
    for kv in ("nvfp4", CacheDType.NVFP4_4OVER6):
        with pytest.raises(ValueError, match="written by reshape_and_cache_flash only"):
            parse_kv_cache_dtype(kv)
    assert CacheDType.NVFP4.is_nvfp4 and not CacheDType.NVFP4.is_fp8
    with pytest.raises(ValueError, match="no per-element dtype"):
        CacheDType.NVFP4.element_dtype(torch.bfloat16)


def test_the_seed_benchmark_does_not_offer_nvfp4(capsys):
    """The seed benchmark's --kv-cache-dtype stays vLLM's list, and run_benchmark (vLLM's
    function) refuses the NVFP4 spellings: its per-element cases have no NVFP4 form."""
    from kvwrite.bench import cli, run_benchmark
    with pytest.raises(SystemExit):
        cli.main(["--device", "cpu", "--kv-cache-dtype", "nvfp4"])
    assert "invalid choice: 'nvfp4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        run_benchmark(2, 2, 64, 16, 8, torch.bfloat16, "nvfp4", "NHD", 1, "torch", "no_graph",
                      device="cpu")


def test_other_ops_refuse_nvfp4():
    key = torch.zeros(2, 1, 16)
    cache = torch.zeros(2, 16, 1, 16)
    with pytest.raises(ValueError, match="v_scale_layout: only the NVFP4 modes"):
        kvwrite.reshape_and_cache_flash(key, key, cache, cache.clone(),
                                        torch.zeros(2, dtype=torch.long), "auto",
                                        v_scale_layout="linear")
    cos_sin = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kvwrite.fused_rope_and_reshape_cache_flash(
            torch.zeros(2, 1, 16), key, key, torch.zeros(2, dtype=torch.long), cos_sin, True,
            cache.to(torch.uint8), cache.to(torch.uint8), torch.zeros(2, dtype=torch.long),
            "nvfp4", torch.ones(1), torch.ones(1))


def test_named_implementation_and_zero_tokens():
    inp = make_nvfp4_inputs(Nvfp4Case(num_tokens=3))
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call"):
        inp.call("cuda")
    with pytest.raises(ValueError, match="implementation: expected one of"):
        inp.call("vllm")
    zero = make_nvfp4_inputs(Nvfp4Case(num_tokens=0, extra_rows=3))
    before = [storage_bytes(t).clone() for t in zero.tensors()]
    zero.call()
    assert all(torch.equal(storage_bytes(t), b) for t, b in zip(zero.tensors(), before,
                                                                 strict=True))


def test_default_v_scale_layout_rule():
    assert nvfp4_op.default_v_scale_layout("cpu") is ScaleLayout.SWIZZLED
    nvfp4_op._capability_major.cache_clear()
    try:
        for major, want in ((8, ScaleLayout.SWIZZLED), (9, ScaleLayout.SWIZZLED),
                            (10, ScaleLayout.SWIZZLED), (12, ScaleLayout.LINEAR)):
            nvfp4_op._capability_major.cache_clear()
            orig = torch.cuda.get_device_capability
            torch.cuda.get_device_capability = lambda i, m=major: (m, 0)
            try:
                assert nvfp4_op.default_v_scale_layout("cuda:0") is want
            finally:
                torch.cuda.get_device_capability = orig
    finally:
        nvfp4_op._capability_major.cache_clear()


# --- CUDA: NVRTC compiles (no GPU needed), launch plans, machine code --------------------------------


def _cuda_impl():
    from kvwrite.ops.nvfp4 import cuda_impl
    return cuda_impl


@pytest.fixture(scope="module")
def pdl_sass(tmp_path_factory):
    """sm_90 SASS of the PDL build of every variant, compiled as one NVRTC program."""
    if nvrtc_reason() is not None:
        pytest.skip(nvrtc_reason())
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    from kvwrite.kernels import nvrtc
    cuda_impl = _cuda_impl()
    names = cuda_impl.all_kernel_names()
    obj, _ = cuda_impl.SOURCE.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    return names, sass_tools.dump_sass(bytes(obj.code), tmp_path_factory.mktemp("nvfp4sass"))


def test_every_cuda_variant_compiles_and_its_pdl_build_waits_first(pdl_sass):
    """Every variant compiles with NVRTC for sm_90 (70: nvfp4_kernel by dtype x MODE x slot type
    x rule, 28, MODE 2 only for "nvfp4" with 16-bit inputs; nvfp4_small_kernel by dtype x slot
    type x 4, 8 or 16 elements a thread, 18; nvfp4_kv_kernel by 16-bit dtype x slot type x 32- or
    64-bit offsets x (table with one or two groups of each side, or neither), 24); in its PDL
    build the trigger and the wait (PREEXIT, ACQBULK) come before the first global access."""
    import sass as sass_tools
    names, text = pdl_sass
    assert len(names) == 70
    funcs = sass_tools.functions(text)
    assert len(funcs) == len(names)
    sass_tools.assert_waits_first(funcs)


def _row_load(text: str) -> bool:
    """Every global load counts: the rows', the scales' and the slot's (all one round trip)."""
    return True


def _rare_path(text: str) -> list[tuple[int, int]]:
    """The code a predicated forward branch jumps over where it computes codes (VIMNMX3, the
    E2M1 lines): a rare path laid out in line, left out of the round-trip check
    (nvfp4_kv_kernel loads its rows again there)."""
    import sass as sass_tools
    return sass_tools.skipped_by_branches(text, lambda x: x.startswith("VIMNMX3"))


def test_every_cuda_variant_issues_its_loads_before_any_wait(pdl_sass):
    """No variant waits for a load's result before it has issued its last load: the K and V
    groups, the scales and the slot are one memory round trip (sass.waits_before_loads). The
    16-byte row loads are plain (L1-cached) loads, which ptxas sinks below a branch that does not
    need them: the kernels test the slot after the amax, the rows' first use (MODE 0, whose
    element loads are volatile, before it). Testing the slot before the amax in nvfp4_kernel's
    MODE 1 fails the check: ptxas then loads the rows after the test. A rare path laid out in
    line (_rare_path) is left out: nvfp4_kv_kernel's loads the rows again."""
    import tempfile
    from pathlib import Path

    import sass as sass_tools
    from kvwrite.kernels import nvrtc
    names, text = pdl_sass
    late = sass_tools.late_issues(text, _row_load, _rare_path)
    assert not late, {k: v[:3] for k, v in late.items()}
    # No volatile 16-byte row loads (they skip L1: see kernel.cu's nvfp4_load); MODE 0's element
    # loads are volatile.
    strong = {op for ops in sass_tools.functions(text).values() for op in ops
              if op.startswith("LDG") and "STRONG" in op and ".128" in op}
    assert not strong, strong
    # The order the check guards: the slot tested before the amax (as MODE 0 does).
    cuda_impl = _cuda_impl()
    early, late = "  if (MODE == 0 && skip) return;\n", "  if (skip) return;\n"
    src = cuda_impl.SOURCE.text
    assert src.count(early) == 1 and src.count(late) == 1
    old = src.replace(late, "").replace(early, late)
    big = [n for n in names if n.startswith("nvfp4_kernel<") and ", 1, " in n][:4]
    obj, _ = cuda_impl.SOURCE.compile("sm_90", big, source=old, macros=(nvrtc.PDL_MACRO,))
    with tempfile.TemporaryDirectory() as d:
        flagged = sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), Path(d)),
                                         _row_load, _rare_path)
    assert len(flagged) == 4, sorted(flagged)


def _tuning(**kw):
    """A CudaTuning with the kernel shapes fixed (not the environment's defaults; no wide tier
    unless asked: mid_call_groups=0 makes a call large)."""
    return _cuda_impl().CudaTuning(**{"small_elems": 4, "pair_groups": True, "pair_min_ctas": 4,
                                      "small_call_groups": 4096, "mid_call_groups": 1 << 18,
                                      "mid_elems": 16, "wide_call_groups": 0,
                                      "wide_elems": 32, "kv_min_ctas": 0, "kv_table": True,
                                      "kv_groups": 1, **kw})


def _plan_of(case: Nvfp4Case, **kw):
    inp = make_nvfp4_inputs(case)
    args = inp.run_args()
    return _cuda_impl().plan(*args[:8], args[10], tuning=_tuning(**kw))


_BIG = dict(num_tokens=300, num_heads=8, head_size=128, num_blocks=20)
_WIDE = {"mid_call_groups": 0, "wide_call_groups": 1 << 40}  # a 300-token call is a wide one


@pytest.mark.parametrize("case, kw, name, threads, per_token", [
    # Small calls of "nvfp4" with aligned inputs and data: a group of a side over 4 (2) threads.
    (Nvfp4Case(), {}, "nvfp4_small_kernel<1, long long, 4>", 64, 64),
    (Nvfp4Case(), {"small_elems": 8}, "nvfp4_small_kernel<1, long long, 8>", 64, 32),
    (Nvfp4Case(dtype=torch.float32, form="stacked"), {}, "nvfp4_small_kernel<2, long long, 4>",
     64, 64),
    (Nvfp4Case(pad=8, qkv_slices=True), {}, "nvfp4_small_kernel<1, long long, 4>", 64, 64),
    # small_elems=0: nvfp4_kernel for the small calls too.
    (Nvfp4Case(), {"small_elems": 0}, "nvfp4_kernel<1, 2, long long, false>", 64, 4),
    (Nvfp4Case(pad=8, qkv_slices=True), {"small_elems": 0}, "nvfp4_kernel<1, 1, long long, false>",
     64, 8),  # data 8-byte aligned only: one group a thread
    # 4over6: nvfp4_kernel, one group a thread.
    (Nvfp4Case(dtype=torch.float16, slot_dtype=torch.int32, kv_cache_dtype="nvfp4_4over6"), {},
     "nvfp4_kernel<0, 1, int, true>", 64, 8),
    # Unaligned inputs or data: element accesses.
    (Nvfp4Case(misaligned=True), {}, "nvfp4_kernel<1, 0, long long, false>", 64, 8),
    (Nvfp4Case(form="padded", pad=3), {}, "nvfp4_kernel<1, 0, long long, false>", 64, 8),
    (Nvfp4Case(pad=4), {}, "nvfp4_kernel<1, 0, long long, false>", 64, 8),  # s0 % 8 == 4
    # Mid-sized calls (19200 groups of K) of "nvfp4" with aligned inputs and data: one thread a
    # group of one side (mid_elems 16), or two (8); 4over6 and unaligned ones: nvfp4_kernel.
    (Nvfp4Case(**_BIG), {}, "nvfp4_small_kernel<1, long long, 16>", 256, 128),
    (Nvfp4Case(**_BIG, form="tuple", layout="HND"), {}, "nvfp4_small_kernel<1, long long, 16>",
     256, 128),
    (Nvfp4Case(**_BIG), {"mid_elems": 8}, "nvfp4_small_kernel<1, long long, 8>", 256, 256),
    (Nvfp4Case(**_BIG, dtype=torch.float32), {}, "nvfp4_small_kernel<2, long long, 16>", 256,
     128),
    (Nvfp4Case(**_BIG, pad=8), {}, "nvfp4_small_kernel<1, long long, 16>", 256, 128),
    (Nvfp4Case(**_BIG), {"mid_elems": 0}, "nvfp4_kernel<1, 2, long long, false>", 256, 32),
    (Nvfp4Case(**_BIG, kv_cache_dtype="nvfp4_4over6"), {}, "nvfp4_kernel<1, 1, long long, true>",
     256, 64),
    (Nvfp4Case(**_BIG, misaligned=True), {}, "nvfp4_kernel<1, 0, long long, false>", 256, 64),
    # Large calls (mid_call_groups 0 here): two groups a thread where the data is 16-byte
    # aligned, D % 32 == 0 and the inputs 16-bit; else one.
    (Nvfp4Case(**_BIG), {"mid_call_groups": 0}, "nvfp4_kernel<1, 2, long long, false>", 256, 32),
    (Nvfp4Case(**_BIG, form="tuple", layout="HND"), {"mid_call_groups": 0},
     "nvfp4_kernel<1, 2, long long, false>", 256, 32),
    (Nvfp4Case(**_BIG), {"pair_groups": False, "mid_call_groups": 0},
     "nvfp4_kernel<1, 1, long long, false>", 256, 64),
    (Nvfp4Case(**{**_BIG, "head_size": 48}), {"mid_call_groups": 0},
     "nvfp4_kernel<1, 1, long long, false>", 256, 24),
    (Nvfp4Case(**_BIG, dtype=torch.float32), {"mid_call_groups": 0},
     "nvfp4_kernel<2, 1, long long, false>", 256, 64),
    (Nvfp4Case(**_BIG, pad=8), {"mid_call_groups": 0}, "nvfp4_kernel<1, 1, long long, false>",
     256, 64),
    # Wide calls (mid_call_groups 0, wide_call_groups past the call): one thread a group of K
    # and V for "nvfp4" with 16-bit inputs and MODE 1's alignment, 256-thread CTAs with the
    # table; 32-bit offsets where the views fit them.
    (Nvfp4Case(**_BIG), _WIDE, "nvfp4_kv_kernel<1, long long, true, true, 1>", 256, 64),
    (Nvfp4Case(**_BIG, dtype=torch.float16, slot_dtype=torch.int32, layout="HND"), _WIDE,
     "nvfp4_kv_kernel<0, int, true, true, 1>", 256, 64),
    (Nvfp4Case(**_BIG, pad=8), _WIDE, "nvfp4_kv_kernel<1, long long, true, true, 1>", 256, 64),
    (Nvfp4Case(**_BIG), {**_WIDE, "kv_table": False, "threads": 128},
     "nvfp4_kv_kernel<1, long long, true, false, 1>", 128, 64),
    (Nvfp4Case(**_BIG), {**_WIDE, "kv_off32": False},
     "nvfp4_kv_kernel<1, long long, false, true, 1>", 256, 64),
    (Nvfp4Case(**_BIG), {**_WIDE, "wide_elems": 0}, "nvfp4_kernel<1, 2, long long, false>", 256,
     32),  # wide_elems=0: the large calls' kernel, as before the wide tier
    (Nvfp4Case(**_BIG), {**_WIDE, "wide_elems": 16}, "nvfp4_small_kernel<1, long long, 16>", 256,
     128),
    (Nvfp4Case(**_BIG), {"mid_elems": 32}, "nvfp4_kv_kernel<1, long long, true, true, 1>", 256,
     64),
    # kv_groups=2: two adjacent groups of each side a thread where MODE 2 could take them.
    (Nvfp4Case(**_BIG), {**_WIDE, "kv_groups": 2}, "nvfp4_kv_kernel<1, long long, true, true, 2>",
     256, 32),
    (Nvfp4Case(**{**_BIG, "head_size": 48}), {**_WIDE, "kv_groups": 2},
     "nvfp4_kv_kernel<1, long long, true, true, 1>", 256, 24),
    (Nvfp4Case(**_BIG, pad=8), {**_WIDE, "kv_groups": 2},
     "nvfp4_kv_kernel<1, long long, true, true, 1>", 256, 64),  # data 8-byte aligned only
    (Nvfp4Case(**_BIG), {**_WIDE, "kv_groups": 2, "kv_table": False},
     "nvfp4_kv_kernel<1, long long, true, false, 1>", 256, 64),  # two groups: the table's
    # ... float32 inputs: one group of one side a thread; 4over6 and unaligned: nvfp4_kernel.
    (Nvfp4Case(**_BIG, dtype=torch.float32), _WIDE, "nvfp4_small_kernel<2, long long, 16>", 256,
     128),
    (Nvfp4Case(**_BIG, kv_cache_dtype="nvfp4_4over6"), _WIDE,
     "nvfp4_kernel<1, 1, long long, true>", 256, 64),
    (Nvfp4Case(**_BIG, misaligned=True), _WIDE, "nvfp4_kernel<1, 0, long long, false>", 256, 64),
    # Past wide_call_groups: the large calls' kernel.
    (Nvfp4Case(**_BIG), {"mid_call_groups": 0, "wide_call_groups": 19199},
     "nvfp4_kernel<1, 2, long long, false>", 256, 32),
])
def test_cuda_plan(case, kw, name, threads, per_token):
    p = _plan_of(case, **kw)
    assert (p.name, p.threads, p.per_token) == (name, threads, per_token)
    assert p.name in _cuda_impl().all_kernel_names()
    assert len(p.fixed) == len(_cuda_impl().FIXED_ARGS) == 20
    assert p.fixed[-1] == int(case.v_scale_layout == "swizzled")


def test_cuda_cta_size_shrinks_for_few_ctas():
    """The CTAs of mid-sized and large calls halve (down to 64 threads) while a call would have
    fewer than min_ctas of them; the small calls' keep their size."""
    cuda_impl = _cuda_impl()
    t = _tuning()
    big = _plan_of(Nvfp4Case(**_BIG), mid_call_groups=0)  # 32 threads a token
    assert [cuda_impl.cta_threads(big, n * 32, t) for n in (64, 1024, 2000, 2112, 16384)] == [
        64, 64, 128, 256, 256]
    mid = _plan_of(Nvfp4Case(**_BIG))  # nvfp4_small_kernel, 128 threads a token
    assert mid.mode == -1 and mid.threads == 256
    assert [cuda_impl.cta_threads(mid, n * 128, t) for n in (256, 512, 528, 4096)] == [
        64, 128, 256, 256]
    small = _plan_of(Nvfp4Case())
    assert cuda_impl.cta_threads(small, 64, t) == 64
    assert cuda_impl.cta_threads(_plan_of(Nvfp4Case(), small_threads=256), 64, t) == 256


def test_cuda_tuning_rejects_bad_values():
    with pytest.raises(ValueError, match="small_elems: expected 0, 4, 8 or 16, got 2"):
        _tuning(small_elems=2)
    with pytest.raises(ValueError, match="small_elems: expected 0, 4, 8 or 16, got 32"):
        _tuning(small_elems=32)
    with pytest.raises(ValueError, match="mid_elems: expected 0, 4, 8, 16 or 32, got 24"):
        _tuning(mid_elems=24)
    with pytest.raises(ValueError, match="wide_elems: expected 0, 4, 8, 16 or 32, got 2"):
        _tuning(wide_elems=2)
    with pytest.raises(ValueError, match="pair_min_ctas: expected 0 to 8, got 9"):
        _tuning(pair_min_ctas=9)
    with pytest.raises(ValueError, match="kv_min_ctas: expected 0 to 8, got -1"):
        _tuning(kv_min_ctas=-1)
    with pytest.raises(ValueError, match="kv_groups: expected 1 or 2, got 4"):
        _tuning(kv_groups=4)


@needs_nvrtc
def test_specialized_builds_compile_and_read_no_fixed_argument(tmp_path):
    """A build with the call signature's 20 trailing arguments compiled in reads none of them
    from the parameter bank (sm_90: 9 pointers at 0x210, the scale bits, num_tokens at 0x268,
    the fixed arguments from 0x270), issues its loads before any wait and, as its PDL twin,
    waits before any access; the generic build reads them; a wrong count fails."""
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    from kvwrite.kernels import nvrtc
    cuda_impl = _cuda_impl()

    def reads(name, fixed):
        obj, _ = cuda_impl.compile_kernel("sm_90", name, fixed=fixed)
        text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
        return sass_tools.param_reads(text), text

    first, end = 0x270, 0x270 + 8 * 20
    for case in (Nvfp4Case(num_heads=8, head_size=128), Nvfp4Case(layout="HND", block_size=12,
                                                                   v_scale_layout="linear",
                                                                   slot_dtype=torch.int32)):
        p = _plan_of(case)
        special, text = reads(p.name, p.fixed)
        assert not any(first <= o < end for o in special), sorted(map(hex, special))
        assert 0x210 in special and 0x268 in special  # the key pointer and num_tokens still are
        assert not sass_tools.late_issues(text, _row_load, _rare_path)
        pdl, _ = cuda_impl.SOURCE.compile("sm_90", p.name, macros=nvrtc.fixed_args_macros(p.fixed)
                                          + (nvrtc.PDL_MACRO,))
        (ops,) = sass_tools.functions(sass_tools.dump_sass(bytes(pdl.code), tmp_path)).values()
        first_mem = next(i for i, o in enumerate(ops) if o.startswith(MEMORY_OPS))
        assert "ACQBULK" in ops[:first_mem], ops[:40]
    generic, _ = reads(p.name, None)
    assert any(first <= o < end for o in generic), sorted(map(hex, generic))
    with pytest.raises(RuntimeError, match="20 values"):
        cuda_impl.compile_kernel("sm_90", p.name, fixed=(1, 2, 3))


def _build_shape(case: Nvfp4Case, tmp_path, extra_macros=(), **kw):
    """(plan, opcodes, ptxas registers, spill bytes) of the specialized PDL build for sm_90
    that a call of ``case`` runs, after checking that it issues every load before any wait."""
    import sass as sass_tools
    from kvwrite.kernels import nvrtc
    p = _plan_of(case, **kw)
    obj, log = _cuda_impl().SOURCE.compile(
        "sm_90", p.name, macros=nvrtc.fixed_args_macros(p.fixed) + (nvrtc.PDL_MACRO,)
        + tuple(extra_macros), ptxas_verbose=True)
    text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
    (ops,) = sass_tools.functions(text).values()
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    assert not sass_tools.late_issues(text, _row_load, _rare_path), (p.name, case.id)  # one round trip
    return p, ops, regs, spill


def _count(ops, *prefixes) -> dict[str, int]:
    import collections
    return dict(collections.Counter(o for o in ops if o.startswith(prefixes)))


# The benchmark's shape (kvwrite-bench nvfp4: H=8, D=128, bfloat16, block 16, NHD, swizzled V
# scales, int64 slots), as a large call (300 tokens: 19200 groups) and a small one (16 tokens).
_BENCH = dict(num_heads=8, head_size=128, block_size=16, num_blocks=20, v_scale_layout="swizzled")


@needs_nvrtc
def test_machine_code_shape_of_the_benchmark_builds(tmp_path):
    """What the performance rests on, in the sm_90 machine code of the benchmark shape's builds:
    - large calls (nvfp4_kernel, MODE 2): two groups a thread, one 16-byte store of codes a side
      (a warp's store 512 contiguous bytes) and four scale bytes; eight 16-byte L1-cached row
      loads (LDG.CONSTANT, not volatile: a group's two halves are one sector fetch); at most 64
      registers (4 CTAs of 256 threads an SM) with at most 8 bytes spilled; the amax of the raw
      bfloat16 words by the 16-bit SIMD maximum of magnitudes (HMNMX2); the E2M1 lines' minimum
      as one VIMNMX3 an element (64 fast, 64 in the general path); about 420 instructions a
      group on the fast
      path (nvfp4_kernel before: about 550, 63 registers, two 8-byte stores, volatile loads);
    - the same with pair_groups=False (MODE 1): one group a thread, two 8-byte stores;
    - small calls (nvfp4_small_kernel, 4 elements a thread): one 8-byte row load, one 2-byte
      store of codes (a warp's 64 contiguous bytes) and part 0's scale byte; two xor shuffles
      (and two more on the NaN path) and no divergent-shuffle fallback; at most 32 registers and
      under 260 instructions in all;
    and in every one of these builds (and the HND and int32-slot ones) all loads are issued
    before the first wait."""
    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path,
                                       mid_call_groups=0)
    assert p.name == "nvfp4_kernel<1, 2, long long, false>"
    assert _count(ops, "STG") == {"STG.E.128": 2, "STG.E.U8": 4}
    assert _count(ops, "LDG") == {"LDG.E.128.CONSTANT": 8, "LDG.E.64.CONSTANT": 1,
                                  "LDG.E.CONSTANT": 2}
    assert regs <= 64 and spill <= 8, (regs, spill)
    assert _count(ops, "VIMNMX3.U32") == {"VIMNMX3.U32": 128}
    assert _count(ops, "HMNMX2") == {"HMNMX2.BF16_V2.NAN.XORSIGN": 4 * 8}  # 4 groups, 7 + 1
    assert len(ops) <= 1600, len(ops)

    # pair_min_ctas=0 (no register bound): no spill, 3 CTAs of 256 an SM.
    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path,
                                       extra_macros=[("KVW_NVFP4_PAIR_MIN_CTAS", "0")],
                                       mid_call_groups=0)
    assert p.name == "nvfp4_kernel<1, 2, long long, false>"
    assert _count(ops, "STG") == {"STG.E.128": 2, "STG.E.U8": 4}
    assert 64 < regs <= 85 and spill == 0, (regs, spill)

    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path,
                                       pair_groups=False, mid_call_groups=0)
    assert p.name == "nvfp4_kernel<1, 1, long long, false>"
    assert _count(ops, "STG") == {"STG.E.64": 2, "STG.E.U8": 2}
    assert _count(ops, "LDG") == {"LDG.E.128.CONSTANT": 4, "LDG.E.64.CONSTANT": 1,
                                  "LDG.E.CONSTANT": 2}
    assert regs <= 64 and spill == 0, (regs, spill)
    assert _count(ops, "VIMNMX3.U32") == {"VIMNMX3.U32": 64}

    # Mid-sized calls (the same 300 tokens under the default mid_call_groups): one thread a group
    # of one side, its two 16-byte row loads, one 8-byte store of codes and the scale byte; the
    # amax by the 16-bit SIMD maximum, no shuffle or vote; 32 registers (64 warps an SM), about
    # 450 instructions in all (about 290 on the fast path).
    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path)
    assert p.name == "nvfp4_small_kernel<1, long long, 16>"
    assert _count(ops, "STG") == {"STG.E.64": 1, "STG.E.U8": 1}
    assert _count(ops, "LDG") == {"LDG.E.128.CONSTANT": 2, "LDG.E.64.CONSTANT": 1,
                                  "LDG.E.CONSTANT": 1}  # row, slot, k or v
    assert not _count(ops, "SHFL", "VOTE", "MATCH", "WARPSYNC", "BRA.DIV", "REDUX"), ops
    assert _count(ops, "VIMNMX3.U32") == {"VIMNMX3.U32": 32}
    assert _count(ops, "HMNMX2") == {"HMNMX2.BF16_V2.NAN.XORSIGN": 8}
    assert regs <= 32 and spill == 0, (regs, spill)
    assert len(ops) <= 470, len(ops)

    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=16, **_BENCH), tmp_path)
    assert p.name == "nvfp4_small_kernel<1, long long, 4>"
    assert _count(ops, "STG") == {"STG.E.U16": 1, "STG.E.U8": 1}
    assert _count(ops, "LDG") == {"LDG.E.64.CONSTANT": 2, "LDG.E.CONSTANT": 1}  # row, slot; k
    assert _count(ops, "SHFL") == {"SHFL.BFLY": 4}
    assert not _count(ops, "MATCH", "WARPSYNC", "BRA.DIV", "REDUX"), ops
    assert regs <= 32 and spill == 0, (regs, spill)
    assert len(ops) <= 260, len(ops)
    # The other layouts and slot type of the benchmark: the same kernels, loads first.
    for layout, slot in (("HND", torch.int64), ("NHD", torch.int32)):
        for t, kw, name in ((300, {"mid_call_groups": 0}, "nvfp4_kernel<1, 2, "),
                            (300, {}, "nvfp4_small_kernel<1, "),
                            (16, {}, "nvfp4_small_kernel<1, ")):
            p, ops, regs, spill = _build_shape(
                Nvfp4Case(num_tokens=t, layout=layout, slot_dtype=slot, **_BENCH), tmp_path, **kw)
            assert p.name.startswith(name), p.name


@needs_nvrtc
def test_machine_code_shape_of_the_wide_builds(tmp_path):
    """The wide calls' kernel (nvfp4_kv_kernel) for the benchmark shape, sm_90 bfloat16: a thread
    loads its group of K and of V (four 16-byte L1-cached loads) and the slot, stores two 8-byte
    code words and two scale bytes; the amax of each group by the 16-bit SIMD maximum of
    magnitudes (HMNMX2 max.NaN.xorsign.abs: 7 + 1 a group, no mask of each word); one VIMNMX3 an
    element on the fast path and one in the general path. With its table: one entry stored per
    thread (STS, or STS.128 and an STS for the scale constants), one barrier, the two sides' constants and
    reciprocals loaded (2 LDS.128 + 2 LDS, and 2 more LDS in the general path), MUFU only in
    the entry (2), at most 48 registers and no spill; all loads of the fast path before the
    first wait, and the four row loads again in the rare path (one branch for both sides: the
    fast paths do not hold the rows' words for it). Without
    the table, 64-bit offsets and a bound of 6 CTAs: every thread's scale constants and
    reciprocals (6 MUFU), at most 40 registers. Two groups of each side a thread: see below."""
    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path, **_WIDE)
    assert p.name == "nvfp4_kv_kernel<1, long long, true, true, 1>"
    assert _count(ops, "LDG") == {"LDG.E.128.CONSTANT": 8, "LDG.E.64.CONSTANT": 1,
                                  "LDG.E.CONSTANT": 2}
    assert _count(ops, "STG") == {"STG.E.64": 2, "STG.E.U8": 2}
    assert _count(ops, "HMNMX2") == {"HMNMX2.BF16_V2.NAN.XORSIGN": 16}
    assert _count(ops, "VIMNMX3.U32") == {"VIMNMX3.U32": 64}
    assert _count(ops, "LDS", "STS", "BAR", "MUFU") == {
        "LDS": 4, "LDS.128": 2, "STS": 2, "STS.128": 1, "BAR.SYNC.DEFER_BLOCKING": 1,
        "MUFU.RCP": 2}
    assert regs <= 48 and spill == 0, (regs, spill)
    assert len(ops) <= 900, len(ops)
    p, ops, regs, spill = _build_shape(
        Nvfp4Case(num_tokens=300, **_BENCH), tmp_path,
        extra_macros=[("KVW_NVFP4_KV_MIN_CTAS", "6")],
        **{**_WIDE, "kv_table": False, "kv_off32": False})
    assert p.name == "nvfp4_kv_kernel<1, long long, false, false, 1>"
    assert _count(ops, "STG") == {"STG.E.64": 2, "STG.E.U8": 2}
    assert not _count(ops, "LDS", "STS", "BAR")
    assert _count(ops, "MUFU") == {"MUFU.RCP": 6}
    assert regs <= 40, regs
    # kv_groups=2: two groups of each side, one 16-byte store of codes a side and four scale
    # bytes; eight row loads (and eight in the rare path); at most 64 registers (4 CTAs) and no
    # spill.
    p, ops, regs, spill = _build_shape(Nvfp4Case(num_tokens=300, **_BENCH), tmp_path,
                                       **{**_WIDE, "kv_groups": 2})
    assert p.name == "nvfp4_kv_kernel<1, long long, true, true, 2>"
    assert _count(ops, "LDG") == {"LDG.E.128.CONSTANT": 16, "LDG.E.64.CONSTANT": 1,
                                  "LDG.E.CONSTANT": 2}
    assert _count(ops, "STG") == {"STG.E.128": 2, "STG.E.U8": 4}
    assert _count(ops, "HMNMX2") == {"HMNMX2.BF16_V2.NAN.XORSIGN": 32}
    assert regs <= 64 and spill == 0, (regs, spill)


def test_wide_kernel_offsets_fit_32_bits_by_the_views_spans():
    """nvfp4_kv_kernel's OFF32 is planned where every byte offset into each view (from its own
    pointer) is below 2^32."""
    import types
    cuda_impl = _cuda_impl()

    def view(shape, stride):
        return types.SimpleNamespace(shape=shape, stride=lambda: stride)

    small = view((4, 16, 8, 64), (18432, 512, 64, 1))
    assert cuda_impl._fits_32_bits(small, small)
    edge = view((2, 2), (1 << 31, 1))  # largest offset 2^31 + 1
    assert cuda_impl._fits_32_bits(edge)
    over = view((3, 16, 8, 64), ((1 << 31) - 1, 512, 64, 1))  # 2 * (2^31 - 1) + 8191 >= 2^32
    assert not cuda_impl._fits_32_bits(small, over)


def test_call_size_tiers():
    """Small, mid-sized, wide and large calls by groups of K (H=8, D=128: 64 groups a token)."""
    cuda_impl = _cuda_impl()
    t = _tuning(mid_call_groups=1 << 16, wide_call_groups=1 << 18)
    assert [cuda_impl.call_size(n, 64, t) for n in (64, 65, 1024, 1025, 4096, 4097)] == [
        0, 1, 1, 3, 3, 2]


@needs_nvrtc
def test_plain_build_has_no_pdl_and_other_architectures_compile(tmp_path):
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    from kvwrite.kernels import nvrtc
    cuda_impl = _cuda_impl()
    names = cuda_impl.all_kernel_names()[:2]
    plain, _ = cuda_impl.compile_kernel("sm_90", names)
    sass_tools.assert_no_pdl(sass_tools.dump_sass(bytes(plain.code), tmp_path))
    old, _ = cuda_impl.SOURCE.compile("sm_80", names[:1], macros=(nvrtc.PDL_MACRO,))
    text = sass_tools.dump_sass(bytes(old.code), tmp_path)
    assert "ACQBULK" not in text and "LDG" in text
    for arch in ("sm_75", "sm_120"):  # any GPU: no e2m1 or max.NaN instruction needed
        obj, _ = cuda_impl.compile_kernel(arch, names[:1])
        assert len(bytes(obj.code)) > 0


def test_cuda_unavailable_on_cpu_says_why():
    assert "CUDA devices only" in registry.get(OP, "cuda").available("cpu")


def test_sanitize_cases_are_listed():
    from tools.sanitize import nvfp4 as sanitize
    ids = [i for i, _ in sanitize.cases()]
    assert ids and len(ids) == len(set(ids))
    assert all(callable(fn) for _, fn in sanitize.cases())


# --- Triton: compiles for sm_90 (CPU), no fused multiply-add, the PDL wait first ---------------

_TRITON_PTX_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.ops.nvfp4 import triton_impl as nv

def ptx(in_ty, fos, swz, in_mem, pdl=False, slot="*i64", bt=2, bq=64, words=True,
        native=False):
    k = nv._nvfp4_kernel
    types = {"key_ptr": in_ty, "value_ptr": in_ty, "k_data_ptr": "*u8", "k_sf_ptr": "*u8",
             "v_data_ptr": "*u8", "v_sf_ptr": "*u8", "slot_mapping_ptr": slot,
             "num_tokens": "i32"}
    consts = dict(KEY_STRIDE=3072, VALUE_STRIDE=3072, KD_SB=18432, KD_SS=512, KD_SH=64,
                  KS_SB=18432, KS_SS=64, KS_SH=8, VD_SB=18432, VD_SS=512, VD_SH=64,
                  VS_SB=18432, VS_SS=64, VS_SH=8, NUM_SLOTS=1024, BLOCK_SIZE=16, G=8,
                  NUM_GROUPS=64, FOUR_OVER_SIX=fos, V_SWIZZLE=swz, BF16_BITS=in_ty == "*i16",
                  SCALE_IN_MEMORY=in_mem, IN_WORDS=words and in_ty != "*fp32",
                  DATA_WORDS=words, NATIVE=native, F32=in_ty == "*fp32", BLOCK_T=bt,
                  BLOCK_Q=bq, PDL=pdl, PDL_TRIGGER=pdl)
    if in_mem:
        types.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32", k_scale_value="fp32",
                     v_scale_value="fp32")
    else:
        consts.update(k_scale_ptr=None, v_scale_ptr=None)
        types.update(k_scale_value="fp32", v_scale_value="fp32")
    sig = dict(types)
    sig.update({n: "constexpr" for n in consts})
    # Pointers 16-byte aligned where the words are (as Triton specializes aligned tensors).
    attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n, ty in types.items()
             if words and ty.startswith("*")}
    src = ASTSource(fn=k, signature=sig, attrs=attrs,
                    constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
    opts = {"num_warps": 4, "enable_fp_fusion": False}
    if pdl:
        opts["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

import re
LINE = r"fma\.rn\.f32\s+%\w+,\s*%\w+,\s*"
out = {}
for in_ty, fos in (("*i16", False), ("*fp32", True)):
    text = ptx(in_ty, fos, True, True)
    two = len(re.findall(LINE + r"0f40000000,\s*0f4B000000;", text))
    half = len(re.findall(LINE + r"0f3F000000,\s*0f4B000004;", text))
    out[f"{in_ty}-{fos}"] = [text.count("fma.") - two - half, two, half,
                             text.count("div.rn.f32"), text.count("ld.global.v4.b32"),
                             text.count("shfl.sync") + text.count("bar.sync")]
text = ptx("*i16", False, True, True, native=True)
out["native"] = [text.count("fma.") - len(re.findall(LINE + r"0f40000000,\s*0f4B000000;", text))
                 - len(re.findall(LINE + r"0f3F000000,\s*0f4B000004;", text)),
                 text.count("cvt.rn.satfinite.e4m3x2.f32"), text.count("shf.l.wrap.b32"),
                 text.count("div.rn.f32")]
text = ptx("*i16", False, False, False, pdl=True, slot="*i32", bt=1, bq=8, words=False)
first_ld = text.index("ld.global")
out["pdl"] = [text.count("griddepcontrol.wait"), text.find("griddepcontrol.wait") < first_ld]
print(json.dumps(out))
"""


def test_triton_kernel_compiles_for_sm90_without_fma_and_waits_first_with_pdl():
    """The Triton kernel compiled for sm_90 (no GPU needed): bfloat16 bits and float32 4over6
    builds with swizzled V scales and scale tensors, and a PDL build with Python-number scales
    and int32 slots. No fma in their PTX but E2M1's two exact-product lines (contraction off:
    the rule's steps and 4over6's error sums are rounded one by one), and the PDL build's wait
    before its first load. With aligned tensors each thread holds whole groups (one of K and one
    of V: bfloat16 as four 16-byte loads, float32 as eight): the two quotients per group as
    div.rn.f32 once per thread and group (2 x 2; 4over6 both candidates), no shuffle and no
    barrier (no amax across threads, no layout change through shared memory). The NATIVE build
    (sm_89 and later) takes each side's scale code by one float8 conversion and packs each
    element's code with one funnel shift (16 a side)."""
    out = run_triton_script(_TRITON_PTX_SCRIPT)
    other, two, half, div, v4, sync = out["*i16-False"]
    assert other == 0 and two == half > 0 and div == 4 and v4 == 4 and sync == 0, out
    other, two, half, div, v4, sync = out["*fp32-True"]
    assert other == 0 and two == half > 0 and div == 8 and v4 == 8 and sync == 0, out
    assert out["native"] == [0, 2, 32, 4], out
    assert out["pdl"] == [1, True], out


# --- on the GPU -----------------------------------------------------------------------------------------

def _gpu_impl(impl: str):
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    return info


def _gpu_vs_reference(case: Nvfp4Case, impl: str, seed: int = 0, **run_kw):
    """impl on the GPU against the torch reference on the GPU, whole allocations."""
    inp = make_nvfp4_inputs(case, "cuda", seed)
    want = clone_inputs(inp)
    want.call("torch")
    if run_kw:
        args = inp.run_args()
        if inp.slot_mapping.numel():
            importlib.import_module(f"kvwrite.ops.nvfp4.{impl}_impl").run(*args, **run_kw)
    else:
        inp.call(impl)
    torch.cuda.synchronize()
    assert_storages_equal(inp.tensors(), want.tensors(), f"{impl} {case.id}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", NVFP4_GPU_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_gpu_matrix(impl, case):
    _gpu_impl(impl)
    _gpu_vs_reference(case, impl)


@pytest.mark.gpu
@pytest.mark.parametrize("case", NVFP4_CASES, ids=lambda c: c.id)
def test_gpu_reference_matches_page_oracle(case):
    """The torch reference on the GPU writes the oracle's bytes (PyTorch's CUDA ops: the same
    IEEE steps; no division by a CPU scalar)."""
    inp = make_nvfp4_inputs(case, "cuda")
    inp.call("torch")
    assert_storages_equal(clone_inputs(inp, "cpu").tensors(), expected(case), case.id)


def _every_16_bit_groups(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern of dtype once, as 4096 groups of 16 (rows [4096 / 8, 8 heads, 16]),
    in an order that mixes magnitudes within groups."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(9))
    return bits[perm].view(dtype).reshape(512, 8, 16)


# Kernel shapes the GPU tests force (cuda_impl.CudaTuning fields): the default plan, the large
# calls' kernel on every call with two groups a thread and with one, the small calls' kernel on
# every call with 4 and 8 elements a thread, the mid-sized calls' shape (spread CTAs) with 16 and
# 8, the wide calls' kernel (K and V a thread) with its table and 32-bit offsets and without
# either (64-thread CTAs, 40 registers), and the large calls' kernel with small CTAs.
_SHAPES = {
    "default": {},
    "generic": {"specialize": False},
    "big-pair": {"small_call_groups": 0, "mid_call_groups": 0},
    "big-pair-unbounded": {"small_call_groups": 0, "mid_call_groups": 0, "pair_min_ctas": 0},
    "big-single": {"small_call_groups": 0, "mid_call_groups": 0, "pair_groups": False},
    "mid-e16": {"small_call_groups": 0, "mid_call_groups": 1 << 40, "mid_elems": 16},
    "mid-e8": {"small_call_groups": 0, "mid_call_groups": 1 << 40, "mid_elems": 8},
    "wide-kv": {"small_call_groups": 0, "mid_call_groups": 0, "wide_call_groups": 1 << 40},
    "wide-kv-plain": {"small_call_groups": 0, "mid_call_groups": 0, "wide_call_groups": 1 << 40,
                      "kv_table": False, "kv_off32": False, "kv_min_ctas": 6, "threads": 64},
    "wide-kv2": {"small_call_groups": 0, "mid_call_groups": 0, "wide_call_groups": 1 << 40,
                 "kv_groups": 2},
    "wide-kv2-off64": {"small_call_groups": 0, "mid_call_groups": 0, "wide_call_groups": 1 << 40,
                       "kv_groups": 2, "kv_off32": False},
    "small-e4": {"small_call_groups": 1 << 40, "small_elems": 4, "small_threads": 32},
    "small-e8": {"small_call_groups": 1 << 40, "small_elems": 8},
    "small-ctas": {"small_call_groups": 1 << 40, "small_elems": 0, "small_threads": 32},
}


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["nvfp4", "nvfp4_4over6"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl, shape", [("triton", None), ("cuda", None)]
                         + [("cuda", s) for s in _SHAPES], ids=lambda x: x or "public")
@pytest.mark.parametrize("head_size", [16, 32])
def test_gpu_every_16_bit_input(impl, dtype, kv, shape, head_size):
    """Every bfloat16 / float16 input (NaNs, infinities, subnormals, -0 included) through the
    kernels, for scales that put S in every regime (subnormal, normal, saturated, and the
    documented ties' power-of-two k), against the reference. D = 16 and 32 (two groups a head:
    the large calls' kernel takes them two a thread); the cuda kernel shapes forced one by one
    (``shape``; None: the public op)."""
    _gpu_impl(impl)
    x = _every_16_bit_groups(dtype).cuda().reshape(-1, 8, head_size)
    slots = torch.randperm(x.shape[0], device="cuda")
    for k in (1.0, 2.0**-5, 0.003, 1 / 3, 0.7, 2.0**-100, 2.0**100, 5e-4):
        kc, vc = kvwrite.create_kv_caches_with_random_flash(32, 16, 1, 8, head_size, kv, seed=1,
                                                            device="cuda")
        want_k, want_v = clone_tensors([kc[0], vc[0]])
        ks = torch.tensor([k], device="cuda")
        vs = torch.tensor([min(k * 3, 2.0**100)], device="cuda")  # within [2^-100, 2^100]
        kvwrite.reshape_and_cache_flash(x, x.flip(0), want_k, want_v, slots, kv, ks, vs,
                                        v_scale_layout="linear", implementation="torch")
        if shape is None:
            kvwrite.reshape_and_cache_flash(x, x.flip(0), kc[0], vc[0], slots, kv, ks, vs,
                                            v_scale_layout="linear", implementation=impl)
        else:
            args = nvfp4_op.flash_run_args(x, x.flip(0), kc[0], vc[0], slots, kv, ks, vs,
                                           v_scale_layout="linear")
            _cuda_impl().run(*args, tuning=_tuning(**_SHAPES[shape]))
        assert_storages_equal([kc[0], vc[0]], [want_k, want_v],
                              f"{impl} {dtype} {kv} D={head_size} shape={shape} k={k}")


def clone_tensors(ts):
    from kvwrite.testing.nvfp4 import clone_tensors as ct
    return ct(ts)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in NVFP4_CASES if c.num_tokens in (5, 7, 9, 40)]
                         + [c for c in NVFP4_GPU_CASES if c.num_tokens in (70, 100)]
                         + [c for c in NVFP4_GPU_CASES if c.num_tokens == 300][::5],
                         ids=lambda c: c.id)
@pytest.mark.parametrize("shape", [s for s in _SHAPES if s != "default"])
def test_gpu_cuda_builds(case, shape):
    """The unspecialized builds (runtime arguments) and every kernel shape forced on part of the
    matrix (the small calls' kernel on calls of 70 to 300 tokens too, the large calls' on the
    small ones)."""
    _gpu_impl("cuda")
    _gpu_vs_reference(case, "cuda", tuning=_tuning(**_SHAPES[shape]))


@pytest.mark.parametrize("impl, device", [
    ("torch", "cpu"), pytest.param("torch", "cuda", marks=pytest.mark.gpu),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu),
    pytest.param("cuda", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("form", ["vllm", "tuple", "stacked"])
def test_torch_compile_sees_one_custom_op(impl, device, form):
    """Both entry points stay one opaque custom op under torch.compile (v_scale_layout and
    Python-number scales passed through) and write the reference's bytes."""
    if device == "cuda":
        _gpu_impl(impl)
    case = Nvfp4Case(form=form, num_tokens=16, v_scale_layout="swizzled",
                     scale_as_number=form == "tuple")
    inp = make_nvfp4_inputs(case, device)
    want = clone_inputs(inp)
    want.call("torch")

    if form == "vllm":
        def fn(key, value, kc, vc, slots, ks, vs):
            kvwrite.reshape_and_cache_flash(key, value, kc, vc, slots, "nvfp4", ks, vs,
                                            v_scale_layout="swizzled", implementation=impl)
        targets = compiled_targets(fn, inp.key, inp.value, *inp.caches, inp.slot_mapping,
                                   inp.k_scale, inp.v_scale)
        assert targets == ["kvwrite.reshape_and_cache_flash"], targets
    else:
        def fn(key, value, slots, data, sf):
            kvwrite.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
                key, value, slots, data, sf, inp.k_scale, inp.v_scale, "NHD",
                implementation=impl)
        targets = compiled_targets(fn, inp.key, inp.value, inp.slot_mapping, *inp.caches)
        assert targets == ["kvwrite.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping"], \
            targets
    if device == "cuda":
        torch.cuda.synchronize()
    assert_storages_equal(inp.tensors(), want.tensors(), f"compiled {impl} {form}")


@pytest.mark.gpu
def test_gpu_sanitize_cases():
    from tools.sanitize import nvfp4 as sanitize
    _gpu_impl("cuda")
    failures = [f"{i}: {r}" for i, fn in sanitize.cases() if (r := fn()) is not None]
    assert not failures, failures


@pytest.mark.gpu
def test_gpu_readers_match_the_cpu():
    """The readers on the GPU give the CPU's bytes (exact PyTorch ops, tensor divisors)."""
    key, value, kc, vc, slots, ks, vs = _roundtrip_inputs("HND", "swizzled")
    cpu = kvwrite.nvfp4_gather_cache(vc, slots, vs, scale_layout="swizzled")
    gpu = kvwrite.nvfp4_gather_cache(vc.cuda(), slots.cuda(), vs.cuda(),
                                     scale_layout="swizzled")
    assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))
    x = key.reshape(-1, 128)
    for fos in (False, True):
        a = kvwrite.nvfp4_kv_quantize(x, 0.003, four_over_six=fos)
        b = kvwrite.nvfp4_kv_quantize(x.cuda(), 0.003, four_over_six=fos)
        assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
    d1 = kvwrite.nvfp4_kv_dequantize(*a, 0.003, torch.float32)
    d2 = kvwrite.nvfp4_kv_dequantize(b[0], b[1], 0.003, torch.float32)
    assert torch.equal(d1.view(torch.int32), d2.cpu().view(torch.int32))


@pytest.mark.gpu
def test_gpu_default_v_scale_layout_follows_the_device():
    major = torch.cuda.get_device_capability()[0]
    want = ScaleLayout.LINEAR if major >= 12 else ScaleLayout.SWIZZLED
    assert nvfp4_op.default_v_scale_layout("cuda") is want
