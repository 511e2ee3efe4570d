"""Every op's bounds cases through its CUDA kernels, for the memory checker; a tool of this
repository (not installed with kvwrite), run from the checkout's root:

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \\
        python -m tools.sanitize [--ops OP,...]

Each op that has CUDA kernels keeps its cases in ``tools/sanitize/<op>.py`` (``cases()``: ids and
functions that run the cuda implementation on the GPU and the torch reference on the CPU over
the same bounds-stressing inputs and compare whole outputs byte for byte;
:mod:`kvwrite.testing.sanitize`). This runs them all, or those of ``--ops``. Exit status 1 on a
mismatch (the memory checker's own errors exit with its ``--error-exitcode``), 2 where it cannot
run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable

import torch

import tools.probes as probes
from kvwrite import registry
from kvwrite.bench.engine import Parser, parse_list
from kvwrite.testing import gather
from tools.probes import common

__all__ = ["op_cases", "run_cases", "build_parser", "main", "Cases", "gather_cases"]

# What a module's cases() returns: (id, run), run() None when the outputs match, else what differs.
Cases = list[tuple[str, Callable[[], "str | None"]]]


def _module(op: str) -> str:
    """The module of ``op``'s cases: named as the package of its cuda implementation."""
    package = registry.get(op, "cuda").module.rpartition(".")[0]
    return f"{__name__}.{package.rpartition('.')[2]}"


def op_cases(ops: list[str] | None = None) -> dict[str, list]:
    """{op: its cases}, for every registered op with a cuda implementation (or those of
    ``ops``); an op without a module here maps to [] (a test refuses that)."""
    out: dict[str, list] = {}
    for op in ops or registry.ops():
        if not any(i.name == "cuda" for i in registry.all_impls(op)):
            continue
        name = _module(op)
        out[op] = (importlib.import_module(name).cases()
                   if importlib.util.find_spec(name) is not None else [])
    return out


def gather_cases(op: str, make_inputs, args_of, outs_of, cases: dict, nan=lambda case: False
                 ) -> Cases:
    """The memcheck cases of a gather (``tools/sanitize/<op>.py``): for each ``{id: case}``, a
    check of ``op``'s cuda implementation on the GPU against the torch one on the CPU
    (:func:`kvwrite.testing.gather.cuda_against_reference`) over ``make_inputs(case, device)``:
    the call's arguments ``args_of(case, inputs)``, its outputs ``outs_of(inputs)``, compared
    NaN-aware as ``nan(case)`` says."""
    def check(case) -> Callable[[], str | None]:
        return lambda: gather.cuda_against_reference(
            op, lambda d: make_inputs(case, d), lambda i: args_of(case, i), outs_of, nan(case))
    return [(case_id, check(case)) for case_id, case in cases.items()]


def run_cases(ops: list[str] | None = None, out=print) -> tuple[int, int]:
    """Every case of every op; ``out`` gets one line per run. Returns (runs, failures)."""
    reason = registry.get(registry.ops()[0], "cuda").available(torch.device("cuda"))
    if reason is not None:
        raise common.ProbeError(reason)
    runs = failures = 0
    seen = set()
    for op, cases in op_cases(ops).items():
        for case_id, run in cases:
            if (op, case_id) in seen:
                continue
            seen.add((op, case_id))
            runs += 1
            diff = run()
            failures += diff is not None
            out(f"{'ok      ' if diff is None else 'MISMATCH'} {op} {case_id}"
                + ("" if diff is None else f": {diff}"))
    out(f"{runs - failures}/{runs} runs match the torch reference")
    return runs, failures


def build_parser(prog: str) -> Parser:
    p = Parser(prog=prog, description="Run every op's cases that stress the bounds through its "
                                      "CUDA kernels and compare whole outputs with the torch "
                                      "reference; meant to run under `compute-sanitizer --tool "
                                      "memcheck --report-api-errors no --error-exitcode 3`.")
    p.add_argument("--ops", default=None,
                   help="comma list of ops (default: every op with a cuda implementation)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m tools.sanitize") -> int:
    """The command line; errors as :func:`tools.probes.guarded` prints them (exit status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return probes.guarded(lambda: _main(argv, prog), prog)


def _main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    ops = None
    if args.ops:
        ops = parse_list(args.ops, "--ops", registry.ops())
    common.require_gpu()
    _, failures = run_cases(ops, out=lambda line: print(line, flush=True))
    return 1 if failures else 0
