"""The MX writes' kernels (SPEC §10.3: ``mx_kv_write``'s Triton and CUDA implementations) against
an oracle written here from the SPEC's text: per group of 32, the amax (NaN skipped, +inf
counted), the scale exponent E by the "ceil" rule's definition (the smallest E >= -127 with
a <= M 2^E, searched) or the "floor" rule's (floor(log2 a) - e_M, by frexp), the elements
divided by 2^E in double (exact) and rounded once to float32, then e4m3fn by torch's cast after
the clamp (§1.1) or E2M1 by §6.1's thresholds; written into clones of the whole allocations
through the layouts' index formulas.

On the CPU: kvw/mx.cuh's group rule built for the host, Triton's interpreter (exact here: the
kernel casts nothing to float8, widens bfloat16 from its bits and multiplies by powers of two
only), NVRTC compiles of every CUDA variant. On a GPU (``gpu``): both implementations on whole
allocations.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math

import pytest
import torch

from host import build_emu_lib, build_host_lib, run_triton_script
from kvwrite.testing.compare import assert_caches_equal, copy_allocations
from sass import needs_nvrtc

GROUP = 32


@dataclasses.dataclass(frozen=True)
class Mode:
    """What the implementations read of the op's format record."""

    name: str


def _impl(name: str):
    if name == "triton":
        from kvwrite.ops.mx_kv_write import triton_impl as m
    else:
        from kvwrite.ops.mx_kv_write import cuda_impl as m
    return m


# --- the oracle --------------------------------------------------------------------------------

def oracle_groups(x: torch.Tensor, fp4: bool, floor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bytes [...], code bytes [..., 32] e4m3fn or [..., 16] packed E2M1) of groups
    ``x`` [..., 32] (float32 values)."""
    xd = x.double()
    a = torch.where(torch.isnan(xd), 0.0, xd.abs()).amax(-1)
    big_m, e_m = (6.0, 2) if fp4 else (448.0, 8)
    if floor:
        _, ex = torch.frexp(a)  # a = f 2^ex, f in [0.5, 1): k = ex - 1
        e = (ex.long() - 1 - e_m).clamp(-127, 127)
    else:
        cand = torch.arange(-127, 128, dtype=torch.float64)
        ok = a[..., None] <= big_m * torch.exp2(cand)
        e = torch.where(ok.any(-1), cand.long()[ok.long().argmax(-1)], 127)
    e = torch.where(a == 0, -127, e)
    e = torch.where(torch.isinf(a), 127, e)
    v = (xd / torch.exp2(e.double())[..., None]).float()  # exact in double, one rounding
    if fp4:
        m = v.abs()
        code = torch.zeros(v.shape, dtype=torch.long)
        for lim, strict in ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                            (2.5, False), (3.5, True), (5.0, False)):
            code += (m >= lim) if strict else (m > lim)  # "<= t -> below", "< t -> below"
        code = code | (torch.signbit(v).long() << 3)
        code = torch.where(torch.isnan(v), 7, code)
        codes = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    else:
        codes = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return (e + 127).to(torch.uint8), codes


def test_oracle_thresholds_and_documented_groups():
    """The oracle's documented consequences (SPEC §10.3): a zero group stores scale 0x00 and ±0
    codes; a group with an inf stores 0xFE and its inf as ±448 / 0x7, 0xF; "ceil" never
    saturates a finite element; "floor" with m > m_M saturates the largest to ±M; E2M1's ties go
    to the even code."""
    z = torch.zeros(2, GROUP)
    z[1, 3] = -0.0
    for fp4 in (False, True):
        s, c = oracle_groups(z, fp4, False)
        assert s.tolist() == [0, 0]
        assert c[0].tolist() == [0] * c.shape[-1]
    inf = torch.ones(1, GROUP)
    inf[0, 0], inf[0, 1] = math.inf, -math.inf
    s, c = oracle_groups(inf, False, False)
    assert s.tolist() == [0xFE] and c[0, :3].tolist() == [0x7E, 0xFE, 0]
    s, c = oracle_groups(inf, True, False)
    assert s.tolist() == [0xFE] and c[0, 0].item() == 0xF7
    g = torch.full((1, GROUP), 1.0)
    g[0, 0] = 7.0  # mxfp4: m = 1.75 > 1.5: ceil 2^1 (7/2 = 3.5 -> 4, the even code 6), floor 2^0
    s, c = oracle_groups(g, True, False)
    assert s.tolist() == [128] and c[0, 0].item() == 0x16
    s, c = oracle_groups(g, True, True)
    assert s.tolist() == [127] and c[0, 0].item() == 0x27  # 7 saturates to 6
    t = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    _, c = oracle_groups(t, True, False)
    assert c[0, :4].tolist() == [0x20, 0x42, 0x64, 0x76]


# --- kvw/mx.cuh on the host ------------------------------------------------------------------

_HARNESS = r"""
#include <cstring>
#include "kvw/mx.cuh"
extern "C" void kvw_mx_groups(const float* x, long long n, int fp4, int floor_rule,
                              unsigned char* data, unsigned char* sc) {
  for (long long i = 0; i < n; ++i) {
    float g[32];
    for (int j = 0; j < 32; ++j) g[j] = x[i * 32 + j];
    if (fp4) {
      u32 w[4];
      sc[i] = static_cast<unsigned char>(mx_group<true>(g, floor_rule != 0, w));
      std::memcpy(data + i * 32, w, 16);
    } else {
      u32 w[8];
      sc[i] = static_cast<unsigned char>(mx_group<false>(g, floor_rule != 0, w));
      std::memcpy(data + i * 32, w, 32);
    }
  }
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory, _HARNESS, "mxhost", "kvw/mx.cuh harness")


def special_groups(fp4: bool, dtype: torch.dtype) -> torch.Tensor:
    """Groups [n, 32] (float32 values of ``dtype``): zeros and -0, all NaN, one NaN, ±inf, tiny
    (bfloat16 and float32 subnormals), the amax exactly M 2^k and one ulp of ``dtype`` below and
    above it, the format's thresholds, the dtype's largest finite values."""
    big_m = 6.0 if fp4 else 448.0
    finfo = torch.finfo(dtype)
    base = torch.linspace(-1.0, 1.0, GROUP)
    out = [torch.zeros(GROUP), torch.full((GROUP,), -0.0), torch.full((GROUP,), math.nan)]
    g = base.clone()
    g[5] = math.nan
    out.append(g)
    for inf in (math.inf, -math.inf):
        g = base.clone()
        g[7] = inf
        out.append(g)
    g = base.clone()
    g[0], g[1] = math.inf, math.nan
    out.append(g)
    out.append(base * 2.0**-133)  # bfloat16 / float32 subnormals
    out.append(base * 2.0**-149 * 5)
    out.append(base * finfo.tiny)
    out.append(base * finfo.max)
    for k in (-140, -130, -126, -120, -3, 0, 1, 5, 100, 127):
        for step in (-1, 0, 1):
            top = torch.tensor(big_m * 2.0**k).to(dtype)
            if not torch.isfinite(top) or top == 0:
                continue
            bits = top.view({torch.float32: torch.int32, torch.float16: torch.int16,
                             torch.bfloat16: torch.int16}[dtype])
            t = (bits + step).view(dtype).float()
            g = base * t
            g[3] = -t
            out.append(g)
    thr = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.5, 3.0, 4.0,
                        0.0078125, 0.001953125, 0.0009765625, 240.0, 464.0, 448.0, 416.0, 432.0])
    g = torch.cat([thr, -thr[:12]])
    out.append(g)
    out.append(g * 2.0**-10)
    return torch.stack(out).to(dtype).float()


def random_groups(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-30, 30) if dtype != torch.float32 else (-140, 120)
    x = torch.randn(n, GROUP, generator=gen) * torch.exp2(
        torch.randint(lo, hi, (n, 1), generator=gen).float())
    return x.to(dtype).float()


@pytest.mark.parametrize("floor", [False, True], ids=["ceil", "floor"])
@pytest.mark.parametrize("fp4", [False, True], ids=["mxfp8", "mxfp4"])
def test_host_c_group_rule_matches_oracle(host_lib, fp4, floor):
    """kvw/mx.cuh's mx_group (built for the host: software e4m3, the E2M1 lines) against the
    oracle on random groups of every input dtype's range and the special groups."""
    x = torch.cat([random_groups(3000, torch.float32, 1), random_groups(3000, torch.bfloat16, 2)]
                  + [special_groups(fp4, d) for d in (torch.float32, torch.bfloat16,
                                                       torch.float16)]).contiguous()
    n = x.shape[0]
    data = torch.zeros(n, 32, dtype=torch.uint8)
    sc = torch.zeros(n, dtype=torch.uint8)
    host_lib.kvw_mx_groups(ctypes.c_void_p(x.data_ptr()), ctypes.c_longlong(n), int(fp4),
                           int(floor), ctypes.c_void_p(data.data_ptr()),
                           ctypes.c_void_p(sc.data_ptr()))
    s, c = oracle_groups(x, fp4, floor)
    got = data[:, :c.shape[1]]
    if not fp4:  # which NaN code is unspecified
        got = torch.where(got == 0xFF, 0x7F, got)
        c = torch.where(c == 0xFF, 0x7F, c)
    bad = torch.nonzero((got != c).any(1) | (sc != s)).flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} groups differ; first {x[bad[0]].tolist()}: got {got[bad[0]].tolist()} "
        f"scale {int(sc[bad[0]])}, want {c[bad[0]].tolist()} scale {int(s[bad[0]])}")


# --- whole allocations -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MxCase:
    fmt: str = "mxfp8"
    dtype: torch.dtype = torch.bfloat16
    num_tokens: int = 7
    num_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    num_blocks: int = 3
    layout: str = "NHD"  # or HND
    kv: str = "separate"  # "stacked": K and V blocks of one allocation [nb, 2, ...]
    scales: str = "linear"  # "inline" ([F | D/32] rows of the data allocation), "interleaved128"
    rule: str = "ceil"
    slot_dtype: torch.dtype = torch.int64
    fp8_tensors: bool = False  # data float8_e4m3fn (mxfp8), scales float8_e8m0fnu
    qkv: bool = False  # key and value slices of one fused row (unaligned: element offset 1)
    seed: int = 0

    @property
    def id(self) -> str:
        f = [self.fmt, str(self.dtype).split(".")[-1], f"T{self.num_tokens}",
             f"H{self.num_heads}", f"D{self.head_size}", f"bs{self.block_size}", self.layout,
             self.kv, self.scales, self.rule, str(self.slot_dtype).split(".")[-1]]
        if self.fp8_tensors:
            f.append("f8")
        if self.qkv:
            f.append("qkv")
        return "-".join(f)


@dataclasses.dataclass
class MxInputs:
    case: MxCase
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor
    v_scale_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.key, self.value, self.key_cache, self.value_cache, self.k_scale_cache,
                self.v_scale_cache, self.slot_mapping]

    def to(self, device) -> MxInputs:
        return MxInputs(self.case, *copy_allocations(self.tensors(), device))

    def run(self, impl) -> None:
        c = self.case
        impl.run(self.key, self.value, self.key_cache, self.value_cache, self.k_scale_cache,
                 self.v_scale_cache, self.slot_mapping, Mode(c.fmt), c.rule,
                 "interleaved128" if c.scales == "interleaved128" else "linear")


def _garbage(n: int, gen) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)


def make_inputs(c: MxCase) -> MxInputs:
    gen = torch.Generator().manual_seed(c.seed)
    h, d, nb, bs = c.num_heads, c.head_size, c.num_blocks, c.block_size
    f = d // 2 if c.fmt == "mxfp4" else d
    gs = d // GROUP
    t_pad = c.num_tokens + 2
    # Inputs: random groups with the special ones spread over them; rows past T are NaN.
    n = t_pad * h * gs
    x = random_groups(2 * n, c.dtype, c.seed + 10)
    sp = special_groups(c.fmt == "mxfp4", c.dtype)
    idx = torch.randperm(2 * n, generator=gen)[: min(sp.shape[0], 2 * n)]
    x[idx] = sp[: idx.numel()]
    x = x.to(c.dtype).view(2, t_pad, h, d)
    if c.qkv:
        row = 3 * h * d + 1
        buf = torch.full((t_pad, row), math.nan, dtype=c.dtype)
        key = buf[:, 1:1 + h * d].view(t_pad, h, d)
        value = buf[:, 1 + 2 * h * d:1 + 3 * h * d].view(t_pad, h, d)
        key.copy_(x[0])
        value.copy_(x[1])
    else:
        key, value = x[0].clone(), x[1].clone()
    key[c.num_tokens:] = math.nan
    value[c.num_tokens:] = math.nan

    # Data caches (and inline scales), random bytes that must stay where not written.
    row = f + gs if c.scales == "inline" else f
    if c.kv == "stacked":
        shape = (nb, 2, bs, h, row) if c.layout == "NHD" else (nb, 2, h, bs, row)
        alloc = _garbage(math.prod(shape), gen).view(shape)
        if c.layout == "HND":
            alloc = alloc.permute(0, 1, 3, 2, 4)
        kfull, vfull = alloc[:, 0], alloc[:, 1]
    else:
        shape = (nb, bs, h, row) if c.layout == "NHD" else (nb, h, bs, row)
        kfull, vfull = (_garbage(math.prod(shape), gen).view(shape) for _ in range(2))
        if c.layout == "HND":
            kfull, vfull = kfull.permute(0, 2, 1, 3), vfull.permute(0, 2, 1, 3)
    key_cache, value_cache = kfull[..., :f], vfull[..., :f]
    if c.scales == "inline":
        ksc, vsc = kfull[..., f:], vfull[..., f:]
    elif c.scales == "interleaved128":
        # [nb, H, bs/128, 32, 4, 4] inside a padded allocation: nontrivial strides.
        shape = (nb, h, bs // 128, 32, 4, 8)
        ksc, vsc = (_garbage(math.prod(shape), gen).view(shape)[..., :4] for _ in range(2))
    else:
        shape = (nb, bs, h, gs) if c.layout == "NHD" else (nb, h, bs, gs)
        ksc, vsc = (_garbage(math.prod(shape), gen).view(shape) for _ in range(2))
        if c.layout == "HND":
            ksc, vsc = ksc.permute(0, 2, 1, 3), vsc.permute(0, 2, 1, 3)
    if c.fp8_tensors:
        if c.fmt == "mxfp8" and c.scales != "inline":
            key_cache = key_cache.view(torch.float8_e4m3fn)
            value_cache = value_cache.view(torch.float8_e4m3fn)
        ksc, vsc = ksc.view(torch.float8_e8m0fnu), vsc.view(torch.float8_e8m0fnu)

    # Slots: distinct, some padding (-1) and out of range ones.
    num_slots = nb * bs
    slots = torch.randperm(num_slots, generator=gen)[: c.num_tokens].clone()
    if c.num_tokens > 2:
        slots[1] = -1
        slots[-1] = num_slots + 3
    if c.num_tokens > 4:
        slots[3] = -7
    return MxInputs(c, key, value, key_cache, value_cache, ksc, vsc, slots.to(c.slot_dtype))


def oracle(inp: MxInputs) -> list[torch.Tensor]:
    """The expected allocations after the call (on the CPU), written token by token through
    the views' logical indices: data [b, o, h, :], linear scales [b, o, h, g], interleaved128
    scales [b, h, o // 128, o % 32, (o % 128) // 32, g]."""
    c = inp.case
    exp = MxInputs(c, *copy_allocations([t.cpu() for t in inp.tensors()], "cpu"))
    fp4, floor = c.fmt == "mxfp4", c.rule == "floor"
    h, gs = c.num_heads, c.head_size // GROUP
    num_slots = c.num_blocks * c.block_size
    for x, data, sc in ((exp.key, exp.key_cache, exp.k_scale_cache),
                        (exp.value, exp.value_cache, exp.v_scale_cache)):
        data = data.view(torch.uint8) if data.dtype != torch.uint8 else data
        sc = sc.view(torch.uint8) if sc.dtype != torch.uint8 else sc
        s_all, c_all = oracle_groups(x[: c.num_tokens].float().reshape(-1, gs, GROUP), fp4,
                                     floor)
        s_all = s_all.view(c.num_tokens, h, gs)
        c_all = c_all.view(c.num_tokens, h, -1)
        for t, slot in enumerate(inp.slot_mapping.tolist()):
            if not 0 <= slot < num_slots:
                continue
            b, o = divmod(slot, c.block_size)
            data[b, o] = c_all[t]
            if c.scales == "interleaved128":
                sc[b, :, o // 128, o % 32, (o % 128) // 32, :] = s_all[t]
            else:
                sc[b, o] = s_all[t]
    return exp.tensors()


def assert_all_equal(got: list[torch.Tensor], want: list[torch.Tensor], case: MxCase) -> None:
    names = ("key", "value", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache",
             "slot_mapping")
    for name, g, w in zip(names, got, want, strict=True):
        nan_dtype = torch.float8_e4m3fn if case.fmt == "mxfp8" and "cache" in name else None
        assert_caches_equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                            w.view(torch.uint8) if w.element_size() == 1 else w,
                            f"{case.id}: {name}", fp8_dtype=nan_dtype,
                            nan_equal=nan_dtype is not None)


def _cases() -> list[MxCase]:
    out = []
    for fmt in ("mxfp8", "mxfp4"):
        for rule in ("ceil", "floor"):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                out.append(MxCase(fmt=fmt, rule=rule, dtype=dtype, seed=len(out)))
        out += [
            MxCase(fmt=fmt, layout="HND", kv="stacked", slot_dtype=torch.int32, seed=20),
            MxCase(fmt=fmt, scales="inline", head_size=96, num_heads=3, block_size=12,
                   dtype=torch.float16, seed=21),
            MxCase(fmt=fmt, scales="interleaved128", head_size=128, block_size=128,
                   num_blocks=2, num_tokens=9, rule="floor", seed=22),
            MxCase(fmt=fmt, scales="interleaved128", head_size=128, block_size=256,
                   num_blocks=1, num_tokens=12, layout="HND", kv="stacked", fp8_tensors=True,
                   dtype=torch.float32, slot_dtype=torch.int32, seed=23),
            MxCase(fmt=fmt, qkv=True, head_size=32, num_heads=5, block_size=5, fp8_tensors=True,
                   seed=24),
            MxCase(fmt=fmt, num_tokens=1, num_heads=1, head_size=32, block_size=1,
                   num_blocks=4, seed=25),
        ]
    return out


CASES = _cases()


@functools.cache
def expected(case: MxCase) -> list[torch.Tensor]:
    return oracle(make_inputs(case))


def test_cases_cover_the_contract():
    """Both formats, rules and scale layouts (linear, inline, interleaved128), every input
    dtype, NHD and HND, separate and stacked K/V, both slot types, float8 tensors, unaligned
    rows, a block size not a power of two."""
    assert {c.fmt for c in CASES} == {"mxfp8", "mxfp4"}
    assert {c.rule for c in CASES} == {"ceil", "floor"}
    assert {c.scales for c in CASES} == {"linear", "inline", "interleaved128"}
    assert {c.dtype for c in CASES} == {torch.bfloat16, torch.float16, torch.float32}
    assert {c.layout for c in CASES} == {"NHD", "HND"}
    assert {c.kv for c in CASES} == {"separate", "stacked"}
    assert {c.slot_dtype for c in CASES} == {torch.int32, torch.int64}
    assert any(c.fp8_tensors for c in CASES) and any(c.qkv for c in CASES)
    assert any(c.block_size & (c.block_size - 1) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_interpreter_matches_oracle(case):
    impl = _impl("triton")
    if (reason := impl.available(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    inp = make_inputs(case)
    inp.run(impl)
    assert_all_equal(inp.tensors(), expected(case), case)


def test_triton_small_calls_spread_groups_over_more_warps():
    """Small calls (T * H * D/32 <= small_call_groups) tile with small_bytes_per_warp: at the
    benchmark's H=8, D=128, bfloat16, T=1, four warps (8 groups a warp) where the large tiling
    has one; tile shapes (BLOCK_T, BLOCK_Q) are the same, so the interpreter's results are."""
    from kvwrite.kernels.triton_support import group_tiling
    m = _impl("triton")
    small = m._small_tuning(m.TUNING)
    assert small is m._small_tuning(m.TUNING)  # cached: one tiling cache entry per tuning
    assert group_tiling(1, 32, 64, m.TUNING) == (1, 32, 1)
    assert group_tiling(1, 32, 64, small) == (1, 32, 4)
    assert group_tiling(16, 32, 64, small)[:2] == group_tiling(16, 32, 64, m.TUNING)[:2]


def test_zero_tokens_write_nothing():
    impl = _impl("triton")
    if (reason := impl.available(torch.device("cpu"))) is not None:
        pytest.skip(reason)
    inp = make_inputs(MxCase(num_tokens=0))
    before = [t.clone() for t in inp.tensors()]
    inp.run(impl)
    assert_all_equal(inp.tensors(), before, inp.case)


# --- CUDA: the kernels emulated on the CPU ----------------------------------------------------
# kernel.cu compiled with g++ over tests/gather_emu.h's SIMT emulation (one std::thread per CUDA
# thread of a 128-thread CTA, shuffles and ballots emulated), launched as cuda_impl.run launches
# it (the plan's kernel and fixed arguments, the generic build). Not emulated: the GPU's own
# instructions (the satfinite e4m3 conversion, cvt.f32.f16, the 16-bit SIMD maximum), which take
# the headers' host paths; the GPU tests cover those.

_EMU_HEAD = r"""
#include "gather_emu.h"
#include "kernel.cu"
"""


def _emu_symbol(name: str) -> str:
    return "emu_" + "".join(ch if ch.isalnum() else "_" for ch in name)


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    import pathlib
    cuda_impl = _impl("cuda")
    lines = [_EMU_HEAD]
    fixed = ", ".join(f"f[{i}]" for i in range(len(cuda_impl.FIXED_ARGS)))
    for name in cuda_impl.all_kernel_names():
        st = name.rsplit(",", 1)[1].strip(" >")
        lines.append(
            f'extern "C" void {_emu_symbol(name)}(const u8* k, const u8* v, u8* kd, u8* vd, '
            f"u8* ks, u8* vs, const {st}* sl, i64 n, const i64* f, i64 grid) {{\n"
            f"  emu_launch(static_cast<unsigned>(grid), [&] {{ {name}(k, v, kd, vd, ks, vs, sl, "
            f"n, {fixed}); }});\n}}")
    return build_emu_lib(tmp_path_factory, "\n".join(lines) + "\n", "mxemu",
                         pathlib.Path(cuda_impl.__file__).parent)


def run_emulated(lib, inp: MxInputs, small: bool) -> str:
    """cuda_impl.run's launch of ``inp`` with the kernel emulated: mx_small_kernel where
    ``small`` and the call is aligned, else mx_kernel. Returns the kernel's name."""
    from kvwrite.gather import bits_view
    cuda_impl = _impl("cuda")
    c = inp.case
    tuning = cuda_impl.CudaTuning(small_call_groups=(1 << 40) if small else 0)
    views = [bits_view(x) for x in (inp.key_cache, inp.value_cache, inp.k_scale_cache,
                                    inp.v_scale_cache)]
    p = cuda_impl.plan(inp.key, inp.value, *views, inp.slot_mapping, Mode(c.fmt), c.rule,
                       "interleaved128" if c.scales == "interleaved128" else "linear", tuning)
    n = inp.slot_mapping.numel()
    fixed = (ctypes.c_longlong * len(p.fixed))(*p.fixed)
    grid = -(-n * p.per_token // 128)
    ptr = [ctypes.c_void_p(x.data_ptr()) for x in (inp.key, inp.value, *views, inp.slot_mapping)]
    getattr(lib, _emu_symbol(p.name))(*ptr, ctypes.c_longlong(n), fixed, ctypes.c_longlong(grid))
    return p.name


# The small kernel's shapes past CASES: the benchmark's (H=8, D=128, block 16) at T = 1 and 16,
# a head of one group, every mode, rule and input dtype, both scale layouts.
EMU_CASES = CASES + [
    MxCase(fmt=fmt, rule=rule, dtype=dtype, num_tokens=t, num_heads=8, head_size=128,
           block_size=16, num_blocks=4, seed=60 + t)
    for fmt in ("mxfp8", "mxfp4") for rule in ("ceil", "floor")
    for dtype, t in ((torch.bfloat16, 1), (torch.bfloat16, 16), (torch.float32, 3),
                     (torch.float16, 5))
] + [MxCase(fmt=fmt, num_heads=3, head_size=32, num_tokens=11, block_size=8, seed=70)
     for fmt in ("mxfp8", "mxfp4")]


@pytest.mark.parametrize("small", [False, True], ids=["mx_kernel", "small"])
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: c.id)
def test_cuda_kernels_emulated_match_oracle(emu_lib, case, small):
    """Both CUDA kernels, run by the SIMT emulation, write the oracle's bytes (whole
    allocations): mx_kernel on every case, mx_small_kernel on every aligned one (the others
    take mx_kernel in both runs)."""
    inp = make_inputs(case)
    name = run_emulated(emu_lib, inp, small)
    aligned = name.split("<")[0] == "mx_small_kernel" or name.split(",")[2].strip() == "true"
    assert name.startswith("mx_small_kernel") == (small and aligned), name
    assert_all_equal(inp.tensors(), expected(case), case)


def test_emulated_cases_reach_the_small_kernel():
    """The emulated cases run mx_small_kernel in every mode, rule and input dtype."""
    cuda_impl = _impl("cuda")
    tuning = cuda_impl.CudaTuning(small_call_groups=1 << 40)
    seen = set()
    for c in EMU_CASES:
        inp = make_inputs(c)
        p = cuda_impl.plan(*inp.tensors(), Mode(c.fmt), c.rule,
                           "interleaved128" if c.scales == "interleaved128" else "linear",
                           tuning)
        if p.name.startswith("mx_small_kernel"):
            seen.add((c.fmt, c.rule, c.dtype, c.scales))
    assert {(f, r, d) for f, r, d, _ in seen} == {
        (f, r, d) for f in ("mxfp8", "mxfp4") for r in ("ceil", "floor")
        for d in (torch.bfloat16, torch.float16, torch.float32)}
    assert {sc for *_, sc in seen} == {"linear", "interleaved128"}


# --- CUDA: compiles on the CPU ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pdl_sass(tmp_path_factory):
    """sm_90 SASS of the PDL build of every variant, compiled as one NVRTC program."""
    from kvwrite.kernels import nvrtc
    from sass import cuobjdump, dump_sass, nvrtc_reason
    if nvrtc_reason() is not None:
        pytest.skip(nvrtc_reason())
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    cuda_impl = _impl("cuda")
    names = cuda_impl.all_kernel_names()
    obj, _ = cuda_impl.SOURCE.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    return names, dump_sass(bytes(obj.code), tmp_path_factory.mktemp("mxsass"))


@needs_nvrtc
def test_every_cuda_variant_compiles_for_sm80():
    """Every variant (mx_kernel: input dtype x format x alignment x slot type, 24;
    mx_small_kernel: input dtype x format x slot type, 12) compiles with NVRTC for sm_80 too
    (the software e4m3 conversion: no cvt.satfinite.e4m3x2 before sm_89)."""
    cuda_impl = _impl("cuda")
    names = cuda_impl.all_kernel_names()
    assert len(names) == 36 == len(set(names))
    cuda_impl.compile_kernel("sm_80", names)


def test_every_cuda_variant_waits_first_and_loads_before_any_wait(pdl_sass):
    """Each variant's PDL build triggers and waits (PREEXIT, ACQBULK) before its first global
    access, and no variant waits for a load's result before it has issued its last load (the
    rows and the slot: one memory round trip; sass.waits_before_loads)."""
    import sass as sass_tools
    names, text = pdl_sass
    funcs = sass_tools.functions(text)
    assert len(funcs) == len(names) == 36
    sass_tools.assert_waits_first(funcs)
    late = sass_tools.late_issues(text, lambda op: True)
    assert not late, {k: v[:3] for k, v in late.items()}


@needs_nvrtc
def test_load_order_check_catches_an_early_slot_test(tmp_path):
    """The order the check above guards: with the slot loaded before the rows and tested before
    the rule, ptxas loads the rows after the test."""
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    cuda_impl = _impl("cuda")
    src = cuda_impl.SOURCE.text
    test = "  if (static_cast<u64>(s) >= static_cast<u64>(num_slots)) return;  // also s < 0\n"
    rule = "  const bool fl = floor_rule != 0;\n"
    slot = "  const i64 s = static_cast<i64>(load_index(slot_mapping + t));\n"
    rows = "  Raw<16> rk[C], rv[C];\n"
    assert all(src.count(x) == 1 for x in (test, rule, slot, rows))
    early = src.replace(test, "").replace(rule, test + rule).replace(slot, "").replace(
        rows, slot + rows)
    name = "mx_kernel<1, false, true, long long>"
    obj, _ = cuda_impl.SOURCE.compile("sm_90", [name], source=early)
    assert sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), tmp_path),
                                  lambda op: True)


def _plan(case: MxCase, small_call_groups: int = 0):
    """cuda_impl.plan of the case; mx_kernel unless small_call_groups lets the call be small."""
    inp = make_inputs(case)
    c = case
    cuda_impl = _impl("cuda")
    return cuda_impl.plan(*inp.tensors(), Mode(c.fmt), c.rule,
                          "interleaved128" if c.scales == "interleaved128" else "linear",
                          cuda_impl.CudaTuning(small_call_groups=small_call_groups))


@pytest.mark.parametrize("case, aligned", [
    (MxCase(), True), (MxCase(qkv=True, head_size=32, num_heads=5, block_size=5), False),
    (MxCase(scales="inline", head_size=96, num_heads=3, block_size=12), False),
    (MxCase(fmt="mxfp4", scales="interleaved128", head_size=128, block_size=128), True)],
    ids=["aligned", "qkv", "inline", "interleaved"])
def test_cuda_plan(case, aligned):
    """The plan picks the aligned variant only where inputs and data allow 16-byte accesses; the
    fixed arguments are 28 and the linear scale strides are the interleaved formula's."""
    cuda_impl = _impl("cuda")
    p = _plan(case)
    assert p.name in cuda_impl.all_kernel_names()
    assert p.name.split(",")[2].strip() == str(aligned).lower()
    assert len(p.fixed) == len(cuda_impl.FIXED_ARGS) == 28
    fx = dict(zip(cuda_impl.FIXED_ARGS, p.fixed, strict=True))
    assert fx["floor_rule"] == int(case.rule == "floor")
    # A small call (T * H * D/32 <= small_call_groups) takes mx_small_kernel where aligned.
    groups = case.num_heads * case.head_size // GROUP
    for limit, small in ((case.num_tokens * groups, aligned), (case.num_tokens * groups - 1,
                                                                False)):
        ps = _plan(case, limit)
        assert ps.name.startswith("mx_small_kernel") == small, (limit, ps.name)
        assert ps.name in cuda_impl.all_kernel_names() and ps.fixed == p.fixed
        assert ps.per_token == (8 * groups if small else groups)
    if case.scales == "linear":
        inp = make_inputs(case)
        sc = inp.k_scale_cache
        sb, ss, sh, sg = (st if n > 1 else 0 for st, n in zip(sc.stride(), sc.shape, strict=True))
        assert (fx["ks_sb"], fx["ks_sh"], fx["ks_128"], fx["ks_32"], fx["ks_4"], fx["ks_g"]) == (
            sb, sh, 128 * ss, ss, 32 * ss, sg)


@needs_nvrtc
def test_specialized_builds_read_no_fixed_argument(tmp_path):
    """A build with a call signature's 28 trailing arguments compiled in (linear and
    interleaved scales, aligned and not) reads none of them from the parameter bank (sm_90: 7
    pointers from 0x210, num_tokens at 0x248, the fixed arguments from 0x250); the generic build
    reads them; a build given another count is refused."""
    import sass as sass_tools
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    cuda_impl = _impl("cuda")
    builds = []
    for case, small in ((MxCase(), False), (MxCase(), True),
                        (MxCase(fmt="mxfp4", scales="interleaved128", head_size=128,
                                block_size=128, rule="floor"), True),
                        (MxCase(qkv=True, head_size=32, num_heads=5, block_size=5), False)):
        p = _plan(case, 1 << 40 if small else 0)
        builds.append((case.id + ("-small" if small else ""), p.name, p.fixed))
    sass_tools.assert_specialized_builds_read_no_fixed_argument(
        cuda_impl.compile_kernel, builds, 0x250, 0x250 + 8 * 28, 28, tmp_path)


_TRITON_PTX_SCRIPT = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.ops.mx_kv_write import triton_impl as mx

def ptx(in_ty, fp4, floor, slot, native=False):
    k = mx._mx_kernel
    types = {"key_ptr": in_ty, "value_ptr": in_ty, "k_data_ptr": "*u8", "v_data_ptr": "*u8",
             "k_sf_ptr": "*u8", "v_sf_ptr": "*u8", "slot_mapping_ptr": slot, "num_tokens": "i32"}
    f = 64 if fp4 else 128
    consts = dict(KEY_STRIDE=1024, VALUE_STRIDE=1024, KD_SB=16 * 8 * f, KD_SS=8 * f, KD_SH=f,
                  KD_SE=1, VD_SB=16 * 8 * f, VD_SS=8 * f, VD_SH=f, VD_SE=1, KS_SB=512,
                  KS_SH=4, KS_128=4096, KS_32=32, KS_4=1024, KS_G=1, VS_SB=512, VS_SH=4,
                  VS_128=4096, VS_32=32, VS_4=1024, VS_G=1, NUM_SLOTS=1024, BLOCK_SIZE=16, G=4,
                  NUM_GROUPS=32, FP4=fp4, FLOOR=floor, BF16_BITS=in_ty == "*i16", BLOCK_T=2,
                  BLOCK_Q=32, PDL=False, PDL_TRIGGER=False, NATIVE=native)
    sig = dict(types)
    sig.update({n: "constexpr" for n in consts})
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
    opts = {"num_warps": 4, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

out = {}
for in_ty, fp4, floor, slot in (("*fp16", False, False, "*i64"), ("*i16", True, True, "*i32"),
                                 ("*fp32", True, False, "*i64"), ("*i16", False, True, "*i64")):
    text = ptx(in_ty, fp4, floor, slot)
    out[f"{in_ty}-{fp4}-{floor}"] = [len(re.findall(r"\.ftz", text)),
                                     len(re.findall(r"cvt[.\w]*e4m3", text)),
                                     len(re.findall(r"mul(\.rn)?\.f32", text))]
text = ptx("*i16", False, False, "*i64", native=True)
out["native"] = [len(re.findall(r"\.ftz", text)),
                 len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", text)),
                 len(re.findall(r"mul(\.rn)?\.f32", text))]
print(json.dumps(out))
"""


def test_triton_kernel_compiles_for_sm90_without_flush_or_float8_cast():
    """The Triton kernel compiles for sm_90 (outside the interpreter, whose type rules are
    looser) in both formats, rules and every input kind; its PTX flushes no subnormal (no .ftz:
    the products by 2^127 of bfloat16 subnormals and by the subnormal 2^-127, as the
    interpreter computes them), converts nothing to float8 where NATIVE is off (the codes are
    integer work, what the interpreter runs) and multiplies the elements."""
    out = run_triton_script(_TRITON_PTX_SCRIPT)
    assert len(out) == 5, out
    native = out.pop("native")
    for variant, (ftz, cvt, mul) in out.items():
        assert ftz == 0 and cvt == 0 and mul > 0, (variant, out)
    # NATIVE (compiled mxfp8 on sm_89 and later): the codes by cvt.rn.satfinite.e4m3x2.f32,
    # the CUDA kernel's conversion (32 a thread here: 64 elements, two an instruction).
    assert native[0] == 0 and native[1] > 0 and native[2] > 0, native


# --- GPU: both implementations on whole allocations ------------------------------------------

GPU_CASES = CASES + [
    MxCase(fmt=fmt, rule=rule, dtype=dtype, num_tokens=300, num_heads=8, head_size=128,
           block_size=16, num_blocks=32, seed=40)
    for fmt in ("mxfp8", "mxfp4") for rule in ("ceil", "floor")
    for dtype in (torch.bfloat16, torch.float32)
] + [MxCase(fmt=fmt, scales="interleaved128", head_size=128, num_heads=4, block_size=128,
            num_blocks=6, num_tokens=600, seed=41) for fmt in ("mxfp8", "mxfp4")]


def _gpu_impl(impl: str):
    """(module, run keywords): "cuda-small" / "cuda-large" force mx_small_kernel (aligned
    calls) / mx_kernel through the tuning; "cuda" takes the default choice."""
    m = _impl(impl.split("-")[0])
    if impl == "cuda-small":
        return m, {"tuning": m.CudaTuning(small_call_groups=1 << 40)}
    if impl == "cuda-large":
        return m, {"tuning": m.CudaTuning(small_call_groups=0)}
    return m, {}


# The benchmark's shape at the small kernel's sizes (T = 1, 16), every mode and rule.
GPU_SMALL_CASES = [
    MxCase(fmt=fmt, rule=rule, dtype=torch.bfloat16, num_tokens=t, num_heads=8, head_size=128,
           block_size=16, num_blocks=8, seed=80 + t)
    for fmt in ("mxfp8", "mxfp4") for rule in ("ceil", "floor") for t in (1, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "cuda-small", "cuda-large", "triton"])
@pytest.mark.parametrize("case", GPU_CASES + GPU_SMALL_CASES, ids=lambda c: c.id)
def test_gpu_matches_oracle(case, impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m, kw = _gpu_impl(impl)
    if (reason := m.available(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    inp = make_inputs(case).to("cuda")
    c = inp.case
    m.run(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.k_scale_cache,
          inp.v_scale_cache, inp.slot_mapping, Mode(c.fmt), c.rule,
          "interleaved128" if c.scales == "interleaved128" else "linear", **kw)
    torch.cuda.synchronize()
    assert_all_equal(inp.tensors(), expected(case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "cuda-small", "triton"])
def test_gpu_every_16bit_pattern(impl):
    """Every bfloat16 and float16 bit pattern, each in a group with random neighbours, both
    formats and rules, against the oracle: the amax, E and element paths of every input."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m, kw = _gpu_impl(impl)
    if (reason := m.available(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.float16):
        every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        x = random_groups(65536, dtype, 3).to(dtype)
        x[torch.arange(65536), torch.randint(0, GROUP, (65536,), generator=gen)] = every
        key = x.view(2048, 32, GROUP)  # 2048 tokens of 32 heads, D = 32
        for fmt in ("mxfp8", "mxfp4"):
            for rule in ("ceil", "floor"):
                f = 16 if fmt == "mxfp4" else 32
                kc = torch.zeros(2048, 1, 32, f, dtype=torch.uint8)
                ksc = torch.zeros(2048, 1, 32, 1, dtype=torch.uint8)
                args = [key, key.flip(0).contiguous(), kc, kc.clone(), ksc, ksc.clone(),
                        torch.arange(2048)]
                dev = copy_allocations(args, "cuda")
                m.run(*dev, Mode(fmt), rule, "linear", **kw)
                s, c = oracle_groups(key.float(), fmt == "mxfp4", rule == "floor")
                got_c, got_s = dev[2].cpu().view(2048, 32, f), dev[4].cpu().view(2048, 32)
                if fmt == "mxfp8":
                    got_c = torch.where(got_c == 0xFF, 0x7F, got_c)
                    c = torch.where(c == 0xFF, 0x7F, c)
                assert torch.equal(got_s, s), (dtype, fmt, rule)
                assert torch.equal(got_c, c), (dtype, fmt, rule)
