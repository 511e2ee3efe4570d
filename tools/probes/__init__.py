"""``kvwrite-bench probe ...``: development probes for tuning, built on :mod:`kvwrite.bench.timing`
and the workload model (:mod:`kvwrite.bench.workload`).

    kvwrite-bench probe variants   [--impls ...] [--set IMPL.FIELD=V1|V2] ...  # tuning variants
    kvwrite-bench probe pattern    [--kinds plain,evict_last] ...    # the access pattern's floor
    kvwrite-bench probe small-t    [--heads 8,128 --tokens 2,64] ... # small calls vs a minimum
    kvwrite-bench probe ab --base REV [...]         # an earlier revision's kernels vs this tree's
    kvwrite-bench probe l2-follow  [...]            # what a call leaves in the L2
    kvwrite-bench probe sanitize                    # every op's memcheck cases (= kvwrite-bench sanitize)
    kvwrite-bench probe mla                         # concat_and_cache_mla's launch variants
    kvwrite-bench probe mla-pattern                 # ... its slot patterns and entry alignment
    kvwrite-bench probe chain                       # the floor of a small call's dependent loads
    kvwrite-bench probe pdl-step                    # programmatic dependent launch in a GEMM step

Each prints its table on stdout; ``--json PATH`` writes its rows. Exit status 0, 1 for a failed
check, 2 for a usage error or where a probe cannot run (no GPU: one line on stderr).
"""

from __future__ import annotations

import importlib
import sys

from ...registry import installed as registry_installed
from .common import ProbeError

__all__ = ["PROBES", "main", "run_probe"]

# subcommand -> (module, one-line description)
PROBES = {
    "variants": ("variants", "implementations and tuning variants (--set) at the issue's points"),
    "pattern": ("pattern", "a minimal kernel with the op's access pattern and none of its work"),
    "small-t": ("small_t", "small calls next to a kernel doing only the unavoidable work"),
    "ab": ("ab", "an earlier revision's implementations next to this tree's, alternating"),
    "l2-follow": ("l2_follow", "a follower kernel's time right after a call (L2 effects)"),
    "sanitize": ("sanitize", "every op's compute-sanitizer cases through its CUDA kernels"),
    "mla": ("mla", "concat_and_cache_mla's launch-shape variants, hot and rotated"),
    "mla-pattern": ("mla_pattern", "concat_and_cache_mla's cost of slot order and entry alignment"),
    "chain": ("chain", "the floor of a small call's dependent loads (slot, position -> table)"),
    "pdl-step": ("pdl_step", "the fused op after a GEMM, with and without dependent launch"),
}


def _usage(prog: str) -> str:
    lines = [f"usage: {prog} {{{','.join(PROBES)}}} [options]", "", "probes:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in PROBES.items()]
    lines.append(f"\n`{prog} NAME --help` shows a probe's options.")
    return "\n".join(lines)


def run_probe(name: str, argv: list[str], prog: str) -> int:
    """Run probe ``name``; a ProbeError or ValueError is one line on stderr and exit status 2."""
    try:
        module = importlib.import_module(f"{__name__}.{PROBES[name][0]}")
        return module.main(argv, prog)
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


def main(argv: list[str], prog: str = "kvwrite-bench probe") -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog))
        return 0 if argv else 2
    if argv[0] not in PROBES:
        print(f"{prog}: error: expected a probe name ({', '.join(PROBES)}), got {argv[0]!r}",
              file=sys.stderr)
        return 2
    return run_probe(argv[0], argv[1:], f"{prog} {argv[0]}")
