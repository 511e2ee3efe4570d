"""The five gathers (docs/ops/gather.md): each reference against an independent per-row oracle
(``gather_oracle.py``), every registered implementation against the reference byte for byte on
whole output allocations with the caches unchanged, over the row rule's cases (seq_starts,
negative and past-the-table positions, bad block ids, rows no request owns, decreasing
cu_seq_lens, T_out below the total, int32/int64 index tensors with non-unit strides, block sizes),
entry sizes and layouts; the fp8 read rule on all 256 codes under special scales; validation
specifics. Wrong writers, bad input, CUDA-graph replay with new index tensors and torch.compile:
tests/test_conformance.py (kvwrite.testing.providers.<gather op>).

On CPU this runs the torch reference and Triton's interpreter (where it rounds exactly); on a GPU
(`gpu` marker) every implementation available there, over a larger matrix.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

import kvwrite
from gather_oracle import (
    dequant_bits,
    oracle_entry,
    oracle_flash,
    oracle_indexer,
    oracle_rows,
    oracle_upconvert,
)
from host import run_triton_script
from kvwrite import registry
from kvwrite.layouts import KVAlloc, Layout
from kvwrite.testing.gather import (
    SPECIAL_SCALES,
    EntryCase,
    FlashCase,
    IndexerCase,
    Seqs,
    UpconvertCase,
    assert_outputs_equal,
    clone_tensor,
    make_entry_inputs,
    make_flash_inputs,
    make_indexer_inputs,
    make_upconvert_inputs,
    mixed_seqs,
)
from params import DEVICES, impl_names

DEQUANT = "gather_and_maybe_dequant_cache"
CP = "cp_gather_cache"
UPCONVERT = "cp_gather_and_upconvert_fp8_kv_cache"
FLASH = "gather_cache_flash"
INDEXER = "cp_gather_indexer_k_quant_cache"
OPS = (DEQUANT, CP, UPCONVERT, FLASH, INDEXER)
IMPLS = {op: impl_names(op) for op in OPS}


def impl_device_cases(op: str, cases: list, cpu_step: int = 1) -> list:
    """(implementation, device, case) triples: on the CPU Triton's interpreter over every
    ``cpu_step``-th case (it is slow; the torch implementation is the reference, checked against
    the oracle on every case), on the GPU every implementation over every case."""
    out = [pytest.param(i, "cpu", c, id=f"{c.id}-{i}-cpu") for i in IMPLS[op] if i == "triton"
           for c in cases[::cpu_step]]
    return out + [pytest.param(i, "cuda", c, id=f"{c.id}-{i}-cuda", marks=pytest.mark.gpu)
                  for i in IMPLS[op] for c in cases]
I32, I64 = torch.int32, torch.int64

# --- the row rule's cases ------------------------------------------------------------------------

# Each exercises one part of the rule; every op runs them (the indexer those without seq_starts).
SEQ_SETS = [
    Seqs(),
    Seqs(starts=(3, 0, 40, 15, 2)),
    Seqs(starts=(-3, 0, 5, -20, 0)),                       # negative positions
    Seqs(starts=(0, 9, 30, 0, 0), max_blocks=2),           # positions past the table
    Seqs(bad_blocks=(-1, 12, 100, -7)),                    # block ids outside [0, num_blocks)
    Seqs(first=4, rows_past=5),                            # rows before a_0 and after a_B
    Seqs(lens=(4, 6, -14, 4), first=4, rows_past=1),       # cu_seq_lens decreasing, no overlap
    Seqs(lens=(4, -14, 4), first=10, rows_past=3),         # ... with a gap no request owns
    Seqs(rows_past=-6),                                    # T_out smaller than the total
    Seqs(lens=(), rows_past=3),                            # B = 0
    Seqs(lens=(0, 0), rows_past=4),                        # only empty requests
    Seqs(lens=(3, 20, 2), starts=(1, 7, 0), cu_dtype=I64, ss_dtype=I32, bt_dtype=I32,
         strided=True, table_rows=3),
    Seqs(lens=(3, 20, 2), starts=(1, 7, 0), cu_dtype=I32, ss_dtype=I64, bt_dtype=I64,
         strided=True),
    Seqs(lens=(9, 2, 13), block_size=1, num_blocks=40, bad_blocks=(40,)),
    Seqs(lens=(9, 2, 13), starts=(5, 0, 3), block_size=7, num_blocks=9),
    Seqs(lens=(70, 1, 30), block_size=64, num_blocks=3, cu_dtype=I64, bt_dtype=I64),
    mixed_seqs(long=(41, 23), short=14, max_short=5, block_size=16, bad_blocks=(-1, 64)),
]
NO_SS = [s for s in SEQ_SETS if s.starts is None]
BAD_IDS = SEQ_SETS[4]  # block ids outside [0, num_blocks), no seq_starts


def _owned_twice(s: Seqs, workspace: bool = False) -> bool:
    """Whether a row below T_out has two owners (with workspace_starts the last request ends at
    T_out)."""
    cu, owned = s.cu, []
    for r in range(s.num_req):
        end = s.t_out if workspace and r == s.num_req - 1 else cu[r + 1]
        owned += [t for t in range(cu[r], end) if 0 <= t < s.t_out]
    return len(owned) != len(set(owned))


# As workspace_starts the last request ends at T_out: decreasing starts overlap unless T_out is
# small; this one does not.
WS_SETS = [s for s in SEQ_SETS if not _owned_twice(s, workspace=True)] + [
    Seqs(lens=(4, -12, 5), first=8, rows_past=-7)]


def test_seq_sets_have_no_row_owned_twice():
    """Which of two owners wins is undefined: the cases must not depend on it."""
    for s in SEQ_SETS:
        assert not _owned_twice(s), s.id
    assert len(WS_SETS) >= len(SEQ_SETS) - 3


def test_oracle_rows_by_hand():
    """The rule on a hand-checked batch: block size 4, table [[5, 1], [2, 9]], cu = [1, 4, 9],
    seq_starts = [6, -1]: rows 1-3 read positions 6-8 of request 0 (block 1 offsets 2, 3, then
    position 8: past the 2-block table), rows 4-8 positions -1..3 of request 1 (row 4 negative,
    rows 5-8 block 2 offsets 0-3); row 0 and rows 9-10 no request owns."""
    bt = torch.tensor([[5, 1], [2, 9]])
    rows = oracle_rows(torch.tensor([1, 4, 9]), torch.tensor([6, -1]), bt, 2, 11, 4, 10)
    assert rows == {1: (1, 2), 2: (1, 3), 5: (2, 0), 6: (2, 1), 7: (2, 2), 8: (2, 3)}
    bt[1, 0] = 10  # a block id past num_blocks: those rows keep their bytes
    rows = oracle_rows(torch.tensor([1, 4, 9]), torch.tensor([6, -1]), bt, 2, 11, 4, 10)
    assert rows == {1: (1, 2), 2: (1, 3)}
    ws = oracle_rows(torch.tensor([1, 4]), None, torch.tensor([[5, 1], [2, 9]]), 2, 7, 4, 10,
                     workspace=True)
    assert ws == {1: (5, 0), 2: (5, 1), 3: (5, 2), 4: (2, 0), 5: (2, 1), 6: (2, 2)}


def test_fp8_oracle_decodes_like_the_float8_dtypes():
    """The oracle's bit-field decode equals PyTorch's float8 decode on every code (NaN as NaN)."""
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float().numpy()
        got = dequant_bits(np.arange(256), fmt, 1.0, torch.float32).view(np.float32)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


# --- gather_and_maybe_dequant_cache ------------------------------------------------------------

def _dequant_cases() -> list[EntryCase]:
    cases = [EntryCase(seqs=s) for s in SEQ_SETS]
    for kv in ("auto", "fp8", "fp8_e5m2"):
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            cases.append(EntryCase(kv_cache_dtype=kv, dtype=dt, seqs=SEQ_SETS[1], seed=1))
    cases += [
        EntryCase(entry=(512,), kv_cache_dtype="fp8", fp8_storage="float8"),
        EntryCase(entry=(320,), kv_cache_dtype="fp8_e5m2", fp8_storage="float8",
                  dtype=torch.float16),
        EntryCase(entry=(7,), dtype=torch.float32, seqs=BAD_IDS),
        EntryCase(entry=(1,), kv_cache_dtype="fp8", dtype=torch.float16),
        EntryCase(entry=(33,), kv_cache_dtype="fp8", dtype=torch.float32, cache_pad=1,
                  cache_offset=1, dst_pad=1, dst_offset=1),
        EntryCase(cache_pad=3, cache_offset=1, dst_pad=5, dst_offset=3, dst_rows_extra=4),
        EntryCase(kv_cache_dtype="fp8", cache_pad=16, cache_transposed=True, dst_pad=64,
                  dtype=torch.float16, seqs=SEQ_SETS[11]),
        EntryCase(kv_cache_dtype="fp8_e5m2", cache_offset=3, dst_rows_extra=3,
                  dtype=torch.float32, seqs=SEQ_SETS[6]),
    ]
    return cases


DEQUANT_CASES = _dequant_cases()


@functools.cache
def _dequant_expected(case: EntryCase) -> torch.Tensor:
    return oracle_entry(case, make_entry_inputs(case), dequant=True)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequant_reference_matches_oracle(case):
    inp = make_entry_inputs(case)
    cache = clone_tensor(inp.src_cache)
    kvwrite.gather_and_maybe_dequant_cache(*inp.dequant_args(case), implementation="torch")
    assert_outputs_equal(inp.dst, _dequant_expected(case), "dst",
                         None if case.fp8 else False)
    assert_outputs_equal(inp.src_cache, cache, "src_cache")


def _run(op: str, impl: str, device: str, inputs_of, args_of, case, caches_of):
    """Run ``impl`` of ``op`` on ``case``'s inputs on ``device``; check that the caches did not
    change; return the inputs."""
    info = registry.get(op, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    inp = inputs_of(case, device)
    caches = [clone_tensor(c) for c in caches_of(inp)]
    try:
        getattr(kvwrite, op)(*args_of(inp, case), implementation=impl)
    except ValueError as e:
        if "cannot run this call" in str(e):
            pytest.skip(str(e))
        raise
    for c, before in zip(caches_of(inp), caches, strict=True):
        assert_outputs_equal(c, before, f"cache ({impl}; a gather never writes it)")
    return inp


@pytest.mark.parametrize("impl, device, case", impl_device_cases(DEQUANT, DEQUANT_CASES, 2))
def test_dequant_implementations(impl, case, device):
    inp = _run(DEQUANT, impl, device, make_entry_inputs, lambda i, c: i.dequant_args(c), case,
               lambda i: (i.src_cache,))
    assert_outputs_equal(inp.dst, _dequant_expected(case), f"dst ({impl})",
                         None if case.fp8 else False)


# --- cp_gather_cache ------------------------------------------------------------------------------

def _cp_cases() -> list[EntryCase]:
    cases = [EntryCase(seqs=s, seed=2) for s in SEQ_SETS]
    cases += [
        EntryCase(entry=(576,), dtype=torch.uint8),
        EntryCase(entry=(8, 16), dtype=torch.float32, entry_perm=(1, 0)),       # HND-like
        EntryCase(entry=(3, 5, 7), dtype=torch.float16, entry_perm=(2, 0, 1)),
        EntryCase(entry=(2, 3, 4, 5), dtype=torch.int16, entry_perm=(3, 2, 1, 0)),  # 4 strided
        EntryCase(entry=(4, 6), dtype=torch.float64, cache_transposed=True),
        EntryCase(entry=(5,), dtype=torch.complex64, cache_pad=1, dst_pad=2),
        EntryCase(entry=(3,), dtype=torch.complex128),
        EntryCase(entry=(), dtype=torch.int64, seqs=SEQ_SETS[1]),
        EntryCase(entry=(9,), dtype=torch.bool, cache_offset=1, dst_offset=3),
        EntryCase(entry=(13,), dtype=torch.bfloat16, cache_pad=1, cache_offset=1, dst_pad=3),
        EntryCase(entry=(0,), dtype=torch.float32),
        # Two outer dims around runs of 128 bytes (Triton's run-major steps under outer dims).
        EntryCase(entry=(2, 3, 32), dtype=torch.float32, entry_perm=(1, 0, 2), seed=3),
    ]
    return cases


CP_CASES = _cp_cases()


@functools.cache
def _cp_expected(case: EntryCase) -> torch.Tensor:
    return oracle_entry(case, make_entry_inputs(case), dequant=False)


@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.id)
def test_cp_reference_matches_oracle(case):
    inp = make_entry_inputs(case)
    kvwrite.cp_gather_cache(*inp.cp_args(), implementation="torch")
    assert_outputs_equal(inp.dst, _cp_expected(case), "dst")


@pytest.mark.parametrize("impl, device, case", impl_device_cases(CP, CP_CASES, 2))
def test_cp_implementations(impl, case, device):
    inp = _run(CP, impl, device, make_entry_inputs, lambda i, c: i.cp_args(), case,
               lambda i: (i.src_cache,))
    assert_outputs_equal(inp.dst, _cp_expected(case), f"dst ({impl})")


def test_cp_four_strided_entry_dims_fall_back_with_the_reason():
    case = EntryCase(entry=(2, 3, 4, 5), dtype=torch.int16, entry_perm=(3, 2, 1, 0))
    inp = make_entry_inputs(case)
    reason = registry.get(CP, "triton").unsupported(inp.src_cache, inp.dst)
    assert reason is not None and "coalesce to 4 strided dims" in reason


# --- cp_gather_and_upconvert_fp8_kv_cache -------------------------------------------------------

def _upconvert_cases() -> list[UpconvertCase]:
    cases = [UpconvertCase(seqs=s) for s in WS_SETS]
    cases += [
        UpconvertCase(dtype=torch.float16, scales="special", seqs=SEQ_SETS[1]),
        UpconvertCase(scales="random", fp8_storage="float8"),
        UpconvertCase(dtype=torch.float16, scales="random", cache_pad=3, cache_offset=1,
                      dst_pad=1, dst_offset=1),
        UpconvertCase(cache_pad=16, cache_transposed=True, dst_pad=8, seqs=SEQ_SETS[12]),
        UpconvertCase(dtype=torch.float16, cache_offset=8, dst_offset=4, seqs=WS_SETS[-1]),
        # Entries 2-byte aligned (Triton: the rotary values as 16-bit loads, the scales' bytes).
        UpconvertCase(dtype=torch.float16, scales="special", cache_pad=2, cache_offset=2,
                      seqs=SEQ_SETS[14]),
    ]
    return cases


UPCONVERT_CASES = _upconvert_cases()


@functools.cache
def _upconvert_expected(case: UpconvertCase) -> torch.Tensor:
    return oracle_upconvert(make_upconvert_inputs(case))


@pytest.mark.parametrize("case", UPCONVERT_CASES, ids=lambda c: c.id)
def test_upconvert_reference_matches_oracle(case):
    inp = make_upconvert_inputs(case)
    kvwrite.cp_gather_and_upconvert_fp8_kv_cache(*inp.args(), implementation="torch")
    assert_outputs_equal(inp.dst, _upconvert_expected(case), "dst", slice(0, 512))


@pytest.mark.parametrize("impl, device, case", impl_device_cases(UPCONVERT, UPCONVERT_CASES))
def test_upconvert_implementations(impl, case, device):
    inp = _run(UPCONVERT, impl, device, make_upconvert_inputs, lambda i, c: i.args(), case,
               lambda i: (i.src_cache,))
    assert_outputs_equal(inp.dst, _upconvert_expected(case), f"dst ({impl})", slice(0, 512))


# --- gather_cache_flash ---------------------------------------------------------------------------

def _flash_cases() -> list[FlashCase]:
    cases = [FlashCase(seqs=s) for s in SEQ_SETS]
    for layout, alloc in ((Layout.NHD, KVAlloc.INTERLEAVED), (Layout.HND, KVAlloc.INTERLEAVED),
                          (Layout.NHD, KVAlloc.PACKED), (Layout.HND, KVAlloc.PACKED),
                          (Layout.HND, KVAlloc.SEPARATE)):
        for kv, ph in (("auto", False), ("fp8", False), ("fp8_e5m2", True)):
            cases.append(FlashCase(layout=layout, alloc=alloc, kv_cache_dtype=kv,
                                   per_head_scale=ph, seqs=SEQ_SETS[1]))
    cases += [
        FlashCase(kv_cache_dtype="fp8", per_head_scale=True, dtype=torch.float16,
                  outputs="fused"),
        FlashCase(kv_cache_dtype="fp8_e5m2", dtype=torch.float32, fp8_storage="float8",
                  outputs="padded"),
        FlashCase(kv_cache_dtype="fp8", dtype=torch.bfloat16, outputs="padded", num_heads=3,
                  head_size=20, layout=Layout.HND, alloc=KVAlloc.PACKED),
        FlashCase(kv_cache_dtype="float16", dtype=torch.float16, num_heads=1, head_size=7),
        FlashCase(kv_cache_dtype="float32", dtype=torch.float32, num_heads=5, head_size=3,
                  outputs="padded", alloc=KVAlloc.INTERLEAVED),
        FlashCase(kv_cache_dtype="auto", dtype=torch.float32, num_heads=2, head_size=128,
                  seqs=BAD_IDS),
    ]
    return cases


FLASH_CASES = _flash_cases()


@functools.cache
def _flash_expected(case: FlashCase):
    return oracle_flash(case, make_flash_inputs(case))


def _flash_check(inp, case, what: str) -> None:
    nan = None if case.cache_dtype.is_fp8 else False
    want_k, want_v = _flash_expected(case)
    assert_outputs_equal(inp.key_out, want_k, f"key_out{what}", nan, (inp.value_out,))
    assert_outputs_equal(inp.value_out, want_v, f"value_out{what}", nan, (inp.key_out,))


@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: c.id)
def test_flash_reference_matches_oracle(case):
    inp = make_flash_inputs(case)
    kvwrite.gather_cache_flash(*inp.args(case), implementation="torch")
    _flash_check(inp, case, "")


@pytest.mark.parametrize("impl, device, case", impl_device_cases(FLASH, FLASH_CASES))
def test_flash_implementations(impl, case, device):
    inp = _run(FLASH, impl, device, make_flash_inputs, lambda i, c: i.args(c), case,
               lambda i: (i.key_cache, i.value_cache))
    _flash_check(inp, case, f" ({impl})")


# --- cp_gather_indexer_k_quant_cache --------------------------------------------------------------

def _indexer_cases() -> list[IndexerCase]:
    cases = [IndexerCase(seqs=s) for s in NO_SS]
    cases += [
        IndexerCase(scale_dtype=torch.float32, k_dtype=torch.float8_e4m3fn),
        IndexerCase(head_dim=64, groups=2, k_layout="padded", scale_layout="padded",
                    page_pad=16),
        IndexerCase(k_layout="strided", scale_layout="strided", scale_dtype=torch.float32,
                    seqs=BAD_IDS),
        IndexerCase(k_layout="strided", scale_layout="strided", page_pad=3, cache_offset=1),
        IndexerCase(head_dim=24, groups=3, scale_dtype=torch.float32, scale_layout="strided",
                    cache_offset=2, page_pad=1),
        IndexerCase(head_dim=7, groups=1, cache_offset=1, k_layout="padded",
                    scale_dtype=torch.float32),
    ]
    return cases


INDEXER_CASES = _indexer_cases()


@functools.cache
def _indexer_expected(case: IndexerCase):
    return oracle_indexer(make_indexer_inputs(case))


@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: c.id)
def test_indexer_reference_matches_oracle(case):
    inp = make_indexer_inputs(case)
    kvwrite.cp_gather_indexer_k_quant_cache(*inp.args(), implementation="torch")
    want_k, want_s = _indexer_expected(case)
    assert_outputs_equal(inp.dst_k, want_k, "dst_k")
    assert_outputs_equal(inp.dst_scale, want_s, "dst_scale")


@pytest.mark.parametrize("impl, device, case", impl_device_cases(INDEXER, INDEXER_CASES))
def test_indexer_implementations(impl, case, device):
    inp = _run(INDEXER, impl, device, make_indexer_inputs, lambda i, c: i.args(), case,
               lambda i: (i.kv_cache,))
    want_k, want_s = _indexer_expected(case)
    assert_outputs_equal(inp.dst_k, want_k, f"dst_k ({impl})")
    assert_outputs_equal(inp.dst_scale, want_s, f"dst_scale ({impl})")


def test_matrix_covers_the_contract():
    for cases in (DEQUANT_CASES, CP_CASES, UPCONVERT_CASES, FLASH_CASES):
        seqs = [c.seqs for c in cases]
        assert not any(_owned_twice(s, cases is UPCONVERT_CASES) for s in seqs)
        assert any(s.starts is not None for s in seqs) and any(s.bad_blocks for s in seqs)
        assert any(s.rows_past < 0 for s in seqs) and any(s.first > 0 for s in seqs)
        assert any(s.strided and s.cu_dtype != s.bt_dtype for s in seqs)
        assert any(min(s.lens, default=0) < 0 for s in seqs)
        assert {s.block_size for s in seqs} >= {1, 7, 16, 64}
    assert {c.entry for c in DEQUANT_CASES} >= {(576,), (512,), (320,), (7,), (1,)}
    assert {c.kv_cache_dtype for c in DEQUANT_CASES} == {"auto", "fp8", "fp8_e5m2"}
    assert {(c.layout, c.alloc) for c in FLASH_CASES} >= {
        (Layout.NHD, KVAlloc.INTERLEAVED), (Layout.HND, KVAlloc.INTERLEAVED),
        (Layout.NHD, KVAlloc.PACKED)}
    assert any(c.per_head_scale for c in FLASH_CASES)
    assert {c.scale_dtype for c in INDEXER_CASES} == {torch.uint8, torch.float32}
    assert any(c.k_layout == "strided" for c in INDEXER_CASES)


# --- the fp8 read rule: all 256 codes under special scales -------------------------------------

def _all_codes_cache(storage: torch.dtype) -> torch.Tensor:
    """A [2, 4, 64] cache whose 8 entries hold the 256 codes, twice, in two orders."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    cache = torch.cat([codes, codes.flip(0)]).view(2, 4, 64)
    return cache if storage == torch.uint8 else cache.view(storage)


def _all_codes_call(kv: str, storage, out_dtype, scale: float, device: str):
    cache = _all_codes_cache(storage).to(device)
    dst = torch.full((8, 64), 7.0, dtype=out_dtype, device=device)
    bt = torch.tensor([[1, 0]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    t2s = torch.zeros(8, dtype=torch.int32, device=device)
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    return (cache, dst, bt, cu, t2s, 8, kv, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS[DEQUANT])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_every_code_under_special_scales(kv, out_dtype, impl, device):
    """D(c, s) for all 256 codes and SPECIAL_SCALES (0, -0, negative, subnormal, huge, inf, NaN)
    against the oracle, through gather_and_maybe_dequant_cache (block table order: block 1 then
    block 0)."""
    info = registry.get(DEQUANT, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    fmt = "e4m3" if kv == "fp8_e4m3" else "e5m2"
    for storage in (torch.uint8, {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]):
        for s in SPECIAL_SCALES:
            args = _all_codes_call(kv, storage, out_dtype, s, device)
            if (reason := info.unsupported(args[0], args[1], kvwrite.MlaMode(kv))) is not None:
                pytest.skip(reason)
            kvwrite.gather_and_maybe_dequant_cache(*args, implementation=impl)
            cache = args[0].cpu().view(torch.uint8)
            want = torch.empty(8, 64, dtype=out_dtype)
            for t in range(8):
                b, o = (1, t) if t < 4 else (0, t - 4)
                bits = dequant_bits(cache[b, o].numpy(), fmt, s, out_dtype)
                want[t].view({2: torch.int16, 4: torch.int32}[want.element_size()]).copy_(
                    torch.from_numpy(bits.view({2: np.int16, 4: np.int32}[bits.itemsize])))
            assert_outputs_equal(args[1], want, f"dst (scale {s}, {storage})", None)


@pytest.mark.parametrize("impl, device", [
    pytest.param(i, d, id=f"{i}-{d}", marks=[pytest.mark.gpu] if d == "cuda" else [])
    for d in ("cpu", "cuda") for i in IMPLS[FLASH] if d == "cuda" or i != "cuda"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_every_code_under_per_head_special_scales(kv, out_dtype, impl, device):
    """gather_cache_flash with one head per special scale (SPECIAL_SCALES as k_scale, reversed as
    v_scale), every head holding all 256 codes (the value cache in reverse order), against the
    oracle."""
    info = registry.get(FLASH, impl)
    if (reason := info.available(device)) is not None:
        pytest.skip(reason)
    fmt = "e4m3" if kv == "fp8_e4m3" else "e5m2"
    h = len(SPECIAL_SCALES)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    kc = codes.repeat(h).view(1, 1, h, 256).to(device)
    vc = codes.flip(0).repeat(h).view(1, 1, h, 256).to(device)
    ks = torch.tensor(SPECIAL_SCALES, dtype=torch.float32, device=device)
    vs = ks.flip(0).contiguous()
    ko = torch.full((2, h, 256), 3.0, dtype=out_dtype, device=device)
    vo = torch.full_like(ko, 3.0)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int64, device=device)
    if (reason := info.unsupported(kc, ko, kvwrite.CacheDType(kv))) is not None:
        pytest.skip(reason)
    kvwrite.gather_cache_flash(kc, vc, ko, vo, bt, cu, kv, ks, vs, implementation=impl)
    for cache, out, sc, name in ((kc, ko, ks, "key_out"), (vc, vo, vs, "value_out")):
        want = torch.full((2, h, 256), 3.0, dtype=out_dtype)
        ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
        nps = {2: np.int16, 4: np.int32}[want.element_size()]
        for head in range(h):
            bits = dequant_bits(cache[0, 0, head].cpu().numpy(), fmt, float(sc[head]), out_dtype)
            want[0, head].view(ints).copy_(torch.from_numpy(bits.view(nps)))
        assert_outputs_equal(out, want, f"{name} ({impl}, per-head special scales)", None)


# --- validation specifics (bad input: tests/test_conformance.py) -----------------------------------

def _entry_base(kv="auto"):
    case = EntryCase(kv_cache_dtype=kv, seqs=Seqs(starts=(1, 2, 3, 4, 5)), entry=(32,))
    return case, make_entry_inputs(case)


def test_scale_is_not_read_where_the_mode_copies():
    case, inp = _entry_base("auto")
    want = clone_tensor(inp.dst)
    a = list(inp.dequant_args(case))
    a[1] = want
    a[7] = None
    kvwrite.gather_and_maybe_dequant_cache(*a)
    kvwrite.gather_and_maybe_dequant_cache(*inp.dequant_args(case)[:7],
                                           torch.full((3,), float("nan")), inp.req.seq_starts)
    assert_outputs_equal(inp.dst, want, "dst")


def test_named_implementation_that_cannot_run_says_why():
    case, inp = _entry_base()
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call"):
        kvwrite.gather_and_maybe_dequant_cache(*inp.dequant_args(case), implementation="cuda")
    with pytest.raises(ValueError, match="implementation: expected one of"):
        kvwrite.gather_and_maybe_dequant_cache(*inp.dequant_args(case), implementation="nope")


# --- Triton: the machine code of the benchmark's calls (CPU: Triton compiles for sm_90) ---------

_TRITON_PTX_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.ops.cp_gather_cache import triton_impl as cp
from kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache import triton_impl as up
from kvwrite.ops.gather_and_maybe_dequant_cache import triton_impl as dq

def ptx(kernel, types, consts, div=(), arch=90):
    consts = {**consts, "PDL": False, "PDL_TRIGGER": False}
    sig = dict(types)
    sig.update({n: "constexpr" for n in consts})
    # As a launch specializes them: 16-byte aligned pointers, integers divisible by 16.
    aligned = [n for n, t in types.items() if t.startswith("*")] + list(div)
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4}).asm["ptx"]

# The benchmark's geometry: 8 requests, blocks of 64 slots, int32 index tensors, 32 rows a program.
# ROW: (ST_STRIDE, SS_STRIDE, BT_S0, BT_S1, MAX_BLOCKS, BLOCK_SIZE, NUM_BLOCKS, HAS_SS, WS, BLOCK_B).
row = dict(ROW=(1, 0, 256, 1, 256, 64, 2048, False, False, 8), BLOCK_T=32)
idx = {"bt_ptr": "*i32", "starts_ptr": "*i32", "t_out": "i32", "num_req": "i32"}
out = {}
out["cp"] = ptx(cp._kernel, {"src_ptr": "*i64", "src_base": "i64", "dst_ptr": "*i64",
                             "dst_base": "i64", "ss_ptr": "*i32", **idx},
                dict(CBS=64 * 144, CPS=144, DRS=144, RUN=144, N0=1, N1=1, N2=1, S0=0, S1=0,
                     S2=0, D0=0, D1=0, D2=0, RUN_MAJOR=True, CHUNK=16, **row),
                div=("src_base", "dst_base"))
out["upconvert"] = ptx(up._kernel, {"src_ptr": "*u8", "src16_ptr": "*i16", "src32_ptr": "*i32",
                                    "dst_ptr": "*bf16", "dst_bits_ptr": "*i16", **idx},
                       dict(ss_ptr=None, CBS=64 * 656, CPS=656, DRS=576, ALIGN=4, NATIVE=True,
                            **{**row, "ROW": (1, 0, 256, 1, 256, 64, 2048, False, True, 8)}))
out["dequant-fp8"] = ptx(dq._kernel, {"src_ptr": "*u8", "dst_ptr": "*bf16", "scale_ptr": "*fp32",
                                      **idx},
                         dict(ss_ptr=None, CBS=64 * 576, CPS=576, DRS=576, E=576, CHUNK=64, FMT=1,
                              NATIVE=True, **row))
# sm_80 has no e4m3 type in Triton: the integer decode there (triton_gather.native_fp8).
out["dequant-fp8-sm80"] = ptx(dq._kernel, {"src_ptr": "*u8", "dst_ptr": "*bf16",
                                           "scale_ptr": "*fp32", **idx},
                              dict(ss_ptr=None, CBS=64 * 576, CPS=576, DRS=576, E=576, CHUNK=64,
                                   FMT=1, NATIVE=False, **row), arch=80)
out["upconvert-sm80"] = ptx(up._kernel, {"src_ptr": "*u8", "src16_ptr": "*i16",
                                         "src32_ptr": "*i32", "dst_ptr": "*bf16",
                                         "dst_bits_ptr": "*i16", **idx},
                            dict(ss_ptr=None, CBS=64 * 656, CPS=656, DRS=576, ALIGN=4,
                                 NATIVE=False,
                                 **{**row, "ROW": (1, 0, 256, 1, 256, 64, 2048, False, True,
                                                   8)}), arch=80)
print(json.dumps(out))
"""


def test_triton_benchmark_calls_move_rows_in_16_byte_accesses():
    """sm_90 PTX of the Triton kernels at the benchmark's shapes: cp_gather_cache's 1152-byte
    entries move as 16-byte loads and stores (the first version's per-element form took 8-byte
    ones, 3.5x slower than the CUDA kernel); the upconvert loads every row's codes, scales and
    rotary values before its first store, its rotary values 16 bytes at a time (they were single
    bytes) and its scales 4 (4 bytes assembled), and decodes with the hardware conversion; the
    fp8 dequant decodes with it too (compiled kernels; the interpreter keeps the integer
    decode, its float8 conversion is not exact)."""
    ptx = run_triton_script(_TRITON_PTX_SCRIPT, {"TRITON_DEFAULT_FP_FUSION": "1"})

    def ops(text):
        return re.findall(r"\b((?:ld|st)\.global[\w.]*)", text)

    cp = ops(ptx["cp"])
    assert cp.count("ld.global.v2.b64") >= 9 and cp.count("st.global.v2.b64") >= 9, cp
    assert set(cp) == {"ld.global.b32", "ld.global.v2.b64", "st.global.v2.b64"}, set(cp)
    up = ptx["upconvert"]
    u = ops(up)
    first_store = next(i for i, o in enumerate(u) if o.startswith("st."))
    assert all(o.startswith("ld.") for o in u[:first_store])
    assert not any(o.startswith("ld.") for o in u[first_store:]), u
    assert u.count("ld.global.v4.b32") == 10 and "ld.global.b8" not in u, u
    assert not any(o.startswith("st.global") and o != "st.global.v4.b32" for o in u), u
    assert up.count("cvt.rn.f16x2.e4m3x2") >= 64 and up.count("cvt.rn.bf16x2.f32") >= 64
    assert ptx["dequant-fp8"].count("cvt.rn.f16x2.e4m3x2") >= 8
    assert "e4m3" not in ptx["dequant-fp8-sm80"] + ptx["upconvert-sm80"]


@pytest.mark.parametrize("capability, native", [((8, 0), False), ((8, 6), False), ((8, 9), True),
                                                ((9, 0), True)])
def test_triton_gathers_decode_by_the_float8_conversion_where_the_gpu_has_it(
        monkeypatch, capability, native):
    """The fp8 gathers' NATIVE (triton_gather.native_fp8) is triton_support.native_fp8: the
    float8 conversion on sm_89 and later only (below it Triton has no e4m3 type: the kernels
    compile with the integer decode, test_triton_benchmark_calls_move_rows_in_16_byte_accesses);
    never on the CPU (the interpreter's conversion is inexact)."""
    from kvwrite.kernels import triton_gather, triton_support

    monkeypatch.setattr(triton_support, "_native_fp8_device", lambda index: capability >= (8, 9))
    assert triton_gather.native_fp8(torch.device("cuda", 0)) is native
    assert triton_gather.native_fp8(torch.device("cpu")) is False
