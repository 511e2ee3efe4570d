"""The gathers' CUDA kernels run on the CPU (no GPU needed): each op's ``kernel.cu`` compiled with
g++ over a SIMT emulation (``tests/gather_emu.h``: one thread per CUDA thread, warp shuffles,
ballots and barriers emulated), launched with exactly the arguments the cuda implementation
computes (``cuda_impl.launch_args``, ``gather_cuda.launch_shape``), over the case matrix of
``test_gather.py`` and against its independent oracle, byte for byte on whole outputs. Several
launch shapes: the default rows per warp, one row per warp, 32 rows per warp in several rounds,
small rounds (2 chunks per lane, 1 upconvert row, 1+1 indexer chunks), and batches past the warp's
32 starts (shared memory) and past the shared memory (global search).

What this does not run is the GPU's own instructions: the predicated 16-byte loads (asm), the
hardware fp8 decode and the packed float16/bfloat16 rounding take their host paths (plain C++,
the software decode, exact roundings) with KVWRITE_EMU; the GPU tests cover those. The generic
build is emulated (fixed arguments as kernel arguments); the specialized builds differ only in
constant folding (their SASS is read by test_gather_cuda.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.resources
import pathlib
import shutil
import subprocess

import pytest
import torch

import kvwrite
import test_gather as tg
from kvwrite.kernels import gather_cuda
from kvwrite.testing.gather import (
    EntryCase,
    FlashCase,
    IndexerCase,
    Seqs,
    UpconvertCase,
    assert_all_outputs_equal,
    big_batch,
    make_entry_inputs,
    make_flash_inputs,
    make_indexer_inputs,
    make_upconvert_inputs,
)

EMU_H = pathlib.Path(__file__).with_name("gather_emu.h")
OPS = ("gather_and_maybe_dequant_cache", "cp_gather_cache", "cp_gather_and_upconvert_fp8_kv_cache",
       "gather_cache_flash", "cp_gather_indexer_k_quant_cache")
_ENTRY_PTRS = ("const u8*", "const u8*", "u8*", "u8*", "const float*", "const float*",
               "const u8*", "const u8*", "const u8*")
PTR_TYPES = {
    "gather_and_maybe_dequant_cache": _ENTRY_PTRS,
    "cp_gather_cache": _ENTRY_PTRS,
    "gather_cache_flash": _ENTRY_PTRS,
    "cp_gather_and_upconvert_fp8_kv_cache": ("const u8*", "u8*", "const u8*", "const u8*",
                                             "const u8*"),
    "cp_gather_indexer_k_quant_cache": ("const u8*", "u8*", "u8*", "const u8*", "const u8*"),
}
SM_COUNT = 2  # small: T_out of a test case spreads to several rows per warp

# Launch shapes (the kernels' round sizes as macros where they differ from the defaults).
TUNINGS = {
    "default": gather_cuda.CudaTuning(specialize=False),
    "one-row-per-warp": gather_cuda.CudaTuning(specialize=False, max_rows_per_warp=1),
    "32-rows-rounds": gather_cuda.CudaTuning(specialize=False, ctas_per_sm=0, max_rounds=32),
    "small-rounds": gather_cuda.CudaTuning(specialize=False, ctas_per_sm=0, max_rounds=32,
                                           entry_unroll=2, upconvert_rows=1,
                                           indexer_unroll=(1, 1)),
    "global-search": gather_cuda.CudaTuning(specialize=False, smem_rows=0),
}


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@dataclasses.dataclass
class Call:
    """One emulated launch and what it must produce."""

    case_id: str
    op: str
    args: gather_cuda.LaunchArgs
    outs: tuple[torch.Tensor, ...]
    wants: tuple[torch.Tensor, ...]
    nan: object
    labels: tuple[str, ...]
    keep: tuple  # tensors the launch reads, alive until it has run


def _calls(op: str, tuning: gather_cuda.CudaTuning, extra: bool) -> list[Call]:
    """Every case of ``op``'s matrix in test_gather.py (each second one where ``extra`` is
    false), as the cuda implementation would launch it with ``tuning``."""
    mod = importlib.import_module(f"kvwrite.ops.{op}.cuda_impl")
    out = []
    if op == "gather_and_maybe_dequant_cache":
        cases = tg.DEQUANT_CASES if extra else tg.DEQUANT_CASES[::2]
        for case in cases:
            inp = make_entry_inputs(case)
            mode, nr, nt = kvwrite.ops.gather_and_maybe_dequant_cache.validate(
                *inp.dequant_args(case))
            if nr and nt:
                a = mod.launch_args(inp.src_cache, inp.dst, inp.req.block_table,
                                    inp.req.cu_seq_lens, inp.req.seq_starts, nt, mode,
                                    inp.scale if mode.uses_scale else None, tuning=tuning)
                out.append(Call(case.id, op, a, (inp.dst,), (tg._dequant_expected(case),),
                                None if case.fp8 else False, ("dst",), (inp,)))
    elif op == "cp_gather_cache":
        cases = tg.CP_CASES if extra else tg.CP_CASES[::2]
        for case in cases:
            inp = make_entry_inputs(case)
            nr = kvwrite.ops.cp_gather_cache.validate(*inp.cp_args())
            if nr and inp.dst.numel() and mod.unsupported(inp.src_cache, inp.dst) is None:
                a = mod.launch_args(inp.src_cache, inp.dst, inp.req.block_table,
                                    inp.req.cu_seq_lens, inp.req.seq_starts, tuning=tuning)
                out.append(Call(case.id, op, a, (inp.dst,), (tg._cp_expected(case),), False,
                                ("dst",), (inp,)))
    elif op == "cp_gather_and_upconvert_fp8_kv_cache":
        cases = tg.UPCONVERT_CASES if extra else tg.UPCONVERT_CASES[::2]
        for case in cases:
            inp = make_upconvert_inputs(case)
            nr = kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache.validate(*inp.args())
            if nr and inp.dst.shape[0]:
                a = mod.launch_args(*inp.args()[:4], nr, inp.req.seq_starts, tuning=tuning)
                out.append(Call(case.id, op, a, (inp.dst,), (tg._upconvert_expected(case),),
                                slice(0, 512), ("dst",), (inp,)))
    elif op == "gather_cache_flash":
        cases = tg.FLASH_CASES if extra else tg.FLASH_CASES[::2]
        for case in cases:
            inp = make_flash_inputs(case)
            cd, nr = kvwrite.ops.gather_cache_flash.validate(*inp.args(case))
            if nr and inp.key_out.numel():
                ks, vs = (inp.k_scale, inp.v_scale) if cd.is_fp8 else (None, None)
                a = mod.launch_args(inp.key_cache, inp.value_cache, inp.key_out, inp.value_out,
                                    inp.req.block_table, inp.req.cu_seq_lens, inp.req.seq_starts,
                                    cd, ks, vs, tuning=tuning)
                out.append(Call(case.id, op, a, (inp.key_out, inp.value_out),
                                tg._flash_expected(case), None if cd.is_fp8 else False,
                                ("key_out", "value_out"), (inp,)))
    else:
        cases = tg.INDEXER_CASES if extra else tg.INDEXER_CASES[::2]
        for case in cases:
            inp = make_indexer_inputs(case)
            nr = kvwrite.ops.cp_gather_indexer_k_quant_cache.validate(*inp.args())
            if nr and inp.dst_k.shape[0]:
                a = mod.launch_args(*inp.args(), tuning=tuning)
                out.append(Call(case.id, op, a, (inp.dst_k, inp.dst_scale),
                                tg._indexer_expected(case), False, ("dst_k", "dst_scale"),
                                (inp,)))
    return out


def _batch(num_req: int, decreasing: bool) -> Seqs:
    """``num_req`` requests of 0-3 rows (big_batch); ``decreasing``: the first half's rows (at
    most 100 requests) moved after all the others (cu_seq_lens drops back once, through an
    empty request: no row owned twice)."""
    seqs = big_batch(num_req - decreasing, rows_past=9, bad_blocks=(-1, 200),
                     cu_dtype=torch.int64)
    if not decreasing:
        return seqs
    lens = list(seqs.lens)
    k = min(100, num_req // 2)
    head = sum(lens[:k])
    return dataclasses.replace(seqs, lens=tuple(lens[:k] + [-head - sum(lens[k:])] + lens[k:]),
                               starts=(*seqs.starts[:k], 0, *seqs.starts[k:]),
                               first=sum(lens[k:]))


def _big_batch_calls(tuning) -> list[Call]:
    """Batches of 31 requests (the most a warp's registers hold: every lane a start), 32 and 40
    (the starts in shared memory) and 2100 (the binary search of global memory), monotone and
    decreasing, fp8 dequant and a flash copy."""
    out = []
    for num_req, decreasing in ((31, False), (31, True), (32, True), (40, False), (40, True),
                                (2100, False), (2100, True)):
        seqs = _batch(num_req, decreasing)
        assert seqs.num_req == num_req
        case = EntryCase(seqs=seqs, kv_cache_dtype="fp8", dtype=torch.float16, entry=(16,))
        inp = make_entry_inputs(case)
        mode, nr, nt = kvwrite.ops.gather_and_maybe_dequant_cache.validate(
            *inp.dequant_args(case))
        mod = importlib.import_module("kvwrite.ops.gather_and_maybe_dequant_cache.cuda_impl")
        a = mod.launch_args(inp.src_cache, inp.dst, inp.req.block_table, inp.req.cu_seq_lens,
                            inp.req.seq_starts, nt, mode, inp.scale, tuning=tuning)
        want = make_entry_inputs(case)
        kvwrite.gather_and_maybe_dequant_cache(*want.dequant_args(case), implementation="torch")
        cid = f"batch-{num_req}{'-decreasing' if decreasing else ''}"
        out.append(Call(cid, "gather_and_maybe_dequant_cache", a, (inp.dst,),
                        (want.dst,), None, ("dst",), (inp,)))
        fc = FlashCase(seqs=seqs, num_heads=2, head_size=8)
        f = make_flash_inputs(fc)
        cd, _ = kvwrite.ops.gather_cache_flash.validate(*f.args(fc))
        fmod = importlib.import_module("kvwrite.ops.gather_cache_flash.cuda_impl")
        fa = fmod.launch_args(f.key_cache, f.value_cache, f.key_out, f.value_out,
                              f.req.block_table, f.req.cu_seq_lens, f.req.seq_starts, cd, None,
                              None, tuning=tuning)
        fw = make_flash_inputs(fc)
        kvwrite.gather_cache_flash(*fw.args(fc), implementation="torch")
        out.append(Call(cid, "gather_cache_flash", fa,
                        (f.key_out, f.value_out), (fw.key_out, fw.value_out), False,
                        ("key_out", "value_out"), (f,)))
    return out


def _driver(op: str, names: list[str]) -> str:
    """C++ of one shared library: the op's kernel.cu over gather_emu.h, and one entry point per
    kernel variant, kvw_emu_<i>(grid, pointers, scalars)."""
    src = importlib.resources.files(f"kvwrite.ops.{op}").joinpath("kernel.cu")
    ptrs = PTR_TYPES[op]
    n_scalars = {9: 33, 5: 16 if "upconvert" in op else 24}[len(ptrs)]
    lines = ['#include "gather_emu.h"', f'#include "{src}"']
    for i, name in enumerate(names):
        args = [f"({t})p[{k}]" for k, t in enumerate(ptrs)] + [f"a[{k}]" for k in
                                                               range(n_scalars)]
        lines.append(f'extern "C" void kvw_emu_{i}(unsigned grid, void* const* p, '
                     f'const long long* a) {{\n  emu_launch(grid, [&] {{ {name}('
                     f'{", ".join(args)}); }});\n}}')
    return "\n".join(lines) + "\n"


def _build(op: str, names: list[str], macros: tuple, d: pathlib.Path) -> ctypes.CDLL:
    include = importlib.resources.files("kvwrite.kernels").joinpath("include")
    tag = "_".join(f"{k}{v}" for k, v in macros)
    cpp = d / f"{op}{tag}.cpp"
    lib = d / f"lib{op}{tag}.so"
    cpp.write_text(_driver(op, names))
    # -ffp-contract=off: every product one rounded IEEE product, as mul.rn.f32 on the GPU.
    cmd = [_compiler(), "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w",
           "-ffp-contract=off", "-fno-fast-math", f"-I{include}", f"-I{EMU_H.parent}",
           *(f"-D{k}={v}" for k, v in macros), str(cpp), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(lib))
    for i in range(len(names)):
        f = getattr(so, f"kvw_emu_{i}")
        f.restype = None
        f.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    return so


def _emulate(calls: list[Call], tuning, libs: dict) -> list[tuple[str, str]]:
    """Runs every call on its op's emulated kernel (``libs``: (op, macros) -> (library, variant
    names), as :func:`_libraries` builds); returns (case id, failure) pairs."""
    macros = gather_cuda.tuning_macros(tuning)
    failures = []
    for c in calls:
        so, names = libs[c.op, macros]
        a = c.args
        grid, _, smem_rows, rpw = gather_cuda.launch_shape(a.t_out, a.num_req, a.has_seq_starts,
                                                           SM_COUNT, a.round_rows, tuning)
        ptrs = (ctypes.c_void_p * len(a.pointers))(*a.pointers)
        scalars = (ctypes.c_longlong * (4 + len(a.fixed)))(a.t_out, a.num_req, smem_rows, rpw,
                                                           *a.fixed)
        getattr(so, f"kvw_emu_{names.index(a.name)}")(grid, ptrs, scalars)
        try:
            assert_all_outputs_equal(c.outs, c.wants, f"{c.case_id} ({a.name}, rows per warp "
                                     f"{rpw})", c.nan, c.labels)
        except AssertionError as e:
            failures.append((c.case_id, str(e)))
    return failures


def _libraries(calls_by_tuning: dict, d: pathlib.Path) -> dict:
    """One library per op and set of round-size macros, holding every variant the calls of the
    tunings with those macros launch (compiled once for all of them)."""
    wanted: dict = {}
    for tuning, calls in calls_by_tuning.items():
        macros = gather_cuda.tuning_macros(tuning)
        for c in calls:
            wanted.setdefault((c.op, macros), set()).add(c.args.name)
    libs = {}
    for (op, macros), names in wanted.items():
        names = sorted(names)
        libs[op, macros] = (_build(op, names, macros, d), names)
    return libs


def _tuning_calls(name: str) -> list[Call]:
    t = TUNINGS[name]
    if name == "global-search":
        return _big_batch_calls(t)
    calls = [c for op in OPS for c in _calls(op, t, extra=name == "default")]
    return calls + (_big_batch_calls(t) if name == "default" else [])


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """{tuning name: (calls, libraries)}: every tuning's calls, and the emulated kernels built
    once for all of them."""
    if _compiler() is None:
        pytest.skip("no host C++ compiler (g++ or c++)")
    calls = {name: _tuning_calls(name) for name in TUNINGS}
    libs = _libraries({TUNINGS[n]: c for n, c in calls.items()},
                      tmp_path_factory.mktemp("gather_emu"))
    return calls, libs


needs_cxx = pytest.mark.skipif(_compiler() is None, reason="no host C++ compiler (g++ or c++)")


@needs_cxx
@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_emulated_kernels_match_the_oracle(tuning, emulated):
    """Every op's kernel, emulated, over the case matrix (every second case for the launch shapes
    other than the default) and the big batches (default and the global search)."""
    calls, libs = emulated
    failures = _emulate(calls[tuning], TUNINGS[tuning], libs)
    assert not failures, "\n".join(f"{cid}: {msg}" for cid, msg in failures[:8])


@needs_cxx
def test_emulation_catches_a_wrong_kernel(tmp_path, monkeypatch):
    """The check can fail: with the indexer's scale chunks written one row off (the kernel's
    source altered), the emulated run no longer matches."""
    from kvwrite.ops.cp_gather_indexer_k_quant_cache import cuda_impl as mod
    src = importlib.resources.files(mod.__package__).joinpath("kernel.cu").read_text()
    bad = src.replace("store_raw<VS>(dst_scale + t_first * s_row_stride + static_cast<i64>(j) *",
                      "store_raw<VS>(dst_scale + t_first * s_row_stride + static_cast<i64>(j ^ 1) *")
    assert bad != src
    (tmp_path / "kernel.cu").write_text(bad)

    class Files:
        def joinpath(self, name):
            return tmp_path / name

    real = importlib.resources.files
    monkeypatch.setattr(importlib.resources, "files",
                        lambda pkg: Files() if pkg == mod.__package__ else real(pkg))
    t = TUNINGS["default"]
    calls = _calls("cp_gather_indexer_k_quant_cache", t, extra=False)
    failures = _emulate(calls, t, _libraries({t: calls}, tmp_path))
    assert failures and "dst_scale" in failures[0][1]


def test_launch_args_match_run():
    """launch_args computes what run launches: the same kernel, fixed arguments and pointers as
    the plan (checked for one case per op; run itself needs a GPU)."""
    seqs = Seqs(starts=(1, 2, 3, 4, 5))
    case = EntryCase(seqs=seqs, kv_cache_dtype="fp8")
    inp = make_entry_inputs(case)
    mode, _, nt = kvwrite.ops.gather_and_maybe_dequant_cache.validate(*inp.dequant_args(case))
    mod = importlib.import_module("kvwrite.ops.gather_and_maybe_dequant_cache.cuda_impl")
    a = mod.launch_args(inp.src_cache, inp.dst, inp.req.block_table, inp.req.cu_seq_lens,
                        inp.req.seq_starts, nt, mode, inp.scale)
    assert (a.name, a.fixed) == mod.plan(inp.src_cache, inp.dst, inp.req.block_table,
                                         inp.req.cu_seq_lens, inp.req.seq_starts, mode)
    assert a.pointers[0] == inp.src_cache.data_ptr() and a.pointers[2] == inp.dst.data_ptr()
    assert a.t_out == nt and a.num_req == seqs.num_req and a.has_seq_starts
    assert a.round_rows == gather_cuda.entry_round_rows(a.fixed)
    u = make_upconvert_inputs(UpconvertCase())
    umod = importlib.import_module("kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache.cuda_impl")
    ua = umod.launch_args(*u.args()[:4], u.req.num_req, u.req.seq_starts)
    assert ua.round_rows == gather_cuda.UPCONVERT_ROWS and ua.t_out == u.dst.shape[0]
    i = make_indexer_inputs(IndexerCase())
    imod = importlib.import_module("kvwrite.ops.cp_gather_indexer_k_quant_cache.cuda_impl")
    ia = imod.launch_args(*i.args())
    assert ia.round_rows == 32 and not ia.has_seq_starts
