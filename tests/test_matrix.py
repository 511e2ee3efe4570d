"""Every registered implementation over the case matrix, byte-exact against the oracle.

On CPU this runs the torch reference (and Triton's interpreter where it is exact); on a GPU
(`gpu` marker) every implementation available there. The whole allocation behind each cache is
compared, so stray writes are caught as well as wrong ones. Wrong writers, CUDA graphs and
torch.compile: tests/test_conformance.py (kvwrite.testing.providers.reshape_and_cache_flash).
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.ops.reshape_and_cache_flash import OP
from kvwrite.testing import CASES, Case, assert_caches_equal, clone_caches, make_inputs
from oracle import oracle
from params import DEVICES, impl_names

IMPLS = impl_names(OP)
# torch-compile compiles once per case signature (minutes over the whole matrix); its bytes are
# checked by tests/test_peers.py and, before timing, by the benchmark.
MATRIX_IMPLS = [name for name in IMPLS if name != "torch-compile"]


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
