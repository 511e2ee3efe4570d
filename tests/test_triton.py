"""Tests specific to the Triton implementation (the case matrix in test_matrix.py covers the rest).

On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, which conftest.py sets
when there is no GPU). There it checks the kernel's indexing (layouts, head chunks, tokens per
program, the 2D grid of token and head tiles, padding and out-of-range slots, int32 slots, odd head sizes) and
the casts the interpreter rounds like the GPU: copies, float16->float32, bfloat16->float16,
float32->float16, and fp8 from float16 and float32 rows (the kernel's integer form of the codes:
kvwrite.kernels.triton_fp8.fp8_code). The interpreter rounds float32->bfloat16 and
bfloat16->float32 (subnormals, so fp8 from bfloat16 rows too) differently from the GPU, so
``unsupported`` refuses those cases there; the fp8 path's indexing and scale selection is still
checked on bfloat16 inputs whose quotients are exact fp8 values (where rounding cannot differ).
fp8 rounding on the GPU (the float8 conversion) is checked by the gpu-marked sweep.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import kvwrite
from kvwrite.dtypes import FP8_MAX, CacheDType, quantize
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.ops.reshape_and_cache_flash import triton_impl, validate
from kvwrite.testing import (
    Case,
    Inputs,
    assert_caches_equal,
    clone_caches,
    make_inputs,
    special_values,
)

# conftest.py sets TRITON_INTERPRET=1 where there is no GPU, before triton is imported.
HAS_CUDA = torch.cuda.is_available()

needs_triton = pytest.mark.skipif(triton_impl.triton is None, reason="triton is not installed")
_cpu_reason = None if HAS_CUDA else triton_impl.available(torch.device("cpu"))
interpreter = pytest.mark.skipif(
    HAS_CUDA or _cpu_reason is not None,
    reason="interpreter tests run where there is no GPU" if HAS_CUDA else str(_cpu_reason),
)
gpu = pytest.mark.gpu  # conftest.py skips these where there is no GPU

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _fill_random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bits over the whole allocation behind `t`."""
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _check(case: Case, device: str, tuning=None) -> None:
    """Run `case` through the public op with implementation="triton" (or, with ``tuning``, the
    implementation directly with that tuning); compare every cache byte."""
    inp = make_inputs(case, device)
    ref_k, ref_v = clone_caches(inp)
    kvwrite.reshape_and_cache_flash(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping,
                                    case.kv_cache_dtype, inp.k_scale, inp.v_scale,
                                    implementation="torch")
    if tuning is None:
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="triton")
    else:
        cd = validate(*inp.args())
        scales = (inp.k_scale, inp.v_scale) if cd.is_fp8 else (None, None)
        triton_impl.run(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping, cd,
                        *scales, tuning=tuning)
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    assert_caches_equal(inp.key_cache, ref_k, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(inp.value_cache, ref_v, "value_cache", fp8, nan_equal=True)


# Shapes that stress what is specific to this kernel: head sizes that are not powers of two
# (masked BLOCK_D), H split into several head chunks with a partial last one (130 heads), several
# tokens per program (small H*D), HND and packed strides, int32 slots, padding, out-of-range slots,
# key/value slices of a fused qkv tensor with rows past T. Cache dtypes are ones the interpreter
# rounds exactly (fp8 runs there in test_matrix.py's cases).
CASES = [
    Case(num_tokens=11, num_heads=5, head_size=46, layout=Layout.HND, alloc=KVAlloc.PACKED,
         padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32, fused_qkv=True,
         extra_rows=4),
    Case(num_tokens=23, num_heads=13, head_size=80, dtype=torch.float32, kv_cache_dtype="float16",
         alloc=KVAlloc.INTERLEAVED, padding_slots=4, out_of_range_slots=1, fused_qkv=True),
    Case(num_tokens=6, num_heads=130, head_size=96, dtype=torch.float16, kv_cache_dtype="float32",
         layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=1, out_of_range_slots=1),
    Case(num_tokens=33, num_heads=2, head_size=192, block_size=32, num_blocks=4,
         dtype=torch.float32, padding_slots=2, out_of_range_slots=5, slot_dtype=torch.int32,
         layout=Layout.HND),
    Case(num_tokens=129, num_heads=1, head_size=1, num_blocks=16, kv_cache_dtype="float16",
         padding_slots=7, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED),
    Case(num_tokens=40, num_heads=3, head_size=120, dtype=torch.bfloat16, kv_cache_dtype="float16",
         alloc=KVAlloc.PACKED, out_of_range_slots=3, slot_dtype=torch.int32),
]
# The same shapes with fp8 and the casts the interpreter cannot check (bfloat16), for the GPU.
GPU_CASES = CASES + [
    Case(num_tokens=11, num_heads=5, head_size=46, layout=Layout.HND, alloc=KVAlloc.PACKED,
         kv_cache_dtype="fp8_e5m2", per_head_scale=True, padding_slots=3, out_of_range_slots=2,
         slot_dtype=torch.int32, fused_qkv=True, extra_rows=4, special_values=True),
    Case(num_tokens=6, num_heads=130, head_size=96, dtype=torch.float16, kv_cache_dtype="fp8",
         layout=Layout.HND, alloc=KVAlloc.PACKED, per_head_scale=True, fp8_storage="float8",
         padding_slots=1, out_of_range_slots=1),
    Case(num_tokens=23, num_heads=13, head_size=80, dtype=torch.float32, kv_cache_dtype="bfloat16",
         alloc=KVAlloc.INTERLEAVED, padding_slots=4, fused_qkv=True),
]


@needs_triton
@interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_interpreter_matches_reference(case):
    _check(case, "cpu")


@needs_triton
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
@gpu
def test_gpu_matches_reference(case):
    _check(case, "cuda")


# Every call planned as a large one: data loads without the evict-first hint.
NO_LOAD_HINT = dataclasses.replace(triton_impl.TUNING, evict_first_max_bytes=-1)


@needs_triton
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
@gpu
def test_gpu_matches_reference_without_load_hint(case):
    assert triton_impl._tiling(1, 1, 1, 2, False, NO_LOAD_HINT)[5] == ""
    _check(case, "cuda", NO_LOAD_HINT)


@needs_triton
def test_load_hint_by_call_size():
    # Inputs (K and V) of at most _EVICT_FIRST_MAX_BYTES: evict-first loads; larger: no hint.
    limit = triton_impl.TUNING.evict_first_max_bytes
    tokens = limit // (2 * 128 * 128 * 2)  # H=128, D=128, bfloat16: the largest "small" call
    assert triton_impl._tiling(tokens, 128, 128, 2, True)[5] == "evict_first"
    assert triton_impl._tiling(tokens + 1, 128, 128, 2, True)[5] == ""
    assert triton_impl._tiling(2, 8, 128, 2, False)[5] == "evict_first"
    assert triton_impl._tiling(32768, 8, 128, 2, False)[5] == ""


@needs_triton
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interpreter),
    pytest.param("cuda", marks=gpu),
])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=lambda c: c.id)
def test_key_and_value_token_strides_differ(case, device):
    """key from a fused qkv tensor, value from a tensor with another token stride."""
    inp = make_inputs(case, device)
    rows, num_heads, head_size = inp.value.shape
    wide = torch.full((rows, num_heads + 3, head_size), float("nan"), dtype=inp.value.dtype,
                      device=device)
    inp.value = wide[:, 2:2 + num_heads]
    inp.value.copy_(make_inputs(dataclasses.replace(case, fused_qkv=False), device, seed=1).value)
    assert inp.key.stride(0) != inp.value.stride(0)
    ref_k, ref_v = clone_caches(inp)
    torch_ref.run(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping, case.cache_dtype, None, None)
    kvwrite.reshape_and_cache_flash(*inp.args(), implementation="triton")
    assert_caches_equal(inp.key_cache, ref_k, "key_cache")
    assert_caches_equal(inp.value_cache, ref_v, "value_cache")


# --- Which casts the interpreter can check --------------------------------------------------

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2")
# (input dtype, kv_cache_dtype) pairs refused under the interpreter; every other one runs there.
INTERPRETER_INEXACT = {(torch.float16, "bfloat16"), (torch.float32, "bfloat16"),
                       (torch.bfloat16, "float32")}
INTERPRETER_INEXACT |= {(torch.bfloat16, kv) for kv in FP8}


@needs_triton
@interpreter
@pytest.mark.parametrize("dtype,kv", list(itertools.product(INPUT_DTYPES, KV_DTYPES)),
                         ids=lambda x: str(x).replace("torch.", ""))
def test_interpreter_refuses_inexact_casts(dtype, kv):
    case = Case(num_tokens=3, num_heads=2, head_size=16, dtype=dtype, kv_cache_dtype=kv)
    inp = make_inputs(case, "cpu")
    reason = triton_impl.unsupported(inp.key, inp.key_cache, case.cache_dtype, inp.k_scale,
                                     inp.v_scale)
    if (dtype, kv) not in INTERPRETER_INEXACT:
        assert reason is None
        return
    assert reason is not None and "TRITON_INTERPRET=1" in reason and "CUDA" in reason
    src = str(dtype).removeprefix("torch.")
    dst = str(case.cache_dtype.element_dtype(dtype)).removeprefix("torch.")
    assert f"{src}->{dst}" in reason
    with pytest.raises(ValueError, match="cannot run this call") as err:
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="triton")
    assert reason in str(err.value)


def _all_bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 2:
        return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    gen = torch.Generator().manual_seed(1)
    rand = torch.randint(-(2**31), 2**31, (1 << 18,), generator=gen).to(torch.int32)
    # float32 -> float16 rounding ties for normal results (the 13 dropped mantissa bits exactly
    # half an ulp), then ties and edges at the subnormal and overflow ends.
    ties = ((torch.randint(0, 2**19, (1 << 14,), generator=gen) << 13) | 0x1000).to(torch.int32)
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26,
                          float("inf"), float("nan"), 0.0, -0.0])
    return torch.cat([rand.view(torch.float32), ties.view(torch.float32),
                      -ties.view(torch.float32), edges])


@needs_triton
@interpreter
@pytest.mark.parametrize("dtype,kv", [(torch.float16, "float32"), (torch.bfloat16, "float16"),
                                      (torch.float32, "float16")],
                         ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy casting inf
def test_interpreter_casts_it_allows_are_exact(dtype, kv):
    """The casts run under the interpreter are exact there on every 16-bit input (NaN payloads
    aside) and on random float32 bit patterns with every kind of rounding tie."""
    cdt = CacheDType(kv)
    x = _all_bit_patterns(dtype)
    d = 256
    x = torch.cat([x, torch.zeros(-x.numel() % d, dtype=dtype)]).view(-1, 1, d)
    cache = torch.empty(x.shape[0], 1, 1, d, dtype=cdt.element_dtype(dtype))
    expected = quantize(x, cdt, None, cache.dtype).view(cache.shape)
    triton_impl.run(x, x, cache, torch.empty_like(cache), torch.arange(x.shape[0]), cdt, None,
                    None)
    assert_caches_equal(cache, expected, "cache", nan_equal=True)


@needs_triton
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interpreter),
    pytest.param("cuda", marks=gpu),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("storage", ["uint8", "float8"])
@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("per_head", [False, True], ids=["pertensor", "perhead"])
def test_fp8_path_on_exact_quotients(kv, per_head, storage, dtype, device):
    """fp8 indexing, scale selection, e4m3/e5m2 choice and storage on every finite fp8 value,
    ±0, ±inf and overflow, scaled by powers of two: quotients are exact fp8 values or saturate,
    so rounding cannot differ and the interpreter checks them bit for bit too."""
    fp8 = FP8[kv]
    cdt = CacheDType(kv)
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    vals = vals[~vals.isnan()]
    extra = [float("inf"), -float("inf"), 2.0**100, -(2.0**90), 0.0, -0.0]  # exact in bfloat16
    vals = torch.cat([vals, torch.tensor(extra)])
    num_heads, head_size = 4, 64
    scales = torch.tensor([2.0**-7, 4.0, 1.0, 0.5])
    k_scale = scales if per_head else scales[1:2]
    v_scale = scales.flip(0) if per_head else scales[3:4]
    rows = -(-vals.numel() // head_size)
    vals = torch.cat([vals, vals[: rows * head_size - vals.numel()]]).view(rows, head_size)
    # Token t, head h holds row (t + h) % rows times head h's scale (or the one scale).
    t = torch.arange(rows)
    h = torch.arange(num_heads)
    base = vals[(t[:, None] + h[None, :]) % rows]  # [T, H, D]
    key = (base * k_scale.view(1, -1, 1)).to(dtype)
    value = (base.flip(2) * v_scale.view(1, -1, 1)).to(dtype)
    assert torch.equal(key.float() / k_scale.view(1, -1, 1), base)  # exact quotients

    num_blocks, block_size = 8, 16
    kc, vc = allocate_kv_cache(num_blocks, block_size, num_heads, head_size,
                               torch.uint8 if storage == "uint8" else fp8, Layout.HND,
                               KVAlloc.PACKED, device)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[1], slots[2] = -1, num_blocks * block_size + 5  # padding, out of range
    inp = Inputs(key.to(device), value.to(device), kc, vc, slots.to(device), kv,
                 k_scale.to(device), v_scale.to(device))
    _fill_random_bytes(kc, gen)  # the whole packed allocation, V half included
    ref_k, ref_v = clone_caches(inp)
    torch_ref.run(inp.key, inp.value, ref_k, ref_v, inp.slot_mapping, cdt, inp.k_scale,
                  inp.v_scale)
    # Called directly: the public op refuses bfloat16 rows into fp8 under the interpreter.
    triton_impl.run(inp.key, inp.value, kc, vc, inp.slot_mapping, cdt, inp.k_scale, inp.v_scale)
    assert_caches_equal(kc, ref_k, "key_cache", fp8)
    assert_caches_equal(vc, ref_v, "value_cache", fp8)


@needs_triton
def test_available_reasons(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "TRITON_INTERPRET=1" in triton_impl.available(torch.device("cpu"))
    monkeypatch.setattr(triton_impl, "triton", None)
    assert "pip install triton" in triton_impl.available(torch.device("cpu"))
    assert "pip install triton" in triton_impl.available(torch.device("cuda"))


# --- fp8 rounding on the GPU ----------------------------------------------------------------


def _fp8_grid(fp8: torch.dtype) -> torch.Tensor:
    """Every non-negative finite fp8 value, ascending, as float64."""
    v = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(fp8).double()
    return v[v.isfinite()].sort().values


def _sweep_values(fp8: torch.dtype, scale: float, n: int, gen: torch.Generator) -> torch.Tensor:
    """n float32 inputs for one scale: quotients at and around every rounding tie, neighbours of
    every exact fp8 value, special values, then random magnitudes and bit patterns."""
    grid = _fp8_grid(fp8)
    mx = FP8_MAX[fp8]
    ulp_top = float(grid[-1] - grid[-2])
    mids = torch.cat([(grid[1:] + grid[:-1]) / 2, torch.tensor([mx + ulp_top / 2])])
    centres = torch.cat([mids, grid])
    centres = torch.cat([centres, -centres])
    x0 = (centres * scale).float()
    near = [x0]
    up, down = x0, x0
    for _ in range(3):  # a few float32 ulps either side: quotients just off the tie
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, -float("inf")))
        near += [up, down]
    specials = torch.tensor(special_values(CacheDType("fp8_e4m3" if fp8 == torch.float8_e4m3fn
                                                      else "fp8_e5m2")), dtype=torch.float32)
    specials = torch.cat([specials, specials * scale,
                          torch.tensor([1e-45, -1e-45, 1e-40, -1.2e-38, 3.4028235e38, -3.4028235e38,
                                        mx * scale * 1.0000001, -(mx + ulp_top / 2) * scale])])
    fixed = torch.cat(near + [specials])
    m = n - fixed.numel()
    n_bits = m // 8
    mag = torch.exp2(torch.randint(-40, 24, (m - n_bits,), generator=gen).double())
    rnd = (torch.rand(m - n_bits, generator=gen, dtype=torch.float64) + 1) * mag
    rnd = torch.where(torch.rand(m - n_bits, generator=gen) < 0.5, -rnd, rnd).float()
    bits = torch.randint(-(2**31), 2**31, (n_bits,), generator=gen).to(torch.int32)
    return torch.cat([fixed, rnd, bits.view(torch.float32)])


@needs_triton
@pytest.mark.parametrize("per_head", [False, True], ids=["pertensor", "perhead"])
@pytest.mark.parametrize("kv", list(FP8))
@gpu
def test_fp8_dense_sweep_gpu(kv, per_head):
    """~1M float32 values per cache, bit-exact against the reference (NaN sign/payload aside):
    ties, values where x * (1/s) and x / s round apart, special values, random inputs."""
    fp8, cdt = FP8[kv], CacheDType(kv)
    num_heads, head_size, num_tokens, block_size = 8, 128, 1024, 16
    gen = torch.Generator().manual_seed(7)
    n_scales = num_heads if per_head else 1
    k_scale = (torch.rand(n_scales, generator=gen) * 2.9 + 0.1)  # not powers of two
    v_scale = (torch.rand(n_scales, generator=gen) * 0.09 + 0.003)
    per = num_tokens * head_size

    def inputs(scale: torch.Tensor) -> torch.Tensor:
        heads = [_sweep_values(fp8, float(scale[h % n_scales]), per, gen)
                 for h in range(num_heads)]
        return torch.stack([h.view(num_tokens, head_size) for h in heads], dim=1)

    key, value = inputs(k_scale), inputs(v_scale)
    num_blocks = num_tokens // block_size
    slots = torch.randperm(num_tokens, generator=gen)
    kc = torch.randint(0, 256, (num_blocks, block_size, num_heads, head_size), dtype=torch.uint8,
                       generator=gen)
    vc = torch.randint(0, 256, kc.shape, dtype=torch.uint8, generator=gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    torch_ref.run(key, value, ref_k, ref_v, slots, cdt, k_scale, v_scale)

    # The sweep must tell a true division from a reciprocal multiply, and hit exact ties.
    s = k_scale.view(1, -1, 1)
    approx = quantize(key * (1 / s), cdt, torch.ones(1), torch.uint8)
    assert (approx != quantize(key, cdt, k_scale, torch.uint8)).sum() > 0
    q = (key / s).double()
    grid = _fp8_grid(fp8)
    mids = (grid[1:] + grid[:-1]) / 2
    assert torch.isin(q.abs().flatten(), mids).sum() > 0

    dev = [t.cuda() for t in (key, value, kc, vc, slots, k_scale, v_scale)]
    kvwrite.reshape_and_cache_flash(*dev[:5], kv, *dev[5:], implementation="triton")
    assert_caches_equal(dev[2].cpu(), ref_k, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(dev[3].cpu(), ref_v, "value_cache", fp8, nan_equal=True)


@needs_triton
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv", list(FP8))
@gpu
def test_fp8_every_16bit_input_gpu(kv, in_dtype):
    """Every bfloat16/float16 bit pattern through per-head scales that are not powers of two."""
    fp8, cdt = FP8[kv], CacheDType(kv)
    num_heads, head_size, block_size = 8, 128, 16
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(in_dtype)
    num_tokens = x.numel() // head_size
    key = x.view(num_tokens, 1, head_size).expand(num_tokens, num_heads, head_size).contiguous()
    value = key.flip(0)
    gen = torch.Generator().manual_seed(3)
    k_scale = torch.rand(num_heads, generator=gen) * 5 + 0.01
    v_scale = torch.rand(num_heads, generator=gen) * 0.5 + 0.001
    slots = torch.randperm(num_tokens, generator=gen)
    shape = (num_tokens // block_size, block_size, num_heads, head_size)
    kc, vc = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    ref_k, ref_v = kc.clone(), vc.clone()
    torch_ref.run(key, value, ref_k, ref_v, slots, cdt, k_scale, v_scale)
    dev = [t.cuda() for t in (key, value, kc, vc, slots, k_scale, v_scale)]
    kvwrite.reshape_and_cache_flash(*dev[:5], kv, *dev[5:], implementation="triton")
    assert_caches_equal(dev[2].cpu(), ref_k, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(dev[3].cpu(), ref_v, "value_cache", fp8, nan_equal=True)
