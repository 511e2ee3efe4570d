"""Compiling kernels and reading their machine code in tests: whether NVRTC can compile here,
cuobjdump (the CUDA toolkit's, or the copy in the Triton wheel) and the opcodes of each kernel
function."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

import pytest

# Global memory accesses of sm_90 SASS (generic LD/ST included; shared and constant ones are not).
MEMORY_OPS = ("LDG", "STG", "LD.", "ST.", "ATOM", "RED", "LDGSTS", "UBLKCP", "UTMALDG")


@functools.cache
def nvrtc_reason() -> str | None:
    """Why NVRTC cannot compile here, or None where it can (no GPU is needed to compile)."""
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        return None if int(err) == 0 else f"nvrtcVersion returned {err}"
    except Exception as e:  # not installed, or the library cannot be loaded
        return f"cuda.core/NVRTC unavailable: {e}"


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor): the machine code some tests pin is the compiler's."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return major, minor


needs_nvrtc = pytest.mark.skipif(nvrtc_reason() is not None, reason=str(nvrtc_reason()))


def cuobjdump() -> str | None:
    """The cuobjdump to use, or None where there is none."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def cuobjdump_or_skip():
    """This module, or a skip where there is no cuobjdump to read SASS with."""
    import sys
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's copy) to read the SASS")
    return sys.modules[__name__]


def dump_sass(cubin: bytes, tmp_path) -> str:
    """cuobjdump's SASS listing of ``cubin``."""
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          check=True).stdout


_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+ )?(\S+)", re.M)


def opcodes(sass: str) -> list[str]:
    """The opcodes of a SASS listing, in order (predicates dropped)."""
    return _OP.findall(sass)


def function_listings(sass: str) -> dict[str, str]:
    """Each kernel function's part of a SASS listing, by mangled name."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def functions(sass: str) -> dict[str, list[str]]:
    """Each kernel function's opcodes, by mangled name."""
    return {name: opcodes(text) for name, text in function_listings(sass).items()}


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+ )?([^;]*);\s*/\* (0x[0-9a-f]{16}) \*/\s*$"
                    r"\n^\s*/\* (0x[0-9a-f]{16}) \*/", re.M)


def _scheduled_at(sass: str) -> list[tuple[int, str, bool, int | None, int]]:
    out = []
    for m in _INSTR.finditer(sass):
        ctrl = int(m.group(5), 16) >> 41
        wb = (ctrl >> 5) & 7
        out.append((int(m.group(1), 16), m.group(3).strip(), m.group(2) is not None,
                    None if wb == 7 else wb, (ctrl >> 11) & 0x3F))
    return out


def scheduled(sass: str) -> list[tuple[str, bool, int | None, int]]:
    """The instructions of one function's SASS (sm_70 and later) with their scheduling: (text,
    predicated, the scoreboard a variable-latency result sets or None, the mask of scoreboards
    the instruction waits for). The control bits are the top 23 of the 128-bit word: stall (4),
    yield (1), write scoreboard (3; 7 for none), read scoreboard (3), wait mask (6), reuse (4)."""
    return [x[1:] for x in _scheduled_at(sass)]


_BRANCH = re.compile(r"^BRA (?:!?U?P\w+, )?(0x[0-9a-f]+)")


def skipped_by_branches(sass: str, holds) -> list[tuple[int, int]]:
    """The address ranges [after the branch, its target) of one function's SASS that a
    predicated forward branch jumps over, for the ranges holding an instruction for which
    ``holds(text)`` is true: a rare path's code laid out in line (the caller names what marks
    it)."""
    ins = _scheduled_at(sass)
    out = []
    for i, (addr, text, predicated, _, _) in enumerate(ins):
        m = _BRANCH.match(text)
        if not (m and predicated) or int(m.group(1), 16) <= addr:
            continue
        target = int(m.group(1), 16)
        inside = [x[1] for x in ins[i + 1:] if x[0] < target]
        if any(holds(x) for x in inside):
            out.append((ins[i + 1][0], target))
    return out


def waits_before_loads(sass: str, is_row_load, skip=lambda sass: ()) -> list[str]:
    """Where a kernel waits for a global load's result before it has issued a later load for
    which ``is_row_load(text)`` holds, in listing order up to an unpredicated EXIT (for a
    loop-free kernel whose branches rejoin, or end in an EXIT before the next path's code): the
    instructions that wait, with the load they come before. Empty when every such load is issued
    before the first wait for a load. ``skip(sass)``: address ranges left out (a rare path's
    code, see skipped_by_branches), their loads and waits both."""
    found, pending, waits = [], set(), []
    ranges = skip(sass)
    for addr, text, predicated, wb, wait in _scheduled_at(sass):
        if any(lo <= addr < hi for lo, hi in ranges):
            continue
        op = text.split()[0]
        hit = [sb for sb in pending if wait >> sb & 1]
        if hit:
            waits.append(text)
            pending -= set(hit)
        if op.startswith("LDG"):
            if is_row_load(text):
                found += [f"{w}  (before {text})" for w in waits]
            if wb is not None:
                pending.add(wb)
        if op == "EXIT" and not predicated:
            pending, waits = set(), []
    return found


def late_issues(sass: str, is_row_load, skip=lambda sass: ()) -> dict[str, list[str]]:
    """:func:`waits_before_loads` of each kernel function of a listing, by mangled name (only
    those with any)."""
    found = {name: waits_before_loads(text, is_row_load, skip)
             for name, text in function_listings(sass).items()}
    return {k: v for k, v in found.items() if v}


def round_window(sass: str, is_row_load, is_store=lambda text: text.startswith("STG"),
                 start: int | None = None) -> tuple[int, int, list[str]]:
    """One function's SASS from instruction ``start`` (default: the first for which
    ``is_row_load(text)`` holds) to the first store after it (``is_store``): (the row loads
    issued there, those issued before the first instruction that waits for one of them, that
    instruction and the next few). A kernel whose loads of a round all go out before it waits
    has the first two equal. A wait on a scoreboard that a row load set counts whatever else set
    it too (the wait is for both)."""
    ins = scheduled(sass)
    first = start if start is not None else next(i for i, x in enumerate(ins)
                                                 if is_row_load(x[0]))
    pending, issued, before, waits = set(), 0, None, []
    for text, _, wb, wait in ins[first:]:
        if is_store(text):
            break
        if before is None and any(wait >> sb & 1 for sb in pending):
            before = issued
        if before is not None and len(waits) < 4:
            waits.append(text)
        if is_row_load(text):
            issued += 1
            if wb is not None:
                pending.add(wb)
    return issued, issued if before is None else before, waits


def param_reads(sass: str) -> set[int]:
    """The offsets of constant bank 0 that a SASS listing reads (sm_90 kernels find their
    parameters there from 0x210 on, 8 bytes a pointer or int64)."""
    return {int(m, 16) for m in re.findall(r"c\[0x0\]\[(0x[0-9a-f]+)\]", sass)}


def compiled_param_reads(compile_kernel, name: str, fixed, tmp_path) -> set[int]:
    """:func:`param_reads` of the sm_90 build ``compile_kernel("sm_90", name, fixed=fixed)`` (an
    op's cuda_impl.compile_kernel; ``fixed=None``: the generic build)."""
    obj, _ = compile_kernel("sm_90", name, fixed=fixed)
    return param_reads(dump_sass(bytes(obj.code), tmp_path))


def source_param_reads(source, name: str, fixed, tmp_path) -> set[int]:
    """:func:`param_reads` of the sm_90 build of ``name`` from ``source`` (an op's KernelSource)
    with the fixed arguments ``fixed`` compiled in (None: the generic build)."""
    from kvwrite.kernels import nvrtc
    obj, _ = source.compile("sm_90", name, macros=nvrtc.fixed_args_macros(fixed))
    return param_reads(dump_sass(bytes(obj.code), tmp_path))


def assert_source_fixed_args_compiled_in(source, name: str, fixed, leading: int,
                                         tmp_path) -> set[int]:
    """:func:`assert_fixed_args_compiled_in` for kernel ``name`` of ``source`` (an op's
    KernelSource) whose fixed arguments ``fixed`` follow its first ``leading`` parameters (8
    bytes each, from 0x210 on); returns the offsets the specialized build reads."""
    generic, special = (source_param_reads(source, name, f, tmp_path) for f in (None, fixed))
    first = 0x210 + 8 * leading
    assert_fixed_args_compiled_in(generic, special, first, first + 8 * len(fixed), name)
    return special


def assert_fixed_args_compiled_in(generic: set[int], special: set[int], first: int, end: int,
                                  what=None) -> None:
    """The generic build reads a fixed argument (a parameter at [first, end): so the check can
    fail), the build with the fixed arguments compiled in reads none of them."""
    assert any(first <= o < end for o in generic), (what, sorted(map(hex, generic)))
    assert not any(first <= o < end for o in special), (what, sorted(map(hex, special)))


def assert_specialized_builds_read_no_fixed_argument(compile_kernel, builds, first: int, end: int,
                                                     count: int, tmp_path) -> None:
    """For each (what, kernel name, fixed arguments) of ``builds``: the generic sm_90 build of
    ``compile_kernel`` (an op's cuda_impl.compile_kernel) reads a fixed argument (at [first,
    end)), the specialized one none; a build given other than ``count`` fixed values is refused
    (by the compiler, saying how many it takes)."""
    for what, name, fixed in builds:
        generic, special = (compiled_param_reads(compile_kernel, name, f, tmp_path)
                            for f in (None, fixed))
        assert_fixed_args_compiled_in(generic, special, first, end, what)
    with pytest.raises(RuntimeError, match=f"{count} values"):
        compile_kernel("sm_90", name, fixed=(1, 2, 3))


def kernel_params(obj, name: str) -> str:
    """The parameter types of kernel ``name`` of a compiled program, from its mangled name: what
    follows the template arguments and the void return (``x``: an int64)."""
    mangled = obj.symbol_mapping[name]
    mangled = mangled.decode() if isinstance(mangled, bytes) else mangled
    return mangled.split("Ev", 1)[1]


def assert_waits_first(funcs: dict[str, list[str]], trigger: bool = True,
                       memory_ops: tuple[str, ...] = MEMORY_OPS) -> None:
    """Each PDL build of ``funcs`` (opcodes by function, :func:`functions`) waits for the kernel
    before it (ACQBULK) before its first access of ``memory_ops``; with ``trigger`` it lets the
    next kernel start (PREEXIT) before that access too, without it has no trigger at all."""
    for name, ops in funcs.items():
        first = next(i for i, o in enumerate(ops) if o.startswith(memory_ops))
        if trigger:
            assert "PREEXIT" in ops[:first] and "ACQBULK" in ops[:first], (name, ops[:40])
        else:
            assert "ACQBULK" in ops[:first] and "PREEXIT" not in ops, (name, ops[:40])


def assert_no_pdl(sass: str) -> None:
    """A plain (not PDL) build neither waits (ACQBULK) nor triggers (PREEXIT)."""
    assert "ACQBULK" not in sass and "PREEXIT" not in sass


def assert_pdl_builds_wait_first(source, names, tmp_path) -> None:
    """The PDL build (nvrtc.PDL_MACRO) of each of ``names`` triggers the next kernel (PREEXIT)
    and waits for the previous one (ACQBULK) before its first global access; the plain build of
    the first four has neither. ``source``: the op's KernelSource."""
    from kvwrite.kernels import nvrtc
    cuobjdump_or_skip()
    pdl, _ = source.compile("sm_90", names, macros=(nvrtc.PDL_MACRO,))
    funcs = functions(dump_sass(bytes(pdl.code), tmp_path))
    assert len(funcs) == len(names)
    assert_waits_first(funcs)
    plain, _ = source.compile("sm_90", names[:4])
    assert_no_pdl(dump_sass(bytes(plain.code), tmp_path))
