"""Tests' builds outside the process: a C++ harness over the kernels' headers for the host (the
tests that check a device rule bit for bit against the reference on the CPU, without a GPU), and
scripts that compile Triton kernels outside its interpreter."""

from __future__ import annotations

import ctypes
import importlib.resources
import json
import os
import shutil
import subprocess
import sys

import pytest


def build_host_lib(tmp_path_factory, harness: str, name: str, what: str,
                   packages: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``harness`` (C++ source) built as a shared library and loaded; it sees kvwrite/kernels/
    include and the folders of ``packages`` (e.g. an op's, for its kernel.cu) on its include
    path. Skips, naming ``what`` (the harness), where there is no host C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip(f"no host C++ compiler (g++, c++ or clang++) to build the {what}")
    dirs = [importlib.resources.files("kvwrite.kernels").joinpath("include"),
            *(importlib.resources.files(p) for p in packages)]
    d = tmp_path_factory.mktemp(name)
    (d / "harness.cpp").write_text(harness)
    lib = d / f"lib{name}.so"
    # -ffp-contract=off: a*b stays a rounded product (no FMA), as mul.rn.f32 on the GPU.
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math",
                    "-Wno-unknown-pragmas", "-shared", "-fPIC", "-DKVWRITE_HOST_TEST",
                    *(f"-I{i}" for i in dirs), str(d / "harness.cpp"), "-o", str(lib)],
                   check=True)
    return ctypes.CDLL(str(lib))


def build_emu_lib(tmp_path_factory, harness: str, name: str, op_dir) -> ctypes.CDLL:
    """``harness`` (C++ source over an op's kernel.cu and the SIMT emulation header in tests/)
    built as a shared library and loaded: include paths kvwrite/kernels/include, ``op_dir`` (the
    op's folder) and tests/; C++20 and threads for the emulated CTAs. Skips where there is no
    host C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++) to build the SIMT emulation")
    inc = importlib.resources.files("kvwrite.kernels").joinpath("include")
    d = tmp_path_factory.mktemp(name)
    (d / "harness.cpp").write_text(harness)
    lib = d / f"lib{name}.so"
    # -ffp-contract=off: a*b stays a rounded product (no FMA), as mul.rn.f32 on the GPU.
    subprocess.run([cxx, "-O1", "-std=c++20", "-ffp-contract=off", "-fno-fast-math",
                    "-Wno-unknown-pragmas", "-shared", "-fPIC", "-pthread", f"-I{inc}",
                    f"-I{op_dir}", f"-I{os.path.dirname(os.path.abspath(__file__))}",
                    str(d / "harness.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def run_emu_program(tmp_path, name: str, source: str, op_dir) -> str:
    """What the C++ program ``source`` prints, built for the host with build_emu_lib's include
    paths (kvwrite/kernels/include, ``op_dir``, tests/) and flags (C++20, threads, no FMA
    contraction). Skips where there is no host C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++)")
    inc = importlib.resources.files("kvwrite.kernels").joinpath("include")
    (tmp_path / f"{name}.cpp").write_text(source)
    exe = tmp_path / name
    subprocess.run([cxx, "-O2", "-std=c++20", "-ffp-contract=off", "-fno-fast-math",
                    "-Wno-unknown-pragmas", "-pthread", f"-I{inc}", f"-I{op_dir}",
                    f"-I{os.path.dirname(os.path.abspath(__file__))}",
                    str(tmp_path / f"{name}.cpp"), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def run_c(tmp_path, name: str, source: str) -> str:
    """What the C program ``source`` prints, built for the host (``-ffp-contract=off``: x * y
    stays a rounded product; fmaf is the C library's exact fma). Skips where there is no host C
    compiler."""
    cc = shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no host C compiler (gcc, cc or clang) to build the check")
    (tmp_path / f"{name}.c").write_text(source)
    exe = tmp_path / name
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-fno-fast-math", str(tmp_path / f"{name}.c"),
                    "-o", str(exe), "-lm"], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


# The start of a C check of the reciprocal: float32 <-> bits (f, u), and rcp_rn_s2_steps(b, r),
# what kvw/fp8.cuh's rcp_rn_s2 computes from the hardware's approximation r of 1/b.
RCP_RN_S2_C = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static float f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t u(float x) { uint32_t v; memcpy(&v, &x, 4); return v; }
static float rcp_rn_s2_steps(float b, float r) {
  r = fmaf(r, fmaf(-b, r, 1.0f), r);
  float y = fmaf(r, fmaf(-b, r, 1.0f), r);
  uint32_t bb = u(b);
  return (bb & 0x7FFFFFu) == 0x7FFFFFu ? f(((253u - (bb >> 23)) << 23) | 1u) : y;
}
"""


def run_triton_script(script: str, env_defaults: dict[str, str] | None = None):
    """The JSON that the last output line of ``script`` holds, run by a fresh Python outside
    Triton's interpreter (TRITON_INTERPRET unset; this checkout's src first on the path; the
    variables of ``env_defaults`` where the environment sets none), e.g. to compile Triton
    kernels for sm_90 on a machine without a GPU. Skips where Triton is not installed."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                         env.get("PYTHONPATH", "")])
    for k, v in (env_defaults or {}).items():
        env.setdefault(k, v)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The start of a script for :func:`run_triton_script`: ``ptx(kernel, types, consts, fusion,
# pdl)`` compiles one Triton kernel for sm_90 with kvwrite's launch options and 4 warps and
# returns its PTX (``fusion``: floating-point contraction allowed; ``pdl``: the PDL build; a
# kernel's NATIVE, where it has one and ``consts`` gives none, as sm_90 takes it:
# triton_support.native_fp8).
TRITON_PTX_PRELUDE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvwrite.kernels.triton_rope import LAUNCH_OPTIONS

def ptx(kernel, types, consts, fusion=False, pdl=False):
    consts = {**consts, "PDL": pdl, "PDL_TRIGGER": pdl}
    if "NATIVE" in kernel.arg_names:
        consts.setdefault("NATIVE", True)
    sig = dict(types)
    sig.update({n: "constexpr" for n in consts})
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    opts = {"num_warps": 4, **LAUNCH_OPTIONS}
    if fusion:
        opts["enable_fp_fusion"] = True
    if pdl:
        opts["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
"""
