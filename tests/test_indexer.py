"""indexer_k_quant_and_cache (DeepSeek-V3.2's indexer key cache): the reference against an
independent per-token NumPy oracle of the page layout and the scale rule (CPU), every registered
implementation byte for byte over whole caches (Triton's interpreter on exact quotients on the
CPU; all three on the GPU over a large matrix), the scale rule's C code compiled for the host,
"mxfp8"'s exponent bytes and the round trip through the gather, validation specifics, NVRTC
builds. Wrong writers, bad input, CUDA graphs, torch.compile and the NVRTC compile of every
variant: tests/test_conformance.py (kvwrite.testing.providers.indexer_k_quant_and_cache).

A failure names the cache, the number of differing bytes and the first ones by block, slot and
code or scale byte.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
import pytest
import torch

import kvwrite
from host import build_host_lib
from kvwrite import registry
from kvwrite.ops.indexer_k_quant_and_cache import OP, ScaleFormat, parse_scale_fmt
from kvwrite.ops.indexer_k_quant_and_cache import reference as torch_ref
from kvwrite.testing.compare import storage_bytes
from kvwrite.testing.indexer import (
    INDEXER_CASES,
    INDEXER_GPU_CASES,
    IndexerCase,
    assert_indexer_caches_equal,
    clone_cache,
    decode_scales,
    dequantize_rows,
    exact_quotient_inputs,
    make_indexer_inputs,
    pow2_boundary_amaxes,
)
from oracle import cache_slots, fp8_round
from params import DEVICES, impl_names
from sass import assert_pdl_builds_wait_first, cuobjdump_or_skip, needs_nvrtc

IMPLS = impl_names(OP)


# --- the independent oracle -----------------------------------------------------------------------

def _ue8m0(s: np.float32) -> np.float32:
    """The smallest power of two >= s (s > 0), by frexp: s = m * 2^e with m in [0.5, 1)."""
    if math.isinf(s):
        return s
    m, e = math.frexp(float(s))
    return np.float32(s) if m == 0.5 else np.float32(math.ldexp(1.0, e))


def _group(x: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.float32]:
    """(e4m3 codes, scale) of one group of float32 values, element by element."""
    amax = np.float32(0.0)
    for v in x:
        if not np.isnan(v) and abs(v) > amax:
            amax = np.float32(abs(v))
    floor = np.float32(1e-4)
    with np.errstate(all="ignore"):
        s = np.float32(max(amax, floor)) / np.float32(448.0)  # IEEE float32 division
        if ue8m0:
            s = _ue8m0(s)
        q = (x / np.float32(s)).astype(np.float32)
    return fp8_round(q, torch.float8_e4m3fn), np.float32(s)


def _mxfp8_byte(s: np.float32) -> int:
    """The UE8M0 byte of a power-of-two scale s = 2^k (k + 127, by frexp: s = 0.5 * 2^(k+1)), 0xFF
    for +inf."""
    if math.isinf(s):
        return 0xFF
    m, e = math.frexp(float(s))
    assert m == 0.5, s
    return e - 1 + 127


def indexer_oracle(k, kv_cache, slot_mapping, quant_block_size: int, scale_fmt) -> None:
    """Writes into a CPU cache one token and group at a time, at byte offsets computed from the
    page layout and the cache's strides."""
    nb, bs, e = kv_cache.shape
    d = k.shape[1]
    g_count = d // quant_block_size
    mxfp8 = scale_fmt == "mxfp8"
    ue8m0 = scale_fmt == "ue8m0" or mxfp8
    mem = storage_bytes(kv_cache)
    for t, b, o in cache_slots(slot_mapping, nb, bs):
        page = kv_cache.storage_offset() + b * kv_cache.stride(0)
        x = k[t].float().numpy().astype(np.float32)
        for g in range(g_count):
            codes, s = _group(x[g * quant_block_size:(g + 1) * quant_block_size], ue8m0)
            at = page + o * d + g * quant_block_size
            mem[at:at + quant_block_size] = torch.from_numpy(codes)
            at = page + bs * d + 4 * (o * g_count + g)
            if mxfp8:
                mem[at:at + 4] = _mxfp8_byte(s)
            else:
                mem[at:at + 4] = torch.from_numpy(np.array([s], dtype="<f4").view(np.uint8))


@functools.cache
def expected_cache(case: IndexerCase) -> torch.Tensor:
    inp = make_indexer_inputs(case)
    cache = clone_cache(inp.kv_cache)
    indexer_oracle(inp.k, cache, inp.slot_mapping, case.quant_block_size, case.scale_fmt)
    return cache


@functools.cache
def reference_cache(case: IndexerCase) -> torch.Tensor:
    """The torch reference's cache for ``case`` on the CPU (the GPU matrix's expectation: the
    reference is checked against the oracle on the CPU matrix)."""
    inp = make_indexer_inputs(case)
    cache = clone_cache(inp.kv_cache)
    kvwrite.indexer_k_quant_and_cache(inp.k, cache, *inp.args()[2:], implementation="torch")
    return cache


def run_case(impl: str, case: IndexerCase, device: str):
    info = registry.get(OP, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = make_indexer_inputs(case, device)
    if (reason := info.unsupported(inp.k, inp.kv_cache,
                                   parse_scale_fmt(case.scale_fmt))) is not None:
        pytest.skip(reason)
    kvwrite.indexer_k_quant_and_cache(*inp.args(), implementation=impl)
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: c.id)
def test_matches_oracle(impl, case, device):
    inp = run_case(impl, case, device)
    assert_indexer_caches_equal(clone_cache(inp.kv_cache, "cpu"), expected_cache(case),
                                case.head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", INDEXER_GPU_CASES, ids=lambda c: c.id)
def test_gpu_matrix(impl, case):
    inp = run_case(impl, case, "cuda")
    assert_indexer_caches_equal(clone_cache(inp.kv_cache, "cpu"), reference_cache(case),
                                case.head_dim)


def test_matrix_covers_the_contract():
    for cases in (INDEXER_CASES, INDEXER_GPU_CASES):
        assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16, torch.float32}
        assert {(c.head_dim, c.quant_block_size) for c in cases} >= {
            (128, 128), (64, 64), (128, 64), (256, 128), (96, 96), (80, 16), (128, 1), (6, 3)}
        assert {c.block_size for c in cases} >= {1, 16, 64}
        assert any(c.scale_fmt == "ue8m0" for c in cases)
        assert {c.dtype for c in cases if c.scale_fmt == "mxfp8" and c.special_values} == {
            torch.float16, torch.bfloat16, torch.float32}
        assert any(c.scale_fmt == "mxfp8" and c.groups > 1 and c.cache_offset % 2 for c in cases)
        assert any(c.scale_fmt != "ue8m0" for c in cases)
        assert any(c.special_values and c.dtype == torch.float32 for c in cases)
        assert any(c.padding_slots and c.out_of_range_slots for c in cases)
        assert any(c.slot_dtype == torch.int32 for c in cases)
        assert any(c.k_pad and c.extra_rows for c in cases)
        assert any(c.page_pad and c.cache_offset % 2 for c in cases)
    assert {c.num_tokens for c in INDEXER_CASES} >= {0, 1}


def test_oracle_writes_the_documented_page():
    """A hand-checked page: D = 8, q = 4 (G = 2), block_size 2; the token at slot 3 is block 1's
    offset 1: its codes at page bytes [8, 16), its scales at 16 + 4 * (1 * 2 + g)."""
    k = torch.tensor([[448.0, -224.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    cache = torch.zeros(2, 2, 16, dtype=torch.uint8)
    indexer_oracle(k, cache, torch.tensor([3]), 4, "float32")
    page = cache[1].reshape(-1)
    assert page[:8].tolist() == [0] * 8 and cache[0].count_nonzero() == 0
    # s0 = 448 / 448 = 1: codes of 448, -224, 0, 1; s1 = 1e-4 / 448 (the floor): zeros.
    assert page[8:16].tolist() == [0x7E, 0xF6, 0x00, 0x38, 0, 0, 0, 0]
    scales = page[16:32].numpy().view("<f4")
    assert scales[:2].tolist() == [0.0, 0.0]  # slot 0's scales: untouched
    assert scales[2] == np.float32(1.0)
    assert scales[3] == np.float32(1e-4) / np.float32(448)
    want = cache.clone()
    cache.zero_()
    kvwrite.indexer_k_quant_and_cache(k, cache, torch.tensor([3]), 4, "float32")
    assert torch.equal(cache, want)


def test_mxfp8_writes_exponent_bytes():
    """Hand-checked "mxfp8" scale bytes (D = q = 128, block_size 2): amax 448 gives s = 1, byte
    127; an all-zero group s = RN(1e-4 / 448) = 2.23e-7 -> 2^-22, byte 105; amax 448 * 2^-20 plus
    one ulp rounds up to 2^-19, byte 108; +inf gives 0xFF, its codes ±0 and NaN. Each byte 4
    times; the codes those of "ue8m0"; no other byte changes."""
    k = torch.zeros(4, 128)
    k[0, 0], k[0, 1] = 448.0, -1.0
    k[2, 5] = float(torch.nextafter(torch.tensor(448.0 * 2.0**-20), torch.tensor(1.0)))
    k[3, 7], k[3, 8] = float("inf"), 2.0
    cache = torch.full((3, 2, 132), 0xA5, dtype=torch.uint8)
    slots = torch.tensor([1, 2, 4, 5])
    kvwrite.indexer_k_quant_and_cache(k, cache, slots, 128, "mxfp8", implementation="torch")
    page = cache.view(3, -1)
    for slot, byte in zip(slots.tolist(), (127, 105, 108, 0xFF), strict=True):
        b, o = divmod(slot, 2)
        assert page[b, 256 + 4 * o:260 + 4 * o].tolist() == [byte] * 4, (slot, byte)
    assert page[0, 256:260].tolist() == [0xA5] * 4  # slot 0: untouched
    assert page[2, 7 + 128].item() & 0x7F == 0x7F and page[2, 8 + 128].item() == 0  # NaN, +0
    want = torch.full_like(cache, 0xA5)
    indexer_oracle(k, want, slots, 128, "mxfp8")
    assert_indexer_caches_equal(cache, want, 128)  # NaN codes of either sign
    ue8m0 = torch.full_like(cache, 0xA5)
    kvwrite.indexer_k_quant_and_cache(k, ue8m0, slots, 128, "ue8m0", implementation="torch")
    assert torch.equal(ue8m0.view(3, -1)[:, :256], page[:, :256])


def test_ue8m0_rounds_up_from_the_bits():
    """Scales exactly a power of two stay; a few ulps above one go to the next power, where
    exp2(ceil(log2(s))) in float32 stays at the lower power (vLLM's form)."""
    amax = torch.tensor(pow2_boundary_amaxes(), dtype=torch.float32)
    s = amax / torch.full_like(amax, 448.0)
    got = torch_ref.ue8m0(s)
    want = torch.tensor([_ue8m0(np.float32(v)) for v in s.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    exact = (s.view(torch.int32) & 0x7FFFFF) == 0
    assert exact.sum() == 12 and torch.equal(got[exact], s[exact])
    assert (got[~exact] == 2 * torch.exp2(torch.floor(torch.log2(s[~exact].double())))
            .float()).all()
    log_form = torch.exp2(torch.ceil(torch.log2(s[~exact])))
    assert (log_form != got[~exact]).sum() >= 20  # the boundaries catch the float32 log form
    inf = torch.tensor([float("inf")])
    assert torch.equal(torch_ref.ue8m0(inf), inf)


# --- Triton's interpreter on exactly representable quotients -------------------------------------

TRITON_CPU_CASES = [
    IndexerCase(num_tokens=9, padding_slots=2, out_of_range_slots=2),
    IndexerCase(num_tokens=9, scale_fmt="float32", dtype=torch.float16, slot_dtype=torch.int32),
    IndexerCase(num_tokens=6, head_dim=64, quant_block_size=32, dtype=torch.float32,
                block_size=5, k_pad=2, page_pad=1, cache_offset=3),
    IndexerCase(num_tokens=7, head_dim=6, quant_block_size=3, block_size=1, num_blocks=9),
    IndexerCase(num_tokens=5, head_dim=80, quant_block_size=16, extra_rows=2, k_pad=1,
                scale_fmt=""),
    IndexerCase(num_tokens=9, scale_fmt="mxfp8", dtype=torch.float32, padding_slots=1),
    IndexerCase(num_tokens=7, head_dim=256, scale_fmt="mxfp8", block_size=5, k_pad=3,
                page_pad=1, cache_offset=3, slot_dtype=torch.int32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TRITON_CPU_CASES, ids=lambda c: c.id)
def test_triton_on_exact_quotients(case, device):
    """Quotients that are e4m3 values themselves, so any rounding gives the same code: the
    kernel's indexing, scales and page layout apart from its rounding."""
    from kvwrite.ops.indexer_k_quant_and_cache import triton_impl
    info = registry.get(OP, "triton")
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = exact_quotient_inputs(case, "cpu")
    want = clone_cache(inp.kv_cache)
    indexer_oracle(inp.k, want, inp.slot_mapping, case.quant_block_size, case.scale_fmt)
    got = clone_cache(inp.kv_cache, device)
    kvwrite.ops.indexer_k_quant_and_cache.validate(*inp.args())
    triton_impl.run(inp.k.to(device), got, inp.slot_mapping.to(device), case.quant_block_size,
                    parse_scale_fmt(case.scale_fmt))
    assert_indexer_caches_equal(clone_cache(got, "cpu"), want, case.head_dim)


# --- the scale rule's C code, compiled for the host -----------------------------------------------

_HARNESS = r"""
#include "kernel.cu"  // with -DKVWRITE_HOST_TEST only the scale functions remain
extern "C" {
void kvw_indexer_scales(const float* amax, int ue8m0, float* s, float* rcp, long long n) {
  for (long long i = 0; i < n; ++i) {
    s[i] = indexer_scale(amax[i], ue8m0 != 0);
    rcp[i] = ue8m0 ? pow2_reciprocal(s[i]) : 0.0f;
  }
}
void kvw_indexer_scale_words(const float* s, int fmt, unsigned* word, long long n) {
  for (long long i = 0; i < n; ++i) word[i] = indexer_scale_word(s[i], fmt == KVW_INDEXER_FMT_MXFP8);
}
}
"""


@pytest.fixture(scope="module")
def scale_lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory, _HARNESS, "kvwindexer", "scale harness",
                          ("kvwrite.ops.indexer_k_quant_and_cache",))


def _host_scales(lib, amax: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s, rcp = torch.empty_like(amax), torch.empty_like(amax)
    lib.kvw_indexer_scales(ctypes.c_void_p(amax.data_ptr()), int(ue8m0),
                           ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(rcp.data_ptr()),
                           ctypes.c_longlong(amax.numel()))
    return s, rcp


def test_kernel_scale_rule_on_the_host(scale_lib):
    """kernel.cu's indexer_scale (and the exact reciprocal of ue8m0 scales) against the
    reference's group_scales: random amaxes over the float32 range, the floor's neighbours, the
    power-of-two boundaries, 0, +inf and the largest finite value."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 0x7F800000, (1 << 18,), generator=gen, dtype=torch.int64)
    amax = torch.cat([bits.to(torch.int32).view(torch.float32),
                      torch.tensor(pow2_boundary_amaxes(range(-21, 118, 3), 8)),
                      torch.tensor([0.0, 1e-4, float("inf"), 3.4028234663852886e38, 448.0,
                                    2.0**-149, 1e-30]),
                      torch.nextafter(torch.tensor([1e-4] * 2),
                                      torch.tensor([0.0, 1.0]))]).float().contiguous()
    for fmt in ScaleFormat:
        ue8m0 = fmt.power_of_two
        s, rcp = _host_scales(scale_lib, amax, ue8m0)
        want = torch_ref.group_scales(amax.view(-1, 1, 1), fmt).view(-1)
        bad = torch.nonzero(s.view(torch.int32) != want.view(torch.int32)).flatten()
        assert bad.numel() == 0, (fmt, amax[bad[:5]].tolist(), s[bad[:5]].tolist(),
                                  want[bad[:5]].tolist())
        if ue8m0:
            finite = torch.isfinite(s)
            assert torch.equal(rcp[finite] * s[finite], torch.ones_like(s[finite]))
            assert (rcp[~finite] == 0).all()
        # The 4 scale bytes (kernel.cu's indexer_scale_word, KVW_INDEXER_FMT_* as the launcher's
        # codes) against the reference's.
        from kvwrite.ops.indexer_k_quant_and_cache.cuda_impl import _FMT_CODE
        word = torch.empty_like(s, dtype=torch.int32)
        scale_lib.kvw_indexer_scale_words(ctypes.c_void_p(s.data_ptr()), _FMT_CODE[fmt],
                                          ctypes.c_void_p(word.data_ptr()),
                                          ctypes.c_longlong(s.numel()))
        want_bytes = torch_ref.scale_bytes(want.view(-1, 1), fmt)
        assert torch.equal(word.view(torch.uint8).view(-1, 4), want_bytes), fmt
        if fmt.exponent_bytes:
            assert set(want_bytes[:, 0].unique().tolist()) <= set(range(105, 248)) | {0xFF}
            assert (want_bytes[torch.isinf(want), 0] == 0xFF).all()


# --- the round trip: write, gather, decode ---------------------------------------------------------

GATHER = "cp_gather_indexer_k_quant_cache"
ROUND_TRIP_CASES = [
    IndexerCase(scale_fmt="mxfp8", special_values=True, num_tokens=12, num_blocks=8,
                padding_slots=2),
    IndexerCase(scale_fmt="mxfp8", special_values=True, num_tokens=96, num_blocks=8,
                dtype=torch.float32, out_of_range_slots=2),
    IndexerCase(scale_fmt="mxfp8", head_dim=256, num_tokens=9, block_size=7, num_blocks=3,
                page_pad=1, cache_offset=3, special_values=True, dtype=torch.float16),
    IndexerCase(scale_fmt="ue8m0", special_values=True, num_tokens=12, num_blocks=8),
    IndexerCase(scale_fmt="float32", special_values=True, num_tokens=12, num_blocks=8),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gather_impl", [i.name for i in registry.all_impls(GATHER)])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32], ids=["u8", "f32"])
@pytest.mark.parametrize("case", ROUND_TRIP_CASES, ids=lambda c: c.id)
def test_round_trip_through_the_gather(case, scale_dtype, impl, gather_impl, device):
    """Write, then cp_gather_indexer_k_quant_cache every slot in order (one request over all
    blocks): the gather copies each slot's code and scale bytes as they are (uint8 or float32
    dst_scale); "mxfp8" holds one exponent byte 4 times a group; the decoded scales
    (testing.indexer.decode_scales) are the reference's group scales exactly (+inf included) and
    each decoded finite element is within the e4m3 bound of its input: ``|D(Q(x)) - x| <=
    s * max(|x / s| * 2^-4, 2^-10)`` (half an ulp of a normal code, of a subnormal one)."""
    if (reason := registry.get(GATHER, gather_impl).available(device)) is not None:
        pytest.skip(reason)
    inp = run_case(impl, case, device)
    nb, bs, _ = inp.kv_cache.shape
    d, g = case.head_dim, case.groups
    rows = nb * bs
    dst_k = torch.full((rows, d), 0x5A, dtype=torch.uint8, device=device)
    width = 4 * g if scale_dtype == torch.uint8 else g
    dst_scale = torch.full((rows, 4 * g), 0x5A, dtype=torch.uint8, device=device)
    dst_scale = dst_scale.view(scale_dtype)[:, :width]
    table = torch.arange(nb, dtype=torch.int32, device=device)[None]
    cu = torch.tensor([0, rows], dtype=torch.int32, device=device)
    kvwrite.cp_gather_indexer_k_quant_cache(inp.kv_cache, dst_k, dst_scale, table, cu,
                                            implementation=gather_impl)
    cache = clone_cache(inp.kv_cache, "cpu")
    codes, scales = (v.reshape(rows, -1) for v in torch_ref.page_views(cache, d))
    got_scales = dst_scale.cpu().contiguous().view(torch.uint8)
    assert torch.equal(dst_k.cpu(), codes) and torch.equal(got_scales, scales)

    k = inp.k.cpu()[:inp.slot_mapping.numel()]
    slots = inp.slot_mapping.cpu().long()
    ok = (slots >= 0) & (slots < rows)
    x, at = k[ok].float(), slots[ok]
    if case.scale_fmt == "mxfp8":
        b = got_scales[at].view(-1, g, 4)
        assert (b == b[:, :, :1]).all()
    pow2 = case.scale_fmt in ("ue8m0", "mxfp8")
    want_s = torch_ref.group_scales(x.view(-1, g, case.quant_block_size),
                                    ScaleFormat.UE8M0 if pow2 else ScaleFormat.FLOAT32)
    s = decode_scales(got_scales[at], case.scale_fmt)
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))
    y = dequantize_rows(dst_k.cpu()[at], got_scales[at], case.scale_fmt, torch.float64)
    x, sx = x.double(), s.double().repeat_interleave(case.quant_block_size, dim=1)
    check = torch.isfinite(sx) & ~torch.isnan(x)
    bound = sx * torch.maximum((x / sx).abs() * 2.0**-4, torch.full_like(x, 2.0**-10))
    err = (y - x).abs()
    assert (err[check] <= bound[check]).all(), (err - bound)[check].max()
    assert torch.isnan(y[torch.isnan(x)]).all()


# --- validation -----------------------------------------------------------------------------------

def test_any_other_scale_fmt_means_float32_scales():
    case = IndexerCase(num_tokens=6, scale_fmt="float32")
    for fmt in ("", "fp8", "bfloat16", "UE8M0", "MXFP8", "mxfp8 "):
        inp = make_indexer_inputs(case)
        kvwrite.indexer_k_quant_and_cache(inp.k, inp.kv_cache, inp.slot_mapping, 128, fmt)
        assert_indexer_caches_equal(inp.kv_cache, expected_cache(case), 128)


def test_zero_tokens_is_a_no_op():
    inp = make_indexer_inputs(IndexerCase(num_tokens=0, extra_rows=2))
    before = storage_bytes(inp.kv_cache).clone()
    kvwrite.indexer_k_quant_and_cache(*inp.args())
    assert torch.equal(storage_bytes(inp.kv_cache), before)


def test_create_indexer_k_cache():
    c = kvwrite.create_indexer_k_cache(3, 64, device="cpu")
    assert c.shape == (3, 64, 132) and c.dtype == torch.uint8 and not c.any()
    assert kvwrite.create_indexer_k_cache(1, 2, 128, 64, device="cpu").shape == (1, 2, 136)
    with pytest.raises(ValueError, match="quant_block_size: expected a positive divisor"):
        kvwrite.create_indexer_k_cache(1, 2, 128, 48, device="cpu")
    with pytest.raises(ValueError, match="block_size: expected a positive integer"):
        kvwrite.create_indexer_k_cache(1, 0, device="cpu")


# --- CUDA: NVRTC compiles (no GPU needed), launch plans, machine code -------------------------------


def _plan(case: IndexerCase, **tuning):
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    inp = make_indexer_inputs(case)
    t = cuda_impl.CudaTuning(**tuning) if tuning else cuda_impl.TUNING
    return cuda_impl.plan(inp.k, inp.kv_cache, inp.slot_mapping, case.quant_block_size,
                          parse_scale_fmt(case.scale_fmt), t)


MXFP8_PLANS = [
    IndexerCase(scale_fmt="mxfp8", dtype=dtype, slot_dtype=slot, head_dim=d, cache_offset=off,
                page_pad=off)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for slot in (torch.int32, torch.int64) for d, off in ((128, 0), (256, 1), (512, 2))
]


@needs_nvrtc
def test_nvrtc_compiles_every_mxfp8_build_for_sm90():
    """"mxfp8" is the last fixed argument (2): the specialized builds of every input and slot
    dtype, small and large calls, aligned and unaligned pages compile (the generic builds, which
    take it at run time, are the 56 variants above)."""
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    built = set()
    for case in MXFP8_PLANS:
        for tuning in (dict(), dict(small_call_bytes=0)):
            p = _plan(case, **tuning)
            assert p.fixed[-1] == 2
            if (p.name, p.fixed) not in built:
                built.add((p.name, p.fixed))
                obj, _ = cuda_impl.compile_kernel("sm_90", p.name, fixed=p.fixed)
                assert len(bytes(obj.code)) > 0
    assert len({name for name, _ in built}) >= 12


@pytest.mark.parametrize("case, name, vec, lanes, tpt", [
    (IndexerCase(), "indexer_k_quant_and_cache_kernel<1, 8, long long, true>", 8, 16, 16),
    (IndexerCase(dtype=torch.float32, slot_dtype=torch.int32, padding_slots=1),
     "indexer_k_quant_and_cache_kernel<2, 4, int, true>", 4, 32, 32),
    (IndexerCase(dtype=torch.float16, quant_block_size=64),
     "indexer_k_quant_and_cache_kernel<0, 8, long long, true>", 8, 8, 16),
    (IndexerCase(head_dim=512, quant_block_size=512),
     "indexer_k_quant_and_cache_kernel<1, 8, long long, false>", 8, 32, 32),
    (IndexerCase(head_dim=80, quant_block_size=80),
     "indexer_k_quant_and_cache_kernel<1, 8, long long, false>", 8, 2, 2),
    (IndexerCase(head_dim=6, quant_block_size=3),
     "indexer_k_quant_and_cache_kernel<1, 1, long long, false>", 1, 1, 2),
    (IndexerCase(head_dim=128, quant_block_size=1),
     "indexer_k_quant_and_cache_kernel<1, 1, long long, true>", 1, 1, 128),
    (IndexerCase(k_pad=1), None, 1, 32, 32),  # 2-byte aligned rows: one element a chunk
    (IndexerCase(k_pad=2), None, 2, 32, 32),
    (IndexerCase(page_pad=4), None, 4, 32, 32),  # 4-byte aligned pages: 4-byte code stores
    (IndexerCase(cache_offset=1, page_pad=1), None, 1, 32, 32),
])
def test_cuda_plan_picks_the_widest_aligned_accesses(case, name, vec, lanes, tpt):
    p = _plan(case)
    if name is not None:
        assert p.name == name
    assert (p.vec, min(p.lanes, 32), p.threads_per_token) == (vec, lanes, tpt)


def test_cuda_plan_fixed_arguments():
    p = _plan(IndexerCase(num_blocks=4, block_size=16, page_pad=16))
    assert p.fixed == (128, 16 * 132 + 16, 16, 4, 64, 128, 128, 1, 16, 16, 1)
    p = _plan(IndexerCase(num_blocks=4, block_size=7, scale_fmt="fp32", quant_block_size=32))
    assert p.fixed == (128, 7 * 144, 7, -1, 28, 128, 32, 4, 4, 16, 0)
    p = _plan(IndexerCase(num_blocks=4, block_size=16, page_pad=16, scale_fmt="mxfp8"))
    assert p.fixed == (128, 16 * 132 + 16, 16, 4, 64, 128, 128, 1, 16, 16, 2)
    large = _plan(IndexerCase(), small_call_bytes=0)  # large calls: 32-byte chunks
    assert (large.vec, large.lanes, large.one, large.name) == (
        16, 8, True, "indexer_k_quant_and_cache_kernel<1, 16, long long, true>")
    large = _plan(IndexerCase(dtype=torch.float32), small_call_bytes=0)
    assert (large.vec, large.lanes, large.one) == (8, 16, True)
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    assert cuda_impl.is_small_call(2048, 128, 2) and not cuda_impl.is_small_call(2049, 128, 2)


@needs_nvrtc
def test_nvrtc_compiles_specialized_builds_and_reads_no_fixed_argument(tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: k, kv_cache, slot_mapping and
    num_tokens (0x210-0x22f), then the 11 fixed arguments; a specialized build reads none of them,
    the generic build does."""
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    sass_tools = cuobjdump_or_skip()
    first, end = 0x230, 0x230 + 8 * 11
    cases = (IndexerCase(), IndexerCase(head_dim=512, quant_block_size=512, scale_fmt=""),
             IndexerCase(head_dim=80, quant_block_size=16, block_size=7, page_pad=3),
             IndexerCase(head_dim=256, scale_fmt="mxfp8", page_pad=1))
    builds = [(c.id, p.name, p.fixed) for c in cases for p in (_plan(c),)]
    sass_tools.assert_specialized_builds_read_no_fixed_argument(
        cuda_impl.compile_kernel, builds, first, end, 11, tmp_path)


@needs_nvrtc
def test_cuda_main_build_issues_the_row_load_before_any_wait(tmp_path):
    """The D = 128 builds (small calls: one 16-byte load a lane, an 8-byte code store; large
    calls: two 16-byte loads, a 16-byte store): the row's loads and the slot's are issued before
    the first wait for a load's result, with int32 and int64 slots, ue8m0 and float32 scales
    (tests/sass.py's scoreboard reading)."""
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    sass_tools = cuobjdump_or_skip()
    for slot in (torch.int32, torch.int64):
        for fmt in ("ue8m0", "mxfp8", "float32"):
            for tuning, store in ((dict(), "STG.E.64"), (dict(small_call_bytes=0), "STG.E.128")):
                p = _plan(IndexerCase(slot_dtype=slot, scale_fmt=fmt), **tuning)
                obj, _ = cuda_impl.compile_kernel("sm_90", p.name, fixed=p.fixed)
                text = sass_tools.dump_sass(bytes(obj.code), tmp_path)
                rows = 1 if tuning == {} else 2
                assert text.count("LDG.E.128") == rows and store in text, p.name
                late = sass_tools.late_issues(text, lambda op: op.split()[0].startswith("LDG"))
                assert not late, (p.name, late)


@needs_nvrtc
def test_pdl_builds_wait_before_any_memory_access(tmp_path):
    """As tests/test_pdl.py checks the other ops: in every variant's PDL build PREEXIT and
    ACQBULK come before the first global access; the plain build has neither."""
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    assert_pdl_builds_wait_first(cuda_impl.SOURCE, cuda_impl.all_kernel_names()[::5], tmp_path)


# --- the GPU: builds and launch shapes, graphs, torch.compile -----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [
    dict(specialize=False), dict(small_call_bytes=0),
    dict(chunk_bytes=4, small_chunk_bytes=4, threads=64),
    dict(small_call_bytes=0, specialize=False, threads=128),
], ids=["generic", "large-call-plan", "4-byte-chunks-64-threads", "large-call-generic"])
@pytest.mark.parametrize("case", INDEXER_GPU_CASES[::4], ids=lambda c: c.id)
def test_gpu_cuda_builds(case, tuning):
    """The generic (unspecialized) builds, the large calls' 32-byte chunks (8 lanes a D = 128
    group) and narrow chunks (more lanes, the two-pass path for large groups) over every fourth
    case of the GPU matrix (whose cases are mostly small calls)."""
    from kvwrite.ops.indexer_k_quant_and_cache import cuda_impl
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    inp = make_indexer_inputs(case, "cuda")
    kvwrite.ops.indexer_k_quant_and_cache.validate(*inp.args())
    if inp.slot_mapping.numel():
        cuda_impl.run(inp.k, inp.kv_cache, inp.slot_mapping, case.quant_block_size,
                      parse_scale_fmt(case.scale_fmt), tuning=cuda_impl.CudaTuning(**tuning))
    assert_indexer_caches_equal(clone_cache(inp.kv_cache, "cpu"), reference_cache(case),
                                case.head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("fmt", ["ue8m0", "mxfp8", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_every_16_bit_input(impl, fmt, dtype):
    """Every 16-bit pattern once, shuffled into groups of 128 (one group in 8 keeps only its
    small values, so its scale comes from a small amax), against the reference."""
    info = registry.get(OP, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    x = bits[torch.randperm(65536, generator=torch.Generator().manual_seed(1))].view(dtype)
    groups = x.clone().view(512, 128)
    small = groups[::8].float().abs()
    groups[::8] = torch.where(small < 1.0, groups[::8], torch.zeros_like(groups[::8]))
    k = groups.view(512, 128).cuda()
    cache = kvwrite.create_indexer_k_cache(8, 64, device="cuda")
    storage_bytes(cache).copy_(torch.randint(0, 256, (cache.numel(),), dtype=torch.uint8))
    slots = torch.randperm(512).cuda()
    want = cache.clone()
    kvwrite.indexer_k_quant_and_cache(k, want, slots, 128, fmt, implementation="torch")
    kvwrite.indexer_k_quant_and_cache(k, cache, slots, 128, fmt, implementation=impl)
    assert_indexer_caches_equal(cache, want, 128)


def test_torch_compile_scale_fmt_none_raises():
    inp = make_indexer_inputs(IndexerCase(num_tokens=3))

    def step(k, kv_cache, slot_mapping):
        kvwrite.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, 128, None,
                                          implementation="torch")

    before = storage_bytes(inp.kv_cache).clone()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="scale_fmt: expected a string"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(*inp.args()[:3])
    assert torch.equal(storage_bytes(inp.kv_cache), before)


# --- memcheck cases -------------------------------------------------------------------------------

def test_sanitize_cases_are_listed():
    from tools.sanitize import indexer_k_quant_and_cache as sanitize
    ids = [i for i, _ in sanitize.cases()]
    assert ids and len(ids) == len(set(ids))


@pytest.mark.gpu
def test_gpu_sanitize_cases_pass():
    from tools.sanitize import indexer_k_quant_and_cache as sanitize
    if (reason := registry.get(OP, "cuda").available("cuda")) is not None:
        pytest.skip(reason)
    failed = [(i, r) for i, f in sanitize.cases() if (r := f()) is not None]
    assert not failed, failed
