"""``kvwrite-bench``: vLLM's reshape_and_cache_flash benchmark, its flags and its table, and more.

    kvwrite-bench [vLLM's flags] [kvwrite's flags]     # the sweep; the table on stdout
    kvwrite-bench plot RESULTS.json --out PLOT.png     # a plot from a saved --json file
    kvwrite-bench report RESULTS.json...               # saved --json files as markdown tables
    kvwrite-bench probe NAME [...]                     # development probes (kvwrite.bench.probes)
    kvwrite-bench sanitize                             # the cases for compute-sanitizer
    kvwrite-bench rope [flags]                         # fused RoPE + cache write (bench/rope.py)
    kvwrite-bench mla [flags]                          # concat_and_cache_mla (kvwrite.bench.mla)

Exit status: 0, 1 when an implementation failed its check or raised, 2 for a usage error, an
output path that cannot be written, no implementation that can run on the device, or a cache
that does not fit; 130 on Ctrl-C (after printing the table of what was measured and writing the
files).

Without a GPU (``--device cpu``), flags not given take small values (:data:`CPU_DEFAULTS`) so
that the sweep runs in seconds; vLLM's defaults would need a 64 GiB cache.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys

import torch

from .. import registry
from ..ops.reshape_and_cache_flash import OP
from . import report
from .models import MODELS, doublings, get_model, heads_per_rank, serving_flags
from .plot import PlotError, plot_rows
from .slots import PATTERNS, SlotPattern
from .sweep import DTYPES, BenchError, Config, Env, Interrupted, run_sweep
from .timing import MIN_SAMPLES, floor_line
from .workload import LAYOUTS

__all__ = ["main", "build_parser", "parse_args", "make_config", "parse_num_tokens",
           "check_output_path", "CPU_DEFAULTS", "add_slot_flags", "slot_pattern", "given_flags"]

PROG = "kvwrite-bench"

# --device cpu: the values of the flags not given. vLLM's shape (128 heads, 65536 blocks) needs a
# 64 GiB cache; this one runs its 16 points in about 15 s on 2 cores with the torch reference.
CPU_DEFAULTS = {"num_heads": 8, "num_blocks": 16, "num_tokens": "2:256", "iters": 10,
                "graph_calls": 5}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of the seed benchmark's flags."""

    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark reshape_and_cache_flash (writing new K/V rows into a paged KV "
                    "cache). vLLM's flags, defaults and table, plus device timing, several "
                    "implementations side by side, bandwidth, JSON/CSV and plots. "
                    f"`{prog} plot RESULTS.json --out PLOT.png` plots a saved --json file.",
    )
    seed = p.add_argument_group("vLLM's flags (same defaults and choices)")
    seed.add_argument("--num-heads", type=int, default=128, help="KV heads (default: 128)")
    seed.add_argument("--head-size", type=int, choices=[64, 80, 96, 112, 120, 128, 192, 256],
                      default=128, help="(default: 128)")
    seed.add_argument("--block-size", type=int, choices=[16, 32], default=16,
                      help="(default: 16)")
    seed.add_argument("--num-blocks", type=int, default=128 * 512, help="(default: 65536)")
    seed.add_argument("--dtype", type=str, choices=list(DTYPES), default="bfloat16",
                      help="key/value dtype (default: bfloat16)")
    seed.add_argument("--kv-cache-dtype", type=str, choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                      default="auto", help="fp8 = fp8_e4m3 (default: auto)")
    seed.add_argument("--iters", type=int, default=100,
                      help="timed samples at most: replays (device timer) or calls (host-sync) "
                           "(default: 100)")
    seed.add_argument("--implementation", type=str, default="cuda",
                      help="a registered implementation (cuda, triton, torch, ...), a comma list, "
                           "or 'all' (those available on the device) (default: cuda; torch with "
                           "--device cpu)")
    seed.add_argument("--mode", type=str, choices=["cudagraph", "no_graph"], default="cudagraph",
                      help="(default: cudagraph)")

    more = p.add_argument_group("kvwrite's flags")
    more.add_argument("--timer", choices=["device", "host-sync"], default="device",
                      help="device (default): CUDA events around a CUDA graph of --graph-calls "
                           "calls (around as many eager calls in no_graph mode), median per call; "
                           "host-sync: vLLM's host clock with a synchronize after each call")
    more.add_argument("--hot-l2", action="store_true", default=False,
                      help="the same inputs every call (vLLM's condition) instead of rotating "
                           "inputs and slot mappings past the L2")
    more.add_argument("--graph-calls", type=int, default=20,
                      help="calls per CUDA graph (or per eager run) for the device timer "
                           "(default: 20)")
    more.add_argument("--time-budget", type=float, default=0.5, metavar="SECONDS",
                      help="timed seconds per point and implementation after which the device "
                           "timer stops (at least 10 samples, at most --iters; default: 0.5)")
    more.add_argument("--layouts", type=str, default="NHD,HND",
                      help="comma list of NHD, HND, packed (one [num_blocks, block_size, H, 2*D] "
                           "allocation, K = [..., :D], V = [..., D:]) (default: NHD,HND)")
    more.add_argument("--num-tokens", type=str, default="2:65536",
                      help="a list (1,2,64) or a range LO:HI of doublings (2:65536 = 2, 4, ..., "
                           "65536, the default)")
    add_slot_flags(p)
    add_launch_flags(p)

    more.add_argument("--per-head-scale", action="store_true", default=False,
                      help="fp8: one scale per head (its amax over tokens and dims / 64)")
    more.add_argument("--model", type=str.lower, choices=list(MODELS), default=None,
                      help="set --num-heads and --head-size to the model's KV heads and head "
                           "size; with --slots decode, prefill or mixed also the serving shape "
                           "(kvwrite.bench.models.ServingShape): T = 1..256 running sequences "
                           "(decode) or 512..8192 tokens per step (prefill, mixed: 256 decode "
                           "tokens + one chunk), contexts up to the model's context window, "
                           "prefill_len 2048; --num-tokens, --context-len, --prefill-len, "
                           "--decode-tokens and --decode-fraction given win")
    more.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel degree: divides the KV heads (one replicated head per "
                           "rank when it exceeds them) (default: 1)")
    more.add_argument("--baseline", type=str, default=None,
                      help="the implementation speedups are relative to (default: the first listed)")
    more.add_argument("--no-check", dest="check", action="store_false", default=True,
                      help="skip the check against the torch reference before timing")
    more.add_argument("--device", type=str, default="cuda",
                      help="cuda (default), cuda:N, or cpu (the torch implementation, CPU timings)")
    more.add_argument("--verbose", action="store_true", default=False,
                      help="add spread, bandwidth and status columns to the table")
    more.add_argument("--json", type=str, default=None, metavar="PATH",
                      help="write {meta, rows} (one row per measurement) as JSON")
    more.add_argument("--csv", type=str, default=None, metavar="PATH",
                      help="write one line per measurement as CSV (last column: the command)")
    more.add_argument("--plot", type=str, default=None, metavar="PATH.png",
                      help="plot latency and GB/s against num_tokens (needs matplotlib)")
    return p


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """``--no-pdl``; every benchmark subcommand adds it (and applies it with
    :func:`launch_line`)."""
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the cuda implementations without programmatic dependent "
                             "launch (on by default on compute capability 9.0 and later: each "
                             "call is scheduled while the one before it still runs and waits for "
                             "it before reading anything; KVWRITE_PDL=0 does the same)")


def launch_line(args: argparse.Namespace, device: torch.device) -> str:
    """Applies ``--no-pdl`` and returns the header line that says how the cuda and Triton kernels
    launch on ``device``."""
    from ..kernels import nvrtc

    if getattr(args, "no_pdl", False):
        nvrtc.use_pdl(False)
    if not nvrtc.pdl_on():
        return "launch: programmatic dependent launch off"
    if device.type != "cuda":
        return "launch: plain (not a CUDA device)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] < 9:
        return ("launch: plain (programmatic dependent launch needs compute capability 9.0)")
    return ("launch: programmatic dependent launch of the cuda and Triton kernels (each call "
            "scheduled while the kernel before it runs, waiting for it before any load; --no-pdl "
            "turns it off)")


def add_slot_flags(parser: argparse.ArgumentParser) -> None:
    """The slot-pattern flags (``--slots``, ``--pad-fraction``, ``--context-len``,
    ``--prefill-len``, ``--decode-fraction``, ``--decode-tokens``) as one group of ``parser``;
    every benchmark subcommand adds them here."""
    g = parser.add_argument_group("slot patterns (which cache slots the T tokens write)")
    g.add_argument("--slots", choices=PATTERNS, default="random",
                   help="random: T unique random slots (vLLM's, the default); decode: T "
                        "sequences appending one token each at the next offset of their last "
                        "block; prefill: ceil(T / --prefill-len) sequences writing consecutive "
                        "offsets over whole blocks; mixed: decode tokens (--decode-tokens, else "
                        "--decode-fraction of T) then one prefill chunk. Blocks come from a "
                        "shuffled free list")
    g.add_argument("--pad-fraction", type=float, default=0.0, metavar="F",
                   help="that fraction of the T slots are -1 padding at the end, as in a "
                        "CUDA-graph batch (default: 0)")
    g.add_argument("--context-len", type=int, default=4096,
                   help="decode, mixed: contexts already cached are uniform in [0, this] "
                        "(capped so that every sequence's blocks fit) (default: 4096)")
    g.add_argument("--prefill-len", type=int, default=512,
                   help="prefill: new tokens per sequence (default: 512)")
    g.add_argument("--decode-fraction", type=float, default=0.5,
                   help="mixed: the fraction of the tokens that are decode tokens "
                        "(default: 0.5)")
    g.add_argument("--decode-tokens", type=int, default=None,
                   help="mixed: this many decode tokens (at most T) instead of "
                        "--decode-fraction: the running batch of a serving step")


def slot_pattern(args: argparse.Namespace, max_position: int | None = None) -> SlotPattern:
    """The :class:`SlotPattern` of :func:`add_slot_flags`'s flags (ValueError names a bad one)."""
    return SlotPattern(args.slots, pad_fraction=args.pad_fraction, context_len=args.context_len,
                       prefill_len=args.prefill_len, decode_fraction=args.decode_fraction,
                       decode_tokens=args.decode_tokens, max_position=max_position)


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags ``argv`` gives (argparse leaves a namespace's attributes that are
    already set alone unless a flag sets them)."""
    unset = object()
    ns = argparse.Namespace(**{dest: unset for dest in vars(parser.parse_args([]))})
    parser.parse_args(argv, namespace=ns)
    return {dest for dest, value in vars(ns).items() if value is not unset}


def normalize_flags(argv: list[str]) -> list[str]:
    """vLLM's parsers accept --num_heads for --num-heads: so do kvwrite's (every subcommand)."""
    out = []
    for a in argv:
        if a.startswith("--") and not a.startswith("---"):
            flag, eq, value = a.partition("=")
            a = flag.replace("_", "-") + eq + value
        out.append(a)
    return out


def parse_args(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    """Parsed flags; ``explicit`` holds the names of the flags given on the command line."""
    argv = normalize_flags(argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.explicit = given_flags(parser, argv)
    return args


def parse_num_tokens(text: str) -> list[int]:
    """``"1,2,64"`` -> [1, 2, 64]; ``"LO:HI"`` -> LO, 2*LO, 4*LO, ... up to HI."""
    bad = ValueError(f"--num-tokens: expected a list like 1,2,64 or a range LO:HI of doublings "
                     f"like 2:65536 (positive integers), got {text!r}")
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            if lo < 1 or hi < lo:
                raise bad
            return doublings(lo, hi)
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise bad from None
    if not values or min(values) < 1:
        raise bad
    return list(dict.fromkeys(values))


def _parse_layouts(text: str) -> list[str]:
    names = {name.lower(): name for name in LAYOUTS}
    out = []
    for part in text.split(","):
        if part.strip().lower() not in names:
            raise ValueError(f"--layouts: expected a comma list of {', '.join(LAYOUTS)}, got {text!r}")
        out.append(names[part.strip().lower()])
    return list(dict.fromkeys(out))


def _parse_device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda, cuda:N or cpu, got {text!r}")
    return dev


def left_out(device: torch.device, op: str = OP) -> list[str]:
    """One line per registered implementation of ``op`` that cannot run on ``device``, with the
    reason."""
    return [f"{i.name}: {reason}" for i in registry.all_impls(op)
            if (reason := i.available(device)) is not None]


def parse_implementations(text: str, device: torch.device, op: str = OP) -> list[str]:
    """``--implementation``: a registered name of ``op``, a comma list, or "all" (those available
    on ``device``); every benchmark subcommand parses it this way."""
    if text == "all":
        names = [i.name for i in registry.all_impls(op) if i.available(device) is None]
        if not names:
            raise ValueError(f"--implementation all: no registered implementation is available on "
                             f"{device}: {'; '.join(left_out(device, op))}")
        return names
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [i.name for i in registry.all_impls(op)]
    for n in names:
        if n not in known:
            raise ValueError(f"--implementation: expected {', '.join(known)}, a comma list of "
                             f"them, or 'all', got {n!r}")
    if not names:
        raise ValueError(f"--implementation: expected a name, a comma list or 'all', got {text!r}")
    return list(dict.fromkeys(names))


def make_config(args: argparse.Namespace) -> Config:
    """The run's configuration; raises ValueError naming the flag for bad values."""
    device = _parse_device(args.device)
    impl_text = args.implementation
    if device.type == "cpu":
        if "implementation" not in args.explicit:
            impl_text = "torch"
        for flag, value in CPU_DEFAULTS.items():
            if flag not in args.explicit and not (args.model and flag == "num_heads"):
                setattr(args, flag, value)
    impls = parse_implementations(impl_text, device)
    baseline = args.baseline or impls[0]
    if baseline not in impls:
        raise ValueError(f"--baseline: expected one of the implementations run ({', '.join(impls)}), "
                         f"got {baseline!r}")
    num_heads, head_size = args.num_heads, args.head_size
    max_position = None
    if args.model:
        preset_flags = serving_flags(args.model, args.slots, args.explicit)
        max_position = preset_flags.pop("max_position", None)
        for dest, value in preset_flags.items():
            setattr(args, dest, ",".join(map(str, value)) if dest == "num_tokens" else value)
        given = [f"--{f.replace('_', '-')}" for f in ("num_heads", "head_size") if f in args.explicit]
        if given:
            raise ValueError(f"--model: sets --num-heads and --head-size; got {' and '.join(given)} too")
        preset = get_model(args.model)
        num_heads, head_size = preset.num_kv_heads, preset.head_dim
    for flag, value in (("--num-heads", num_heads), ("--num-blocks", args.num_blocks),
                        ("--iters", args.iters), ("--graph-calls", args.graph_calls)):
        if value < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {value}")
    num_heads = heads_per_rank(num_heads, args.tp)
    if not args.time_budget > 0:
        raise ValueError(f"--time-budget: expected a positive number of seconds, got {args.time_budget}")
    pattern = slot_pattern(args, max_position)
    return Config(
        implementations=impls, baseline=baseline, layouts=_parse_layouts(args.layouts),
        num_tokens=parse_num_tokens(args.num_tokens), num_heads=num_heads, head_size=head_size,
        block_size=args.block_size, num_blocks=args.num_blocks, dtype=DTYPES[args.dtype],
        kv_cache_dtype=args.kv_cache_dtype, per_head_scale=args.per_head_scale, iters=args.iters,
        mode=args.mode, timer=args.timer, hot_l2=args.hot_l2, graph_calls=args.graph_calls,
        time_budget=args.time_budget, check=args.check, device=device, model=args.model or "",
        tp=args.tp, slots=pattern)


def header_lines(cfg: Config, env: Env) -> list[str]:
    """What was measured, how, and on what: printed above vLLM's header line."""
    calls = cfg.graph_calls

    def over(unit: str) -> str:
        return (f"up to {cfg.iters} {unit} (fewer past {cfg.time_budget:g} s per point, at least "
                f"{min(cfg.iters, MIN_SAMPLES)})")
    model = f" ({cfg.model}, tp={cfg.tp})" if cfg.model else (f" (tp={cfg.tp})" if cfg.tp > 1 else "")
    scale = ", per-head scales" if cfg.per_head_scale and "fp8" in cfg.kv_cache_dtype else ""
    lines = [
        f"kvwrite-bench {env.kvwrite_version} on {env.device_name} | torch {env.torch_version}, "
        f"triton {env.triton_version or '-'}, CUDA {env.cuda_version or '-'}",
        f"shape: num_heads={cfg.num_heads}{model} head_size={cfg.head_size} "
        f"block_size={cfg.block_size} num_blocks={cfg.num_blocks} dtype={str(cfg.dtype).removeprefix('torch.')} "
        f"kv_cache_dtype={cfg.kv_cache_dtype}{scale}",
        "slots: " + cfg.slots.explain(max(cfg.num_tokens), cfg.num_blocks, cfg.block_size),
    ]
    if cfg.timer == "host-sync":
        what = ("each replay of a CUDA graph of 1 call" if cfg.measured_mode == "cudagraph"
                else "each call")
        lines.append(f"timer: host-sync (vLLM's method): host clock around {what}, with a "
                     f"synchronize after it; latency = mean of {cfg.iters} calls")
    elif cfg.is_cpu:
        lines.append(f"CPU timings: host clock (time.perf_counter) around runs of {calls} calls; "
                     f"latency = median per call over {over('runs')}")
    elif cfg.measured_mode == "cudagraph":
        lines.append(f"timer: device: CUDA events around replays of one CUDA graph of {calls} calls; "
                     f"latency = median per call over {over('replays')}")
    else:
        lines.append(f"timer: device: CUDA events around {calls} back-to-back eager calls (launch "
                     f"cost included); latency = median per call over {over('runs')}")
    if cfg.is_cpu and cfg.mode == "cudagraph":
        lines.append("note: cudagraph mode needs a CUDA device; measured no_graph on the CPU")
    l2_mib = env.l2_bytes / 2**20
    if cfg.l2_condition == "rotated":
        lines.append(f"L2: rotated: the calls of a run rotate over input sets (key, value, slots) "
                     f"that together exceed 2x the {l2_mib:.0f} MiB L2 (up to {calls} sets; when "
                     f"{calls} are smaller, L2 is flushed before each run)")
    elif cfg.l2_condition == "hot":
        lines.append("L2: hot: the same inputs every call, as vLLM measures")
    else:
        lines.append("L2: not controlled on the CPU")
    lines.append(f"copy bandwidth: {env.copy_bw / 1e9:.0f} GB/s (copies of "
                 f"{env.copy_bytes / 2**20:.0f} MiB, bytes read + written, median of 10)")
    if not cfg.is_cpu:
        lines.append(floor_line(None if math.isnan(env.launch_floor) else env.launch_floor))
    lines.append("check: each implementation against the torch reference at each point, before "
                 "timing" if cfg.check else "check: off (--no-check)")
    return ["# " + line for line in lines]


def _command(prog: str, argv: list[str]) -> str:
    return " ".join([prog, shlex.join(argv)]) if argv else prog


def _run(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    try:
        cfg = make_config(args)
    except ValueError as e:
        build_parser(prog).error(str(e))
    if cfg.device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); "
                         "pass --device cpu to run the torch implementation on the CPU")
    reasons = {n: registry.get(OP, n).available(cfg.device) for n in cfg.implementations}
    if all(r is not None for r in reasons.values()):
        raise BenchError(f"nothing can run on {cfg.device}: "
                         + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
    # Fail before the sweep, not after it.
    try:
        check_output_paths(args)
    except ValueError as e:
        build_parser(prog).error(str(e))
    if args.plot:
        from .plot import _pyplot
        _pyplot()

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if "all" in args.implementation.split(","):
        for line in left_out(cfg.device):
            progress(f"--implementation all leaves out {line}")
    launch = launch_line(args, cfg.device)
    try:
        rows, env = run_sweep(cfg, progress)
        interrupted = False
    except Interrupted as e:
        rows, env, interrupted = e.rows, e.env, True
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C) before any point was measured", file=sys.stderr)
        return 130
    if interrupted and not rows:
        print(f"{prog}: interrupted (Ctrl-C) before any point was measured", file=sys.stderr)
        return 130
    impl_title = ",".join(cfg.implementations)
    header = header_lines(cfg, env) + ["# " + launch]
    lines = list(header)
    lines.append(f"Benchmark results for implementation {impl_title} "
                 f"(measuring with {cfg.measured_mode}):")
    if len(cfg.implementations) == 1:
        lines.append(report.seed_table(rows, args.verbose))
    else:
        lines.append(report.compare_table(rows, cfg.implementations, cfg.baseline, args.verbose))
        lines.append(f"speedup = {cfg.baseline} latency / the implementation's latency")
    notes = report.notes(rows)
    if notes:
        lines.append("notes (NaN rows):")
        lines += [f"  {n}" for n in notes]
    print("\n".join(lines), flush=True)

    command = _command(prog, argv)
    meta = {
        "command": command, "argv": argv, "created": datetime.datetime.now(datetime.timezone.utc)
        .isoformat(timespec="seconds"), "device": str(cfg.device), "device_name": env.device_name,
        "torch_version": env.torch_version, "triton_version": env.triton_version,
        "cuda_version": env.cuda_version, "kvwrite_version": env.kvwrite_version,
        "l2_bytes": env.l2_bytes, "copy_bw_gbps": env.copy_bw / 1e9, "copy_bytes": env.copy_bytes,
        "launch_floor_us": None if math.isnan(env.launch_floor) else env.launch_floor * 1e6,
        "implementations": cfg.implementations, "baseline": cfg.baseline,
        "header": header, "notes": notes,
    }
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.csv:
        report.write_csv(args.csv, rows, command)
    if args.plot:
        plot_rows(rows, args.plot)
    total = len(cfg.layouts) * len(cfg.num_tokens) * len(cfg.implementations)
    if interrupted:
        print(f"{prog}: interrupted (Ctrl-C) after {len(rows)} of {total} measurements; the "
              f"table above and the files written hold those", file=sys.stderr)
        return 130
    if not any(r.ok for r in rows):
        print(f"{prog}: nothing was measured: every point was unsupported or skipped (see the "
              f"notes above)", file=sys.stderr)
    failed = [r for r in rows if r.status.startswith(("mismatch", "error"))]
    return 1 if failed else 0


def _plot_main(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=f"{prog} plot",
                                description="Plot a JSON file written by --json.")
    p.add_argument("json", help="a file written by --json")
    p.add_argument("--out", required=True, metavar="PATH.png")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        check_output_path("--out", args.out)
    except ValueError as e:
        p.error(str(e))
    try:
        _, rows = report.read_json(args.json)
    except OSError as e:
        p.error(f"{args.json}: cannot read it ({e.strerror or e})")
    except (ValueError, TypeError, KeyError) as e:  # not JSON, or not --json's layout
        text = str(e)
        p.error(text if text.startswith(args.json) else
                f"{args.json}: expected a JSON file written by --json, got one that does not "
                f"parse as such ({type(e).__name__}: {text})")
    plot_rows(rows, args.out, args.title)
    return 0


def _tool_main(name: str, argv: list[str], prog: str) -> int:
    """The ``probe``, ``report`` and ``sanitize`` subcommands (imported only when used)."""
    if name == "report":
        from .markdown import main as report_main
        return report_main(argv, f"{prog} report")
    from . import probes
    if name == "sanitize":
        return probes.run_probe("sanitize", argv, f"{prog} sanitize")
    return probes.main(argv, f"{prog} probe")


def check_output_paths(args: argparse.Namespace) -> None:
    """:func:`check_output_path` for every one of ``--json``, ``--csv``, ``--plot`` that ``args``
    has and sets (every benchmark subcommand calls it before its sweep)."""
    for flag in ("json", "csv", "plot"):
        path = getattr(args, flag, None)
        if path:
            check_output_path(f"--{flag}", path)


def check_output_path(flag: str, path: str) -> None:
    """Raise ValueError (naming ``flag``) unless ``path`` can be written: its folder exists and
    is writable, and it is not a folder itself. Checked before the sweep."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag}: expected a file path, got the folder {path!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: the folder {folder!r} of {path!r} does not exist (create it "
                         f"first)")
    if not os.access(folder, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}: {path!r} cannot be written (no permission)")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["plot"]:
            return _plot_main(argv[1:], prog)
        if argv[:1] in (["probe"], ["report"], ["sanitize"]):
            return _tool_main(argv[0], argv[1:], prog)
        if argv[:1] == ["rope"]:
            from .rope import main as rope_main
            return rope_main(argv[1:], f"{prog} rope")
        if argv[:1] == ["mla"]:
            from .mla import main as mla_main
            return mla_main(argv[1:], f"{prog} mla")
        return _run(argv, prog)
    except (BenchError, PlotError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
