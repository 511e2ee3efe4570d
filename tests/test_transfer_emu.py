"""The raw copy kernels of transfer.cu (``transfer_copy_kernel``: segments of one row;
``transfer_copy_rows_kernel``: several rows a warp) run on the CPU (no GPU needed): the source
compiled with g++ over the SIMT emulation of ``tests/gather_emu.h`` (one thread per CUDA thread,
CTAs of 128 threads one after the other), launched with exactly the arguments the cuda
implementation computes (``transfer_cuda.copy_calls``), against ``raw_oracle`` of
tools/sanitize/transfer_plans.py on whole allocations (sources unchanged too).

Covered: every copy kind of the sanitize plans, and rows of 1..40 vectors and a few long ones in
five layouts (dense 16-byte vectors, a relayout, 2-byte vectors in padded rows, 1-byte vectors at
odd offsets, non-dense rows of 8-byte elements in 4-byte pieces), two jobs a launch, int64 and
strided int32 mappings with out-of-range ids, every U the launcher picks (loads in flight 1, 2,
8), grids of 1 CTA, 3 and as many as the work fills. What the emulation cannot run is the GPU's
own loads (ld.volatile, ld.global.nc): with KVWRITE_EMU they are plain C++ loads of the same
bytes; the GPU tests (test_transfer_cuda.py) cover those.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.resources
import itertools
import pathlib
import shutil
import subprocess

import pytest
import torch

from kvwrite.kernels import transfer_cuda as tc
from kvwrite.testing.sanitize import compare_outputs
from kvwrite.transfer import CopyJob, Side
from tools.sanitize import transfer_plans as tp

EMU_H = pathlib.Path(__file__).with_name("gather_emu.h")
EMU_THREADS = 128  # gather_emu.h's kEmuThreads
SMS = 16           # the "many CTAs" grid: up to 16 CTAs (the work's, where fewer)
PAIRS = tp.PAIRS   # (-1, 2) and (1, 7) skipped (blocks 6)
MOST = [1, 2, 8]   # loads in flight: rows U 1, 2, 8 (ROWS_MOST); segment U up to 1, 2, 8
GRIDS = [1, 3, None]  # max_ctas
ROW_VECTORS = list(range(1, 41)) + [63, 64, 100, 257]

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler (g++)")


def _tuning(most: int, order: str = "auto") -> tc.TransferTuning:
    """Loads in flight ``most`` on every side; the rows kernel's order ``order`` (auto: these
    tests' jobs lie in allocations of their own, so job-major; "pairs" forces the other)."""
    return tc.TransferTuning(loads_in_flight=most, loads_in_flight_host=most, host_read_rows=most,
                             rows_order=order)


def _all_names() -> list[str]:
    names = set()
    for most in MOST:
        names |= {n for n in tc.all_kernel_names(_tuning(most)) if "copy" in n}
    return sorted(names)


def _driver(names: list[str], src) -> str:
    lines = ['#include "gather_emu.h"', f'#include "{src}"']
    for i, name in enumerate(names):
        idx = name.split(", ")[1]
        # the rows kernel's last argument: its order (pair_major)
        n_args = 4 + 2 * tc.SLOTS + 1 + 12 + 3 + 4 + ("rows" in name)
        args = [f"(const {idx}*)a[0]"] + [f"a[{k}]" for k in range(1, n_args)]
        lines.append(f'extern "C" void kvw_emu_{i}(unsigned grid, const long long* a) {{\n'
                     f'  emu_launch(grid, [&] {{ {name}({", ".join(args)}); }});\n}}')
    return "\n".join(lines) + "\n"


def _build(d: pathlib.Path, src=None, names: list[str] | None = None):
    """(library, names): every copy variant the tested tunings launch (or ``names``), emulated
    (``src``: the kernel source's path, transfer.cu where None)."""
    if src is None:
        src = importlib.resources.files(tc.SOURCE.package).joinpath(tc.SOURCE.filename)
    if names is None:
        names = _all_names()
    (d / "copy.cpp").write_text(_driver(names, src))
    include = importlib.resources.files("kvwrite.kernels").joinpath("include")
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w",
                    f"-I{include}", f"-I{EMU_H.parent}", str(d / "copy.cpp"), "-o",
                    str(d / "libcopy.so")], check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(d / "libcopy.so"))
    for i in range(len(names)):
        f = getattr(so, f"kvw_emu_{i}")
        f.restype = None
        f.argtypes = [ctypes.c_uint, ctypes.c_void_p]
    return so, names


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no host C++ compiler (g++)")
    return _build(tmp_path_factory.mktemp("transfer_emu"))


def launched_names(tuning: tc.TransferTuning, names: list[str]):
    """A ``run(plan)`` that only records the copy variants ``plan`` launches in ``names`` (what a
    mutated source's build needs: every variant is a 20-second build)."""
    return lambda plan: names.extend(c.name for c in tc.copy_calls(plan, tuning))


def emu_run(emu, tuning: tc.TransferTuning, launched: list | None = None):
    """A ``run(plan)`` that runs the plan's copy launches (copy_calls) on the emulated kernels,
    each at the grid run would take on a GPU of SMS SMs and CTAs of EMU_THREADS threads."""
    so, names = emu

    def run(plan):
        for c in tc.copy_calls(plan, tuning):
            grid = tc.grid_size(c.work, EMU_THREADS // 32 * c.per_warp, SMS, plan.max_ctas, 1)
            a = (ctypes.c_longlong * len(c.args))(*[x - (1 << 64) if x >= 1 << 63 else x
                                                    for x in c.args])
            getattr(so, f"kvw_emu_{names.index(c.name)}")(grid, a)
            if launched is not None:
                launched.append((c.name, grid))
    return run


@needs_cxx
@pytest.mark.parametrize("most, order", [(m, "auto") for m in MOST] + [(2, "pairs"), (8, "pairs")])
@pytest.mark.parametrize("layout", list(tp.ROW_LAYOUTS))
def test_emulated_rows_of_every_length(emu, layout, most, order):
    """Rows of 1..40 vectors and a few long ones: every grouping (lanes 1..32 a row) and the
    segments, each length at one of the grids and mapping kinds (rotating), two jobs a launch,
    the rows walked job-major and pair-major."""
    tuning = _tuning(most, order)
    failures = []
    for k, n in enumerate(ROW_VECTORS):
        views, jobs = tp.row_views(layout, n, "cpu", seed=k)
        (cl,) = tc.copy_launches(tuple(jobs), tuning)
        vb, nvec = tp.ROW_LAYOUTS[layout]
        assert (cl.vb, cl.geometry[12]) == (vb, nvec(n)), (layout, n)
        launched = []
        max_ctas = GRIDS[k % 3]
        mdt, strided = ((torch.int64, False), (torch.int32, True))[k % 2]
        err = tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS,
                               emu_run(emu, tuning, launched), mapping_dtype=mdt,
                               strided_mapping=strided, max_ctas=max_ctas, jobs=jobs)
        lanes = tc.copy_lanes(cl.geometry[12])
        u = tc.copy_rows_unroll(most) if lanes else tc.copy_unroll(cl.geometry[12], most)
        assert [name for name, _ in launched] == [tc.copy_name(cl.vb, mdt, u, lanes)]
        if err is not None:
            failures.append(f"n={n} {launched}: {err}")
    assert not failures, "\n".join(failures[:6])


@needs_cxx
@pytest.mark.parametrize("kind", tp.COPY_KINDS)
@pytest.mark.parametrize("most", MOST)
def test_emulated_copy_kinds(emu, kind, most):
    """Every copy kind of the sanitize plans, at every grid and both mapping kinds."""
    tuning = _tuning(most)
    for max_ctas in GRIDS:
        for mdt, strided in ((torch.int64, False), (torch.int32, True)):
            err = tp.run_copy_case("swap_blocks", tp.copy_views(kind, "cpu"), PAIRS,
                                   emu_run(emu, tuning), mapping_dtype=mdt,
                                   strided_mapping=strided, max_ctas=max_ctas)
            assert err is None, (kind, max_ctas, mdt, err)


@needs_cxx
def test_emulated_rows_many_warps_and_ctas(emu):
    """A launch of many rows (32 jobs of 6 heads x 5 tokens of 16-vector rows, 41 pairs with
    repeated sources and out-of-range ids): every warp of several CTAs takes steps, the
    grid-stride loop wraps, rows of one step span pairs and jobs; job-major and pair-major."""
    g = torch.Generator().manual_seed(11)
    views = []
    for _ in range(32):
        src = torch.randint(-2**31, 2**31, (6, 6, 5, 64), generator=g, dtype=torch.int32)
        views.append((src, torch.randint(-2**31, 2**31, (40, 6, 5, 64), generator=g,
                                         dtype=torch.int32)))
    jobs = [tp.copy_job(s, d) for s, d in views]
    pairs = [(m % 7 - 1, m) for m in range(40)] + [(2, 40)]  # m % 7 == 0, j 40: skipped
    for order, max_ctas in itertools.product(("jobs", "pairs"), (2, None)):
        tuning = _tuning(2, order)
        launched = []
        want = tp.raw_oracle(views, pairs)
        mapping = tp.mapping_tensor(pairs, torch.int32, "cpu", strided=True)
        emu_run(emu, tuning, launched)(tp.make_plan("swap_blocks_multi_layer", jobs, mapping,
                                                    len(pairs), torch.device("cuda"), max_ctas))
        assert launched == [(tc.copy_name(16, torch.int32, 2, 16),
                             2 if max_ctas else SMS)]
        got = {f"dst{n}": d for n, (_, d) in enumerate(views)}
        assert compare_outputs(got, {f"dst{n}": w for n, w in enumerate(want)}) is None


@needs_cxx
@pytest.mark.parametrize("max_ctas", [1, 3, None])
def test_emulated_relayout_into_one_buffer(emu, max_ctas):
    """Five layers' [blocks, N, H, C] caches into one page-first buffer [blocks, L, H, N, C] and
    back out of it: their jobs lie inside one block of the buffer, so the rule walks the rows
    pair-major; the whole buffer (and the caches) against torch."""
    g = torch.Generator().manual_seed(5)
    layers = 5

    def ints(*shape):
        return torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int32)

    caches = [ints(6, 3, 2, 16).transpose(1, 2) for _ in range(layers)]  # [blocks, H, N, C]
    buf = ints(7, layers, 2, 3, 16)
    tuning = _tuning(2)
    for into in (True, False):
        want_buf, want_caches = buf.clone(), [c.clone() for c in caches]
        for i, j in PAIRS:
            for n in range(layers):
                if into and 0 <= i < 6 and 0 <= j < 7:
                    want_buf[j, n] = caches[n][i]
                if not into and 0 <= i < 7 and 0 <= j < 6:
                    want_caches[n][j] = buf[i, n]
        pairs = [(c, buf[:, n]) if into else (buf[:, n], c) for n, c in enumerate(caches)]
        mapping = tp.mapping_tensor(PAIRS, torch.int64, "cpu")
        plan = tp.make_plan("relayout_kv_cache", [tp.copy_job(s, d) for s, d in pairs], mapping,
                            len(PAIRS), torch.device("cuda"), max_ctas)
        assert [c.args[-1] for c in tc.copy_calls(plan, tuning)] == [1]
        emu_run(emu, tuning)(plan)
        assert torch.equal(buf, want_buf) and all(
            torch.equal(c, w) for c, w in zip(caches, want_caches, strict=True)), (into, max_ctas)


class _DeviceSide(Side):
    """A CPU tensor's side taken for device memory (the emulated kernels' memory is the host's):
    the launcher's device-copy choices (half rows, U) apply."""

    on_host = False


def _as_device(job: CopyJob) -> CopyJob:
    def side(x: Side) -> _DeviceSide:
        return _DeviceSide(x.tensor, x.offset, x.strides, x.blocks)
    return dataclasses.replace(job, src=side(job.src), dst=side(job.dst))


@needs_cxx
@pytest.mark.parametrize("max_ctas", [None, 3])
@pytest.mark.parametrize("layout", ["dense16", "relayout16"])
def test_emulated_half_rows(emu, layout, max_ctas):
    """Rows of 32 vectors in device memory: on every SM (no max_ctas) copy_calls moves each job
    as two jobs of half rows (16 lanes a row, halve_rows), under a budget as rows of 32 lanes;
    the same bytes either way, whole allocations (sources unchanged too)."""
    views, jobs = tp.row_views(layout, 32, "cpu", seed=3)
    jobs = [_as_device(j) for j in jobs]
    tuning = _tuning(2)
    launched = []
    err = tp.run_copy_case("relayout_kv_cache", views, PAIRS, emu_run(emu, tuning, launched),
                           max_ctas=max_ctas, jobs=jobs)
    assert err is None, err
    lanes = 16 if max_ctas is None else 32
    assert [name for name, _ in launched] == [tc.copy_name(16, torch.int64, 2, lanes)]


def _whole_block_case(run, tokens: int, int32_per_row: int, relayout: bool) -> str | None:
    """Rows of ``int32_per_row`` int32 (16-byte vectors) in blocks of ``tokens`` tokens, 3 heads,
    4 jobs, 9 pairs (repeated sources, out-of-range ids), 3 CTAs; the destination (B, N, H, C)
    where ``relayout``. None where ``run`` copied exactly what the oracle says
    (tp.run_copy_case)."""
    g = torch.Generator().manual_seed(tokens * 100 + int32_per_row)
    views = []
    for _ in range(4):
        src = torch.randint(-2**31, 2**31, (5, 3, tokens, int32_per_row), generator=g,
                            dtype=torch.int32)
        dst = torch.randint(-2**31, 2**31, (7, tokens, 3, int32_per_row), generator=g,
                            dtype=torch.int32)
        views.append((src, dst.transpose(1, 2) if relayout else dst.view(7, 3, tokens, -1)))
    pairs = [(0, 6), (4, 0), (1, 3), (-1, 2), (2, 5), (4, 1), (3, 7), (0, 4), (5, 2)]
    return tp.run_copy_case("swap_blocks_multi_layer", views, pairs, run, max_ctas=3)


@needs_cxx
@pytest.mark.parametrize("order", ["auto", "pairs"])
@pytest.mark.parametrize("tokens", [16, 20, 7])
@pytest.mark.parametrize("vectors", [4, 16, 32])
def test_emulated_rows_of_whole_blocks_at_u8(emu, tokens, vectors, order):
    """U = 8 (a remote side's loads in flight): rows of 4, 16 and 32 vectors (8, 2 and 1 rows a
    warp's load) in blocks of 16 tokens (a step's rows all in one block: the path that takes
    them from the lane's first row), 20 (some steps cross a block's end) and 7 (every step
    does), copied and relayout, job-major and pair-major."""
    launched = []
    for relayout in (False, True):
        err = _whole_block_case(emu_run(emu, _tuning(8, order), launched), tokens,
                                4 * vectors, relayout)
        assert err is None, (tokens, vectors, relayout, err)
    lanes = tc.copy_lanes(vectors)
    assert {name for name, _ in launched} == {tc.copy_name(16, torch.int64, 8, lanes)}


@needs_cxx
@pytest.mark.parametrize("shape, cut", [
    ((6, 1, 1, 1536), True),    # a whole block one row of 384 vectors: 12 rows of 32
    ((6, 1, 5, 256), True),     # 5 tokens of 64 vectors: the tokens become heads
    ((6, 3, 1, 512), True),     # 3 heads of 128 vectors
    ((6, 2, 3, 256), False),    # heads and tokens: segments
    ((6, 1, 1, 1000), False),   # 250 vectors, not a multiple of 32: segments
])
def test_emulated_peer_copies_of_long_rows(emu, shape, cut):
    """A copy from a peer cuts long dense rows into rows of 32 vectors for the rows kernel
    (TransferTuning.peer_row_vectors) where they are a multiple of 32 and heads or tokens is 1;
    the same bytes land. Without a peer (or where it cannot cut) the launch is unchanged."""
    g = torch.Generator().manual_seed(sum(shape))
    views = [(torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int32),
              torch.randint(-2**31, 2**31, (7, *shape[1:]), generator=g, dtype=torch.int32))
             for _ in range(3)]
    tuning = _tuning(8)
    alone, launched = [], []

    def from_peer(plan):
        (c,) = tc.copy_calls(plan, tuning)
        alone.append(c.name)
        emu_run(emu, tuning, launched)(dataclasses.replace(plan, peer=torch.device("cuda", 1)))

    err = tp.run_copy_case("swap_blocks_multi_layer", views,
                           [(0, 6), (4, 0), (1, 3), (-1, 2), (2, 5), (5, 1), (3, 9)], from_peer,
                           mapping_dtype=torch.int32, max_ctas=2)
    assert alone[0].startswith("transfer_copy_kernel<")
    want_name = tc.copy_name(16, torch.int32, 8, 32) if cut else alone[0]
    assert [name for name, _ in launched] == [want_name]
    assert err is None, err


@needs_cxx
@pytest.mark.parametrize("right, wrong", [
    ("const i64 ss = ROWS * sst, ds = ROWS * dst_;", "const i64 ss = sst, ds = ROWS * dst_;"),
    ("if (room > (U - 1) * ROWS) {", "if (room >= (U - 1) * ROWS) {"),
])
def test_emulation_catches_a_wrong_whole_block_step(tmp_path, right, wrong):
    """The check of the U = 8 whole-block path can fail: a lane's rows one token apart on the
    source, or a step whose last row is its block's next one taken as whole, no longer match."""
    text = tc.SOURCE.text
    bad = text.replace(right, wrong)
    assert bad != text
    (tmp_path / "transfer.cu").write_text(bad)
    names: list[str] = []
    for t in (16, 15):
        _whole_block_case(launched_names(_tuning(8), names), t, 64, False)
    broken = _build(tmp_path, tmp_path / "transfer.cu", sorted(set(names)))
    errs = [_whole_block_case(emu_run(broken, _tuning(8)), t, 64, False) for t in (16, 15)]
    assert any(e is not None and "dst" in e for e in errs), errs


_ROWS_MUTATIONS = [
    # a lane's rows one apart instead of a warp's load of rows apart (the rows past their
    # block's last token, decomposed in full)
    ("const u64 r = r0 + static_cast<u64>(k) * ROWS;", "const u64 r = r0 + static_cast<u64>(k);"),
    # later tokens of row 0's block moved by one token instead of k * ROWS (the source side)
    ("sb[kk] = s0 + static_cast<i64>(k * ROWS) * sst;", "sb[kk] = s0 + static_cast<i64>(k) * sst;"),
    # a row one token past its block taken as the block's (the destination side's next block)
    ("if (k * ROWS < room) {", "if (k * ROWS <= room) {"),
    # the order's pair and job swapped (where pair_major, or where not)
    ("read_pair(mapping, ms0, ms1, pair_major ? q_ : w_, &I, &J);",
     "read_pair(mapping, ms0, ms1, pair_major ? w_ : q_, &I, &J);"),
]


@needs_cxx
@pytest.mark.parametrize("order, right, wrong", [
    (order, right, wrong) for order in ("jobs", "pairs") for right, wrong in _ROWS_MUTATIONS
    # pair-major, the last row's stray neighbour of the third lands past the case's
    # allocations (the emulation's process dies, nothing to compare): job-major's case only
    if not (order == "pairs" and "room" in right)])
def test_emulation_catches_a_wrong_rows_kernel(tmp_path, right, wrong, order):
    """The check can fail: with the kernel's source altered in how a lane's rows follow its
    first or where a row's pair comes from (rows of 16 vectors: 2 rows a load, 3 tokens a
    block), the copies no longer match, in either order."""
    text = tc.SOURCE.text
    bad = text.replace(right, wrong)
    assert bad != text
    (tmp_path / "transfer.cu").write_text(bad)
    views, jobs = tp.row_views("dense16", 16, "cpu")
    names: list[str] = []
    tuning = _tuning(2, order)
    tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS, launched_names(tuning, names),
                     jobs=jobs)
    broken = _build(tmp_path, tmp_path / "transfer.cu", sorted(set(names)))
    err = tp.run_copy_case("swap_blocks_multi_layer", views, PAIRS, emu_run(broken, tuning),
                           jobs=jobs)
    assert err is not None and "dst" in err
