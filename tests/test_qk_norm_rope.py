"""fused_qk_norm_rope and fused_qk_norm_rope_and_reshape_cache_flash (docs/ops/fused_qk_norm_rope.md):
the torch reference against an independent oracle (NumPy float64, one token and head at a time,
rounded to float32 at every step of the contract, its own pairwise tree by recursive halves);
every implementation byte for byte against the reference (qkv, query_out and both caches, whole
allocations); fused == the norm op followed by reshape_and_cache_flash; validation specifics
(bad input and deliberately wrong implementations: tests/test_conformance.py); NVRTC compiles
of every CUDA variant and the machine code (no local memory, no FFMA outside the root and the
divisions); on the GPU the large matrix for all three implementations, the generic CUDA builds,
CUDA-graph replay with new positions, weights and scales, torch.compile and the memory-checker
cases."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re

import numpy as np
import pytest
import torch

import kvwrite
import sass as sass_tools
from host import TRITON_PTX_PRELUDE, run_triton_script
from kvwrite import registry
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops import fused_qk_norm_rope as norm_pkg
from kvwrite.ops import fused_qk_norm_rope_and_reshape_cache_flash as fused_pkg
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.compile import compiled_targets
from kvwrite.testing.providers.fused_qk_norm_rope import BROKEN, variant
from kvwrite.testing.providers.qk_norm_common import FUSED_NAMES, NORM_NAMES, VCASE
from kvwrite.testing.qk_norm import (
    FUSED_CASES,
    GPU_FUSED_CASES,
    GPU_NORM_CASES,
    NORM_CASES,
    QkNormCase,
    QkNormInputs,
    clone_inputs,
    differences,
    make_qk_norm_inputs,
)
from oracle import fp8_round, oracle_valid_tokens
from params import DEVICES

NORM = norm_pkg.OP
FUSED = fused_pkg.OP


def _nan_equal(case: QkNormCase) -> bool:
    """Cases whose results hold NaNs (the contract lets each stored NaN be any NaN)."""
    return case.special in ("nan", "inf") or (case.eps == 0 and case.special in ("zeros", "tiny"))


# --- the oracle ----------------------------------------------------------------------------------

def _f32(x):
    """float64 values rounded to float32 (nearest even, overflow to ±inf), as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def _tree(leaves: list[float]) -> float:
    """The pairwise sum of a power-of-two number of leaves: the two halves' sums added (the same
    tree as neighbours added level by level), each sum rounded to float32."""
    if len(leaves) == 1:
        return leaves[0]
    h = len(leaves) // 2
    return float(_f32(_tree(leaves[:h]) + _tree(leaves[h:])))


def _round_to(vals: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 values (as float64) rounded to nearest even in ``dtype`` (bfloat16 by integer
    arithmetic)."""
    v32 = np.ascontiguousarray(vals, dtype=np.float32)
    if dtype == torch.float32:
        return torch.from_numpy(v32.copy())
    if dtype == torch.float16:
        with np.errstate(over="ignore"):
            return torch.from_numpy(v32.astype(np.float16))
    b = v32.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    r = np.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return torch.from_numpy(r.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def oracle_head(x: np.ndarray, g: np.ndarray | None, eps32: float, cs: np.ndarray, rot: int,
                neox: bool) -> np.ndarray:
    """One head row (float32 values as float64) normalized and rotated, float32 values."""
    d = len(x)
    p = 1
    while p < d:
        p *= 2
    with np.errstate(all="ignore"):
        leaves = [float(v) for v in _f32(x * x)] + [0.0] * (p - d)
        ss = _tree(leaves)
        m = float(_f32(ss / d))
        a = float(_f32(m + eps32))
        sigma = float(_f32(np.sqrt(a)))
        r = float(_f32(np.float64(1.0) / np.float64(sigma)))
        n = _f32(x * r)
        if g is not None:
            n = _f32(n * g)
        out = n.copy()
        half = rot // 2
        xs = np.arange(half) if neox else np.arange(0, rot, 2)
        ys = xs + half if neox else xs + 1
        c, s = cs[:half], cs[half:rot]
        out[xs] = _f32(_f32(n[xs] * c) - _f32(n[ys] * s))
        out[ys] = _f32(_f32(n[ys] * c) + _f32(n[xs] * s))
    return out


def _oracle_weight(w: torch.Tensor | None, offset: float) -> np.ndarray | None:
    if w is None:
        return None
    g = w.float().numpy().astype(np.float64)
    if offset != 0:
        g = _f32(g + float(np.float32(offset)))
    return g


def oracle_rows(inp: QkNormInputs) -> tuple[torch.Tensor, list[bool]]:
    """The query and key heads of every row t < T_rot as the contract stores them (qkv's dtype;
    rows of invalid tokens keep their bits), ``[T_rot, Hq+Hk, D]``, and each token's validity."""
    qkv = inp.heads()
    hq, hk = inp.num_heads_q, inp.num_heads_k
    table = inp.cos_sin_cache.float().numpy().astype(np.float64)
    rot = inp.cos_sin_cache.shape[1]
    eps32 = float(np.float32(inp.eps))
    gq = _oracle_weight(inp.q_weight, inp.weight_offset)
    gk = _oracle_weight(inp.k_weight, inp.weight_offset)
    out = qkv[:inp.position_ids.numel(), :hq + hk].clone()
    valid = []
    for t in range(inp.position_ids.numel()):
        p = int(inp.position_ids[t])
        ok = 0 <= p < table.shape[0]
        valid.append(ok)
        if not ok:
            continue
        for h in range(hq + hk):
            x = qkv[t, h].float().numpy().astype(np.float64)
            row = oracle_head(x, gq if h < hq else gk, eps32, table[p], rot, inp.is_neox)
            out[t, h] = _round_to(row, qkv.dtype)
    return out, valid


def expected_norm(case: QkNormCase) -> QkNormInputs:
    inp = make_qk_norm_inputs(case)
    rows, valid = oracle_rows(inp)
    qkv = inp.heads()
    for t, ok in enumerate(valid):
        if ok:
            qkv[t, :rows.shape[1]] = rows[t]
    return inp


def _quantize_query(row: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    with np.errstate(all="ignore"):
        q = row.float().numpy().astype(np.float32) / np.float32(scale)
    return torch.from_numpy(fp8_round(q, fp8)).view(fp8)


def expected_fused(case: QkNormCase) -> QkNormInputs:
    inp = make_qk_norm_inputs(case)
    rows, valid = oracle_rows(inp)
    qkv = inp.heads()
    hq, hk = inp.num_heads_q, inp.num_heads_k
    qo = inp.query_out
    if qo is not None and qo.dim() == 2:
        qo = qo.unflatten(1, (hq, inp.head_dim))
    key = qkv[:, hq:hq + hk].clone()
    value = qkv[:, hq + hk:].clone()
    for t, ok in enumerate(valid):
        if not ok:
            continue
        key[t] = rows[t, hq:]
        if inp.rotate_key_in_place:
            qkv[t, hq:hq + hk] = rows[t, hq:]
        if qo is None:
            qkv[t, :hq] = rows[t, :hq]
        elif qo.dtype == qkv.dtype:
            qo[t] = rows[t, :hq]
        else:
            for h in range(hq):
                s = float(inp.q_scale.reshape(-1)[h if inp.q_scale.numel() > 1 else 0])
                qo[t, h] = _quantize_query(rows[t, h], s, qo.dtype)
    oracle_valid_tokens(key, value, inp, valid, case.cache_dtype)
    return inp


_expected_norm = functools.cache(expected_norm)
_expected_fused = functools.cache(expected_fused)


def assert_same(got: QkNormInputs, want: QkNormInputs, nan_equal: bool = False,
                names: tuple[str, ...] | None = None) -> None:
    """Every tensor of the call (or those of ``names``), whole allocations, byte for byte."""
    diff = differences(got, want, nan_equal, names)
    if diff is not None:
        raise AssertionError(f"bytes differ: {diff}")


def _norm_names(inp: QkNormInputs) -> tuple[str, ...]:
    return tuple(inp.tensors(cache=False))


# --- the reference against the oracle ------------------------------------------------------------

@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.id)
def test_norm_reference_matches_oracle(case):
    inp = make_qk_norm_inputs(case)
    kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(), implementation="torch")
    assert_same(inp, _expected_norm(case), _nan_equal(case), _norm_names(inp))


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_reference_matches_oracle(case):
    inp = make_qk_norm_inputs(case)
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation="torch")
    assert_same(inp, _expected_fused(case), _nan_equal(case))


def test_oracle_rounds_bfloat16_to_nearest_even():
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -0.0, 3e38],
                    dtype=np.float32)
    got = _round_to(vals.astype(np.float64), torch.bfloat16)
    want = torch.from_numpy(vals).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_reference_root_is_correctly_rounded_where_float32_sqrt_may_not_be():
    """The reference's sigma is the float64 root rounded once: on many random float32 values it
    equals the correctly rounded float32 root (checked against integer arithmetic:
    sigma^2 <= a < (sigma + ulp/2)^2 rounded to nearest)."""
    from kvwrite.ops.fused_qk_norm_rope import reference as ref
    gen = torch.Generator().manual_seed(5)
    a = torch.rand(100_000, generator=gen) * torch.exp2(torch.randint(-60, 60, (100_000,),
                                                                       generator=gen).float())
    x = torch.sqrt(a.double()).float()  # what the reference computes
    lo, hi = torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, x * 2)
    # x is the nearest float32 to sqrt(a): its neighbours' midpoints bracket the root.
    mid_lo = (lo.double() + x.double()) / 2
    mid_hi = (hi.double() + x.double()) / 2
    assert bool(((mid_lo**2 <= a.double()) & (a.double() <= mid_hi**2)).all())
    assert ref.sum_of_squares(torch.tensor([[1.0, 2.0, 3.0]])).item() == 14.0


# --- every implementation against the reference --------------------------------------------------

def _skip_unless_runs(op: str, impl: str, inp: QkNormInputs, device) -> None:
    info = registry.get(op, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    if op == NORM:
        view, *_ = norm_pkg.op.validate(*inp.norm_args(), weight_offset=inp.weight_offset)
        reason = info.unsupported(view, inp.q_weight, inp.k_weight, inp.cos_sin_cache,
                                  inp.is_neox)
    else:
        view, _, _, cache_dtype, qo, _ = fused_pkg.op.validate(*inp.fused_args(),
                                                               **inp.fused_kwargs())
        reason = info.unsupported(view, inp.q_weight, inp.k_weight, inp.cos_sin_cache,
                                  inp.is_neox, inp.key_cache, cache_dtype, qo)
    if reason is not None:
        pytest.skip(reason)


def _run_norm(impl: str, case: QkNormCase, device) -> QkNormInputs:
    inp = make_qk_norm_inputs(case, device)
    _skip_unless_runs(NORM, impl, inp, device)
    want = clone_inputs(inp)
    kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(), implementation=impl)
    kvwrite.fused_qk_norm_rope(*want.norm_args(), **want.norm_kwargs(), implementation="torch")
    assert_same(inp, want, _nan_equal(case), _norm_names(inp))
    return inp


def _run_fused(impl: str, case: QkNormCase, device) -> QkNormInputs:
    inp = make_qk_norm_inputs(case, device)
    _skip_unless_runs(FUSED, impl, inp, device)
    want = clone_inputs(inp)
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation=impl)
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*want.fused_args(), **want.fused_kwargs(),
                                                       implementation="torch")
    assert_same(inp, want, _nan_equal(case))
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(NORM) if i.name != "torch"])
@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.id)
def test_norm_matches_reference(impl, case, device):
    _run_norm(impl, case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED) if i.name != "torch"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_fused_matches_reference(impl, case, device):
    _run_fused(impl, case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("op, case", [(NORM, c) for c in NORM_CASES] +
                         [(FUSED, c) for c in FUSED_CASES],
                         ids=[f"norm-{c.id}" for c in NORM_CASES] +
                             [f"fused-{c.id}" for c in FUSED_CASES])
def test_gpu_reference_matches_the_oracle(op, case):
    """The torch reference on the GPU writes the oracle's bytes (so the GPU matrix below, whose
    cases are compared with it, is compared with the oracle too)."""
    inp = make_qk_norm_inputs(case, "cuda")
    if op == NORM:
        kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(), implementation="torch")
        assert_same(inp, _expected_norm(case), _nan_equal(case), _norm_names(inp))
    else:
        kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(),
                                                           **inp.fused_kwargs(),
                                                           implementation="torch")
        assert_same(inp, _expected_fused(case), _nan_equal(case))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("case", GPU_NORM_CASES, ids=lambda c: c.id)
def test_gpu_norm_matrix(impl, case):
    _run_norm(impl, case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("case", GPU_FUSED_CASES, ids=lambda c: c.id)
def test_gpu_fused_matrix(impl, case):
    _run_fused(impl, case, "cuda")


_GPU_SAMPLE = ([(NORM, c) for c in GPU_NORM_CASES if c.num_tokens < 1000][::3]
               + [(FUSED, c) for c in GPU_FUSED_CASES if c.num_tokens < 1000][::3])


@pytest.mark.gpu
@pytest.mark.parametrize("op, case", _GPU_SAMPLE, ids=[f"{o}-{c.id}" for o, c in _GPU_SAMPLE])
def test_gpu_reference_matches_the_cpu_reference(op, case):
    """The reference gives the same bytes on the GPU as on the CPU (where the oracle checks it)."""
    gpu, cpu = make_qk_norm_inputs(case, "cuda"), make_qk_norm_inputs(case, "cpu")
    fused = op == FUSED
    for inp in (gpu, cpu):
        if fused:
            kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
                *inp.fused_args(), **inp.fused_kwargs(), implementation="torch")
        else:
            kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(),
                                       implementation="torch")
    assert_same(gpu, cpu, _nan_equal(case), None if fused else _norm_names(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("op", [NORM, FUSED])
@pytest.mark.parametrize("case", [QkNormCase(num_tokens=40, num_q_heads=32, num_k_heads=8,
                                             head_size=128, dtype=torch.bfloat16,
                                             kv_cache_dtype="fp8", query_out="fp8_e4m3",
                                             bad_positions=2, padding_slots=2, num_blocks=4),
                                  QkNormCase(num_tokens=9, head_size=46, rot_dim=18,
                                             num_q_heads=5, num_k_heads=3, row_pad=1,
                                             dtype=torch.float32, q_weight=torch.bfloat16,
                                             weight_offset=1.0, is_neox=False,
                                             layout=Layout.HND, alloc=KVAlloc.PACKED),
                                  QkNormCase(num_tokens=5, head_size=512, num_q_heads=4,
                                             num_k_heads=2, kv_cache_dtype="fp8_e5m2",
                                             per_head_scale=True, dtype=torch.bfloat16),
                                  QkNormCase(num_tokens=9, head_size=80, head_pad=64,
                                             num_q_heads=4, num_k_heads=2,
                                             dtype=torch.bfloat16, kv_cache_dtype="fp8",
                                             bad_positions=1)],
                         ids=lambda c: c.id)
def test_gpu_cuda_generic_builds_match_reference(monkeypatch, record_builds, op, case):
    """KVWRITE_CUDA_SPECIALIZE=0 (CudaTuning.specialize=False): the kernels with their fixed
    arguments read at run time (D not known: the division by D instead of the multiplication)
    write the reference's bytes too."""
    if op == NORM:
        from kvwrite.ops.fused_qk_norm_rope import cuda_impl
    else:
        from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl
    monkeypatch.setattr(cuda_impl, "TUNING", cuda_impl.CudaTuning(specialize=False))
    monkeypatch.setattr(cuda_impl, "LAUNCHES", {})
    monkeypatch.setattr(cuda_impl.run, "__kwdefaults__", {"tuning": cuda_impl.TUNING})
    seen = record_builds(cuda_impl.SOURCE)
    (_run_norm if op == NORM else _run_fused)("cuda", case, "cuda")
    assert seen and all(f is None for f in seen), seen


# --- padded heads: the same bytes as dense heads -------------------------------------------------

def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (a copy through them is bit-exact, NaNs
    included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _call(op: str, inp: QkNormInputs, impl: str) -> None:
    if op == NORM:
        kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(), implementation=impl)
    else:
        kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(),
                                                           **inp.fused_kwargs(),
                                                           implementation=impl)


def _run_padded_as_dense(op: str, impl: str, case: QkNormCase, device) -> None:
    """``impl`` on padded heads writes, into the heads, query_out and the caches, exactly what it
    writes on a dense copy of the same heads, and leaves every other byte of qkv's allocation
    (the padding between heads included) as it was."""
    assert case.head_pad and not case.flat
    inp = make_qk_norm_inputs(case, device)
    assert inp.qkv.stride(1) == case.head_size + case.head_pad
    _skip_unless_runs(op, impl, inp, device)
    dense = clone_inputs(inp)
    dense.qkv = inp.qkv.contiguous()  # a new allocation: [T_pad, H, D], dense heads
    if inp.query_out is not None:
        dense.query_out = inp.query_out.clone()  # apart from qkv even where inp's lies in it
    assert dense.qkv.stride(1) == case.head_size
    want = clone_inputs(inp)
    _call(op, inp, impl)
    _call(op, dense, impl)
    _ints(want.qkv).copy_(_ints(dense.qkv))
    if want.query_out is not None:
        _ints(want.query_out).copy_(_ints(dense.query_out))
    if op == FUSED:
        for name in ("key_cache", "value_cache"):
            storage_bytes(getattr(want, name)).copy_(storage_bytes(getattr(dense, name)))
    assert_same(inp, want, _nan_equal(case), None if op == FUSED else _norm_names(inp))


_PADDED = ([(NORM, c) for c in NORM_CASES if c.head_pad]
           + [(FUSED, c) for c in FUSED_CASES if c.head_pad])
_GPU_PADDED = ([(NORM, c) for c in GPU_NORM_CASES if c.head_pad]
               + [(FUSED, c) for c in GPU_FUSED_CASES if c.head_pad])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("op, case", _PADDED, ids=[f"{o}-{c.id}" for o, c in _PADDED])
def test_padded_heads_give_the_bytes_of_dense_heads(op, case, impl, device):
    _run_padded_as_dense(op, impl, case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton", "cuda", "cuda-large"])
@pytest.mark.parametrize("op, case", _GPU_PADDED, ids=[f"{o}-{c.id}" for o, c in _GPU_PADDED])
def test_gpu_padded_heads_give_the_bytes_of_dense_heads(monkeypatch, op, case, impl):
    """The GPU's padded cases (model shapes, 16-byte alignment broken, large calls) for every
    implementation; cuda-large: every call through the cuda large-call build (two chunks per
    lane where the head stride keeps 16-byte alignment, the one-chunk plan where it breaks it)."""
    if impl == "cuda-large":
        if op == NORM:
            from kvwrite.ops.fused_qk_norm_rope import cuda_impl
        else:
            from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl
        _force(monkeypatch, cuda_impl, large_call_bytes=0)
        impl = "cuda"
    _run_padded_as_dense(op, impl, case, "cuda")


def test_padded_heads_are_refused_where_they_are_not_heads():
    """A 3-D qkv needs a unit-stride head_dim (any head stride); heads that share memory are
    refused where qkv is written; the 2-D form keeps dense heads (its width is the heads'). The
    messages name qkv, and nothing changes."""
    inp = make_qk_norm_inputs(dataclasses.replace(VCASE, head_pad=16))
    before = _snapshot(inp)
    norm = dict(zip(NORM_NAMES, inp.norm_args(), strict=True))
    fused = {**dict(zip(FUSED_NAMES, inp.fused_args(), strict=True)), **inp.fused_kwargs()}
    wide = inp.qkv.as_strided((5, 8, 32), inp.qkv.stride()[:2] + (1,))
    bad = [
        ({"qkv": wide[..., ::2]}, "qkv: expected a unit stride in dim 2 (head_dim), got strides "
                                  "(256, 32, 2)"),
        ({"qkv": inp.qkv.as_strided((5, 8, 16), (256, 8, 1))},
         "qkv: expected every element in its own memory"),
        ({"qkv": wide.flatten(1)}, "qkv: expected [num_tokens, (num_heads_q + "),
    ]
    for change, text in bad:
        for fn, args in ((kvwrite.fused_qk_norm_rope, norm),
                         (kvwrite.fused_qk_norm_rope_and_reshape_cache_flash, fused)):
            with pytest.raises(ValueError) as e:
                fn(**{**args, **change})
            assert text in str(e.value), str(e.value)
    _assert_unchanged(inp, before)
    # The fused op's cache arguments are still named against padded heads.
    with pytest.raises(ValueError, match=r"key_cache: expected \[num_blocks, block_size, 2, 16\]"):
        kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
            **{**fused, "key_cache": inp.key_cache[..., :8],
               "value_cache": inp.value_cache[..., :8]})
    _assert_unchanged(inp, before)


def _force(monkeypatch, cuda_impl, **tuning) -> None:
    """Every cuda call of the test through ``cuda_impl`` with these CudaTuning fields."""
    monkeypatch.setattr(cuda_impl, "TUNING", dataclasses.replace(cuda_impl.TUNING, **tuning))
    monkeypatch.setattr(cuda_impl.run, "__kwdefaults__", {"tuning": cuda_impl.TUNING})


_LARGE_GPU = ([(NORM, c) for c in NORM_CASES + GPU_NORM_CASES[::2] if c.num_tokens < 1000] +
              [(FUSED, c) for c in FUSED_CASES + GPU_FUSED_CASES[::2] if c.num_tokens < 1000])


@pytest.mark.gpu
@pytest.mark.parametrize("op, case", _LARGE_GPU, ids=[f"{o}-{c.id}" for o, c in _LARGE_GPU])
def test_gpu_cuda_large_call_build_matches_reference(monkeypatch, op, case):
    """The large-call build forced (large_call_bytes=0) on every case of the CPU matrices and on
    half of the GPU ones: the interleaved layouts (two chunks per lane, neox partners in the
    lane), 64-thread CTAs, the register bound with the row and weights converted again, the
    value first: qkv, query_out and both caches, whole allocations, as the reference writes
    them."""
    if op == NORM:
        from kvwrite.ops.fused_qk_norm_rope import cuda_impl
    else:
        from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl
    _force(monkeypatch, cuda_impl, large_call_bytes=0)
    (_run_norm if op == NORM else _run_fused)("cuda", case, "cuda")


_TUNING_CASES = [
    QkNormCase(num_tokens=37, num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
               kv_cache_dtype="fp8", alloc=KVAlloc.PACKED, padding_slots=3, bad_positions=2,
               per_head_scale=True),
    QkNormCase(num_tokens=37, num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
               layout=Layout.HND, query_out="fp8_e4m3", rotate_key_in_place=False),
    QkNormCase(num_tokens=21, num_q_heads=16, num_k_heads=8, head_size=256, dtype=torch.bfloat16,
               weight_offset=1.0, is_neox=False, kv_cache_dtype="fp8_e5m2"),
    QkNormCase(num_tokens=21, num_q_heads=8, num_k_heads=2, head_size=64, dtype=torch.float16,
               alloc=KVAlloc.INTERLEAVED, special="nan"),
    QkNormCase(num_tokens=13, num_q_heads=4, num_k_heads=2, head_size=512, dtype=torch.float32,
               kv_cache_dtype="bfloat16", q_weight=torch.float32, k_weight=torch.bfloat16),
]
_TUNINGS = [dict(large_call_cta_threads=128), dict(large_call_cta_threads=32),
            dict(large_call_chunks=1), dict(large_call_chunks=4), dict(large_call_min_blocks=1),
            dict(large_call_pdl_trigger=True), dict(large_call_value_first=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", _TUNINGS, ids=lambda t: "-".join(f"{k}={v}" for k, v in
                                                                    t.items()))
@pytest.mark.parametrize("op", [NORM, FUSED])
def test_gpu_cuda_large_call_tunings_match_reference(monkeypatch, op, tuning):
    """The large-call build under each setting the benchmark may compare (other CTA widths,
    chunks per lane, no register bound, the early PDL trigger, the value after the table), on
    the models' shapes and a few odd ones: the reference's bytes."""
    if op == NORM:
        from kvwrite.ops.fused_qk_norm_rope import cuda_impl
        tuning = {k: v for k, v in tuning.items() if k != "large_call_value_first"}
    else:
        from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl
    _force(monkeypatch, cuda_impl, large_call_bytes=0, **tuning)
    for case in _TUNING_CASES:
        (_run_norm if op == NORM else _run_fused)("cuda", case, "cuda")


# --- fused == the norm op, then the cache write --------------------------------------------------

SEQUENCE_CASES = [
    QkNormCase(num_tokens=9, dtype=torch.float32, kv_cache_dtype="fp8", per_head_scale=True),
    QkNormCase(num_tokens=9, kv_cache_dtype="fp8_e5m2", layout=Layout.HND, alloc=KVAlloc.PACKED,
               padding_slots=2, out_of_range_slots=1, weight_offset=1.0, is_neox=False,
               rot_dim=32),
    QkNormCase(num_tokens=9, cache_tokens=5, kv_cache_dtype="float32", q_weight=None,
               alloc=KVAlloc.INTERLEAVED),
    QkNormCase(num_tokens=7, kv_cache_dtype="auto", flat=True, row_pad=4),
    QkNormCase(num_tokens=7, kv_cache_dtype="fp8", dtype=torch.bfloat16,
               cos_sin_dtype=torch.bfloat16),
]
GPU_SEQUENCE_CASES = [
    QkNormCase(num_tokens=33, num_q_heads=32, num_k_heads=8, head_size=128,
               dtype=torch.bfloat16 if layout is Layout.NHD else torch.float16,
               kv_cache_dtype=kv, layout=layout, alloc=KVAlloc.INTERLEAVED, num_blocks=4,
               padding_slots=2, per_head_scale=kv == "fp8")
    for kv in ("auto", "fp8", "fp8_e5m2", "float32") for layout in Layout]


def _sequence(inp: QkNormInputs, impl: str) -> None:
    kvwrite.fused_qk_norm_rope(*inp.norm_args(), **inp.norm_kwargs(), implementation=impl)
    v = inp.heads()
    hq, hk = inp.num_heads_q, inp.num_heads_k
    kvwrite.reshape_and_cache_flash(v[:, hq:hq + hk], v[:, hq + hk:], inp.key_cache,
                                    inp.value_cache, inp.slot_mapping, inp.kv_cache_dtype,
                                    inp.k_scale, inp.v_scale, implementation=impl)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED)])
@pytest.mark.parametrize("case", SEQUENCE_CASES + [
    pytest.param(c, marks=pytest.mark.gpu) for c in GPU_SEQUENCE_CASES], ids=lambda c: c.id)
def test_fused_equals_the_unfused_sequence(impl, case, device):
    """With every position in the table, the fused op has the effect of fused_qk_norm_rope
    followed by reshape_and_cache_flash (the same implementation), byte for byte."""
    if device == "cpu" and case in GPU_SEQUENCE_CASES:
        pytest.skip("a GPU case")
    inp = make_qk_norm_inputs(case, device)
    _skip_unless_runs(FUSED, impl, inp, device)
    pair = clone_inputs(inp)
    try:
        _sequence(pair, impl if impl != "triton" or device != "cpu" else "torch")
    except ValueError as e:
        pytest.skip(str(e))
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation=impl)
    assert_same(inp, pair)


# --- T == 0 and T_rot == 0 ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(FUSED)])
def test_zero_cache_tokens_normalizes_and_leaves_the_caches(impl, device):
    case = QkNormCase(num_tokens=6, cache_tokens=0, kv_cache_dtype="auto")
    inp = _run_fused(impl, case, device)
    fresh = make_qk_norm_inputs(case, device)
    assert_same(inp, fresh, names=("key_cache", "value_cache", "slot_mapping"))
    with pytest.raises(AssertionError):
        assert_same(inp, fresh, names=("qkv",))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [NORM, FUSED])
@pytest.mark.parametrize("impl", ["torch", "triton", "cuda"])
def test_zero_tokens_changes_nothing(op, impl, device):
    case = QkNormCase(num_tokens=0, extra_rows=3)
    inp = make_qk_norm_inputs(case, device)
    _skip_unless_runs(op, impl, inp, device)
    if op == NORM:
        kvwrite.fused_qk_norm_rope(*inp.norm_args(), implementation=impl)
    else:
        kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(),
                                                           implementation=impl)
    assert_same(inp, make_qk_norm_inputs(case, device))


# --- the checker can fail (the wrong writers: tests/test_conformance.py) ---------------------------

@pytest.mark.parametrize("kwargs, case", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_wrong_arithmetic_variants_are_the_reference_without_their_change(kwargs, case):
    """The variants the conformance suite catches (kvwrite.testing.providers.fused_qk_norm_rope)
    differ from the reference only by their change: without it they give the oracle's bytes."""
    right = make_qk_norm_inputs(case)
    variant(right)
    assert_same(right, _expected_norm(case), names=("qkv",))


# --- validation specifics (bad input: tests/test_conformance.py) -----------------------------------

def _spare_query_out(a):
    """qkv and query_out as disjoint parts of one allocation: accepted."""
    buf = torch.zeros(5, (4 + 2 + 2) * 16 + 4 * 16, dtype=torch.float16)
    buf[:, :128].copy_(a["qkv"].flatten(1))
    return {"qkv": buf[:, :128], "query_out": buf[:, 128:]}


def _snapshot(inp: QkNormInputs) -> dict:
    return {n: t.clone() for n, t in inp.tensors().items()}


def _assert_unchanged(inp: QkNormInputs, before: dict) -> None:
    for n, t in inp.tensors().items():
        assert torch.equal(t.contiguous().view(torch.uint8), before[n].contiguous().view(
            torch.uint8)), n


def test_accepted_edge_arguments():
    """What the contract allows: an int eps, eps = 0, a 0-dim q_scale, no q_scale with a
    query_out of qkv's dtype (any q_scale then ignored), any forced_token_heads_per_warp,
    weights of another dtype than qkv, and query_out in a spare region of qkv's own allocation."""
    inp = make_qk_norm_inputs(VCASE)
    args = {**dict(zip(FUSED_NAMES, inp.fused_args(), strict=True)), **inp.fused_kwargs()}
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(**{**args, "eps": 0,
                                                          "q_scale": torch.tensor(0.5)})
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
        **{**args, "query_out": torch.zeros(5, 64, dtype=torch.float16), "q_scale": "ignored",
           "q_weight": torch.ones(16, dtype=torch.bfloat16), "weight_offset": 1})
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(**{**args, **_spare_query_out(args),
                                                          "q_scale": None})
    norm = dict(zip(NORM_NAMES, inp.norm_args(), strict=True))
    kvwrite.fused_qk_norm_rope(**norm, forced_token_heads_per_warp=7)
    kvwrite.fused_qk_norm_rope(**{**norm, "eps": 10**400 // 10**399, "q_weight": None})


def test_float32_scalars_round_to_nearest():
    from kvwrite.ops.fused_qk_norm_rope.op import float32_bits, float32_value
    assert float32_value(1e-6) == float(np.float32(1e-6))
    assert float32_value(1e39) == float("inf")
    assert float32_bits(1.0) == 0x3F800000
    assert float32_bits(-0.0) == 0x80000000
    assert float32_bits(1 + 2**-24) == 0x3F800000  # a tie: to even
    assert float32_bits(1 + 3 * 2**-24) == 0x3F800002


# --- the fused RoPE op accepts a query_out in a spare region of its own allocation --------------

def test_fused_rope_accepts_query_out_in_a_spare_region_of_qkv():
    """fused_rope_and_reshape_cache_flash judges query_out's overlap with query element by
    element: a query_out that is a disjoint slice of the fused qkv buffer (past the value heads)
    is accepted and receives the rotated query; one that overlaps query is refused. (Before,
    any query_out in query's allocation was refused.)"""
    from kvwrite.testing.rope import RopeCase, make_rope_inputs
    case = RopeCase(num_tokens=9, num_q_heads=4, num_heads=2, head_size=32, dtype=torch.float16,
                    fused_qkv=True)
    inp = make_rope_inputs(case)
    want = make_rope_inputs(case)
    hq, h, d = 4, 2, 32
    buf = torch.zeros(9, hq + 2 * h + hq, d, dtype=torch.float16)
    q, k, v, qo = buf[:, :hq], buf[:, hq:hq + h], buf[:, hq + h:hq + 2 * h], buf[:, hq + 2 * h:]
    for dst, src in ((q, inp.query), (k, inp.key), (v, inp.value)):
        dst.copy_(src)
    kvwrite.fused_rope_and_reshape_cache_flash(q, k, v, inp.positions, inp.cos_sin_cache, True,
                                               inp.key_cache, inp.value_cache, inp.slot_mapping,
                                               None, None, "auto", query_out=qo,
                                               implementation="torch")
    want_qo = torch.zeros(9, hq, d, dtype=torch.float16)
    kvwrite.fused_rope_and_reshape_cache_flash(want.query, want.key, want.value, want.positions,
                                               want.cos_sin_cache, True, want.key_cache,
                                               want.value_cache, want.slot_mapping, None, None,
                                               "auto", query_out=want_qo, implementation="torch")
    assert torch.equal(qo.view(torch.int16), want_qo.view(torch.int16))
    assert torch.equal(q.view(torch.int16), want.query.view(torch.int16))
    assert torch.equal(k.view(torch.int16), want.key.view(torch.int16))
    with pytest.raises(ValueError, match="query: expected memory apart from query_out's"):
        kvwrite.fused_rope_and_reshape_cache_flash(q, k, v, inp.positions, inp.cos_sin_cache,
                                                   True, inp.key_cache, inp.value_cache,
                                                   inp.slot_mapping, None, None, "auto",
                                                   query_out=buf[:, :hq])


# --- the matrices cover the contract -------------------------------------------------------------

def test_matrices_cover_the_contract():
    cpu = NORM_CASES + FUSED_CASES
    gpu = GPU_NORM_CASES + GPU_FUSED_CASES
    for cases in (cpu, gpu):
        assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16, torch.float32}
        assert {c.is_neox for c in cases} == {True, False}
        assert any(c.rot < c.head_size for c in cases)
        assert {c.special for c in cases} >= {"zeros", "nan", "inf", "huge", "tiny"}
        assert any(c.eps == 0 for c in cases)
        assert {c.weight_offset for c in cases} == {0.0, 1.0}
        assert any(c.q_weight is None or c.k_weight is None for c in cases)
        assert any(c.weight_dtype("q") not in (None, c.dtype) for c in cases)
        assert any(c.bad_positions for c in cases)
        assert any(c.pos_dtype == torch.int32 for c in cases)
        assert any(c.flat for c in cases) and any(c.row_pad for c in cases)
        # Padded heads: vLLM's D = 128 in rows of 192 and D = 80 in rows of 144, a head stride
        # that breaks 16-byte alignment, partial rotary.
        padded = {(c.head_size, c.head_size + c.head_pad) for c in cases if c.head_pad}
        assert {(128, 192), (80, 144)} <= padded
        assert any(c.head_pad and (c.head_size + c.head_pad) * c.dtype.itemsize % 16
                   for c in cases)
        assert any(c.head_pad and c.rot < c.head_size for c in cases)
        assert any(c.num_q_heads == c.num_k_heads for c in cases)
        assert any(c.num_q_heads != c.num_k_heads for c in cases)
    assert {c.head_size for c in gpu} >= {64, 80, 128, 256, 512}
    assert {c.head_size for c in cpu} >= {6, 46, 64, 80, 128, 256, 512}
    assert (32, 8, 128) in {(c.num_q_heads, c.num_k_heads, c.head_size) for c in gpu}
    for fused in (FUSED_CASES, GPU_FUSED_CASES):
        assert {(c.layout, c.alloc) for c in fused} == {(lo, a) for lo in Layout for a in KVAlloc}
        assert {c.kv_cache_dtype for c in fused} >= {"auto", "float16", "bfloat16", "float32",
                                                     "fp8", "fp8_e5m2"}
        assert any(c.per_head_scale for c in fused)
        assert {c.fp8_storage for c in fused if c.cache_dtype.is_fp8} == {"uint8", "float8"}
        assert {c.query_out for c in fused} >= {None, "same", "spare", "fp8_e4m3", "fp8_e5m2"}
        assert any(c.q_scale_per_head for c in fused)
        assert any(not c.rotate_key_in_place for c in fused)
        assert any(c.padding_slots and c.out_of_range_slots for c in fused)
        assert any(c.num_cache_tokens < c.num_tokens for c in fused)
        assert any(c.num_cache_tokens == 0 < c.num_tokens for c in fused)
        assert any(c.slot_dtype == torch.int32 for c in fused)
    assert any(c.num_tokens == 0 for c in cpu)


def test_oracle_sees_what_the_specials_plant():
    """The special cases do what they say (the oracle's results): zero heads stay ±0 with eps >
    0 and become NaN with eps = 0; a head whose sum of squares overflows becomes ±0."""
    zeros = expected_norm(QkNormCase(special="zeros", num_tokens=5)).heads()
    nans = expected_norm(QkNormCase(special="zeros", eps=0, num_tokens=5,
                                    dtype=torch.float32)).heads()
    huge = expected_norm(QkNormCase(special="huge", num_tokens=5, dtype=torch.float32)).heads()
    assert bool((zeros[0, 0].float() == 0).all())
    assert bool(nans[0, 0].isnan().all())
    assert bool((huge[0, 0].float() == 0).all())


# --- registry, implementations ------------------------------------------------------------------

def test_implementations_are_registered_and_exported():
    for op in (NORM, FUSED):
        assert [i.name for i in registry.all_impls(op)] == ["cuda", "triton", "torch"]
    assert kvwrite.fused_qk_norm_rope is norm_pkg.fused_qk_norm_rope
    assert (kvwrite.fused_qk_norm_rope_and_reshape_cache_flash
            is fused_pkg.fused_qk_norm_rope_and_reshape_cache_flash)


def test_without_triton_the_triton_implementations_say_so():
    """Where triton cannot be imported, both ops' triton modules still import and their
    `available` says what to install."""
    import subprocess
    import sys
    script = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
              "import kvwrite\n"
              "for s in kvwrite.implementations('cuda'):\n"
              "    if s.name == 'triton' and 'qk_norm' in s.op: print(s.op, '|', s.reason)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, lines
    assert all("triton is not installed (pip install triton)" in ln for ln in lines), lines


def test_cuda_unavailable_on_cpu_says_why():
    inp = make_qk_norm_inputs(QkNormCase(num_tokens=3))
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call"):
        kvwrite.fused_qk_norm_rope(*inp.norm_args(), implementation="cuda")


# --- CUDA: the lane layout, NVRTC compiles, the machine code ------------------------------------

def _cuda_modules():
    pytest.importorskip("cuda.core")
    from kvwrite.ops.fused_qk_norm_rope import cuda_impl as norm_cuda
    from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl as fused_cuda
    return norm_cuda, fused_cuda


def _build(which: str, names: tuple[str, ...], macros: tuple = ()):
    """(object code, NVRTC log with ptxas's report) of ``names`` built from which's source for
    sm_90: once per test session (the compile, SASS and scheduling tests share the builds)."""
    return _build_once(which, tuple(names), tuple(macros))


@functools.cache
def _build_once(which: str, names: tuple[str, ...], macros: tuple):
    norm_cuda, fused_cuda = _cuda_modules()
    mod = norm_cuda if which == "norm" else fused_cuda
    return mod.SOURCE.compile("sm_90", list(names), macros=macros, ptxas_verbose=True)


def _build_sass(which: str, names: tuple[str, ...], tmp_path, macros: tuple = ()) -> str:
    """The SASS listing of :func:`_build`'s build (once per test session)."""
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    return _dump(which, tuple(names), tuple(macros))


@functools.cache
def _dump(which: str, names: tuple[str, ...], macros: tuple) -> str:
    import pathlib
    import tempfile
    obj, _ = _build(which, names, macros)
    with tempfile.TemporaryDirectory() as tmp:
        return sass_tools.dump_sass(bytes(obj.code), pathlib.Path(tmp))


def _all_names(which: str) -> tuple[str, ...]:
    norm_cuda, fused_cuda = _cuda_modules()
    return tuple((norm_cuda if which == "norm" else fused_cuda).all_kernel_names())


def test_cuda_lane_layout():
    from kvwrite.ops.fused_qk_norm_rope.cuda_impl import lane_layout
    # (D, element size) -> (elements per lane, lanes per head)
    assert lane_layout(128, 2) == (8, 16)     # Qwen3 bfloat16: a 16-byte chunk per lane
    assert lane_layout(128, 4) == (4, 32)
    assert lane_layout(64, 2) == (8, 8)
    assert lane_layout(80, 2) == (8, 16)      # padded to 128
    assert lane_layout(256, 2) == (8, 32)
    assert lane_layout(512, 2) == (16, 32)    # one warp per head, 32 bytes per lane
    assert lane_layout(512, 4) == (16, 32)
    assert lane_layout(46, 2) == (8, 8)
    assert lane_layout(6, 4) == (4, 2)
    assert lane_layout(2, 2) == (2, 1)


def test_cuda_widths_follow_alignment():
    from kvwrite.ops.fused_qk_norm_rope.cuda_impl import table_width, vector_width
    rows = ((4096, 2, (5120,)),)
    assert vector_width(128, 8, rows, 2) == 8
    assert vector_width(128, 8, ((4098, 2, (5120,)),), 2) == 1   # a 2-byte aligned pointer
    assert vector_width(128, 8, ((4096, 2, (5122,)),), 2) == 2   # an even token stride
    assert vector_width(46, 8, rows, 2) == 2                     # 46 = 2 * 23
    assert vector_width(80, 8, rows + ((4096, 4, (16, 128)),), 2) == 8  # float32 caches
    table = torch.zeros(8, 128)
    assert table_width(8, 128, True, table) == 4
    assert table_width(8, 128, False, table) == 4
    assert table_width(8, 36, True, table[:, :36].contiguous()) == 2     # rot/2 = 18
    assert table_width(8, 2, True, table[:, :2].contiguous()) == 1
    assert table_width(8, 128, True, torch.zeros(8, 128, dtype=torch.bfloat16)) == 8


def test_cuda_lane_plans():
    """kvw/qk_norm.cuh's layouts as the launchers choose them (E, L, SEG, V, VW, VT, PS): one
    16-byte chunk per lane for small calls; two for large calls, interleaved across the group's
    lanes (segments of V elements, L * V apart) where the neox partner is then the lane's own
    chunk PS segments on (or the pairs are GPT-J's), else the one-chunk consecutive layout."""
    from kvwrite.ops.fused_qk_norm_rope.cuda_impl import Plan, layout_plan, plan
    bf, f32 = 2, 4
    assert layout_plan(128, bf, 128, True) == Plan(8, 16, 8, 8, 8, 4, 0)
    assert layout_plan(128, bf, 128, True, 2) == Plan(16, 8, 8, 8, 8, 4, 1)
    assert layout_plan(128, bf, 128, False, 2) == Plan(16, 8, 8, 8, 8, 4, 0)
    assert layout_plan(256, bf, 256, True, 2) == Plan(16, 16, 8, 8, 8, 4, 1)
    assert layout_plan(64, bf, 64, True, 2) == Plan(16, 4, 8, 8, 8, 4, 1)
    assert layout_plan(128, f32, 128, True, 2) == Plan(8, 16, 4, 4, 4, 4, 1)
    assert layout_plan(512, f32, 512, True, 2) == Plan(16, 32, 4, 4, 4, 4, 2)
    # D = 512 of 16-bit rows holds two chunks per lane in small calls too: interleaved.
    assert layout_plan(512, bf, 512, True) == Plan(16, 32, 8, 8, 8, 4, 1)
    # Partners across lanes (rot/2 not a multiple of L * V): consecutive, one chunk.
    assert layout_plan(128, bf, 64, True, 2) == Plan(8, 16, 8, 8, 8, 4, 0)
    assert layout_plan(80, bf, 80, True, 2) == Plan(8, 16, 8, 8, 8, 4, 0)
    assert layout_plan(512, bf, 256, True) == Plan(16, 32, 16, 8, 8, 4, 0)
    table = torch.zeros(16, 128)
    qkv = torch.zeros(4, 48, 128, dtype=torch.bfloat16)
    assert plan(qkv, None, None, table, True, chunks=2) == Plan(16, 8, 8, 8, 8, 4, 1)
    w = torch.zeros(128, dtype=torch.float32)
    assert plan(qkv, w, w, table, True, chunks=2) == Plan(16, 8, 8, 8, 4, 4, 1)
    # Rows aligned to 2 bytes only: the one-chunk plan of 1-element chunks.
    odd = torch.zeros(4 * 48 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 48, 128)
    assert plan(odd, None, None, table, True, chunks=2) == Plan(8, 16, 8, 1, 8, 4, 0)
    # Padded heads: the head stride counts for the chunks' alignment as the token stride does.
    # D = 128 in rows of 192 keeps the dense plans; a head stride of 132 elements (264 bytes,
    # 8-byte aligned) narrows the chunks to 4 elements (and large calls to the one-chunk plan),
    # 129 to single elements.
    def padded(hs):
        return torch.zeros(4, 48 * hs, dtype=torch.bfloat16).view(4, 48, hs)[..., :128]

    for chunks in (1, 2):
        assert plan(padded(192), None, None, table, True, chunks=chunks) == plan(
            qkv, None, None, table, True, chunks=chunks)
    assert plan(padded(132), None, None, table, True) == Plan(8, 16, 8, 4, 8, 4, 0)
    assert plan(padded(132), None, None, table, True, chunks=2) == Plan(8, 16, 8, 4, 8, 4, 0)
    assert plan(padded(129), None, None, table, True, chunks=2) == Plan(8, 16, 8, 1, 8, 4, 0)


@pytest.mark.parametrize("which", ["norm", "fused"])
def test_cuda_padded_heads_take_the_dense_variant_with_their_head_stride(which):
    """A call on padded heads whose head stride keeps the chunks aligned (D = 128 in rows of 192)
    takes the variant of the dense call (same template arguments: widths, lane layout) with its
    own token and head strides compiled in (fixed arguments 0 and 1: a dense call's head stride
    is D); one that breaks 16-byte alignment (rows of 132) takes narrower chunks."""
    base = QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
                      kv_cache_dtype="fp8")
    for build in ("small", "large"):
        name, fixed = _specialized_build(which, base, build)
        assert fixed[:2] == (48 * 128, 128)
        pname, pfixed = _specialized_build(which, dataclasses.replace(base, head_pad=64), build)
        assert pname == name and pfixed[:2] == (48 * 192, 192) and pfixed[2:] == fixed[2:]
        nname, nfixed = _specialized_build(which, dataclasses.replace(base, head_pad=4), build)
        assert _template_args(which, nname)["V"] == "4" and nfixed[:2] == (48 * 132, 132)


def test_cuda_call_builds():
    """Which build a call takes: the large-call build from large_call_bytes of the rows the
    kernel moves (the norm op: query and key; the fused op: query, key and value), with the fp8
    bound for fp8 caches or queries; the register bound only for specialized interleaved builds
    with lean weights."""
    norm_cuda, fused_cuda = _cuda_modules()
    from kvwrite.ops.fused_qk_norm_rope.cuda_impl import SMALL, Build, Plan, bounded
    t = norm_cuda.TUNING
    assert norm_cuda.call_build(t.large_call_bytes - 1) == SMALL
    large = norm_cuda.call_build(t.large_call_bytes)
    assert large == Build(t.large_call_chunks, t.large_call_cta_threads,
                          t.large_call_min_blocks, t.large_call_pdl_trigger)
    assert (large.chunks, large.cta, large.trigger) == (2, 64, False)
    ft = fused_cuda.TUNING
    assert fused_cuda.call_build(ft.large_call_bytes - 1, True) == (SMALL, False)
    b, vf = fused_cuda.call_build(ft.large_call_bytes, True)
    assert vf and b.min_blocks == ft.large_call_min_blocks_fp8
    assert fused_cuda.call_build(ft.large_call_bytes, False)[0].min_blocks == \
        ft.large_call_min_blocks
    ilv, consecutive = Plan(16, 8, 8, 8, 8, 4, 1), Plan(8, 16, 8, 8, 8, 4, 0)
    bf = torch.zeros(128, dtype=torch.bfloat16)
    assert bounded(large, ilv, True, bf, bf, 2) == large
    assert bounded(large, ilv, True, None, bf, 2) == large
    assert bounded(large, ilv, True, bf.float(), bf.float(), 4) == large
    for p, spec, w in ((ilv, False, bf), (consecutive, True, bf), (ilv, True, bf.float()),
                       (ilv, True, bf.half())):
        assert bounded(large, p, spec, bf, w, 2).min_blocks == 1, (p, spec, w.dtype)
    assert bounded(large, ilv, True, bf.float(), None, 2).min_blocks == 1
    with pytest.raises(ValueError, match="large_call_cta_threads"):
        norm_cuda.CudaTuning(large_call_cta_threads=48)


@pytest.mark.parametrize("which", ["norm", "fused"])
def test_nvrtc_compiles_every_cuda_variant_for_sm90(which):
    """Every variant of the representative set compiles; the kernels take int64 scalars only (as
    many as the launchers pass), none needs a stack frame (no local memory: every index into a
    lane's registers is a constant), none spills."""
    names = _all_names(which)
    obj, log = _build(which, names)
    assert set(names) <= set(obj.symbol_mapping)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert len(frames) >= len(names) and all(f == ("0", "0") for f in frames), frames
    scalars = 11 if which == "norm" else 23
    for name in names:
        params = sass_tools.kernel_params(obj, name)
        assert params.endswith("x" * scalars) and not params.endswith("x" * (scalars + 1))


def _specialized_build(which: str, case: QkNormCase, build: str = "small") -> tuple[str, tuple]:
    """(kernel name, fixed arguments) of the build ``case``'s call takes (CPU tensors): the
    small-call build, or with ``build="large"`` the large-call build (as a call of at least
    CudaTuning.large_call_bytes of rows takes it, register bound included)."""
    norm_cuda, fused_cuda = _cuda_modules()
    inp = make_qk_norm_inputs(case, "cpu")
    cs = inp.cos_sin_cache
    if which == "norm":
        view, eps, off = norm_pkg.op.validate(*inp.norm_args(), weight_offset=inp.weight_offset)
        b = norm_cuda.TUNING.large_build() if build == "large" else norm_cuda.SMALL
        name, _, fixed, _ = norm_cuda.call_kernel(view, inp.num_heads_q, inp.num_heads_k, eps,
                                                  inp.q_weight, inp.k_weight, cs, case.is_neox,
                                                  inp.position_ids, off, b)
        return name, fixed
    view, eps, off, cdt, qo, _ = fused_pkg.op.validate(*inp.fused_args(), **inp.fused_kwargs())
    fp8 = cdt.is_fp8 or fused_cuda.query_kind(qo) in (3, 4)
    b, vf = fused_cuda.call_build(1 << 62 if build == "large" else 0, fp8)
    name, _, fixed, _ = fused_cuda.call_kernel(view, inp.num_heads_q, inp.num_heads_k, eps,
                                               inp.q_weight, inp.k_weight, cs, case.is_neox,
                                               inp.position_ids, off, inp.key_cache,
                                               inp.value_cache, inp.slot_mapping, cdt,
                                               case.rotate_key_in_place, qo, b, vf)
    return name, fixed


_TEMPLATE = {
    "norm": ("IN", "CS", "WQ", "WK", "E", "L", "SEG", "V", "VW", "VT", "NEOX", "PS", "PosT", "CTA",
             "MIN_BLOCKS"),
    "fused": ("IN", "CS", "WQ", "WK", "OUT", "QO", "E", "L", "SEG", "V", "VW", "VT", "NEOX", "PS",
              "PosT", "SlotT", "CTA", "MIN_BLOCKS", "VALUE_FIRST"),
}


def _template_args(which: str, name: str) -> dict[str, str]:
    """A kernel name's template arguments by kernel.cu's names."""
    args = name.split("<", 1)[1].rstrip(">").split(", ")
    return dict(zip(_TEMPLATE[which], args, strict=True))


@pytest.mark.parametrize("which", ["norm", "fused"])
def test_nvrtc_compiles_the_specialized_build_of_every_case(which):
    """Every call of the CPU matrix takes a build with its fixed arguments compiled in: every
    variant those calls take compiles for sm_90 specialized (with the first call's arguments;
    one program per build, so not every call's: that would take minutes here, and the GPU tests
    build every call's). A build given the wrong number of fixed arguments is refused by the
    compiler, naming the macro."""
    norm_cuda, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    mod = norm_cuda if which == "norm" else fused_cuda
    cases = NORM_CASES if which == "norm" else FUSED_CASES
    by_name = collections.defaultdict(list)
    for name, fixed in {_specialized_build(which, c) for c in cases if c.num_tokens < 1000}:
        by_name[name].append(fixed)
    assert len(by_name) > 10
    for name, sets in sorted(by_name.items()):
        obj, _ = _build(which, (name,), nvrtc.fixed_args_macros(min(sets)))
        assert name in obj.symbol_mapping
    with pytest.raises(RuntimeError, match=f"KVWRITE_FIXED_ARGS: {len(sets[0])} values"):
        mod.SOURCE.compile("sm_90", name, macros=nvrtc.fixed_args_macros(sets[0][:-1]))


def _sass(source, names, tmp_path, macros=(), text=None) -> str:
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    obj, _ = source.compile("sm_90", names, macros=macros, source=text)
    return sass_tools.dump_sass(bytes(obj.code), tmp_path)


_INV_RMS_PROBE = r'''
extern "C" __global__ void qkn_inv_rms_probe(float* p, long long d, float eps) {
  p[threadIdx.x] = qkn_inv_rms(p[threadIdx.x], d, eps);
}
'''


def test_cuda_sass_has_ffma_only_in_the_root_and_divisions(tmp_path):
    """The per-element arithmetic (squares, sums, x*r, *g, the rotation) is mul.rn/add.rn/sub.rn,
    never contracted: in every generic variant of both kernels without fp8 the FFMAs are exactly
    those of the reciprocal root alone (qkn_inv_rms: the division by D, the root and the
    reciprocal, once per head), whatever the elements per lane. A build of the same source with
    plain `*` and `+` in the tree gets more (the check can fail)."""
    norm_cuda, fused_cuda = _cuda_modules()
    probe = norm_cuda.SOURCE.text + _INV_RMS_PROBE
    base = sass_tools.opcodes(_sass(norm_cuda.SOURCE, "qkn_inv_rms_probe", tmp_path, text=probe))
    want = sum(op.startswith("FFMA") for op in base)
    assert want > 0
    for which in ("norm", "fused"):
        names = _all_names(which)
        obj, _ = _build(which, names)
        by_symbol = {(v.decode() if isinstance(v, bytes) else v): k
                     for k, v in obj.symbol_mapping.items()}
        fp8 = ("3", "4")
        checked = 0
        for symbol, ops in sass_tools.functions(_build_sass(which, names, tmp_path)).items():
            args = _template_args(which, by_symbol[symbol])
            if which == "fused" and (args["OUT"] in fp8 or args["QO"] in fp8):
                continue  # the fp8 quotient's deliberate FMAs
            assert sum(op.startswith("FFMA") for op in ops) == want, by_symbol[symbol]
            checked += 1
        assert checked >= 20
    from kvwrite.kernels import nvrtc
    with open(os.path.join(nvrtc.include_dir(), "kvw", "qk_norm.cuh")) as f:
        header = f.read()
    contracting = header.replace("return add_rn(qkn_tree<N / 2>(q), qkn_tree<N / 2>(q + N / 2));",
                                 "return qkn_tree<N / 2>(q) + qkn_tree<N / 2>(q + N / 2);")
    contracting = contracting.replace("q[i] = mul_rn(x[i], x[i]);", "q[i] = x[i] * x[i];")
    assert contracting.count("qkn_tree<N / 2>(q) +") == 1 and "x[i] * x[i]" in contracting
    text = norm_cuda.SOURCE.text.replace('#include "kvw/qk_norm.cuh"', contracting)
    name = norm_cuda.all_kernel_names()[0]
    ops = sass_tools.opcodes(_sass(norm_cuda.SOURCE, name, tmp_path, text=text))
    assert sum(op.startswith("FFMA") for op in ops) > want


def _row_load(text: str) -> bool:
    """A row's load: the volatile loads of qkv's chunks (the fp8 scales are read-only loads,
    kvw/vec_io.cuh's load_scale)."""
    return "STRONG.SYS" in text


def test_cuda_kernels_issue_the_row_loads_before_waiting_for_any_load(tmp_path):
    """In the specialized builds (what calls take; every other variant) of the CPU matrices and in
    the generic variants, no instruction waits for a global load's result before the last row
    load is issued (the position and slot are loaded after the rows, sass.waits_before_loads),
    in the small-call and the large-call builds. The kinds of exception: generic builds
    (KVWRITE_CUDA_SPECIALIZE=0) of rows in chunks narrower than a lane's elements (float32 rows;
    since qkv's head stride is a run-time argument of its own there, also the fused op's
    bfloat16 rows in 2-element chunks with int32 slots), or of the fused op's large-call build
    with int32 positions, where ptxas issues the position's load first and places its test among
    the chunks' and weights' address arithmetic (specialized, the same variants do not)."""
    _cuda_modules()
    from kvwrite.kernels import nvrtc
    for which, cases in (("norm", NORM_CASES), ("fused", FUSED_CASES)):
        names = _all_names(which)
        obj, _ = _build(which, names)
        by_symbol = {(v.decode() if isinstance(v, bytes) else v): k
                     for k, v in obj.symbol_mapping.items()}
        late = sass_tools.late_issues(_build_sass(which, names, tmp_path), _row_load)
        for symbol in late:
            args = _template_args(which, by_symbol[symbol])
            assert int(args["V"]) < int(args["E"]) or (
                args.get("VALUE_FIRST") == "true" and args["PosT"] == "int"), (
                which, by_symbol[symbol], late[symbol])
        assert len(late) <= 2, late
        for build, step in (("small", 2), ("large", 3)):
            by_name = {}
            for name, fixed in {_specialized_build(which, c, build) for c in cases
                                if c.num_tokens < 1000}:
                by_name[name] = min(fixed, by_name.get(name, fixed))
            # A share of the variants (each SASS listing costs time here).
            for name, fixed in sorted(by_name.items())[::step]:
                macros = nvrtc.fixed_args_macros(fixed)
                late = sass_tools.late_issues(_build_sass(which, (name,), tmp_path, macros),
                                              _row_load)
                assert not late, (name, fixed, late)
                # The large-call register bound spills at most a few bytes (GPT-J with partial
                # rotary and D = 64: 4 bytes) in these odd shapes; none in the models' shapes
                # (test_cuda_large_call_builds_of_model_shapes).
                spills = re.findall(r"(\d+) bytes spill stores", _build(which, (name,), macros)[1])
                assert all(int(n) <= 8 for n in spills), (name, spills)


@pytest.mark.parametrize("which", ["norm", "fused"])
def test_cuda_specialized_builds_read_no_fixed_argument(which, tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: the pointers, num_rot (the fused
    kernel: num_tokens and three scale strides too), then the fixed arguments. The specialized
    build reads none of the fixed ones; the generic build does (the check can fail)."""
    norm_cuda, fused_cuda = _cuda_modules()
    sass_tools.cuobjdump_or_skip()
    mod = norm_cuda if which == "norm" else fused_cuda
    pointers, leading = (5, 1) if which == "norm" else (12, 5)
    case = (QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16)
            if which == "norm" else
            QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
                       kv_cache_dtype="fp8", per_head_scale=True, query_out="fp8_e4m3"))
    name, fixed = _specialized_build(which, case)
    sass_tools.assert_source_fixed_args_compiled_in(mod.SOURCE, name, fixed, pointers + leading,
                                                    tmp_path)


_MODEL_LARGE = [  # (op, case): the models' shapes in the large-call build
    ("norm", QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16)),
    ("fused", QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16)),
    ("fused", QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
                         kv_cache_dtype="fp8")),
    ("fused", QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
                         query_out="fp8_e4m3")),
    ("fused", QkNormCase(num_q_heads=16, num_k_heads=8, head_size=256, dtype=torch.bfloat16,
                         weight_offset=1.0)),
    ("fused", QkNormCase(num_q_heads=64, num_k_heads=8, head_size=64, dtype=torch.bfloat16)),
    ("fused", QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.float32)),
]


def test_cuda_large_call_builds_of_model_shapes(tmp_path):
    """The large-call builds (specialized, register bound included) of the models' shapes
    (Qwen3-8B both ops with auto and fp8 caches and an fp8 query, Gemma 3's D = 256 with (1 +
    w), D = 64, float32 rows): the interleaved layout, so no shared-memory exchange (no LDS or
    STS); within the bound's registers without a spill; each lane loads its weight once (one
    weight's chunks, selected by address) and one segment's cos and sin (the partner segment
    shares them): bfloat16 D = 128, 2 + 4 16-byte loads after the rows, position and slot; with
    16-bit rows the value (value-first) stored before the table's first load, except where a
    head's cache row is 128 bytes of fp8, where it is stored with the key's chunks, after it
    (float32 rows: ptxas issues the table's loads first, within the bound)."""
    norm_cuda, fused_cuda = _cuda_modules()
    from kvwrite.kernels import nvrtc
    for which, case in _MODEL_LARGE:
        name, fixed = _specialized_build(which, case, "large")
        args = _template_args(which, name)
        assert args["SEG"] != args["E"] and args["PS"] == "1" and args["CTA"] == "64", name
        macros = nvrtc.fixed_args_macros(fixed)
        _, log = _build(which, (name,), macros)
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
        assert regs and max(regs) <= 65536 // (64 * int(args["MIN_BLOCKS"])), (name, regs)
        # NVRTC 13.0's ptxas (the test extra's, the GPU machine's) spills 4 bytes in Gemma 3's
        # D = 256 build under its 48 registers and requests the table before storing the value
        # (13.5: neither); whether a looser bound is faster there is not measured. Every other
        # shape: no spill.
        gemma_13_0 = case.head_size == 256 and sass_tools.nvrtc_version() == (13, 0)
        spill = ["4"] if gemma_13_0 else ["0"]
        assert re.findall(r"(\d+) bytes spill stores", log) == spill, (name, log[-400:])
        ops = sass_tools.opcodes(_build_sass(which, (name,), tmp_path, macros))
        assert not any(op.startswith(("LDS", "STS")) for op in ops), name
        wide = [i for i, op in enumerate(ops) if op.startswith("LDG.E.128.CONSTANT")]
        e, seg, vw, vt = (int(args[k]) for k in ("E", "SEG", "VW", "VT"))
        assert len(wide) == e // vw + 2 * seg // vt, (name, len(wide))  # weight, cos and sin
        if which == "fused" and case.dtype != torch.float32:  # (float32: ptxas's own order)
            first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
            fp8_128 = case.cache_dtype.is_fp8 and case.head_size == 128
            assert (first_store > wide[0]) == (fp8_128 or gemma_13_0), (name, first_store,
                                                                      wide[0])


def test_cuda_small_fp8_build_converts_the_value_while_the_table_is_in_flight(tmp_path):
    """The small-call build with an fp8 cache converts the value's chunks (F2FP E4M3 packs)
    before the rotation rounds the key (F2FP / F2F to bfloat16): between the table's request and
    the rotation, no longer after the key's store on a small call's latency path (as
    fused_rope_and_reshape_cache_flash's small build, tuning-log change 54)."""
    _cuda_modules()
    from kvwrite.kernels import nvrtc
    case = QkNormCase(num_q_heads=32, num_k_heads=8, head_size=128, dtype=torch.bfloat16,
                      kv_cache_dtype="fp8")
    name, fixed = _specialized_build("fused", case)
    assert _template_args("fused", name)["VALUE_FIRST"] == "false"
    ops = sass_tools.opcodes(_build_sass("fused", (name,), tmp_path,
                                         nvrtc.fixed_args_macros(fixed)))
    table = next(i for i, op in enumerate(ops) if op.startswith("LDG.E.128.CONSTANT"))
    value = next(i for i, op in enumerate(ops) if op.startswith("F2FP.SATFINITE.E4M3"))
    key = next(i for i, op in enumerate(ops) if op.startswith(("F2FP.BF16", "F2F.BF16")))
    assert table < value < key, (table, value, key)


def test_cuda_pdl_build_waits_before_any_global_access(tmp_path):
    """The KVWRITE_PDL build of both kernels (every fourth variant of the representative set:
    each build costs CPU time here): the trigger (PREEXIT) and the wait (ACQBULK) before the
    first global load or store; the plain build has neither. The large-call build's twin (no
    early trigger, CudaTuning.large_call_pdl_trigger) of the models' shapes: the wait first, no
    trigger."""
    from kvwrite.kernels import nvrtc
    for which in ("norm", "fused"):
        names = _all_names(which)[::4]
        pdl = sass_tools.functions(_build_sass(which, names, tmp_path, (nvrtc.PDL_MACRO,)))
        assert len(pdl) == len(names)
        sass_tools.assert_waits_first(pdl)
    for which, case in _MODEL_LARGE[:3]:
        name, fixed = _specialized_build(which, case, "large")
        macros = nvrtc.fixed_args_macros(fixed) + (nvrtc.PDL_MACRO, nvrtc.PDL_NO_TRIGGER_MACRO)
        ops = sass_tools.opcodes(_build_sass(which, (name,), tmp_path, macros))
        sass_tools.assert_waits_first({name: ops}, trigger=False)
        sass_tools.assert_no_pdl(_build_sass(which, _all_names(which), tmp_path))


_HOST_HARNESS = r'''
#include "kvw/qk_norm.cuh"
extern "C" void inv_rms(const float* ss, float* out, int n, long long d, float eps) {
  for (int i = 0; i < n; ++i) out[i] = qkn_inv_rms(ss[i], d, eps);
}
extern "C" float lane_tree16(const float* q) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = q[i];
  return qkn_lane_tree<16>(a);
}
// The device's sum of squares over a layout, its shuffles emulated lane by lane: per segment the
// in-lane tree, xor masks 1, 2, ..., L/2, then the tree over the segments (lane 0's result).
template <int E, int L, int SEG>
float layout_sum(const float* leaves) {
  using LY = QknLayout<E, L, SEG>;
  float part[L][LY::NSEG], next[L][LY::NSEG];
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < LY::NSEG; ++s) {
      float seg[SEG];
      for (int j = 0; j < SEG; ++j) seg[j] = leaves[LY::off(l * SEG, s * SEG + j)];
      part[l][s] = qkn_tree<SEG>(seg);
    }
  for (int m = 1; m < L; m <<= 1) {
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < LY::NSEG; ++s) next[l][s] = add_rn(part[l][s], part[l ^ m][s]);
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < LY::NSEG; ++s) part[l][s] = next[l][s];
  }
  return qkn_tree<LY::NSEG>(part[0]);
}
// 0 when the layout's offsets cover [0, L*E) once each and (ps > 0) element i < ps*SEG of a lane
// pairs with its element i + ps*SEG at row offset + ps*L*SEG (the neox partner, rot/2 on).
template <int E, int L, int SEG>
int layout_errors(int ps) {
  using LY = QknLayout<E, L, SEG>;
  int seen[L * E] = {0}, bad = 0;
  for (int l = 0; l < L; ++l)
    for (int i = 0; i < E; ++i) {
      const unsigned o = LY::off(l * SEG, i);
      if (o >= L * E) { ++bad; continue; }
      ++seen[o];
      if (i < ps * SEG && LY::off(l * SEG, i + ps * SEG) != o + ps * L * SEG) ++bad;
    }
  for (int o = 0; o < L * E; ++o) bad += seen[o] != 1;
  return bad;
}
#define KVW_LAYOUT(E, L, SEG)                                                              \
  extern "C" float sum_##E##_##L##_##SEG(const float* q) { return layout_sum<E, L, SEG>(q); } \
  extern "C" int errors_##E##_##L##_##SEG(int ps) { return layout_errors<E, L, SEG>(ps); }
KVW_LAYOUT(8, 16, 8)
KVW_LAYOUT(16, 8, 8)
KVW_LAYOUT(16, 4, 8)
KVW_LAYOUT(16, 16, 8)
KVW_LAYOUT(16, 32, 8)
KVW_LAYOUT(8, 16, 4)
KVW_LAYOUT(16, 32, 4)
KVW_LAYOUT(32, 4, 8)
KVW_LAYOUT(16, 32, 16)
'''


def test_header_arithmetic_on_the_host(tmp_path):
    """kvw/qk_norm.cuh's reciprocal RMS and in-lane tree, compiled as host C++
    (-DKVWRITE_HOST_TEST, no contraction): the oracle's values for many sums of squares
    (normal, subnormal, zero, huge, inf), D = 128 (the multiplication by 2^-7) and 80 (the
    division), eps 0 and 1e-6; the tree of 16 leaves is the oracle's; every lane layout's
    offsets, neox partners and sum over lanes (its shuffles emulated) are the contract's."""
    import ctypes
    import shutil
    import subprocess

    from kvwrite.kernels import nvrtc
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++)")
    src = tmp_path / "h.cpp"
    src.write_text(_HOST_HARNESS)
    lib = tmp_path / "h.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared",
                    "-DKVWRITE_HOST_TEST", f"-I{nvrtc.include_dir()}", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    h = ctypes.CDLL(str(lib))
    gen = np.random.default_rng(3)
    ss = (gen.random(20000) * np.exp2(gen.integers(-150, 128, 20000))).astype(np.float32)
    ss[:6] = [0.0, np.inf, 1e-45, 3e38, 2.0**-149, 1.0]
    fp = ctypes.POINTER(ctypes.c_float)
    for d in (128, 80):
        for eps in (0.0, 1e-6):
            out = np.empty_like(ss)
            h.inv_rms(ss.ctypes.data_as(fp), out.ctypes.data_as(fp), len(ss), ctypes.c_longlong(d),
                      ctypes.c_float(eps))
            eps32 = float(np.float32(eps))
            with np.errstate(all="ignore"):
                m = _f32(ss.astype(np.float64) / d)
                want = _f32(1.0 / _f32(np.sqrt(_f32(m + eps32))))
            assert np.array_equal(out.astype(np.float64), want), (d, eps)
    h.lane_tree16.restype = ctypes.c_float
    for _ in range(200):
        q = (gen.standard_normal(16) * np.exp2(gen.integers(-20, 20, 16))).astype(np.float32)
        got = h.lane_tree16(q.ctypes.data_as(fp))
        assert got == np.float32(_tree([float(v) for v in q]))
    # Every lane layout the launchers choose: the offsets partition the padded row, the neox
    # partners are PS segments on (PS of the plans: bfloat16 D = 128, 256, 64 and 512 in two
    # chunks, float32 D = 128 and 512, four chunks), and the sum over lanes is the contract's
    # tree over the row (the oracle's, leaves in row order).
    for e, lanes, seg, ps in ((8, 16, 8, 0), (16, 8, 8, 1), (16, 4, 8, 1), (16, 16, 8, 1),
                              (16, 32, 8, 1), (8, 16, 4, 1), (16, 32, 4, 2), (32, 4, 8, 2),
                              (16, 32, 16, 0)):
        tag = f"{e}_{lanes}_{seg}"
        assert getattr(h, "errors_" + tag)(ctypes.c_int(ps)) == 0, tag
        fn = getattr(h, "sum_" + tag)
        fn.restype = ctypes.c_float
        for _ in range(50):
            n = e * lanes
            q = (gen.standard_normal(n) * np.exp2(gen.integers(-20, 20, n))).astype(np.float32)
            assert fn(q.ctypes.data_as(fp)) == np.float32(_tree([float(v) for v in q])), tag


# --- Triton: the compiled kernels have no fused multiply-add and no flush to zero ---------------

_PTX_SCRIPT = TRITON_PTX_PRELUDE + r"""
from kvwrite.ops.fused_qk_norm_rope import triton_impl as norm
from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import triton_impl as fused

def count(text):
    return [text.count("fma.rn.f32"), text.count(".ftz"), text.count("sqrt.rn.f32"),
            text.count("div.rn.f32"), text.count("sqrt.approx"), text.count("rsqrt")]

out = {}
for dt in ("bf16", "fp32"):
    types = {"positions_ptr": "*i64", "qkv_ptr": "*" + dt, "cos_sin_ptr": "*fp32",
             "q_weight_ptr": "*" + dt, "k_weight_ptr": "*fp32", "num_rot": "i32",
             "qkv_stride": "i32", "max_position": "i32", "eps_bits": "i32", "offset_bits": "i32"}
    consts = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_SIZE=128, HEAD_STRIDE=128, ROT=128,
                  IS_NEOX=True, HAS_QW=True, HAS_KW=True, ADD_OFFSET=True, Q_TILES=8, BLOCK_T=1,
                  BLOCK_H=4, BLOCK_D=128)
    out["norm-" + dt] = count(ptx(norm._qk_norm_rope_kernel, types, consts))
    if dt == "fp32":
        out["norm-fusion-on"] = count(ptx(norm._qk_norm_rope_kernel, types, consts, True))
        continue
    types = {"positions_ptr": "*i64", "qkv_ptr": "*" + dt, "query_out_ptr": "*" + dt,
             "cos_sin_ptr": "*fp32", "q_weight_ptr": "*" + dt, "k_weight_ptr": "*" + dt,
             "key_cache_ptr": "*" + dt, "value_cache_ptr": "*" + dt, "slot_mapping_ptr": "*i64"}
    types.update({n: "i32" for n in ("num_rot", "num_tokens", "qkv_stride", "qo_stride",
                                      "max_position", "num_slots", "stride_b", "stride_s",
                                      "stride_h", "eps_bits", "offset_bits")})
    consts = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_SIZE=80, HEAD_STRIDE=144, ROT=64,
                  IS_NEOX=False, HAS_QW=True, HAS_KW=True, ADD_OFFSET=False, STORE_KEY=True,
                  QUERY_IN_PLACE=False, QUERY_QUANT=0, Q_PER_HEAD_SCALE=False, BLOCK_SIZE=16,
                  QUANT=0, K_PER_HEAD=False, V_PER_HEAD=False, Q_TILES=8, BLOCK_T=1, BLOCK_H=4,
                  BLOCK_D=128,
                  k_scale_ptr=None, v_scale_ptr=None, q_scale_ptr=None)
    out["fused-" + dt] = count(ptx(fused._qk_norm_rope_cache_kernel, types, consts))
# The other paths of both kernels compile (fp8 caches and queries with per-tensor and per-head
# scales, no weights, the query in place, the key not stored, int32 indices, a bfloat16 table):
# the GPU runs them, the interpreter cannot.
compiled = 0
for quant, qquant, per_head, has_w, in_place in (
        (1, 2, True, False, False), (2, 1, False, True, False), (1, 0, True, True, True)):
    types = {"positions_ptr": "*i32", "qkv_ptr": "*bf16", "query_out_ptr": "*fp8e4nv" if qquant
             == 1 else "*fp8e5" if qquant == 2 else "*bf16", "cos_sin_ptr": "*bf16",
             "q_weight_ptr": "*fp32", "k_weight_ptr": "*fp16", "key_cache_ptr": "*u8" if quant
             else "*bf16", "value_cache_ptr": "*u8" if quant else "*bf16",
             "slot_mapping_ptr": "*i32"}
    types.update({n: "i32" for n in ("num_rot", "num_tokens", "qkv_stride", "qo_stride",
                                      "max_position", "num_slots", "stride_b", "stride_s",
                                      "stride_h", "eps_bits", "offset_bits")})
    consts = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_SIZE=128, HEAD_STRIDE=128, ROT=128,
                  IS_NEOX=True, HAS_QW=has_w, HAS_KW=has_w, ADD_OFFSET=has_w,
                  STORE_KEY=not in_place, QUERY_IN_PLACE=in_place, QUERY_QUANT=qquant,
                  Q_PER_HEAD_SCALE=per_head and
                  qquant > 0, BLOCK_SIZE=16, QUANT=quant, K_PER_HEAD=per_head and quant > 0,
                  V_PER_HEAD=per_head and quant > 0,
                  Q_TILES=8, BLOCK_T=1, BLOCK_H=4, BLOCK_D=128)
    for name, on in (("k_scale_ptr", quant), ("v_scale_ptr", quant), ("q_scale_ptr", qquant)):
        if on:
            types[name] = "*fp32"
        else:
            consts[name] = None
    if not has_w:
        consts.update(q_weight_ptr=None, k_weight_ptr=None)
        del types["q_weight_ptr"], types["k_weight_ptr"]
    ptx(fused._qk_norm_rope_cache_kernel, types, consts)
    compiled += 1
for has_w, off in ((False, False),):
    types = {"positions_ptr": "*i32", "qkv_ptr": "*fp16", "cos_sin_ptr": "*fp16",
             "num_rot": "i32", "qkv_stride": "i32", "max_position": "i32", "eps_bits": "i32",
             "offset_bits": "i32"}
    consts = dict(NUM_Q_HEADS=16, NUM_K_HEADS=16, HEAD_SIZE=80, HEAD_STRIDE=81, ROT=32,
                  IS_NEOX=False, HAS_QW=has_w, HAS_KW=has_w, ADD_OFFSET=off, Q_TILES=4,
                  BLOCK_T=2, BLOCK_H=4, BLOCK_D=128)
    if has_w:
        types.update(q_weight_ptr="*bf16", k_weight_ptr="*bf16")
    else:
        consts.update(q_weight_ptr=None, k_weight_ptr=None)
    ptx(norm._qk_norm_rope_kernel, types, consts)
    compiled += 1
out["compiled"] = compiled
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_sm90_without_fma_or_flush():
    """The Triton kernels compiled for sm_90 (on the CPU): no fma (the quotient's are in fp8
    builds only, none here), no .ftz, the correctly rounded root and true divisions, no
    approximate root; with fusion allowed the same kernel gets fmas (the check can fail)."""
    counts = run_triton_script(_PTX_SCRIPT)
    assert counts.pop("compiled") == 4
    fusion = counts.pop("norm-fusion-on")
    for name, (fma, ftz, sqrt_rn, div_rn, sqrt_approx, rsqrt) in counts.items():
        assert (fma, ftz, sqrt_approx, rsqrt) == (0, 0, 0, 0), (name, counts[name])
        assert sqrt_rn > 0 and div_rn >= 2 * sqrt_rn, (name, counts[name])
    assert fusion[0] > 0


# --- Triton: the whole-row kernels (large calls) -------------------------------------------------

def _rows_tuning(monkeypatch, tile_bytes: int):
    """Every call with rot_dim == head_size == a power of two takes the whole-row kernels
    (RowsTuning.min_tokens 1), with tiles of ``tile_bytes``."""
    ti = pytest.importorskip("kvwrite.ops.fused_qk_norm_rope.triton_impl")
    monkeypatch.setattr(ti, "ROWS_TUNING", ti.RowsTuning(min_tokens=1, tile_bytes=tile_bytes))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile_bytes", [512, 16384])
@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.id)
def test_triton_rows_kernel_norm_matches_reference(monkeypatch, case, tile_bytes, device):
    """The whole-row kernel at every size (the default takes it from 17 tokens): one head or
    token per program (512 bytes) or many, the same bytes as the reference."""
    _rows_tuning(monkeypatch, tile_bytes)
    _run_norm("triton", case, device)


def _rows_fp8_on_the_cpu() -> set[str]:
    """The fp8 cases the whole-row kernel runs under the interpreter: the first of FUSED_CASES
    that takes the kernel with an e4m3 query and e4m3 cache, and with e5m2 ones (the codes are
    exact there: triton_fp8.fp8_code's integer form). Its other fp8 cases run on the GPU: all of
    them under the interpreter took 27 s of CPU (2 tile sizes x 23 cases), about half the CPU
    time that checking fp8 writes under the interpreter adds to the suite, and most of them
    take the tile kernel, which test_fused_matches_reference runs on every case."""
    picks = {}
    for c in FUSED_CASES:
        if (c.dtype != torch.bfloat16 and c.rot == c.head_size
                and c.query_out in ("fp8_e4m3", "fp8_e5m2")
                and c.cache_dtype is parse_kv_cache_dtype(c.query_out)):
            picks.setdefault(c.query_out, c.id)
    assert set(picks) == {"fp8_e4m3", "fp8_e5m2"}, picks
    return set(picks.values())


ROWS_FP8_ON_THE_CPU = _rows_fp8_on_the_cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile_bytes", [512, 16384])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_triton_rows_kernel_fused_matches_reference(monkeypatch, case, tile_bytes, device):
    fp8 = case.kv_cache_dtype.startswith("fp8") or (case.query_out or "").startswith("fp8")
    if device == "cpu" and fp8 and case.id not in ROWS_FP8_ON_THE_CPU:
        _skip_unless_runs(FUSED, "triton", make_qk_norm_inputs(case, device), device)
        pytest.skip("fp8 under Triton's interpreter: the cases of ROWS_FP8_ON_THE_CPU only (CPU "
                    "time); the GPU runs every case")
    _rows_tuning(monkeypatch, tile_bytes)
    _run_fused("triton", case, device)


# Per-tensor scales of every kind for store_quantized_uniform (k, v, q): powers of two at both
# ends of its product's range (2^126: the product; 2^127: |m| = 2^-126, the division), negative,
# and ones that are not powers of two (the division).
_UNIFORM_SCALES = [(1.0, 1.0, 1.0), (2.0**-8, 0.5, 2.0**-6), (2.0**126, 2.0**127, -2.0),
                   (-4.0, 3.0, 0.75), (2.0**-100, 1.0, 2.0**20)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [False, True], ids=["tile", "rows"])
@pytest.mark.parametrize("scales", _UNIFORM_SCALES, ids=lambda s: "-".join(f"{x:g}" for x in s))
def test_triton_per_tensor_power_of_two_scales(monkeypatch, scales, rows, device):
    """A per-tensor scale that is a power of two takes Triton's one-product store
    (triton_fp8.store_quantized_uniform) for the key, the value and an fp8 query: the same bytes
    as the reference (whole allocations), in the tile and the whole-row kernel, e4m3 cache and
    query, and codes that saturate (2^-8, 2^-100), round to subnormals or to zero (2^20,
    2^126)."""
    case = QkNormCase(num_tokens=6, num_q_heads=4, num_k_heads=2, head_size=64,
                      kv_cache_dtype="fp8_e4m3", query_out="fp8_e4m3", padding_slots=1)
    if rows:
        _rows_tuning(monkeypatch, 512)
    inp = make_qk_norm_inputs(case, device)
    _skip_unless_runs(FUSED, "triton", inp, device)
    for t, v in zip((inp.k_scale, inp.v_scale, inp.q_scale), scales, strict=True):
        assert t.numel() == 1
        t.fill_(v)
    want = clone_inputs(inp)
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*inp.fused_args(), **inp.fused_kwargs(),
                                                       implementation="triton")
    kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(*want.fused_args(), **want.fused_kwargs(),
                                                       implementation="torch")
    assert_same(inp, want, _nan_equal(case))


def test_triton_rows_launch_picks_by_tokens_and_shape():
    """Calls of at most 16 tokens keep the tile kernel's launch (its small-call shapes were
    measured); larger ones with rot_dim == head_size == a power of two take the whole-row
    kernel, at the benchmark's Qwen3-8B shape 8 heads x 8 tokens (16 KiB) per program, 4
    warps, from 1024 tokens (fewer tokens per program below, RowsTuning.min_programs); partial
    rotary and head sizes that are not powers of two keep the tile kernel."""
    pytest.importorskip("triton")
    from kvwrite.ops.fused_qk_norm_rope import triton_impl as ti

    def launch(t, hq=32, hk=8, d=128, rot=128, dtype=torch.bfloat16):
        qkv = torch.empty(t, hq + 2 * hk, d, dtype=dtype)
        return ti.rows_launch(qkv, hq, hk, torch.empty(4, rot), torch.zeros(t, dtype=torch.long),
                              ti.ROWS_TUNING)

    assert launch(1) is None and launch(16) is None
    for t in (1024, 16384):
        r = launch(t)
        assert (r.block_t, r.block_h, r.warps, r.q_tiles, r.grid) == (8, 8, 4, 4, (t // 8, 5))
    # fewer than 264 programs of 8 tokens: fewer tokens per program, a warp per 4 KiB
    r = launch(256)
    assert (r.block_t, r.block_h, r.warps, r.grid) == (4, 8, 2, (64, 5))
    r = launch(17)
    assert (r.block_t, r.block_h, r.warps, r.grid) == (1, 8, 1, (17, 5))
    r = launch(1024, hq=32, hk=32)
    assert (r.block_t, r.block_h, r.warps, r.q_tiles, r.grid) == (2, 32, 4, 1, (512, 2))
    assert launch(1024, rot=64) is None and launch(1024, d=80, rot=80) is None


_ROWS_PTX_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.kernels.triton_rope import LAUNCH_OPTIONS
from kvwrite.ops.fused_qk_norm_rope import triton_impl as norm
from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import triton_impl as fused

STRIDES = ("qkv_stride", "qo_stride", "stride_b", "stride_s", "stride_h")

def ptx(kernel, types, consts, warps):
    # The specialization Triton's JIT gives a call whose pointers are 16-byte aligned and
    # whose strides are multiples of 16 (the benchmark's tensors): tt.divisibility 16.
    consts = {**consts, "PDL": False, "PDL_TRIGGER": False}
    if "NATIVE" in kernel.arg_names:  # sm_90's (triton_support.native_fp8)
        consts["NATIVE"] = True
    sig = dict(types)
    sig.update({n: "constexpr" for n in consts})
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, ty in types.items()
             if ty.startswith("*") or n in STRIDES}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    opts = {"num_warps": warps, **LAUNCH_OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

def count(text):
    ops = {}
    for line in text.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        if op.startswith("@"):
            op = line.strip().split()[1]
        if op.startswith(("ld.global", "st.global", "div.", "rem.", "fma.", "sqrt.")) or ".ftz" in op:
            ops[op] = ops.get(op, 0) + 1
    return ops

q_tiles = 32 // 8
out = {}
for dt, neox in (("bf16", True), ("bf16", False), ("fp32", True)):
    tag = f"{dt}-{'neox' if neox else 'gptj'}"
    types = {"positions_ptr": "*i64", "qkv_ptr": "*" + dt, "cos_sin_ptr": "*bf16",
             "q_weight_ptr": "*" + dt, "k_weight_ptr": "*" + dt}
    types.update({n: "i32" for n in ("num_rot", "qkv_stride", "max_position", "eps_bits",
                                      "offset_bits")})
    consts = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_SIZE=128, HEAD_STRIDE=128, IS_NEOX=neox,
                  HAS_QW=True, HAS_KW=True, ADD_OFFSET=False, Q_TILES=q_tiles, BLOCK_T=8,
                  BLOCK_H=8)
    out["norm-" + tag] = count(ptx(norm._qk_norm_rope_rows_kernel, types, consts, 4))
    for quant in (0, 1):
        types = {"positions_ptr": "*i64", "qkv_ptr": "*" + dt, "query_out_ptr": "*" + dt,
                 "cos_sin_ptr": "*bf16", "q_weight_ptr": "*" + dt, "k_weight_ptr": "*" + dt,
                 "key_cache_ptr": "*u8" if quant else "*" + dt,
                 "value_cache_ptr": "*u8" if quant else "*" + dt, "slot_mapping_ptr": "*i64"}
        types.update({n: "i32" for n in ("num_rot", "num_tokens", "qkv_stride", "qo_stride",
                                          "max_position", "num_slots", "stride_b", "stride_s",
                                          "stride_h", "eps_bits", "offset_bits")})
        consts = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HEAD_SIZE=128, HEAD_STRIDE=128,
                      IS_NEOX=neox, HAS_QW=True, HAS_KW=True, ADD_OFFSET=False, STORE_KEY=True,
                      QUERY_IN_PLACE=True, QUERY_QUANT=0, Q_PER_HEAD_SCALE=False, BLOCK_SIZE=16,
                      QUANT=quant, K_PER_HEAD=False, V_PER_HEAD=False, Q_TILES=q_tiles,
                      BLOCK_T=8, BLOCK_H=8, q_scale_ptr=None)
        if quant:
            types.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        else:
            consts.update(k_scale_ptr=None, v_scale_ptr=None)
        out[f"fused-{tag}-{'fp8' if quant else 'auto'}"] = count(
            ptx(fused._qk_norm_rope_cache_rows_kernel, types, consts, 4))
# The other paths compile (fp8 queries with per-head scales, no weights, the query to
# query_out, the key not stored, int32 indices, padded heads, float16, one warp): the GPU runs
# them, the interpreter only those with exact casts.
compiled = 0
for qquant, per_head, has_w, in_place, neox in ((1, True, False, False, True),
                                                (2, False, True, False, False),
                                                (0, False, True, False, True)):
    types = {"positions_ptr": "*i32", "qkv_ptr": "*fp16",
             "query_out_ptr": "*fp8e4nv" if qquant == 1 else "*fp8e5" if qquant == 2 else "*fp16",
             "cos_sin_ptr": "*fp32", "q_weight_ptr": "*bf16", "k_weight_ptr": "*fp32",
             "key_cache_ptr": "*u8", "value_cache_ptr": "*u8", "slot_mapping_ptr": "*i32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    types.update({n: "i32" for n in ("num_rot", "num_tokens", "qkv_stride", "qo_stride",
                                      "max_position", "num_slots", "stride_b", "stride_s",
                                      "stride_h", "eps_bits", "offset_bits")})
    consts = dict(NUM_Q_HEADS=16, NUM_K_HEADS=4, HEAD_SIZE=64, HEAD_STRIDE=72, IS_NEOX=neox,
                  HAS_QW=has_w, HAS_KW=has_w, ADD_OFFSET=has_w, STORE_KEY=in_place,
                  QUERY_IN_PLACE=in_place, QUERY_QUANT=qquant,
                  Q_PER_HEAD_SCALE=per_head and qquant > 0, BLOCK_SIZE=16, QUANT=2,
                  K_PER_HEAD=per_head, V_PER_HEAD=not per_head, Q_TILES=4, BLOCK_T=2, BLOCK_H=4)
    if qquant:
        types["q_scale_ptr"] = "*fp32"
    else:
        consts["q_scale_ptr"] = None
    if not has_w:
        consts.update(q_weight_ptr=None, k_weight_ptr=None)
        del types["q_weight_ptr"], types["k_weight_ptr"]
    ptx(fused._qk_norm_rope_cache_rows_kernel, types, consts, 1)
    compiled += 1
types = {"positions_ptr": "*i32", "qkv_ptr": "*fp16", "cos_sin_ptr": "*fp16", "num_rot": "i32",
         "qkv_stride": "i32", "max_position": "i32", "eps_bits": "i32", "offset_bits": "i32"}
consts = dict(NUM_Q_HEADS=12, NUM_K_HEADS=2, HEAD_SIZE=256, HEAD_STRIDE=257, IS_NEOX=False,
              HAS_QW=False, HAS_KW=False, ADD_OFFSET=False, Q_TILES=6, BLOCK_T=4, BLOCK_H=2,
              q_weight_ptr=None, k_weight_ptr=None)
ptx(norm._qk_norm_rope_rows_kernel, types, consts, 2)
compiled += 1
# Weights on one side only (q or k): the q and k tiles take either branch of one runtime `if`,
# which Triton compiles only when both give the weights one type (the interpreter never checks).
for has_qw in (True, False):
    types = {"positions_ptr": "*i64", "qkv_ptr": "*fp32", "cos_sin_ptr": "*fp32",
             "num_rot": "i32", "qkv_stride": "i32", "max_position": "i32", "eps_bits": "i32",
             "offset_bits": "i32", ("k_weight_ptr", "q_weight_ptr")[has_qw]: "*fp16"}
    consts = dict(NUM_Q_HEADS=4, NUM_K_HEADS=2, HEAD_SIZE=64, HEAD_STRIDE=64, IS_NEOX=True,
                  HAS_QW=has_qw, HAS_KW=not has_qw, ADD_OFFSET=False, Q_TILES=2, BLOCK_T=2,
                  BLOCK_H=2)
    consts[("q_weight_ptr", "k_weight_ptr")[has_qw]] = None
    ptx(norm._qk_norm_rope_rows_kernel, types, consts, 1)
    types = {**types, "query_out_ptr": "*fp32", "key_cache_ptr": "*fp32",
             "value_cache_ptr": "*fp32", "slot_mapping_ptr": "*i64",
             **{n: "i32" for n in ("num_tokens", "qo_stride", "num_slots", "stride_b",
                                   "stride_s", "stride_h")}}
    consts.update(STORE_KEY=True, QUERY_IN_PLACE=True, QUERY_QUANT=0, Q_PER_HEAD_SCALE=False,
                  BLOCK_SIZE=16, QUANT=0, K_PER_HEAD=False, V_PER_HEAD=False, q_scale_ptr=None,
                  k_scale_ptr=None, v_scale_ptr=None)
    ptx(fused._qk_norm_rope_cache_rows_kernel, types, consts, 1)
    compiled += 2
out["compiled"] = compiled
print(json.dumps(out))
"""


def test_triton_rows_kernels_ptx_for_sm90():
    """The whole-row kernels compiled for sm_90 at the benchmark's shape (Qwen3-8B: Hq=32,
    Hk=Hv=8, D=128, RowsTuning's 8 heads x 8 tokens, 4 warps): every row access is 16 bytes
    (bfloat16 and float32: ``ld/st.global.v4.b32``; no 2-byte access of a row: the tile kernel
    at its large-call tiles had only those; GPT-J's weights aside), no 64-bit division or remainder, no fma (the fp8
    quotient's aside), no .ftz, the correctly rounded root and true divisions. Per thread and
    program: 64 rows of 256 bytes (bfloat16) over 128 threads, so 8 row loads of 16 bytes
    (neox: 2 halves x 4 rows) and as many stores; the fused op loads the value too and stores
    key and value into the caches."""
    counts = run_triton_script(_ROWS_PTX_SCRIPT)
    assert counts.pop("compiled") == 8
    for name, ops in counts.items():
        narrow = {op: n for op, n in ops.items() if op.startswith(("ld.global", "st.global"))
                  and not op.endswith((".v4.b32", ".b64", ".v2.b32", ".b32"))}
        # GPT-J loads each weight vector (D elements, split into pairs) with one element per
        # thread: 2 loads, once per program; every row access is wide
        assert narrow == ({"ld.global.b16": 2} if "bf16-gptj" in name else {}), (name, ops)
        assert not any(op.startswith(("div.s64", "div.u64", "rem.s64", "rem.u64")) for op in ops), \
            (name, ops)
        assert not any(".ftz" in op or op.startswith(("sqrt.approx", "rsqrt")) for op in ops), \
            (name, ops)
        assert ops.get("sqrt.rn.f32", 0) > 0 and ops.get("div.rn.f32", 0) >= 2 * ops["sqrt.rn.f32"]
        if not name.endswith("fp8"):
            assert not any(op.startswith("fma") for op in ops), (name, ops)
        stores = {op: n for op, n in ops.items() if op.startswith("st.global")}
        row_bytes = 256 if "bf16" in name else 512
        per_thread = 64 * row_bytes // 128 // 16  # 16-byte stores of one kind of row per thread
        if name.startswith("norm"):
            assert stores == {"st.global.v4.b32": per_thread}, (name, ops)
            assert ops.get("ld.global.v4.b32", 0) >= per_thread, (name, ops)
        elif name.endswith("auto"):
            # query or key in place, then key and value into the caches (the query program's
            # stores and the key program's share no code)
            assert stores == {"st.global.v4.b32": 4 * per_thread}, (name, ops)
            assert ops.get("ld.global.v4.b32", 0) >= 3 * per_thread, (name, ops)


# --- CUDA graphs, torch.compile, sanitize --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("head_pad", [0, 64, 4])
@pytest.mark.parametrize("impl", ["triton", "cuda", "cuda-large"])
@pytest.mark.parametrize("op", [NORM, FUSED])
def test_cuda_graph_replay_sees_new_inputs(monkeypatch, op, impl, head_pad):
    """Capture once (the first call of the variant inside the capture), then change every input
    in place (rows, positions, weights, slots, cache and query scales): the replay writes what
    the reference writes for the new values (cuda-large: the cuda large-call build), on dense
    and padded heads (D = 128 in rows of 192; of 132, which breaks 16-byte alignment)."""
    if impl == "cuda-large":
        if op == NORM:
            from kvwrite.ops.fused_qk_norm_rope import cuda_impl
        else:
            from kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash import cuda_impl
        _force(monkeypatch, cuda_impl, large_call_bytes=0)
        impl = "cuda"
    if (reason := registry.get(op, impl).available("cuda")) is not None:
        pytest.skip(reason)
    case = QkNormCase(num_tokens=40, num_q_heads=32, num_k_heads=8, head_size=128,
                      dtype=torch.bfloat16, kv_cache_dtype="fp8", per_head_scale=True,
                      layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=3,
                      bad_positions=2, num_blocks=8, pos_dtype=torch.int32,
                      query_out="fp8_e4m3" if op == FUSED else None, q_scale_per_head=True,
                      q_weight=torch.float32, weight_offset=1.0, max_position=4096,
                      head_pad=head_pad)
    live = make_qk_norm_inputs(case, "cuda", seed=1)

    def call():
        if op == NORM:
            kvwrite.fused_qk_norm_rope(*live.norm_args(), **live.norm_kwargs(),
                                       implementation=impl)
        else:
            kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
                *live.fused_args(), **live.fused_kwargs(), implementation=impl)

    if impl == "triton":
        # Triton loads a kernel it has not compiled in this process with cuModuleLoad, which a
        # global-mode capture refuses: warm it up first, as an engine does before capturing. (The
        # cuda builds load inside the capture: nvrtc.capture_relaxed.)
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (2, 3):
        new = make_qk_norm_inputs(case, "cuda", seed=seed)
        want = make_qk_norm_inputs(case, "cuda", seed=seed)
        for name, t in live.tensors().items():
            # Whole allocations: a padded qkv's padding must not change either.
            t.untyped_storage().copy_(new.tensors()[name].untyped_storage())
        graph.replay()
        if op == NORM:
            kvwrite.fused_qk_norm_rope(*want.norm_args(), **want.norm_kwargs(),
                                       implementation="torch")
        else:
            kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
                *want.fused_args(), **want.fused_kwargs(), implementation="torch")
        torch.cuda.synchronize()
        assert_same(live, want, names=None if op == FUSED else _norm_names(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_pad", [0, 64])
@pytest.mark.parametrize("impl", ["torch", "triton", "cuda"])
def test_torch_compile_sees_mutating_custom_ops(impl, head_pad, device):
    """Both ops stay one opaque custom op under torch.compile, and through AOT autograd's
    functionalization the mutations are kept, on dense and padded heads (the padding keeps its
    bytes)."""
    case = QkNormCase(num_tokens=9, bad_positions=2, padding_slots=2, layout=Layout.HND,
                      query_out="same", weight_offset=1.0, rotate_key_in_place=False,
                      head_pad=head_pad)
    inp = make_qk_norm_inputs(case, device)
    for op in (NORM, FUSED):
        _skip_unless_runs(op, impl, inp, device)

    def norm(qkv, qw, kw, cs, pos):
        kvwrite.fused_qk_norm_rope(qkv, 4, 2, 2, 64, 1e-6, qw, kw, cs, True, pos,
                                   weight_offset=1.0, implementation=impl)

    def fused(qkv, qw, kw, cs, pos, kc, vc, slots, qo):
        kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
            qkv, 4, 2, 2, 64, 1e-6, qw, kw, cs, True, pos, kc, vc, slots, None, None, "auto",
            weight_offset=1.0, rotate_key_in_place=False, query_out=qo, implementation=impl)

    def nargs(i):
        return (i.qkv, i.q_weight, i.k_weight, i.cos_sin_cache, i.position_ids)

    def fargs(i):
        return (*nargs(i), i.key_cache, i.value_cache, i.slot_mapping, i.query_out)

    assert compiled_targets(norm, *nargs(make_qk_norm_inputs(case, device))) == [
        "kvwrite.fused_qk_norm_rope"]
    assert compiled_targets(fused, *fargs(make_qk_norm_inputs(case, device))) == [
        "kvwrite.fused_qk_norm_rope_and_reshape_cache_flash"]
    # Through AOT autograd's functionalization, on fresh inputs: the mutations are kept.
    for fn, args, op in ((norm, nargs, NORM), (fused, fargs, FUSED)):
        got, want = make_qk_norm_inputs(case, device), make_qk_norm_inputs(case, device)
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*args(got))
        if op == NORM:
            kvwrite.fused_qk_norm_rope(*want.norm_args(), **want.norm_kwargs(),
                                       implementation="torch")
        else:
            kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
                *want.fused_args(), **want.fused_kwargs(), implementation="torch")
        assert_same(got, want, names=None if op == FUSED else _norm_names(want))


def test_sanitize_cases_are_listed():
    from tools.sanitize import fused_qk_norm_rope as norm_san
    from tools.sanitize import fused_qk_norm_rope_and_reshape_cache_flash as fused_san
    for mod in (norm_san, fused_san):
        listed = mod.cases()
        assert listed and len({i for i, _ in listed}) == len(listed)
        assert all(callable(fn) for _, fn in listed)
    for case in norm_san.CASES + fused_san.CASES:  # the inputs build on the CPU
        if case.num_tokens < 1000:
            make_qk_norm_inputs(case)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["norm", "fused"])
def test_gpu_sanitize_cases_pass(which):
    if which == "norm":
        from tools.sanitize import fused_qk_norm_rope as sanitize
    else:
        from tools.sanitize import fused_qk_norm_rope_and_reshape_cache_flash as sanitize
    failed = {i: r for i, fn in sanitize.cases() if (r := fn()) is not None}
    assert not failed, failed


def test_case_ids_are_unique():
    for cases in (NORM_CASES, FUSED_CASES, GPU_NORM_CASES, GPU_FUSED_CASES):
        ids = [c.id for c in cases]
        assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]
    assert dataclasses.replace(QkNormCase(), eps=0).id != QkNormCase().id


# --- the builder is device-independent; comparisons take whole allocations -----------------------

def _all_built_cases() -> list[QkNormCase]:
    from tools.sanitize import fused_qk_norm_rope as norm_san
    from tools.sanitize import fused_qk_norm_rope_and_reshape_cache_flash as fused_san
    cases = NORM_CASES + FUSED_CASES + [c for _, c in _GPU_SAMPLE] + norm_san.CASES + fused_san.CASES
    return [c for c in cases if c.num_tokens < 1000]


def test_builder_gives_the_same_allocations_on_every_device():
    """make_qk_norm_inputs(case, device) has the CPU build's allocation sizes, view geometry
    (dtype, shape, strides, offset) and sharing whatever the device: checked against a 'meta'
    build (the path every non-CPU device takes) and, bytes included, against the CPU build moved
    whole to the CPU (the same path, forced), for the CPU matrices, the cases the GPU compares
    with the CPU reference and the memory-checker cases."""
    from kvwrite.testing.qk_norm import geometry
    for case in _all_built_cases():
        cpu = make_qk_norm_inputs(case, "cpu")
        want = geometry(cpu)
        meta = make_qk_norm_inputs(case, "meta")
        assert all(t.is_meta for t in meta.tensors().values()), case.id
        assert geometry(meta) == want, case.id
        moved = clone_inputs(cpu, "cpu")
        assert all(t.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
                   for t, c in zip(moved.tensors().values(), cpu.tensors().values(), strict=True)
                   if c.untyped_storage().nbytes()), case.id  # copies, not the same memory
        assert geometry(moved) == want, case.id
        assert differences(moved, cpu) is None, case.id


def test_builder_keeps_padding_and_sharing():
    """The allocations the GPU comparisons depend on: qkv's row padding and spare region, K and
    V in one allocation (interleaved, packed), query_out inside qkv's allocation."""
    from kvwrite.testing.qk_norm import geometry
    case = QkNormCase(num_tokens=5, row_pad=8, query_out="spare", alloc=KVAlloc.INTERLEAVED)
    g = geometry(make_qk_norm_inputs(case, "meta"))
    rows, width = 5, (4 + 2 + 2) * 64 + 8 + 4 * 64
    assert g["qkv"][4] == g["query_out"][4] == rows * width * 2
    assert g["qkv"][5] == g["query_out"][5]
    assert g["key_cache"][5] == g["value_cache"][5]
    assert g["key_cache"][4] == 2 * 8 * 16 * 2 * 64 * 2
    for alloc in (KVAlloc.PACKED, KVAlloc.SEPARATE):
        g = geometry(make_qk_norm_inputs(dataclasses.replace(case, alloc=alloc), "meta"))
        assert (g["key_cache"][5] == g["value_cache"][5]) == (alloc is KVAlloc.PACKED)


def test_differences_compares_whole_allocations_and_their_geometry():
    """A byte changed outside every view (qkv's row padding, between the key blocks of an
    interleaved cache) is caught, and so is a compact copy of a view (what Tensor.cpu() of a
    view on another device gives), by its geometry, before any byte is compared."""
    case = QkNormCase(num_tokens=5, row_pad=8, alloc=KVAlloc.INTERLEAVED)
    want = make_qk_norm_inputs(case)
    assert differences(clone_inputs(want), want) is None
    got = clone_inputs(want)
    pad = got.qkv.flatten(1)
    storage_row = pad.stride(0) * pad.element_size()
    qkv_bytes = kvwrite.testing.compare.storage_bytes(got.qkv)
    qkv_bytes[storage_row - 1] ^= 1  # the last byte of row 0's padding
    assert "qkv: 1 bytes differ" in differences(got, want)
    got = clone_inputs(want)
    vb = kvwrite.testing.compare.storage_bytes(got.value_cache)
    off = got.value_cache.storage_offset() * got.value_cache.element_size()
    vb[off] ^= 0x40  # the value cache's first byte: in key_cache's allocation too
    assert "key_cache: 1 bytes differ" in differences(got, want)
    got = clone_inputs(want)
    got.key_cache = got.key_cache.contiguous()
    assert differences(got, want) == ("key_cache: stride differs (got "
                                      f"{got.key_cache.stride()}, want "
                                      f"{want.key_cache.stride()})")
    got = clone_inputs(want)
    q = got.qkv
    wider = torch.zeros(q.untyped_storage().nbytes() + 16, dtype=torch.uint8)
    got.qkv = wider.view(q.dtype).as_strided(q.shape, q.stride(), q.storage_offset())
    got.qkv.copy_(q)
    assert differences(got, want).startswith("qkv: allocation bytes differs")


def test_pow2_scales_case_gives_the_scales_it_names():
    """fp8_scales="pow2" (the GPU matrix's cases of the kernel's power-of-two path): k, v and q
    scales by head from POW2_SCALES (v's reversed), 1.0 per tensor; powers whose reciprocal is a
    normal float and others (the quotient) side by side."""
    from kvwrite.testing.qk_norm import POW2_SCALES, make_qk_norm_inputs
    per_head = QkNormCase(num_q_heads=8, num_k_heads=8, head_size=128, kv_cache_dtype="fp8",
                          per_head_scale=True, query_out="fp8_e4m3", q_scale_per_head=True,
                          fp8_scales="pow2")
    inp = make_qk_norm_inputs(per_head)
    want = torch.tensor(POW2_SCALES, dtype=torch.float32)
    assert torch.equal(inp.k_scale.reshape(-1), want)
    assert torch.equal(inp.v_scale.reshape(-1), want.flip(0))
    assert torch.equal(inp.q_scale.reshape(-1), want)
    assert {2.0**-126, 2.0**126, 2.0**127, 3.0} <= set(want.tolist())
    tensor = make_qk_norm_inputs(dataclasses.replace(per_head, per_head_scale=False,
                                                     q_scale_per_head=False))
    assert tensor.k_scale.numel() == tensor.v_scale.numel() == tensor.q_scale.numel() == 1
    assert float(tensor.k_scale) == float(tensor.v_scale) == float(tensor.q_scale) == 1.0
    with pytest.raises(ValueError, match="fp8_scales"):
        make_qk_norm_inputs(dataclasses.replace(per_head, fp8_scales="unit"))


def test_fast16_scales_case_gives_the_scales_it_names():
    """fp8_scales="fast16" (the GPU matrix's cases of fp8_quantize_fast16): k and v scales by head
    from FAST16_SCALES (v's reversed), the first per tensor; scales inside its ranges (their ends
    too) and just outside side by side."""
    from kvwrite.testing.qk_norm import FAST16_SCALES, make_qk_norm_inputs
    per_head = QkNormCase(num_q_heads=8, num_k_heads=8, head_size=128, kv_cache_dtype="fp8",
                          per_head_scale=True, fp8_scales="fast16")
    inp = make_qk_norm_inputs(per_head)
    want = torch.tensor(FAST16_SCALES, dtype=torch.float32)
    assert torch.equal(inp.k_scale.reshape(-1), want)
    assert torch.equal(inp.v_scale.reshape(-1), want.flip(0))
    inside = [2.0**-60 <= v <= 1.0 for v in want.tolist()]
    assert 2.0**-60 in want.tolist() and any(inside) and not all(inside)
    assert {1.0 + 2.0**-23, 2.0**-61, 300.0} <= set(want.tolist())
    tensor = make_qk_norm_inputs(dataclasses.replace(per_head, per_head_scale=False))
    assert float(tensor.k_scale) == float(tensor.v_scale) == FAST16_SCALES[0]
