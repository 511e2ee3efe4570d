"""reshape_and_cache (the legacy paged-attention layout): every registered implementation byte for
byte against an independent per-token oracle of the layout (CPU) and against the reference over a
large matrix (GPU); the logical views equal reshape_and_cache_flash's caches; CUDA launch plans
and builds. Wrong writers, bad input, CUDA graphs, torch.compile and the NVRTC compile of every
variant: tests/test_conformance.py (kvwrite.testing.providers.reshape_and_cache).

The whole allocation behind each cache is compared, so stray writes are caught as well as wrong
ones; a failure names the tensor, the number of differing bytes and the first ones by index.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvwrite
from kvwrite import registry
from kvwrite.dtypes import CacheDType
from kvwrite.layouts import allocate_kv_cache
from kvwrite.ops.reshape_and_cache import OP, logical_views
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.legacy import (
    CACHE_STRIDES,
    LEGACY_CASES,
    LEGACY_GPU_CASES,
    LegacyCase,
    assert_legacy_caches_equal,
    clone_caches,
    make_legacy_inputs,
)
from oracle import _convert_row, cache_slots
from params import DEVICES, impl_names
from sass import assert_pdl_builds_wait_first, cuobjdump_or_skip, needs_nvrtc

IMPLS = impl_names(OP)


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
    for t, b, o in cache_slots(slot_mapping, nb, bs):
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


# --- validation -----------------------------------------------------------------------------------

def _base(kv="auto", dtype=torch.bfloat16):
    return make_legacy_inputs(LegacyCase(kv_cache_dtype=kv, dtype=dtype, num_tokens=5,
                                         num_heads=2, head_size=32, num_blocks=2, block_size=4))


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


# --- CUDA: NVRTC compiles (no GPU needed), launch plans ---------------------------------------------


def _plan(case: LegacyCase, **tuning):
    from kvwrite.ops.reshape_and_cache import cuda_impl
    inp = make_legacy_inputs(case)
    t = cuda_impl.CudaTuning(**tuning) if tuning else cuda_impl.TUNING
    return cuda_impl.plan(inp.key, inp.value, inp.key_cache, inp.value_cache, inp.slot_mapping,
                          case.cache_dtype, t)


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
    cases = (LegacyCase(), LegacyCase(kv_cache_dtype="fp8", cache_strides="padded"),
             LegacyCase(num_heads=13, head_size=80, block_size=7, x=2))
    builds = [(c.id, p.name, p.fixed) for c in cases for p in (_plan(c),)]
    sass_tools.assert_specialized_builds_read_no_fixed_argument(
        cuda_impl.compile_kernel, builds, first, end, 17, tmp_path)


@needs_nvrtc
def test_pdl_builds_wait_before_any_memory_access(tmp_path):
    """As tests/test_pdl.py checks the other ops: in the PDL build PREEXIT and ACQBULK come before
    the first global access, the plain build has neither (every 13th variant: the entry is the
    same code in each)."""
    from kvwrite.ops.reshape_and_cache import cuda_impl
    assert_pdl_builds_wait_first(cuda_impl.SOURCE, cuda_impl.all_kernel_names()[::13], tmp_path)


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
