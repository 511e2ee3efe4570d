"""``kvwrite-bench``: every op's benchmark on one engine, and the tools around it.

    kvwrite-bench [flags]                       # reshape_and_cache_flash: vLLM's benchmark
    kvwrite-bench OP [flags]                    # another op's benchmark (the table below)
    kvwrite-bench plot RESULTS.json --out P.png # a plot of any subcommand's --json file
    kvwrite-bench report RESULTS.json...        # --json files as markdown tables
    kvwrite-bench compare OLD NEW               # two runs point by point (kvwrite.bench.compare)

    kvwrite-bench --version

Exit status: 0; 1 when an implementation failed its check or raised; 2 for a usage error (one
line on stderr, before any work), an output path that cannot be written, nothing that can run on
the device, or a point that does not fit; 3 when nothing was measured (every point unsupported
or skipped); 130 on Ctrl-C (after printing the table of what was measured and writing the files;
during start-up: one line).

The subcommands are the registry's: each op's ``OpSpec.bench`` (a ``registry.BenchCommand``: name,
aliases, one line for ``--help``, and its definition in :mod:`kvwrite.bench.ops`). The development
probes and the memcheck cases are tools of the repository, not of this command:
``python -m tools.probes NAME`` and ``python -m tools.sanitize`` from a checkout (tools/).

Nothing here imports an op, the engine or PyTorch's extras at module level: ``--version`` needs
none, the subcommand list imports the ops (registering them), a subcommand imports its own
definition only.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading

__all__ = ["main", "subcommands", "TOOLS", "bench_of", "PROG", "DEFAULT"]

PROG = "kvwrite-bench"
# The subcommand that runs without a subcommand word (vLLM's benchmark).
DEFAULT = "reshape_and_cache_flash"
# The order --help lists the subcommands in: the default first, then as they were added; a
# registered subcommand not named here follows them in registration order.
LISTED = ("reshape_and_cache_flash", "fused_rope_and_reshape_cache_flash",
          "fused_qk_norm_rope_and_reshape_cache_flash", "concat_and_cache_mla",
          "reshape_and_cache_flash_per_token_head_quant", "gather", "nvfp4", "reshape_and_cache",
          "indexer_k_quant_and_cache", "transfer", "turboquant", "mx")

TOOLS = {
    "plot": "plot a --json file of any subcommand",
    "report": "--json files as the markdown tables of docs/performance.md",
    "compare": "two runs' --json files point by point: new/old, geometric means, a threshold",
}

# Former subcommands that are tools of the repository now (tools/, not installed): where they went.
MOVED = {"probe": "python -m tools.probes NAME", "sanitize": "python -m tools.sanitize"}


def subcommands() -> dict:
    """{subcommand: its ``registry.BenchCommand``}, every registered op's, in the order of
    :data:`LISTED` (imports kvwrite.ops, which registers the ops)."""
    from .. import (
        ops,  # noqa: F401  (registers every op)
        registry,
    )

    found = {}
    for op in registry.ops():
        command = registry.get_op(op).bench
        if command is not None:
            found[command.name] = command
    rank = {name: i for i, name in enumerate(LISTED)}
    return {name: found[name] for name in sorted(found, key=lambda n: rank.get(n, len(rank)))}


def _resolve(name: str) -> str | None:
    for canon, command in subcommands().items():
        if name == canon or name in command.aliases:
            return canon
    return None


def bench_of(name: str):
    """The :class:`~kvwrite.bench.engine.OpBench` of subcommand (or alias) ``name``."""
    canon = _resolve(name)
    if canon is None:
        raise ValueError(f"expected a subcommand ({', '.join(subcommands())}), got {name!r}")
    module, attr = subcommands()[canon].target.split(":")
    return getattr(importlib.import_module(module), attr)


def subcommand_help() -> str:
    lines = ["subcommands (kvwrite-bench SUBCOMMAND --help shows one's flags):"]
    for canon, command in subcommands().items():
        name = canon + (f" ({', '.join(command.aliases)})" if command.aliases else "")
        lines.append(f"  {name:<44} {command.summary}")
    lines += [f"  {name:<44} {summary}" for name, summary in TOOLS.items()]
    lines.append("\ndevelopment probes and memcheck cases (tools of the repository, from a "
                 "checkout's root):\n  " + ", ".join(MOVED.values()))
    return "\n".join(lines)


def _plot_main(argv: list[str], prog: str) -> int:
    from .engine import Parser, check_output_path, check_plot_format
    from .plot import plot_rows
    from .report import ReportError, read_json

    p = Parser(prog=f"{prog} plot", description="Plot a JSON file written by any subcommand's "
                                               "--json.")
    p.add_argument("json", help="a file written by --json")
    p.add_argument("--out", required=True, metavar="PATH.png")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        check_output_path("--out", args.out)
        check_plot_format("--out", args.out)
    except ValueError as e:
        p.error(str(e))
    try:
        _, rows = read_json(args.json)
    except OSError as e:
        p.error(f"{args.json}: cannot read it ({e.strerror or e})")
    except ReportError as e:
        p.error(str(e))
    plot_rows(rows, args.out, args.title)
    return 0


def _tool_main(name: str, argv: list[str], prog: str) -> int:
    if name == "plot":
        return _plot_main(argv, prog)
    if name == "report":
        from .markdown import main as report_main
        return report_main(argv, f"{prog} report")
    from .compare import main as compare_main
    return compare_main(argv, f"{prog} compare")


def _sigterm_as_ctrl_c(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM (`timeout`, a job scheduler's time limit) stops a run as Ctrl-C does: the points
    # measured until then are printed and written, not lost with the process.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c) if main_thread else None
    try:
        return _main(argv, prog)
    except KeyboardInterrupt:
        # Ctrl-C while starting (importing PyTorch, an op, compiling): one line, no traceback.
        # The sweep's own Ctrl-C is the engine's (the table of what was measured, then 130).
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str], prog: str) -> int:
    if argv[:1] == ["--version"]:
        from .. import __version__
        print(f"{PROG} {__version__}")
        return 0
    from . import engine
    from .plot import PlotError

    try:
        if argv[:1] and argv[0] in TOOLS:
            return _tool_main(argv[0], argv[1:], prog)
        if argv[:1] and _resolve(argv[0]) is not None:
            return engine.main(bench_of(argv[0]), argv[1:], f"{prog} {argv[0]}")
        if argv[:1] and argv[0] in MOVED:
            print(f"{prog}: error: {argv[0]!r} is a tool of the kvwrite repository now: run "
                  f"`{MOVED[argv[0]]}` from a checkout's root (tools/)", file=sys.stderr)
            return 2
        if argv[:1] and not argv[0].startswith("-"):
            print(f"{prog}: error: expected a subcommand ({', '.join(subcommands())}, "
                  f"{', '.join(TOOLS)}) or flags, got {argv[0]!r}", file=sys.stderr)
            return 2
        if "-h" in argv or "--help" in argv:
            # The default subcommand's help (its one op imported), with every subcommand listed.
            engine.build_parser(bench_of(DEFAULT), prog).print_help()
            print("\n" + subcommand_help())
            return 0
        return engine.main(bench_of(DEFAULT), argv, prog)
    except (engine.BenchError, PlotError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
