"""A per-head scale for one of K and V and a per-tensor scale for the other (issue #40).

The contract lets ``k_scale`` and ``v_scale`` each be ``[1]`` (per tensor) or ``[H]`` (per head)
independently; every launcher must take each scale's kind from that scale's own tensor
(kvwrite.dtypes.scale_is_per_head). Every implementation of every op that writes fp8 caches, for
both mixes and both fp8 formats, writes the torch reference's bytes over the whole allocations
of both caches (bytes it must not touch included): eagerly, in CUDA-graph replay with new scale
values, and, on the CPU, Triton's kernels under the interpreter on inputs it computes exactly.

The ``[1]`` scale of a mix is the first element of an ``[H]`` allocation of other values (each
head's own), so a kernel that reads it per head reads those values, deterministically and
inside the allocation, instead of ``scale[0]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import parse_kv_cache_dtype, scale_is_per_head
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops import fused_qk_norm_rope_and_reshape_cache_flash as qk_pkg
from kvwrite.ops import fused_rope_and_reshape_cache_flash as rope_pkg
from kvwrite.ops import reshape_and_cache as legacy_pkg
from kvwrite.ops import reshape_and_cache_flash as flash_pkg
from kvwrite.testing import Case, assert_caches_equal, make_inputs, storage_bytes
from kvwrite.testing.legacy import LegacyCase, make_legacy_inputs
from kvwrite.testing.qk_norm import QkNormCase, make_qk_norm_inputs
from kvwrite.testing.rope import RopeCase, make_rope_inputs
from params import DEVICES

FP8 = ["fp8", "fp8_e5m2"]
# Which scale is per head; the other is per tensor.
MIXES = ["k-per-head", "v-per-head"]


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """One op that writes fp8 caches: how to build a call of it (per-head scales for K and V,
    from the op's case model), call it, and ask an implementation whether it runs the call."""

    name: str
    # (kv_cache_dtype, input dtype, device, seed) -> the op's inputs object.
    build: Callable
    call: Callable             # (inputs, implementation) -> None
    unsupported: Callable      # (ImplInfo, inputs) -> str | None
    key_heads: Callable        # inputs -> the key rows [T, H, D] as written (before any rotation)
    value_heads: Callable      # inputs -> the value rows [T, H, D]


def _flash_build(kv, dtype, device, seed):
    return make_inputs(Case(num_tokens=40, num_heads=8, head_size=64, dtype=dtype,
                            kv_cache_dtype=kv, per_head_scale=True, padding_slots=3,
                            out_of_range_slots=2), device, seed)


def _flash_unsupported(info, inp):
    cdt = parse_kv_cache_dtype(inp.kv_cache_dtype)
    reason = info.unsupported(inp.key, inp.key_cache, cdt, inp.k_scale, inp.v_scale)
    if reason is None:  # a peer's slot conversion (FlashInfer: no padding) says what it refuses
        reason = info.prepare(inp.key, inp.value, inp.key_cache, inp.value_cache,
                              inp.slot_mapping, cdt, inp.k_scale, inp.v_scale)
    return reason


def _legacy_build(kv, dtype, device, seed):
    return make_legacy_inputs(LegacyCase(num_tokens=40, num_heads=8, head_size=64, dtype=dtype,
                                         kv_cache_dtype=kv, per_head_scale=True,
                                         cache_strides="padded", padding_slots=3,
                                         out_of_range_slots=2), device, seed)


def _legacy_unsupported(info, inp):
    return info.unsupported(inp.key, inp.key_cache, parse_kv_cache_dtype(inp.kv_cache_dtype),
                            inp.k_scale)


def _rope_build(kv, dtype, device, seed):
    return make_rope_inputs(RopeCase(num_tokens=40, num_q_heads=8, num_heads=8, head_size=64,
                                     dtype=dtype, kv_cache_dtype=kv, per_head_scale=True,
                                     layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=3),
                            device, seed)


def _rope_unsupported(info, inp):
    return info.unsupported(inp.query, inp.key, inp.key_cache,
                            parse_kv_cache_dtype(inp.kv_cache_dtype), inp.cos_sin_cache,
                            inp.is_neox)


def _qk_build(kv, dtype, device, seed):
    # eps = 0: the norm of a row of equal magnitudes 2^j is exact (the interpreter's variant).
    return make_qk_norm_inputs(QkNormCase(num_tokens=40, num_q_heads=8, num_k_heads=8,
                                          head_size=64, dtype=dtype, kv_cache_dtype=kv,
                                          per_head_scale=True, padding_slots=3, eps=0.0),
                               device, seed)


def _qk_unsupported(info, inp):
    view, _, _, cdt, qo, _ = qk_pkg.op.validate(*inp.fused_args(), **inp.fused_kwargs())
    return info.unsupported(view, inp.q_weight, inp.k_weight, inp.cos_sin_cache, inp.is_neox,
                            inp.key_cache, cdt, qo)


def _qk_heads(inp, first: int) -> torch.Tensor:
    return inp.heads()[:, first:first + inp.num_heads_k]


OPS = [
    FusedOp(flash_pkg.OP, _flash_build,
            lambda inp, impl: kvwrite.reshape_and_cache_flash(*inp.args(), implementation=impl),
            _flash_unsupported, lambda inp: inp.key, lambda inp: inp.value),
    FusedOp(legacy_pkg.OP, _legacy_build,
            lambda inp, impl: kvwrite.reshape_and_cache(*inp.args(), implementation=impl),
            _legacy_unsupported, lambda inp: inp.key, lambda inp: inp.value),
    FusedOp(rope_pkg.OP, _rope_build,
            lambda inp, impl: kvwrite.fused_rope_and_reshape_cache_flash(
                *inp.fused_args(), **inp.fused_kwargs(), implementation=impl),
            _rope_unsupported, lambda inp: inp.key, lambda inp: inp.value),
    FusedOp(qk_pkg.OP, _qk_build,
            lambda inp, impl: kvwrite.fused_qk_norm_rope_and_reshape_cache_flash(
                *inp.fused_args(), **inp.fused_kwargs(), implementation=impl),
            _qk_unsupported, lambda inp: _qk_heads(inp, inp.num_heads_q),
            lambda inp: _qk_heads(inp, inp.num_heads_q + inp.num_heads_k)),
]
OPS_BY_NAME = {op.name: op for op in OPS}
# Every (op, implementation) pair the registry holds (torch-compile compiles for minutes; its
# bytes are checked by tests/test_peers.py).
PAIRS = [(op.name, info.name) for op in OPS for info in registry.all_impls(op.name)
         if info.name != "torch-compile"]
GRAPH_PAIRS = [(op, impl) for op, impl in PAIRS if registry.get(op, impl).graph_safe]


def mixed(inp, mix: str):
    """``inp`` with one scale per tensor: the first element of its ``[H]`` allocation."""
    if mix == "k-per-head":
        inp.v_scale = inp.v_scale[:1]
    else:
        inp.k_scale = inp.k_scale[:1]
    assert scale_is_per_head(inp.k_scale) == (mix == "k-per-head")
    assert scale_is_per_head(inp.v_scale) == (mix == "v-per-head")
    return inp


def build(op: FusedOp, kv: str, mix: str, device, seed: int, dtype=torch.bfloat16):
    return mixed(op.build(kv, dtype, device, seed), mix)


def reference(op: FusedOp, kv: str, mix: str, device, seed: int, dtype=torch.bfloat16,
              prepare: Callable | None = None):
    """The torch reference's call of the same inputs on ``device`` (each op's own tests check
    the reference against an independent oracle on every device)."""
    want = build(op, kv, mix, device, seed, dtype)
    if prepare is not None:
        prepare(want)
    op.call(want, "torch")
    return want


def assert_same_caches(got, want, kv: str) -> None:
    fp8 = parse_kv_cache_dtype(kv).fp8_dtype
    # NaN's sign and payload are not part of the contract (the fp8 rule: "NaN stays NaN").
    assert_caches_equal(got.key_cache, want.key_cache, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(got.value_cache, want.value_cache, "value_cache", fp8, nan_equal=True)


def _runnable(op: FusedOp, impl: str, inp, device) -> None:
    info = registry.get(op.name, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    if (reason := op.unsupported(info, inp)) is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("op_name, impl", PAIRS)
def test_mixed_scale_kinds_match_reference(op_name, impl, mix, kv, device):
    op = OPS_BY_NAME[op_name]
    got = build(op, kv, mix, device, seed=1)
    _runnable(op, impl, got, device)
    op.call(got, impl)
    assert_same_caches(got, reference(op, kv, mix, device, seed=1), kv)


def _tensors(inp) -> list[torch.Tensor]:
    return [v for f in dataclasses.fields(inp)
            if isinstance(v := getattr(inp, f.name), torch.Tensor)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("op_name, impl", GRAPH_PAIRS)
def test_mixed_scale_kinds_in_cuda_graph_replay(op_name, impl, mix, kv):
    """Capture once, then change every input in place, the scales' values included (each whole
    allocation, so the values behind a ``[1]`` scale change too): the replay writes what the
    reference writes for the new values."""
    op = OPS_BY_NAME[op_name]
    live = build(op, kv, mix, "cuda", seed=1)
    _runnable(op, impl, live, "cuda")
    op.call(live, impl)  # compiles and loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.call(live, impl)
    for seed in (2, 3):
        new = build(op, kv, mix, "cuda", seed=seed)
        for dst, src in zip(_tensors(live), _tensors(new), strict=True):
            storage_bytes(dst).copy_(storage_bytes(src))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_caches(live, reference(op, kv, mix, "cuda", seed=seed), kv)


# --- Triton's kernels under the interpreter ------------------------------------------------------

_TRITON_PAIRS = [p for p in PAIRS if p[1] == "triton"]


def _fp8_exact(shape, scale: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """float32 ``m * 2^e * scale[h]`` (``shape`` ``[T, H, D]``, ``scale`` one power of two per
    head): ``m`` of two significand bits and ``e`` in [-3, 3], so ``x / scale[h]`` is a normal
    value of either fp8 format, exactly: no cast of the call rounds."""
    m = 1.0 + torch.randint(0, 4, shape, generator=gen).float() / 4
    e = torch.exp2(torch.randint(-3, 4, shape, generator=gen).float())
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return sign * m * e * scale.reshape(1, -1, 1)


def _exact_inputs(op: FusedOp, kv: str, mix: str, seed: int):
    """A function that makes ``inp`` (float32, on the CPU) a call that Triton's interpreter
    computes exactly: power-of-two scales, different per head and between K and V; rows that are
    fp8 values times their head's scale; every position 0 (the identity rotation); for the
    QK-norm op, key rows of one magnitude 2^j per head (eps = 0: the norm divides exactly) and a
    key weight of fp8 values, so that the normed key is ± the weight."""

    def prepare(inp):
        gen = torch.Generator().manual_seed(seed)
        h = inp.key_cache.shape[1] if op.name == legacy_pkg.OP else inp.key_cache.shape[2]
        # Set the whole [H] allocations: the [1] scale is their first element.
        ks_all = torch.exp2(torch.arange(h) % 5 - 2.0)
        vs_all = torch.exp2(torch.arange(h).flip(0) % 5 - 2.0)
        storage_bytes(inp.k_scale).view(torch.float32).copy_(ks_all)
        storage_bytes(inp.v_scale).view(torch.float32).copy_(vs_all)
        ks = ks_all if scale_is_per_head(inp.k_scale) else ks_all[:1].expand(h)
        vs = vs_all if scale_is_per_head(inp.v_scale) else vs_all[:1].expand(h)
        key, value = op.key_heads(inp), op.value_heads(inp)
        value.copy_(_fp8_exact(value.shape, vs, gen))
        if op.name == qk_pkg.OP:
            d = key.shape[-1]
            inp.k_weight.copy_(_fp8_exact((1, 1, d), torch.ones(1), gen).flatten())
            mag = torch.exp2(torch.randint(-4, 5, key.shape[:2] + (1,), generator=gen).float())
            sign = torch.where(torch.rand(key.shape, generator=gen) < 0.5, -1.0, 1.0)
            key.copy_(sign * mag)  # normed: sign * weight, fp8 values as _fp8_exact's
        else:
            key.copy_(_fp8_exact(key.shape, ks, gen))
        positions = inp.position_ids if op.name == qk_pkg.OP else getattr(inp, "positions", None)
        if positions is not None:
            positions.zero_()

    return prepare


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's variant (CPU only)")
@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("op_name, impl", _TRITON_PAIRS)
def test_mixed_scale_kinds_triton_interpreter(monkeypatch, op_name, impl, mix, kv):
    """Triton's kernel on the CPU (TRITON_INTERPRET=1) on inputs it computes exactly: its
    ``unsupported``, which refuses fp8 caches there for the casts it may round differently, is
    bypassed, and the whole allocations still match the reference."""
    op = OPS_BY_NAME[op_name]
    info = registry.get(op.name, impl)
    if (reason := info.available("cpu")) is not None:
        pytest.skip(reason)
    prepare = _exact_inputs(op, kv, mix, seed=5)
    got = build(op, kv, mix, "cpu", seed=1, dtype=torch.float32)
    prepare(got)
    monkeypatch.setattr(info._mod(), "unsupported", lambda *args: None)
    op.call(got, impl)
    assert_same_caches(got, reference(op, kv, mix, "cpu", seed=1, dtype=torch.float32,
                                      prepare=prepare), kv)
