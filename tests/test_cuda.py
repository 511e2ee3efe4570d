"""The cuda implementation: NVRTC compilation (CPU), the software fp8 conversion and the
division-free fp8 quotient compiled with the system C++ compiler (CPU), the vectorization
rule (CPU), and on a GPU: a dense fp8 exactness sweep, the vector variants, CUDA-graph capture
of a variant first seen inside the capture, the persistent grid and a launch from a new thread.

The case matrix over every implementation lives in test_matrix.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.resources
import re
import threading

import pytest
import torch

import kvwrite
import sass as sass_tools
from host import build_host_lib
from kvwrite.dtypes import FP8_MAX, CacheDType
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.ops.reshape_and_cache_flash import cuda_impl
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.ops.reshape_and_cache_flash.cuda_impl import CallSize
from kvwrite.testing import CASES, Case, assert_caches_equal, clone_caches, make_inputs
from sass import needs_nvrtc

ARCHS = ["sm_80", "sm_89", "sm_90", "sm_100"]
FP8 = {3: torch.float8_e4m3fn, 4: torch.float8_e5m2}  # DT_E4M3, DT_E5M2 in the .cu

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Tunings that force a path (passed to cuda_impl.run / plan explicitly).
LARGE_CALLS = dataclasses.replace(cuda_impl.TUNING, small_call_bytes=0,
                                  mid_call_bytes=0)  # large-call variants
GRID_STRIDE = dataclasses.replace(cuda_impl.TUNING, loop_free=False)  # the grid-stride kernel


# ------------------------------------------------------------------------------------------
# The source and its compilation (no GPU needed)
# ------------------------------------------------------------------------------------------
def test_kernel_source_found_through_importlib_resources():
    res = importlib.resources.files(cuda_impl.SOURCE.package).joinpath(cuda_impl.SOURCE.filename)
    assert res.is_file()
    src = cuda_impl.kernel_source()
    assert src == res.read_text(encoding="utf-8")
    assert cuda_impl.KERNEL in src
    # Only kvwrite's own headers, which ship beside it; none of them includes anything else, so
    # NVRTC needs no CUDA toolkit include directory.
    include = importlib.resources.files("kvwrite.kernels").joinpath("include")
    included = re.findall(r'^\s*#\s*include\s*(\S+)', src, re.M)
    assert included and all(re.fullmatch(r'"kvw/\w+\.cuh"', i) for i in included), included
    for name in included:
        header = include.joinpath(name.strip('"')).read_text(encoding="utf-8")
        for inc in re.findall(r'^\s*#\s*include\s*(\S+)', header, re.M):
            assert re.fullmatch(r'"kvw/\w+\.cuh"', inc), (name, inc)


def _compile_plan() -> dict[str, list[str]]:
    """The variants each architecture's compile test builds, as one NVRTC program per arch: every
    variant for sm_90 (the GPUs kvwrite is measured on), and every variant once more for one of
    sm_80 (software fp8 conversion), sm_89 and sm_100 (hardware conversion), taken in turn, so
    each variant is built for two architectures and each architecture builds every kind of
    variant (measured on 2 cores: 51 s instead of 99 s for all four archs x all variants)."""
    names = cuda_impl.all_kernel_names()
    others = [a for a in ARCHS if a != "sm_90"]
    return {"sm_90": names, **{a: names[i::len(others)] for i, a in enumerate(others)}}


def test_compile_plan_covers_every_variant_and_arch():
    plan, names = _compile_plan(), cuda_impl.all_kernel_names()
    assert set(plan) == set(ARCHS) and plan["sm_90"] == names
    others = [n for a in ARCHS if a != "sm_90" for n in plan[a]]
    assert sorted(others) == sorted(names)  # each exactly once beside sm_90
    for arch in ARCHS:  # every (input, output) kind pair and both kernels on every arch
        kinds = {re.match(r"(\w+)<(\d), (\d),", n).groups() for n in plan[arch]}
        assert {k[1:] for k in kinds} == {re.match(r"\w+<(\d), (\d),", n).groups() for n in names}
        assert {k[0] for k in kinds} == {cuda_impl.KERNEL, cuda_impl.GRID_STRIDE_KERNEL}


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compile_every_variant(arch):
    names = _compile_plan()[arch]
    obj, _ = cuda_impl.compile_kernel(arch, names)
    assert len(bytes(obj.code)) > 0
    assert set(names) <= set(obj.symbol_mapping)


@needs_nvrtc
def test_compile_kernel_signature_matches_the_launch_arguments():
    # run() passes 7 pointers, num_tokens, two scale strides, then fixed_args(): every scalar a
    # Python int, which cuda.core passes as 8 bytes. The mangled name lists the parameter types.
    key = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    kc, vc = allocate_kv_cache(4, 16, 8, 128, torch.bfloat16, device="cpu")
    p = cuda_impl.plan(key, key, kc, vc, torch.zeros(4, dtype=torch.int32), CacheDType.AUTO)
    obj, _ = cuda_impl.compile_kernel("sm_90", p.name)
    params = sass_tools.kernel_params(obj, p.name)
    # 4 byte pointers (PKh S1_ Ph S2_), the int slots (PKi / PKT2_), 2 float pointers, int64s.
    assert re.fullmatch(r"PKhS1_PhS2_PKT2_PKfS7_(x+)", params), params
    num_int64 = len(re.fullmatch(r".*?(x+)", params).group(1))
    assert num_int64 == 3 + len(cuda_impl.fixed_args(key, key, kc, p))


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compile_exact_division_variants(arch):
    # The fp8 variants with KVWRITE_EXACT_DIV, half for sm_80 (software conversion) and half for
    # sm_90 (hardware conversion), taken in turn: each variant built once.
    names = [n for n in cuda_impl.all_kernel_names() if re.search(r"<\d, [34],", n)]
    names = names[["sm_80", "sm_90"].index(arch)::2]
    obj, _ = cuda_impl.compile_kernel(arch, names, exact_div=True)
    assert len(bytes(obj.code)) > 0
    assert set(names) <= set(obj.symbol_mapping)


@needs_nvrtc
def test_nvrtc_compile_error_carries_the_log():
    broken = cuda_impl.kernel_source() + "\n__global__ void broken() { kvw_no_such_name(1); }\n"
    with pytest.raises(RuntimeError) as info:
        cuda_impl.compile_kernel("sm_90", "broken", source=broken)
    text = str(info.value)
    assert "NVRTC could not compile broken for sm_90" in text
    assert "kvw_no_such_name" in text and "undefined" in text  # NVRTC's own diagnostic


needs_cuobjdump = pytest.mark.skipif(sass_tools.cuobjdump() is None,
                                     reason="no cuobjdump (CUDA toolkit or triton wheel)")


def _sass(tmp_path, name: str, fixed=None) -> str:
    """The sm_90 machine code of one kernel variant, as cuobjdump prints it."""
    obj, _ = cuda_impl.compile_kernel("sm_90", name, fixed=fixed)
    return sass_tools.dump_sass(bytes(obj.code), tmp_path)


def _sass_ops(tmp_path, name: str, fixed=None) -> list[str]:
    """The opcodes of one kernel variant's sm_90 machine code, in order (predicates dropped)."""
    return sass_tools.opcodes(_sass(tmp_path, name, fixed))


@needs_nvrtc
@needs_cuobjdump
@pytest.mark.parametrize("in_dtype, cache_dtype, store", [
    (torch.bfloat16, CacheDType.AUTO, "STG.E.128"),
    (torch.bfloat16, CacheDType.FP8_E4M3, "STG.E.128"),
    (torch.float32, CacheDType.BFLOAT16, "STG.E.64"),
])
def test_compile_sm90_fast_paths_use_vector_accesses(tmp_path, in_dtype, cache_dtype, store):
    # The machine code of the 16-byte variants must move whole vectors: 128-bit loads, and
    # stores as wide as VEC cache elements (a compiler may narrow them; NVRTC 13.5 did once).
    key = torch.empty(4, 8, 128, dtype=in_dtype)
    cache_tensor_dtype = torch.uint8 if cache_dtype.is_fp8 else cache_dtype.element_dtype(in_dtype)
    kc, vc = allocate_kv_cache(4, 16, 8, 128, cache_tensor_dtype, device="cpu")
    p = cuda_impl.plan(key, key, kc, vc, torch.zeros(4, dtype=torch.int64), cache_dtype,
                       size=CallSize.LARGE)
    assert p.vec_bytes == (32 if cache_dtype.is_fp8 else 16)  # fp8: two 16-byte loads a chunk
    sass = _sass(tmp_path, p.name)
    assert "LDG.E.128" in sass
    assert store in sass
    # Every store of the variant is a whole VEC-element vector (none narrowed).
    assert set(re.findall(r"STG\.E[.\w]*", sass)) == {store}


def _h8_call(cache_dtype: CacheDType, layout: Layout, tokens: int):
    """(key, key_cache, plan) of an H=8, D=128 bfloat16 call into an interleaved cache."""
    key = torch.empty(tokens, 8, 128, dtype=torch.bfloat16)
    storage = torch.uint8 if cache_dtype.is_fp8 else torch.bfloat16
    kc, vc = allocate_kv_cache(64, 16, 8, 128, storage, layout, KVAlloc.INTERLEAVED, "cpu")
    slots = torch.zeros(tokens, dtype=torch.int64)
    return key, kc, cuda_impl.plan(key, key, kc, vc, slots, cache_dtype)


def _param_bank_reads(tmp_path, name: str, fixed) -> set[int]:
    return sass_tools.param_reads(_sass(tmp_path, name, fixed))


@needs_nvrtc
@needs_cuobjdump
@pytest.mark.parametrize("cache_dtype", [CacheDType.AUTO, CacheDType.FP8_E4M3])
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_compile_specialized_build_reads_no_fixed_argument(tmp_path, cache_dtype, layout):
    # sm_90 kernels find their parameters at c[0x0][0x210] on: 7 pointers, num_tokens and the
    # two scale strides (0x210-0x25f), then fixed_args (0x260 on). The build with the fixed
    # arguments compiled in must read none of them; the generic build reads them.
    key, kc, p = _h8_call(cache_dtype, layout, 4)
    fixed = cuda_impl.fixed_args(key, key, kc, p)
    first, end = 0x210 + 8 * 10, 0x210 + 8 * (10 + len(fixed))
    generic = _param_bank_reads(tmp_path, p.name, None)
    special = _param_bank_reads(tmp_path, p.name, fixed)
    sass_tools.assert_fixed_args_compiled_in(generic, special, first, end)
    assert 0x210 in special and 0x248 in special  # the key pointer and num_tokens still are


@needs_nvrtc
@needs_cuobjdump
@pytest.mark.parametrize("cache_dtype", [CacheDType.AUTO, CacheDType.FP8_E4M3])
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_compile_loop_free_kernel_loads_before_the_slot_test(tmp_path, cache_dtype, layout):
    # The loop-free kernel must issue the slot's, the data's (and the scales') loads together:
    # no exit or branch between the first load and the last. (ptxas moves plain loads whose only
    # use is a store under the slot's test below that test, which makes them wait for the slot's
    # load.)
    key, kc, p = _h8_call(cache_dtype, layout, 2)
    assert p.loop_free and p.name.startswith(cuda_impl.KERNEL + "<")
    for fixed in (cuda_impl.fixed_args(key, key, kc, p), None):
        ops = _sass_ops(tmp_path, p.name, fixed)
        loads = [i for i, op in enumerate(ops) if "LDG" in op]
        assert len(loads) == (5 if cache_dtype.is_fp8 else 3), ops  # slot, K, V (, 2 scales)
        between = ops[loads[0]:loads[-1]]
        assert not [op for op in between if "EXIT" in op or "BRA" in op], between


@needs_nvrtc
@needs_cuobjdump
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
# 8-, 16- and 32-byte fp8 chunks (small, mid-sized and large plans)
@pytest.mark.parametrize("tokens, chunk", [(2, 8), (512, 16), (4096, 32)])
def test_compile_fp8_kernel_loads_before_any_arithmetic(tmp_path, layout, tokens, chunk):
    # The fp8 loop-free kernel must have every load in flight before any of the conversion's
    # floating-point work (none between its first load and its last). Small calls' 8-byte
    # chunks prepare the scales without a call (rcp_rn_s2); 16- and 32-byte chunks keep div_rn,
    # whose branch keeps ptxas from issuing V's chunk, or the second halves of the chunks, among
    # the conversions (it did both with rcp_rn_s2).
    key, kc, p = _h8_call(CacheDType.FP8_E4M3, layout, tokens)
    assert p.loop_free and p.vec_bytes == chunk
    for fixed in (cuda_impl.fixed_args(key, key, kc, p), None):
        ops = _sass_ops(tmp_path, p.name, fixed)
        loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
        assert len(loads) == (7 if chunk == 32 else 5), ops  # slot, K, V (halves), 2 scales
        between = ops[loads[0]:loads[-1]]
        assert not [op for op in between
                    if op.split(".")[0] in ("MUFU", "FFMA", "FMUL", "FMNMX", "F2FP")], between
        if fixed is not None and tokens == 2:  # (a generic build keeps a 64-bit division's call)
            assert not [op for op in ops if op.startswith("CALL")], "a call in the fp8 kernel"


@needs_nvrtc
def test_compile_fixed_args_must_be_complete():
    name = cuda_impl.all_kernel_names()[0]
    with pytest.raises(RuntimeError, match="KVWRITE_FIXED_ARGS: 11 values"):
        cuda_impl.compile_kernel("sm_90", name, fixed=(1, 2, 3))


# ------------------------------------------------------------------------------------------
# The vectorization rule and the CTA shape (pure Python)
# ------------------------------------------------------------------------------------------
def _plan(num_heads, head_size, dtype=torch.bfloat16, cache_dtype=CacheDType.AUTO,
          layout=Layout.NHD, alloc=KVAlloc.SEPARATE, key_offset=0, size=CallSize.LARGE,
          tuning=cuda_impl.TUNING):
    rows = torch.empty(8 * num_heads * head_size + key_offset, dtype=dtype)
    key = rows[key_offset:].view(8, num_heads, head_size)
    storage = torch.uint8 if cache_dtype.is_fp8 else cache_dtype.element_dtype(dtype)
    kc, vc = allocate_kv_cache(4, 16, num_heads, head_size, storage, layout, alloc, "cpu")
    return cuda_impl.plan(key, key, kc, vc, torch.zeros(8, dtype=torch.int64), cache_dtype, size,
                          tuning)


def test_plan_narrower_chunks_for_small_calls():
    # Small calls spread each token over more threads: fp8 8 input bytes a chunk instead of 32.
    p = _plan(8, 128, cache_dtype=CacheDType.FP8_E4M3, size=CallSize.SMALL)
    assert (p.vec, p.vec_bytes, p.threads, p.tokens_per_cta) == (4, 8, 256, 1)
    assert _plan(8, 128, size=CallSize.SMALL).vec_bytes == cuda_impl.TUNING.small_chunk_bytes_copy
    # Mid-sized calls: one 16-byte load per tensor and thread.
    mid = _plan(128, 128, cache_dtype=CacheDType.FP8_E4M3, size=CallSize.MID)
    assert (mid.vec, mid.vec_bytes, mid.threads, mid.grid_y) == (8, 16, 256, 8)
    # Every call whose row fits the grid runs the loop-free kernel.
    assert p.loop_free and p.name.startswith(cuda_impl.KERNEL + "<")
    big = _plan(128, 128, cache_dtype=CacheDType.FP8_E4M3)
    assert big.loop_free and big.name.startswith(cuda_impl.KERNEL + "<")


def test_plan_grid_stride_kernel_for_rows_longer_than_the_grid():
    # H=128 fp8 rows are 1024 chunks, 4 CTAs of 256: with at most 1 CTA per token the row does
    # not fit, and the grid-stride kernel (which loops over the rest) takes it.
    one_cta = dataclasses.replace(cuda_impl.TUNING, max_grid_y=1)
    p = _plan(128, 128, cache_dtype=CacheDType.FP8_E4M3, tuning=one_cta)
    assert (p.grid_y, p.threads, p.chunks_per_token) == (1, 256, 1024)
    assert not p.loop_free and p.name.startswith(cuda_impl.GRID_STRIDE_KERNEL + "<")
    assert not _plan(8, 128, size=CallSize.SMALL, tuning=GRID_STRIDE).loop_free
    # The decision, from the call's size (key bytes).
    t = dataclasses.replace(cuda_impl.TUNING, small_call_bytes=1000, mid_call_bytes=3000)
    assert [t.call_size(n) for n in (1000, 1001, 3000, 3001)] == [
        CallSize.SMALL, CallSize.MID, CallSize.MID, CallSize.LARGE]
    # ... and what run() plans from it: the key bytes of the call's tokens.
    assert _plan(8, 128, size=None, tuning=t).vec_bytes == t.chunk_bytes_copy  # 8 * 2 KiB keys


def test_plan_16_byte_vectors_for_h8_d128_bf16():
    for layout in Layout:
        for alloc in KVAlloc:
            p = _plan(8, 128, layout=layout, alloc=alloc)
            assert (p.vec, p.vec_bytes) == (8, 16), (layout, alloc)
            # One token's 128 chunks fill a CTA of SMALL_ROW_THREADS = 128.
            assert (p.threads, p.tokens_per_cta, p.grid_y) == (128, 1, 1)
    # fp8: 32 input bytes (16 elements) a chunk, one 16-byte store of codes.
    p = _plan(8, 128, cache_dtype=CacheDType.FP8_E4M3, alloc=KVAlloc.PACKED)
    assert p.vec_bytes == 32 and "<1, 3, 16, long long>" in p.name
    assert (p.threads, p.tokens_per_cta) == (128, 2)  # 64 chunks a token
    p = _plan(8, 128, dtype=torch.float32, cache_dtype=CacheDType.FP8_E5M2)
    assert (p.vec, p.vec_bytes) == (8, 32)
    p = _plan(8, 120, cache_dtype=CacheDType.FP8_E4M3)  # 120 % 16 != 0: back to 8 elements
    assert (p.vec, p.vec_bytes) == (8, 16)


def test_plan_falls_back_where_rows_are_not_16_byte_aligned():
    assert _plan(5, 46).vec == 2  # 92-byte rows: 4-byte vectors
    assert _plan(5, 46, cache_dtype=CacheDType.FP8_E4M3, alloc=KVAlloc.PACKED).vec == 2
    assert _plan(8, 128, key_offset=1).vec == 1  # key starts 2 bytes into an allocation
    assert _plan(3, 45).vec == 1
    assert _plan(8, 128, dtype=torch.float32, cache_dtype=CacheDType.BFLOAT16).vec == 4


def test_plan_splits_large_rows_over_ctas():
    p = _plan(128, 128)
    assert (p.threads, p.tokens_per_cta, p.grid_y, p.chunks_per_token) == (256, 1, 8, 2048)
    p = _plan(128, 120)  # 1920 chunks: 8 balanced parts of 240
    assert (p.threads, p.grid_y) == (240, 8)
    p = _plan(24, 64)  # 192 chunks: one token per CTA of 192 threads
    assert (p.threads, p.tokens_per_cta, p.grid_y) == (192, 1, 1)
    p = _plan(4, 16)  # 8 chunks a token: 16 tokens per CTA
    assert (p.threads, p.tokens_per_cta, p.grid_y) == (128, 16, 1)
    p = _plan(1, 64)
    assert (p.threads, p.tokens_per_cta) == (128, 16)


def test_cuda_unavailable_on_cpu_says_why():
    reason = cuda_impl.available(torch.device("cpu"))
    assert reason and "CUDA devices only" in reason
    if not torch.cuda.is_available():
        reason = cuda_impl.available(torch.device("cuda"))
        assert reason and ("GPU" in reason or "pip install" in reason)


# ------------------------------------------------------------------------------------------
# The software fp8 conversion and the division-free quotient, compiled with the host C++ compiler
# ------------------------------------------------------------------------------------------
_HARNESS = r"""
#include "kvw/fp8.cuh"  // the shared fp8 header, as every op's kernel includes it
extern "C" {
void kvw_fp8_soft(int fmt, const float* x, unsigned char* out, long long n) {
  for (long long i = 0; i < n; ++i)
    out[i] = (unsigned char)(fmt == DT_E4M3 ? fp8_from_f32_soft<DT_E4M3>(x[i])
                                            : fp8_from_f32_soft<DT_E5M2>(x[i]));
}
void kvw_bf16_soft(const float* x, unsigned short* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = (unsigned short)bf16_from_f32_soft(x[i]);
}
// Q(x / s) for n elements (n % 8 == 0) in chunks of 8, as the kernel does, with `steps`
// correction steps of the division-free quotient (1 for 16-bit inputs, 2 for float32).
void kvw_fp8_quantize(int fmt, int steps, const float* x, float s, unsigned char* out,
                      long long n) {
  const Fp8Scale sc = make_fp8_scale(s);
  for (long long c = 0; c < n; c += 8) {
    float v[8];
    u32 w[2];
    for (int i = 0; i < 8; ++i) v[i] = x[c + i];
    if (fmt == DT_E4M3) {
      if (steps == 1) fp8_quantize<DT_E4M3, 8, 1>(v, w, sc); else fp8_quantize<DT_E4M3, 8, 2>(v, w, sc);
    } else {
      if (steps == 1) fp8_quantize<DT_E5M2, 8, 1>(v, w, sc); else fp8_quantize<DT_E5M2, 8, 2>(v, w, sc);
    }
    __builtin_memcpy(out + c, w, 8);
  }
}
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    so = build_host_lib(tmp_path_factory, _HARNESS, "kvwfp8", "conversion harness")
    so.kvw_fp8_quantize.restype = None
    return so


def _reference(x: torch.Tensor, s: float, fp8: torch.dtype) -> torch.Tensor:
    """the fp8 rule on the CPU, as kvwrite.dtypes.quantize does."""
    q = (x.float() / torch.tensor(s, dtype=torch.float32)).clamp(-FP8_MAX[fp8], FP8_MAX[fp8])
    return q.to(fp8).view(torch.uint8)


def _assert_fp8_equal(got: torch.Tensor, want: torch.Tensor, fp8: torch.dtype, x: torch.Tensor):
    both_nan = torch.isnan(got.view(fp8).float()) & torch.isnan(want.view(fp8).float())
    bad = torch.nonzero((got != want) & ~both_nan).flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} fp8 codes differ; first inputs {x[bad[:6]].tolist()}: got "
        f"{got[bad[:6]].tolist()}, expected {want[bad[:6]].tolist()}")


def _fp8_grid(fp8: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours, both signs, +-2 float32 ulps."""
    vals = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()
    mx = FP8_MAX[fp8]
    base = torch.cat([vals, mids, torch.tensor([mx * 1.0625, mx * 1.125, mx * 2, 2 * mx + 1])])
    out = [base]
    up, down = base.clone(), base.clone()
    for _ in range(2):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(float("-inf")))
        out += [up, down]
    grid = torch.cat(out)
    return torch.cat([grid, -grid])


def _specials() -> torch.Tensor:
    return torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                         1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, 3.4028235e38, -3.4028235e38])


def _random_floats(n: int, seed: int) -> torch.Tensor:
    """2n values, alternating: random float32 bit patterns (every exponent, NaNs included) and
    normal values spread over the fp8 range and past it."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    mag = torch.exp2(torch.randint(-24, 18, (n,), generator=g).float())
    spread = torch.randn(n, generator=g) * mag
    return torch.stack([bits.view(torch.float32), spread], dim=1).flatten()


def _pad8(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.zeros((-x.numel()) % 8)])


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_host_software_fp8_conversion_matches_torch(host_lib, fmt):
    fp8 = FP8[fmt]
    x = torch.cat([_specials(), _fp8_grid(fp8), _random_floats(2_000_000, seed=fmt)]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    host_lib.kvw_fp8_soft(fmt, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                          ctypes.c_longlong(x.numel()))
    _assert_fp8_equal(out, _reference(x, 1.0, fp8), fp8, x)


# Scales: ordinary, powers of two (exact ties), negative, tiny, subnormal, huge, zero, infinite
# and NaN.
_SCALES = [0.37, 3.0, 0.0123, 7.3e5, 0.25, 1.0, -0.5, 2.0**-126, 1e-40, 2.0**-149, 2.0**121,
           3.4028235e38, -2.7e-20, 0.0, -0.0, float("inf"), -float("inf"), float("nan")]


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_host_division_free_quotient_is_bit_exact(host_lib, fmt):
    """The kernel's fp8 path (make_fp8_scale, fp8_quotient, fp8_quantize, software conversion)
    against the fp8 rule: float32 inputs with two correction steps, bfloat16 and float16 values
    with one."""
    fp8 = FP8[fmt]
    grid = _fp8_grid(fp8)
    rand = _random_floats(300_000, seed=10 + fmt)
    for s in _SCALES:
        # Near-ties: x = RN(m * s) and its float32 neighbours, so x / s falls on or next to every
        # fp8 rounding boundary m.
        near = (grid.double() * s).float() if 0 < abs(s) < float("inf") else grid
        x = torch.cat([_specials(), near, rand])
        for steps, inputs in ((2, x), (1, x.to(torch.bfloat16).float()),
                              (1, x.to(torch.float16).float())):
            inputs = _pad8(inputs).contiguous()
            out = torch.empty(inputs.numel(), dtype=torch.uint8)
            host_lib.kvw_fp8_quantize(fmt, steps, ctypes.c_void_p(inputs.data_ptr()),
                                      ctypes.c_float(s), ctypes.c_void_p(out.data_ptr()),
                                      ctypes.c_longlong(inputs.numel()))
            _assert_fp8_equal(out, _reference(inputs, s, fp8), fp8, inputs)


def test_host_software_bf16_conversion_matches_torch(host_lib):
    x = torch.cat([_specials(), _random_floats(1_000_000, seed=3)]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.int16)
    host_lib.kvw_bf16_soft(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_longlong(x.numel()))
    want = x.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(out[~nan], want[~nan])
    assert bool((out[nan] == 0x7FFF).all())


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
def _run_both(inp, tuning=None):
    """Run the cuda kernel on ``inp`` (through the public op, or with ``tuning`` directly) and the
    torch reference on copies of its starting caches (same device); returns the reference caches."""
    ref_k, ref_v = clone_caches(inp)
    cd = kvwrite.ops.reshape_and_cache_flash.validate(*inp.args())
    scales = (inp.k_scale, inp.v_scale) if cd.is_fp8 else (None, None)
    torch_ref.run(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping, cd, *scales)
    if tuning is None:
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="cuda")
    else:
        cuda_impl.run(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping, cd,
                      *scales, tuning=tuning)
    torch.cuda.synchronize()
    return ref_k, ref_v


def _check(inp, ref_k, ref_v, cd: CacheDType):
    fp8 = cd.fp8_dtype if cd.is_fp8 else None
    assert_caches_equal(inp.key_cache, ref_k, "key_cache", fp8_dtype=fp8, nan_equal=cd.is_fp8)
    assert_caches_equal(inp.value_cache, ref_v, "value_cache", fp8_dtype=fp8, nan_equal=cd.is_fp8)


def _sweep_inputs(fp8: torch.dtype, scales: torch.Tensor, num_heads=8, head_size=128, tokens=1024,
                  seed=0) -> torch.Tensor:
    """[tokens, H, D] float32 values: specials, near-ties for each head's scale, random floats."""
    per_head = []
    n = tokens * head_size
    grid = _fp8_grid(fp8)
    for h in range(num_heads):
        s = float(scales[h if scales.numel() > 1 else 0])
        near = (grid.double() * s).float() if 0 < abs(s) < float("inf") else grid
        vals = torch.cat([_specials(), near, _random_floats(n, seed=seed + h)])[:n]
        per_head.append(vals.view(tokens, head_size))
    return torch.stack(per_head, dim=1).contiguous()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("exact_div", [False, True], ids=["division-free", "exact-div"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_gpu_fp8_exactness_sweep(kv, per_head, exact_div):
    """About 2 x 1M float32 values (specials, every fp8 rounding boundary times each scale and
    its neighbours, random bit patterns) through the real kernel, byte for byte vs the fp8 rule."""
    tuning = dataclasses.replace(cuda_impl.TUNING, exact_div=exact_div)
    cd = kvwrite.dtypes.parse_kv_cache_dtype(kv)
    fp8 = cd.fp8_dtype
    H, D, T, bs = 8, 128, 1024, 16
    if per_head:
        k_scale = torch.tensor([0.37, 1.0, 0.125, 3.0, 1e-38, 7.3e5, 0.0123, 2.0**125])
        v_scale = torch.tensor([2.5, 0.001, 1.0, 0.3, 2.0**-121, 1e30, 0.75, 11.0])
    else:
        k_scale, v_scale = torch.tensor([0.37]), torch.tensor([3.0])
    key = _sweep_inputs(fp8, k_scale, H, D, T, seed=1)
    value = _sweep_inputs(fp8, v_scale, H, D, T, seed=2)
    slots = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    kc, vc = allocate_kv_cache(T // bs, bs, H, D, torch.uint8, device="cpu")
    args = [key, value, kc, vc, slots, kv, k_scale, v_scale]
    ref_k, ref_v = kc.clone(), vc.clone()
    torch_ref.run(key, value, ref_k, ref_v, slots, cd, k_scale, v_scale)
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    cuda_impl.run(*dev[:5], cd, *dev[6:], tuning=tuning)
    assert_caches_equal(dev[2], ref_k, "key_cache", fp8_dtype=fp8, nan_equal=True)
    assert_caches_equal(dev[3], ref_v, "value_cache", fp8_dtype=fp8, nan_equal=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("size", list(CallSize), ids=lambda s: s.value)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_gpu_fp8_every_16_bit_input(kv, dtype, size):
    """All 65536 bit patterns of the input dtype, as [64, 8, 128] rows (the chunk width of each
    call size), under several per-tensor scales and one set of per-head scales."""
    limits = {CallSize.SMALL: (1 << 30, 1 << 30), CallSize.MID: (0, 1 << 30),
              CallSize.LARGE: (0, 0)}[size]
    tuning = dataclasses.replace(cuda_impl.TUNING, small_call_bytes=limits[0],
                                 mid_call_bytes=limits[1])
    cd = kvwrite.dtypes.parse_kv_cache_dtype(kv)
    fp8 = cd.fp8_dtype
    key = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    key = key.view(64, 8, 128)
    value = key.flip(0)
    slots = torch.arange(64)
    per_head = torch.tensor([0.37, 1.0, 0.125, 3.0, 1e-38, 7.3e5, 0.0123, 2.0**125])
    scales = [(torch.tensor([s]), torch.tensor([1 / s])) for s in (0.37, 1.0, 96.0)]
    for k_scale, v_scale in scales + [(per_head, per_head.flip(0))]:
        kc, vc = allocate_kv_cache(4, 16, 8, 128, torch.uint8, device="cpu")
        ref_k, ref_v = kc.clone(), vc.clone()
        torch_ref.run(key, value, ref_k, ref_v, slots, cd, k_scale, v_scale)
        dev = [t.cuda() for t in (key, value, kc, vc, slots)] + [kv, k_scale.cuda(), v_scale.cuda()]
        p = cuda_impl.plan(*dev[:5], cd, tuning=tuning)
        assert p.vec_bytes == tuning.chunk_input_bytes(True, size)
        cuda_impl.run(*dev[:5], cd, *dev[6:], tuning=tuning)
        assert_caches_equal(dev[2], ref_k, "key_cache", fp8_dtype=fp8, nan_equal=True)
        assert_caches_equal(dev[3], ref_v, "value_cache", fp8_dtype=fp8, nan_equal=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads, head_size, kv, vec_bytes", [
    (8, 128, "auto", 16), (8, 128, "fp8", 32), (5, 46, "auto", 4), (5, 46, "fp8", 4)])
def test_gpu_vector_variant_choice(num_heads, head_size, kv, vec_bytes):
    case = Case(num_tokens=129, num_heads=num_heads, head_size=head_size, num_blocks=16,
                kv_cache_dtype=kv, padding_slots=3, out_of_range_slots=2, extra_rows=4)
    inp = make_inputs(case, "cuda")
    cd = case.cache_dtype
    p = cuda_impl.plan(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping, cd,
                       tuning=LARGE_CALLS)
    assert p.vec_bytes == vec_bytes
    ref_k, ref_v = _run_both(inp, LARGE_CALLS)
    _check(inp, ref_k, ref_v, cd)


@pytest.mark.gpu
@gpu
def test_gpu_unaligned_input_uses_scalar_variant():
    case = Case(num_tokens=33, num_heads=8, head_size=128, num_blocks=4)
    inp = make_inputs(case, "cuda")
    buf = torch.empty(inp.key.numel() + 1, dtype=inp.key.dtype, device="cuda")
    inp.key = buf[1:].view(inp.key.shape).copy_(inp.key)  # 2 bytes past a 16-byte boundary
    p = cuda_impl.plan(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping,
                       case.cache_dtype)
    assert p.vec == 1
    ref_k, ref_v = _run_both(inp)
    _check(inp, ref_k, ref_v, case.cache_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size, slot_dtype", [(16, torch.int64), (12, torch.int32)])
def test_gpu_persistent_grid_walks_every_token(block_size, slot_dtype, monkeypatch):
    # 120k tokens of 8 chunks with the grid capped at one resident wave: threads loop over
    # many tokens (two a step).
    tuning = dataclasses.replace(GRID_STRIDE, max_waves=1)
    monkeypatch.setattr(cuda_impl, "LAUNCHES", {})
    case = Case(num_tokens=120_001, num_heads=1, head_size=64, block_size=block_size,
                num_blocks=-(-130_000 // block_size), padding_slots=500, out_of_range_slots=500,
                slot_dtype=slot_dtype)
    inp = make_inputs(case, "cuda")
    ref_k, ref_v = _run_both(inp, tuning)
    (lau,) = cuda_impl.LAUNCHES.values()
    max_grid_x = lau.bounds[1]
    assert max_grid_x * lau.plan.tokens_per_cta < case.num_tokens  # the loop really runs
    _check(inp, ref_k, ref_v, case.cache_dtype)


@pytest.mark.gpu
@gpu
def test_gpu_graph_capture_of_a_new_variant_and_replay():
    """The first call of a variant happens inside the capture (compile and module load there);
    replays see new inputs, slots and scales."""
    case = Case(num_tokens=37, num_heads=3, head_size=80, dtype=torch.float16,
                kv_cache_dtype="fp8_e5m2", per_head_scale=True, layout=Layout.HND,
                alloc=KVAlloc.PACKED, slot_dtype=torch.int32,
                padding_slots=4)
    inp = make_inputs(case, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="cuda")
    for seed in (1, 2):
        new = make_inputs(case, "cuda", seed=seed)
        for name in ("key", "value", "slot_mapping", "k_scale", "v_scale"):
            getattr(inp, name).copy_(getattr(new, name))
        ref_k, ref_v = clone_caches(inp)
        torch_ref.run(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping, case.cache_dtype,
                      inp.k_scale, inp.v_scale)
        graph.replay()
        torch.cuda.synchronize()
        _check(inp, ref_k, ref_v, case.cache_dtype)


@pytest.mark.gpu
@gpu
def test_gpu_launch_from_a_new_thread():
    case = Case(num_tokens=17, num_heads=2, head_size=96, kv_cache_dtype="bfloat16",
                dtype=torch.float32)
    assert cuda_impl.available(torch.device("cuda")) is None
    inp = make_inputs(case, "cuda")
    ref_k, ref_v = clone_caches(inp)
    torch_ref.run(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping, case.cache_dtype, None, None)
    errors = []

    def work():
        try:
            kvwrite.reshape_and_cache_flash(*inp.args(), implementation="cuda")
            torch.cuda.synchronize()
        except Exception as e:  # surfaced in the main thread below
            errors.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errors, errors
    _check(inp, ref_k, ref_v, case.cache_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("loop_free", [True, False], ids=["loop-free", "grid-stride"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_case_matrix_with_large_call_variants(case, loop_free):
    """The case matrix runs mostly small calls (test_matrix.py); here every case takes the
    variants and CTA shapes of large calls (for fp8, 32-byte chunks) instead, in both kernels."""
    tuning = dataclasses.replace(LARGE_CALLS, loop_free=loop_free)
    inp = make_inputs(case, "cuda")
    ref_k, ref_v = _run_both(inp, tuning)
    _check(inp, ref_k, ref_v, case.cache_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("small_limit", [None, 0], ids=["default-plan", "large-call-plan"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_case_matrix_with_generic_kernels(record_builds, case, small_limit):
    """KVWRITE_CUDA_SPECIALIZE=0: the same kernels with their fixed arguments read at run time."""
    tuning = dataclasses.replace(cuda_impl.TUNING, specialize=False)
    if small_limit is not None:
        tuning = dataclasses.replace(tuning, small_call_bytes=small_limit,
                                     mid_call_bytes=small_limit)
    seen = record_builds(cuda_impl.SOURCE)
    inp = make_inputs(case, "cuda")
    ref_k, ref_v = _run_both(inp, tuning)
    _check(inp, ref_k, ref_v, case.cache_dtype)
    assert set(seen) <= {None}


@pytest.mark.gpu
@gpu
def test_gpu_specialized_build_is_the_default(monkeypatch, record_builds):
    monkeypatch.setattr(cuda_impl, "LAUNCHES", {})
    seen = record_builds(cuda_impl.SOURCE)
    case = CASES[0]
    inp = make_inputs(case, "cuda")
    ref_k, ref_v = _run_both(inp)
    _check(inp, ref_k, ref_v, case.cache_dtype)
    (lau,) = cuda_impl.LAUNCHES.values()
    # One build, and its programmatic-dependent-launch twin where the device takes those.
    assert seen == [lau.fixed] * (1 if lau.pdl_kernel is None else 2)
