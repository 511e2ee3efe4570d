"""reshape_and_cache (the legacy paged-attention layout): every registered implementation byte for
byte against an independent per-token oracle of the layout (CPU) and against the reference over a
large matrix (GPU); the logical views equal reshape_and_cache_flash's caches; validation;
deliberately wrong writers caught; NVRTC compiles; CUDA graphs and torch.compile.

The whole allocation behind each cache is compared, so stray writes are caught as well as wrong
ones; a failure names the tensor, the number of differing bytes and the first ones by index.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import CacheDType
from kvwrite.layouts import allocate_kv_cache
from kvwrite.ops.reshape_and_cache import OP, logical_views
from kvwrite.ops.reshape_and_cache import reference as torch_ref
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.compile import compiled_targets
from kvwrite.testing.legacy import (
    CACHE_STRIDES,
    LEGACY_CASES,
    LEGACY_GPU_CASES,
    LegacyCase,
    assert_legacy_caches_equal,
    clone_caches,
    make_legacy_inputs,
)
from oracle import _convert_row
from sass import MEMORY_OPS, cuobjdump_or_skip, needs_nvrtc

IMPLS = [info.name for info in registry.all_impls(OP)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# --- the independent oracle -----------------------------------------------------------------------

def legacy_oracle(key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType,
                  k_scale, v_scale) -> None:
    """Writes into CPU caches one token and head at a time, at element offsets computed from the
    layout's formula and the caches' strides (no view of the logical layout)."""
    nb, num_heads, _, bs, x = key_cache.shape
    d = torch.arange(key.shape[2])
    ks, vs = key_cache.stride(), value_cache.stride()
    kflat = storage_bytes(key_cache).view(key_cache.dtype)
    vflat = storage_bytes(value_cache).view(value_cache.dtype)
    for t in range(slot_mapping.numel()):
        slot = int(slot_mapping[t])
        if slot < 0 or slot >= nb * bs:
            continue
        b, o = divmod(slot, bs)
        for h in range(num_heads):
            k_at = (key_cache.storage_offset() + b * ks[0] + h * ks[1] + (d // x) * ks[2]
                    + o * ks[3] + (d % x) * ks[4])
            v_at = value_cache.storage_offset() + b * vs[0] + h * vs[1] + d * vs[2] + o * vs[3]
            for src, flat, scale, at in ((key, kflat, k_scale, k_at),
                                         (value, vflat, v_scale, v_at)):
                s = None
                if cache_dtype.is_fp8:
                    s = float(scale[h] if scale.numel() > 1 else scale[0])
                flat[at] = _convert_row(src[t, h], cache_dtype, s, flat.dtype)


def _fp8(case: LegacyCase):
    return case.cache_dtype.fp8_dtype if case.cache_dtype.is_fp8 else None


@functools.cache
def expected_caches(case: LegacyCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's caches for ``case`` (CPU), once per case."""
    inp = make_legacy_inputs(case)
    kc, vc = clone_caches(inp)
    legacy_oracle(inp.key, inp.value, kc, vc, inp.slot_mapping, case.cache_dtype, inp.k_scale,
                  inp.v_scale)
    return kc, vc


@functools.cache
def reference_caches(case: LegacyCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference's caches for ``case`` on the CPU (the GPU matrix's expectation: the
    reference is checked against the oracle on the CPU matrix)."""
    inp = make_legacy_inputs(case)
    kc, vc = clone_caches(inp)
    kvwrite.reshape_and_cache(*inp.args()[:2], kc, vc, *inp.args()[4:], implementation="torch")
    return kc, vc


def check(case: LegacyCase, key_cache, value_cache, want) -> None:
    ek, ev = want
    assert_legacy_caches_equal(key_cache, ek, "key_cache", _fp8(case))
    assert_legacy_caches_equal(value_cache, ev, "value_cache", _fp8(case))


def run_case(impl: str, case: LegacyCase, device: str):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_legacy_inputs(case, device)
    if (reason := info.unsupported(inp.key, inp.key_cache, case.cache_dtype,
                                   inp.k_scale)) is not None:
        pytest.skip(reason)
    kvwrite.reshape_and_cache(*inp.args(), implementation=impl)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", LEGACY_CASES, ids=lambda c: c.id)
def test_matches_oracle(impl, case, device):
    inp = run_case(impl, case, device)
    check(case, *clone_caches(inp, "cpu"), expected_caches(case))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", LEGACY_GPU_CASES, ids=lambda c: c.id)
def test_gpu_matrix(impl, case):
    inp = run_case(impl, case, "cuda")
    check(case, *clone_caches(inp, "cpu"), reference_caches(case))


def test_matrix_covers_the_contract():
    for cases in (LEGACY_CASES, LEGACY_GPU_CASES):
        assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16, torch.float32}
        assert {c.kv_cache_dtype for c in cases} >= {"auto", "float16", "bfloat16", "float32",
                                                     "fp8", "fp8_e5m2"}
        assert {c.cache_strides for c in cases} == set(CACHE_STRIDES)
        assert {c.xx for c in cases} >= {1, 2, 4, 8, 16}
        assert {c.head_size for c in cases} >= {46, 80, 96, 128 if cases is LEGACY_GPU_CASES
                                                else 64}
        assert {c.num_heads for c in cases} >= {1, 13, 64}
        assert any(c.per_head_scale for c in cases) and any(c.special_values for c in cases)
        assert any(c.fp8_storage == "float8" for c in cases)
        assert any(c.padding_slots and c.out_of_range_slots for c in cases)
        assert any(c.slot_dtype == torch.int32 for c in cases)
        assert any(c.fused_qkv for c in cases) and any(c.extra_rows for c in cases)
    assert {c.block_size for c in LEGACY_GPU_CASES} >= {1, 16, 64}
    assert {c.num_tokens for c in LEGACY_CASES} >= {0, 1}


def test_oracle_writes_the_documented_layout():
    """A hand-checked write: D = 4, x = 2, H = 2, block_size 3; the token at slot 4 lands at
    block 1, offset 1."""
    key = torch.arange(8, dtype=torch.float32).view(1, 2, 4)
    value = -key
    kc, vc = torch.zeros(2, 2, 2, 3, 2), torch.zeros(2, 2, 4, 3)
    legacy_oracle(key, value, kc, vc, torch.tensor([4]), CacheDType.AUTO, None, None)
    for h in range(2):
        for d in range(4):
            assert kc[1, h, d // 2, 1, d % 2] == 4 * h + d
            assert vc[1, h, d, 1] == -(4 * h + d)
    assert kc.count_nonzero() == 7 and vc.count_nonzero() == 7  # key[0, 0, 0] is 0


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("cache_strides", ["contiguous", "slot-major"])
def test_logical_views_are_the_flash_layout(kv, cache_strides):
    """``logical_views`` of the legacy caches after reshape_and_cache equals the caches that
    reshape_and_cache_flash writes from the same inputs (the same rows, quantized alike)."""
    case = LegacyCase(kv_cache_dtype=kv, cache_strides=cache_strides, num_tokens=9,
                      padding_slots=2, out_of_range_slots=1, per_head_scale=True)
    inp = make_legacy_inputs(case)
    k_before, v_before = logical_views(inp.key_cache, inp.value_cache)
    fk, fv = allocate_kv_cache(case.num_blocks, case.block_size, case.num_heads, case.head_size,
                               inp.key_cache.dtype, device="cpu")
    fk.copy_(k_before)
    fv.copy_(v_before)
    kvwrite.reshape_and_cache(*inp.args(), implementation="torch")
    kvwrite.reshape_and_cache_flash(inp.key, inp.value, fk, fv, inp.slot_mapping, kv,
                                    inp.k_scale, inp.v_scale, implementation="torch")
    k_after, v_after = logical_views(inp.key_cache, inp.value_cache)
    assert torch.equal(k_after.contiguous().view(torch.uint8), fk.contiguous().view(torch.uint8))
    assert torch.equal(v_after.contiguous().view(torch.uint8), fv.contiguous().view(torch.uint8))


# --- the checker can fail -------------------------------------------------------------------------

def _skip_last_token(key, value, kc, vc, slots, cdt, ks, vs):
    torch_ref.run(key, value, kc, vc, slots[:-1], cdt, ks, vs)


def _heads_past_512_threads(key, value, kc, vc, slots, cdt, ks, vs):
    """vLLM's launch: min(H * D / x, 512) threads and no loop, so heads past 512 * x / D stay."""
    x, d = kc.shape[4], key.shape[2]
    h = max(1, 512 * x // d)
    torch_ref.run(key[:, :h], value[:, :h], kc[:, :h], vc[:, :h], slots, cdt,
                  None if ks is None else ks[:h], None if vs is None else vs[:h])


def _first_scale_only(key, value, kc, vc, slots, cdt, ks, vs):
    """vLLM reads k_scale[0] only."""
    torch_ref.run(key, value, kc, vc, slots, cdt, ks[:1], vs[:1])


def _contiguous_strides(key, value, kc, vc, slots, cdt, ks, vs):
    """Writes as if both caches were contiguous."""
    torch_ref.run(key, value, kc.as_strided(kc.shape, torch.empty(kc.shape).stride()),
                  vc.as_strided(vc.shape, torch.empty(vc.shape).stride()), slots, cdt, ks, vs)


def _value_as_key_layout(key, value, kc, vc, slots, cdt, ks, vs):
    """The value written with the key's x-split: value_cache's memory as [nb, H, D/x, bs, x]."""
    torch_ref.run(key, value, kc, torch.empty_like(vc), slots, cdt, ks, vs)
    nb, h, d, bs = vc.shape
    x = kc.shape[4]
    torch_ref.run(value, value, vc.view(nb, h, d // x, bs, x), torch.empty_like(vc), slots, cdt,
                  vs, vs)


@pytest.mark.parametrize("broken, case", [
    (_skip_last_token, LegacyCase()),
    (_heads_past_512_threads, LegacyCase(num_heads=64, head_size=128, num_tokens=3,
                                         kv_cache_dtype="bfloat16", dtype=torch.float32)),
    (_first_scale_only, LegacyCase(kv_cache_dtype="fp8", per_head_scale=True)),
    (_contiguous_strides, LegacyCase(cache_strides="padded")),
    (_contiguous_strides, LegacyCase(cache_strides="slot-major", kv_cache_dtype="fp8")),
    (_value_as_key_layout, LegacyCase(x=4)),
], ids=["skip-last-token", "heads-past-512-threads", "first-scale-only", "padded-as-contiguous",
        "slot-major-as-contiguous", "value-x-split"])
def test_checker_rejects_wrong_implementations(broken, case):
    inp = make_legacy_inputs(case)
    broken(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping, case.cache_dtype,
           inp.k_scale if case.cache_dtype.is_fp8 else None,
           inp.v_scale if case.cache_dtype.is_fp8 else None)
    with pytest.raises(AssertionError, match="bytes differ"):
        check(case, inp.key_cache, inp.value_cache, expected_caches(case))


# --- validation -----------------------------------------------------------------------------------

def _base(kv="auto", dtype=torch.bfloat16):
    return make_legacy_inputs(LegacyCase(kv_cache_dtype=kv, dtype=dtype, num_tokens=5,
                                         num_heads=2, head_size=32, num_blocks=2, block_size=4))


def _bad(kv, **changes):
    def make():
        inp = _base(kv)
        args = dict(key=inp.key, value=inp.value, key_cache=inp.key_cache,
                    value_cache=inp.value_cache, slot_mapping=inp.slot_mapping,
                    kv_cache_dtype=kv, k_scale=inp.k_scale, v_scale=inp.v_scale)
        for k, f in changes.items():
            args[k] = f(inp)
        return inp, args
    return make


def _x_not_dividing(i):
    nb, h, _, bs, _ = i.key_cache.shape
    return torch.zeros(nb, h, 10, bs, 3, dtype=i.key_cache.dtype)


BAD = [
    ("kv_cache_dtype", _bad("auto", kv_cache_dtype=lambda i: "int8"), ValueError, "kv_cache_dtype: expected one of"),
    ("key type", _bad("auto", key=lambda i: i.key.tolist()), TypeError, "key: expected a torch.Tensor"),
    ("key dims", _bad("auto", key=lambda i: i.key[0]), ValueError, "key: expected 3 dims"),
    ("key dtype", _bad("auto", key=lambda i: i.key.double()), ValueError, "key: expected dtype"),
    ("value dtype", _bad("auto", value=lambda i: i.value.half()), ValueError, "value: expected the dtype of key"),
    ("value shape", _bad("auto", value=lambda i: i.value[:, :1]), ValueError, "value: expected the shape of key"),
    ("key heads", _bad("auto", key=lambda i: i.key.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "key: expected dense heads"),
    ("key_cache dims", _bad("auto", key_cache=lambda i: i.key_cache[0]), ValueError, "key_cache: expected 5 dims"),
    ("x not dividing D", _bad("auto", key_cache=_x_not_dividing), ValueError, "key_cache: expected x = key_cache.size(4) dividing head_size 32"),
    ("key_cache heads", _bad("auto", key_cache=lambda i: i.key_cache[:, :1]), ValueError, "key_cache: expected [num_blocks, 2, 4, block_size, 8]"),
    ("key_cache D/x", _bad("auto", key_cache=lambda i: i.key_cache[:, :, :3]), ValueError, "key_cache: expected [num_blocks, 2, 4, block_size, 8]"),
    ("value_cache dims", _bad("auto", value_cache=lambda i: i.value_cache[..., None]), ValueError, "value_cache: expected 4 dims"),
    ("value_cache block size", _bad("auto", value_cache=lambda i: i.value_cache[..., :3]), ValueError, "value_cache: expected [num_blocks, num_heads, head_size, block_size] = (2, 2, 32, 4)"),
    ("value_cache head size", _bad("auto", value_cache=lambda i: i.value_cache[:, :, :16]), ValueError, "value_cache: expected [num_blocks, num_heads, head_size, block_size]"),
    ("value_cache dtype", _bad("auto", value_cache=lambda i: i.value_cache.half()), ValueError, "value_cache: expected the dtype of key_cache"),
    ("cache dtype auto", _bad("auto", key_cache=lambda i: i.key_cache.half(), value_cache=lambda i: i.value_cache.half()), ValueError, "key_cache: kv_cache_dtype='auto' with torch.bfloat16 input expects"),
    ("cache dtype fp8", _bad("fp8", key_cache=lambda i: i.key_cache.view(torch.float8_e5m2), value_cache=lambda i: i.value_cache.view(torch.float8_e5m2)), ValueError, "key_cache: kv_cache_dtype='fp8_e4m3'"),
    ("slot dtype", _bad("auto", slot_mapping=lambda i: i.slot_mapping.float()), ValueError, "slot_mapping: expected dtype int64 or int32"),
    ("slot dims", _bad("auto", slot_mapping=lambda i: i.slot_mapping[None]), ValueError, "slot_mapping: expected 1 dim"),
    ("slot count", _bad("auto", slot_mapping=lambda i: torch.cat([i.slot_mapping, i.slot_mapping])), ValueError, "slot_mapping: expected at most key.shape[0] = 5"),
    ("slot device", _bad("auto", slot_mapping=lambda i: i.slot_mapping.to("meta")), ValueError, "slot_mapping: expected device cpu"),
    ("scale missing", _bad("fp8", k_scale=lambda i: None), ValueError, "k_scale: kv_cache_dtype='fp8_e4m3' needs"),
    ("scale dtype", _bad("fp8", v_scale=lambda i: i.v_scale.double()), ValueError, "v_scale: expected dtype float32"),
    ("scale numel", _bad("fp8", k_scale=lambda i: i.k_scale.repeat(3)), ValueError, "k_scale: expected 1 (per tensor) or 2 (per head)"),
    ("caches overlap", _bad("auto", value_cache=lambda i: i.key_cache.view(2, 2, 32, 4)), ValueError, "expected memory apart from key_cache's"),
    ("key in the cache", _bad("auto", key=lambda i: i.key_cache.view(-1)[:320].view(5, 2, 32)), ValueError, "key: expected memory apart from key_cache's"),
]


@pytest.mark.parametrize("name, make, exc, text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_nothing_changes(name, make, exc, text):
    inp, args = make()
    tensors = [t for t in args.values() if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [storage_bytes(t).clone() for t in tensors]
    with pytest.raises(exc, match=re.escape(text)):
        kvwrite.reshape_and_cache(**args)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(storage_bytes(t), b)


def test_scales_are_ignored_outside_fp8():
    inp = _base("auto")
    kc, vc = clone_caches(inp)
    kvwrite.reshape_and_cache(inp.key, inp.value, kc, vc, inp.slot_mapping, "auto")
    kvwrite.reshape_and_cache(inp.key, inp.value, inp.key_cache, inp.value_cache,
                              inp.slot_mapping, "auto", torch.full((3,), float("nan")), "nope")
    check(LegacyCase(), inp.key_cache, inp.value_cache, (kc, vc))


def test_zero_tokens_is_a_no_op():
    inp = make_legacy_inputs(LegacyCase(num_tokens=0, extra_rows=2, kv_cache_dtype="fp8"))
    before = [storage_bytes(t).clone() for t in (inp.key_cache, inp.value_cache)]
    kvwrite.reshape_and_cache(*inp.args())
    assert torch.equal(storage_bytes(inp.key_cache), before[0])
    assert torch.equal(storage_bytes(inp.value_cache), before[1])


def test_create_legacy_kv_cache():
    kc, vc = kvwrite.create_legacy_kv_cache(3, 16, 8, 128, torch.bfloat16, device="cpu")
    assert kc.shape == (3, 8, 16, 16, 8) and vc.shape == (3, 8, 128, 16)
    kc, vc = kvwrite.create_legacy_kv_cache(3, 16, 8, 128, torch.uint8, device="cpu")
    assert kc.shape == (3, 8, 8, 16, 16) and kc.dtype == torch.uint8
    kc, _ = kvwrite.create_legacy_kv_cache(1, 4, 1, 6, torch.float32, x=2, device="cpu")
    assert kc.shape == (1, 1, 3, 4, 2)
    with pytest.raises(ValueError, match="x: expected a positive divisor of head_size 6"):
        kvwrite.create_legacy_kv_cache(1, 4, 1, 6, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="num_heads: expected a positive integer"):
        kvwrite.create_legacy_kv_cache(1, 4, 0, 6, torch.float32, device="cpu")


def test_implementations_are_registered():
    names = {s.name for s in kvwrite.implementations("cpu", OP)}
    assert names == {"torch", "triton", "cuda"}
    assert "CUDA devices only" in registry.get(OP, "cuda").available("cpu")


# --- CUDA: NVRTC compiles (no GPU needed), launch plans ---------------------------------------------


def _plan(case: LegacyCase, **tuning):
    from kvwrite.ops.reshape_and_cache import cuda_impl
    inp = make_legacy_inputs(case)
    t = cuda_impl.CudaTuning(**tuning) if tuning else cuda_impl.TUNING
    return cuda_impl.plan(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping,
                          case.cache_dtype, t)


@needs_nvrtc
def test_nvrtc_compiles_every_cuda_variant_for_sm90():
    from kvwrite.ops.reshape_and_cache import cuda_impl
    names = cuda_impl.all_kernel_names()
    obj, _ = cuda_impl.compile_kernel("sm_90", names)  # one program: raises if any fails
    assert len(names) == len(set(names)) == 192 and len(bytes(obj.code)) > 0


@pytest.mark.parametrize("case, name", [
    (LegacyCase(), "reshape_and_cache_kernel<0, 5, 8, 8, false, long long>"),
    (LegacyCase(kv_cache_dtype="fp8"), "reshape_and_cache_kernel<1, 3, 8, 8, true, long long>"),
    (LegacyCase(kv_cache_dtype="float32", slot_dtype=torch.int32, padding_slots=1),
     "reshape_and_cache_kernel<1, 2, 4, 4, false, int>"),
    (LegacyCase(dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
     "reshape_and_cache_kernel<2, 4, 4, 4, false, long long>"),
    (LegacyCase(x=1), "reshape_and_cache_kernel<0, 5, 8, 1, false, long long>"),
    (LegacyCase(x=2, kv_cache_dtype="float16"), "reshape_and_cache_kernel<1, 0, 2, 2, false, long long>"),
    (LegacyCase(cache_strides="x-strided"), "reshape_and_cache_kernel<0, 5, 8, 1, false, long long>"),
    (LegacyCase(num_heads=3, head_size=46, x=2), "reshape_and_cache_kernel<0, 5, 2, 2, false, long long>"),
    (LegacyCase(fused_qkv=True, num_heads=3, head_size=6, x=2),
     "reshape_and_cache_kernel<0, 5, 2, 2, false, long long>"),
])
def test_cuda_plan_picks_the_widest_aligned_accesses(case, name):
    assert _plan(case).name == name


def test_cuda_plan_cta_shape():
    from kvwrite.ops.reshape_and_cache import cuda_impl
    # Calls of fewer than 32 tokens: CTAs of one warp (1024 chunks: every head).
    p = _plan(LegacyCase(num_tokens=1, num_heads=64, head_size=128))
    assert (p.token_lanes, p.rows, p.grid_y) == (1, 32, 32)
    p = _plan(LegacyCase(num_tokens=7, num_heads=8, head_size=128))
    assert (p.token_lanes, p.rows, p.grid_y) == (8, 4, 32)
    p = _plan(LegacyCase(num_tokens=7, num_heads=8, head_size=128), small_call_threads=256)
    assert (p.token_lanes, p.rows, p.grid_y) == (8, 32, 4)
    p = _plan(LegacyCase(num_tokens=40, num_blocks=8, num_heads=1, head_size=16))
    assert (p.token_lanes, p.rows, p.grid_y) == (32, 2, 1)
    assert cuda_impl.token_lanes(1) == 1 and cuda_impl.token_lanes(33) == 32
    assert p.fixed[-2:] == (2, 2) and p.fixed[11:15] == (16, 4, 128, 8)


@pytest.mark.parametrize("case, pair", [
    (LegacyCase(kv_cache_dtype="fp8"), True),
    (LegacyCase(kv_cache_dtype="fp8_e5m2", x=1, slot_dtype=torch.int32), True),
    (LegacyCase(kv_cache_dtype="fp8", num_tokens=1, head_size=128), True),
    (LegacyCase(kv_cache_dtype="fp8", head_size=8), False),  # one chunk a head: no pair
    (LegacyCase(kv_cache_dtype="fp8", head_size=24, x=8), False),  # three chunks a head
    (LegacyCase(dtype=torch.float32, kv_cache_dtype="fp8"), False),  # 4-element chunks
    (LegacyCase(kv_cache_dtype="bfloat16"), False),  # 2-byte cache elements
    (LegacyCase(), False),
], ids=lambda v: v.id if isinstance(v, LegacyCase) else str(v))
def test_cuda_plan_pairs_lanes_for_one_byte_caches(case, pair):
    """PAIR builds: fp8 caches with 8-element chunks and an even number of chunks a head (a
    pair never straddles a head); ``pair_lanes=False`` turns them off."""
    assert (", true, " in _plan(case).name) is pair
    assert ", true, " not in _plan(case, pair_lanes=False).name
    if pair:
        assert _plan(case).rows % 2 == 0


@needs_nvrtc
def test_nvrtc_compiles_specialized_builds_and_reads_no_fixed_argument(tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: 7 pointers, num_tokens and the two
    scale strides (0x210-0x25f), then the 17 fixed arguments; a specialized build reads none of
    them, the generic build does."""
    from kvwrite.ops.reshape_and_cache import cuda_impl
    sass_tools = cuobjdump_or_skip()
    first, end = 0x210 + 8 * 10, 0x210 + 8 * 27
    for case in (LegacyCase(), LegacyCase(kv_cache_dtype="fp8", cache_strides="padded"),
                 LegacyCase(num_heads=13, head_size=80, block_size=7, x=2)):
        p = _plan(case)
        reads = {}
        for fixed in (p.fixed, None):
            obj, _ = cuda_impl.compile_kernel("sm_90", p.name, fixed=fixed)
            text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
            reads[fixed is None] = {int(m, 16) for m in re.findall(r"c\[0x0\]\[(0x[0-9a-f]+)\]",
                                                                   text)}
        assert any(first <= o < end for o in reads[True]), case.id
        assert not any(first <= o < end for o in reads[False]), (case.id, sorted(reads[False]))
    with pytest.raises(RuntimeError, match="17 values"):
        cuda_impl.compile_kernel("sm_90", p.name, fixed=(1, 2, 3))


@needs_nvrtc
def test_pdl_builds_wait_before_any_memory_access(tmp_path):
    """As tests/test_pdl.py checks the other ops: in the PDL build PREEXIT and ACQBULK come before
    the first global access, the plain build has neither (every 13th variant: the entry is the
    same code in each)."""
    from kvwrite.kernels import nvrtc
    from kvwrite.ops.reshape_and_cache import cuda_impl
    sass_tools = cuobjdump_or_skip()
    names = cuda_impl.all_kernel_names()[::13]
    pdl, _ = cuda_impl.SOURCE.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    funcs = sass_tools.functions(sass_tools.dump_sass(bytes(pdl.code), tmp_path))
    assert len(funcs) == len(names)
    for name, ops in funcs.items():
        first_mem = next(i for i, o in enumerate(ops) if o.startswith(MEMORY_OPS))
        assert "PREEXIT" in ops[:first_mem] and "ACQBULK" in ops[:first_mem], (name, ops[:40])
    plain, _ = cuda_impl.SOURCE.compile("sm_90", names[:4])
    text = sass_tools.dump_sass(bytes(plain.code), tmp_path)
    assert "ACQBULK" not in text and "PREEXIT" not in text


# --- Triton and the CUDA kernel's launch shapes on the GPU ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [
    dict(specialize=False), dict(token_lanes=1), dict(token_lanes=8, threads=64),
    dict(chunk_bytes=4), dict(chunk_bytes=8, specialize=False), dict(pair_lanes=False),
    dict(small_call_threads=256), dict(pair_lanes=True, specialize=False, token_lanes=4),
], ids=["generic", "one-token-lane", "8-lanes-64-threads", "4-byte-chunks", "8-byte-generic",
        "no-lane-pairs", "256-thread-small-calls", "pairs-4-lanes-generic"])
@pytest.mark.parametrize("case", LEGACY_GPU_CASES[::5], ids=lambda c: c.id)
def test_gpu_cuda_launch_shapes(case, tuning):
    """The generic (unspecialized) builds, other CTA shapes and narrower chunks (more key pieces
    per chunk, other variants) over every fifth case of the GPU matrix."""
    from kvwrite.ops.reshape_and_cache import cuda_impl
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    inp = make_legacy_inputs(case, "cuda")
    kvwrite.ops.reshape_and_cache.validate(*inp.args())
    if inp.slot_mapping.numel():
        fp8 = case.cache_dtype.is_fp8
        cuda_impl.run(*inp.args()[:5], case.cache_dtype, inp.k_scale if fp8 else None,
                      inp.v_scale if fp8 else None, tuning=cuda_impl.CudaTuning(**tuning))
    check(case, *clone_caches(inp, "cpu"), reference_caches(case))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_every_16_bit_input_fp8_per_head(impl, kv, dtype):
    """Every 16-bit pattern through both caches, per-head scales of several magnitudes."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    x = bits[torch.randperm(65536, generator=torch.Generator().manual_seed(5))].view(dtype)
    key = x.view(128, 4, 128).cuda()
    value = key.flip(0).contiguous()
    kc, vc = kvwrite.create_legacy_kv_cache(8, 16, 4, 128, torch.uint8, device="cuda")
    slots = torch.randperm(128).cuda()
    for scales in ((0.37, 2.7, 1.0, 2.0**-10), (3e-41, 1.3, 448.0, 2.0**20)):
        ks = torch.tensor(scales, dtype=torch.float32, device="cuda")
        vs = ks.flip(0).contiguous()
        want = (kc.clone(), vc.clone())
        kvwrite.reshape_and_cache(key, value, *want, slots, kv, ks, vs, implementation="torch")
        kvwrite.reshape_and_cache(key, value, kc, vc, slots, kv, ks, vs, implementation=impl)
        fp8 = CacheDType(kv).fp8_dtype
        assert_legacy_caches_equal(kc, want[0], f"key_cache (scales {scales})", fp8)
        assert_legacy_caches_equal(vc, want[1], f"value_cache (scales {scales})", fp8)


# --- CUDA graphs and torch.compile ------------------------------------------------------------------

GRAPH_CASE = LegacyCase(num_tokens=40, num_heads=4, head_size=64, kv_cache_dtype="fp8",
                        per_head_scale=True, cache_strides="padded", padding_slots=3,
                        out_of_range_slots=2, num_blocks=8)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i.name for i in registry.all_impls(OP) if i.graph_safe])
@pytest.mark.parametrize("kv", ["auto", "fp8", "float32"])
def test_cuda_graph_replay_sees_new_inputs(impl, kv):
    """Capture once, then change key, value, slots and scales in place: the replay uses them."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    case = dataclasses.replace(GRAPH_CASE, kv_cache_dtype=kv)
    first = make_legacy_inputs(case, "cuda", seed=1)
    kvwrite.reshape_and_cache(*first.args(), implementation=impl)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.reshape_and_cache(*first.args(), implementation=impl)
    second = make_legacy_inputs(case, "cuda", seed=2)
    for dst, src in ((first.key, second.key), (first.value, second.value),
                     (first.slot_mapping, second.slot_mapping), (first.k_scale, second.k_scale),
                     (first.v_scale, second.v_scale)):
        dst.copy_(src)
    for dst, src in ((first.key_cache, second.key_cache), (first.value_cache, second.value_cache)):
        storage_bytes(dst).copy_(storage_bytes(src))
    ek, ev = clone_caches(second)
    kvwrite.reshape_and_cache(second.key, second.value, ek, ev, *second.args()[4:],
                              implementation="torch")
    graph.replay()
    torch.cuda.synchronize()
    check(case, first.key_cache, first.value_cache, (ek, ev))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_sees_a_mutating_custom_op(impl, device):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    case = LegacyCase(num_tokens=9, padding_slots=2, cache_strides="padded")
    inp = make_legacy_inputs(case, device)
    if (reason := info.unsupported(inp.key, inp.key_cache, case.cache_dtype, None)) is not None:
        pytest.skip(reason)

    def step(key, value, key_cache, value_cache, slot_mapping):
        kvwrite.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "auto",
                                  implementation=impl)

    assert compiled_targets(step, *inp.args()[:5]) == ["kvwrite.reshape_and_cache"]
    inp = make_legacy_inputs(case, device)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(*inp.args()[:5])
    check(case, *clone_caches(inp, "cpu"), expected_caches(case))


# --- memcheck cases -------------------------------------------------------------------------------

def test_sanitize_cases_are_listed():
    from tools.sanitize import reshape_and_cache as sanitize
    ids = [i for i, _ in sanitize.cases()]
    assert ids and len(ids) == len(set(ids))
    assert all(callable(f) for _, f in sanitize.cases())


@pytest.mark.gpu
def test_gpu_sanitize_cases_pass():
    from tools.sanitize import reshape_and_cache as sanitize
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    failed = [(i, r) for i, f in sanitize.cases() if (r := f()) is not None]
    assert not failed, failed
