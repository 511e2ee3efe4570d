"""rotary_embedding and fused_rope_and_reshape_cache_flash (docs/ops/rotary_embedding.md): every
registered implementation over the case matrices, byte-exact against an independent oracle (NumPy
float32, one token and head at a time, pairs picked by explicit index lists), every byte of every
tensor the call touches compared; validation specifics; NVRTC builds and machine code. Wrong
writers, bad input, CUDA graphs and torch.compile: tests/test_conformance.py
(kvwrite.testing.providers.rotary_embedding, .fused_rope_and_reshape_cache_flash)."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import torch

import kvwrite
import sass as sass_tools
from host import TRITON_PTX_PRELUDE, run_triton_script
from kvwrite import registry
from kvwrite.dtypes import CacheDType
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops import fused_rope_and_reshape_cache_flash as fused_pkg
from kvwrite.ops import rotary_embedding as rope_pkg
from kvwrite.testing import assert_caches_equal
from kvwrite.testing.rope import (
    FUSED_CASES,
    PADDED_FUSED_CASES,
    PADDED_ROPE_CASES,
    ROPE_CASES,
    RopeCase,
    RopeInputs,
    make_rope_inputs,
)
from oracle import oracle_valid_tokens
from params import DEVICES

ROPE = rope_pkg.OP
FUSED = fused_pkg.OP


# --- the oracle ----------------------------------------------------------------------------------

def _round_to(vals: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 values rounded to nearest even in ``dtype`` (bfloat16 by integer arithmetic)."""
    vals = np.ascontiguousarray(vals, dtype=np.float32)
    if dtype == torch.float32:
        return torch.from_numpy(vals.copy())
    if dtype == torch.float16:
        return torch.from_numpy(vals.astype(np.float16))
    b = vals.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    r = np.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)  # NaN stays NaN
    return torch.from_numpy(r.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def _pairs(rot: int, neox: bool) -> tuple[list[int], list[int]]:
    half = rot // 2
    if neox:
        return list(range(half)), [i + half for i in range(half)]
    return [2 * i for i in range(half)], [2 * i + 1 for i in range(half)]


def oracle_row(row: torch.Tensor, cs: np.ndarray, rot: int, neox: bool) -> torch.Tensor:
    """One head's row rotated by one table row ``cs`` (float32 cos then sin)."""
    x = row.float().numpy().astype(np.float32)
    out = x.copy()
    xs, ys = _pairs(rot, neox)
    c, s = cs[: rot // 2], cs[rot // 2: rot]
    a, b = x[xs], x[ys]
    with np.errstate(all="ignore"):
        out[xs] = np.subtract(np.multiply(a, c, dtype=np.float32), np.multiply(b, s, dtype=np.float32),
                              dtype=np.float32)
        out[ys] = np.add(np.multiply(b, c, dtype=np.float32), np.multiply(a, s, dtype=np.float32),
                         dtype=np.float32)
    res = _round_to(out, row.dtype)
    res[rot:] = row[rot:]
    return res


def oracle_rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool,
                  dest: torch.Tensor) -> list[bool]:
    """Writes rotated rows of the CPU ``[T_pad, H, D]`` tensor ``x`` into ``dest`` (valid tokens
    only); returns each token's validity."""
    table = cos_sin.float().numpy().astype(np.float32)
    rot = cos_sin.shape[1]
    valid = []
    for t in range(positions.numel()):
        p = int(positions[t])
        ok = 0 <= p < cos_sin.shape[0]
        valid.append(ok)
        if not ok:
            continue
        for h in range(x.shape[1]):
            dest[t, h] = oracle_row(x[t, h], table[p], rot, neox)
    return valid


def _heads(t, d):
    return None if t is None else (t if t.dim() == 3 else t.unflatten(1, (-1, d)))


def expected_rotary(case: RopeCase) -> RopeInputs:
    inp = make_rope_inputs(case)
    d = case.head_size
    for t in (inp.query, inp.key):
        if t is not None:
            v = _heads(t, d)
            oracle_rotate(v.clone(), inp.positions, inp.cos_sin_cache, case.is_neox, v)
    return inp


def expected_fused(case: RopeCase) -> RopeInputs:
    inp = make_rope_inputs(case)
    d = case.head_size
    q, k, v = _heads(inp.query, d), _heads(inp.key, d), _heads(inp.value, d)
    qdest = q if inp.query_out is None else _heads(inp.query_out, d)
    oracle_rotate(q.clone(), inp.positions, inp.cos_sin_cache, case.is_neox, qdest)
    rk = k.clone()
    valid = oracle_rotate(k.clone(), inp.positions, inp.cos_sin_cache, case.is_neox, rk)
    if case.rotate_key_in_place:
        k.copy_(rk)
    oracle_valid_tokens(rk, v, inp, valid, case.cache_dtype)
    return inp


_expected_rotary = functools.cache(expected_rotary)
_expected_fused = functools.cache(expected_fused)


def assert_same_bytes(got: RopeInputs, want: RopeInputs) -> None:
    """Every tensor of the call, whole allocations, byte for byte."""
    gt, wt = got.tensors(), want.tensors()
    assert gt.keys() == wt.keys()
    for name in gt:
        assert_caches_equal(gt[name], wt[name], name)


# --- every implementation against the oracle -----------------------------------------------------

def _impl_inputs(op: str, impl: str, case: RopeCase, device: str) -> RopeInputs:
    info = registry.get(op, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_rope_inputs(case, device)
    d = case.head_size
    q, k = _heads(inp.query, d), _heads(inp.key, d)
    if op == ROPE:
        reason = info.unsupported(q, k, inp.cos_sin_cache, case.is_neox)
    else:
        reason = info.unsupported(q, k, inp.key_cache, case.cache_dtype, inp.cos_sin_cache,
                                  case.is_neox)
    if reason is not None:
        pytest.skip(reason)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(ROPE)])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.id)
def test_rotary_matches_oracle(impl, case, device):
    inp = _impl_inputs(ROPE, impl, case, device)
    kvwrite.rotary_embedding(*inp.rotary_args(), implementation=impl)
    assert_same_bytes(inp, _expected_rotary(case))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED)])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_matches_oracle(impl, case, device):
    inp = _impl_inputs(FUSED, impl, case, device)
    kvwrite.fused_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                               implementation=impl)
    assert_same_bytes(inp, _expected_fused(case))


# --- padded heads: the bytes of dense heads ------------------------------------------------------

def _dense(case: RopeCase) -> RopeCase:
    return dataclasses.replace(case, head_pad=(0, 0, 0, 0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(ROPE)])
@pytest.mark.parametrize("case", PADDED_ROPE_CASES, ids=lambda c: c.id)
def test_rotary_padded_heads_write_the_bytes_of_dense_heads(impl, case, device):
    """Query and key as ``[..., :D]`` slices of wider rows (each its own head stride): the
    implementation writes into them the bytes it writes into the same data with dense heads, and
    no other byte of their allocations changes (the padding included)."""
    inp = _impl_inputs(ROPE, impl, case, device)
    dense = _impl_inputs(ROPE, impl, _dense(case), device)
    kvwrite.rotary_embedding(*inp.rotary_args(), implementation=impl)
    kvwrite.rotary_embedding(*dense.rotary_args(), implementation=impl)
    want = make_rope_inputs(case, device)
    for name in ("query", "key"):
        if getattr(want, name) is not None:
            getattr(want, name).copy_(getattr(dense, name))
    assert_same_bytes(inp, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED)])
@pytest.mark.parametrize("case", PADDED_FUSED_CASES, ids=lambda c: c.id)
def test_fused_padded_heads_write_the_bytes_of_dense_heads(impl, case, device):
    """As for rotary_embedding: query (or query_out), key and both caches hold the bytes of the
    dense call; value, and the padding of every row tensor, keep theirs."""
    inp = _impl_inputs(FUSED, impl, case, device)
    dense = _impl_inputs(FUSED, impl, _dense(case), device)
    for i in (inp, dense):
        kvwrite.fused_rope_and_reshape_cache_flash(*i.fused_args(), **i.fused_kwargs(),
                                                   implementation=impl)
    want = make_rope_inputs(case, device)
    for name in ("query", "key", "query_out", "key_cache", "value_cache"):
        if getattr(want, name) is not None:
            getattr(want, name).copy_(getattr(dense, name))
    assert_same_bytes(inp, want)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_padded_cases_pad_every_tensor_as_asked():
    """The case model's padded heads: each tensor's head stride is D + its own padding, the
    views hold the dense case's values, and the padding is not all zeros (a stray write of
    zeros would show)."""
    for case in PADDED_ROPE_CASES + PADDED_FUSED_CASES:
        inp, dense = make_rope_inputs(case), make_rope_inputs(_dense(case))
        for name, pad in zip(("query", "key", "value", "query_out"), case.head_pad, strict=True):
            t, d = getattr(inp, name), getattr(dense, name)
            if t is None:
                continue
            assert t.stride(1) == case.head_size + pad and t.stride(2) == 1, (case.id, name)
            assert torch.equal(_bits(t), _bits(d)), (case.id, name)
            if pad:
                padding = t.as_strided((t.shape[0], t.shape[1], pad), t.stride(),
                                       t.storage_offset() + case.head_size)
                assert _bits(padding).any(), (case.id, name)
    assert {p for c in PADDED_ROPE_CASES + PADDED_FUSED_CASES for p in c.head_pad} >= {1, 64}
    assert any(c.head_size == 80 and c.head_pad[0] == 64 for c in PADDED_ROPE_CASES)
    assert any(len(set(c.head_pad)) == 4 for c in PADDED_FUSED_CASES)
    assert any(c.fused_qkv for c in PADDED_ROPE_CASES) and any(c.fused_qkv
                                                               for c in PADDED_FUSED_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("cta_threads", [64, 32])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_cuda_fused_large_call_build_matches_oracle(case, cta_threads):
    """The build that large calls take (register bound, value first, narrow CTAs), forced for
    every call here, writes the oracle's bytes too; 32-thread CTAs split every case's tokens
    that they tile or that take more than one CTA of launch_shape's (cta_shape)."""
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import cuda_impl
    from kvwrite.ops.fused_rope_and_reshape_cache_flash.op import validate
    inp = _impl_inputs(FUSED, "cuda", case, "cuda")
    q, k, v, query_out, cache_dtype = validate(*inp.fused_args(), **inp.fused_kwargs())
    scales = (inp.k_scale, inp.v_scale) if cache_dtype.is_fp8 else (None, None)
    if inp.positions.numel():
        cuda_impl.run(q, k, v, inp.positions, inp.cos_sin_cache, case.is_neox, inp.key_cache,
                      inp.value_cache, inp.slot_mapping, cache_dtype, *scales,
                      case.rotate_key_in_place, query_out,
                      tuning=cuda_impl.CudaTuning(large_call_bytes=0,
                                                  large_call_cta_threads=cta_threads))
    assert_same_bytes(inp, _expected_fused(case))


# Rows long enough for several CTAs per token (GQA(32,8,128): 2 of 160 threads; MHA: 4 of 128).
LONG_ROW_CASES = [
    RopeCase(num_q_heads=32, num_heads=8, head_size=128),
    RopeCase(num_q_heads=32, num_heads=32, head_size=128, bad_positions=2),
    RopeCase(num_q_heads=32, num_heads=8, head_size=128, dtype=torch.float16, is_neox=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROPE_CASES + LONG_ROW_CASES, ids=lambda c: c.id)
def test_cuda_rotary_large_call_grid_matches_oracle(case):
    """The 1-D grid that large calls take (CudaTuning.linear_grid_bytes), forced for every call
    here (cases of several tokens per CTA keep their grid), writes the oracle's bytes too."""
    from kvwrite.ops.rotary_embedding import cuda_impl
    from kvwrite.ops.rotary_embedding.op import validate
    inp = _impl_inputs(ROPE, "cuda", case, "cuda")
    q, k = validate(*inp.rotary_args())
    if inp.positions.numel():
        cuda_impl.run(inp.positions, q, k, inp.cos_sin_cache, case.is_neox,
                      tuning=cuda_impl.CudaTuning(linear_grid_bytes=0))
    assert_same_bytes(inp, _expected_rotary(case))


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["small", "mid", "large", "mid-specialized"])
@pytest.mark.parametrize("op,case",
                         [(ROPE, c) for c in ROPE_CASES] + [(FUSED, c) for c in FUSED_CASES],
                         ids=[f"rotary-{c.id}" for c in ROPE_CASES] +
                             [f"fused-{c.id}" for c in FUSED_CASES])
def test_cuda_generic_builds_match_oracle(monkeypatch, record_builds, op, case, build):
    """KVWRITE_CUDA_SPECIALIZE=0 (CudaTuning.specialize=False): the same kernels with their fixed
    arguments read at run time write the oracle's bytes too, in the builds of small calls
    (narrower units), mid-sized calls and large calls, each forced on every case; and the
    specialized build of mid-sized calls (the matrix's own calls are small)."""
    huge = 1 << 60
    small = huge if build == "small" else 0
    specialize = build == "mid-specialized"
    rotary = op == ROPE
    if rotary:
        from kvwrite.ops.rotary_embedding import cuda_impl
        from kvwrite.ops.rotary_embedding.op import validate
        tuning = cuda_impl.CudaTuning(specialize=specialize, small_call_bytes=small,
                                      linear_grid_bytes=0 if build == "large" else huge)
    else:
        from kvwrite.ops.fused_rope_and_reshape_cache_flash import cuda_impl
        from kvwrite.ops.fused_rope_and_reshape_cache_flash.op import validate
        tuning = cuda_impl.CudaTuning(specialize=specialize, small_call_bytes=small,
                                      small_call_bytes_fp8=small,
                                      large_call_bytes=0 if build == "large" else huge)
    seen = record_builds(cuda_impl.SOURCE)
    monkeypatch.setattr(cuda_impl, "LAUNCHES", {})
    inp = _impl_inputs(ROPE if rotary else FUSED, "cuda", case, "cuda")
    if rotary:
        q, k = validate(*inp.rotary_args())
        if inp.positions.numel():
            cuda_impl.run(inp.positions, q, k, inp.cos_sin_cache, case.is_neox, tuning=tuning)
        assert_same_bytes(inp, _expected_rotary(case))
    else:
        q, k, v, query_out, cache_dtype = validate(*inp.fused_args(), **inp.fused_kwargs())
        scales = (inp.k_scale, inp.v_scale) if cache_dtype.is_fp8 else (None, None)
        if inp.positions.numel():
            cuda_impl.run(q, k, v, inp.positions, inp.cos_sin_cache, case.is_neox, inp.key_cache,
                          inp.value_cache, inp.slot_mapping, cache_dtype, *scales,
                          case.rotate_key_in_place, query_out, tuning=tuning)
        assert_same_bytes(inp, _expected_fused(case))
    assert all((f is not None) == specialize for f in seen), seen


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["rotary", "fused"])
def test_cuda_specialized_build_is_the_default(monkeypatch, record_builds, which):
    """A call with the default tuning builds its kernel (and the PDL twin) with the call's fixed
    arguments compiled in, the ones it launches with."""
    rotary = which == "rotary"
    if rotary:
        from kvwrite.ops.rotary_embedding import cuda_impl
    else:
        from kvwrite.ops.fused_rope_and_reshape_cache_flash import cuda_impl
    seen = record_builds(cuda_impl.SOURCE)
    monkeypatch.setattr(cuda_impl, "LAUNCHES", {})
    case = RopeCase(num_q_heads=32, num_heads=8, head_size=128, kv_cache_dtype="fp8")
    inp = _impl_inputs(ROPE if rotary else FUSED, "cuda", case, "cuda")
    if rotary:
        kvwrite.rotary_embedding(*inp.rotary_args(), implementation="cuda")
        assert_same_bytes(inp, _expected_rotary(case))
    else:
        kvwrite.fused_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                   implementation="cuda")
        assert_same_bytes(inp, _expected_fused(case))
    (lau,) = cuda_impl.LAUNCHES.values()
    assert seen == [lau.fixed] * (1 if lau.pdl_kernel is None else 2)


# Every call on the Triton kernels' large-call tiles (no small-grid tiles either).
TRITON_LARGE = dict(large_call_bytes=0, small_grid=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROPE_CASES + LONG_ROW_CASES, ids=lambda c: c.id)
def test_triton_rotary_large_call_tiles_match_oracle(case, device):
    from kvwrite.ops.rotary_embedding import triton_impl
    from kvwrite.ops.rotary_embedding.op import validate
    inp = _impl_inputs(ROPE, "triton", case, device)
    q, k = validate(*inp.rotary_args())
    if inp.positions.numel():
        triton_impl.run(inp.positions, q, k, inp.cos_sin_cache, case.is_neox,
                        tuning=triton_impl.RopeTuning(**TRITON_LARGE))
    assert_same_bytes(inp, _expected_rotary(case))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_triton_fused_large_call_tiles_match_oracle(case, device):
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import triton_impl
    from kvwrite.ops.fused_rope_and_reshape_cache_flash.op import validate
    from kvwrite.ops.rotary_embedding.triton_impl import RopeTuning
    inp = _impl_inputs(FUSED, "triton", case, device)
    q, k, v, query_out, cache_dtype = validate(*inp.fused_args(), **inp.fused_kwargs())
    scales = (inp.k_scale, inp.v_scale) if cache_dtype.is_fp8 else (None, None)
    if inp.positions.numel():
        triton_impl.run(q, k, v, inp.positions, inp.cos_sin_cache, case.is_neox, inp.key_cache,
                        inp.value_cache, inp.slot_mapping, cache_dtype, *scales,
                        case.rotate_key_in_place, query_out,
                        tuning=RopeTuning(**TRITON_LARGE, fused_value_first_max_programs=0,
                                          fused_value_first_max_programs_fp8=0))
    assert_same_bytes(inp, _expected_fused(case))


def test_triton_rope_tiling_for_large_calls():
    from kvwrite.ops.rotary_embedding.triton_impl import TUNING, tiling
    # GQA(32,8,128) bfloat16: 2 KiB tiles (8 heads) in one warp from 4 MiB of query and key rows.
    limit = TUNING.large_call_bytes // (40 * 128 * 2)
    assert tiling(limit - 1, 32, 8, 128, 2) == (1, 16, 128, 8, 2, 1)
    assert tiling(limit + 1, 32, 8, 128, 2) == (1, 8, 128, 1, 4, 1)
    assert tiling(1, 32, 8, 128, 2) == (1, 4, 128, 2, 8, 2)  # a small grid keeps its tiles


def test_long_row_cases_span_several_ctas():
    from kvwrite.ops.rotary_embedding.cuda_impl import launch_shape, units
    for case in LONG_ROW_CASES:
        w = 16 // case.dtype.itemsize
        per_head, _ = units(case.head_size, case.rot_dim or case.head_size, case.is_neox, w)
        assert launch_shape((case.num_q_heads + case.num_heads) * per_head)[2] >= 2


def test_cuda_unit_width_for_small_calls():
    """Small calls take units of at most CudaTuning.small_call_unit_bytes (8 bytes: 4 bfloat16
    elements, 2 float32), still the widest that every alignment allows."""
    rope_cuda, fused_cuda = _cuda_modules()
    for mod in (rope_cuda, fused_cuda):
        assert mod.TUNING.small_call_unit_bytes == 8
    ptrs, strides = ((4096, 2),), (6144,)
    assert rope_cuda.unit_width(128, 128, True, 2, 4, 4096, ptrs, strides) == 8
    assert rope_cuda.unit_width(128, 128, True, 2, 4, 4096, ptrs, strides, 8) == 4
    assert rope_cuda.unit_width(128, 128, True, 4, 4, 4096, ((4096, 4),), strides, 8) == 2
    assert rope_cuda.unit_width(128, 128, False, 2, 4, 4096, ptrs, strides, 8) == 4  # GPT-J
    # alignment still narrows further: a row stride of 2 elements
    assert rope_cuda.unit_width(128, 128, True, 2, 4, 4096, ptrs, (2,), 8) == 2


def test_cuda_unit_width_takes_every_head_stride():
    """Each tensor's head stride bounds the unit width as its pointer and token stride do:
    padding of 64 elements keeps 16-byte units, padding that breaks 16-byte alignment in any one
    tensor (value's alone included) narrows them, and the stride of a single head (or token)
    never counts; an odd head stride leaves GPT-J no unit (refused)."""
    rope_cuda, fused_cuda = _cuda_modules()

    def widths(case):
        inp = make_rope_inputs(case)
        cs = inp.cos_sin_cache
        q, k = rope_pkg.op.validate(inp.positions, inp.query, inp.key, case.head_size, cs,
                                    case.is_neox)
        q, k, v, qo, _ = fused_pkg.op.validate(*inp.fused_args(), **inp.fused_kwargs())
        return (rope_cuda._width(q, k, cs, case.is_neox),
                fused_cuda._width(q, k, v, inp.key_cache, inp.value_cache, qo, cs, case.is_neox))

    base = RopeCase(num_tokens=3, num_q_heads=4, num_heads=2, head_size=80, dtype=torch.float16)
    assert widths(base) == (8, 8)
    assert widths(dataclasses.replace(base, head_pad=(64, 64, 64, 0))) == (8, 8)
    assert widths(dataclasses.replace(base, head_pad=(0, 0, 4, 0))) == (8, 4)  # value's only
    assert widths(dataclasses.replace(base, head_pad=(2, 0, 0, 0))) == (2, 2)
    assert widths(dataclasses.replace(base, head_pad=(0, 1, 0, 0))) == (1, 1)
    assert widths(dataclasses.replace(base, head_pad=(0, 0, 0, 6), query_out=True)) == (8, 2)
    one = dataclasses.replace(base, num_tokens=1, num_q_heads=1, num_heads=1,
                              head_pad=(3, 5, 7, 0))  # no stride moves: one token, one head
    assert widths(one) == (8, 8)
    assert widths(dataclasses.replace(one, num_q_heads=2)) == (1, 1)
    gptj = dataclasses.replace(base, is_neox=False, head_pad=(1, 0, 0, 0))
    assert widths(gptj) == (0, 0)


def test_small_call_bounds_per_cache_format():
    """Where each RoPE kernel's small-call build ends (tuning-log change 50): bfloat16,
    GQA(32,8,128) and MHA(32,32,128) token counts either side of each bound."""
    from kvwrite.ops.fused_rope_and_reshape_cache_flash.triton_impl import takes_value_first
    rope_cuda, fused_cuda = _cuda_modules()
    fp8, auto = CacheDType.FP8_E4M3, CacheDType.AUTO

    def rotary_unit(T, heads):
        return rope_cuda.call_unit_bytes(T * heads * 128 * 2)

    def fused_unit(T, hq, h, cache_dtype):
        return fused_cuda.call_build(T * (hq + 2 * h) * 128 * 2, cache_dtype)[2]

    # rotary_embedding: 4-element units up to 3 MiB of query and key rows.
    assert rotary_unit(307, 40) == 8 and rotary_unit(308, 40) == 16
    assert rotary_unit(192, 64) == 8 and rotary_unit(193, 64) == 16
    # The fused op: copies up to 3 MiB of query, key and value rows, fp8 up to 1 MiB.
    assert fused_unit(256, 32, 8, auto) == 8 and fused_unit(257, 32, 8, auto) == 16
    assert fused_unit(128, 32, 32, auto) == 8 and fused_unit(129, 32, 32, auto) == 16
    assert fused_unit(85, 32, 8, fp8) == 8 and fused_unit(86, 32, 8, fp8) == 16
    assert fused_unit(85, 32, 8, CacheDType.FP8_E5M2) == 8
    assert fused_unit(86, 32, 8, CacheDType.FP8_E5M2) == 16
    assert fused_unit(42, 32, 32, fp8) == 8 and fused_unit(43, 32, 32, fp8) == 16
    # From 4 MiB the large-call build (value first, register bound, 64-thread CTAs).
    assert fused_cuda.call_build(4 << 20, auto) == (5, 64, 16)
    assert fused_cuda.call_build((4 << 20) - 1, auto) == (1, None, 16)
    # The Triton fused kernel stores the value first up to 16384 programs for copies (GQA
    # T=2048: 10240), up to 512 for fp8 (GQA T=128: 384; T=192: 576).
    assert takes_value_first(16384, False) and not takes_value_first(16385, False)
    assert takes_value_first(512, True) and not takes_value_first(513, True)


def test_cuda_launch_shapes():
    from kvwrite.ops.rotary_embedding.cuda_impl import launch_shape
    assert launch_shape(48) == (48, 2, 1)          # short rows: several tokens per CTA
    assert launch_shape(200) == (200, 1, 1)
    assert launch_shape(256) == (256, 1, 1)
    assert launch_shape(320) == (160, 1, 2)        # GQA(32,8,128) bfloat16 neox: near-even
    assert launch_shape(512) == (128, 1, 4)        # MHA(32,32,128): 128-thread tiles
    assert launch_shape(640) == (128, 1, 5)
    assert launch_shape(600) == (200, 1, 3)


def test_cuda_fused_cta_shapes():
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import cuda_impl
    # GQA(32,8,128) bfloat16 neox: 8 units per head, 320 per token.
    assert cuda_impl.cta_shape(320, None) == (160, 1, 2)       # small calls: launch_shape's
    assert cuda_impl.cta_shape(320, 64) == (64, 1, 5)          # large calls: 2-warp CTAs
    assert cuda_impl.cta_shape(512, 64) == (64, 1, 8)          # MHA(32,32,128)
    # GQA(32,8,64): 160 units, which 64-thread CTAs do not tile (their last would hold 32 busy
    # threads): launch_shape's one CTA; past 256 units the last CTA part-filled.
    assert cuda_impl.cta_shape(160, 64) == cuda_impl.cta_shape(160, None) == (160, 1, 1)
    assert cuda_impl.cta_shape(100, 64) == (100, 1, 1)
    assert cuda_impl.cta_shape(288, 64) == (64, 1, 5)
    assert cuda_impl.cta_shape(160, 32) == (32, 1, 5)
    assert cuda_impl.cta_shape(48, 64) == cuda_impl.cta_shape(48, None) == (48, 2, 1)
    for bad in (0, 16, 48, 288, 64.0):
        with pytest.raises(ValueError, match="large_call_cta_threads: expected a multiple of 32"):
            cuda_impl.CudaTuning(large_call_cta_threads=bad)


def test_matrices_cover_the_contract():
    both = ROPE_CASES + FUSED_CASES
    assert {c.dtype for c in both} == {torch.float16, torch.bfloat16, torch.float32}
    assert {c.cos_sin_dtype for c in both} == {torch.float16, torch.bfloat16, torch.float32}
    assert {c.is_neox for c in ROPE_CASES} == {c.is_neox for c in FUSED_CASES} == {True, False}
    assert any(c.rot < c.head_size for c in ROPE_CASES)
    assert any(c.rot < c.head_size and not c.is_neox for c in FUSED_CASES)
    assert {(c.layout, c.alloc) for c in FUSED_CASES} == {(lo, a) for lo in Layout for a in KVAlloc}
    assert {c.kv_cache_dtype for c in FUSED_CASES} >= {"auto", "float16", "float32", "fp8",
                                                       "fp8_e5m2"}
    for cases in (ROPE_CASES, FUSED_CASES):
        assert any(c.bad_positions for c in cases) and any(c.num_tokens == 0 for c in cases)
        assert any(c.pos_dtype == torch.int32 for c in cases)
        assert any(c.fused_qkv and c.flat for c in cases)
        assert any(c.num_q_heads != c.num_heads for c in cases)
        assert any(c.num_q_heads == c.num_heads for c in cases)
        assert any(c.extra_rows for c in cases)
    assert any(c.no_key for c in ROPE_CASES)
    assert any(c.per_head_scale for c in FUSED_CASES)
    assert any(c.padding_slots and c.out_of_range_slots and c.slot_dtype == torch.int32
               for c in FUSED_CASES)
    assert any(c.num_cache_tokens < c.num_tokens for c in FUSED_CASES)
    assert any(not c.rotate_key_in_place for c in FUSED_CASES)
    assert any(c.query_out for c in FUSED_CASES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED)])
@pytest.mark.parametrize("case", [
    RopeCase(num_tokens=9, dtype=torch.float32, kv_cache_dtype="fp8", per_head_scale=True),
    RopeCase(num_tokens=9, dtype=torch.bfloat16, cos_sin_dtype=torch.bfloat16, is_neox=False,
             rot_dim=32, layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=2),
], ids=lambda c: c.id)
def test_fused_equals_the_unfused_pair(impl, case, device):
    """With every position in the table, the fused op has the pair's effect, byte for byte."""
    inp = _impl_inputs(FUSED, impl, case, device)
    pair = make_rope_inputs(case, device)
    kvwrite.fused_rope_and_reshape_cache_flash(*inp.fused_args(), implementation=impl)
    kvwrite.rotary_embedding(*pair.rotary_args(), implementation="torch")
    kvwrite.reshape_and_cache_flash(_heads(pair.key, case.head_size),
                                    _heads(pair.value, case.head_size), pair.key_cache,
                                    pair.value_cache, pair.slot_mapping, pair.kv_cache_dtype,
                                    pair.k_scale, pair.v_scale, implementation="torch")
    assert_same_bytes(inp, pair)


def test_oracle_rounds_bfloat16_to_nearest_even():
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -0.0, 3e38],
                    dtype=np.float32)
    got = _round_to(vals, torch.bfloat16)
    want = torch.from_numpy(vals).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_check_positions():
    kvwrite.check_positions(torch.tensor([0, 5, 7]), 8)
    with pytest.raises(ValueError, match=r"2 out of range at indices \[1, 3\] with values \[-1, 8\]"):
        kvwrite.check_positions(torch.tensor([0, -1, 7, 8], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="positions: expected dtype int64 or int32"):
        kvwrite.check_positions(torch.tensor([0.0]), 8)


# --- Triton: the compiled rotation has no fused multiply-add (CPU: Triton compiles for sm_90) ----

_PTX_SCRIPT = TRITON_PTX_PRELUDE + r"""
import sys
from kvwrite.ops.rotary_embedding import triton_impl as rope
from kvwrite.ops.fused_rope_and_reshape_cache_flash import triton_impl as fused

# Dense heads of 128 elements (the fused kernel's four tensors).
HEAD_STRIDES = dict(Q_HEAD_STRIDE=128, QO_HEAD_STRIDE=128, K_HEAD_STRIDE=128, V_HEAD_STRIDE=128)
out = {}
for dt in ("bf16", "fp16", "fp32"):
    out["rope-" + dt] = ptx(rope._rope_kernel, {
        "positions_ptr": "*i64", "query_ptr": "*" + dt, "key_ptr": "*" + dt,
        "cos_sin_ptr": "*fp32", "num_rot": "i32", "q_stride": "i32", "k_stride": "i32",
        "max_position": "i32"}, dict(NUM_Q_HEADS=32, NUM_HEADS=8, HEAD_SIZE=128, ROT=128,
        IS_NEOX=True, Q_HEAD_STRIDE=128, K_HEAD_STRIDE=128, Q_TILES=8, BLOCK_T=1, BLOCK_H=4, BLOCK_D=128), False).count("fma")
    for quant in (0, 1):
        types = {"positions_ptr": "*i64", "query_ptr": "*" + dt, "query_out_ptr": "*" + dt,
                 "key_ptr": "*" + dt, "value_ptr": "*" + dt, "cos_sin_ptr": "*" + dt,
                 "key_cache_ptr": "*u8" if quant else "*" + dt,
                 "value_cache_ptr": "*u8" if quant else "*" + dt, "slot_mapping_ptr": "*i32"}
        types.update({n: "i32" for n in ("num_rot", "num_tokens", "q_stride", "qo_stride",
                                          "k_stride", "v_stride", "max_position", "num_slots",
                                          "stride_b", "stride_s", "stride_h")})
        consts = dict(NUM_Q_HEADS=32, NUM_HEADS=8, HEAD_SIZE=128, ROT=64, IS_NEOX=False,
                      **HEAD_STRIDES, STORE_KEY=True, BLOCK_SIZE=16, QUANT=quant,
                      K_PER_HEAD=False, V_PER_HEAD=False, Q_TILES=8, BLOCK_T=1, BLOCK_H=4, BLOCK_D=128, VALUE_FIRST=False)
        if quant:
            types.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        else:
            consts.update(k_scale_ptr=None, v_scale_ptr=None)
        out[f"fused-{dt}-q{quant}"] = ptx(fused._fused_kernel, types, consts, False).count("fma")
out["rope-fp32-fusion-on"] = ptx(rope._rope_kernel, {
    "positions_ptr": "*i64", "query_ptr": "*fp32", "key_ptr": "*fp32", "cos_sin_ptr": "*fp32",
    "num_rot": "i32", "q_stride": "i32", "k_stride": "i32", "max_position": "i32"},
    dict(NUM_Q_HEADS=2, NUM_HEADS=2, HEAD_SIZE=64, ROT=64, IS_NEOX=True, Q_HEAD_STRIDE=64,
         K_HEAD_STRIDE=64, Q_TILES=1, BLOCK_T=1,
         BLOCK_H=2, BLOCK_D=64), True).count("fma")
# Programmatic dependent launch: the PDL build's first memory access comes after the wait.
for pdl in (False, True):
    text = ptx(rope._rope_kernel, {
        "positions_ptr": "*i64", "query_ptr": "*bf16", "key_ptr": "*bf16", "cos_sin_ptr": "*fp32",
        "num_rot": "i32", "q_stride": "i32", "k_stride": "i32", "max_position": "i32"},
        dict(NUM_Q_HEADS=32, NUM_HEADS=8, HEAD_SIZE=128, ROT=128, IS_NEOX=True, Q_TILES=8,
             Q_HEAD_STRIDE=128, K_HEAD_STRIDE=128, BLOCK_T=1, BLOCK_H=4, BLOCK_D=128), False, pdl)
    first_ld = text.index("ld.global")
    out[f"rope-pdl{int(pdl)}"] = [text.count("griddepcontrol.launch_dependents"),
                                  text.count("griddepcontrol.wait"),
                                  text.find("griddepcontrol.wait") in range(0, first_ld)]
# The fused kernel's key programs (after the query branch's end, its bra.uni), with VALUE_FIRST (small
# calls) only: the fp8 scales (the only 32-bit loads with bfloat16 rows and table) are loaded before
# anything is stored, and the value's cache stores (8-bit) come before the key's in-place store
# (16-bit).
for vf in (False, True):
    types = {"positions_ptr": "*i64", "query_ptr": "*bf16", "query_out_ptr": "*bf16",
             "key_ptr": "*bf16", "value_ptr": "*bf16", "cos_sin_ptr": "*bf16",
             "key_cache_ptr": "*u8", "value_cache_ptr": "*u8", "slot_mapping_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    types.update({n: "i32" for n in ("num_rot", "num_tokens", "q_stride", "qo_stride",
                                      "k_stride", "v_stride", "max_position", "num_slots",
                                      "stride_b", "stride_s", "stride_h")})
    consts = dict(NUM_Q_HEADS=32, NUM_HEADS=8, HEAD_SIZE=128, ROT=128, IS_NEOX=True,
                  **HEAD_STRIDES, STORE_KEY=True, BLOCK_SIZE=16, QUANT=1, K_PER_HEAD=False,
                  V_PER_HEAD=False, Q_TILES=8, BLOCK_T=1, BLOCK_H=4, BLOCK_D=128, VALUE_FIRST=vf)
    text = ptx(fused._fused_kernel, types, consts, False)
    key = text[text.index("bra.uni"):]
    out[f"fused-order-vf{int(vf)}"] = [key.index("ld.global.b32") < key.index("st.global"),
                                       key.index("st.global.b8") < key.index("st.global.b16")]
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_sm90_without_fma_in_the_rotation_and_wait_first_with_pdl():
    """Also: the fused kernel's order of loads and stores in its key programs."""
    counts = run_triton_script(_PTX_SCRIPT)
    # The fp8 variants keep the quotient's deliberate FMAs (kvwrite.kernels.triton_fp8); every
    # other variant has none, and with fusion allowed the rotation gets some (the check can fail).
    pdl = {k: counts.pop(k) for k in ("rope-pdl0", "rope-pdl1")}
    order = {k: counts.pop(k) for k in ("fused-order-vf0", "fused-order-vf1")}
    assert order == {"fused-order-vf0": [False, False], "fused-order-vf1": [True, True]}
    assert {k: v for k, v in counts.items() if "-q1" not in k and "fusion-on" not in k} == {
        k: 0 for k in counts if "-q1" not in k and "fusion-on" not in k}
    assert counts["rope-fp32-fusion-on"] > 0
    assert all(counts[k] > 0 for k in counts if "-q1" in k)
    # PDL=True: one launch_dependents and one wait, the wait before the first global load.
    assert pdl == {"rope-pdl0": [0, 0, False], "rope-pdl1": [1, 1, True]}


# --- CUDA: every variant compiles with NVRTC (no GPU needed); no FMA in the rotation ------------

def _cuda_modules():
    pytest.importorskip("cuda.core")
    from kvwrite.ops.fused_rope_and_reshape_cache_flash import cuda_impl as fused_cuda
    from kvwrite.ops.rotary_embedding import cuda_impl as rope_cuda
    return rope_cuda, fused_cuda


@pytest.mark.parametrize("which", ["rotary", "fused"])
def test_nvrtc_compiles_every_cuda_variant_for_sm90(which):
    rope_cuda, fused_cuda = _cuda_modules()
    mod = rope_cuda if which == "rotary" else fused_cuda
    names = mod.all_kernel_names()
    obj, _ = mod.SOURCE.compile("sm_90", names)
    assert len(bytes(obj.code)) > 0
    assert set(names) <= set(obj.symbol_mapping)
    # The launchers pass every scalar as a Python int (8 bytes): the kernels take int64s only,
    # as many as the launchers pass (12 and 27), after the pointers; the fused kernel's names
    # carry its register bound (1, or the large-call build's).
    for name in names:
        params = sass_tools.kernel_params(obj, name)
        assert params.endswith("x" * (12 if which == "rotary" else 27)), params
        assert not params.endswith("x" * (13 if which == "rotary" else 28)), params
    # ... and the last of them are the fixed arguments, after num_rot (and for the fused
    # kernel num_tokens and the two scale strides).
    for case in (ROPE_CASES if which == "rotary" else FUSED_CASES)[:3]:
        _, fixed = _specialized_build(which, case)
        assert len(fixed) == (12 - 1 if which == "rotary" else 27 - 4)


def _specialized_build(which, case, max_unit_bytes=16):
    """(kernel name, fixed arguments) of the build ``case``'s call takes with units of at most
    ``max_unit_bytes`` (CudaTuning.small_call_unit_bytes for small calls): its shapes and
    strides, from CPU tensors (no GPU needed)."""
    rope_cuda, fused_cuda = _cuda_modules()
    inp = make_rope_inputs(case, "cpu")
    cs = inp.cos_sin_cache
    if which == "rotary":
        q, k = rope_pkg.op.validate(*inp.rotary_args())
        w = rope_cuda._width(q, k, cs, case.is_neox, max_unit_bytes)
        return (rope_cuda.kernel_name(rope_cuda.kind(q.dtype), rope_cuda.kind(cs.dtype), w,
                                      case.is_neox, inp.positions.dtype),
                rope_cuda.fixed_args(q, k, cs, case.is_neox, w))
    q, k, v, query_out, cache_dtype = fused_pkg.op.validate(*inp.fused_args(),
                                                            **inp.fused_kwargs())
    kc = inp.key_cache
    w = fused_cuda._width(q, k, v, kc, inp.value_cache, query_out, cs, case.is_neox,
                          max_unit_bytes)
    out = fused_cuda._out_kind(cache_dtype, q.dtype, kc.dtype)
    return (fused_cuda.kernel_name(rope_cuda.kind(q.dtype), rope_cuda.kind(cs.dtype), out, w,
                                   case.is_neox, inp.positions.dtype, inp.slot_mapping.dtype),
            fused_cuda.fixed_args(q, k, v, cs, case.is_neox, kc, case.rotate_key_in_place,
                                  query_out, w))


@pytest.mark.parametrize("which", ["rotary", "fused"])
def test_nvrtc_compiles_the_specialized_build_of_every_case(which):
    """Every call of the case matrix takes a build with its fixed arguments compiled in
    (CudaTuning.specialize): each compiles for sm_90. A build given the wrong number of fixed
    arguments is refused by the compiler, naming the macro."""
    rope_cuda, fused_cuda = _cuda_modules()
    mod = rope_cuda if which == "rotary" else fused_cuda
    from kvwrite.kernels import nvrtc
    builds = {_specialized_build(which, c, unit) for c in (ROPE_CASES if which == "rotary"
                                                          else FUSED_CASES)
              for unit in (16, mod.TUNING.small_call_unit_bytes)}
    assert len(builds) > 10
    for name, fixed in sorted(builds):
        obj, _ = mod.SOURCE.compile("sm_90", name, macros=nvrtc.fixed_args_macros(fixed))
        assert name in obj.symbol_mapping
    with pytest.raises(RuntimeError, match=f"KVWRITE_FIXED_ARGS: {len(fixed)} values"):
        mod.SOURCE.compile("sm_90", name, macros=nvrtc.fixed_args_macros(fixed[:-1]))


@pytest.mark.parametrize("which", ["rotary", "fused"])
def test_cuda_specialized_builds_read_no_fixed_argument(which, tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: the pointers, num_rot (the fused
    kernel: num_tokens and the scale strides too), then the fixed arguments. A build with them
    compiled in reads none of the fixed ones; the generic build reads them (the check can
    fail); both read the positions' pointer and num_rot."""
    rope_cuda, fused_cuda = _cuda_modules()
    mod = rope_cuda if which == "rotary" else fused_cuda
    sass_tools.cuobjdump_or_skip()
    cases = ROPE_CASES if which == "rotary" else FUSED_CASES
    pointers, leading = (4, 1) if which == "rotary" else (11, 4)
    num_rot = 0x210 + 8 * pointers
    for case in (cases[0], next(c for c in cases if c.kv_cache_dtype == "fp8"
                                and c.per_head_scale) if which == "fused" else cases[1]):
        name, fixed = _specialized_build(which, case)
        special = sass_tools.assert_source_fixed_args_compiled_in(mod.SOURCE, name, fixed,
                                                                  pointers + leading, tmp_path)
        assert {0x210, num_rot} <= special, sorted(map(hex, special))


# The kernels' uses of the head strides (patterns of the whole statements), and the statements
# the kernels had there before head strides were arguments (their text, verbatim).
_NO_HEAD_STRIDES = {
    "rotary": [(r"const i64 head_stride = is_q \? q_head_stride : k_head_stride;",
                "const i64 head_stride = head_size;")],
    "fused": [(r"const i64 h_off = static_cast<i64>\(j\) \* q_head_stride \* IB;.*?"
               r"u8\* out = query_out \+ t \* qo_stride \* IB \+ out_off;",
               "const i64 h_off = static_cast<i64>(j) * head_size * IB;\n"
               "    const u8* row = query + t * q_stride * IB + h_off;\n"
               "    u8* out = query_out + t * qo_stride * IB + h_off;"),
              (r"u8\* krow = key \+ t \* k_stride \* IB \+ h \* k_head_stride \* IB;\s*"
               r"const u8\* vrow = value \+ t \* v_stride \* IB \+ h \* v_head_stride \* IB;",
               "u8* krow = key + t * k_stride * IB + h * head_size * IB;\n"
               "  const u8* vrow = value + t * v_stride * IB + h * head_size * IB;")],
}


@pytest.mark.parametrize("which", ["rotary", "fused"])
def test_cuda_dense_heads_build_the_code_of_kernels_without_head_strides(which, tmp_path):
    """Dense heads pass head strides equal to head_size, compiled in: the specialized builds
    (both unit widths; the fused op with query_out too) are instruction for instruction those of
    the kernel that used head_size there (its statements kept here verbatim), so padded heads
    cost dense calls nothing. Recomputing query_out's head offset from its own (equal) stride
    changed the fused kernel's SASS: the kernel reuses query's offset where the strides agree."""
    from kvwrite.kernels import nvrtc
    mod = _cuda_modules()[0 if which == "rotary" else 1]
    old = mod.SOURCE.text
    for use, before in _NO_HEAD_STRIDES[which]:
        old, n = re.subn(use, lambda m, b=before: b, old, flags=re.S)
        assert n == 1, f"the kernel's use of head strides changed ({use}): check this test"
    cases = [RopeCase(num_q_heads=32, num_heads=8, head_size=128)]
    if which == "fused":
        cases.append(RopeCase(num_q_heads=4, num_heads=2, head_size=80, query_out=True,
                              rotate_key_in_place=False, kv_cache_dtype="fp8", layout=Layout.HND))
    for case in cases:
        for unit in (16, 8):
            name, fixed = _specialized_build(which, case, unit)
            listings = []
            for text in (None, old):
                macros = nvrtc.fixed_args_macros(fixed)
                source = type("S", (), {"compile": lambda self, a, n, t=text, m=macros:
                                        mod.SOURCE.compile(a, n, source=t, macros=m)})()
                listings.append(re.findall(r"/\*[0-9a-f]{4,}\*/\s*([^;]*);",
                                           _sass(source, name, tmp_path)))
            assert listings[0] == listings[1], (case.id, unit)


def _sass(source, names, tmp_path) -> str:
    """The sm_90 SASS of ``names`` built from ``source`` (skip where there is no cuobjdump)."""
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    obj, _ = source.compile("sm_90", names)
    return sass_tools.dump_sass(bytes(obj.code), tmp_path)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cuda_fused_small_call_build_loads_the_fp8_scales_before_the_table(kv_cache_dtype,
                                                                            tmp_path):
    """The small-call builds (units of 8 and 4 elements) use the fp8 scales only after the
    rotation; their loads must still be issued before the table's, not sunk to that use (a
    memory round trip more per call). ptxas sank plain loads there in the build with the fixed
    arguments compiled in (tuning-log change 48), so they are loaded where they stand
    (kvw/vec_io.cuh's load_scale, an asm volatile ld.global.nc): the first 4-byte load comes
    before the first 16-byte read-only load (the table's), in the generic and the specialized
    build."""
    rope_cuda, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    case = RopeCase(num_tokens=16, num_q_heads=32, num_heads=8, head_size=128,
                    kv_cache_dtype=kv_cache_dtype)
    builds = [_specialized_build("fused", case, unit) for unit in (16, 8)]
    assert builds[0][0].endswith(", 8, true, long long, long long, 1>"), builds  # W = 8
    assert builds[1][0].endswith(", 4, true, long long, long long, 1>"), builds  # W = 4
    for (name, _), macros in [(b, m) for b in builds
                                  for m in ((), nvrtc.fixed_args_macros(b[1]))]:
        source = type("S", (), {"compile": lambda self, a, n, m=macros: fused_cuda.SOURCE.compile(
            a, n, macros=(nvrtc.PDL_MACRO,) + m)})()
        loads = [op for op in sass_tools.opcodes(_sass(source, name, tmp_path))
                 if op.startswith("LDG")]
        table = loads.index("LDG.E.128.CONSTANT")
        scale = min(i for i, op in enumerate(loads) if op in ("LDG.E.STRONG.SYS",
                                                               "LDG.E.CONSTANT", "LDG.E"))
        assert scale < table, loads


def _row_load(text: str) -> bool:
    """A row's load in the RoPE kernels: the volatile loads of query, key and value chunks, which
    must not wait for the position's or slot's load."""
    return "STRONG.SYS" in text


def test_cuda_rope_kernels_issue_the_row_loads_before_waiting_for_any_load(tmp_path):
    """A small call's latency is its chain of memory round trips: the position (and slot), then
    the table's row, then the stores, with the rows' loads alongside the first. In the machine
    code of every variant of both kernels, and of the specialized builds of the case matrix (both
    unit widths), no instruction waits for a global load's result before the last row load is
    issued (sass.waits_before_loads reads sm_90's scoreboard bits). The fused kernel's earlier
    source failed this in every variant, and so do the two mutations below: its value chunks
    initialized as copies of the key's, or its position loaded first (tuning-log change 52)."""
    rope_cuda, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    for which, mod in (("rotary", rope_cuda), ("fused", fused_cuda)):
        obj, _ = mod.SOURCE.compile("sm_90", mod.all_kernel_names())
        late = sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), tmp_path), _row_load)
        assert not late, (which, late)
        builds = {_specialized_build(which, c, unit) for c in (ROPE_CASES if which == "rotary"
                                                               else FUSED_CASES)
                  for unit in (16, mod.TUNING.small_call_unit_bytes)}
        for name, fixed in sorted(builds):
            obj, _ = mod.SOURCE.compile("sm_90", name, macros=nvrtc.fixed_args_macros(fixed))
            late = sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), tmp_path),
                                          _row_load)
            assert not late, (name, fixed, late)
    text = fused_cuda.SOURCE.text
    copies = text.replace("b{}, va{}, vb{};", "b = a, va = a, vb = a;")
    first = text.replace("  const u32 j = c / static_cast<u32>(units_per_head);\n",
                         "  const i64 p0 = positions[t];\n"
                         "  if (static_cast<u64>(p0) >= static_cast<u64>(max_position)) return;\n"
                         "  const u32 j = c / static_cast<u32>(units_per_head);\n", 1)
    name = "fused_rope_cache_kernel<0, 2, 5, 8, true, long long, long long, 1>"
    for mutated in (copies, first):
        assert mutated != text
        obj, _ = fused_cuda.SOURCE.compile("sm_90", name, source=mutated)
        assert sass_tools.late_issues(sass_tools.dump_sass(bytes(obj.code), tmp_path), _row_load)


def _stores_before_table(sass: str) -> int:
    """Global stores placed before the first 16-byte read-only load (the table's entries; the
    position and slot loads are narrower, the rows' volatile) in a fused build's listing, whose
    key path comes first."""
    ops = sass_tools.opcodes(sass)
    first_table = next(i for i, op in enumerate(ops) if op == "LDG.E.128.CONSTANT")
    return sum(op.startswith("STG") for op in ops[:first_table])


def test_cuda_fused_large_build_stores_a_128_byte_value_row_with_the_key(tmp_path):
    """The large-call build stores the value's converted chunks before it requests the table,
    except where a head's cache row is 128 bytes (fp8 with D=128, 16-bit with D=64): there it
    holds them and stores them right after the key's, so K and V of a (slot, head), adjacent
    lines in the packed layout, are written together (kernel.cu's value_after; packed fp8 (32,32,128)
    T=4096 88.5 -> 91.7% of the copy bandwidth, tuning-log change 53). Pinned either side in the
    specialized builds of the benchmark's shapes."""
    _, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    min_blocks = fused_cuda.TUNING.large_call_min_blocks
    for d, kv, hold in ((128, "fp8", True), (64, "auto", True), (128, "auto", False),
                        (64, "fp8", False)):
        for alloc in (KVAlloc.PACKED, KVAlloc.INTERLEAVED):
            case = RopeCase(num_tokens=20, head_size=d, num_q_heads=32, num_heads=8,
                            num_blocks=4, dtype=torch.bfloat16, kv_cache_dtype=kv, alloc=alloc)
            name, fixed = _specialized_build("fused", case)
            name = name.rsplit(", ", 1)[0] + f", {min_blocks}>"  # the large-call build
            obj, _ = fused_cuda.SOURCE.compile("sm_90", name,
                                               macros=nvrtc.fixed_args_macros(fixed))
            early = _stores_before_table(sass_tools.dump_sass(bytes(obj.code), tmp_path))
            assert (early == 0) == hold, (d, kv, alloc, early)


def test_cuda_fused_small_build_prepares_fp8_stores_while_the_table_loads(tmp_path):
    """A small call's key thread requests the table's entries, then computes the fp8 scales'
    constants (their MUFU.RCP) and converts the value while they are in flight, before the
    rotation's first result (F2F.BF16.F32): that work used to follow the rotation, on the call's
    latency path (tuning-log change 54). Checked in the specialized small-call builds of
    GQA(32,8,128) bfloat16 with fp8 caches (both unit widths); the old order fails it."""
    _, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")

    def order(source, name, fixed):
        obj, _ = fused_cuda.SOURCE.compile("sm_90", name, source=source,
                                           macros=nvrtc.fixed_args_macros(fixed))
        ops = sass_tools.opcodes(sass_tools.dump_sass(bytes(obj.code), tmp_path))
        return ops.index("LDG.E.128.CONSTANT") < ops.index("MUFU.RCP") < ops.index("F2F.BF16.F32")

    text = fused_cuda.SOURCE.text
    for alloc in (KVAlloc.INTERLEAVED, KVAlloc.PACKED):
        case = RopeCase(num_tokens=16, head_size=128, num_q_heads=32, num_heads=8,
                        dtype=torch.bfloat16, kv_cache_dtype="fp8", alloc=alloc)
        for unit in (fused_cuda.TUNING.small_call_unit_bytes, 16):
            name, fixed = _specialized_build("fused", case, unit)
            assert order(text, name, fixed), (alloc, unit)
    old = text.replace("      prepare_stores();\n      convert_value();\n"
                       "      rope_rotate_entries<IN, CS, W, NEOX>(a, b, entries);\n",
                       "      rope_rotate_entries<IN, CS, W, NEOX>(a, b, entries);\n", 1)
    old = old.replace("  if (!valid) return;\n",
                      "  if (!valid) return;\n  if constexpr (!VALUE_FIRST) {\n"
                      "    if (rotated) {\n      prepare_stores();\n      convert_value();\n"
                      "    }\n  }\n", 1)
    assert old != text
    assert not order(old, name, fixed)


def test_cuda_rotation_sass_has_no_fma(tmp_path):
    """The copy and cast variants have no fused multiply-add (fp8 ones keep the quotient's);
    a contracting build of the same arithmetic would (the check can fail)."""
    rope_cuda, fused_cuda = _cuda_modules()
    for mod, names in ((rope_cuda, rope_cuda.all_kernel_names()),
                       (fused_cuda, [n for n in fused_cuda.all_kernel_names()
                                     if n.split("<")[1].split(", ")[2] not in ("3", "4")])):
        assert names
        sass = _sass(mod.SOURCE, names, tmp_path)
        assert "FMUL" in sass and "FFMA" not in sass
    contracting = rope_cuda.SOURCE.text.replace(
        "rope_rotate_unit<IN, CS, W, NEOX>(a, b, cos_sin", "naive_rotate<IN, CS, W, NEOX>(a, b, cos_sin")
    assert contracting != rope_cuda.SOURCE.text
    naive = r'''
template <int IN, int CS, int W, bool NEOX>
KVW_HD void naive_rotate(Raw<W * elem_bytes(IN)>& a, Raw<W * elem_bytes(IN)>& b,
                         const u8* table, u32 half, u32 oa) {
  Raw<W * elem_bytes(IN)> r = zero_raw<W * elem_bytes(IN)>();
  for (int j = 0; j < W; ++j) {
    const float c = elem_f32<CS>(load_raw<4>(table + 4 * j), 0);
    put_elem<IN>(r, j, round_to<IN>(elem_f32<IN>(a, j) * c - elem_f32<IN>(b, j) * c));
  }
  a = r;
}
'''
    contracting = contracting.replace('#include "kvw/rope.cuh"\n', '#include "kvw/rope.cuh"\n' + naive)

    name = rope_cuda.kernel_name(2, 2, 4, True, torch.int64)
    obj, _ = rope_cuda.SOURCE.compile("sm_90", name, source=contracting)
    path = tmp_path / "naive.cubin"
    path.write_bytes(bytes(obj.code))
    assert "FFMA" in _sass(type("S", (), {"compile": lambda self, a, n: (obj, "")})(), name,
                           tmp_path)


# --- the benchmark ------------------------------------------------------------------------------

def _bench():
    from kvwrite.bench.ops import fused_rope_and_reshape_cache_flash as bench
    return bench


def test_bench_rope_runs_checks_and_writes_rows(tmp_path, capsys):
    import json

    from kvwrite.bench.cli import main as cli_main

    out = tmp_path / "r.json"
    rc = cli_main(["rope", "--device", "cpu", "--num-tokens", "3", "--implementation", "torch",
                   "--iters", "2", "--time-budget", "0.01", "--no-graph", "--heads", "4,2,32",
                   "--dtypes", "float16", "--kv-cache-dtypes", "auto,fp8", "--layouts",
                   "NHD,packed", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "best pair/fused" in text and "bound" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 3
    assert {r["check"] for r in rows} == {"passed"}
    assert all(r["latency_us"] > 0 for r in rows)
    assert {r["kind"] for r in rows} == {"fused", "pair", "rotary"}
    bench_rope = _bench()
    p = bench_rope.Point(torch.bfloat16, CacheDType.AUTO, 32, 8, 128, 128, True, "NHD", 1000,
                         256, 16, 4096)
    # pair - fused = one more read of the key: T*H*D*2 bytes.
    assert bench_rope.point_bytes(p, "pair") - bench_rope.point_bytes(p, "fused") == 1000 * 8 * 128 * 2


# --- the benchmark's slot patterns and positions ------------------------------------------------

BENCH_CPU = ["rope", "--device", "cpu", "--implementation", "torch", "--iters", "2",
             "--time-budget", "0.01", "--no-graph", "--heads", "4,2,32", "--dtypes", "float16"]


def _bench_point(kind: str, T: int = 16, max_position: int = 4096, **pattern):
    from kvwrite.testing.slots import SlotPattern
    slots = SlotPattern(kind, max_position=None if kind == "random" else max_position, **pattern)
    return _bench().Point(torch.float16, CacheDType.AUTO, 4, 2, 32, 32, True, "NHD", T, 64, 16,
                          max_position, "", slots)


def test_bench_rope_slot_pattern_runs_checks_and_rows_carry_it(tmp_path, capsys):
    import csv
    import json

    from kvwrite.bench.cli import main as cli_main
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    rc = cli_main([*BENCH_CPU, "--num-tokens", "4", "16", "--kv-cache-dtypes", "auto,fp8",
                   "--slots", "decode", "--pad-fraction", "0.25", "--json", str(js),
                   "--csv", str(cs)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "# slots: decode(context_len=4096, max_position=4096, pad_fraction=0.25): " in out
    assert "# positions: each token's position in its sequence" in out
    doc = json.loads(js.read_text())
    assert doc["meta"]["header"] == [ln[2:] for ln in out.splitlines() if ln.startswith("# ")]
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert r["check"] == "passed" and r["status"] == "ok"
        assert (r["slots"], r["pad_fraction"], r["max_position"]) == ("decode", 0.25, 4096)
        assert r["slot_params"] == "decode(context_len=4096, max_position=4096, pad_fraction=0.25)"
    with cs.open() as f:
        assert {line["slots"] for line in csv.DictReader(f)} == {"decode"}


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_bench_rope_positions_are_the_sequences_positions(kind):
    from kvwrite.testing.slots import make_slots
    # A 64-row table: decode contexts (up to 4096 asked) and the mixed chunk stay below it.
    p = _bench_point(kind, T=48, max_position=64, pad_fraction=0.25, prefill_len=40,
                     decode_tokens=8)
    gen = torch.Generator().manual_seed(0)
    sets = _bench().make_sets(p, 3, torch.device("cpu"), gen)
    for i, s in enumerate(sets):
        batch = make_slots(p.slots, 48, p.num_blocks, p.block_size, set_index=i)
        assert s.slots.tolist() == batch.slots.tolist()
        pos = s.positions.tolist()
        t = 0
        for seq in batch.sequences:  # in token order
            want = list(range(seq.start, seq.start + seq.num_new))
            if kind == "decode":  # one token at its context length
                assert want == [seq.start]
            assert pos[t:t + seq.num_new] == want
            t += seq.num_new
        assert t == 36 and pos[36:] == [0] * 12 and max(pos) < 64
        assert s.slots[36:].tolist() == [-1] * 12


def test_bench_rope_random_keeps_random_positions_over_the_table():
    p = _bench_point("random", T=200, max_position=4096)
    (s,) = _bench().make_sets(p, 1, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert int(s.positions.min()) >= 0 and int(s.positions.max()) < 4096
    assert len(set(s.positions.tolist())) > 150  # not a sequence's consecutive positions
    assert len(set(s.slots.tolist())) == 200


def test_bench_rope_bytes_leave_out_the_padding_writes():
    bench_rope = _bench()
    full, padded = _bench_point("decode"), _bench_point("decode", pad_fraction=0.25)
    e, H, D, c = 2, 2, 32, 2
    # 4 of the 16 tokens are padding: no value read, no K/V cache write, no second key read.
    assert (bench_rope.point_bytes(full, "fused") - bench_rope.point_bytes(padded, "fused")
            == 4 * (H * D * e + 2 * H * D * c))
    assert (bench_rope.point_bytes(full, "pair") - bench_rope.point_bytes(padded, "pair")
            == 4 * (2 * H * D * e + 2 * H * D * c))
    assert bench_rope.point_bytes(full, "rotary") == bench_rope.point_bytes(padded, "rotary")


def test_bench_rope_check_catches_a_write_of_padding():
    from kvwrite import fused_rope_and_reshape_cache_flash
    from kvwrite.testing.rope import cos_sin_table
    bench_rope = _bench()
    p = _bench_point("decode", pad_fraction=0.25)

    def caller(p, impl, kind, sets, caches, table, scales):
        if impl != "padding-writer":
            return bench_rope.kind_call(p, impl, kind, sets, caches, table, scales)

        def call(i):  # wrong: indexes with -1 as Python does, so padding lands in the last slot
            s = sets[i % len(sets)]
            slots = s.slots.clone()
            slots[slots < 0] = p.num_blocks * p.block_size - 1
            fused_rope_and_reshape_cache_flash(s.query, s.key, s.value, s.positions, table,
                                               p.is_neox, *caches, slots, None, None, "auto",
                                               implementation="torch")
        return call

    table = cos_sin_table(p.max_position, p.rot_dim, torch.float32)
    cpu = torch.device("cpu")
    assert bench_rope.check(p, "torch", "fused", cpu, table, (None, None), caller) is None
    reason = bench_rope.check(p, "padding-writer", "fused", cpu, table, (None, None), caller)
    assert reason is not None and reason.startswith("key_cache: ")


def test_bench_rope_rotation_flushes_when_the_sets_are_small():
    from kvwrite.bench import engine
    from kvwrite.bench.timing import l2_rotation
    bench_rope = _bench()
    l2 = 50 << 20
    assert l2_rotation(True, 1000, l2, 20) == (1, False)           # hot: one set, no flush
    assert l2_rotation(False, 60 << 20, l2, 20) == (2, False)      # sets past 2x the L2
    assert l2_rotation(False, 40 << 20, l2, 20) == (3, False)
    assert l2_rotation(False, 57_000, l2, 20) == (20, True)        # T=1: flush too

    # The rope benchmark's own rule. Call i of a graph takes set i % sets, so a point never has
    # more sets than the graph has calls (a cap of 64 left MHA(32,32,128) at T=32-96 rotating
    # over the 20 sets a graph touches, unflushed). The sets are counted by the bytes a call
    # touches in them (the in-place query and key once), for the kind that touches fewest:
    # GQA(32,8,128) at T=4096 (rotary 42 MB a set) takes 3 sets, not the 2 that the pair's
    # bytes moved (119 MB) would give, which left rotary_embedding's 84 MB partly in the L2.
    l2 = 60 << 20

    def cfg(*argv):
        return engine.configure(bench_rope.BENCH, list(argv), "rope")[0]

    def point(hq, h, T):
        return bench_rope.Point(torch.bfloat16, CacheDType.AUTO, hq, h, 128, 128, True, "NHD", T,
                                256, 16, 4096)

    kinds = ("fused", "pair", "rotary")
    for hq, h, T in ((32, 32, 64), (32, 8, 128), (32, 8, 4096), (32, 32, 4096), (32, 8, 16384)):
        p = point(hq, h, T)
        for calls in (5, 20, 64):
            sets, flush = engine.rotation(bench_rope.BENCH, cfg("--graph-calls", str(calls)), p, l2)
            assert 1 <= sets <= calls
            for k in kinds:
                touched = sets * bench_rope.set_footprint(p, k)
                assert flush[k] == (touched < 2 * l2), (hq, h, T, calls, k)
                if not flush[k]:
                    assert touched >= 2 * l2
    default = cfg()
    assert bench_rope.set_footprint(point(32, 8, 4096), "rotary") == 4096 * (40 * 256 + 8)
    assert engine.rotation(bench_rope.BENCH, default, point(32, 8, 4096), l2)[0] == 3
    assert engine.rotation(bench_rope.BENCH, cfg("--kinds", "fused"), point(32, 8, 4096),
                           l2)[0] == 3
    assert engine.rotation(bench_rope.BENCH, default, point(32, 32, 64), l2) == (
        default.graph_calls, {"fused": True, "pair": True, "rotary": True})
    assert engine.rotation(bench_rope.BENCH, cfg("--hot-l2"), point(32, 32, 64), l2) == (
        1, {"fused": False, "pair": False, "rotary": False})


def test_bench_rope_model_takes_the_serving_shape():
    from kvwrite.bench import engine
    bench_rope = _bench()

    def args_of(*argv):
        return engine.configure(bench_rope.BENCH, list(argv), "rope")[1]

    a = args_of("--model", "llama-3.1-8b", "--slots", "decode")
    assert a.token_counts == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert (a.max_position, a.context_len, a.num_blocks) == (131072, 131071, 65536)
    assert a.pattern.max_position == 131072
    a = args_of("--model", "llama-3.1-8b", "--slots", "mixed", "--device", "cpu",
                "--num-tokens", "64", "--max-position", "8192")
    assert (a.token_counts, a.max_position, a.decode_tokens, a.num_blocks) == ([64], 8192, 256,
                                                                                256)
    a = args_of("--model", "llama-3.1-8b")  # random: today's sweep and table
    assert (a.token_counts, a.max_position, a.num_blocks) == ([1, 8, 128, 2048], 4096, 256)
    assert a.pattern.is_default
    assert a.head_list == [(32, 8, 128)]
