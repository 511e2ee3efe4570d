"""The quantized transfer page kernels (kvwrite/kernels/transfer.cu: transfer_pack_kernel,
transfer_unpack_kernel) run on the CPU (no GPU needed): transfer.cu compiled with g++ over the
SIMT emulation of ``tests/gather_emu.h`` (one thread per CUDA thread, CTAs of 128 threads one
after the other; ``tests/transfer_emu.h``: a launch from a flat array of arguments), launched
with exactly the variants, grids and arguments
:func:`kvwrite.kernels.transfer_cuda.page_launch_args` computes, against the torch
rules of ``tools/sanitize/transfer_plans.py`` (every page and cache allocation compared whole).

Covered: every page format x cache dtype x mapping dtype both ways (the general variant: padded
rows, a misaligned page pool), the aligned variant (U = 1 and 2, items masked at a segment's end),
partial fp8 groups (E % 16 != 0), kv_split 1 and 2, head slices, several grid sizes, more layers
than a launch's slots, and special values (every fp8 value and tie, saturation, +-inf, NaN, +-0).
What this cannot run is the GPU's own instructions: with KVWRITE_EMU the headers take their host
paths (fp8_quantize's quotient in host arithmetic, not the GPU's reciprocal and fused steps; the
software fp8 decode; exact float16 / bfloat16 rounding), which test_transfer_cuda.py's GPU tests
cover.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.resources
import pathlib
import shutil
import subprocess

import pytest
import torch

from kvwrite.kernels import transfer_cuda as tc
from tools.sanitize import transfer_plans as tp

EMU_H = pathlib.Path(__file__).with_name("transfer_emu.h")
EMU_THREADS = 128  # gather_emu.h's kEmuThreads
SM_COUNT = 2       # grids without max_ctas: at most 2 * page_ctas_per_sm CTAs
TUNING = tc.TransferTuning(page_threads=EMU_THREADS)


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


needs_cxx = pytest.mark.skipif(_compiler() is None, reason="no host C++ compiler (g++ or c++)")

_FMTS = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _id(v):
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None


def _variants() -> list[str]:
    """Every page variant run can launch with TUNING."""
    return [n for n in tc.all_kernel_names(TUNING) if "pack_kernel" in n]


class Emulated:
    """Every page variant (or ``names``) compiled into one shared library (kvw_emu_<i>)."""

    def __init__(self, d: pathlib.Path, src: pathlib.Path | None = None,
                 names: list[str] | None = None):
        self.names = _variants() if names is None else names
        if src is None:
            src = importlib.resources.files(tc.SOURCE.package).joinpath(tc.SOURCE.filename)
        include = importlib.resources.files("kvwrite.kernels").joinpath("include")
        lines = ['#include "transfer_emu.h"', f'#include "{src}"']
        for i, name in enumerate(self.names):
            lines.append(f'extern "C" void kvw_emu_{i}(unsigned grid, const long long* a, int n) '
                         f'{{ emu_run(&{name}, grid, a, n); }}')
        cpp, lib = d / "transfer_emu.cpp", d / "libtransfer_emu.so"
        cpp.write_text("\n".join(lines) + "\n")
        # -ffp-contract=off: every product one rounded IEEE product, as mul.rn.f32 on the GPU.
        cmd = [_compiler(), "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w",
               "-ffp-contract=off", "-fno-fast-math", f"-I{include}", f"-I{EMU_H.parent}",
               str(cpp), "-o", str(lib)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        self.so = ctypes.CDLL(str(lib))
        self.launched: list[tc.PageLaunchArgs] = []

    def run(self, plan) -> None:
        """transfer_cuda.run's page launches of ``plan``, emulated."""
        assert not plan.jobs
        for pa in tc.page_launch_args(plan, TUNING, SM_COUNT):
            assert pa.threads == EMU_THREADS
            f = getattr(self.so, f"kvw_emu_{self.names.index(pa.name)}")
            f.restype = None
            f.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_int]
            args = (ctypes.c_longlong * len(pa.args))(*pa.args)
            f(pa.grid, args, len(pa.args))
            self.launched.append(pa)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if _compiler() is None:
        pytest.skip("no host C++ compiler (g++ or c++)")
    return Emulated(tmp_path_factory.mktemp("transfer_pages_emu"))


def _align_unroll(name: str) -> tuple[int, int]:
    """(ALIGN, U) of a page variant's name."""
    *_, align, unroll = name.rstrip(">").split(",")
    return int(align), int(unroll)


def _check(emu, case, *, aligned: bool, unroll: int | None = None, align: int | None = None,
           **kw):
    emu.launched.clear()
    err = tp.run_page_case(case, emu.run, device=torch.device("cpu"), **kw)
    assert err is None, err
    assert emu.launched, "nothing launched"
    for pa in emu.launched:
        a, u = _align_unroll(pa.name)
        assert (a > 0) == aligned, pa.name
        assert unroll is None or u == unroll, pa.name
        assert align is None or a == align, pa.name


def _unroll(page_format, cache_dtype, N, E) -> int:
    """U of an aligned launch by TUNING: units of 16 cache bytes (fp8) or 16 elements (nvfp4),
    64 cache bytes a lane at most, doubled while the segment fills two items of 32 * U."""
    es = cache_dtype.itemsize
    unit = 16 if page_format == "nvfp4" else 16 // es
    units, most, u = N * -(-E // unit), 64 // (unit * es), 1
    while 2 * u <= most and 64 * u <= units:
        u *= 2
    return u


def _aligned(case: tp.PageCase) -> tp.PageCase:
    """``case`` with dense caches and a page pool whose chunks start 16-byte aligned."""
    return dataclasses.replace(case, pad=0, row_pad=16, page_offset=32)


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", _FMTS)
@pytest.mark.parametrize("cache_dtype", _DTYPES, ids=_id)
@pytest.mark.parametrize("mapping_dtype", [torch.int32, torch.int64], ids=_id)
def test_general_variant_every_format(emu, direction, page_format, cache_dtype, mapping_dtype):
    """Padded cache rows and a pool 5 bytes in (every chunk misaligned): the general variant."""
    case = tp.PageCase(direction, page_format, cache_dtype)
    _check(emu, case, aligned=False, mapping_dtype=mapping_dtype,
           strided_mapping=mapping_dtype == torch.int32)


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", _FMTS)
@pytest.mark.parametrize("cache_dtype", _DTYPES, ids=_id)
@pytest.mark.parametrize("L,S", [(2, 2), (3, 2), (3, 1)])
def test_aligned_variant_every_format(emu, direction, page_format, cache_dtype, L, S):
    """Dense caches, aligned chunks: the aligned variants, codes at 4*L*S = 16, 24 and 12 (ALIGN
    16 / 8 / 4; nvfp4 at most 8), segments of 5 rows of 2 to 16 units (one or two items, lanes
    past their end masked)."""
    case = _aligned(tp.PageCase(direction, page_format, cache_dtype, L=L, S=S, N=5, C=64))
    codes_at = 4 * L * S
    want = min(8 if page_format == "nvfp4" else 16, codes_at & -codes_at)
    _check(emu, case, aligned=True, align=want, mapping_dtype=torch.int32, strided_mapping=True)


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", _FMTS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32], ids=_id)
@pytest.mark.parametrize("N,C,S", [(16, 256, 2), (10, 128, 1), (9, 128, 2), (32, 96, 2)])
def test_aligned_variant_long_segments(emu, direction, page_format, cache_dtype, N, C, S):
    """Longer segments (16, 10, 9 and 32 rows of 48 to 128 elements): U = 1, 2 and 4, whole and
    masked items; a lane's units 32 apart cross rows by carries: rows of 48 elements hold 6 fp8
    units (bfloat16; 12 float32) or 3 nvfp4 groups, none a divisor of 32."""
    case = _aligned(tp.PageCase(direction, page_format, cache_dtype, L=2, S=S, N=N, C=C, Hc=2,
                                Hp=3, K=2, hc0=0, hp0=1, scale_shape="full"))
    if S == 1:
        case = dataclasses.replace(case, L=4)
    _check(emu, case, aligned=True, unroll=_unroll(page_format, cache_dtype, N, C // S),
           max_ctas=3)


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format,C,S", [("fp8_e4m3", 10, 2), ("fp8_e5m2", 40, 1),
                                             ("fp8_e4m3", 72, 2), ("nvfp4", 64, 2),
                                             ("nvfp4", 16, 1)])
@pytest.mark.parametrize("max_ctas", [1, 3, None])
def test_row_shapes_and_grids(emu, direction, page_format, C, S, max_ctas):
    """Partial fp8 groups (E = 5, 40, 36), kv_split 1 and 2, 1 / 3 / all CTAs, a dense cache
    whose parts are not whole groups (general variant) and aligned ones."""
    case = tp.PageCase(direction, page_format, torch.bfloat16, C=C, S=S, N=3, Hc=2, Hp=2, K=2,
                       hc0=0, hp0=0, row_pad=0, pad=0, scale_shape="head")
    aligned = tc.page_align(case.page_job(*case.make("cpu"))) > 0
    _check(emu, case, aligned=aligned, max_ctas=max_ctas)


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("aligned", [False, True])
def test_more_layers_than_slots(emu, direction, page_format, aligned):
    """35 layers: two launches (32 + 3 slots); the header written by the first only."""
    case = tp.PageCase(direction, page_format, torch.float16, L=tc.SLOTS + 3, N=2, C=16, S=1,
                       scale_shape="tensor")
    if aligned:
        case = _aligned(dataclasses.replace(case, L=tc.SLOTS + 4))
    _check(emu, case, aligned=aligned, max_ctas=4)
    assert len(emu.launched) == 2


@needs_cxx
@pytest.mark.parametrize("page_format", _FMTS)
@pytest.mark.parametrize("cache_dtype", _DTYPES, ids=_id)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("scale_value", [1.0, 0.125, 3.0, 2.0 ** -101])
def test_pack_special_values(emu, page_format, cache_dtype, aligned, scale_value):
    """Every fp8 value and every tie between neighbours (times sigma), saturation, +-inf, NaN,
    +-0 and tiny values: the codes of SPEC §9.4's rule (sigma 3: quotients not exact; 2^-101:
    most quotients saturate, fp8 only)."""
    if page_format == "nvfp4" and scale_value < 2.0 ** -100:
        pytest.skip("nvfp4 chunks of a sigma outside [2^-100, 2^100] are unspecified")
    case = tp.PageCase("pack", page_format, cache_dtype, L=2, S=2, N=16, C=64, Hc=2, Hp=2, K=2,
                       hc0=0, hp0=0, special=True, scale_value=scale_value,
                       scale_shape="tensor")
    if aligned:
        case = _aligned(case)
    _check(emu, case, aligned=aligned)


@needs_cxx
def test_emulation_catches_a_wrong_kernel(tmp_path):
    """The check can fail: with each group's codes written one group on (the kernel's source
    altered), the emulated aligned pack no longer matches."""
    src = tc.SOURCE.text
    bad = src.replace("u8* codes = cbase + codes_at + r * E + e0;",
                      "u8* codes = cbase + codes_at + r * E + (e0 ^ 16);")
    assert bad != src

    path = tmp_path / tc.SOURCE.filename
    path.write_text(bad)
    case = _aligned(tp.PageCase("pack", "fp8_e4m3", torch.bfloat16, L=2, N=5, C=64))
    names: list[str] = []  # the case's variants only (every variant: a 25-second build)
    tp.run_page_case(case, lambda plan: names.extend(
        pa.name for pa in tc.page_launch_args(plan, TUNING, SM_COUNT)), device=torch.device("cpu"))
    emu = Emulated(tmp_path, path, sorted(set(names)))
    err = tp.run_page_case(case, emu.run, device=torch.device("cpu"))
    assert err is not None and "pages" in err


def test_page_align_decides_by_every_address():
    """The aligned variants only where every group's accesses are aligned: a misaligned pool,
    padded rows whose stride is not a multiple of 16, a cache offset by one element, every other
    element, partial groups give the general one (0); the codes' offset 4*L*S gives ALIGN."""
    def align(case, cache=None):
        caches, pages, scale = case.make("cpu")
        if cache is not None:
            caches = [cache(c) for c in caches]
        return tc.page_align(case.page_job(caches, pages, scale))

    base = _aligned(tp.PageCase("pack", "fp8_e4m3", torch.bfloat16, L=2, N=5, C=64))
    assert align(base) == 16
    assert align(dataclasses.replace(base, L=3)) == 8
    assert align(dataclasses.replace(base, L=3, S=1, C=32)) == 4
    assert align(dataclasses.replace(base, L=4, page_format="nvfp4")) == 8
    assert align(dataclasses.replace(base, L=61, S=1, C=32)) == 4  # DeepSeek-V3's 61 layers
    assert align(dataclasses.replace(base, page_offset=8)) == 0
    assert align(dataclasses.replace(base, row_pad=8)) == 0
    assert align(dataclasses.replace(base, row_pad=8, num_pages=1, pairs=((0, 0),))) == 16
    assert align(dataclasses.replace(base, pad=4)) == 0  # token stride 136 bytes
    assert align(dataclasses.replace(base, pad=8)) == 16  # 144 bytes
    assert align(dataclasses.replace(base, C=40)) == 0  # E = 20: partial groups
    # (page jobs only looked at: a row part's elements of all tokens, N * E, from 2^32 on take
    # the general variant, whose unit indices are 64-bit)
    pj = base.page_job(*base.make("cpu"))
    assert tc.page_align(dataclasses.replace(pj, tokens=(1 << 27) - 1)) == 16  # E = 32
    assert tc.page_align(dataclasses.replace(pj, tokens=1 << 27)) == 0
    # (views only looked at, never run: one element further, every other element)
    assert align(base, lambda c: c[:-1].as_strided(c[:-1].shape, c.stride(),
                                                   c.storage_offset() + 1)) == 0
    assert align(base, lambda c: c[:-1].as_strided(c[:-1].shape, (*c.stride()[:3], 2))) == 0
    assert align(base, lambda c: c[:-1].as_strided(c[:-1].shape, c.stride(),
                                                   c.storage_offset() + 8)) == 16


@needs_cxx
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("page_format", _FMTS)
def test_deepseek_latent_rows(emu, direction, page_format):
    """61 latent layers of 576 elements (DeepSeek-V3; 8 tokens a block here): codes at 4*61 = 244,
    ALIGN 4; fp8: 72 vectors a row, 576 a segment, U = 4 (five items, the last masked); nvfp4: 36
    groups a row, 288 a segment, U = 2 (five items, the last masked)."""
    case = tp.PageCase(direction, page_format, torch.bfloat16, L=61, S=1, N=8, C=576, Hc=1,
                       Hp=1, K=1, hc0=0, hp0=0, pad=0, row_pad=0, page_offset=0,
                       scale_shape="full")
    _check(emu, case, aligned=True, unroll=2 if page_format == "nvfp4" else 4, align=4)
