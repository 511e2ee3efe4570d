"""A Triton kernel's sm_90 machine code, compiled on this machine (no GPU needed): its
instructions by opcode and by the pipe that issues them, its layout conversions and barriers, its
shared memory and registers -- the static side of tuning a Triton kernel (tuning-log 96 counted
the per-token-head fast path's instructions this way, with Triton 3.9 and 3.6).

The kernel is compiled as a call would specialize it: every pointer and integer argument that
the kernel does not exclude (``do_not_specialize``) is taken as a multiple of 16, as the JIT
does for aligned tensors and strides (``--not-divisible`` names others); integer arguments are
int32 unless ``--arg NAME=i64`` says otherwise. Counts are static (every path of the kernel,
slow paths included); the pipe classes are the Hopper ones as Nsight Compute reports them,
approximately (the ALU pipe issues at half the rate of the FMA pipe).

    python -m tools.probes triton-code MODULE:KERNEL --arg NAME=TYPE ... --const NAME=VALUE ...
        [--warps 4] [--not-divisible NAME,...] [--fusion] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import tempfile

from .common import ProbeError

__all__ = ["main", "compile_sm90", "report", "PIPES"]

# Opcode (its first word) -> the pipe Nsight Compute counts it on (Hopper; approximate).
PIPES = {
    "fma": ("FADD", "FMUL", "FFMA", "IMAD", "IMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD"),
    "alu": ("FMNMX", "FSEL", "FSETP", "FCHK", "LOP3", "LOP", "SHF", "ISETP", "IADD3", "SEL",
            "PLOP3", "PRMT", "LEA", "MOV", "VIMNMX", "IMNMX", "IABS", "FLO", "POPC", "BMSK",
            "SGXT", "P2R", "R2P", "CS2R", "VIADD", "HMNMX2", "HSETP2"),
    "xu": ("MUFU", "F2F", "F2I", "I2F", "FRND", "F2FP", "I2FP", "F2IP"),
    "memory": ("LDG", "STG", "LDS", "STS", "LDC", "LD", "ST", "LDSM", "STSM", "ATOM", "ATOMS",
               "ATOMG", "RED", "LDGSTS", "UBLKCP", "SYNCS"),
    "shuffle": ("SHFL",),
    "control": ("BRA", "BSSY", "BSYNC", "CALL", "RET", "EXIT", "BAR", "NOP", "WARPSYNC",
                "DEPBAR", "YIELD", "BMOV", "ACQBULK", "S2R", "S2UR", "R2UR", "ELECT"),
}
_PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}


def _value(text: str):
    """A --const value: an int, a float, True / False, else the string."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ProbeError(f"{what}: expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _kernel(spec: str):
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ProbeError(f"KERNEL: expected MODULE:NAME (e.g. kvwrite.ops.reshape_and_cache_"
                         f"flash_per_token_head_quant.triton_impl:_pth_kernel), got {spec!r}")
    kernel = getattr(importlib.import_module(module), name, None)
    if kernel is None or not hasattr(kernel, "arg_names"):
        raise ProbeError(f"KERNEL: {spec!r} is not a @triton.jit function"
                         + (" (TRITON_INTERPRET=1 is set: unset it to compile kernels)"
                            if os.environ.get("TRITON_INTERPRET") == "1" else ""))
    return kernel


def compile_sm90(kernel, types: dict[str, str], consts: dict, warps: int = 4,
                 not_divisible: tuple[str, ...] = (), fusion: bool = False):
    """``kernel`` compiled for sm_90 with kvwrite's launch options (Triton's CompiledKernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvwrite.kernels.triton_rope import LAUNCH_OPTIONS

    names = list(kernel.arg_names)
    for name in (*types, *consts, *not_divisible):
        if name not in names:
            raise ProbeError(f"{name!r} is not an argument of {kernel.__name__} "
                             f"(its arguments: {', '.join(names)})")
    skip = {p.name for p in kernel.params if p.do_not_specialize} | set(not_divisible)
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if kernel.params[i].is_constexpr:
            raise ProbeError(f"{name} is a tl.constexpr of {kernel.__name__}: give it with "
                             f"--const {name}=VALUE")
        sig[name] = types.get(name, "i32")
        if sig[name][0] in "*i" and name not in skip:  # pointers and integers
            attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [n for n in names if n not in sig]
    if missing:
        raise ProbeError(f"no value for {', '.join(missing)}")
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    options = {**LAUNCH_OPTIONS, "num_warps": warps}
    if fusion:
        options["enable_fp_fusion"] = True
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # Triton's compile errors: where (each nested call's first line)
        where, cause = [], e  # and what (the innermost cause's last line)
        while cause is not None:
            lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
            where.append((lines[0] if lines else type(cause).__name__).rstrip(":"))
            what = lines[-1] if lines else type(cause).__name__
            cause = cause.__cause__
        raise ProbeError(f"{kernel.__name__} did not compile: {' > '.join(where[:-1] or where)}: "
                         f"{what}") from e


def _tool(name: str) -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise ProbeError(f"{name} not found beside Triton ({path}): this Triton wheel has none")
    return path


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ProbeError(f"{os.path.basename(cmd[0])} failed: {done.stderr.strip()[:200]}")
    return done.stdout


def opcodes(sass: str) -> collections.Counter:
    """Each instruction's opcode (predicate dropped) in nvdisasm's listing, counted: the lines
    whose address comment is /*0000*/, /*10a0*/ ... (any number of hex digits)."""
    return collections.Counter(m.group(1) for m in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass))


def report(compiled) -> dict:
    """Counts of ``compiled``'s SASS: instructions (total, by opcode, by pipe), barriers, layout
    conversions and shared-memory buffers in its TTGIR, shared bytes, registers."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = _run([_tool("nvdisasm"), "-c", cubin])
        usage = _run([_tool("cuobjdump"), "--dump-resource-usage", cubin])
    ops = opcodes(sass)
    pipes = collections.Counter()
    for op, n in ops.items():
        base = op.split(".")[0]
        pipes["uniform" if base.startswith("U") and base not in _PIPE_OF
              else _PIPE_OF.get(base, "other")] += n
    regs = re.search(r"REG:(\d+)", usage)
    ttgir = compiled.asm["ttgir"]
    return {
        "instructions": sum(ops.values()),
        "registers": int(regs.group(1)) if regs else None,
        "shared_bytes": compiled.metadata.shared,
        "barriers": sum(n for op, n in ops.items() if op.startswith("BAR")),
        "layout_conversions": ttgir.count("ttg.convert_layout"),
        "shared_buffers": ttgir.count("ttg.local_alloc"),
        "pipes": dict(pipes.most_common()),
        "opcodes": dict(ops.most_common()),
    }


def main(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("kernel", metavar="MODULE:KERNEL", help="a @triton.jit function")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=TYPE",
                   help="an argument's Triton type (*bf16, *fp32, *u8, *i64, i32, i64, fp32); "
                        "pointers need one, integers default to i32")
    p.add_argument("--const", action="append", default=[], metavar="NAME=VALUE",
                   help="a tl.constexpr's value (int, float, True/False)")
    p.add_argument("--warps", type=int, default=4, help="num_warps (default: 4)")
    p.add_argument("--not-divisible", default="", metavar="NAME,...",
                   help="arguments not taken as multiples of 16")
    p.add_argument("--fusion", action="store_true",
                   help="allow floating-point contraction (kvwrite's kernels: off)")
    p.add_argument("--top", type=int, default=25, help="opcodes listed (default: 25)")
    p.add_argument("--json", metavar="PATH", help="also write the counts as JSON")
    args = p.parse_args(argv)
    if args.warps < 1 or args.warps & (args.warps - 1):
        raise ProbeError(f"--warps: expected a power of two, got {args.warps}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ProbeError("TRITON_INTERPRET=1 is set: unset it to compile kernels")
    kernel = _kernel(args.kernel)
    consts = {k: _value(v) for k, v in _pairs(args.const, "--const").items()}
    types = _pairs(args.arg, "--arg")
    not_div = tuple(n for n in args.not_divisible.split(",") if n)
    compiled = compile_sm90(kernel, types, consts, args.warps, not_div, args.fusion)
    r = report(compiled)
    import triton
    print(f"# {args.kernel}: sm_90, {args.warps} warps, Triton {triton.__version__}; static "
          f"counts (every path)")
    print(f"instructions {r['instructions']}  registers {r['registers']}  shared "
          f"{r['shared_bytes']} B  barriers {r['barriers']}  layout conversions "
          f"{r['layout_conversions']}")
    print("by pipe: " + "  ".join(f"{k} {v}" for k, v in r["pipes"].items()))
    for op, n in list(r["opcodes"].items())[:args.top]:
        print(f"  {op:<24}{n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": args.kernel, "warps": args.warps, **r}, f, indent=1)
    return 0
