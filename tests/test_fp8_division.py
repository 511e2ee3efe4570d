"""The fp8 quotient without a per-element division (the Triton kernel's `fp8_scale` and
`fp8_quotient`, kvwrite.kernels.triton_fp8), checked three ways:

- the identity it rests on, in C on the host: for x and s of the input's precision,
  q = RN(x * RN(1/s)), then q = fma(fma(-s, q, x), RN(1/s), q) once, is RN(x / s). Exhaustive
  for bfloat16 significands against every float32 scale significand, for float16 against every
  64th one; float32 inputs take a second step (Markstein's theorem) and are sampled;
- the Triton functions themselves, under the interpreter on CPU (its float32 multiply and fma
  round like the GPU; only its fp8 cast does not, and that cast is not used here) and on the GPU:
  every 16-bit input and random float32 inputs against a true division, for ordinary, tiny,
  subnormal, huge, negative, zero, infinite and NaN scales;
- end to end on the GPU for both fp8 kernels, with the same extreme scales per head.

And the per-scale reciprocal y = RN(1 / s2): the CUDA kernel's branch-free one (rcp_rn_s2: an
approximate reciprocal, two fused Newton steps, one fixed significand) in C from every
approximation within 4 ulp; each kernel's own y (CUDA's both ways, Triton's `div_rn`) against a
true division for every scale of [2, 4) and for subnormal scales (Triton's under the interpreter
too).
"""

from __future__ import annotations

import pytest
import torch

import kvwrite
from host import RCP_RN_S2_C, run_c
from kvwrite.dtypes import FP8_MAX, CacheDType
from kvwrite.kernels import nvrtc, triton_fp8
from kvwrite.ops.reshape_and_cache_flash import cuda_impl, triton_impl
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.testing import assert_caches_equal

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_triton = pytest.mark.skipif(triton_impl.triton is None, reason="triton is not installed")
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# Ordinary, tiny, subnormal, huge, negative and special scales.
SCALES = [0.37, 2.7, 1.3, 0.0123, 5.5e-3, 1.0, 2.0**-7, 3.0, 1.9999999, 6.1e-5, 1e-30, 1e30,
          1.17549435e-38, 1.5 * 2.0**-127, 1e-39, 2.0**-149, 2.0**127, 3.4028235e38,
          -0.37, -2.7e-20, 0.0, -0.0, float("inf"), -float("inf"), float("nan")]

# ---------------------------------------------------------------------------------------------
# The identity, in C.
# ---------------------------------------------------------------------------------------------
_IDENTITY_C = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static float f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint64_t st = 88172645463325252ull;
static uint32_t rnd(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (uint32_t)(st >> 11); }
/* Scales s in [2, 4) (the kernel's range of s2 for normal scales; the identity is invariant
   under powers of two while nothing underflows), inputs x in [1, 4). Prints mismatch counts. */
static long check(uint32_t s_bits, uint32_t x_bits, int steps) {
  float s = f(0x40000000u | s_bits), y = 1.0f / s;
  long bad = 0;
  for (int e = 0; e < 2; ++e) {
    float x = f(((127u + e) << 23) | x_bits);
    float q = x * y;
    for (int i = 0; i < steps; ++i) q = fmaf(fmaf(-s, q, x), y, q);
    bad += q != x / s;
  }
  return bad;
}
int main(void) {
  long n = 0, bad = 0;
  for (uint32_t sm = 0; sm < (1u << 23); ++sm)        /* bfloat16: every pair */
    for (uint32_t xm = 0; xm < (1u << 7); ++xm) { bad += check(sm, xm << 16, 1); n += 2; }
  printf("bfloat16 %ld %ld\n", n, bad);
  n = bad = 0;
  for (uint32_t sm = 0; sm < (1u << 23); sm += 64)    /* float16: every 64th scale */
    for (uint32_t xm = 0; xm < (1u << 10); ++xm) { bad += check(sm, xm << 13, 1); n += 2; }
  printf("float16 %ld %ld\n", n, bad);
  n = bad = 0;
  for (long i = 0; i < 5000000; ++i) {                /* float32: random, and near-all-ones */
    uint32_t sm = rnd() & 0x7FFFFF, xm = rnd() & 0x7FFFFF;
    if ((i & 3) == 0) sm = 0x7FFFFF - (rnd() & 0xFFF);
    if ((i & 3) == 1) xm = 0x7FFFFF - (rnd() & 0xFFF);
    bad += check(sm, xm, 2); n += 2;
  }
  printf("float32 %ld %ld\n", n, bad);
  return 0;
}
"""


def test_division_identity_in_c(tmp_path):
    out = run_c(tmp_path, "identity", _IDENTITY_C).split("\n")
    counts = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out if line}
    assert counts["bfloat16"] == [2**31, 0]
    assert counts["float16"] == [2**28, 0]
    assert counts["float32"] == [10_000_000, 0]


# The reciprocal, in C: what the CUDA kernel's rcp_rn_s2 computes from the hardware's
# approximation r0 of 1/b (rcp.approx.ftz: within 2 ulp for b in [2^-22, 4)).
_RECIPROCAL_C = RCP_RN_S2_C + r"""
static long n, bad, steps_miss;
static void check(float b) {
  const float want = 1.0f / b;
  for (int k = -4; k <= 4; ++k) {                   /* every r0 within 4 ulp of 1/b */
    float r0 = f(u(want) + k), r = fmaf(r0, fmaf(-b, r0, 1.0f), r0);
    float y = fmaf(r, fmaf(-b, r, 1.0f), r);
    steps_miss += u(y) != u(want);
    bad += u(rcp_rn_s2_steps(b, r0)) != u(want);
    ++n;
  }
}
int main(void) {
  for (uint32_t e = 127u - 22u; e <= 128u; ++e) {   /* b in [2^-22, 4): the range of s2 */
    /* every significand of [1, 4); every 61st and the all-ones one of the binades below */
    const uint32_t step = e >= 127u ? 1u : 61u;
    for (uint32_t m = 0; m < (1u << 23); m += step) check(f((e << 23) | m));
    if (step > 1) check(f((e << 23) | 0x7FFFFFu));
  }
  printf("%ld %ld %ld\n", n, bad, steps_miss);
  return 0;
}
"""


def test_reciprocal_refinement_in_c(tmp_path):
    n, bad, steps_miss = (int(v) for v in run_c(tmp_path, "reciprocal", _RECIPROCAL_C).split())
    assert n == 9 * (2 * 2**23 + 22 * (-(-(2**23) // 61) + 1))
    assert bad == 0
    # The fixed significand is needed: without it the Newton steps miss (all-ones significands,
    # from every approximation but the exact one), so this check can fail.
    assert steps_miss > 0


def _scales_and_s2() -> tuple[torch.Tensor, torch.Tensor]:
    """Every float32 scale of [2, 4) (where s2 = s) and every 61st subnormal one with the
    largest (s2 = s * 2^127, in [2^-22, 2)); each with its s2."""
    normal = (torch.arange(2**23, dtype=torch.int64) | (128 << 23)).to(torch.int32)
    sub = torch.cat([torch.arange(1, 2**23, 61), torch.tensor([2**23 - 1])]).to(torch.int32)
    s = torch.cat([normal, sub]).view(torch.float32)
    s2 = torch.cat([s[: 2**23], (s[2**23:].double() * 2.0**127).float()])
    return s, s2


def test_scale_constants_are_exact_on_the_host():
    # The reference itself: s2 exact (a power-of-two multiple) and CPU division correctly rounded.
    s, s2 = _scales_and_s2()
    assert (s2 >= 2.0**-22).all() and (s2 < 4).all()
    assert torch.equal(s2.double(), s.double() * torch.where(s >= 2, 1.0, 2.0**127))


_SCALE_KERNEL_SRC = r"""
template <bool BRANCH_FREE>
__global__ void kvw_test_fp8_scale(const float* s, float* s2, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const Fp8Scale r = fp8_exact_scale<BRANCH_FREE>(s[i]);
    s2[i] = r.s2;
    y[i] = r.y;
  }
}
"""


def _cuda_scale(s: torch.Tensor, branch_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dev = torch.cuda.current_device()
    arch, _ = nvrtc.device_arch(dev)
    name = f"kvw_test_fp8_scale<{str(branch_free).lower()}>"
    # The shared header alone, as every op's kernel includes it.
    obj, _ = cuda_impl.SOURCE.compile(arch, name,
                                      source='#include "kvw/fp8.cuh"\n' + _SCALE_KERNEL_SRC)
    cc = nvrtc.cuda_core()
    cc.Device(dev).set_current()
    sd = s.cuda()
    s2, y = torch.empty_like(sd), torch.empty_like(sd)
    config = cc.LaunchConfig(grid=(-(-s.numel() // 256), 1, 1), block=(256, 1, 1))
    cc.launch(nvrtc.current_stream(dev), config, obj.get_kernel(name),
              sd.data_ptr(), s2.data_ptr(), y.data_ptr(), s.numel())
    torch.cuda.synchronize()
    return s2.cpu(), y.cpu()


@gpu
@pytest.mark.parametrize("branch_free", [True, False], ids=["rcp_rn_s2", "div_rn"])
def test_cuda_scale_reciprocal_gpu(branch_free):
    s, s2 = _scales_and_s2()
    got_s2, y = _cuda_scale(s, branch_free)
    assert torch.equal(got_s2, s2)
    want = 1.0 / s2
    bad = (y.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()[:5]
    assert bad.numel() == 0, f"y != RN(1/s2) at s2={s2[bad].tolist()}: {y[bad].tolist()}"


_QUANTIZE_KERNEL_SRC = r"""
#include "kvw/fp8.cuh"
template <int FMT, bool BRACKET, int STEPS>
__global__ void kvw_test_quantize(const float* x, const float* s, unsigned char* out, int n,
                                  int per_scale) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  float v[8];
  for (int k = 0; k < 8; ++k) v[k] = x[i + k];
  u32 w[2];
  fp8_quantize<FMT, 8, STEPS>(v, w, make_fp8_scale<true, BRACKET>(s[i / per_scale]));
  for (int k = 0; k < 8; ++k) out[i + k] = (unsigned char)(w[k >> 2] >> (8 * (k & 3)));
}
// The bracket's constants of each scale: r_lo, r_hi and whether the bracket is tried.
__global__ void kvw_test_bracket_constants(const float* s, float* lo, float* hi,
                                           unsigned char* tried, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const Fp8Scale sc = make_fp8_scale<true, true>(s[i]);
  lo[i] = sc.r_lo;
  hi[i] = sc.r_hi;
  tried[i] = sc.bracket;
}
"""


def _cuda_quantize(x: torch.Tensor, scales: torch.Tensor, fmt: int, bracket: bool, steps: int,
                   macros=()) -> torch.Tensor:
    """fp8_quantize<fmt, 8, steps> of x (float32; x.numel() % 8 == 0) under each scale."""
    dev = torch.cuda.current_device()
    arch, _ = nvrtc.device_arch(dev)
    name = f"kvw_test_quantize<{fmt}, {str(bracket).lower()}, {steps}>"
    obj, _ = cuda_impl.SOURCE.compile(arch, name, source=_QUANTIZE_KERNEL_SRC, macros=macros)
    cc = nvrtc.cuda_core()
    cc.Device(dev).set_current()
    xs = x.repeat(scales.numel()).cuda()
    sd = scales.cuda()
    out = torch.empty(xs.numel(), dtype=torch.uint8, device="cuda")
    config = cc.LaunchConfig(grid=(-(-xs.numel() // (8 * 256)), 1, 1), block=(256, 1, 1))
    cc.launch(nvrtc.current_stream(dev), config, obj.get_kernel(name), xs.data_ptr(),
              sd.data_ptr(), out.data_ptr(), xs.numel(), x.numel())
    torch.cuda.synchronize()
    return out.cpu()


def _near_rounding_boundaries(fp8: torch.dtype, s: float) -> torch.Tensor:
    """float32 x with x / s within 6 ulp of every fp8 rounding boundary (the midpoints
    between neighbouring fp8 values): where a bracket too narrow would round the wrong way."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    vals = codes[codes.isfinite()].unique()
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    base = (mids * s).float().view(torch.int32)
    x = torch.cat([base + k for k in range(-6, 7)]).view(torch.float32)
    x = x[x.isfinite()]
    return x[: x.numel() // 8 * 8]


@gpu
@pytest.mark.parametrize("kv", list(FP8))
def test_cuda_fp8_bracket_against_the_reference(kv):
    """fp8_quantize with the bracket (make_fp8_scale<..., true>) and without it, against the
    reference: every bfloat16 value under scales inside the bracket's range and outside it, and
    float32 values within 6 ulp of every fp8 rounding boundary. The same sweep fails for a
    bracket with no margin. Powers of two (1, 0.5, 0.25, 2^-126 and 2^126 among them: every fp8
    midpoint is an exact quotient under them) have a bracket of no width (its constants:
    test_cuda_fp8_bracket_of_powers_of_two), so their codes are its product's alone."""
    fmt = 3 if kv == "fp8_e4m3" else 4  # DT_E4M3, DT_E5M2
    fp8 = FP8[kv]
    fmax = torch.finfo(fp8).max
    scales = torch.tensor([1.0, 0.5, 0.37, 96.0, 3.0, 1.0 / 3, 7.3e5, 1e-3, 2.0**-100, 2.0**100,
                           1e-38, 2.0**125, -0.37, 0.25, 2.0**-126, 2.0**126, 2.0**127,
                           2.0**-127, -1.0])

    def want(x: torch.Tensor, ss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.cat([x / s for s in ss])
        return q.clamp(-fmax, fmax).to(fp8).view(torch.uint8), q.isnan()

    def differing(got, ref) -> int:
        return int(((got != ref[0]) & ~ref[1]).sum())

    bf16 = _inputs(torch.bfloat16).float()
    ref16 = want(bf16, scales)
    near_s = torch.tensor([0.37, 3.0, 1.0 / 3, 1e-3, 0.7, 5.5])
    near = torch.cat([_near_rounding_boundaries(fp8, float(s)) for s in near_s])
    ref32 = want(near, near_s)
    for bracket in (True, False):
        got = _cuda_quantize(bf16, scales, fmt, bracket, 1)
        assert differing(got, ref16) == 0, f"bracket={bracket}, bfloat16"
        got = _cuda_quantize(near, near_s, fmt, bracket, 2)
        assert differing(got, ref32) == 0, f"bracket={bracket}, near the boundaries"
    narrow = _cuda_quantize(near, near_s, fmt, True, 2, (("KVWRITE_FP8_BRACKET_MARGIN", "0.0f"),))
    assert differing(narrow, ref32) > 0


@gpu
def test_cuda_fp8_bracket_of_powers_of_two():
    """make_fp8_scale<..., true>: for every power of two 2^-126 .. 2^126, r_lo = r_hi = 1 / s
    exactly and the bracket is tried (so it never falls back to the quotient); for every other
    scale tried (their neighbours, negative powers) |r_lo| < |r_hi|, and no scale outside
    2^-100 .. 2^100 but those powers is tried (2^127, subnormal ones, zero, inf)."""
    dev = torch.cuda.current_device()
    arch, _ = nvrtc.device_arch(dev)
    name = "kvw_test_bracket_constants"
    obj, _ = cuda_impl.SOURCE.compile(arch, name, source=_QUANTIZE_KERNEL_SRC)
    cc = nvrtc.cuda_core()
    cc.Device(dev).set_current()
    pow2 = torch.exp2(torch.arange(-126, 127, dtype=torch.float64)).float()
    bits = pow2.view(torch.int32)
    others = torch.cat([(bits + 1).view(torch.float32), (bits - 1).view(torch.float32)[1:],
                        -pow2, torch.tensor([2.0**127, 2.0**-127, 2.0**-149, 0.37, 3.0,
                                             1.0 / 3, 0.0, float("inf")])])
    s = torch.cat([pow2, others]).cuda()
    lo, hi = torch.empty_like(s), torch.empty_like(s)
    tried = torch.empty(s.numel(), dtype=torch.uint8, device="cuda")
    config = cc.LaunchConfig(grid=(-(-s.numel() // 256), 1, 1), block=(256, 1, 1))
    cc.launch(nvrtc.current_stream(dev), config, obj.get_kernel(name), s.data_ptr(),
              lo.data_ptr(), hi.data_ptr(), tried.data_ptr(), s.numel())
    torch.cuda.synchronize()
    n = pow2.numel()
    exact = (1.0 / pow2.double()).float().cuda()
    assert torch.equal(lo[:n], exact) and torch.equal(hi[:n], exact)
    assert bool(tried[:n].all())
    inside = (s[n:].abs() >= 2.0**-100) & (s[n:].abs() <= 2.0**100)
    assert torch.equal(tried[n:].bool(), inside)
    assert bool((lo[n:][inside].abs() < hi[n:][inside].abs()).all())


# ---------------------------------------------------------------------------------------------
# The Triton functions, under the interpreter or on the GPU.
# ---------------------------------------------------------------------------------------------
if triton_impl.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _quotient_kernel(x_ptr, s_ptr, q_ptr, n, per_scale, FMAX: tl.constexpr,
                         STEPS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok, other=0.0)
        s = tl.load(s_ptr + i // per_scale, mask=ok, other=1.0)
        m, s2, y = triton_fp8.fp8_scale(s)
        q = triton_fp8.fp8_quotient(x, m, s2, y, FMAX, STEPS)
        tl.store(q_ptr + i, q, mask=ok)

    @triton.jit
    def _scale_kernel(s_ptr, s2_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        m, s2, y = triton_fp8.fp8_scale(tl.load(s_ptr + i, mask=ok, other=1.0))
        tl.store(s2_ptr + i, s2, mask=ok)
        tl.store(y_ptr + i, y, mask=ok)


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    if dtype != torch.float32:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=g, dtype=torch.int64)
    rnd = bits.to(torch.int32).view(torch.float32)
    near = torch.randn(1 << 16, generator=g) * torch.exp2(
        torch.randint(-30, 20, (1 << 16,), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45,
                            3.4028235e38, -3.4028235e38, 448.0, 464.0, -57344.0, 61440.0])
    return torch.cat([rnd, near, special])


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf/NaN scales
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        HAS_CUDA or triton_impl.available(torch.device("cpu")) is not None,
        reason="the interpreter check runs where there is no GPU")),
    pytest.param("cuda", marks=gpu),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kv", list(FP8))
def test_triton_quotient(kv, dtype, device):
    fp8 = FP8[kv]
    fmax = FP8_MAX[fp8]
    x = _inputs(dtype)
    per = x.numel()
    s = torch.tensor(SCALES, dtype=torch.float32)
    xs = x.repeat(len(SCALES))
    q = torch.empty(xs.numel(), dtype=torch.float32, device=device)
    steps = 2 if dtype == torch.float32 else 1
    block = 1024
    # The interpreter's bfloat16 -> float32 cast flushes subnormals; widen on the host there.
    xin = xs.float() if device == "cpu" and dtype == torch.bfloat16 else xs
    _quotient_kernel[(triton.cdiv(xs.numel(), block),)](
        xin.to(device), s.to(device), q, xs.numel(), per, FMAX=fmax, STEPS=steps, BLOCK=block)
    q = q.cpu()
    ref = (xs.float() / s.repeat_interleave(per)).clamp(-fmax, fmax)

    nan = ref.isnan()
    assert torch.equal(q.isnan(), nan), "NaN where the true quotient is not, or the reverse"
    # Exact float32 bits wherever the quotient is not tiny; signed fp8 codes everywhere.
    big = ~nan & (ref.abs() >= 2.0**-40)
    bad = big & (q.view(torch.int32) != ref.view(torch.int32))
    codes_bad = ~nan & (q.to(fp8).view(torch.uint8) != ref.to(fp8).view(torch.uint8))
    for name, mask in (("float32 quotients", bad), ("fp8 codes", codes_bad)):
        idx = mask.nonzero().flatten()[:5]
        assert idx.numel() == 0, (
            f"{int(mask.sum())} {name} differ, e.g. x={xs[idx].float().tolist()} "
            f"s={[SCALES[i // per] for i in idx.tolist()]}: got {q[idx].tolist()}, "
            f"expected {ref[idx].tolist()}")


@needs_triton
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        HAS_CUDA or triton_impl.available(torch.device("cpu")) is not None,
        reason="the interpreter check runs where there is no GPU")),
    pytest.param("cuda", marks=gpu),
])
def test_triton_scale_reciprocal(device):
    s, s2 = _scales_and_s2()
    got_s2, y = torch.empty_like(s, device=device), torch.empty_like(s, device=device)
    block = 1 << 16
    _scale_kernel[(triton.cdiv(s.numel(), block),)](s.to(device), got_s2, y, s.numel(),
                                                     BLOCK=block)
    assert torch.equal(got_s2.cpu(), s2)
    y, want = y.cpu(), 1.0 / s2
    bad = (y.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()[:5]
    assert bad.numel() == 0, f"y != RN(1/s2) at s2={s2[bad].tolist()}: {y[bad].tolist()}"


# ---------------------------------------------------------------------------------------------
# End to end on the GPU: both fp8 kernels, extreme scales per head.
# ---------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kv", list(FP8))
def test_extreme_scales_end_to_end_gpu(kv, dtype, impl):
    fp8 = FP8[kv]
    num_heads, head_size, block_size = len(SCALES), 64, 16
    x = _inputs(dtype)
    num_tokens = x.numel() // head_size
    x = x[: num_tokens * head_size].view(num_tokens, 1, head_size)
    key = x.expand(num_tokens, num_heads, head_size).contiguous()
    value = key.flip(0)
    gen = torch.Generator().manual_seed(5)
    k_scale = torch.tensor(SCALES, dtype=torch.float32)
    v_scale = k_scale[torch.randperm(num_heads, generator=gen)]
    num_blocks = -(-num_tokens // block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    shape = (num_blocks, block_size, num_heads, head_size)
    kc = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    vc = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    cdt = CacheDType(kv)
    torch_ref.run(key, value, ref_k, ref_v, slots, cdt, k_scale, v_scale)
    dev = [t.cuda() for t in (key, value, kc, vc, slots, k_scale, v_scale)]
    kvwrite.reshape_and_cache_flash(*dev[:5], kv, *dev[5:], implementation=impl)
    assert_caches_equal(dev[2].cpu(), ref_k, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(dev[3].cpu(), ref_v, "value_cache", fp8, nan_equal=True)
    # And one scale for all heads, each of the extreme ones in turn (per-tensor path).
    for s in SCALES[12:]:
        one = torch.tensor([s], dtype=torch.float32)
        rk, rv = kc.clone(), vc.clone()
        torch_ref.run(key, value, rk, rv, slots, cdt, one, one)
        dk, dv = kc.cuda(), vc.cuda()
        kvwrite.reshape_and_cache_flash(dev[0], dev[1], dk, dv, dev[4], kv, one.cuda(),
                                        one.cuda(), implementation=impl)
        assert_caches_equal(dk.cpu(), rk, "key_cache", fp8, nan_equal=True)
        assert_caches_equal(dv.cpu(), rv, "value_cache", fp8, nan_equal=True)


# --- power-of-two scales: one product (kvw/fp8.cuh's pow2_scale_reciprocal) ----------------------

_POW2_HARNESS = r"""
#include "kvw/fp8.cuh"
extern "C" void kvw_pow2_rcp(const float* s, float* r, long long n) {
  for (long long i = 0; i < n; ++i) r[i] = pow2_scale_reciprocal(s[i]);
}
"""


def test_pow2_scale_reciprocal_on_the_host(tmp_path_factory):
    """pow2_scale_reciprocal (compiled for the host): 1 / s exactly for the positive powers of
    two 2^-126 .. 2^126, 0 (the quotient) for every other scale: the powers whose reciprocal
    would not be a normal float (2^127, subnormal ones), their neighbours, negative powers, zeros,
    infinities, NaN and random bits. And the premise the kernels build on: for those scales,
    RN(x * r) is RN(x / s) for every float32 x tried (subnormal results included)."""
    import ctypes

    import numpy as np

    from host import build_host_lib
    lib = build_host_lib(tmp_path_factory, _POW2_HARNESS, "kvwpow2", "power-of-two harness")
    e = torch.arange(0, 255, dtype=torch.int64) << 23  # 0 .. 2^127 (0: the subnormal binade)
    sub = torch.tensor([1 << k for k in range(23)], dtype=torch.int64)  # subnormal powers
    gen = torch.Generator().manual_seed(5)
    bits = torch.cat([e, e[1:] + 1, e[1:] - 1, sub, e | (1 << 31), sub | (1 << 31),
                      torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0x80000000]),
                      torch.randint(0, 1 << 32, (4096,), generator=gen, dtype=torch.int64)])
    s = bits.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)
    s = s.contiguous()
    r = torch.empty_like(s)
    lib.kvw_pow2_rcp(ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(r.data_ptr()),
                     ctypes.c_longlong(s.numel()))
    sb = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    ok = ((sb & 0x7FFFFF) == 0) & ((sb >> 23) >= 1) & ((sb >> 23) <= 253)
    assert int(ok.sum()) == 253
    want = torch.where(ok, 1.0 / s.double(), 0.0).float()
    assert torch.equal(r.view(torch.int32), want.view(torch.int32))
    x = torch.cat([torch.randint(0, 1 << 32, (1 << 14,), generator=gen, dtype=torch.int64),
                   torch.arange(0, 1 << 12)]).bitwise_and(0xFFFFFFFF).to(torch.int32)
    xf = x.view(torch.float32).numpy()
    with np.errstate(all="ignore"):
        for sv, rv in zip(s[ok].numpy(), r[ok].numpy(), strict=True):
            prod, quot = xf * rv, xf / sv
            assert np.array_equal(prod.view(np.int32), quot.view(np.int32)), sv


_FAST16_HARNESS = r"""
#include "kvw/fp8.cuh"
template <int IN> static float h2f(u32 h) {
  if (IN == DT_BF16) return bits_f32(h << 16);
  const u16 b = static_cast<u16>(h);
  _Float16 x;
  __builtin_memcpy(&x, &b, 2);
  return static_cast<float>(x);
}
template <int FMT> static bool nan_code(u32 c) {
  return FMT == DT_E4M3 ? (c & 0x7Fu) == 0x7Fu : (c & 0x7Fu) > 0x7Cu;
}
/* Every 16-bit input under scale s, both fp8 formats: fp8_fast16_clamp, the exact conversion,
   fp8_quantize_fast16 where the scale is in its range (else fp8_quantize under
   fp8_fast16_fallback's constants) against the rule, fp8(RN(x / s)) by a true division (any NaN
   code for a NaN). Returns the mismatches (*fast: whether the fast path took s); bad[] the
   first one (input bits, got, want). */
template <int IN, int FMT> static long check(float s, long* fast, long* bad) {
  const Fp8Fast16 f = fp8_fast16_scale<IN>(s);
  *fast = f.c2 != 0u;
  long n = 0;
  for (u32 w = 0; w < 0x10000u; w += 2) {
    const u32 c = *fast ? fp8_fast16_clamp<IN>(w | ((w + 1) << 16), f) : w | ((w + 1) << 16);
    const float x[2] = {h2f<IN>(c & 0xFFFFu), h2f<IN>(c >> 16)};
    u32 out[1];
    if (*fast) fp8_quantize_fast16<FMT, 2>(x, out, f);
    else fp8_quantize<FMT, 2, 1>(x, out, fp8_fast16_fallback(f));
    for (int k = 0; k < 2; ++k) {
      const u32 got = (out[0] >> (8 * k)) & 0xFFu;
      const u32 want = fp8_from_f32_soft<FMT>(h2f<IN>(w + k) / s);
      if (got != want && !(nan_code<FMT>(got) && nan_code<FMT>(want))) {
        if (n++ == 0) { bad[0] = w + k; bad[1] = got; bad[2] = want; }
      }
    }
  }
  return n;
}
/* fast[0], fast[1]: how many scales took the fast path for bfloat16 and float16 inputs (in both
   formats, else -1). */
extern "C" long kvw_fast16(const float* s, long ns, long* fast, long* bad) {
  long n = 0;
  fast[0] = fast[1] = 0;
  for (long i = 0; i < ns; ++i) {
    long f[4];
    n += check<DT_BF16, DT_E4M3>(s[i], f, bad) + check<DT_BF16, DT_E5M2>(s[i], f + 1, bad) +
         check<DT_F16, DT_E4M3>(s[i], f + 2, bad) + check<DT_F16, DT_E5M2>(s[i], f + 3, bad);
    if (f[0] != f[1] || f[2] != f[3]) { fast[0] = fast[1] = -1; return n; }
    fast[0] += f[0];
    fast[1] += f[2];
    if (n) { bad[3] = i; return n; }
  }
  return n;
}
"""


def _float_bits(*bits: int) -> list[float]:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).tolist()


def test_fp8_fast16_on_the_host(tmp_path_factory):
    """fp8_quantize_fast16 (compiled for the host) gives the rule's code, fp8(RN(x / s)) by a
    true division, for every bfloat16 and float16 input (NaN, ±inf, ±0, subnormals, past every
    clamp) in both fp8 formats, under its range's ends ([2^-60, 2^60] for bfloat16, [2^-60, 1]
    for float16) and their neighbours, every power of two in it, decimal scales whose quotients
    land near fp8 midpoints (0.05, 0.04, 0.01), scales under which one product an element is not
    the rule, and log-uniform random scales; and every other scale (negative, zero, tiny, huge,
    infinite, NaN) takes fp8_quantize under fp8_fast16_fallback's constants, with the same
    codes."""
    import ctypes

    from host import build_host_lib
    lib = build_host_lib(tmp_path_factory, _FAST16_HARNESS, "kvwfast16", "fast16 harness")
    gen = torch.Generator().manual_seed(7)
    # Scales under which RN(x * RN(1 / s)) alone gives another code for some inputs (found by a
    # search over random scales; each of the four input and format pairs has some): the
    # correction step is what these check.
    one_product_fails = _float_bits(0x398372C2, 0x371372C2, 0x3EDC8E38, 0x3CABE666, 0x393B8E38,
                                    0x3D4B38E3, 0x3CF55556, 0x3B927627, 0x3D5D70A3, 0x3D7EFFFF)
    below_one = [2.0**-60, 1.0, 1.0 - 2.0**-24, 0.05, 0.04, 0.01, 0.0123, 1 / 3, 2.0**-7,
                 2.0**-60 * (1 + 2.0**-23), *(2.0**k for k in range(-59, 0)), *one_product_fails,
                 *torch.exp2(-60 * torch.rand(200, generator=gen, dtype=torch.float64)).tolist()]
    above_one = [1.0 + 2.0**-23, 2.0, 3.0, 448.0, 2.0**60, 2.0**60 * (1 - 2.0**-24),
                 *(2.0**k for k in range(1, 60)),
                 *torch.exp2(60 * torch.rand(100, generator=gen, dtype=torch.float64)).tolist()]
    outside = [2.0**-61, 2.0**-60 * (1 - 2.0**-24), 2.0**60 * (1 + 2.0**-23), 2.0**100, -0.05,
               -3.0, 0.0, -0.0, 1e-39, 2.0**-149, 3.4028235e38, float("inf"), -float("inf"),
               float("nan")]
    for scales, want in ((below_one, (1, 1)), (above_one, (1, 0)), (outside, (0, 0))):
        s = torch.tensor(scales, dtype=torch.float32)
        fast, bad = (ctypes.c_long * 2)(), (ctypes.c_long * 4)()
        n = lib.kvw_fast16(ctypes.c_void_p(s.data_ptr()), ctypes.c_long(s.numel()), fast, bad)
        assert n == 0, (f"scale {s[bad[3]].item()!r}: input {bad[0]:#06x} gave {bad[1]:#04x}, "
                        f"the rule {bad[2]:#04x}")
        # the fast path for bfloat16 and float16 inputs, every scale of the list or none
        assert (fast[0], fast[1]) == (want[0] * s.numel(), want[1] * s.numel()), scales


def test_quant_code_names_every_fp8_format_once():
    """store_quantized's QUANT for a cache dtype and for a quantized query's torch dtype (one
    table every Triton launcher asks): the two fp8 formats, a copy for everything else."""
    q = triton_fp8.quant_code
    assert (q(CacheDType.FP8_E4M3), q(CacheDType.FP8_E5M2)) == (triton_fp8.E4M3, triton_fp8.E5M2)
    assert (q(torch.float8_e4m3fn), q(torch.float8_e5m2)) == (triton_fp8.E4M3, triton_fp8.E5M2)
    assert {q(CacheDType.AUTO), q(torch.bfloat16), q(torch.float16)} == {triton_fp8.COPY}
