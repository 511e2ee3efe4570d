"""reshape_and_cache_flash_per_token_head_quant, dequantize_per_token_head and
create_per_token_head_caches: the reference against an independent per-row oracle (exact
rational arithmetic for every rounding decision) over the CPU matrix; every implementation byte
for byte against the reference over whole allocations (the four tensors, one allocation or
four); the kernel's row arithmetic compiled as host C++ against the reference; validation
specifics; the round trip and an attention consumer; the allocator's strides; NVRTC builds and
machine code of the CUDA kernel; on the GPU the full matrix for the three implementations,
torch.compile of packed views and the sanitize cases. Wrong writers, bad input, CUDA graphs,
torch.compile and the NVRTC compile of every variant: tests/test_conformance.py
(kvwrite.testing.providers.reshape_and_cache_flash_per_token_head_quant)."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import math
import re
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

import kvwrite
from host import build_host_lib, run_triton_script
from kvwrite import registry
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import OP, PerTokenHeadMode
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import reference as torch_ref
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.per_token_head import (
    FP8,
    INT4,
    INT8,
    PTH_CASES,
    PTH_GPU_CASES,
    PthCase,
    assert_pth_caches_equal,
    check_roundtrip,
    clone_pth_caches,
    half_step_bound,
    make_pth_inputs,
    roundtrip_error,
    special_rows,
)
from oracle import cache_slots, fp8_round
from params import impl_names
from sass import needs_nvrtc

IMPLS = impl_names(OP)
MODES = [INT8, FP8, INT4]


def _dq(case: PthCase) -> tuple[int, int]:
    return case.mode.quantized_size(case.dk), case.mode.quantized_size(case.dv)


# --- the independent oracle -----------------------------------------------------------------------

_FLOOR = np.float32(1e-6)


def _f32(v) -> np.float32:
    return np.float32(v)


def _div(a, b) -> float:
    """The IEEE float32 quotient (NumPy's float32 division rounds to nearest even)."""
    with np.errstate(all="ignore"):
        return float(np.float32(a) / np.float32(b))


def _fmax(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def _round_half_away(v: float) -> float:
    if math.isinf(v):
        return v
    n = math.trunc(v)
    frac = Fraction(v) - n
    if abs(frac) >= Fraction(1, 2):
        n += 1 if v > 0 else -1
    return float(n)


def _round_half_up(v: float) -> float:
    if math.isinf(v):
        return v
    n = math.floor(v)
    return float(n + 1 if Fraction(v) - n >= Fraction(1, 2) else n)


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def oracle_row(x: np.ndarray, mode: str) -> tuple[bytes, int]:
    """(code bytes, scale entry bits) of one row of float32 values, element by element."""
    vals = [float(v) for v in x]
    real = [v for v in vals if not math.isnan(v)]
    if mode == INT4:
        mn, mx = (min(real), max(real)) if real else (0.0, 0.0)
        with np.errstate(all="ignore"):
            rng = float(np.float32(mx) - np.float32(mn))
        s = _fmax(_div(rng, 15.0), float(_FLOOR))
        zq = _div(-mn, s)
        zp = min(max(_round_half_up(0.0 if math.isnan(zq) else zq), 0.0), 15.0)
        codes = []
        for v in vals:
            q = _div(v, s)
            codes.append(int(min(max(_round_half_up(0.0 if math.isnan(q) else q) + zp, 0.0), 15.0)))
        out = bytes(codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(codes) // 2))
        return out, (_bits(s) & 0xFFFFFFF0) | int(zp)
    amax = max((abs(v) for v in real), default=0.0)
    if mode == INT8:
        s = _fmax(_div(amax, 127.0), float(_FLOOR))
        out = []
        for v in vals:
            q = _div(v, s)
            r = min(max(_round_half_away(0.0 if math.isnan(q) else q), -128.0), 127.0)
            out.append(int(r) & 0xFF)
        return bytes(out), _bits(s)
    s = _fmax(_div(amax, 448.0), float(_FLOOR))
    with np.errstate(all="ignore"):
        q = (x.astype(np.float32) / np.float32(s)).astype(np.float32)
    return bytes(fp8_round(q, torch.float8_e4m3fn).tolist()), _bits(s)


def pth_oracle(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
               mode: str) -> None:
    """Writes into CPU caches, one (token, head, K or V) row at a time."""
    nb, bs, num_heads, _ = key_cache.shape
    for t, b, o in cache_slots(slot_mapping, nb, bs):
        for src, cache, scales in ((key, key_cache, k_scale_cache),
                                   (value, value_cache, v_scale_cache)):
            for h in range(num_heads):
                codes, entry = oracle_row(src[t, h].float().numpy(), mode)
                cache[b, o, h, :len(codes)].view(torch.uint8).copy_(
                    torch.frombuffer(bytearray(codes), dtype=torch.uint8))
                signed = entry - (1 << 32) if entry >= 1 << 31 else entry
                scales[b, o, h:h + 1].view(torch.int32).fill_(signed)


@functools.cache
def expected_caches(case: PthCase) -> tuple:
    inp = make_pth_inputs(case)
    caches = clone_pth_caches(inp.caches)
    pth_oracle(inp.key, inp.value, *caches, inp.slot_mapping, case.kv_quant_mode)
    return caches


def run_case(impl: str, case: PthCase, device: str):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_pth_inputs(case, device)
    if (reason := info.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache,
                                   case.mode)) is not None:
        pytest.skip(reason)
    kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation=impl)
    return inp


# --- the oracle and every implementation on the CPU matrix ------------------------------------------

@pytest.mark.parametrize("case", PTH_CASES, ids=lambda c: c.id)
def test_reference_matches_oracle(case):
    inp = run_case("torch", case, "cpu")
    assert_pth_caches_equal(inp.caches, expected_caches(case), case.mode, _dq(case))


# The interpreter's NumPy arithmetic warns on the special values' NaN and inf (as intended).
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", PTH_CASES, ids=lambda c: c.id)
def test_triton_matches_oracle_on_cpu(case):
    inp = run_case("triton", case, "cpu")
    assert_pth_caches_equal(inp.caches, expected_caches(case), case.mode, _dq(case))


def test_oracle_writes_the_documented_bytes():
    """Hand-checked rows: int8 ties away from zero, int4 nibble order and the zero point in the
    scale's low bits, fp8 codes, the floor."""
    codes, entry = oracle_row(np.array([127.0, 0.5, -0.5, 1.5, -2.5, 0.0], np.float32), INT8)
    assert list(codes) == [127, 1, 0xFF, 2, 0xFD, 0] and entry == _bits(1.0)
    # int4: min -7, max 8: s = 1, zp = 7; x + 7 = 0, 15, 7.5 -> 8, 6.5 -> 7 (half up).
    codes, entry = oracle_row(np.array([-7.0, 8.0, 0.5, -0.5], np.float32), INT4)
    assert list(codes) == [0 | 15 << 4, 8 | 7 << 4] and entry == (_bits(1.0) | 7)
    codes, entry = oracle_row(np.array([448.0, -224.0, float("nan"), -0.0], np.float32), FP8)
    assert list(codes) == [0x7E, 0xF6, 0x7F, 0x80] and entry == _bits(1.0)
    codes, entry = oracle_row(np.zeros(4, np.float32), INT8)
    assert entry == 0x358637BD == kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.SCALE_FLOOR_BITS
    assert np.float32(1e-6).view(np.uint32) == 0x358637BD


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_reference_special_rows_match_the_contract(mode, dtype):
    """Each special case the contract lists, row by row, against the oracle and the stated
    outcome."""
    rows = special_rows(16, dtype)
    x = torch.stack(rows).to(dtype)
    codes, entries = torch_ref.quantize_rows(x, PerTokenHeadMode(mode))
    for i, r in enumerate(rows):
        want_codes, want_entry = oracle_row(r.numpy(), mode)
        got = bytes(codes[i].tolist())
        if mode == FP8:  # NaN codes may differ in sign
            nan = [j for j, c in enumerate(want_codes) if c & 0x7F == 0x7F]
            assert all(codes[i][j] & 0x7F == 0x7F for j in nan), (i, r)
            got = bytes(c if j not in nan else want_codes[j] for j, c in enumerate(got))
        assert got == want_codes, (i, r.tolist(), list(got), list(want_codes))
        assert _bits(float(entries[i])) == want_entry, (i, r.tolist())
    ent = [_bits(float(e)) for e in entries]
    floor = 0x358637BD
    zero, all_nan, one_nan, pinf, ninf, const, constn, tiny, pinf_only, ninf_only, both = range(11)
    if mode == INT8:
        assert ent[zero] == ent[all_nan] == ent[tiny] == floor
        assert not codes[zero].any() and not codes[all_nan].any() and codes[one_nan][0] == 0
        assert ent[pinf] == _bits(float("inf")) and not codes[pinf].any()  # inf -> 0, finite -> 0
        assert set(codes[const].tolist()) == {127} and set(codes[constn].tolist()) == {0x81}
    elif mode == INT4:
        f4 = floor & ~15  # the floor with zero point 0 in its low bits
        assert ent[zero] == ent[all_nan] == f4 and not codes[zero].any()
        assert ent[pinf] == (_bits(float("inf")) & ~15) and not codes[pinf].any()
        assert ent[both] == (_bits(float("inf")) & ~15)  # mx - mn overflows: s = inf, zp = 0
        # +inf only: mx - mn is NaN, s = the floor, codes saturate (15; NaN elements get zp = 0).
        assert ent[pinf_only] == f4 and set(codes[pinf_only].tolist()) == {0x0F}
        # -inf only: zp = rhu(+inf) clamped to 15, codes clamp to 0.
        assert ent[ninf_only] == f4 | 15 and not codes[ninf_only].any()
        assert ent[const] == f4 and set(codes[const].tolist()) == {0xFF}  # saturated
        one = [c >> (4 * (j % 2)) & 15 for j, c in
               enumerate(codes[one_nan].repeat_interleave(2).tolist())]
        assert one[0] == ent[one_nan] & 15  # a NaN element stores the zero point
    else:
        assert ent[zero] == ent[all_nan] == floor
        assert set(codes[all_nan].tolist()) <= {0x7F, 0xFF}
        assert codes[zero][0] == 0x80 and codes[zero][1] == 0  # -0 kept
        assert ent[pinf] == _bits(float("inf"))


# --- the kernel's row arithmetic as host C++ --------------------------------------------------------

_HARNESS = r"""
#include <cmath>
#include "kernel.cu"

extern "C" {
// Rows of d float32 values (the input's values): code bytes and scale entry bits, by kernel.cu's
// functions (the reductions as a loop instead of shuffles).
void pth_rows(int mode, int steps, const float* x, long long rows, int d, unsigned char* codes,
              unsigned int* entries) {
  for (long long r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float s, mn = 0.0f;
    if (mode == PTH_INT4) {
      float lo = INFINITY, hi = -INFINITY;
      for (int i = 0; i < d; ++i) { lo = min_step(lo, xr[i]); hi = max_step(hi, xr[i]); }
      s = int4_scale(lo, hi);
      mn = lo;
    } else {
      float a = 0.0f;
      for (int i = 0; i < d; ++i) a = amax_step(a, xr[i]);
      s = amax_scale(a, mode == PTH_INT8 ? 127.0f : 448.0f);
    }
    const Fp8Scale sc = fp8_exact_scale<true>(s);
    u32 entry = f32_bits(s);
    if (mode == PTH_INT4) {
      const float zp = steps == 1 ? int4_zero_point<1>(mn, sc) : int4_zero_point<2>(mn, sc);
      entry = int4_entry(s, zp);
      for (int j = 0; j < d / 2; ++j) {
        const float q0 = steps == 1 ? fp8_quotient<1>(xr[2 * j], sc) : fp8_quotient<2>(xr[2 * j], sc);
        const float q1 = steps == 1 ? fp8_quotient<1>(xr[2 * j + 1], sc) : fp8_quotient<2>(xr[2 * j + 1], sc);
        codes[r * (d / 2) + j] = static_cast<unsigned char>(int4_code(q0, zp) | (int4_code(q1, zp) << 4));
      }
    } else if (mode == PTH_INT8) {
      for (int i = 0; i < d; ++i) {
        const float q = steps == 1 ? int8_quotient<1>(xr[i], sc) : int8_quotient<2>(xr[i], sc);
        codes[r * d + i] = static_cast<unsigned char>(int8_code(q));
      }
    } else {
      for (int i = 0; i < d; ++i) {
        const float v[1] = {xr[i]};
        u32 w[1];
        if (steps == 1) fp8_quantize<DT_E4M3, 1, 1>(v, w, sc); else fp8_quantize<DT_E4M3, 1, 2>(v, w, sc);
        codes[r * d + i] = static_cast<unsigned char>(w[0] & 0xFFu);
      }
    }
    entries[r] = entry;
  }
}

// The kernel's choice of path per row, its reductions (NaN propagating) as loops: rows that
// qualify take the fast path's functions, the others pth_rows. Returns the fast rows' count.
long long pth_rows_paths(int mode, int steps, const float* x, long long rows, int d,
                         unsigned char* codes, unsigned int* entries, long long* clamped) {
  const int dq = mode == PTH_INT4 ? d / 2 : d;
  long long fast_rows = 0;
  *clamped = 0;
  for (long long r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    bool nan = false;
    float amax = 0.0f, lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < d; ++i) {
      const float v = xr[i];
      if (v != v) { nan = true; continue; }
      amax = fmaxf(amax, fabsf(v)); lo = fminf(lo, v); hi = fmaxf(hi, v);
    }
    const bool fast = !nan && (mode == PTH_INT4 ? fast_int4_row(lo, hi) : fast_amax_row(amax));
    if (!fast) { pth_rows(mode, steps, xr, 1, d, codes + r * dq, entries + r); continue; }
    ++fast_rows;
    unsigned char* out = codes + r * dq;
    float s = mode == PTH_INT4 ? fast_int4_scale(lo, hi)
              : mode == PTH_INT8 ? (steps == 1 ? fast_amax_scale<PTH_INT8, 1>(amax)
                                               : fast_amax_scale<PTH_INT8, 2>(amax))
                                 : (steps == 1 ? fast_amax_scale<PTH_FP8, 1>(amax)
                                               : fast_amax_scale<PTH_FP8, 2>(amax));
    const float y = fast_rcp(s);
    auto quot = [&](float v) {
      return steps == 1 ? fast_quotient<1>(v, s, y) : fast_quotient<2>(v, s, y);
    };
    if (mode == PTH_INT4) {
      const u32 zp = steps == 1 ? fast_int4_zero_point<1>(lo, s, y)
                                : fast_int4_zero_point<2>(lo, s, y);
      const float zc = fast_int4_zc(zp);
      entries[r] = (f32_bits(s) & 0xFFFFFFF0u) | (zp & 0xFu);
      // The kernel's choice: no top clamp where the largest value's code is at most 15.
      const bool top = steps == 1 ? fast_int4_top<1>(hi, s, y, zc) : fast_int4_top<2>(hi, s, y, zc);
      *clamped += !top;
      auto bits = [&](float v) {
        return top ? fast_int4_bits<false>(quot(v), zc) : fast_int4_bits<true>(quot(v), zc);
      };
      for (int j = 0; j < d; j += 8) {  // groups of 8 (fast_int4_pack<8>), the rest by pairs
        if (j + 8 <= d) {
          u32 t[8];
          for (int k = 0; k < 8; ++k) t[k] = bits(xr[j + k]);
          const u32 w = fast_int4_pack<8>(t);
          for (int k = 0; k < 4; ++k) out[j / 2 + k] = static_cast<unsigned char>(w >> (8 * k));
        } else {
          for (int k = j; k < d; k += 2) {
            const u32 t[2] = {bits(xr[k]), bits(xr[k + 1])};
            out[k / 2] = static_cast<unsigned char>(fast_int4_pack<2>(t));
          }
        }
      }
    } else if (mode == PTH_INT8) {
      entries[r] = f32_bits(s);
      for (int i = 0; i < d; ++i) out[i] = static_cast<unsigned char>(fast_int8_code(quot(xr[i])));
    } else {
      entries[r] = f32_bits(s);
      for (int i = 0; i < d; ++i) {
        const float v = fast_fp8_signed(quot(xr[i]), xr[i]);
        out[i] = static_cast<unsigned char>(fp8x2_from_f32<DT_E4M3>(v, 0.0f) & 0xFFu);
      }
    }
  }
  return fast_rows;
}

// fast_quotient(x, s, fast_rcp(s)) against the IEEE quotient for every x of xs and s of ss with
// |x / s| <= 1024: out[0] pairs checked, out[1] quotients >= 2^-60 that differ, out[2] tiny
// quotients (< 2^-60) whose result is not tiny, out[3] reciprocals that differ from 1 / s.
void pth_fast_quotient(int steps, const float* xs, long long nx, const float* ss, long long ns,
                       long long* out) {
  out[0] = out[1] = out[2] = out[3] = 0;
  for (long long j = 0; j < ns; ++j) {
    const float s = ss[j], y = fast_rcp(s);
    out[3] += f32_bits(y) != f32_bits(1.0f / s);
    for (long long i = 0; i < nx; ++i) {
      const float x = xs[i], want = x / s;
      if (!(fabsf(want) <= 1024.0f)) continue;
      const float got = steps == 1 ? fast_quotient<1>(x, s, y)
                      : steps == 2 ? fast_quotient<2>(x, s, y) : fast_quotient<0>(x, s, y);
      ++out[0];
      if (fabsf(want) >= 0x1p-60f) out[1] += f32_bits(got) != f32_bits(want);
      else out[2] += !(fabsf(got) < 0x1p-59f);
    }
  }
}

// fast_div_const by 127 (which 0), 448 (1) or 15 (2) against the IEEE quotient, for a >= 0:
// the count that differ.
long long pth_fast_div(int which, int steps, const float* as, long long n) {
  long long bad = 0;
  for (long long i = 0; i < n; ++i) {
    const float a = as[i];
    float got, want;
    if (which == 0) {
      got = steps == 1 ? fast_div_const<1>(a, PTH_M127, PTH_S127, PTH_Y127)
                       : fast_div_const<2>(a, PTH_M127, PTH_S127, PTH_Y127);
      want = a / 127.0f;
    } else if (which == 1) {
      got = steps == 1 ? fast_div_const<1>(a, PTH_M448, PTH_S448, PTH_Y448)
                       : fast_div_const<2>(a, PTH_M448, PTH_S448, PTH_Y448);
      want = a / 448.0f;
    } else {
      got = steps == 1   ? fast_div_const<1>(a, PTH_M15, PTH_S15, PTH_Y15)
            : steps == 2 ? fast_div_const<2>(a, PTH_M15, PTH_S15, PTH_Y15)
                         : fast_div_const<0>(a, PTH_M15, PTH_S15, PTH_Y15);
      want = a / 15.0f;
    }
    // Below the floor (1e-6) only the floored scale matters.
    if (want >= 1e-7f || got >= 1e-7f) bad += f32_bits(got) != f32_bits(want);
  }
  return bad;
}

// The fast path's code roundings on every 13th float q of [2^-3, 2^8) (both signs) and on each
// tie k + 1/2 and its two neighbours: fast_int8_code's byte against rhaz (|q| <= 127.00002),
// fast_int4_bits's nibble against clamp(rhu(q) + zp, 0, 15) for every zp where rhu(q) + zp >= 0
// and q <= 16.0001. out[0] checked, out[1] int8 wrong, out[2] int4 wrong, out[3] int4 bits
// other than 0x4B00000n.
static double rhaz_exact(float q) {
  const double n = trunc((double)q);
  return fabs((double)q - n) >= 0.5 ? n + (q < 0 ? -1.0 : 1.0) : n;
}
static double rhu_exact(float q) {
  const double n = floor((double)q);
  return (double)q - n >= 0.5 ? n + 1.0 : n;
}
static void code_case(float q, long long* out) {
  ++out[0];
  if (fabsf(q) <= 127.00002f) {
    const int want = (int)rhaz_exact(q);
    out[1] += (fast_int8_code(q) & 0xFFu) != ((unsigned)want & 0xFFu);
  }
  if (q > 16.0001f) return;
  const double n = rhu_exact(q);
  for (int zp = 0; zp < 16; ++zp) {
    if (n + zp < 0) continue;
    const double want = n + zp > 15 ? 15 : n + zp;
    const u32 zbits = 0x4B000000u | (u32)zp;
    const u32 b = fast_int4_bits(q, fast_int4_zc(zbits));
    out[2] += (b & 0xFu) != (u32)want;
    out[3] += (b & ~0xFu) != 0x4B000000u;
  }
}
void pth_code_check(long long* out) {
  out[0] = out[1] = out[2] = out[3] = 0;
  for (u32 e = 127u - 3u; e < 127u + 8u; ++e)
    for (u32 m = 0; m < (1u << 23); m += 13) {
      code_case(bits_f32((e << 23) | m), out);
      code_case(-bits_f32((e << 23) | m), out);
    }
  for (int k = -130; k <= 130; ++k)
    for (int dlt = -2; dlt <= 2; ++dlt) {
      const float t = bits_f32(f32_bits((float)k + 0.5f) + dlt);
      code_case(t, out);
    }
  code_case(0.0f, out);
  code_case(-0.0f, out);
  code_case(0x1p-140f, out);
  code_case(-0x1p-140f, out);
}
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    so = build_host_lib(tmp_path_factory, _HARNESS, "pth", "row harness",
                        ("kvwrite.ops.reshape_and_cache_flash_per_token_head_quant",))
    so.pth_rows.restype = None
    return so


def _host_rows(host_lib, x: torch.Tensor, mode: str, steps: int):
    rows, d = x.shape
    xf = x.float().contiguous()
    dq = d // 2 if mode == INT4 else d
    codes = torch.empty(rows, dq, dtype=torch.uint8)
    entries = torch.empty(rows, dtype=torch.int32)
    host_lib.pth_rows(MODES.index(mode), steps, ctypes.c_void_p(xf.data_ptr()),
                      ctypes.c_longlong(rows), d, ctypes.c_void_p(codes.data_ptr()),
                      ctypes.c_void_p(entries.data_ptr()))
    return codes, entries


def _sweep_rows(dtype: torch.dtype, d: int, seed: int) -> torch.Tensor:
    """Rows of every kind: every 16-bit pattern (16-bit dtypes), random rows over many binades,
    with offsets, the special rows, and rows whose quotients sit on rounding ties."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.stack(special_rows(d, dtype)).to(dtype)]
    if dtype != torch.float32:
        bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
        pats = bits[torch.randperm(65536, generator=g)].view(dtype)
        parts.append(pats.view(-1, d))
    n = 4096
    mag = torch.exp2(torch.randint(-30 if dtype != torch.float16 else -14, 16, (n, 1),
                                   generator=g).float())
    parts.append(((torch.randn(n, d, generator=g) + torch.randn(n, 1, generator=g)) * mag).to(dtype))
    # Ties: amax = 127 * 2^k (int8 scale 2^k) or max - min = 15 * 2^k, with halves.
    k = torch.exp2(torch.randint(-8, 8, (512, 1), generator=g).float())
    half = (torch.randint(-254, 255, (512, d), generator=g).float() / 2)
    t8 = half.clamp(-126.5, 126.5)
    t8[:, 0] = 127.0
    parts.append((t8 * k).to(dtype))
    t4 = (torch.randint(-14, 16, (512, d), generator=g).float() / 2).clamp(-7, 8)
    t4[:, 0], t4[:, 1] = -7.0, 8.0
    parts.append((t4 * k).to(dtype))
    # Extremes both on halves (-7.5, 7.5 times 2^k): zp = 8 and the top code would be 16 (the
    # kernel's fast path keeps its top clamp for these rows).
    t5 = (torch.randint(-15, 16, (256, d), generator=g).float() / 2).clamp(-7.5, 7.5)
    t5[:, 0], t5[:, 1] = -7.5, 7.5
    parts.append((t5 * k[:256]).to(dtype))
    return torch.cat(parts)


def _assert_rows_match_reference(x: torch.Tensor, mode: str, codes: torch.Tensor,
                                 entries: torch.Tensor) -> None:
    """The host rows' codes and scale entries are the reference's bit for bit (fp8 NaN codes:
    any NaN)."""
    want_codes, want_entries = torch_ref.quantize_rows(x, PerTokenHeadMode(mode))
    bad_e = torch.nonzero(entries != want_entries.view(torch.int32)).flatten()
    assert bad_e.numel() == 0, (f"{bad_e.numel()} scale entries differ; first row "
                                f"{x[bad_e[0]].tolist()}: got {int(entries[bad_e[0]]):#x}, want "
                                f"{int(want_entries.view(torch.int32)[bad_e[0]]):#x}")
    diff = codes != want_codes
    if mode == FP8:
        diff &= ~(torch.isnan(codes.view(torch.float8_e4m3fn).float())
                  & torch.isnan(want_codes.view(torch.float8_e4m3fn).float()))
    bad = torch.nonzero(diff)
    assert bad.numel() == 0, (f"{bad.shape[0]} codes differ; first row {int(bad[0, 0])} "
                              f"{x[int(bad[0, 0])].tolist()} element {int(bad[0, 1])}: got "
                              f"{int(codes[tuple(bad[0])])}, want "
                              f"{int(want_codes[tuple(bad[0])])}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_row_arithmetic_on_host_matches_reference(host_lib, mode, dtype):
    """kernel.cu's scale, quotient (kvw/fp8.cuh's division-free one) and roundings, compiled as
    host C++, on every 16-bit pattern and on random, tie and special rows, against the
    reference's torch arithmetic: codes and scale entries bit for bit (fp8 NaN codes: any)."""
    d = 32
    x = _sweep_rows(dtype, d, seed=MODES.index(mode))
    steps = 2 if dtype == torch.float32 else 1
    codes, entries = _host_rows(host_lib, x, mode, steps)
    _assert_rows_match_reference(x, mode, codes, entries)


def _fast_rows_check(host_lib, x: torch.Tensor, mode: str, steps: int,
                     clamped: list | None = None) -> int:
    """pth_rows_paths on rows x against the reference; returns how many took the fast path
    (``clamped`` gets how many int4 rows of them took the top clamp)."""
    rows, d = x.shape
    xf = x.float().contiguous()
    dq = d // 2 if mode == INT4 else d
    codes = torch.empty(rows, dq, dtype=torch.uint8)
    entries = torch.empty(rows, dtype=torch.int32)
    host_lib.pth_rows_paths.restype = ctypes.c_longlong
    n_clamped = ctypes.c_longlong(0)
    n_fast = host_lib.pth_rows_paths(MODES.index(mode), steps, ctypes.c_void_p(xf.data_ptr()),
                                     ctypes.c_longlong(rows), d, ctypes.c_void_p(codes.data_ptr()),
                                     ctypes.c_void_p(entries.data_ptr()), ctypes.byref(n_clamped))
    if clamped is not None:
        clamped.append(n_clamped.value)
    _assert_rows_match_reference(x, mode, codes, entries)
    return int(n_fast)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_fast_path_on_host_matches_reference(host_lib, mode, dtype):
    """The kernel's fast path (finite rows; int4: rows whose range holds zero) and its choice of
    path, compiled as host C++, on the sweep's rows (every 16-bit pattern, random, tie and
    special rows) and on rows of 128: codes and entries bit for bit; both paths taken, and
    int4's rows with and without the top clamp."""
    steps = 2 if dtype == torch.float32 else 1
    x = _sweep_rows(dtype, 32, seed=10 + MODES.index(mode))
    clamped = []
    n_fast = _fast_rows_check(host_lib, x, mode, steps, clamped)
    assert x.shape[0] // 3 < n_fast < x.shape[0], (n_fast, x.shape[0])
    if mode == INT4:
        assert 256 <= clamped[0] < n_fast, (clamped, n_fast)
    g = torch.Generator().manual_seed(3)
    lo, hi = (-10, 8) if dtype == torch.float16 else (-20, 20)
    y = (torch.randn(512, 128, generator=g) * torch.exp2(
        torch.randint(lo, hi, (512, 1), generator=g).float())).to(dtype)
    assert _fast_rows_check(host_lib, y, mode, steps) == 512


def _f32_of_all_16bit(dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return x[torch.isfinite(x)].contiguous()


def _fast_scales() -> torch.Tensor:
    """Scales the fast path meets (FLOOR to 2^125): of every binade, ordinary, all-ones, 1.0
    and near-1.0 significands."""
    g = torch.Generator().manual_seed(5)
    e = torch.arange(-20, 126, dtype=torch.int64)
    mant = torch.cat([torch.randint(0, 2**23, (2,), generator=g),
                      torch.tensor([0, 2**23 - 1, 0x7F0000])])
    bits = ((e[:, None] + 127) << 23) | mant[None, :]
    s = bits.flatten().to(torch.int32).view(torch.float32)
    return torch.cat([s[s >= 1e-6], torch.tensor([1e-6, 3.3e-6, 0.0078740157])]).contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fast_quotient_is_the_ieee_quotient_on_host(host_lib, dtype):
    """The fast path's quotient without the scaling by m (one product, two fused multiply-adds
    per step) is RN(x / s) for every 16-bit x (float32: random x, two steps) under scales of every
    binade the fast path meets, wherever |x / s| <= 1024 (tiny quotients: tiny); its reciprocal
    is RN(1 / s). Without a step it is not (the check can fail)."""
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(6)
        xs = (torch.randn(20000, generator=g) * torch.exp2(
            torch.randint(-30, 30, (20000,), generator=g).float())).contiguous()
        steps = 2
    else:
        xs = _f32_of_all_16bit(dtype)
        steps = 1
    ss = _fast_scales()
    out = (ctypes.c_longlong * 4)()
    def run(steps):
        host_lib.pth_fast_quotient(steps, ctypes.c_void_p(xs.data_ptr()),
                                   ctypes.c_longlong(xs.numel()), ctypes.c_void_p(ss.data_ptr()),
                                   ctypes.c_longlong(ss.numel()), out)

    run(steps)
    checked, wrong, tiny_wrong, rcp_wrong = list(out)
    assert checked > 5 * xs.numel() and wrong == 0 and tiny_wrong == 0 and rcp_wrong == 0
    run(0)
    assert out[1] > 0


def test_fast_scale_divisions_on_host(host_lib):
    """RN(a / 127), RN(a / 448) by the fast path's constants, one step, for every 16-bit
    a >= 0 (amax is an input value); two steps for float32 a (float32 inputs, int4's
    RN(mx - mn) / 15, where the proof is Markstein's); and the constants are RN(1 / s2)."""
    import numpy as np
    for s2, y in ((3.96875, "0x1.020408p-2"), (3.5, "0x1.24924ap-2"), (3.75, "0x1.111112p-2")):
        assert float(np.float32(1.0) / np.float32(s2)) == float.fromhex(y)
    host_lib.pth_fast_div.restype = ctypes.c_longlong
    for dtype in (torch.float16, torch.bfloat16):
        a = _f32_of_all_16bit(dtype).abs().unique().contiguous()
        for which in (0, 1):
            assert host_lib.pth_fast_div(which, 1, ctypes.c_void_p(a.data_ptr()),
                                         ctypes.c_longlong(a.numel())) == 0
    g = torch.Generator().manual_seed(7)
    a = (torch.rand(200000, generator=g) * torch.exp2(
        torch.randint(-30, 127, (200000,), generator=g).float())).contiguous()
    a = a[torch.isfinite(a)].contiguous()
    for which in (0, 1, 2):
        assert host_lib.pth_fast_div(which, 2, ctypes.c_void_p(a.data_ptr()),
                                     ctypes.c_longlong(a.numel())) == 0
    # The product alone is not the quotient (the check can fail).
    assert host_lib.pth_fast_div(2, 0, ctypes.c_void_p(a.data_ptr()),
                                 ctypes.c_longlong(a.numel())) > 0


def test_fast_code_roundings_on_host(host_lib):
    """The fast path's int8 byte (rhaz in two directed additions, the sign folded in) and int4
    nibble (rhu + zp, top clamp) on every 13th float of [2^-3, 2^8) of both signs, every tie and
    its neighbours, zeros and tiny values, against exact roundings."""
    out = (ctypes.c_longlong * 4)()
    host_lib.pth_code_check(out)
    checked, int8_wrong, int4_wrong, int4_bits_wrong = list(out)
    assert checked > 10_000_000 and int8_wrong == 0 and int4_wrong == 0 and int4_bits_wrong == 0


def test_tie_rows_catch_inexact_roundings(monkeypatch):
    """The sweep's tie rows fail a reference whose rhu is floor(v + 0.5) in float32 (0.49999997
    -> 1) and one whose rhaz rounds half to even: proof that the sweep above can fail."""
    x = _sweep_rows(torch.float32, 32, seed=0)
    want, _ = torch_ref.quantize_rows(x, PerTokenHeadMode.INT4_PER_TOKEN_HEAD)
    want8, _ = torch_ref.quantize_rows(x, PerTokenHeadMode.INT8_PER_TOKEN_HEAD)
    monkeypatch.setattr(torch_ref, "rhu", lambda v: torch.floor(v + 0.5))
    monkeypatch.setattr(torch_ref, "rhaz", torch.round)  # half to even
    wrong, _ = torch_ref.quantize_rows(x, PerTokenHeadMode.INT4_PER_TOKEN_HEAD)
    wrong8, _ = torch_ref.quantize_rows(x, PerTokenHeadMode.INT8_PER_TOKEN_HEAD)
    assert (wrong != want).any() and (wrong8 != want8).any()



# --- the Triton kernel's int4 fast path -------------------------------------------------------------

def _tie_neighbour_rows(d: int, mode: str = INT4) -> torch.Tensor:
    """float32 rows whose scale is a power of two 2^k (int4: min -7 * 2^k, max 8 * 2^k; int8:
    amax 127 * 2^k) and whose other elements lie on the halves (j + 1/2) 2^k and one float
    below and above them: RN(q + zc) (int4) or RN(|q| + 1/2) (int8) rounds the ones below up
    to the next integer where RM does not (a fast path whose floor took a nearest sum writes
    codes one too high there)."""
    rows = []
    top = 8 if mode == INT4 else 127
    head = [-7.0, 8.0] if mode == INT4 else [127.0]
    for k in (-3, 0, 5):
        halves = torch.arange(-(top - 1), top, dtype=torch.float64) + 0.5
        vals = torch.cat([halves, -halves]).float() * 2.0 ** k
        body = torch.cat([vals, torch.nextafter(vals, torch.full_like(vals, -math.inf)),
                          torch.nextafter(vals, torch.full_like(vals, math.inf))])
        n = d - len(head)
        for start in range(0, body.numel(), n):
            chunk = body[start:start + n]
            chunk = torch.cat([chunk, chunk.new_zeros(n - chunk.numel())])
            rows.append(torch.cat([torch.tensor(head) * 2.0 ** k, chunk]))
    return torch.stack(rows)


def _triton_call(key, value, mode: str, tuning=None):
    """Triton's run on fresh packed caches (random bytes) and the reference's caches."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    mode = PerTokenHeadMode(mode)
    t, h, d = key.shape
    bs = 16
    nb = -(-t // bs) + 1
    caches = kvwrite.create_per_token_head_caches(nb, bs, h, d, mode, kv_alloc="packed",
                                                  device=key.device)
    g = torch.Generator().manual_seed(t)
    storage_bytes(caches[0]).copy_(torch.randint(0, 256, storage_bytes(caches[0]).shape,
                                                 generator=g, dtype=torch.uint8))
    slots = torch.randperm(nb * bs, generator=g)[:t].to(key.device)
    want = clone_pth_caches(caches)
    torch_ref.run(key, value, *want, slots, mode)
    with np.errstate(invalid="ignore"):  # the interpreter's NaN from inf * 0 (general rows)
        triton_impl.run(key, value, *caches, slots, mode,
                        **({} if tuning is None else {"tuning": tuning}))
    return caches, want


def _count_fast_programs(monkeypatch) -> list:
    """Under Triton's interpreter, count the programs that take the fast path (each calls
    _fast_side once per side)."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    calls = []
    inner = triton_impl._fast_side.fn

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setitem(triton_impl._pth_kernel.fn.__globals__, "_fast_side", counted)
    return calls


@pytest.mark.parametrize("mode", [INT8, INT4])
def test_triton_fast_path_runs_where_every_row_can(monkeypatch, mode):
    """Triton's interpreter (the large calls' tiling forced: small calls take the general path):
    programs whose rows are all finite (int4: with a range holding zero) take the fast path, a
    program with a NaN, an infinity (or an int4 row of one sign) takes the general path; both
    write the reference's bytes (so does the kernel with the fast path turned off)."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    if (reason := triton_impl.available(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    calls = _count_fast_programs(monkeypatch)
    large = triton_impl.TritonTuning(small_grid=0)
    assert triton_impl.call_tiling(8, 8, 128, 128, large)[:2] == (2, 8)  # 4 programs
    assert not triton_impl.fast_path(PerTokenHeadMode(mode), 128, 128, 16,
                                     triton_impl.small_call(8, 8, 128, 128))
    dq = (128 // (2 if mode == INT4 else 1),) * 2
    g = torch.Generator().manual_seed(3)
    key = torch.randn(8, 8, 128, generator=g).bfloat16()
    value = torch.randn(8, 8, 128, generator=g).bfloat16()
    caches, want = _triton_call(key, value, mode, large)
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), dq)
    assert len(calls) == 2 * 4
    calls.clear()
    key[1, 3, 5] = float("nan")  # program 0
    value[2, 0, 7] = float("-inf")  # program 1
    key[5, 7] = key[5, 7].abs() + 1  # one sign, program 2
    caches, want = _triton_call(key, value, mode, large)
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), dq)
    assert len(calls) == 2 * (1 if mode == INT4 else 2)
    calls.clear()
    caches, want = _triton_call(key, value, mode,
                                triton_impl.TritonTuning(small_grid=0, fast_path=False))
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), dq)
    assert not calls


@pytest.mark.parametrize("mode", [INT8, INT4])
def test_triton_fast_path_floors_sums_below_integers(monkeypatch, mode):
    """Triton's interpreter (the large calls' tiling forced): rows whose quotients lie one float
    below halves take the fast path and write the reference's codes (the interpreter's RM sum
    is add_rm's TwoSum form; the compiled add.rm.f32 runs in test_gpu_triton_fast_rows)."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    if (reason := triton_impl.available(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    calls = _count_fast_programs(monkeypatch)
    rows = _tie_neighbour_rows(32, mode)
    n = rows.shape[0] // 2 * 2
    key = rows[:n].view(-1, 2, 32)
    value = rows[:n].flip(0).reshape(-1, 2, 32)
    caches, want = _triton_call(key, value, mode, triton_impl.TritonTuning(small_grid=0))
    dq = (32 // (2 if mode == INT4 else 1),) * 2
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), dq)
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_triton_fast_rows(mode, dtype):
    """The sweep's rows that the Triton kernel's fast path takes (finite; int4: with a range
    holding zero: every 16-bit pattern's finite rows, random rows, ties) and the tie
    neighbours (float32), as rows of 128 in vLLM's packed layout, so that whole programs take
    the fast path; against the reference, and the same rows with the fast path turned off."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    if (reason := triton_impl.available(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    x = _sweep_rows(dtype, 128, seed=7).float()
    ok = torch.isfinite(x).all(1)
    if mode == INT4:
        ok &= (x.amin(1) <= 0) & (x.amax(1) >= 0)
    x = x[ok].to(dtype)
    if dtype == torch.float32 and mode != FP8:
        x = torch.cat([x, _tie_neighbour_rows(128, mode)])
    n = x.shape[0] // 16 * 16
    key = x[:n].view(-1, 8, 128).cuda()
    value = x[:n].flip(0).reshape(-1, 8, 128).cuda()
    dq = (128 // (2 if mode == INT4 else 1),) * 2
    for tuning in (triton_impl.TritonTuning(small_grid=0),
                   triton_impl.TritonTuning(small_grid=0, fast_path=False)):
        caches, want = _triton_call(key, value, mode, tuning)
        assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), dq, f"triton {tuning}: ")


# --- the checker can fail --------------------------------------------------------------------------

def test_mismatch_message_names_the_tensor_and_element():
    case = PthCase(num_tokens=3, head_size=16, num_heads=2, alloc="packed")
    inp = make_pth_inputs(case)
    want = expected_caches(case)
    torch_ref.run(inp.key, inp.value, *inp.caches, inp.slot_mapping, case.mode)
    s = int(inp.slot_mapping[1])
    inp.v_scale_cache[s // 16, s % 16, 1] += 1.0
    with pytest.raises(AssertionError, match=re.escape(f"v_scale_cache[{s // 16}, {s % 16}, 1]")):
        assert_pth_caches_equal(inp.caches, want, case.mode, _dq(case))


def test_fp8_nan_codes_equal_only_within_the_codes():
    case = PthCase(kv_quant_mode=FP8, alloc="separate", row_pad=4, num_tokens=1)
    inp = make_pth_inputs(case)
    a, b = clone_pth_caches(inp.caches), clone_pth_caches(inp.caches)
    a[0][0, 0, 0, 3], b[0][0, 0, 0, 3] = 0x7F, 0xFF  # both e4m3 NaN
    assert_pth_caches_equal(a, b, case.mode, _dq(case))
    pad_a, pad_b = storage_bytes(a[0]), storage_bytes(b[0])
    pad_a[64], pad_b[64] = 0x7F, 0xFF  # the first row's padding byte (Dq = 64)
    with pytest.raises(AssertionError, match="1 bytes differ"):
        assert_pth_caches_equal(a, b, case.mode, _dq(case))


# --- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arg, want", [
    ("int8_per_token_head", PerTokenHeadMode.INT8_PER_TOKEN_HEAD),
    (PerTokenHeadMode.INT4_PER_TOKEN_HEAD, PerTokenHeadMode.INT4_PER_TOKEN_HEAD),
    (None, PerTokenHeadMode.FP8_PER_TOKEN_HEAD),
])
def test_parse_kv_quant_mode(arg, want):
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import parse_kv_quant_mode
    assert parse_kv_quant_mode(arg, torch.float8_e4m3fn) is want
    assert parse_kv_quant_mode(None, torch.int8) is PerTokenHeadMode.INT8_PER_TOKEN_HEAD


def test_zero_tokens_is_a_no_op_and_implementations_register():
    inp = make_pth_inputs(PthCase(num_tokens=0, extra_rows=2, kv_quant_mode=INT4))
    before = [storage_bytes(c).clone() for c in inp.caches]
    kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args())  # no GPU: torch picked
    assert all(torch.equal(storage_bytes(c), b) for c, b in zip(inp.caches, before, strict=True))
    assert {s.name for s in kvwrite.implementations("cpu", OP)} == {"torch", "triton", "cuda"}
    assert "CUDA devices only" in registry.get(OP, "cuda").available("cpu")


# --- the round trip and a consumer ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_within_half_step(mode, dtype):
    """Write, read back with dequantize_per_token_head, compare with the input: every row
    within the format's half step (special rows are skipped where the contract gives no bound)."""
    for special in (False, True):
        case = PthCase(kv_quant_mode=mode, dtype=dtype, num_tokens=12, num_heads=4,
                       head_size=32, head_size_v=16, padding_slots=2, out_of_range_slots=1,
                       special_values=special, alloc="packed", vllm_rows=True)
        inp = make_pth_inputs(case)
        kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation="torch")
        assert check_roundtrip(*inp.args()) is None
        err = roundtrip_error(*inp.args())
        assert 0.0 < err <= 1.0, err
        if not special and mode != FP8:
            assert err > 0.5, err  # the bound is tight: some element is off by nearly s/2


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_check_catches_wrong_codes(mode, monkeypatch):
    case = PthCase(kv_quant_mode=mode, num_tokens=6, head_size=32, dtype=torch.float32)
    inp = make_pth_inputs(case)
    kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation="torch")
    s = int(inp.slot_mapping[2])
    token = 2
    code = inp.value_cache[s // 16, s % 16, 1, 3:4].view(torch.uint8)
    code ^= 0x22  # another code, 2+ steps away
    msg = check_roundtrip(*inp.args())
    assert msg is not None and msg.startswith("value: ") and f"token {token}, head 1" in msg, msg
    assert roundtrip_error(*inp.args()) > 1.0
    # Truncating instead of rounding stays within a whole step but not within half of one.
    if mode == INT8:
        monkeypatch.setattr(torch_ref, "rhaz", torch.trunc)
        inp = make_pth_inputs(case)
        kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation="torch")
        assert 1.0 < roundtrip_error(*inp.args()) < 2.1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout, alloc", [("NHD", "packed"), ("HND", "interleaved"),
                                           ("HND", "separate")])
def test_attention_over_dequantized_cache_matches_the_original(mode, layout, alloc):
    """The consumer's view: scaled_dot_product_attention (GQA, 4 query heads per KV head) over
    the K/V read back from the cache equals attention over the original K/V within the bound the
    format's half step implies: logits move by at most d = scale * sum_j |q_j| b_ij (b the
    per-element bound), so softmax weights by a factor within e^(+-2d), and the output by at
    most (e^(2d) - 1) max|v| + max b_v."""
    g = torch.Generator().manual_seed(MODES.index(mode))
    T, H, D, group = 40, 2, 64, 4
    k = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    q = torch.randn(3, H * group, D, generator=g, dtype=torch.float64)
    caches = kvwrite.create_per_token_head_caches(4, 16, H, D, mode, cache_layout=layout,
                                                  kv_alloc=alloc, device="cpu")
    slots = torch.randperm(64, generator=g)[:T]
    kvwrite.reshape_and_cache_flash_per_token_head_quant(k, v, *caches, slots, mode)
    kh = kvwrite.dequantize_per_token_head(caches[0], caches[2], slots, mode)
    vh = kvwrite.dequantize_per_token_head(caches[1], caches[3], slots, mode)
    pm = PerTokenHeadMode(mode)
    bs = 16
    bk = half_step_bound(k.float(), kh, caches[2][slots // bs, slots % bs], pm)  # [T, H, D]
    bv = half_step_bound(v.float(), vh, caches[3][slots // bs, slots % bs], pm)

    def attn(kk, vv):  # [T, H, D] -> [Hq, 3, D], float64
        kk = kk.double().permute(1, 0, 2).repeat_interleave(group, 0)
        vv = vv.double().permute(1, 0, 2).repeat_interleave(group, 0)
        return torch.nn.functional.scaled_dot_product_attention(q.permute(1, 0, 2), kk, vv)

    got, want = attn(kh, vh), attn(k.float(), v.float())
    scale = D**-0.5
    bkq = bk.permute(1, 0, 2).repeat_interleave(group, 0)  # [Hq, T, D]
    delta = (scale * torch.einsum("qhd,htd->hqt", q.abs(), bkq)).amax(-1)  # [Hq, 3]
    vmax = v.double().abs().amax()
    bound = (torch.exp(2 * delta) - 1) * vmax + bv.amax()
    err = (got - want).abs().amax(-1)
    assert (err <= bound + 1e-12).all(), (err.max(), bound.min())
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < {INT8: 0.02, FP8: 0.1, INT4: 0.3}[mode], rel


# --- the allocator and the reader ------------------------------------------------------------------

@pytest.mark.parametrize("mode, d", [(INT8, 128), (FP8, 64), (INT4, 128)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("alloc", ["packed", "interleaved", "separate"])
def test_create_per_token_head_caches_strides(mode, d, layout, alloc):
    nb, bs, h = 3, 16, 4
    kc, vc, ks, vs = kvwrite.create_per_token_head_caches(nb, bs, h, d, mode, cache_layout=layout,
                                                          kv_alloc=alloc, device="cpu")
    pm = PerTokenHeadMode(mode)
    dq = pm.quantized_size(d)
    assert kc.shape == vc.shape == (nb, bs, h, dq) and ks.shape == vs.shape == (nb, bs, h)
    assert kc.dtype == vc.dtype == (torch.int8 if mode == INT8 else torch.uint8)
    assert ks.dtype == vs.dtype == torch.float32
    hnd = layout == "HND"
    if alloc == "packed":
        r = 2 * (dq + 4)
        want = (bs * h * r, r, bs * r, 1) if hnd else (bs * h * r, h * r, r, 1)
        assert kc.stride() == vc.stride() == want
        assert vc.data_ptr() - kc.data_ptr() == dq + 4
        assert ks.data_ptr() - kc.data_ptr() == dq and vs.data_ptr() - kc.data_ptr() == 2 * dq + 4
        assert ks.stride() == tuple(s // 4 for s in want[:3])
        assert storage_bytes(kc).numel() == nb * bs * h * r
    elif alloc == "interleaved":
        r = dq + 4
        want = (2 * bs * h * r, r, bs * r, 1) if hnd else (2 * bs * h * r, h * r, r, 1)
        assert kc.stride() == vc.stride() == want
        assert vc.data_ptr() - kc.data_ptr() == bs * h * r
        assert ks.data_ptr() - kc.data_ptr() == dq and vs.data_ptr() - vc.data_ptr() == dq
        assert storage_bytes(kc).numel() == 2 * nb * bs * h * r
    else:
        want = (bs * h * dq, dq, bs * dq, 1) if hnd else (bs * h * dq, h * dq, dq, 1)
        assert kc.stride() == vc.stride() == want
        assert ks.stride() == ((bs * h, 1, bs) if hnd else (bs * h, h, 1))
        assert len({t.untyped_storage().data_ptr() for t in (kc, vc, ks, vs)}) == 4
    # Data 0, scales 1.0, and nothing else in the allocations.
    assert not kc.view(torch.uint8).any() and not vc.view(torch.uint8).any()
    assert (ks == 1.0).all() and (vs == 1.0).all()
    total = sum(storage_bytes(t).numel() for t in {t.untyped_storage().data_ptr(): t
                                                   for t in (kc, vc, ks, vs)}.values())
    assert total == 2 * nb * bs * h * (dq + 4)
    # The caches take the op's writes.
    x = torch.randn(5, h, d, dtype=torch.bfloat16)
    kvwrite.reshape_and_cache_flash_per_token_head_quant(x, x, kc, vc, ks, vs,
                                                         torch.arange(5) * 7, mode)
    assert check_roundtrip(x, x, kc, vc, ks, vs, torch.arange(5) * 7, mode) is None


@pytest.mark.parametrize("args, kwargs, text", [
    ((2, 16, 4, 6, INT8), {}, "head_size: kv_alloc='packed' stores each float32 scale"),
    ((2, 16, 4, 12, INT4), {"kv_alloc": "interleaved"}, "head_size: kv_alloc='interleaved'"),
    ((2, 16, 4, 7, INT4), {"kv_alloc": "separate"}, "head_size: kv_quant_mode='int4_per_token_head' packs two"),
    ((2, 16, 4, 64, INT8), {"kv_alloc": "fused"}, "kv_alloc: expected 'packed', 'interleaved' or 'separate'"),
    ((2, 16, 4, 64, INT8), {"cache_layout": "NDH"}, "cache_layout: expected 'NHD' or 'HND'"),
    ((2, 16, 4, 64, None), {}, "kv_quant_mode: expected one of"),
    ((2, 16, 4, 64, "int8"), {}, "kv_quant_mode: expected one of"),
    ((0, 16, 4, 64, INT8), {}, "num_blocks: expected a positive integer"),
    ((2, 16, 4, 0, INT8), {}, "head_size: expected a positive integer"),
])
def test_create_per_token_head_caches_errors(args, kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        kvwrite.create_per_token_head_caches(*args, device="cpu", **kwargs)


def test_create_separate_allows_any_head_size():
    kc, _, ks, _ = kvwrite.create_per_token_head_caches(2, 4, 3, 6, INT8, kv_alloc="separate",
                                                        device="cpu")
    assert kc.shape == (2, 4, 3, 6) and ks.shape == (2, 4, 3)


def test_dequantize_reads_the_documented_bytes():
    """Hand-written rows: int8 codes times s, fp8 codes times s, int4 (q - zp) times s' with the
    even element in the low nibble and zp in the scale's low bits."""
    s = 0.37
    slots = torch.tensor([5])
    c8 = torch.zeros(1, 8, 1, 4, dtype=torch.int8)
    c8[0, 5, 0] = torch.tensor([127, -128, 1, -1])
    sc = torch.full((1, 8, 1), s)
    got = kvwrite.dequantize_per_token_head(c8, sc, slots, INT8)
    s32 = torch.tensor(s, dtype=torch.float32)
    assert torch.equal(got[0, 0], torch.tensor([127.0, -128.0, 1.0, -1.0]) * s32)
    cf = torch.zeros(1, 8, 1, 4, dtype=torch.uint8)
    cf[0, 5, 0] = torch.tensor([0x7E, 0xF6, 0x38, 0x80], dtype=torch.uint8)  # 448, -224, 1, -0
    got = kvwrite.dequantize_per_token_head(cf, sc, slots, FP8)
    assert got[0, 0].tolist() == (torch.tensor([448.0, -224.0, 1.0, -0.0]) * s32).tolist()
    c4 = torch.zeros(1, 8, 1, 2, dtype=torch.uint8)
    c4[0, 5, 0] = torch.tensor([0x3A, 0x07], dtype=torch.uint8)  # q = 10, 3, 7, 0
    bits = (s32.view(torch.int32) & -16) | 7
    sc4 = bits.view(torch.float32).expand(1, 8, 1).clone()
    got = kvwrite.dequantize_per_token_head(c4, sc4, slots, INT4)
    sp = (s32.view(torch.int32) & -16).view(torch.float32)
    assert torch.equal(got[0, 0], torch.tensor([3.0, -4.0, 0.0, -7.0]) * sp)
    assert kvwrite.dequantize_per_token_head(c4, sc4, slots, INT4, head_size=2).shape == (1, 1, 2)


@pytest.mark.parametrize("call, text", [
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s, torch.tensor([0, 8]), INT8),
     "slot_mapping: expected every slot in [0, 8)"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s, torch.tensor([-1]), INT8),
     "slot_mapping: expected every slot in [0, 8)"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s, torch.tensor([0.0]), INT8),
     "slot_mapping: expected dtype int64 or int32"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s, torch.tensor([0]), INT8, head_size=5),
     "head_size: 5 needs 5 code bytes per row"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s, torch.tensor([0]), FP8),
     "cache: kv_quant_mode='fp8_per_token_head' expects a cache of dtype"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c, s[:, :4], torch.tensor([0]), INT8),
     "scale_cache: expected shape"),
    (lambda c, s: kvwrite.dequantize_per_token_head(c.view(torch.uint8), s, torch.tensor([0]), None),
     "kv_quant_mode: None infers the mode from cache.dtype"),
])
def test_dequantize_errors(call, text):
    c = torch.zeros(1, 8, 1, 4, dtype=torch.int8)
    s = torch.ones(1, 8, 1)
    with pytest.raises(ValueError, match=re.escape(text)):
        call(c, s)


# --- CUDA: NVRTC compiles, launch plans and machine code (no GPU needed) -----------------------------


def _cuda_impl():
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import cuda_impl
    return cuda_impl


def _plan(case: PthCase, tuning=None):
    c = _cuda_impl()
    inp = make_pth_inputs(case)
    args = (inp.key, inp.value, *inp.caches, inp.slot_mapping, case.mode)
    return c.plan(*args) if tuning is None else c.plan(*args, tuning)


@needs_nvrtc
def test_nvrtc_compiles_for_other_architectures():
    """The software fp8 conversion (before sm_89) and a newer architecture."""
    c = _cuda_impl()
    names = [c.kernel_name(k, m, v, 1) for k in (0, 2) for m in (0, 1, 2) for v in (4, 1)]
    for arch in ("sm_80", "sm_100"):
        obj, _ = c.compile_kernel(arch, names)
        assert len(bytes(obj.code)) > 0


@needs_nvrtc
def test_nvrtc_compiles_specialized_builds():
    c = _cuda_impl()
    for case in (PthCase(kv_quant_mode=FP8, vllm_rows=True, layout="HND"),
                 PthCase(kv_quant_mode=INT4, head_size=30, head_pad=1, alloc="separate"),
                 PthCase(head_size=46, head_size_v=80, block_size=12, slot_dtype=torch.int32,
                         dtype=torch.float32, alloc="separate")):
        for tuning in (c.TUNING, c.CudaTuning(large_call_bytes=0)):
            p = _plan(case, tuning)
            obj, _ = c.compile_kernel("sm_90", p.name, fixed=p.fixed)
            assert len(bytes(obj.code)) > 0
    with pytest.raises(RuntimeError, match="25 values"):
        c.compile_kernel("sm_90", p.name, fixed=(1, 2, 3))


@pytest.mark.parametrize("case, vec, cpl, lanes, sw", [
    (PthCase(head_size=128, alloc="separate"), 8, 1, 16, 8),  # 16-byte loads, 8-byte stores
    (PthCase(head_size=128, alloc="packed"), 8, 1, 16, 4),  # V rows 4-byte aligned (Dq + 4)
    (PthCase(head_size=128, alloc="packed", kv_quant_mode=INT4), 8, 1, 16, 4),  # 4-byte codes
    (PthCase(head_size=256, alloc="interleaved", dtype=torch.float32), 4, 2, 32, 4),
    (PthCase(head_size=64, alloc="separate", dtype=torch.float32), 4, 1, 16, 4),
    (PthCase(head_size=64, head_size_v=80, alloc="separate"), 8, 1, 16, 8),
    (PthCase(head_size=46, alloc="separate"), 2, 1, 32, 2),
    (PthCase(head_size=13, head_size_v=7, alloc="separate"), 1, 1, 16, 1),
    (PthCase(head_size=30, head_pad=1, alloc="separate", kv_quant_mode=INT4), 1, 1, 32, 1),
    (PthCase(head_size=2, num_heads=1, alloc="separate", kv_quant_mode=INT4, head_pad=1), 1, 1,
     2, 1),
    (PthCase(head_size=512, alloc="separate"), 8, 2, 32, 8),
    (PthCase(head_size=1, alloc="separate"), 1, 1, 1, 1),
    # Loads as wide as the input allows, stores as wide as the rows allow (odd row strides).
    (PthCase(head_size=64, alloc="separate", row_pad=1), 8, 1, 8, 1),
])
def test_cuda_plan_picks_aligned_chunks_and_lanes(case, vec, cpl, lanes, sw):
    p = _plan(case)
    assert (p.vec, p.cpl, p.lanes, p.sw) == (vec, cpl, lanes, sw), p
    assert p.name == _cuda_impl().kernel_name(
        {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[case.dtype],
        MODES.index(case.kv_quant_mode), vec, cpl)
    assert len(p.fixed) == _cuda_impl().NUM_FIXED and p.fixed[-1] == sw.bit_length() - 1


def test_cuda_plan_large_calls_take_their_elements_per_lane_and_long_rows_are_refused():
    """Large calls' plans (by default 16 elements per lane for int8 and fp8, 32 for int4, as
    measured best; 32 or 64 when tuned), and the refusals: rows of more than 64 elements or 8
    chunks per lane of 32."""
    c = _cuda_impl()
    default = c.CudaTuning(large_call_bytes=0, large_elems_per_lane=None)
    p = _plan(PthCase(head_size=128, alloc="packed"), default)
    assert (p.vec, p.cpl, p.lanes) == (8, 2, 8)
    p = _plan(PthCase(head_size=128, alloc="packed", kv_quant_mode=INT4), default)
    assert (p.vec, p.cpl, p.lanes) == (8, 4, 4)
    large = c.CudaTuning(large_call_bytes=0, large_elems_per_lane=32)
    p = _plan(PthCase(head_size=128, alloc="separate"), large)
    assert (p.vec, p.cpl, p.lanes) == (8, 4, 4)
    p = _plan(PthCase(head_size=128, alloc="packed"), large)
    assert (p.vec, p.cpl, p.lanes, p.sw) == (8, 4, 4, 4)
    p = _plan(PthCase(head_size=64, alloc="packed", kv_quant_mode=INT4), large)
    assert (p.vec, p.cpl, p.lanes) == (8, 4, 2)
    p = _plan(PthCase(head_size=256, alloc="separate", dtype=torch.float32), large)
    assert (p.vec, p.cpl, p.lanes) == (4, 8, 8)
    case = PthCase(head_size=128, alloc="separate")
    inp = make_pth_inputs(case)
    n = inp.slot_mapping.numel() * case.num_heads * 256 * 2
    assert not c.is_large_call(inp.slot_mapping.numel(), inp.key, inp.value,
                               c.CudaTuning(large_call_bytes=n))
    assert c.is_large_call(inp.slot_mapping.numel(), inp.key, inp.value,
                           c.CudaTuning(large_call_bytes=n - 1))
    long = make_pth_inputs(PthCase(head_size=259, alloc="separate", num_tokens=1))  # 1-element chunks
    reason = c.unsupported(long.key, long.value, long.key_cache, long.value_cache,
                           PerTokenHeadMode.INT8_PER_TOKEN_HEAD)
    assert reason and "chunks per lane" in reason
    ok = make_pth_inputs(PthCase(head_size=512, alloc="separate", num_tokens=1))
    assert c.unsupported(ok.key, ok.value, ok.key_cache, ok.value_cache,
                         PerTokenHeadMode.INT8_PER_TOKEN_HEAD) is None
    # 64 elements per lane: two lanes per row of 128, and rows up to 2048 in 16-byte chunks.
    p = _plan(PthCase(head_size=128, alloc="packed"),
              c.CudaTuning(large_call_bytes=0, large_elems_per_lane=64))
    assert (p.vec, p.cpl, p.lanes, p.sw) == (8, 8, 2, 4)
    for d, refused in ((2048, False), (2056, True), (1024, False)):
        x = make_pth_inputs(PthCase(head_size=d, alloc="separate", num_tokens=1, num_heads=1,
                                    num_blocks=1, dtype=torch.float32 if d == 1024 else
                                    torch.bfloat16))
        reason = c.unsupported(x.key, x.value, x.key_cache, x.value_cache,
                               PerTokenHeadMode.INT8_PER_TOKEN_HEAD)
        assert (reason is not None) == refused, (d, reason)


def test_cuda_plans_every_gpu_case_it_does_not_refuse():
    """Every case of the GPU matrix and the sanitize list gets a plan from the small-call and the
    large-call tuning alike, unless unsupported() refuses it up front (as select() asks)."""
    from tools.sanitize import reshape_and_cache_flash_per_token_head_quant as sanitize
    c = _cuda_impl()
    refused = 0
    for case in PTH_GPU_CASES + sanitize.CASES:
        # A few tokens and blocks: the plan depends on the shapes and strides, not the sizes.
        case = dataclasses.replace(case, num_tokens=min(case.num_tokens, 4), padding_slots=0,
                                   out_of_range_slots=0, num_blocks=1, block_size=max(
                                       case.block_size, 4), num_heads=min(case.num_heads, 4))
        inp = make_pth_inputs(case)
        reason = c.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache, case.mode)
        for tuning in (c.TUNING, c.CudaTuning(large_call_bytes=0)):
            p = c.plan(inp.key, inp.value, *inp.caches, inp.slot_mapping, case.mode, tuning)
            assert isinstance(p, str) == (reason is not None), (case.id, p, reason)
        refused += reason is not None
    assert refused == 0


def _sass_tools():
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    return sass_tools


_MEMORY_OPS = ("LDG", "STG", "LD.", "ST.", "ATOM", "RED")


@needs_nvrtc
def test_pdl_builds_wait_before_any_memory_access(tmp_path):
    """sm_90: the PDL build of every mode and input kind waits (ACQBULK) and triggers (PREEXIT)
    before its first global access; the plain build has neither."""
    from kvwrite.kernels import nvrtc
    sass_tools = _sass_tools()
    c = _cuda_impl()
    names = [c.kernel_name(k, m, v, cpl) for k, m, v, cpl in
             ((1, 0, 8, 1), (1, 1, 4, 2), (1, 2, 1, 8), (2, 0, 1, 1), (2, 1, 2, 4), (0, 2, 8, 2))]
    pdl, _ = c.compile_kernel("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    funcs = sass_tools.functions(sass_tools.dump_sass(bytes(pdl.code), tmp_path))
    assert len(funcs) == len(names)
    sass_tools.assert_waits_first(funcs, memory_ops=_MEMORY_OPS)
    plain, _ = c.compile_kernel("sm_90", names[:4])
    sass_tools.assert_no_pdl(sass_tools.dump_sass(bytes(plain.code), tmp_path))


@needs_nvrtc
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mode", MODES)
def test_specialized_build_reads_no_fixed_argument_and_loads_rows_first(tmp_path, mode,
                                                                         slot_dtype):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: 7 pointers and num_tokens
    (0x210-0x24f), then the 25 fixed arguments (0x250-0x317). The specialized build reads none
    of them, the generic one does; and no build waits for a load (the slot's) before it has
    issued the row's 16-byte loads (sass.waits_before_loads)."""
    sass_tools = _sass_tools()
    c = _cuda_impl()
    p = _plan(PthCase(kv_quant_mode=mode, head_size=128, alloc="separate", slot_dtype=slot_dtype))
    assert p.vec == 8

    def reads(fixed):
        obj, _ = c.compile_kernel("sm_90", p.name, fixed=fixed)
        text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
        return text, sass_tools.param_reads(text)

    first, end = 0x250, 0x250 + 8 * c.NUM_FIXED
    generic_text, generic = reads(None)
    special_text, special = reads(p.fixed)
    sass_tools.assert_fixed_args_compiled_in(generic, special, first, end)
    for text in (special_text, generic_text):
        assert not sass_tools.late_issues(text, lambda t: ".128" in t.split()[0])


# The fast path's machine code for the benchmark's shape (vLLM's packed rows, H=8, D=128,
# bfloat16, the large calls' plan: 4 lanes of 32 elements per row), built alone
# (KVWRITE_PTH_FAST_ONLY; int4: its loop without the top clamp alone, the rows' common case,
# KVWRITE_PTH_COUNT_UNCLAMPED): instructions at most (measured 386 / 312 / 375 when pinned,
# i.e. 12.1 / 9.8 / 11.7 per element, against 17.2 / 14 / about 22 of the kernel before it).
_FAST_PATH_BUDGET = {INT8: 400, FP8: 325, INT4: 390}
_COUNT_MACROS = ("KVWRITE_PTH_FAST_ONLY", "KVWRITE_PTH_COUNT_UNCLAMPED")


def _bench_plan(mode: str, elems: int = 32):
    c = _cuda_impl()
    return _plan(PthCase(kv_quant_mode=mode, head_size=128, num_heads=8, alloc="packed",
                         via_allocator=True),
                 c.CudaTuning(large_call_bytes=0, large_elems_per_lane=elems))


def _build(p, macros=()):
    """(SASS listing, registers, spilled bytes) of plan p's specialized sm_90 build."""
    c = _cuda_impl()
    obj, log = c.compile_kernel("sm_90", p.name, fixed=p.fixed, macros=macros, ptxas_verbose=True)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return obj, regs, spills


@needs_nvrtc
@pytest.mark.parametrize("mode", MODES)
def test_fast_path_machine_code_shape(tmp_path, mode):
    """sm_90, the benchmark's shape. The fast path alone: at most _FAST_PATH_BUDGET
    instructions; per element one product and two fused multiply-adds for the quotient (FMUL,
    FFMA counts), no conversion instruction (F2I, I2F, F2F), one reciprocal (MUFU), no call;
    the reductions on bfloat16 pairs (HMNMX2 / VHMNMX, one per word or less); the row's four
    16-byte loads and the slot's; the codes in 4-byte stores (the rows' alignment), 2 per chunk
    (int8, fp8) or 1 (int4), and the scale's. The whole kernel (both paths): at most 32
    registers (full occupancy at 256 threads), no spills, every load (the row's and the slot's)
    issued before any arithmetic on the row and before any wait for a load."""
    sass_tools = _sass_tools()
    p = _bench_plan(mode)
    assert (p.vec, p.cpl, p.lanes, p.sw) == (8, 4, 4, 4)
    elems = p.vec * p.cpl
    obj, regs, spills = _build(p, _COUNT_MACROS)
    ops = [o for o in sass_tools.opcodes(sass_tools.dump_sass(bytes(obj.code), tmp_path))
           if o != "NOP;" and not o.startswith("BRA")]
    base = [o.split(".")[0] for o in ops]
    n = collections.Counter(base)
    assert len(ops) <= _FAST_PATH_BUDGET[mode], (len(ops), n.most_common(12))
    assert elems <= n["FMUL"] <= elems + 8 and 2 * elems <= n["FFMA"] <= 2 * elems + 10, n
    assert not any(k in n for k in ("F2I", "I2F", "F2F", "CALL", "FCHK", "I2FP", "F2IP")), n
    assert n["MUFU"] == 1 and n["LDL"] == n["STL"] == 0, n
    if mode == INT4:
        assert 0 < n["VHMNMX"] + n["HMNMX2"] <= 2 * p.cpl * 4, n
    else:
        assert n["HMNMX2"] == p.cpl * 4, n  # one per word of two elements
    assert sorted(o for o in ops if o.startswith("LDG")) == \
        ["LDG.E.128.CONSTANT"] * p.cpl + ["LDG.E.64.CONSTANT"]
    stores = [o for o in ops if o.startswith("STG")]
    per_chunk = 1 if mode == INT4 else 2
    assert stores == ["STG.E"] * (p.cpl * per_chunk + 1), stores
    obj, regs, spills = _build(p)
    assert regs <= 32 and spills == 0, (regs, spills)
    text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
    ops = sass_tools.opcodes(text)
    loads = [i for i, o in enumerate(ops) if o.startswith("LDG")]
    first_math = min(i for i, o in enumerate(ops) if o.split(".")[0] in ("HMNMX2", "VHMNMX",
                                                                         "FMNMX", "FMUL"))
    assert len(loads) == p.cpl + 1 and max(loads) < first_math, ops[:first_math + 2]
    # No wait for a load before the last of them is issued (a round trip each otherwise).
    assert not sass_tools.late_issues(text, lambda t: True)
    assert not any(o.startswith(("LDL", "STL")) for o in ops)


@needs_nvrtc
def test_fast_path_64_elements_per_lane_machine_code(tmp_path):
    """The other plan for large calls (2 lanes of 64 elements per row): fewer instructions per
    element than 32 (the per-row work amortized), 8 loads of 16 bytes, at most 48 registers and
    no spills."""
    sass_tools = _sass_tools()
    for mode in MODES:
        p = _bench_plan(mode, 64)
        assert (p.vec, p.cpl, p.lanes) == (8, 8, 2)
        obj, _, _ = _build(p, _COUNT_MACROS)
        ops = [o for o in sass_tools.opcodes(sass_tools.dump_sass(bytes(obj.code), tmp_path))
               if o != "NOP;" and not o.startswith("BRA")]
        assert len(ops) / 64 < _FAST_PATH_BUDGET[mode] / 32 - 1.0, (mode, len(ops))
        assert sum(o == "LDG.E.128.CONSTANT" for o in ops) == 8
        _, regs, spills = _build(p)
        assert regs <= 48 and spills == 0, (mode, regs, spills)


def test_sanitize_cases_are_listed():
    from tools.sanitize import reshape_and_cache_flash_per_token_head_quant as sanitize
    found = sanitize.cases()
    ids = [i for i, _ in found]
    assert len(found) >= 6 and len(set(ids)) == len(ids)
    assert all(callable(f) for _, f in found)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_torch_compile_of_packed_views_cpu(impl):
    _compile_case(impl, "cpu", INT4)


# --- torch.compile, CUDA graphs and the GPU matrix ---------------------------------------------------

def _compile_case(impl: str, device: str, mode: str):
    """The op under torch.compile with a packed allocation passed in and its four views taken
    inside the compiled function (aot_autograd refuses mutated graph inputs that are views of
    one allocation with different dtypes, as the packed caches' codes and float32 scales are);
    separate caches passed in: tests/test_conformance.py."""
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    case = PthCase(kv_quant_mode=mode, num_tokens=9, padding_slots=2, fused_qkv=True,
                   alloc="separate", head_size=32)
    inp = make_pth_inputs(case, device)
    if (reason := info.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache,
                                   case.mode)) is not None:
        pytest.skip(reason)

    # A packed allocation, its views taken inside.
    pm = PerTokenHeadMode(mode)
    dq = pm.quantized_size(32)
    row = dq + 4
    raw = torch.randint(0, 256, (4, 16, 4, 2 * row), dtype=torch.uint8).to(device)
    want = raw.clone()

    def views(r):
        f32 = r.view(torch.float32)
        return (r[..., :dq].view(pm.storage_dtype), r[..., row:row + dq].view(pm.storage_dtype),
                f32[..., dq // 4], f32[..., (row + dq) // 4])

    def packed_step(key, value, r, slots):
        kvwrite.reshape_and_cache_flash_per_token_head_quant(key, value, *views(r), slots, mode,
                                                             implementation=impl)

    torch._dynamo.reset()
    torch.compile(packed_step, fullgraph=True, backend="aot_eager")(
        inp.key, inp.value, raw, inp.slot_mapping)
    torch_ref.run(inp.key, inp.value, *views(want), inp.slot_mapping, pm)
    assert_pth_caches_equal(views(raw), views(want), pm, (dq, dq))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_torch_compile_of_packed_views(impl, mode):
    _compile_case(impl, "cuda", mode)


def _gpu_reference(case: PthCase, seed: int = 0):
    """The case's inputs on the GPU and the torch reference's caches for them (on the GPU)."""
    inp = make_pth_inputs(case, "cuda", seed)
    want = clone_pth_caches(inp.caches)
    if inp.slot_mapping.numel():
        torch_ref.run(inp.key, inp.value, *want, inp.slot_mapping, case.mode)
    return inp, want


@pytest.mark.gpu
@pytest.mark.parametrize("case", PTH_GPU_CASES[::9], ids=lambda c: c.id)
def test_gpu_reference_matches_cpu_reference(case):
    """The reference's arithmetic on the GPU (CUDA's division and casts) writes the CPU's bytes."""
    inp, want = _gpu_reference(case)
    cpu = make_pth_inputs(case)
    torch_ref.run(cpu.key, cpu.value, *cpu.caches, cpu.slot_mapping, case.mode)
    assert_pth_caches_equal(clone_pth_caches(want, "cpu"), cpu.caches, case.mode, _dq(case),
                            "GPU reference vs CPU reference: ")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "torch"])
@pytest.mark.parametrize("case", PTH_GPU_CASES, ids=lambda c: c.id)
def test_gpu_matches_reference(impl, case):
    """The GPU matrix: every mode x input dtype x head size x layout and allocation (and the
    cycled factors), Dk != Dv, odd and unaligned shapes, special values, large calls; the four
    tensors' whole allocations byte for byte against the torch reference on the GPU."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    inp, want = _gpu_reference(case)
    if (reason := info.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache,
                                   case.mode)) is not None:
        pytest.skip(reason)
    kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation=impl)
    torch.cuda.synchronize()
    assert_pth_caches_equal(inp.caches, want, case.mode, _dq(case), f"{impl}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in PTH_CASES if c.special_values or c.vllm_rows
                                  or c.mode_arg != "str" or c.via_allocator or c.dk != c.dv],
                         ids=lambda c: c.id)
def test_gpu_cpu_matrix_against_oracle(case):
    """The CPU matrix's special cases (oracle-checked) on the GPU for the three implementations."""
    for impl in IMPLS:
        info = registry.get(OP, impl)
        if info.available("cuda") is not None:
            continue
        inp = make_pth_inputs(case, "cuda")
        if info.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache, case.mode):
            continue
        kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation=impl)
        assert_pth_caches_equal(clone_pth_caches(inp.caches, "cpu"), expected_caches(case),
                                case.mode, _dq(case), f"{impl}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
@pytest.mark.parametrize("case", PTH_GPU_CASES, ids=lambda c: c.id)
def test_gpu_triton_large_tiling(case, fast):
    """The GPU matrix through the Triton kernel in the large calls' tiling, where its fast path
    runs (most cases are small calls, which take the small grids' tiling and the general path),
    and with the fast path turned off: every mode, shape, layout and allocation, odd head sizes
    (masked halves), special values; whole allocations against the reference."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    if (reason := triton_impl.available(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    inp, want = _gpu_reference(case)
    if inp.slot_mapping.numel():
        triton_impl.run(inp.key, inp.value, *inp.caches, inp.slot_mapping, case.mode,
                        tuning=triton_impl.TritonTuning(small_grid=0, fast_path=fast))
    torch.cuda.synchronize()
    assert_pth_caches_equal(inp.caches, want, case.mode, _dq(case), f"triton fast={fast}: ")


_BUILD_VARIANTS = (
    [(c, v) for v in ("generic", "large-call", "generic-large-call", "threads-64")
     for c in PTH_GPU_CASES[::8]]
    + [(c, v) for v in ("general-path", "large-call-64", "general-path-large-call")
       for c in PTH_GPU_CASES[::16]])


@pytest.mark.gpu
@pytest.mark.parametrize("case, variant", _BUILD_VARIANTS,
                         ids=[f"{c.id}-{v}" for c, v in _BUILD_VARIANTS])
def test_gpu_cuda_builds(case, variant):
    """The cuda kernel's other builds over part of the matrix: generic (runtime arguments), the
    large calls' plan (32 elements per lane, or 64) forced on small calls, both, 64-thread CTAs,
    and every row down the general path (which otherwise runs only NaN, infinite and int4
    one-sign rows)."""
    c = _cuda_impl()
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    tuning = c.CudaTuning(specialize="generic" not in variant,
                          large_call_bytes=0 if "large" in variant else c.TUNING.large_call_bytes,
                          large_elems_per_lane=64 if variant.endswith("-64") else 32,
                          threads=64 if variant == "threads-64" else c.TUNING.threads,
                          general_path_only=variant.startswith("general-path"))
    inp, want = _gpu_reference(case)
    if (reason := c.unsupported(inp.key, inp.value, inp.key_cache, inp.value_cache,
                                case.mode)) is not None:
        pytest.skip(reason)
    if inp.slot_mapping.numel():
        c.run(inp.key, inp.value, *inp.caches, inp.slot_mapping, case.mode, tuning=tuning)
    torch.cuda.synchronize()
    assert_pth_caches_equal(inp.caches, want, case.mode, _dq(case), f"cuda {variant}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_row_sweep(impl, mode, dtype):
    """Every 16-bit input pattern (16-bit dtypes), random rows over many binades, tie rows and
    the special rows, as key and value rows of one call, against the reference."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    x = _sweep_rows(dtype, 32, seed=MODES.index(mode)).cuda()
    n = x.shape[0] // 4 * 4
    key = x[:n].view(-1, 4, 32)
    value = x[:n].flip(0).reshape(-1, 4, 32)
    t = key.shape[0]
    bs = 16
    nb = -(-t // bs)
    caches = kvwrite.create_per_token_head_caches(nb, bs, 4, 32, mode, kv_alloc="packed",
                                                  device="cuda")
    storage_bytes(caches[0]).copy_(torch.randint(0, 256, storage_bytes(caches[0]).shape,
                                                 dtype=torch.uint8, device="cuda"))
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    want = clone_pth_caches(caches)
    torch_ref.run(key, value, *want, slots, PerTokenHeadMode(mode))
    kvwrite.reshape_and_cache_flash_per_token_head_quant(key, value, *caches, slots, mode,
                                                         implementation=impl)
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(mode), (32 // (2 if mode == INT4 else 1),) * 2,
                            f"{impl}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["small", "large-32", "large-64", "general-path"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_cuda_row_sweep_rows_of_128(mode, dtype, plan):
    """The sweep's rows (every 16-bit pattern, random rows over many binades, ties, special
    rows) as rows of 128 in vLLM's packed layout (the benchmark's shape: H=8), through each of
    the cuda kernel's plans: warps whose rows take the fast path and the general path side by
    side (and every row down the general path); whole allocations against the reference."""
    c = _cuda_impl()
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    x = _sweep_rows(dtype, 128, seed=20 + MODES.index(mode)).cuda()
    n = x.shape[0] // 8 * 8
    key = x[:n].view(-1, 8, 128)
    value = x[:n].flip(0).reshape(-1, 8, 128)
    t = key.shape[0]
    bs = 16
    nb = -(-t // bs) + 1
    caches = kvwrite.create_per_token_head_caches(nb, bs, 8, 128, mode, kv_alloc="packed",
                                                  device="cuda")
    storage_bytes(caches[0]).copy_(torch.randint(0, 256, storage_bytes(caches[0]).shape,
                                                 dtype=torch.uint8, device="cuda"))
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[::17] = -1
    want = clone_pth_caches(caches)
    pmode = PerTokenHeadMode(mode)
    torch_ref.run(key, value, *want, slots, pmode)
    tuning = c.CudaTuning(large_call_bytes=c.TUNING.large_call_bytes if plan == "small" else 0,
                          large_elems_per_lane=64 if plan == "large-64" else 32,
                          general_path_only=plan == "general-path")
    c.run(key, value, *caches, slots, pmode, tuning=tuning)
    torch.cuda.synchronize()
    dq = 64 if mode == INT4 else 128
    assert_pth_caches_equal(caches, want, pmode, (dq, dq), f"cuda {plan}: ")


@pytest.mark.gpu
def test_gpu_sanitize_cases_pass():
    from tools.sanitize import reshape_and_cache_flash_per_token_head_quant as sanitize
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    failed = {i: msg for i, f in sanitize.cases() if (msg := f()) is not None}
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_roundtrip_of_every_implementation(mode):
    """The benchmark's check (check_roundtrip) on each implementation's GPU write."""
    for impl in IMPLS:
        case = PthCase(kv_quant_mode=mode, num_tokens=512, num_heads=8, head_size=128,
                       num_blocks=64, alloc="packed", vllm_rows=True)
        inp = make_pth_inputs(case, "cuda")
        kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args(), implementation=impl)
        assert check_roundtrip(*inp.args()) is None, impl
        assert 0.5 < roundtrip_error(*inp.args()) <= 1.0


def test_torch_compile_with_packed_views_as_inputs_refuses_or_is_right():
    """Packed caches passed straight into a compiled function are mutated graph inputs that are
    views of one allocation with different dtypes: PyTorch's aot_autograd refuses them (the docs
    say to pass the allocation and take the views inside). Should a later PyTorch accept them,
    the bytes must be right."""
    caches = kvwrite.create_per_token_head_caches(4, 16, 2, 16, INT4, device="cpu")
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([1, 5, -1, 9, 63])

    def step(key, value, kc, vc, ks, vs, slots):
        kvwrite.reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slots,
                                                             INT4)

    want = clone_pth_caches(caches)
    step(key, value, *want, slots)
    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True, backend="aot_eager")(key, value, *caches, slots)
    except Exception as e:  # the refusal
        assert "views with different dtypes" in str(e), e
        return
    assert_pth_caches_equal(caches, want, PerTokenHeadMode(INT4), (8, 8))


_TRITON_PTX_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl as ti

def ptx(mode, align, small):
    k = ti._pth_kernel
    bt, bh, warps = ti.tiling(8, 128, 128, ti.TUNING, small)
    types = {"key_ptr": "*bf16", "value_ptr": "*bf16", "kc_ptr": "*u8", "vc_ptr": "*u8",
             "ks_ptr": "*fp32", "vs_ptr": "*fp32", "slot_mapping_ptr": "*i64", "num_tokens": "i32"}
    for n in ("K_TOK", "K_HEAD", "V_TOK", "V_HEAD", "KC_B", "KC_S", "KC_H", "VC_B", "VC_S",
              "VC_H", "KS_B", "KS_S", "KS_H", "VS_B", "VS_S", "VS_H", "NUM_SLOTS", "H"):
        types[n] = "i32"
    consts = dict(DK=128, DV=128, BLOCK_DK=128, BLOCK_DV=128, BLOCK_T=bt, BLOCK_H=bh, MODE=mode,
                  PDL=False, PDL_TRIGGER=False, BLOCK_SIZE=16, ALIGN=align, COMPILED=True,
                  NATIVE=True, FAST=not small)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
    opts = {"num_warps": warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

out = {}
for mode, align, small in ((0, 4, False), (1, 4, True), (2, 4, False), (2, 4, True),
                           (0, 1, False)):
        t = ptx(mode, align, small)
        out[f"{mode}-{align}-{small}"] = [t.count("st.global.b8"), t.count("st.global.b32"),
                                          t.count("cvt.rzi") + t.count("cvt.rmi") +
                                          t.count("cvt.rpi") + t.count("cvt.rni"),
                                          t.count("div.s64") + t.count("div.u64") +
                                          t.count("rem.s64") + t.count("rem.u64"),
                                          t.count("add.rm.f32")]
print(json.dumps(out))
"""


def test_triton_kernel_compiles_for_sm90_with_wide_code_stores():
    """The Triton kernel compiled for sm_90 (no GPU needed), the benchmark's shape: with rows
    4-byte aligned (ALIGN, vLLM's packed layout) the codes go out in 4-byte stores, with no
    alignment in bytes (the check can fail); no float-to-integer rounding conversion (the exact
    roundings take additions) and no 64-bit division (the block size is a constant), in the
    large calls' tiling and the small grids'; int8's and int4's large calls with their fast
    path's directed additions."""
    out = run_triton_script(_TRITON_PTX_SCRIPT)
    for key, (b8, b32, cvt, div, add_rm) in out.items():
        mode, align, small = key.split("-")
        if align == "4":
            assert b8 == 0 and b32 > 0 and div == 0, (key, out)
            assert cvt == 0 or mode == "1", (key, out)
            assert (add_rm > 0) == (mode != "1" and small == "False"), (key, out)
    assert out["0-1-False"][0] > 0, out


def test_triton_call_tiling_spreads_small_grids():
    """Calls of few programs take the small-grid tiling: fewer elements per thread (8 at H=8,
    D=128), one token per program."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    large = triton_impl.tiling(8, 128, 128)
    assert large == (2, 8, 4)  # 32 elements per thread
    assert triton_impl.call_tiling(1, 8, 128, 128) == (1, 8, 8)  # 8 per thread
    assert triton_impl.call_tiling(16, 8, 128, 128) == (1, 8, 8)
    assert triton_impl.call_tiling(4096, 8, 128, 128) == large
    none = triton_impl.TritonTuning(small_grid=0)
    assert triton_impl.call_tiling(1, 8, 128, 128, none) == large


def test_triton_tiling_is_powers_of_two_within_the_tile():
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import triton_impl
    for h, dk, dv in ((8, 128, 128), (1, 64, 64), (32, 256, 256), (5, 13, 7), (4, 16, 48),
                      (2, 1024, 1024), (128, 128, 128)):
        for small, tile in ((False, 4096), (True, 2048)):
            bt, bh, warps = triton_impl.tiling(h, dk, dv, triton_impl.TUNING, small)
            for v in (bt, bh, warps):
                assert v >= 1 and v & (v - 1) == 0, (h, dk, dv, bt, bh, warps)
            row = triton_impl.next_pow2(dk) + triton_impl.next_pow2(dv)
            assert bh <= triton_impl.next_pow2(h) and (bt * bh * row <= tile or bt == bh == 1)


def test_roundtrip_reads_back_in_chunks(monkeypatch):
    from kvwrite.testing import per_token_head as pth
    case = PthCase(num_tokens=40, padding_slots=3, kv_quant_mode=INT4, num_blocks=4)
    inp = make_pth_inputs(case)
    kvwrite.reshape_and_cache_flash_per_token_head_quant(*inp.args())
    whole = roundtrip_error(*inp.args())
    monkeypatch.setattr(pth, "_ROUNDTRIP_CHUNK", 7)
    assert roundtrip_error(*inp.args()) == whole and check_roundtrip(*inp.args()) is None
    t = max(i for i, s in enumerate(inp.slot_mapping.tolist()) if s >= 0)
    s = int(inp.slot_mapping[t])
    inp.key_cache[s // 16, s % 16, 2, 0] ^= 0x33
    assert f"first token {t}, head 2, element" in check_roundtrip(*inp.args())


def test_sanitize_case_runner_compares_whole_allocations(monkeypatch):
    """run_case's plumbing on the CPU: with the cuda kernel stood in for by the reference it
    reports nothing, with a writer that skips a token it reports the difference."""
    from kvwrite.ops.reshape_and_cache_flash_per_token_head_quant import cuda_impl
    from kvwrite.testing import per_token_head as pth
    from tools.sanitize import reshape_and_cache_flash_per_token_head_quant as sanitize
    real = pth.make_pth_inputs
    monkeypatch.setattr(sanitize, "make_pth_inputs", lambda c, device: real(c, "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    case = sanitize.CASES[0]
    monkeypatch.setattr(cuda_impl, "run", lambda *a, **k: torch_ref.run(*a))
    assert sanitize.run_case(case) is None
    monkeypatch.setattr(cuda_impl, "run", lambda k, v, kc, vc, ks, vs, sl, m, **kw:
                        torch_ref.run(k, v, kc, vc, ks, vs, sl[1:], m))
    assert "bytes differ" in sanitize.run_case(case)
