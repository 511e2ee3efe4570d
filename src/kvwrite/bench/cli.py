"""``kvwrite-bench``: every op's benchmark on one engine, and the tools around it.

    kvwrite-bench [flags]                       # reshape_and_cache_flash: vLLM's benchmark
    kvwrite-bench OP [flags]                    # another op's benchmark (the table below)
    kvwrite-bench plot RESULTS.json --out P.png # a plot of any subcommand's --json file
    kvwrite-bench report RESULTS.json...        # --json files as markdown tables
    kvwrite-bench compare OLD NEW               # two runs point by point (kvwrite.bench.compare)
    kvwrite-bench probe NAME [...]              # development probes (kvwrite.bench.probes)
    kvwrite-bench sanitize                      # every op's bounds cases, for compute-sanitizer

    kvwrite-bench --version

Exit status: 0; 1 when an implementation failed its check or raised; 2 for a usage error (one
line on stderr, before any work), an output path that cannot be written, nothing that can run on
the device, or a point that does not fit; 3 when nothing was measured (every point unsupported
or skipped); 130 on Ctrl-C (after printing the table of what was measured and writing the files;
during start-up: one line).

Nothing here imports an op, the engine or PyTorch's extras at module level: ``--version`` and the
subcommand list need none, a subcommand imports its own definition only.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "SUBCOMMANDS", "TOOLS", "bench_of", "PROG"]

PROG = "kvwrite-bench"

# subcommand -> (aliases, the definition "module:attribute", one line for --help). Each
# definition lives in its op's folder (ops/<op>/bench.py) and is imported only when used.
SUBCOMMANDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "reshape_and_cache_flash": (
        (), "kvwrite.ops.reshape_and_cache_flash.bench:BENCH",
        "the KV cache write: vLLM's benchmark (also the default: kvwrite-bench [flags])"),
    "fused_rope_and_reshape_cache_flash": (
        ("rope",), "kvwrite.ops.fused_rope_and_reshape_cache_flash.bench:BENCH",
        "RoPE + cache write, fused, against the unfused pair and rotary_embedding alone"),
    "fused_qk_norm_rope_and_reshape_cache_flash": (
        ("qk-norm-rope",), "kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash.bench:BENCH",
        "QK-norm + RoPE + cache write: fused, the unfused sequence, norm+rope alone"),
    "concat_and_cache_mla": (
        ("mla",), "kvwrite.ops.concat_and_cache_mla.bench:BENCH",
        "the MLA latent cache write (auto, fp8, fp8_ds_mla): vLLM's benchmark"),
    "reshape_and_cache_flash_per_token_head_quant": (
        ("per-token-head",), "kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.bench:BENCH",
        "the per-(token, head) quantized cache write: int8, fp8, int4"),
    "gather": (
        (), "kvwrite.ops.gather_cache_flash.bench:BENCH",
        "reading caches back: the five gathers (dequant, cp, upconvert, flash, indexer)"),
    "nvfp4": (
        (), "kvwrite.ops.nvfp4.bench:BENCH",
        "the NVFP4 cache write (vLLM's page layout), beside the fp8 write of the same shape"),
    "reshape_and_cache": (
        ("legacy",), "kvwrite.ops.reshape_and_cache.bench:BENCH",
        "the legacy paged-attention cache write (x-packed key layout)"),
    "indexer_k_quant_and_cache": (
        ("indexer",), "kvwrite.ops.indexer_k_quant_and_cache.bench:BENCH",
        "DeepSeek-V3.2's indexer key write (e4m3 codes + group scales)"),
}

TOOLS = {
    "plot": "plot a --json file of any subcommand",
    "report": "--json files as the markdown tables of docs/performance.md",
    "compare": "two runs' --json files point by point: new/old, geometric means, a threshold",
    "probe": "development probes (kvwrite-bench probe --help lists them)",
    "sanitize": "every op's bounds cases through its CUDA kernels, for compute-sanitizer",
}


def _resolve(name: str) -> str | None:
    for canon, (aliases, _, _) in SUBCOMMANDS.items():
        if name == canon or name in aliases:
            return canon
    return None


def bench_of(name: str):
    """The :class:`~kvwrite.bench.engine.OpBench` of subcommand (or alias) ``name``."""
    canon = _resolve(name)
    if canon is None:
        raise ValueError(f"expected a subcommand ({', '.join(SUBCOMMANDS)}), got {name!r}")
    module, attr = SUBCOMMANDS[canon][1].split(":")
    return getattr(importlib.import_module(module), attr)


def subcommand_help() -> str:
    lines = ["subcommands (kvwrite-bench SUBCOMMAND --help shows one's flags):"]
    for canon, (aliases, _, summary) in SUBCOMMANDS.items():
        name = canon + (f" ({', '.join(aliases)})" if aliases else "")
        lines.append(f"  {name:<44} {summary}")
    lines += [f"  {name:<44} {summary}" for name, summary in TOOLS.items()]
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
    if name == "compare":
        from .compare import main as compare_main
        return compare_main(argv, f"{prog} compare")
    from . import probes
    if name == "sanitize":
        return probes.run_probe("sanitize", argv, f"{prog} sanitize")
    return probes.main(argv, f"{prog} probe")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv, prog)
    except KeyboardInterrupt:
        # Ctrl-C while starting (importing PyTorch, an op, compiling): one line, no traceback.
        # The sweep's own Ctrl-C is the engine's (the table of what was measured, then 130).
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


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
        if argv[:1] and not argv[0].startswith("-"):
            print(f"{prog}: error: expected a subcommand ({', '.join(SUBCOMMANDS)}, "
                  f"{', '.join(TOOLS)}) or flags, got {argv[0]!r}", file=sys.stderr)
            return 2
        if "-h" in argv or "--help" in argv:
            # The default subcommand's help (its one op imported), with every subcommand listed.
            engine.build_parser(bench_of("reshape_and_cache_flash"), prog).print_help()
            print("\n" + subcommand_help())
            return 0
        return engine.main(bench_of("reshape_and_cache_flash"), argv, prog)
    except (engine.BenchError, PlotError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
