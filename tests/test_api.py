"""The public API: validation errors, cache allocation, slot checks, the implementation list."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvwrite
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.testing import Case, assert_caches_equal, clone_caches, make_inputs

BASE = Case(num_tokens=5, num_heads=4, head_size=16, kv_cache_dtype="fp8", num_blocks=4)


def _args(case: Case = BASE) -> dict:
    inp = make_inputs(case)
    return dict(key=inp.key, value=inp.value, key_cache=inp.key_cache, value_cache=inp.value_cache,
                slot_mapping=inp.slot_mapping, kv_cache_dtype=inp.kv_cache_dtype,
                k_scale=inp.k_scale, v_scale=inp.v_scale)


def _other_layout_cache(a):
    k, _ = allocate_kv_cache(4, 16, 4, 16, torch.uint8, Layout.HND, device="cpu")
    return k


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# (name, change to the valid arguments, exception type, text the message must contain)
BAD = [
    ("key-not-tensor", lambda a: {"key": a["key"].tolist()}, TypeError, "key: expected a torch.Tensor, got list"),
    ("key-2d", lambda a: {"key": a["key"][:, 0]}, ValueError, "key: expected 3 dims"),
    ("value-shape", lambda a: {"value": a["value"][:, :2]}, ValueError, "value: expected the shape of key"),
    ("key-int", lambda a: {"key": a["key"].int(), "value": a["value"].int()}, ValueError,
     "key: expected dtype float16, bfloat16 or float32, got torch.int32"),
    ("value-dtype", lambda a: {"value": a["value"].half()}, ValueError, "value: expected the dtype of key"),
    ("key-sparse-heads", lambda a: {"key": torch.cat([a["key"], a["key"]], -1)[..., ::2]}, ValueError,
     "key: expected dense heads"),
    ("cache-3d", lambda a: {"key_cache": a["key_cache"][0]}, ValueError, "key_cache: expected 4 dims"),
    ("cache-heads", lambda a: {"key_cache": a["key_cache"][:, :, :2], "value_cache": a["value_cache"][:, :, :2]},
     ValueError, "key_cache: expected [num_blocks, block_size, 4, 16]"),
    ("value-cache-shape", lambda a: {"value_cache": a["value_cache"][:2]}, ValueError,
     "value_cache: expected the shape of key_cache"),
    ("value-cache-dtype", lambda a: {"value_cache": a["value_cache"].view(torch.float8_e4m3fn)}, ValueError,
     "value_cache: expected the dtype of key_cache"),
    ("value-cache-strides", lambda a: {"value_cache": _other_layout_cache(a)}, ValueError,
     "value_cache: expected the strides of key_cache"),
    ("cache-last-dim-stride", lambda a: {
        "key_cache": torch.empty(4, 16, 4, 32, dtype=torch.uint8)[..., ::2],
        "value_cache": torch.empty(4, 16, 4, 32, dtype=torch.uint8)[..., ::2]},
     ValueError, "key_cache: expected a unit-stride last dim"),
    ("auto-cache-dtype", lambda a: {"kv_cache_dtype": "auto"}, ValueError,
     "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects a cache of dtype torch.bfloat16, got torch.uint8"),
    ("e5m2-cache-for-e4m3", lambda a: {"key_cache": a["key_cache"].view(torch.float8_e5m2),
                                       "value_cache": a["value_cache"].view(torch.float8_e5m2)},
     ValueError, "expects a cache of dtype torch.uint8 or torch.float8_e4m3fn, got torch.float8_e5m2"),
    ("same-cache", lambda a: {"value_cache": a["key_cache"]}, ValueError,
     "value_cache: expected memory apart from key_cache's, got overlapping memory"),
    ("slots-2d", lambda a: {"slot_mapping": a["slot_mapping"][None]}, ValueError, "slot_mapping: expected 1 dim"),
    ("slots-float", lambda a: {"slot_mapping": a["slot_mapping"].float()}, ValueError,
     "slot_mapping: expected dtype int64 or int32, got torch.float32"),
    ("slots-strided", lambda a: {"slot_mapping": a["slot_mapping"].repeat(2)[::2]}, ValueError,
     "slot_mapping: expected a contiguous tensor"),
    ("slots-too-many", lambda a: {"slot_mapping": torch.arange(6)}, ValueError,
     "slot_mapping: expected at most key.shape[0] = 5 entries, got 6"),
    ("slots-device", lambda a: {"slot_mapping": _meta(a["slot_mapping"])}, ValueError,
     "slot_mapping: expected device cpu (that of key), got meta"),
    ("no-scale", lambda a: {"k_scale": None}, ValueError, "k_scale: kv_cache_dtype='fp8_e4m3' needs a float32 scale"),
    ("scale-dtype", lambda a: {"k_scale": a["k_scale"].double()}, ValueError,
     "k_scale: expected dtype float32, got torch.float64"),
    ("scale-numel", lambda a: {"v_scale": torch.ones(3)}, ValueError,
     "v_scale: expected 1 (per tensor) or 4 (per head) elements, got 3"),
    ("scale-device", lambda a: {"k_scale": _meta(a["k_scale"])}, ValueError, "k_scale: expected device cpu"),
    ("scale-strided", lambda a: {"k_scale": torch.ones(8)[::2]}, ValueError, "k_scale: expected a contiguous"),
    ("kv-cache-dtype", lambda a: {"kv_cache_dtype": "int8"}, ValueError, "kv_cache_dtype: expected one of"),
    ("implementation-unknown", lambda a: {"implementation": "nope"}, ValueError,
     "implementation: expected one of ['cuda', 'flashinfer', 'torch', 'torch-compile', 'triton', "
     "'vllm', 'vllm-triton'], got 'nope'"),
]


# Cases whose change replaces a cache with a tensor of another shape or memory.
CACHE_REPLACED = {"cache-3d", "cache-heads", "value-cache-shape", "value-cache-strides",
                  "cache-last-dim-stride", "same-cache"}


@pytest.mark.parametrize("name, change, exc, text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_caches_are_untouched(name, change, exc, text):
    args = _args()
    before_k, before_v = clone_caches(make_inputs(BASE))
    args.update(change(args))
    with pytest.raises(exc) as err:
        kvwrite.reshape_and_cache_flash(**args)
    assert text in str(err.value)
    # Every cache the call saw is as it was (the originals share no memory with replacements).
    assert_caches_equal(args["key_cache"] if name not in CACHE_REPLACED else before_k, before_k)
    if name not in CACHE_REPLACED:
        assert_caches_equal(args["value_cache"], before_v)


# One argument disagrees with all the others (the caches and the other input): the error names it.
# (name, op, mode, change, the message's start)
ODD_ONE = [
    ("key-head-size", "flash", "auto", lambda a: {"key": a["key"][..., :8]},
     "key: expected [num_tokens, 4, 16] (num_heads and head_size of key_cache and value)"),
    ("key-heads", "flash", "fp8", lambda a: {"key": a["key"][:, :2]}, "key: expected [num_tokens, 4, 16]"),
    ("key-dtype", "flash", "auto", lambda a: {"key": a["key"].half()},
     "key: expected dtype torch.bfloat16 (that of value"),
    ("key-cache-dtype", "flash", "auto", lambda a: {"key_cache": a["key_cache"].half()},
     "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects a cache of dtype torch.bfloat16"),
    ("value-head-size", "flash", "auto", lambda a: {"value": a["value"][..., :8]},
     "value: expected the shape of key"),
    ("value-dtype", "flash", "auto", lambda a: {"value": a["value"].half()}, "value: expected the dtype of key"),
    ("value-cache-dtype", "flash", "auto", lambda a: {"value_cache": a["value_cache"].half()},
     "value_cache: expected the dtype of key_cache"),
    ("key-head-size", "legacy", "auto", lambda a: {"key": a["key"][..., :8]},
     "key: expected [num_tokens, 4, 16] (num_heads and head_size of key_cache and value)"),
    ("key-dtype", "legacy", "auto", lambda a: {"key": a["key"].half()},
     "key: expected dtype torch.bfloat16 (that of value"),
    ("key-cache-dtype", "legacy", "auto", lambda a: {"key_cache": a["key_cache"].half()},
     "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects a cache of dtype torch.bfloat16"),
    ("value-head-size", "legacy", "auto", lambda a: {"value": a["value"][..., :8]},
     "value: expected the shape of key"),
    ("value-cache-dtype", "legacy", "auto", lambda a: {"value_cache": a["value_cache"].half()},
     "value_cache: expected the dtype of key_cache"),
]


def _odd_one_args(op: str, mode: str) -> dict:
    if op == "flash":
        return _args(dataclasses.replace(BASE, kv_cache_dtype=mode))
    from kvwrite.testing.legacy import LegacyCase, make_legacy_inputs
    inp = make_legacy_inputs(LegacyCase(kv_cache_dtype=mode, num_tokens=5, num_heads=4,
                                        head_size=16, num_blocks=2, block_size=4))
    return dict(key=inp.key, value=inp.value, key_cache=inp.key_cache,
                value_cache=inp.value_cache, slot_mapping=inp.slot_mapping, kv_cache_dtype=mode,
                k_scale=inp.k_scale, v_scale=inp.v_scale)


@pytest.mark.parametrize("name, op, mode, change, text", ODD_ONE,
                         ids=[f"{o[1]}-{o[0]}" for o in ODD_ONE])
def test_the_one_argument_that_disagrees_is_named(name, op, mode, change, text):
    args = _odd_one_args(op, mode)
    args.update(change(args))
    fn = kvwrite.reshape_and_cache_flash if op == "flash" else kvwrite.reshape_and_cache
    with pytest.raises(ValueError) as err:
        fn(**args)
    assert str(err.value).startswith(text), str(err.value)


def test_rejected_call_changes_no_byte():
    """A call rejected late in validation (bad v_scale) leaves both caches exactly as they were."""
    inp = make_inputs(BASE)
    before_k, before_v = clone_caches(inp)
    with pytest.raises(ValueError, match="v_scale"):
        kvwrite.reshape_and_cache_flash(*inp.args()[:7], torch.ones(3))
    assert_caches_equal(inp.key_cache, before_k, "key_cache")
    assert_caches_equal(inp.value_cache, before_v, "value_cache")


def test_named_implementation_that_cannot_run_says_why():
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine every implementation can run CPU-free cases")
    inp = make_inputs(BASE)
    with pytest.raises(ValueError, match=r"implementation='cuda' cannot run this call: .*cuda"):
        kvwrite.reshape_and_cache_flash(*inp.args(), implementation="cuda")


def test_default_implementation_on_cpu_is_torch(monkeypatch):
    from kvwrite.ops.reshape_and_cache_flash import op
    inp = make_inputs(BASE)
    chosen = op.select_implementation(inp.key, inp.value, inp.key_cache, inp.value_cache,
                                      inp.slot_mapping, BASE.cache_dtype, inp.k_scale, inp.v_scale)
    assert chosen.name == "torch"


def test_scales_are_ignored_outside_fp8():
    inp = make_inputs(dataclasses.replace(BASE, kv_cache_dtype="auto"))
    kvwrite.reshape_and_cache_flash(*inp.args()[:6], None, None)
    kvwrite.reshape_and_cache_flash(*inp.args()[:6], torch.ones(7, dtype=torch.float64), "junk")


def test_zero_tokens_is_a_no_op():
    inp = make_inputs(dataclasses.replace(BASE, num_tokens=0, extra_rows=2))
    before_k, before_v = clone_caches(inp)
    kvwrite.reshape_and_cache_flash(*inp.args())
    assert_caches_equal(inp.key_cache, before_k)
    assert_caches_equal(inp.value_cache, before_v)


# --- tensors that cannot be written, alias each other, or are tracked by autograd ------------------
# The rule is kvwrite.validation.check_mutation_safe, which every op calls; here through
# reshape_and_cache_flash, with a float cache (requires_grad needs a float dtype).

AUTO = Case(num_tokens=5, num_heads=4, head_size=16, kv_cache_dtype="auto", num_blocks=4)


def _shared_storage(a):
    """Both caches as views of one [num_blocks + 1, ...] allocation, shifted by one block."""
    st = torch.zeros((a["key_cache"].shape[0] + 1, *a["key_cache"].shape[1:]),
                     dtype=a["key_cache"].dtype)
    return {"key_cache": st[:-1], "value_cache": st[1:]}


def _stride0(a):
    kc = a["key_cache"]
    return {"key_cache": kc[:1].expand(kc.shape), "value_cache": a["value_cache"][:1].expand(kc.shape)}


def _key_in_cache(a):
    return {"key": a["key_cache"][0, :5], "value": a["value"]}


def _slots_in_cache(a):
    kc = a["key_cache"]
    raw = torch.zeros(kc.numel() * kc.element_size() + 64, dtype=torch.uint8)
    cache = raw[:kc.numel() * kc.element_size()].view(kc.dtype).view(kc.shape)
    slots = raw[-40:].view(torch.int64)[:5]
    slots.copy_(a["slot_mapping"])
    fold = raw[kc.numel() * kc.element_size() - 16:][:40].view(torch.int64)
    return {"key_cache": cache, "slot_mapping": fold}


def _folded_strides(a):
    kc = a["key_cache"]
    # Blocks 16 elements apart with 16 * 4 * 16 elements each: block 1 lies inside block 0.
    def folded():
        return torch.zeros(16 * 4 * 16 * 2, dtype=kc.dtype).as_strided(kc.shape, (16, 4 * 16, 16, 1))
    return {"key_cache": folded(), "value_cache": folded()}


# (name, change, text the message must contain). Each change makes a call that must be refused
# before a byte is written.
UNSAFE = [
    ("key-cache-requires-grad", lambda a: {"key_cache": a["key_cache"].requires_grad_(True)},
     "key_cache: expected a tensor that does not require grad"),
    ("value-cache-requires-grad", lambda a: {"value_cache": a["value_cache"].requires_grad_(True)},
     "value_cache: expected a tensor that does not require grad"),
    ("key-requires-grad", lambda a: {"key": a["key"].requires_grad_(True)},
     "key: expected a tensor that does not require grad (the op is not differentiable)"),
    ("value-requires-grad", lambda a: {"value": a["value"].requires_grad_(True)},
     "value: expected a tensor that does not require grad"),
    ("all-meta", lambda a: {k: _meta(v) for k, v in a.items() if isinstance(v, torch.Tensor)},
     "key_cache: expected a tensor with memory (cpu or cuda), got a meta tensor"),
    ("overlapping-caches", _shared_storage,
     "value_cache: expected memory apart from key_cache's, got overlapping memory"),
    ("block-stride-0", _stride0, "key_cache: expected every element in its own memory"),
    ("folded-strides", _folded_strides, "key_cache: expected every element in its own memory"),
    ("key-aliases-key-cache", _key_in_cache,
     "key: expected memory apart from key_cache's, got overlapping memory"),
    ("slots-alias-key-cache", _slots_in_cache,
     "slot_mapping: expected memory apart from key_cache's, got overlapping memory"),
]


@pytest.mark.parametrize("name, change, text", UNSAFE, ids=[u[0] for u in UNSAFE])
@pytest.mark.parametrize("implementation", ["torch", "triton", None])
def test_unsafe_tensors_are_refused_before_any_write(name, change, text, implementation):
    args = _args(AUTO)
    if implementation and kvwrite.registry.get("reshape_and_cache_flash", implementation
                                               ).available(args["key"].device):
        pytest.skip(f"{implementation} cannot run here")
    args.update(change(args))
    caches = [args["key_cache"], args["value_cache"]]
    before = [c.detach().clone() if c.device.type != "meta" else None for c in caches]
    stored = [c.untyped_storage() if c.device.type != "meta" else None for c in caches]
    snapshots = [bytes(s) if s is not None else None for s in stored]
    with pytest.raises(ValueError) as err:
        kvwrite.reshape_and_cache_flash(**args, implementation=implementation)
    assert text in str(err.value)
    assert "the same memory" not in str(err.value)
    for c, b, s, snap in zip(caches, before, stored, snapshots, strict=True):
        if b is not None:
            assert bytes(s) == snap  # the whole allocation, byte for byte
            assert c.grad_fn is None


def test_refused_before_any_write_under_torch_compile():
    args = _args(AUTO)
    args.update(_shared_storage(args))
    snap = bytes(args["key_cache"].untyped_storage())

    @torch.compile(backend="eager", fullgraph=True)
    def write(key, value, key_cache, value_cache, slot_mapping):
        kvwrite.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto")

    with pytest.raises(ValueError, match="value_cache: expected memory apart from key_cache's"):
        write(args["key"], args["value"], args["key_cache"], args["value_cache"],
              args["slot_mapping"])
    assert bytes(args["key_cache"].untyped_storage()) == snap


def test_inference_tensor_caches_are_written_inside_inference_mode_only():
    with torch.inference_mode():
        args = _args(AUTO)
    before_k, before_v = (args["key_cache"].clone(), args["value_cache"].clone())
    with pytest.raises(ValueError) as err:
        kvwrite.reshape_and_cache_flash(**args)
    assert "key_cache: expected a tensor writable here, got an inference tensor" in str(err.value)
    assert_caches_equal(args["key_cache"], before_k, "key_cache")
    assert_caches_equal(args["value_cache"], before_v, "value_cache")
    # Inside inference mode the same call writes what the reference writes.
    expected = _args(AUTO)
    kvwrite.reshape_and_cache_flash(**expected, implementation="torch")
    with torch.inference_mode():
        kvwrite.reshape_and_cache_flash(**args)
    assert_caches_equal(args["key_cache"], expected["key_cache"], "key_cache")
    assert_caches_equal(args["value_cache"], expected["value_cache"], "value_cache")


def test_inputs_that_require_grad_are_read_under_no_grad_and_caches_stay_plain():
    args, expected = _args(AUTO), _args(AUTO)
    kvwrite.reshape_and_cache_flash(**expected)
    args["key"].requires_grad_(True)
    args["value"].requires_grad_(True)
    with torch.no_grad():
        kvwrite.reshape_and_cache_flash(**args)
    for name in ("key_cache", "value_cache"):
        assert args[name].grad_fn is None and not args[name].requires_grad
        assert_caches_equal(args[name], expected[name], name)


def test_caches_that_only_interleave_are_accepted():
    """K and V blocks of one allocation, and K/V halves of a packed last dim, share no element."""
    from kvwrite.validation import check_mutation_safe
    for layout in Layout:
        for alloc in KVAlloc:
            k, v = allocate_kv_cache(3, 16, 4, 8, torch.float16, layout, alloc, "cpu")
            check_mutation_safe(outputs=[("key_cache", k), ("value_cache", v)])
    # Slices of one fused qkv (GQA: 8 query heads, 2 KV heads) written in place, read beside.
    qkv = torch.zeros(5, 12, 16)
    check_mutation_safe(outputs=[("query", qkv[:, :8]), ("key", qkv[:, 8:10])],
                        inputs=[("value", qkv[:, 10:])])
    with pytest.raises(ValueError, match="key: expected memory apart from query's"):
        check_mutation_safe(outputs=[("query", qkv[:, :8]), ("key", qkv[:, 7:9])])


def test_overlap_check_is_exact_where_the_fast_rule_cannot_decide():
    from kvwrite.validation import check_mutation_safe
    base = torch.zeros(16)
    # Offsets {0, 2, 4} + {0, 3} = {0, 2, 3, 4, 5, 7}: distinct, though stride 3 < 2 * 2 + 1.
    check_mutation_safe(outputs=[("out", base.as_strided((2, 3), (3, 2)))])
    with pytest.raises(ValueError, match="out: expected every element in its own memory"):
        check_mutation_safe(outputs=[("out", base.as_strided((2, 3), (2, 2)))])  # 2 + 0 = 0 + 2
    # Two outputs whose elements interleave at odd offsets, but never coincide; then do coincide.
    # a: elements {0, 4, 8}; b: {1, 2, 6, 7}, then {1, 2, 4, 5}.
    check_mutation_safe(outputs=[("a", base.as_strided((3,), (4,))),
                                 ("b", base.as_strided((2, 2), (5, 1), 1))])
    with pytest.raises(ValueError, match="b: expected memory apart from a's"):
        check_mutation_safe(outputs=[("a", base.as_strided((3,), (4,))),
                                     ("b", base.as_strided((2, 2), (3, 1), 1))])


# --- check_slot_mapping ------------------------------------------------------------------------------

def test_check_slot_mapping_names_bad_positions_and_values():
    slots = torch.tensor([0, 63, 64, -1, 100, 5], dtype=torch.int32)
    with pytest.raises(ValueError) as err:
        kvwrite.check_slot_mapping(slots, 64)
    msg = str(err.value)
    assert "num_slots = 64" in msg and "positions [2, 4]" in msg and "values [64, 100]" in msg


def test_check_slot_mapping_accepts_padding_and_valid_slots():
    kvwrite.check_slot_mapping(torch.tensor([0, 63, -1, -7]), 64)
    kvwrite.check_slot_mapping(torch.tensor([], dtype=torch.int64), 0)


def test_check_slot_mapping_rejects_non_integer():
    with pytest.raises(ValueError, match="slot_mapping: expected dtype int64 or int32"):
        kvwrite.check_slot_mapping(torch.tensor([0.0]), 4)


@pytest.mark.parametrize("num_slots, exc, text", [
    ("x", TypeError, "num_slots: expected a non-negative int, got str"),
    (4.0, TypeError, "num_slots: expected a non-negative int, got float"),
    (None, TypeError, "num_slots: expected a non-negative int, got NoneType"),
    (True, TypeError, "num_slots: expected a non-negative int, got bool"),
    (-1, ValueError, "num_slots: expected a non-negative int, got -1"),
])
def test_check_slot_mapping_rejects_a_bad_num_slots(num_slots, exc, text):
    with pytest.raises(exc) as err:
        kvwrite.check_slot_mapping(torch.tensor([0, 1]), num_slots)
    assert text in str(err.value)


def test_check_slot_mapping_takes_any_integer_num_slots():
    import numpy as np
    kvwrite.check_slot_mapping(torch.tensor([0, 3]), np.int64(4))
    with pytest.raises(ValueError, match="num_slots = 3"):
        kvwrite.check_slot_mapping(torch.tensor([0, 3]), torch.tensor(3))


# --- create_kv_caches_with_random_flash --------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_create_caches_interleave_k_and_v(layout):
    kc, vc = kvwrite.create_kv_caches_with_random_flash(3, 16, 2, 4, 8, "auto", torch.float16, seed=0,
                                                         device="cpu", cache_layout=layout)
    assert len(kc) == len(vc) == 2
    k, v = kc[0], vc[0]
    assert k.shape == v.shape == (3, 16, 4, 8) and k.dtype == torch.float16
    block = 2 * 16 * 4 * 8
    slot, head = (4 * 8, 8) if layout == "NHD" else (8, 16 * 8)
    assert k.stride() == v.stride() == (block, slot, head, 1)
    assert v.data_ptr() - k.data_ptr() == block // 2 * k.element_size()
    assert kc[1].data_ptr() != k.data_ptr()
    assert k.abs().max() <= 8**-0.5 and v.abs().max() <= 8**-0.5
    assert k.std() > 0.05


def test_create_caches_seeded_runs_reproduce():
    a = kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "bfloat16", seed=7, device="cpu")
    b = kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "bfloat16", seed=7, device="cpu")
    c = kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "bfloat16", seed=8, device="cpu")
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][0], b[1][0])
    assert not torch.equal(a[0][0], c[0][0])


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_create_caches_fp8_are_valid_uint8(cache_dtype, fp8):
    kc, vc = kvwrite.create_kv_caches_with_random_flash(8, 16, 1, 4, 32, cache_dtype, seed=0, device="cpu")
    for c in (kc[0], vc[0]):
        assert c.dtype == torch.uint8
        vals = c.view(fp8).float()
        # Rounding to fp8 can land up to half a step (1/8 for e5m2) past the bound.
        assert not torch.isnan(vals).any() and vals.abs().max() <= 32**-0.5 * 1.125
        assert vals.unique().numel() > 20


def test_create_caches_errors():
    with pytest.raises(ValueError, match="model_dtype: required when cache_dtype is 'auto'"):
        kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "auto", device="cpu")
    with pytest.raises(ValueError, match="cache_layout: expected 'NHD' or 'HND', got 'XYZ'"):
        kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "half", device="cpu", cache_layout="XYZ")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        kvwrite.create_kv_caches_with_random_flash(2, 16, 1, 2, 8, "int4", device="cpu")


@pytest.mark.parametrize("layout", list(Layout))
def test_packed_allocation_shares_one_buffer(layout):
    k, v = allocate_kv_cache(2, 16, 4, 8, torch.float16, layout, KVAlloc.PACKED, "cpu")
    assert v.data_ptr() - k.data_ptr() == 8 * 2
    assert k.stride()[2] == (16 if layout is Layout.NHD else 16 * 16) and k.stride() == v.stride()


# --- implementations() ------------------------------------------------------------------------------

def test_implementations_lists_every_one_with_a_reason():
    statuses = {s.name: s for s in kvwrite.implementations("cpu", op="reshape_and_cache_flash")}
    assert set(statuses) == {"torch", "triton", "cuda", "torch-compile", "vllm", "vllm-triton",
                             "flashinfer"}
    # Without an op: every op's implementations, grouped by op.
    every = kvwrite.implementations("cpu")
    assert {s.op for s in every} == set(kvwrite.registry.ops())
    assert [s.op for s in every] == sorted((s.op for s in every), key=kvwrite.registry.ops().index)
    assert statuses["torch"].available and statuses["torch"].reason is None
    for s in statuses.values():
        assert s.available == (s.reason is None) and s.description
    if not torch.cuda.is_available():
        assert not statuses["cuda"].available and statuses["cuda"].reason


def test_implementations_print_as_a_table_and_stay_a_list():
    table = kvwrite.implementations("cpu")
    assert isinstance(table, list) and all(isinstance(s, kvwrite.registry.ImplStatus) for s in table)
    lines = repr(table).splitlines()
    assert str(table) == repr(table)
    assert lines[0].split() == ["op", "implementation", "runs", "on", "cpu?"]
    assert set(lines[1]) == {"-", " "}
    rows = lines[2:]
    assert len(rows) == len(table)  # one row per op and implementation, in the list's order
    op = None
    for row, s in zip(rows, table, strict=True):
        if s.op != op:  # an op's name opens its first row only
            assert row.startswith(s.op + " ")
            op = s.op
        else:
            assert row.startswith(" ")
        assert row.split()[0 if row.startswith(" ") else 1] == s.name
        assert row.endswith("yes" if s.available else f"no: {s.reason}")


def test_python_m_kvwrite_prints_the_version_and_the_table():
    # The same environment (TRITON_INTERPRET included), so the same table as this process's.
    env = {**os.environ, "PYTHONPATH": str(Path(kvwrite.__file__).parents[1])}
    run = subprocess.run([sys.executable, "-m", "kvwrite"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    first, *rest = run.stdout.splitlines()
    assert first.startswith(f"kvwrite {kvwrite.__version__} (torch {torch.__version__}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert "\n".join(rest).strip() == str(kvwrite.implementations(device))


def test_version_is_the_packages():
    import importlib.metadata
    assert kvwrite.__version__ == importlib.metadata.version("kvwrite")


# --- the write-safety rule is every op's -------------------------------------------------------------

def _every_op_call(unsafe: str):
    """(op function, args, kwargs, the tensors whose bytes must not change) for each op, with one
    tensor made unsafe: "grad" (a tensor requires grad) or "alias" (an input shares the memory of
    a written tensor)."""
    from kvwrite.testing.mla import MlaCase, make_mla_inputs
    from kvwrite.testing.rope import RopeCase, make_rope_inputs
    calls = []
    inp = make_inputs(BASE)
    args = list(inp.args())
    if unsafe == "grad":  # the caches are uint8 (fp8): the key requires grad instead
        args[0] = args[0].clone().requires_grad_(True)
    else:
        args[3] = args[2]  # value_cache: key_cache itself
    calls.append((kvwrite.reshape_and_cache_flash, args, {}, args[2:4]))
    m = make_mla_inputs(MlaCase(num_tokens=3, kv_lora_rank=64, pe_dim=16))
    margs = list(m.args())
    if unsafe == "grad":
        margs[2] = margs[2].clone().requires_grad_(True)
    else:
        margs[1] = margs[2].view(-1)[: margs[1].numel()].view(margs[1].shape)
    calls.append((kvwrite.concat_and_cache_mla, margs, {}, [margs[2]]))
    r = make_rope_inputs(RopeCase(num_tokens=3))
    rargs = list(r.rotary_args())
    fargs = list(r.fused_args())
    if unsafe == "grad":
        rargs[1] = rargs[1].clone().requires_grad_(True)
        fargs[7] = fargs[7].clone().requires_grad_(True)
    else:
        rargs[2] = rargs[1][:, : rargs[2].shape[1]]  # key: the first heads of query
        fargs[7] = fargs[6]  # value_cache: key_cache itself
    calls.append((kvwrite.rotary_embedding, rargs, {}, [rargs[1], rargs[2]]))
    calls.append((kvwrite.fused_rope_and_reshape_cache_flash, fargs, r.fused_kwargs(),
                  [fargs[0], fargs[1], fargs[6], fargs[7]]))
    return calls


@pytest.mark.parametrize("unsafe", ["grad", "alias"])
def test_every_op_applies_the_write_safety_rule(unsafe):
    for fn, args, kwargs, written in _every_op_call(unsafe):
        before = [t.detach().clone() for t in written]
        with pytest.raises(ValueError, match="requires_grad=True" if unsafe == "grad"
                           else "expected memory apart"):
            fn(*args, **kwargs)
        for t, b in zip(written, before, strict=True):
            assert torch.equal(t.detach().view(torch.uint8), b.view(torch.uint8)), fn.__name__


def test_every_public_name_is_exported_lazily_and_resolves():
    """kvwrite's lazy table (_EXPORTS) and __all__ name the same public names, and each resolves
    (importing it registers the ops)."""
    names = set(kvwrite._EXPORTS) - {"ops", "registry"}
    assert names == set(kvwrite.__all__) - {"registry"}
    for name in sorted(names):
        assert getattr(kvwrite, name) is not None
    assert kvwrite.registry.ops()  # every op registered
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvwrite.nope  # noqa: B018
