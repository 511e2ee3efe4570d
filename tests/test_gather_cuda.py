"""The gathers' CUDA kernels (docs/ops/gather.md): without a GPU, NVRTC compiles of every variant
of the five kernels, the specialized builds of the test cases (none reads a fixed argument from
the parameter bank), the PDL builds' wait before any memory access (SASS), the fp8 read rule
compiled as host C++ against PyTorch on all 256 codes and special scales, and the launch plans;
on the GPU, the generic builds, the global-memory search (batches past the shared-memory
capacity, forced and real), every rows-per-warp shape, large calls and the sanitize cases.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.resources
import re

import numpy as np
import pytest
import torch

import kvwrite
import sass as sass_tools
from host import build_host_lib
from kvwrite.kernels import gather_cuda
from kvwrite.testing.gather import (
    SPECIAL_SCALES,
    EntryCase,
    FlashCase,
    IndexerCase,
    Seqs,
    UpconvertCase,
    assert_all_outputs_equal,
    assert_outputs_equal,
    big_batch,
    clone_tensors,
    make_entry_inputs,
    make_flash_inputs,
    make_indexer_inputs,
    make_upconvert_inputs,
    mixed_seqs,
)
from sass import needs_nvrtc, nvrtc_reason

OPS = ("gather_and_maybe_dequant_cache", "cp_gather_cache", "cp_gather_and_upconvert_fp8_kv_cache",
       "gather_cache_flash", "cp_gather_indexer_k_quant_cache")
# Pointer arguments before the 4 per-call scalars (T_out, B, shared rows, rows per warp).
POINTERS = {"gather_and_maybe_dequant_cache": 9, "cp_gather_cache": 9, "gather_cache_flash": 9,
            "cp_gather_and_upconvert_fp8_kv_cache": 5, "cp_gather_indexer_k_quant_cache": 5}
MEMORY_OPS = ("LDG", "STG", "LD.", "ST.", "ATOM", "RED", "LDGSTS", "UBLKCP", "UTMALDG", "LDS",
              "STS")


def _cuda(op: str):
    return importlib.import_module(f"kvwrite.ops.{op}.cuda_impl")


# One call per op (its inputs on the CPU: a plan needs no GPU).
def _calls():
    seqs = Seqs(starts=(1, 2, 3, 4, 5), cu_dtype=torch.int64, strided=True)
    e = make_entry_inputs(EntryCase(seqs=seqs, kv_cache_dtype="fp8_e5m2"))
    c = make_entry_inputs(EntryCase(seqs=seqs, entry=(4, 8), dtype=torch.float32,
                                    entry_perm=(1, 0)))
    u = make_upconvert_inputs(UpconvertCase(seqs=seqs))
    fc = FlashCase(seqs=seqs, kv_cache_dtype="fp8", per_head_scale=True)
    f = make_flash_inputs(fc)
    i = make_indexer_inputs(IndexerCase(scale_dtype=torch.float32))
    from kvwrite.dtypes import CacheDType
    return {
        "gather_and_maybe_dequant_cache": lambda: _cuda(OPS[0]).plan(
            e.src_cache, e.dst, e.req.block_table, e.req.cu_seq_lens, e.req.seq_starts,
            kvwrite.MlaMode.FP8_E5M2),
        "cp_gather_cache": lambda: _cuda(OPS[1]).plan(c.src_cache, c.dst, c.req.block_table,
                                                      c.req.cu_seq_lens, c.req.seq_starts),
        "cp_gather_and_upconvert_fp8_kv_cache": lambda: _cuda(OPS[2]).plan(
            u.src_cache, u.dst, u.req.block_table, u.req.workspace_starts, u.req.seq_starts),
        "gather_cache_flash": lambda: _cuda(OPS[3]).plan(
            f.key_cache, f.value_cache, f.key_out, f.value_out, f.req.block_table,
            f.req.cu_seq_lens, f.req.seq_starts, CacheDType.FP8_E4M3, f.k_scale, f.v_scale),
        "cp_gather_indexer_k_quant_cache": lambda: _cuda(OPS[4]).plan(
            i.kv_cache, i.dst_k, i.dst_scale, i.req.block_table, i.req.cu_seq_lens),
    }


@pytest.fixture(scope="module")
def every_variant(tmp_path_factory):
    """{op: (names, {name: SASS listing}, cubin size)}: every variant of each kernel compiled in
    one NVRTC program for sm_90 (compiled once for the tests below; that each compiles, and how
    many there are: the conformance suite, kvwrite.testing.providers)."""
    if nvrtc_reason() is not None:
        pytest.skip(nvrtc_reason())
    out = {}
    d = tmp_path_factory.mktemp("gather_sass")
    for op in OPS:
        mod = _cuda(op)
        names = mod.all_kernel_names()
        obj, _ = mod.compile_kernel("sm_90", names)  # one program: raises if any fails
        listings = {}
        if sass_tools.cuobjdump() is not None:
            funcs = sass_tools.function_listings(sass_tools.dump_sass(bytes(obj.code), d))
            listings = {n: funcs[obj.symbol_mapping[n].decode()
                                 if isinstance(obj.symbol_mapping[n], bytes)
                                 else obj.symbol_mapping[n]] for n in names}
        out[op] = (names, listings, len(bytes(obj.code)))
    return out


@needs_nvrtc
@pytest.mark.parametrize("op", OPS)
def test_specialized_build_reads_no_fixed_argument(op, every_variant, tmp_path):
    """sm_90 kernels find their parameters at c[0x0][0x210] on: the pointers, T_out, B, the
    shared rows and the rows per warp, then the fixed arguments. The build with them compiled in
    reads none of them; the generic build of the same variant reads them (the check can fail);
    both read T_out."""
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    name, fixed = _calls()[op]()
    mod = _cuda(op)
    obj, _ = mod.compile_kernel("sm_90", name, fixed=fixed)
    special = sass_tools.param_reads(sass_tools.dump_sass(bytes(obj.code), tmp_path))
    generic = sass_tools.param_reads(every_variant[op][1][name])
    t_out = 0x210 + 8 * POINTERS[op]
    first, end = t_out + 8 * 4, t_out + 8 * (4 + len(fixed))
    sass_tools.assert_fixed_args_compiled_in(generic, special, first, end)
    assert t_out in special, sorted(map(hex, special))
    with pytest.raises(RuntimeError, match=f"{len(fixed)} values"):
        mod.compile_kernel("sm_90", name, fixed=fixed[:-1])


@needs_nvrtc
@pytest.mark.parametrize("op", OPS)
def test_pdl_builds_wait_before_any_memory_access(op, tmp_path):
    """sm_90: the PDL builds (a generic variant and the specialized build of the test call)
    trigger the next kernel (PREEXIT) and wait for the previous one (ACQBULK) before their first
    memory access, shared memory included; the plain build does neither."""
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    from kvwrite.kernels import nvrtc
    mod = _cuda(op)
    name, fixed = _calls()[op]()
    names = [n for n in mod.all_kernel_names()[:1] if n != name]
    for fx, ns in ((None, names), (fixed, [name])):
        obj, _ = mod.compile_kernel("sm_90", ns, fixed=fx, macros=(nvrtc.PDL_MACRO,))
        funcs = sass_tools.functions(sass_tools.dump_sass(bytes(obj.code), tmp_path))
        assert len(funcs) == len(ns)
        sass_tools.assert_waits_first(funcs, memory_ops=MEMORY_OPS)
    obj, _ = mod.compile_kernel("sm_90", name, fixed=fixed)
    sass_tools.assert_no_pdl(sass_tools.dump_sass(bytes(obj.code), tmp_path))


# --- stores of converted values: whole elements, no float-to-integer conversion ---------------

# A float converted to an 8- or 16-bit integer (F2I.U8.F16.TRUNC.NTZ, ...). No gather converts a
# float to an integer; ptxas (NVRTC 13.0) emitted one where the upconvert kernel's unaligned path
# stored a converted half's low byte (cvt.rn.f16.f32, then st.global.u8): the byte became the
# half's value as a saturated integer (inf -> 255, 6.44 -> 6) instead of its bits.
_NARROW_F2I = re.compile(r"\bF2I(?:\.[A-Z0-9_]+)*\.(?:U8|S8|U16|S16)\b")
_BYTE_STORE = re.compile(r"\bSTG(?:\.[A-Z0-9_]+)*\.U8\b")


def _unaligned_upconvert_plans() -> list[tuple[str, tuple[int, ...]]]:
    """The specialized builds of the unaligned upconvert calls: the matrix's and the sanitize
    case's (cache rows of 659 bytes from an odd address: ALIGN 1, float16 rows padded and offset
    by one element), and bfloat16 at ALIGN 1 and 2."""
    from kvwrite.testing.gather import SANITIZE_SEQS
    cases = [
        UpconvertCase(dtype=torch.float16, scales="random", cache_pad=3, cache_offset=1,
                      dst_pad=1, dst_offset=1),
        UpconvertCase(seqs=SANITIZE_SEQS["bounds"], dtype=torch.float16, cache_pad=3,
                      cache_offset=1, dst_pad=1, dst_offset=1),
        UpconvertCase(cache_pad=1, cache_offset=3, dst_pad=3, dst_offset=1),
        UpconvertCase(cache_pad=2, cache_offset=2, dst_pad=1, dst_offset=1),
    ]
    out = []
    for case in cases:
        u = make_upconvert_inputs(case)
        out.append(_cuda(OPS[2]).plan(u.src_cache, u.dst, u.req.block_table,
                                      u.req.workspace_starts, u.req.seq_starts))
    return out


def test_unaligned_upconvert_plans_take_the_narrow_variants():
    names = [name for name, _ in _unaligned_upconvert_plans()]
    assert names == [f"{_cuda(OPS[2]).KERNEL}<{o}, {a}>" for o, a in
                     ((gather_cuda.DT_F16, 1), (gather_cuda.DT_F16, 1), (gather_cuda.DT_BF16, 1),
                      (gather_cuda.DT_BF16, 2))]


@needs_nvrtc
def test_upconvert_stores_whole_elements(every_variant, tmp_path):
    """sm_90: no variant of the upconvert kernel (generic, and the specialized builds of the
    unaligned calls, PDL twin included) stores single bytes: its output is 16-bit, so its stores
    are at least 2 bytes wide whatever the cache's alignment; and none converts a float to a
    narrow integer (the ptxas miscompile of the byte stores, see _NARROW_F2I)."""
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    from kvwrite.kernels import nvrtc
    mod = _cuda(OPS[2])
    listings = dict(every_variant[OPS[2]][1])
    for name, fixed in _unaligned_upconvert_plans():
        for macros in ((), (nvrtc.PDL_MACRO,)):
            obj, _ = mod.compile_kernel("sm_90", name, fixed=fixed, macros=macros)
            listings[f"{name} {fixed} {macros}"] = sass_tools.dump_sass(bytes(obj.code), tmp_path)
    for name, text in listings.items():
        assert not _BYTE_STORE.search(text), f"{name}: stores single bytes of its 16-bit output"
        assert not _NARROW_F2I.search(text), (name, _NARROW_F2I.findall(text)[:4])
        assert "STG" in text, name


@needs_nvrtc
@pytest.mark.parametrize("op", OPS)
def test_no_variant_converts_a_float_to_a_narrow_integer(op, every_variant):
    """sm_90, every variant of each gather: no float-to-8/16-bit-integer conversion (the gathers
    convert floats only to floats), and the dequantizing variants of the entry kernel (fp8 codes
    into 16/32-bit outputs) store whole elements, never single bytes."""
    names, listings, _ = every_variant[op]
    if not listings:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    for name in names:
        text = listings[name]
        assert not _NARROW_F2I.search(text), (name, _NARROW_F2I.findall(text)[:4])
        if f"<{gather_cuda.DT_E4M3}, " in name and op != OPS[4]:
            assert not _BYTE_STORE.search(text), f"{name}: stores single bytes of its output"


# --- the GPU tests' output checks ---------------------------------------------------------------

def test_output_checks_allow_nan_payloads_in_an_output_sharing_the_allocation():
    """key_out and value_out as halves of one tensor ('fused'): the GPU tests check each output's
    whole allocation, NaN-aware in both halves' elements (assert_all_outputs_equal), so a
    dequantized NaN whose payload differs from the reference's (the GPU's conversion gives 0x7FFF,
    PyTorch's on the CPU 0x7E00) passes in either half, and any other byte still fails. A check
    NaN-aware in key_out's own elements only fails on value_out's NaNs (the paths test did)."""
    case = FlashCase(kv_cache_dtype="fp8", per_head_scale=True, dtype=torch.float16,
                     outputs="fused")
    inp = make_flash_inputs(case)
    kvwrite.gather_cache_flash(*inp.args(case), implementation="torch")
    want = clone_tensors(inp.key_out, inp.value_out)
    got = clone_tensors(inp.key_out, inp.value_out)
    from kvwrite.testing.compare import storage_bytes
    halves = storage_bytes(got[0]).view(torch.int16)
    nan = torch.isnan(halves.view(torch.float16)) & (halves != 0x7FFF)
    value_half = torch.zeros_like(nan).view(got[0].shape[0], 2, -1)
    value_half[:, 1] = True
    value_half = value_half.flatten()
    assert bool((nan & value_half).any()) and bool((nan & ~value_half).any())
    halves[nan] = 0x7FFF  # the GPU's NaN
    labels = ("key_out", "value_out")
    assert_all_outputs_equal(got, want, case.id, None, labels)
    with pytest.raises(AssertionError, match="outside the output's elements"):
        assert_outputs_equal(got[0], want[0], "key_out", None)
    with pytest.raises(AssertionError, match="outside the output's elements"):
        assert_outputs_equal(got[1], want[1], "value_out", None)
    ok = ~torch.isnan(halves.view(torch.float16)) & value_half
    i = int(torch.nonzero(ok)[0])
    halves[i] ^= 1
    with pytest.raises(AssertionError, match="1 bytes differ"):
        assert_all_outputs_equal(got, want, case.id, None, labels)


# --- the machine code of the benchmark's calls ---------------------------------------------------

def _bench_plans() -> dict:
    """{kind: (cuda_impl module, name, fixed)} of the calls `kvwrite-bench gather` times (8
    requests, block size 64, bfloat16 rows; 64 blocks here: the number of blocks is a bound, not
    a shape of the code): MLA entries [.., 64, 576] (auto and fp8), cp of the same, flash H=8
    D=128 NHD (auto and fp8), fp8_ds_mla upconvert, the indexer D=128 with uint8 scales."""
    from kvwrite.dtypes import CacheDType
    nb, bs, t, b = 64, 64, 256, 8
    cu = torch.tensor([t // b * i for i in range(b + 1)], dtype=torch.int32)
    bt = torch.zeros(b, t // b // bs + 1, dtype=torch.int32)
    out = {}
    m = _cuda(OPS[0])
    dst = torch.empty(t, 576, dtype=torch.bfloat16)
    src = torch.empty(nb, bs, 576, dtype=torch.bfloat16)
    out["dequant"] = (m, *m.plan(src, dst, bt, cu, None, kvwrite.MlaMode.AUTO))
    src8 = torch.empty(nb, bs, 576, dtype=torch.uint8)
    out["dequant-fp8"] = (m, *m.plan(src8, dst, bt, cu, None, kvwrite.MlaMode.FP8_E4M3))
    m = _cuda(OPS[1])
    out["cp"] = (m, *m.plan(src, dst, bt, cu, None))
    m = _cuda(OPS[2])
    ds = torch.empty(nb, bs, 656, dtype=torch.uint8)
    out["upconvert"] = (m, *m.plan(ds, dst, bt, cu[:-1], None))
    m = _cuda(OPS[3])
    ko = torch.empty(t, 8, 128, dtype=torch.bfloat16)
    kc = torch.empty(nb, bs, 8, 128, dtype=torch.bfloat16)
    one = torch.ones(1)
    out["flash"] = (m, *m.plan(kc, kc, ko, ko, bt, cu, None, CacheDType.AUTO, None, None))
    kc8 = torch.empty(nb, bs, 8, 128, dtype=torch.uint8)
    out["flash-fp8"] = (m, *m.plan(kc8, kc8, ko, ko, bt, cu, None, CacheDType.FP8_E4M3, one,
                                   one))
    m = _cuda(OPS[4])
    kv = torch.empty(nb, bs, 132, dtype=torch.uint8)
    out["indexer"] = (m, *m.plan(kv, torch.empty(t, 128, dtype=torch.uint8),
                                 torch.empty(t, 4, dtype=torch.uint8), bt, cu))
    return out


@pytest.fixture(scope="module")
def bench_sass(tmp_path_factory):
    """{kind: SASS listing} of the benchmark calls' specialized builds (sm_90)."""
    if nvrtc_reason() is not None:
        pytest.skip(nvrtc_reason())
    if sass_tools.cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    d = tmp_path_factory.mktemp("gather_bench_sass")
    out = {}
    for kind, (mod, name, fixed) in _bench_plans().items():
        obj, _ = mod.compile_kernel("sm_90", name, fixed=fixed)
        funcs = sass_tools.function_listings(sass_tools.dump_sass(bytes(obj.code), d))
        assert len(funcs) == 1
        out[kind] = next(iter(funcs.values()))
    return out


# Each round of the benchmark calls: (the row loads' opcode, how many a lane issues, the other
# loads of the round), all before the lane waits for any of them.
_ROUNDS = {
    "dequant": ("LDG.E.128", 9, 0),    # 9 chunks of 16 bytes: 4 MLA rows per warp
    "cp": ("LDG.E.128", 9, 0),
    "dequant-fp8": ("LDG.E.64", 9, 0),  # 9 chunks of 8 codes
    "flash": ("LDG.E.128", 9, 0),      # 8 of the 9 used: one K+V row of 256 chunks per warp
    "flash-fp8": ("LDG.E.64", 9, 0),
    "upconvert": ("LDG.E.128", 8, 4),  # 4 rows: 16 codes and (lanes 0-7) 16 rotary bytes,
                                       # and each row's 4-byte scale
    "indexer": ("LDG.E.128", 8, 1),    # 8 code chunks (32 rows) and one 4-byte scale chunk
}


@needs_nvrtc
@pytest.mark.parametrize("kind", list(_ROUNDS))
def test_bench_round_issues_every_load_before_waiting(kind, bench_sass):
    """sm_90, the specialized build of each benchmark call: from a round's first row load to its
    first store, the lane issues all its loads of the round (as many as the round's chunks)
    before any instruction waits for one of them. The original kernels issued 1 to 3 of their 4
    (ptxas moved each predicated load's value out of a scratch register right after it); the
    benchmark's 16384-row calls then waited for memory 3 times or more per warp."""
    op, n, extra = _ROUNDS[kind]
    text = bench_sass[kind]
    rows = sass_tools.round_window(text, lambda t: t.split()[0] == op)
    assert rows[0] == n and rows[1] == n, (kind, rows)
    # With the round's 4-byte loads (scales), from its first shuffle (after the rule's 4).
    start = _round_shuffles(text)[0]
    every = sass_tools.round_window(text, lambda t: t.split()[0] in (op, "LDG.E"), start=start)
    assert every[0] == n + extra and every[1] == every[0], (kind, every)


def _round_shuffles(text: str) -> list[int]:
    """Indexes (in the scheduled listing) of a benchmark build's round shuffles: the SHFL.IDX
    from the block-table load (the first load after the row rule's ballots) to the first global
    store. ptxas places a second copy of each shuffle after the kernel's end, for a diverged warp
    (BRA.DIV): not counted."""
    ins = [t for t, *_ in sass_tools.scheduled(text)]
    first_store = next(i for i, t in enumerate(ins) if t.startswith("STG"))
    last_vote = max(i for i, t in enumerate(ins[:first_store]) if t.startswith("VOTE"))
    table = next(i for i, t in enumerate(ins) if i > last_vote and t.startswith("LDG"))
    return [i for i, t in enumerate(ins[:first_store]) if i > table and t.startswith("SHFL.IDX")]


# Global stores of each benchmark call: every one 16 bytes wide, but the indexer's 4-byte scales.
_STORES = {"dequant": {"STG.E.128"}, "cp": {"STG.E.128"}, "dequant-fp8": {"STG.E.128"},
           "flash": {"STG.E.128"}, "flash-fp8": {"STG.E.128"}, "upconvert": {"STG.E.128"},
           "indexer": {"STG.E.128", "STG.E"}}


@needs_nvrtc
@pytest.mark.parametrize("kind", list(_STORES))
def test_bench_accesses_are_wide(kind, bench_sass):
    """sm_90: the benchmark calls store rows in 16-byte pieces (the indexer's scales in 4-byte
    ones: 4 bytes a row, one chunk; the plan used to take single bytes for a uint8 dst_scale),
    and the row data never moves through narrower loads."""
    ops = sass_tools.opcodes(bench_sass[kind])
    stores = {o for o in ops if o.startswith("STG")}
    assert stores == _STORES[kind], (kind, sorted(stores))
    assert not any(o.startswith(("LDG.E.U8", "LDG.E.S8", "LDG.E.U16", "LDG.E.S16")) for o in ops)


@needs_nvrtc
@pytest.mark.parametrize("kind", ["dequant", "cp", "flash", "upconvert", "indexer"])
def test_bench_round_shuffles_one_word_per_chunk(kind, bench_sass):
    """sm_90: every row base of the benchmark's caches lies below 2^31, so a chunk's row base
    comes from its row's lane in one shuffle (two for larger caches): one per chunk of the round
    (the upconvert kernel: one per row), no division by a row's chunks in the upconvert."""
    text = bench_sass[kind]
    _, n, extra = _ROUNDS[kind]
    want = {"upconvert": 4, "indexer": n + extra}.get(kind, n)
    assert len(_round_shuffles(text)) == want, (kind, len(_round_shuffles(text)))


@needs_nvrtc
@pytest.mark.parametrize("kind", ["dequant-fp8", "flash-fp8", "upconvert"])
def test_bench_fp8_decode_is_the_hardware_conversion(kind, bench_sass):
    """sm_90: the fp8 reads decode two codes per F2FP...E4M3.UNPACK_B (cvt.rn.f16x2.e4m3x2: exact,
    the read rule's decode), with no per-element branch (the software decode took a branch, a
    convergence barrier and I2FP per element) and two results rounded per F2FP...PACK_AB."""
    ops = sass_tools.opcodes(bench_sass[kind])
    unpack = [o for o in ops if o.startswith("F2FP") and "E4M3.UNPACK_B" in o]
    pack = [o for o in ops if o.startswith("F2FP") and "PACK_AB" in o]
    pairs = {"dequant-fp8": 9 * 4, "flash-fp8": 9 * 4, "upconvert": 4 * 8}[kind]
    assert len(unpack) >= pairs and len(pack) >= pairs, (kind, len(unpack), len(pack))
    assert "I2FP.F32.U32" not in ops, kind
    # Convergence barriers: the rule's, and one per store under its chunk's test; the software
    # decode had one per element (8 or 16 a chunk).
    assert ops.count("BSSY") < 32, (kind, ops.count("BSSY"))


# --- the fp8 read rule as host C++ --------------------------------------------------------------

_HARNESS = r"""
#include "kvw/fp8_read.cuh"  // the shared read rule, as the gather kernels include it
extern "C" {
void kvw_fp8_dequant(int e5m2, const unsigned char* c, float s, float* out, long long n) {
  for (long long i = 0; i < n; ++i)
    out[i] = e5m2 ? fp8_dequant<DT_E5M2>(c[i], s) : fp8_dequant<DT_E4M3>(c[i], s);
}
void kvw_fp8_dequant_any(int e5m2, const unsigned char* c, float s, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = fp8_dequant_any(c[i], s, e5m2 != 0);
}
}
"""


@pytest.fixture(scope="module")
def read_rule_lib(tmp_path_factory):
    so = build_host_lib(tmp_path_factory, _HARNESS, "kvwfp8read", "read-rule harness")
    for f in (so.kvw_fp8_dequant, so.kvw_fp8_dequant_any):
        f.restype = None
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                      ctypes.c_longlong]
    return so


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_read_rule_in_cxx_matches_pytorch_on_every_code(read_rule_lib, fmt):
    """kvw/fp8_read.cuh's D(c, s) (float32, before the output rounding) equals PyTorch's
    ``code.view(float8).float() * s`` bit for bit on all 256 codes under SPECIAL_SCALES and a few
    ordinary ones (NaN as NaN), through both entry points."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = list(SPECIAL_SCALES) + [0.001, 17.25, 2.0**-140, -7e-39, 1.5e-45]
    for s in scales:
        want = (codes.view(dt).float() * torch.tensor(s, dtype=torch.float32)).numpy()
        for fn in (read_rule_lib.kvw_fp8_dequant, read_rule_lib.kvw_fp8_dequant_any):
            got = np.empty(256, dtype=np.float32)
            fn(int(fmt == "e5m2"), codes.numpy().ctypes.data, s, got.ctypes.data, 256)
            assert np.array_equal(np.isnan(got), np.isnan(want)), s
            ok = ~np.isnan(want)
            bad = np.nonzero(got[ok].view(np.uint32) != want[ok].view(np.uint32))[0]
            assert bad.size == 0, (f"scale {s}: codes {np.arange(256)[ok][bad[:6]]}: got "
                                   f"{got[ok][bad[:6]]}, want {want[ok][bad[:6]]}")


# --- launch plans ----------------------------------------------------------------------------------

def test_rows_per_warp_spread_small_calls_and_amortize_large_ones():
    """Small calls one row per warp over the whole GPU; large ones the rows of one round per warp
    (each lane's loads all issued before it waits), many short CTAs; more rounds only where
    max_rounds allows them; never more than 32 rows (lane j locates row j)."""
    t = gather_cuda.TUNING
    rpw = gather_cuda.rows_per_warp
    assert rpw(1024, 132, 4, t) == 1        # 256 CTAs of 4 rows
    assert rpw(16384, 132, 4, t) == 4       # MLA rows (4 per round): 1024 CTAs
    assert rpw(65536, 132, 4, t) == 4       # 4096 CTAs, not 1024 of 4 rounds
    assert rpw(65536, 132, 32, t) == 16     # indexer rows (32 per round): spread to 1024 CTAs
    assert rpw(65536, 132, 1, t) == 1       # flash K+V rows of 4 KiB
    assert rpw(1 << 22, 132, 4, gather_cuda.CudaTuning(max_rounds=8)) == 32
    assert rpw(1 << 22, 132, 64, t) == 32   # capped
    assert rpw(1, 132, 4, t) == 1
    assert rpw(5, 132, 4, gather_cuda.CudaTuning(ctas_per_sm=0, max_rounds=32)) == 32
    assert gather_cuda.uses_smem(2047) and not gather_cuda.uses_smem(2048)
    assert not gather_cuda.uses_smem(3, gather_cuda.CudaTuning(smem_rows=0))
    # Batches of at most 31 requests: starts in registers, no shared memory.
    assert gather_cuda.launch_shape(65536, 31, True, 132, 4) == (4096, 0, 0, 4)
    assert gather_cuda.launch_shape(65536, 32, True, 132, 4) == (4096, 8 * (33 + 32), 33, 4)


def test_round_sizes_match_the_kernels_defaults():
    """gather_cuda's round sizes (the launcher's rows per round) are the kernels' own defaults."""
    def define(text: str, name: str) -> int:
        return int(re.search(rf"#define {name} (\d+)", text).group(1))

    inc = importlib.resources.files("kvwrite.kernels").joinpath("include", "kvw")
    entry = inc.joinpath("gather_entry.cuh").read_text()
    up = importlib.resources.files(f"kvwrite.ops.{OPS[2]}").joinpath("kernel.cu").read_text()
    ix = importlib.resources.files(f"kvwrite.ops.{OPS[4]}").joinpath("kernel.cu").read_text()
    gather = inc.joinpath("gather.cuh").read_text()
    assert define(entry, "KVW_ENTRY_UNROLL") == gather_cuda.ENTRY_UNROLL
    assert define(up, "KVW_UPCONVERT_ROWS") == gather_cuda.UPCONVERT_ROWS
    assert (define(ix, "KVW_INDEXER_CODE_UNROLL"),
            define(ix, "KVW_INDEXER_SCALE_UNROLL")) == gather_cuda.INDEXER_UNROLL
    assert define(gather, "KVW_GATHER_WARP_REQS") == gather_cuda.WARP_REQS
    assert define(gather, "KVW_GATHER_THREADS") == gather_cuda.THREADS


def test_round_rows_of_the_benchmark_shapes():
    """One round covers 4 MLA rows (72 chunks of 16 bytes: 9 per lane), one gather_cache_flash
    row of H=8, D=128 (K and V: 256 chunks, 8 per lane), 32 indexer rows (8 code chunks and one
    4-byte scale chunk each), 4 upconvert rows."""
    b = _bench_plans()
    assert gather_cuda.entry_round_rows(b["dequant"][2]) == 4
    assert gather_cuda.entry_round_rows(b["dequant-fp8"][2]) == 4
    assert gather_cuda.entry_round_rows(b["cp"][2]) == 4
    assert gather_cuda.entry_round_rows(b["flash"][2]) == 1
    assert gather_cuda.entry_round_rows(b["flash-fp8"][2]) == 1
    assert gather_cuda.indexer_round_rows(b["indexer"][2]) == 32
    assert b["indexer"][1].endswith("<16, 4>")  # 4-byte scale chunks into a uint8 dst_scale
    assert gather_cuda.UPCONVERT_ROWS == 4
    assert gather_cuda.entry_round_rows(b["cp"][2], gather_cuda.CudaTuning(entry_unroll=2)) == 1


def test_entry_plan_picks_the_widest_aligned_chunk():
    plan = gather_cuda.entry_plan
    kw = dict(outer=[], cache_strides=(16 * 1152, 1152), dst_row_strides=(1152, 0),
              num_tensors=1, per_head=0, src_align=16, dst_align=16)
    assert plan(conv=gather_cuda.DT_COPY, out_dtype=None, in_es=2, run=576, **kw).vb == 16
    p = plan(conv=gather_cuda.DT_E5M2, out_dtype=torch.bfloat16, in_es=1, run=576, **kw)
    assert (p.conv, p.vb, p.fixed[-1]) == (gather_cuda.DT_E4M3, 8, 1)  # e5m2: a fixed argument
    assert plan(conv=gather_cuda.DT_COPY, out_dtype=None, in_es=2, run=7,
                **kw).vb == 2  # 14 bytes
    assert plan(conv=gather_cuda.DT_E4M3, out_dtype=torch.float32, in_es=1, run=576,
                **{**kw, "dst_align": 8}).vb == 2  # 8-byte rows: 2 codes -> 8 bytes
    assert plan(conv=gather_cuda.DT_COPY, out_dtype=None, in_es=1, run=576,
                **{**kw, "src_align": 1}).vb == 1


def test_every_case_plans_a_compiled_variant():
    """The plan of each op's test call names one of all_kernel_names() (so the every-variant
    compile covers what runs), with the fixed-argument count the kernel expects."""
    counts = {"gather_and_maybe_dequant_cache": 29, "cp_gather_cache": 29,
              "gather_cache_flash": 29, "cp_gather_and_upconvert_fp8_kv_cache": 12,
              "cp_gather_indexer_k_quant_cache": 20}
    for op, call in _calls().items():
        name, fixed = call()
        assert name in _cuda(op).all_kernel_names(), (op, name)
        assert len(fixed) == counts[op], (op, len(fixed))


def test_cuda_unavailable_on_cpu_says_why():
    for op in OPS:
        assert "CUDA devices only" in kvwrite.registry.get(op, "cuda").available("cpu")


# --- GPU: the other builds and paths --------------------------------------------------------------

def _gpu(op: str):
    info = kvwrite.registry.get(op, "cuda")
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    return _cuda(op)


def _tuned_runs(op: str, tuning):
    """(case id, outputs, expected, NaN columns, output names) over a part of the matrix, running
    cuda_impl.run with ``tuning`` (the outputs are checked together by
    assert_all_outputs_equal: key_out and value_out may be halves of one allocation)."""
    import test_gather as tg
    mod = _cuda(op)
    if op == "gather_and_maybe_dequant_cache":
        for case in tg.DEQUANT_CASES[::2]:
            inp = make_entry_inputs(case, "cuda")
            mode, nr, nt = kvwrite.ops.gather_and_maybe_dequant_cache.validate(
                *inp.dequant_args(case))
            if nr and nt:
                mod.run(inp.src_cache, inp.dst, inp.req.block_table, inp.req.cu_seq_lens,
                        inp.req.seq_starts, nt, mode, inp.scale if mode.uses_scale else None,
                        tuning=tuning)
            yield (case.id, (inp.dst,), (tg._dequant_expected(case),),
                   None if case.fp8 else False, ("dst",))
    elif op == "cp_gather_cache":
        for case in tg.CP_CASES[::2]:
            inp = make_entry_inputs(case, "cuda")
            nr = kvwrite.ops.cp_gather_cache.validate(*inp.cp_args())
            if nr and inp.dst.numel() and mod.unsupported(inp.src_cache, inp.dst) is None:
                mod.run(inp.src_cache, inp.dst, inp.req.block_table, inp.req.cu_seq_lens,
                        inp.req.seq_starts, tuning=tuning)
                yield case.id, (inp.dst,), (tg._cp_expected(case),), False, ("dst",)
    elif op == "cp_gather_and_upconvert_fp8_kv_cache":
        for case in tg.UPCONVERT_CASES[::2]:
            inp = make_upconvert_inputs(case, "cuda")
            nr = kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache.validate(*inp.args())
            if nr and inp.dst.shape[0]:
                mod.run(*inp.args()[:4], nr, inp.req.seq_starts, tuning=tuning)
            yield case.id, (inp.dst,), (tg._upconvert_expected(case),), slice(0, 512), ("dst",)
    elif op == "gather_cache_flash":
        for case in tg.FLASH_CASES[::2]:
            inp = make_flash_inputs(case, "cuda")
            cd, nr = kvwrite.ops.gather_cache_flash.validate(*inp.args(case))
            if nr and inp.key_out.numel():
                ks, vs = (inp.k_scale, inp.v_scale) if cd.is_fp8 else (None, None)
                mod.run(inp.key_cache, inp.value_cache, inp.key_out, inp.value_out,
                        inp.req.block_table, inp.req.cu_seq_lens, inp.req.seq_starts, cd, ks, vs,
                        tuning=tuning)
            yield (case.id, (inp.key_out, inp.value_out), tg._flash_expected(case),
                   None if cd.is_fp8 else False, ("key_out", "value_out"))
    else:
        for case in tg.INDEXER_CASES[::2]:
            inp = make_indexer_inputs(case, "cuda")
            nr = kvwrite.ops.cp_gather_indexer_k_quant_cache.validate(*inp.args())
            if nr and inp.dst_k.shape[0]:
                mod.run(*inp.args(), tuning=tuning)
            yield (case.id, (inp.dst_k, inp.dst_scale), tg._indexer_expected(case), False,
                   ("dst_k", "dst_scale"))


TUNINGS = {
    "generic": gather_cuda.CudaTuning(specialize=False),
    "global-search": gather_cuda.CudaTuning(smem_rows=0),
    "generic-global-search": gather_cuda.CudaTuning(specialize=False, smem_rows=0),
    "one-row-per-warp": gather_cuda.CudaTuning(max_rows_per_warp=1),
    "32-rows-per-warp": gather_cuda.CudaTuning(ctas_per_sm=0, max_rounds=32),
    "small-rounds": gather_cuda.CudaTuning(ctas_per_sm=0, max_rounds=32, entry_unroll=2,
                                           upconvert_rows=1, indexer_unroll=(1, 1)),
    "no-pdl": gather_cuda.CudaTuning(pdl_max_ctas=0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("op", OPS)
def test_gpu_cuda_builds_and_paths(op, tuning):
    """Every other build and path of the cuda kernels over half of each op's matrix: the generic
    builds (runtime arguments), the binary search of global memory (forced; it applies to batches
    of 32 requests or more, see test_gpu_batches_either_side_of_the_shared_memory), one and 32
    rows per warp (32: several rounds), rounds of 2 entry chunks, 1 upconvert row and 1+1
    indexer chunks per lane (many rounds, each row split across them), without PDL."""
    _gpu(op)
    for case_id, gots, wants, nan, labels in _tuned_runs(op, TUNINGS[tuning]):
        torch.cuda.synchronize()
        assert_all_outputs_equal(gots, wants, f"{case_id} ({tuning})", nan, labels)


@pytest.mark.gpu
@pytest.mark.parametrize("num_req", [31, 32, 200, 2047, 2048, 5000])
@pytest.mark.parametrize("decreasing", [False, True], ids=["monotone", "decreasing"])
def test_gpu_batches_either_side_of_the_shared_memory(num_req, decreasing):
    """B = 31 keeps its starts in the registers of each warp (a ballot per row), 32 to 2047 in
    shared memory, 2048 and 5000 search global memory; the decreasing variant moves the first
    requests' rows (100, or half a small batch) after all others (cu_seq_lens drops back: no
    request owns a row twice), which takes the scan where the search misses."""
    for op in ("gather_and_maybe_dequant_cache", "gather_cache_flash"):
        _gpu(op)
    # The decreasing variant adds one (empty) request: B = num_req either way.
    seqs = big_batch(num_req - decreasing, rows_past=9, bad_blocks=(-1, 200),
                     cu_dtype=torch.int64)
    if decreasing:
        lens = list(seqs.lens)
        k = min(100, num_req // 2)
        head = sum(lens[:k])
        seqs = dataclasses.replace(seqs, lens=tuple(lens[:k] + [-head - sum(lens[k:])]
                                                    + lens[k:]),
                                   starts=(*seqs.starts[:k], 0, *seqs.starts[k:]),
                                   first=sum(lens[k:]), rows_past=9)
    case = EntryCase(seqs=seqs, kv_cache_dtype="fp8", dtype=torch.float16, entry=(64,))
    inp = make_entry_inputs(case, "cuda")
    kvwrite.gather_and_maybe_dequant_cache(*inp.dequant_args(case), implementation="cuda")
    cpu = make_entry_inputs(case)
    kvwrite.gather_and_maybe_dequant_cache(*cpu.dequant_args(case), implementation="torch")
    assert_outputs_equal(inp.dst, cpu.dst, f"dst (B = {seqs.num_req})", None)
    fc = FlashCase(seqs=seqs, num_heads=2, head_size=16, layout=kvwrite.Layout.HND,
                   alloc=kvwrite.KVAlloc.INTERLEAVED)
    f, fcpu = make_flash_inputs(fc, "cuda"), make_flash_inputs(fc)
    kvwrite.gather_cache_flash(*f.args(fc), implementation="cuda")
    kvwrite.gather_cache_flash(*fcpu.args(fc), implementation="torch")
    assert_outputs_equal(f.key_out, fcpu.key_out, f"key_out (B = {seqs.num_req})")
    assert_outputs_equal(f.value_out, fcpu.value_out, f"value_out (B = {seqs.num_req})")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_gpu_large_calls(op, impl):
    """MLA chunked prefill's shape at size: a few long sequences and many short ones (about 20000
    rows, more than one wave of CTAs), every op, against the torch implementation on the GPU."""
    info = kvwrite.registry.get(op, impl)
    if (reason := info.available("cuda")) is not None:
        pytest.skip(reason)
    seqs = mixed_seqs(long=(9000, 4000, 2500), short=400, max_short=20, num_blocks=1400,
                      block_size=16, context=op != "cp_gather_indexer_k_quant_cache",
                      bad_blocks=(-1, 1400))
    fn = getattr(kvwrite, op)
    if op in ("gather_and_maybe_dequant_cache", "cp_gather_cache"):
        case = EntryCase(seqs=seqs, kv_cache_dtype="fp8" if op[0] == "g" else "auto")
        inp = make_entry_inputs(case, "cuda")
        args = inp.dequant_args(case) if op[0] == "g" else inp.cp_args()
        outs, nan = (inp.dst,), (None if op[0] == "g" else False)
        swap = {1: 0}
    elif op == "cp_gather_and_upconvert_fp8_kv_cache":
        inp = make_upconvert_inputs(UpconvertCase(seqs=seqs), "cuda")
        args, outs, nan, swap = inp.args(), (inp.dst,), slice(0, 512), {1: 0}
    elif op == "gather_cache_flash":
        case = FlashCase(seqs=seqs, num_heads=8, head_size=64, kv_cache_dtype="fp8",
                         per_head_scale=True, layout=kvwrite.Layout.HND,
                         alloc=kvwrite.KVAlloc.INTERLEAVED)
        inp = make_flash_inputs(case, "cuda")
        args, outs, nan, swap = inp.args(case), (inp.key_out, inp.value_out), None, {2: 0, 3: 1}
    else:
        inp = make_indexer_inputs(IndexerCase(seqs=seqs, scale_dtype=torch.float32), "cuda")
        args, outs, nan, swap = inp.args(), (inp.dst_k, inp.dst_scale), False, {1: 0, 2: 1}
    want = clone_tensors(*outs)
    ref_args = list(args)
    for pos, k in swap.items():
        ref_args[pos] = want[k]
    fn(*ref_args, implementation="torch")
    fn(*args, implementation=impl)
    for got, w in zip(outs, want, strict=True):
        assert_outputs_equal(got, w, f"{op} large ({impl})", nan)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_sanitize_cases(op):
    """Each op's memcheck cases (``tools/sanitize/<op>.py``) pass without the memory checker too."""
    _gpu(op)
    mod = importlib.import_module(f"tools.sanitize.{op}")
    failed = [(cid, msg) for cid, fn in mod.cases() if (msg := fn()) is not None]
    assert not failed, failed


@pytest.mark.parametrize("op", OPS)
def test_sanitize_cases_are_listed(op):
    mod = importlib.import_module(f"tools.sanitize.{op}")
    ids = [cid for cid, _ in mod.cases()]
    assert ids and len(ids) == len(set(ids))
