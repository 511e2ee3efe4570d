"""Every registered implementation over the case matrix, byte-exact against the oracle.

On CPU this runs the torch reference (and Triton's interpreter where it is exact); on a GPU
(`gpu` marker) every implementation available there. The whole allocation behind each cache is
compared, so stray writes are caught as well as wrong ones.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.ops.reshape_and_cache_flash import reference as torch_ref
from kvwrite.testing import CASES, Case, assert_caches_equal, clone_caches, make_inputs
from kvwrite.testing.compile import compiled_targets
from oracle import oracle

IMPLS = [info.name for info in registry.all_impls(OP)]
# torch-compile compiles once per case signature (minutes over the whole matrix); its bytes are
# checked by tests/test_peers.py and, before timing, by the benchmark.
MATRIX_IMPLS = [name for name in IMPLS if name != "torch-compile"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@functools.cache
def expected_caches(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's caches for `case` (CPU), computed once per case."""
    inp = make_inputs(case)
    kc, vc = clone_caches(inp)
    oracle(inp.key, inp.value, kc, vc, inp.slot_mapping, case.cache_dtype, inp.k_scale, inp.v_scale)
    return kc, vc


def check_against_oracle(case: Case, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    ek, ev = expected_caches(case)
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    # NaN's sign and payload are not part of the contract (the fp8 rule: "NaN stays NaN").
    assert_caches_equal(key_cache, ek, "key_cache", fp8, nan_equal=fp8 is not None)
    assert_caches_equal(value_cache, ev, "value_cache", fp8, nan_equal=fp8 is not None)


def run_case(impl: str, case: Case, device: str):
    info = registry.get(OP, impl)
    reason = info.available(device)
    if reason is not None:
        pytest.skip(reason)
    inp = make_inputs(case, device)
    reason = info.unsupported(inp.key, inp.key_cache, case.cache_dtype, inp.k_scale, inp.v_scale)
    if reason is None:  # a peer's slot conversion (FlashInfer: no padding) says what it refuses
        reason = info.prepare(inp.key, inp.value, inp.key_cache, inp.value_cache,
                              inp.slot_mapping, case.cache_dtype, inp.k_scale, inp.v_scale)
    if reason is not None:
        pytest.skip(reason)
    kvwrite.reshape_and_cache_flash(*inp.args(), implementation=impl)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", MATRIX_IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_oracle(impl, case, device):
    inp = run_case(impl, case, device)
    check_against_oracle(case, *clone_caches(inp, "cpu"))


def test_matrix_covers_the_contract():
    """The matrix holds every layout, allocation, dtype and cache dtype the contract names."""
    seen = {(c.layout, c.alloc) for c in CASES}
    assert seen == {(lo, a) for lo in Layout for a in KVAlloc}
    assert {c.dtype for c in CASES} == {torch.float16, torch.bfloat16, torch.float32}
    assert {c.kv_cache_dtype for c in CASES} >= {"auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2"}
    assert {c.head_size for c in CASES} >= {46, 64, 80, 96, 120, 256}
    assert {c.num_heads for c in CASES} >= {1, 8, 13}
    assert {c.num_tokens for c in CASES} >= {0, 1, 7, 129}
    assert any(c.per_head_scale for c in CASES) and any(c.special_values for c in CASES)
    assert any(c.slot_dtype == torch.int32 for c in CASES)
    assert any(c.padding_slots and c.out_of_range_slots for c in CASES)
    assert any(c.fused_qkv for c in CASES) and any(c.extra_rows for c in CASES)


# --- the checker can fail -------------------------------------------------------------------------

def _skip_last_token(key, value, key_cache, value_cache, slot_mapping, *rest):
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping[:-1], *rest)


def _ignore_strides(key, value, key_cache, value_cache, slot_mapping, *rest):
    """Writes as if every cache were a separate, contiguous NHD tensor."""
    nb, bs, h, d = key_cache.shape
    flat_k = key_cache.as_strided((nb, bs, h, d), (bs * h * d, h * d, d, 1))
    flat_v = value_cache.as_strided((nb, bs, h, d), (bs * h * d, h * d, d, 1))
    torch_ref.run(key, value, flat_k, flat_v, slot_mapping, *rest)


def _key_into_value(key, value, key_cache, value_cache, slot_mapping, *rest):
    torch_ref.run(key, key, key_cache, value_cache, slot_mapping, *rest)


def _multiply_by_reciprocal(key, value, key_cache, value_cache, slot_mapping, cache_dtype, ks, vs):
    """fp8 with x * (1/s) instead of x / s: differs from the rule on some values."""
    torch_ref.run(key, value, key_cache, value_cache, slot_mapping, cache_dtype, ks, vs)
    if cache_dtype.is_fp8:
        from kvwrite.dtypes import FP8_MAX
        fp8 = cache_dtype.fp8_dtype
        for src, cache, s in ((key, key_cache, ks), (value, value_cache, vs)):
            sl = slot_mapping.long()
            keep = (sl >= 0) & (sl < cache.shape[0] * cache.shape[1])
            t, sl = torch.nonzero(keep).flatten(), sl[keep]
            r = 1.0 / s.reshape(1, -1, 1)
            q = (src[t].float() * r).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
            cache[sl // cache.shape[1], sl % cache.shape[1]] = q.view(torch.uint8) if cache.dtype == torch.uint8 else q


@pytest.mark.parametrize("broken, case", [
    (_skip_last_token, Case(num_tokens=7)),
    (_ignore_strides, Case(layout=Layout.HND)),
    (_ignore_strides, Case(alloc=KVAlloc.PACKED)),
    (_key_into_value, Case()),
    (_multiply_by_reciprocal, Case(kv_cache_dtype="fp8", num_tokens=9, num_heads=4, head_size=32,
                                   dtype=torch.float32, special_values=True)),
    (_multiply_by_reciprocal, Case(kv_cache_dtype="fp8_e5m2", num_tokens=9, num_heads=4, head_size=32,
                                   dtype=torch.float32, special_values=True, per_head_scale=True)),
], ids=["skip-last-token", "hnd-as-nhd", "packed-as-separate", "key-into-value", "reciprocal-e4m3",
     "reciprocal-e5m2-per-head"])
def test_checker_rejects_wrong_implementations(broken, case):
    inp = make_inputs(case)
    broken(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping,
           parse_kv_cache_dtype(case.kv_cache_dtype), inp.k_scale, inp.v_scale)
    with pytest.raises(AssertionError, match="bytes differ"):
        check_against_oracle(case, inp.key_cache, inp.value_cache)


# --- CUDA graphs and torch.compile ------------------------------------------------------------------

GRAPH_CASE = Case(num_tokens=40, num_heads=4, head_size=64, kv_cache_dtype="fp8", per_head_scale=True,
                  layout=Layout.HND, alloc=KVAlloc.PACKED, padding_slots=3, out_of_range_slots=2,
                  num_blocks=8)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(OP) if i.graph_safe])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cuda_graph_replay_sees_new_inputs(impl, kv):
    """Capture once, then change key, value, slots and scales in place: the replay uses them."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    if hasattr(info._mod(), "prepare"):
        pytest.skip(f"{impl} converts its slots before capture (prepare); new slots need a new "
                    "conversion, as its users rebuild their page table before a replay")
    case = Case(**{**GRAPH_CASE.__dict__, "kv_cache_dtype": kv})
    first = make_inputs(case, "cuda", seed=1)
    kvwrite.reshape_and_cache_flash(*first.args(), implementation=impl)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.reshape_and_cache_flash(*first.args(), implementation=impl)
    second = make_inputs(case, "cuda", seed=2)
    for dst, src in ((first.key, second.key), (first.value, second.value),
                     (first.slot_mapping, second.slot_mapping), (first.k_scale, second.k_scale),
                     (first.v_scale, second.v_scale)):
        dst.copy_(src)
    kc, vc = clone_caches(second)
    first.key_cache.copy_(kc)
    first.value_cache.copy_(vc)
    ek, ev = clone_caches(second)
    kvwrite.reshape_and_cache_flash(*second.args()[:2], ek, ev, *second.args()[4:], implementation="torch")
    graph.replay()
    torch.cuda.synchronize()
    fp8 = case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None
    assert_caches_equal(first.key_cache, ek, "key_cache", fp8, nan_equal=True)
    assert_caches_equal(first.value_cache, ev, "value_cache", fp8, nan_equal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_sees_a_mutating_custom_op(impl, device):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    case = Case(num_tokens=9, kv_cache_dtype="auto", layout=Layout.HND, padding_slots=2)
    inp = make_inputs(case, device)
    if (reason := info.prepare(inp.key, inp.value, inp.key_cache, inp.value_cache,
                               inp.slot_mapping, case.cache_dtype, None, None)) is not None:
        pytest.skip(reason)

    def step(key, value, key_cache, value_cache, slot_mapping):
        kvwrite.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto",
                                        implementation=impl)

    assert compiled_targets(step, *inp.args()[:5]) == ["kvwrite.reshape_and_cache_flash"]

    # Through AOT autograd's functionalization too, on fresh caches.
    inp = make_inputs(case, device)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(*inp.args()[:5])
    check_against_oracle(case, *clone_caches(inp, "cpu"))
