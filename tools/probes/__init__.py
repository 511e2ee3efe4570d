"""Development probes for tuning, built on :mod:`kvwrite.bench.timing` and the workload model
(:mod:`kvwrite.bench.workload`): tools of this repository (not installed with kvwrite), run from
the checkout's root (kvwrite installed, or ``PYTHONPATH=src``):

    python -m tools.probes variants   [--impls ...] [--set IMPL.FIELD=V1|V2] ...  # tuning variants
    python -m tools.probes pattern    [--kinds plain,evict_last] ...    # the access pattern's floor
    python -m tools.probes small-t    [--heads 8,128 --tokens 2,64] ... # small calls vs a minimum
    python -m tools.probes ab --base REV [...]      # an earlier revision's kernels vs this tree's
    python -m tools.probes l2-follow  [...]         # what a call leaves in the L2
    python -m tools.probes mla                      # concat_and_cache_mla's launch variants
    python -m tools.probes mla-pattern              # ... its slot patterns and entry alignment
    python -m tools.probes tq-pattern [--kinds turboquant,pattern,pattern_nhd] ...  # its floor
    python -m tools.probes chain                    # the floor of a small call's dependent loads
    python -m tools.probes pdl-step                 # programmatic dependent launch in a GEMM step
    python -m tools.probes triton-code MODULE:KERNEL --arg ... --const ...  # sm_90 code, no GPU

(Every op's memcheck cases: ``python -m tools.sanitize``, :mod:`tools.sanitize`.) Each prints its
table on stdout; ``--json PATH`` writes its rows. Exit status 0, 1 for a failed check, 2 for a
usage error or where a probe cannot run (no GPU: one line on stderr; ``triton-code`` needs
none).
"""

from __future__ import annotations

import importlib
import sys

from kvwrite.registry import installed as registry_installed

from .common import ProbeError

__all__ = ["PROBES", "PROG", "main", "run_probe", "guarded"]

PROG = "python -m tools.probes"

# subcommand -> (module, one-line description)
PROBES = {
    "variants": ("variants", "implementations and tuning variants (--set) at the issue's points"),
    "pattern": ("pattern", "a minimal kernel with the op's access pattern and none of its work"),
    "small-t": ("small_t", "small calls next to a kernel doing only the unavoidable work"),
    "ab": ("ab", "an earlier revision's implementations next to this tree's, alternating"),
    "l2-follow": ("l2_follow", "a follower kernel's time right after a call (L2 effects)"),
    "mla": ("mla", "concat_and_cache_mla's launch-shape variants, hot and rotated"),
    "mla-pattern": ("mla_pattern", "concat_and_cache_mla's cost of slot order and entry alignment"),
    "tq-pattern": ("tq_pattern", "the TurboQuant write's access pattern without its work"),
    "chain": ("chain", "the floor of a small call's dependent loads (slot, position -> table)"),
    "pdl-step": ("pdl_step", "the fused op after a GEMM, with and without dependent launch"),
    "triton-code": ("triton_code", "a Triton kernel's sm_90 machine code, compiled here: counts"),
}


def _usage(prog: str) -> str:
    lines = [f"usage: {prog} {{{','.join(PROBES)}}} [options]", "", "probes:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in PROBES.items()]
    lines.append(f"\n`{prog} NAME --help` shows a probe's options.")
    return "\n".join(lines)


def run_probe(name: str, argv: list[str], prog: str) -> int:
    """Run probe ``name`` (:func:`guarded`)."""
    return guarded(lambda: importlib.import_module(f"{__name__}.{PROBES[name][0]}").main(argv, prog),
                   prog)


def guarded(run, prog: str) -> int:
    """``run()``'s exit status; a ProbeError or ValueError is one line on stderr and exit status
    2, and so is an optional package it needs and cannot import (named with its pip command)."""
    try:
        return run()
    except (ProbeError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional package this probe needs
        missing = next((p for p in ("triton", "cuda.core", "matplotlib")
                        if not registry_installed(p)), None)
        why = (f"it needs {missing}, which is not installed (pip install "
               f"{missing.replace('.', '-')})" if missing else f"cannot import: {e}")
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog))
        return 0 if argv else 2
    if argv[0] not in PROBES:
        print(f"{prog}: error: expected a probe name ({', '.join(PROBES)}), got {argv[0]!r}",
              file=sys.stderr)
        return 2
    return run_probe(argv[0], argv[1:], f"{prog} {argv[0]}")
