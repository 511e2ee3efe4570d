"""The one benchmark engine: every op's benchmark is a short definition (:class:`OpBench`, in
:mod:`kvwrite.bench.ops`, one module per subcommand) run by this module.

The engine owns everything that is the same for every op:

- the command line: one grammar for the shared flags (``--num-tokens 1,2,64`` or ``LO:HI``,
  comma lists, ``--implementation NAME|A,B|all``, timers, L2, outputs), a one-line error and exit
  status 2 for any bad value before any work, the small CPU defaults, ``--model`` presets and the
  slot-pattern flags where the op has them;
- the environment: the copy bandwidth and the launch floor measured in the same run, the L2 size;
- the memory plan (a point that cannot fit is refused before anything is measured);
- per point: the input sets and the L2 rule (:func:`timing.l2_rotation`: sets past twice the L2,
  flushed when fewer; ``--hot-l2``: one set), the check of every implementation against the
  reference before it is timed, the timer (CUDA events around a CUDA graph or eager calls,
  vLLM's host-sync method, or the host clock on the CPU), one :class:`report.Row` per series;
- progress lines, Ctrl-C (the table of what was measured, the files, exit status 130), the table,
  JSON, CSV and the plot.

An op's definition says only what is the op's: its axes and their flags, how a point's state
(caches) and input sets are built, the callables per kind, the bytes a call moves and touches,
its check, and a few header lines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .. import __version__, registry
from ..dtypes import BENCH_DTYPES
from ..testing.slots import PATTERNS, SlotPattern
from . import report, timing
from .models import MODELS, parse_num_tokens
from .report import Row, format_table, series_label

__all__ = ["OpBench", "SlotsBench", "Config", "Env", "BenchError", "Skip", "Interrupted", "Parser", "main",
           "configure", "sweep", "render", "parse_num_tokens", "parse_list", "parse_device",
           "check_output_path", "given_flags", "normalize_flags", "add_slot_flags",
           "slot_pattern", "launch_line", "COPY_BYTES", "MARGIN_BYTES", "available_memory",
           "OutOfMemoryError", "compare_with_reference", "ENGINE_DEFAULTS", "CPU_TIMING",
           "require_positive", "add_cache_flags", "slots_line", "slot_params", "skip_unless_fits",
           "UNCHECKED"]

COPY_BYTES = 2**30
# The exit status of a run that measured nothing (every row unsupported or skipped): not 0, and
# none of 1 (a failed check or an error), 2 (a usage error) or 130 (Ctrl-C).
NOTHING_MEASURED = 3
CPU_COPY_BYTES = 64 * 2**20
# Kept free beyond the planned tensors: CUDA graphs, kernel modules, allocator rounding.
MARGIN_BYTES = 512 * 2**20
GiB = 2**30
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# The engine's flag defaults (dest -> value); an op's OpBench.defaults overrides some of them.
ENGINE_DEFAULTS = {"num_tokens": "1:65536", "implementation": "cuda", "iters": 100,
                   "time_budget": 0.5, "graph_calls": 20}
# The timing part of most ops' cpu_defaults: few short samples, for runs of seconds on two cores.
CPU_TIMING = {"iters": 5, "graph_calls": 2, "time_budget": 0.05}


# What OpBench.check returns for a kind it does not compare (another library's call whose bytes
# differ from the reference by design): the row's check stays "skipped".
UNCHECKED = "unchecked"


class BenchError(RuntimeError):
    """A condition the user must fix; printed as one line, exit status 2, never a traceback."""


class Skip(Exception):
    """Raised by an op's ``prepare``: this point cannot run (the message says why)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the sweep, carrying the rows measured until then and the environment."""

    def __init__(self, rows: list[Row], env: Env):
        super().__init__()
        self.rows, self.env = rows, env


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- an op's benchmark definition ----------------------------------------------------------------

class OpBench:
    """What an op's benchmark declares; the engine does the rest (see the module doc).

    A point is any object with a ``num_tokens`` attribute (usually a frozen dataclass); its
    ``params`` are the row's axes. A kind is one thing timed at a point (``kinds``; one kind,
    named after the op, by default).
    """

    name: str = ""                   # the subcommand
    # The subcommand's aliases and its line in `kvwrite-bench --help` are the op's
    # registry.BenchCommand (kvwrite.bench.cli lists the registry's).
    summary: str = ""                # the parser's description where `description` is empty
    description: str = ""            # the subcommand's --help
    op: str = ""                     # the registry op whose implementations --implementation names
    kinds: tuple[str, ...] = ()      # () means one kind, named after the op
    # The registry ops each kind calls where not just `op` (kind -> ops; see kind_ops).
    ops_of_kind: dict[str, tuple[str, ...]] = {}
    has_slots: bool = False          # the slot-pattern flags (--slots, --pad-fraction, ...)
    has_model: bool = False          # --model (and --tp, where tp_flag)
    tp_flag: bool = False
    # Defaults of the engine's flags for this op where they differ from ENGINE_DEFAULTS (dest ->
    # value), and the values of any flags on the CPU where not given (dest -> value: a shape that
    # runs in seconds on two cores; CPU_TIMING for the timing flags).
    defaults: dict = {}
    cpu_defaults: dict = {}
    # The table's point columns: (param, header), in order; a column shows when its value
    # varies over the run's points or when it is in always_columns.
    columns: tuple[tuple[str, str], ...] = (("num_tokens", "num_tokens"),)
    always_columns: tuple[str, ...] = ("num_tokens",)
    # The report's table columns are split by this param (one column per value and series).
    report_axis: str | None = None
    # `kvwrite-bench report`: None tabulates the rows as every op's (a table per combination of
    # the varying params, a line per num_tokens, "µs (% of copy bandwidth)" per series). A tuple
    # of params: a table per combination of their values, a line per point (its other varying
    # `columns`), and per num_tokens and series the cells of report_columns.
    report_split: tuple[str, ...] | None = None

    # -- flags and points
    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """The op's own flags (its axes)."""

    def configure(self, args: argparse.Namespace, device: torch.device) -> None:
        """Apply presets to ``args`` (``args.explicit`` holds the flags given, which win); raise
        ValueError naming a flag for a bad value. Called before :meth:`points`."""

    def points(self, args: argparse.Namespace) -> list:
        """Every point of the sweep, in the order measured; ValueError names a bad flag."""
        raise NotImplementedError

    def params(self, point) -> dict:
        """The row's axes for ``point`` (JSON-able values; not num_tokens, and no name of a
        :class:`report.Row` field: ``mode`` is the timer's, so a format is ``kv_cache_dtype``)."""
        raise NotImplementedError

    def header(self, args: argparse.Namespace, points: list) -> list[str]:
        """Lines above the table that say what was measured (shape, slots, bytes formula)."""
        return []

    def title(self, args: argparse.Namespace, cfg: Config) -> str | None:
        """A line just above the table (vLLM's benchmarks print one)."""
        return None

    def kind_ops(self, kind: str) -> tuple[str, ...]:
        """The registry ops a kind calls (their implementations must all be available)."""
        return self.ops_of_kind.get(kind, (self.op,))

    # -- memory and bytes
    def set_bytes(self, point, kind: str) -> int:
        """Bytes of one input set that a call of ``kind`` touches (each once): the L2 rule."""
        raise NotImplementedError

    def state_bytes(self, point) -> int:
        """Device bytes of a point's state, sized by ``--num-blocks`` where the op has caches:
        by default ``num_blocks`` blocks of :meth:`block_bytes` (none where that is None)."""
        block = self.block_bytes(point)
        return 0 if block is None else point.num_blocks * block

    def temp_bytes(self, point) -> int:
        """Other device bytes a point needs besides its state and input sets (the check's
        temporaries, tables)."""
        return 0

    def block_bytes(self, point) -> int | None:
        """Bytes of one cache block, where ``--num-blocks`` sizes the state (memory hints)."""
        return None

    def bytes(self, point, kind: str) -> int:
        """Bytes one call must move: inputs read once, outputs written once."""
        raise NotImplementedError

    # -- one point
    def skip_reason(self, point) -> str | None:
        """Why this point is not run at all (the row's status after "skipped: "), or None."""
        return None

    def prepare(self, point, count: int, device: torch.device):
        """The point's context: its state and ``count`` input sets. Raise :class:`Skip` when the
        point cannot be built (a slot pattern that does not fit)."""
        raise NotImplementedError

    def unsupported(self, ctx, kind: str, impl: str) -> str | None:
        """Why ``impl`` cannot run this point's ``kind``, or None."""
        return None

    def check(self, ctx, kind: str, impl: str) -> str | None:
        """Run ``impl`` once and compare what it writes with the torch reference; None when
        equal, else what differs (:data:`UNCHECKED` for a kind whose bytes are not compared: its
        rows say check "skipped")."""
        raise NotImplementedError

    def call(self, ctx, kind: str, impl: str) -> Callable[[int], None]:
        """``call(i)``: call number ``i`` of a run, on input set ``i % count``."""
        raise NotImplementedError

    def release(self) -> None:
        """Free what the definition keeps between points (caches reused across points)."""

    # -- the table
    def extra_columns(self, point_rows: list[Row]) -> list[tuple[str, str]]:
        """(header, cell) pairs appended to a point's line of a multi-series table."""
        return []

    def report_columns(self, rows: list[Row]) -> list[tuple[str, Callable[[Row], str]]]:
        """Where ``report_split`` is set: the (header, cell of a measured row) pairs of each
        num_tokens and series of a report table holding ``rows``."""
        return [("µs", lambda r: f"{r.latency_us:.2f}")]

    @property
    def kind_names(self) -> tuple[str, ...]:
        return self.kinds or (self.name,)


class SlotsBench(OpBench):
    """An op whose points write ``num_tokens`` rows through a slot pattern (the point's
    ``slots``) into a cache of ``num_blocks`` blocks of ``block_size``: a point whose pattern
    does not fit that cache is not run."""

    has_slots = True

    def skip_reason(self, point) -> str | None:
        return point.slots.fit_reason(point.num_tokens, point.num_blocks, point.block_size)


# --- configuration ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    implementations: list[str]
    baseline: str
    kinds: list[str]
    mode: str                # requested: cudagraph or no_graph
    timer: str               # device or host-sync
    hot_l2: bool
    graph_calls: int
    iters: int
    time_budget: float
    check: bool
    verbose: bool
    device: torch.device

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def measured_mode(self) -> str:
        """CUDA graphs need a GPU: on the CPU, cudagraph falls back to no_graph."""
        return "no_graph" if self.is_cpu else self.mode

    @property
    def timer_name(self) -> str:
        return "cpu" if self.is_cpu and self.timer == "device" else self.timer

    @property
    def l2_condition(self) -> str:
        if self.is_cpu:
            return "n/a"
        return "hot" if self.hot_l2 or self.timer == "host-sync" else "rotated"


@dataclasses.dataclass
class Env:
    device_name: str
    torch_version: str
    triton_version: str
    cuda_version: str
    kvwrite_version: str
    l2_bytes: int
    copy_bytes: int = 0
    copy_bw: float = math.nan       # bytes/s, read + written
    launch_floor: float = math.nan  # seconds per call of an empty kernel (timing.launch_floor)


def describe_env(device: torch.device) -> Env:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Env(name, torch.__version__, triton_version, torch.version.cuda or "", __version__,
               timing.l2_bytes(device))


def available_memory(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device`` (None where it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# --- the shared flags ------------------------------------------------------------------------------

def parse_list(text: str, flag: str, choices: Sequence[str] | None = None,
               convert: Callable[[str], object] | None = None) -> list:
    """A comma list (duplicates dropped); each item one of ``choices`` (case as given) and/or
    converted by ``convert`` (whose ValueError is reported naming ``flag``)."""
    raw = [x.strip() for x in str(text).split(",")]
    if not any(raw):
        raise ValueError(f"{flag}: expected a comma list, got {text!r}")
    if not all(raw):
        raise ValueError(f"{flag}: expected a comma list without empty items, got {text!r}")
    items = list(dict.fromkeys(raw))
    out = []
    for x in items:
        if choices is not None and x not in choices:
            raise ValueError(f"{flag}: expected a comma list of {', '.join(choices)}, got {x!r}")
        if convert is not None:
            try:
                x = convert(x)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(str(e) if str(e).startswith(flag)
                                 else f"{flag}: cannot take {x!r}: {e}") from None
        out.append(x)
    return out


def parse_device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda, cuda:N or cpu, got {text!r}")
    return dev


def positive(flag: str, value, *, zero: bool = False) -> None:
    """Raise naming ``flag`` unless ``value`` is a positive (or, with ``zero``, >= 0) number."""
    ok = value >= 0 if zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        what = "a non-negative" if zero else "a positive"
        raise ValueError(f"{flag}: expected {what} number, got {value}")


def parse_fp8_scales(text: str, flag: str = "--fp8-scales") -> tuple[float, float]:
    """``K,V`` (an fp8 cache's k_scale and v_scale) as two floats; ValueError naming ``flag``."""
    try:
        k, v = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected K,V (two numbers), got {text!r}") from None
    return k, v


def require_positive(args: argparse.Namespace, dests: Sequence[str]) -> None:
    """Raise ValueError naming the flag of the first of ``dests`` whose value is below 1."""
    for dest in dests:
        if getattr(args, dest) < 1:
            raise ValueError(f"--{dest.replace('_', '-')}: expected a positive integer, got "
                             f"{getattr(args, dest)}")


def add_cache_flags(g, *, block_size: int, num_blocks: int, dtype_help: str,
                    dtypes: Sequence[str] = BENCH_DTYPES) -> None:
    """The paged cache's shape flags of most ops, in this order: --block-size, --num-blocks and
    --dtype (the inputs' dtype, bfloat16 by default; ``dtype_help`` says which inputs)."""
    g.add_argument("--block-size", type=int, default=block_size,
                   help=f"(default: {block_size})")
    g.add_argument("--num-blocks", type=int, default=num_blocks, help=f"(default: {num_blocks})")
    g.add_argument("--dtype", choices=list(dtypes), default="bfloat16",
                   help=f"{dtype_help} (default: bfloat16)")


def slots_line(pattern: SlotPattern, points: list, num_blocks: int, block_size: int, *,
               grown: bool = False) -> str:
    """The header's line that says which slots the largest point's tokens write, in a cache of
    ``num_blocks`` (``grown``: as :meth:`SlotPattern.cache_blocks` raises it at that T)."""
    top = max(p.num_tokens for p in points)
    if grown:
        num_blocks = pattern.cache_blocks(top, block_size, num_blocks)
    return "slots: " + pattern.explain(top, num_blocks, block_size)


def slot_params(pattern: SlotPattern) -> dict:
    """A row's slot-pattern params (the last of an op's :meth:`OpBench.params`, in this order)."""
    return dict(slots=pattern.kind, slot_params=pattern.describe(),
                pad_fraction=pattern.pad_fraction)


@contextlib.contextmanager
def skip_unless_fits():
    """Around building a point's input sets: the ValueError of a slot pattern that does not fit
    the cache becomes :class:`Skip` (the row says why)."""
    try:
        yield
    except ValueError as e:
        raise Skip(str(e)) from None


def add_slot_flags(parser: argparse.ArgumentParser) -> None:
    """The slot-pattern flags as one group (ops whose benchmark has slots)."""
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
                   help="mixed: the fraction of the tokens that are decode tokens (default: 0.5)")
    g.add_argument("--decode-tokens", type=int, default=None,
                   help="mixed: this many decode tokens (at most T) instead of "
                        "--decode-fraction: the running batch of a serving step")


# The slot flags each pattern reads (--pad-fraction: every pattern); one given for a pattern that
# does not read it is a usage error, never silently ignored.
SLOT_FLAGS = {"random": (), "decode": ("context_len",), "prefill": ("prefill_len",),
              "mixed": ("context_len", "decode_fraction", "decode_tokens")}


def slot_pattern(args: argparse.Namespace, max_position: int | None = None) -> SlotPattern:
    """The :class:`SlotPattern` of :func:`add_slot_flags`'s flags (ValueError names a bad one, a
    flag the pattern does not read, or --decode-tokens given with --decode-fraction)."""
    given = getattr(args, "explicit", set())
    for dest in ("context_len", "prefill_len", "decode_fraction", "decode_tokens"):
        if dest in given and dest not in SLOT_FLAGS[args.slots]:
            users = [k for k, v in SLOT_FLAGS.items() if dest in v]
            raise ValueError(f"--{dest.replace('_', '-')}: only read with --slots "
                             f"{' or '.join(users)}, got --slots {args.slots}")
    if {"decode_fraction", "decode_tokens"} <= given:
        raise ValueError("--decode-tokens: sets the decode tokens --decode-fraction would; give "
                         "one of them")
    return SlotPattern(args.slots, pad_fraction=args.pad_fraction, context_len=args.context_len,
                       prefill_len=args.prefill_len, decode_fraction=args.decode_fraction,
                       decode_tokens=args.decode_tokens, max_position=max_position)


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags ``argv`` gives (argparse leaves a namespace's attributes that are
    already set alone unless a flag sets them)."""
    unset = object()
    ns = argparse.Namespace(**{a.dest: unset for a in parser._actions
                               if a.dest != argparse.SUPPRESS})
    parser.parse_args(argv, namespace=ns)
    return {dest for dest, value in vars(ns).items() if value is not unset}


def normalize_flags(argv: list[str]) -> list[str]:
    """vLLM's parsers accept --num_heads for --num-heads: so does every subcommand."""
    out = []
    for a in argv:
        if a.startswith("--") and not a.startswith("---"):
            flag, eq, value = a.partition("=")
            a = flag.replace("_", "-") + eq + value
        out.append(a)
    return out


def launch_line(no_pdl: bool, device: torch.device) -> str:
    """Applies ``--no-pdl`` and returns the header line that says how the cuda and Triton kernels
    launch on ``device``."""
    from ..kernels import nvrtc

    if no_pdl:
        nvrtc.use_pdl(False)
    if not nvrtc.pdl_on():
        return "launch: programmatic dependent launch off"
    if device.type != "cuda":
        return "launch: plain (not a CUDA device)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] < 9:
        return "launch: plain (programmatic dependent launch needs compute capability 9.0)"
    return ("launch: programmatic dependent launch of the cuda and Triton kernels (each call "
            "scheduled while the kernel before it runs, waiting for it before any load; --no-pdl "
            "turns it off)")


def check_output_path(flag: str, path: str) -> None:
    """Raise ValueError (naming ``flag``) unless ``path`` can really be written: it is created
    (then removed again) or, if it exists, opened for appending. Checked before the sweep."""
    if os.path.isdir(path):
        raise ValueError(f"{flag}: expected a file path, got the folder {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: the folder {folder!r} of {path!r} does not exist (create it "
                         f"first)")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: {path!r} cannot be written ({e.strerror or e})") from None
    if not existed:
        os.remove(path)


def check_plot_format(flag: str, path: str) -> None:
    """matplotlib must be installed and write ``path``'s format (from its suffix)."""
    from .plot import pyplot
    plt = pyplot()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if ext not in formats:
        raise ValueError(f"{flag}: expected a file name ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (the formats matplotlib "
                         f"writes), got {path!r}")


def build_parser(defn: OpBench, prog: str) -> Parser:
    """The subcommand's parser: the op's own flags, then the engine's."""
    d = {**ENGINE_DEFAULTS, **defn.defaults}
    p = Parser(prog=prog, description=defn.description or defn.summary)
    defn.add_flags(p)
    g = p.add_argument_group("the benchmark engine's flags (every subcommand)")
    g.add_argument("--num-tokens", nargs="+", default=[d["num_tokens"]], metavar="N",
                   help=f"token counts: a list 1,2,64 (or 1 2 64) or a range LO:HI of doublings "
                        f"(default: {d['num_tokens']})")
    g.add_argument("--implementation", default=d["implementation"],
                   help="a registered implementation (cuda, triton, torch, ...), a comma list, "
                        f"or 'all' (those that can run here) (default: {d['implementation']}; "
                        "torch on the CPU)")
    g.add_argument("--baseline", default=None,
                   help="the implementation speedups are relative to (default: the first)")
    if len(defn.kind_names) > 1:
        g.add_argument("--kinds", default=",".join(defn.defaults.get("kinds", defn.kind_names)),
                       help=f"comma list of what to time at each point: "
                            f"{', '.join(defn.kind_names)} (default: %(default)s)")
    g.add_argument("--mode", choices=["cudagraph", "no_graph"], default="cudagraph",
                   help="cudagraph (default): the timed calls are replays of one CUDA graph; "
                        "no_graph: eager calls, launch cost included")
    g.add_argument("--no-graph", action="store_true",
                   help="the same as --mode no_graph")
    g.add_argument("--timer", choices=["device", "host-sync"], default="device",
                   help="device (default): CUDA events around --graph-calls calls, median per "
                        "call; host-sync: vLLM's host clock with a synchronize after each call "
                        "(same inputs every call)")
    g.add_argument("--hot-l2", action="store_true",
                   help="the same inputs every call (vLLM's condition) instead of rotating input "
                        "sets past twice the L2 (flushed before each run when fewer)")
    g.add_argument("--graph-calls", type=int, default=d["graph_calls"],
                   help=f"calls per CUDA graph (or per eager run) (default: {d['graph_calls']})")
    g.add_argument("--iters", type=int, default=d["iters"],
                   help=f"timed samples at most: replays (device timer) or calls (host-sync) "
                        f"(default: {d['iters']})")
    g.add_argument("--time-budget", type=float, default=d["time_budget"], metavar="SECONDS",
                   help=f"timed seconds per point and series after which sampling stops (at "
                        f"least {timing.MIN_SAMPLES} samples) (default: {d['time_budget']})")
    g.add_argument("--warmup", type=int, default=None,
                   help="accepted for vLLM's scripts; the timers warm up by themselves")
    g.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the check against the torch reference before timing")
    g.add_argument("--device", default="cuda",
                   help="cuda (default), cuda:N, or cpu (the torch implementation, host timings, "
                        "a small default shape)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for PyTorch's CPU kernels (torch.set_num_threads); CPU "
                        "timings depend on it more than on anything else (default: PyTorch's, "
                        "as OMP_NUM_THREADS sets it; the header says the count)")
    g.add_argument("--version", action="version", version=f"kvwrite-bench {__version__}",
                   help="print kvwrite-bench's version and exit")
    g.add_argument("--verbose", action="store_true",
                   help="add spread, bandwidth and status columns to the table")
    g.add_argument("--json", metavar="PATH", help="write {meta, rows} as JSON")
    g.add_argument("--csv", metavar="PATH", help="write one line per measurement as CSV")
    g.add_argument("--plot", metavar="PATH.png",
                   help="plot latency and GB/s against num_tokens (needs matplotlib)")
    g.add_argument("--no-pdl", action="store_true",
                   help="launch the cuda and Triton kernels without programmatic dependent launch "
                        "(on by default on compute capability 9.0 and later; KVWRITE_PDL=0 does "
                        "the same)")
    if defn.has_model:
        g.add_argument("--model", type=str.lower, choices=list(MODELS), default=None,
                       help="the model's KV heads and head size (and, with --slots decode, "
                            "prefill or mixed, its serving shape); flags given win")
        if defn.tp_flag:
            g.add_argument("--tp", type=int, default=1,
                           help="tensor-parallel degree: divides the KV heads (default: 1)")
    if defn.has_slots:
        add_slot_flags(p)
    return p


def check_gpu(device: torch.device) -> None:
    """Raise :class:`BenchError` where ``device`` is a CUDA device and PyTorch sees no GPU."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is "
                         "False); pass --device cpu to run the torch implementation on the CPU")


def _implementations(text: str, device: torch.device, defn: OpBench, mode: str
                     ) -> tuple[list[str], list[str]]:
    """(names, what 'all' left out and why)."""
    infos = registry.all_impls(defn.op)
    known = [i.name for i in infos]
    if text == "all":
        names, left = [], []
        for i in infos:
            reasons = [r for op in {o for k in defn.kind_names for o in defn.kind_ops(k)}
                       if (r := registry.get(op, i.name).available(device)) is not None]
            if not reasons and mode == "cudagraph" and device.type == "cuda" and not i.graph_safe:
                reasons = ["not CUDA-graph safe (it syncs with the host); time it with "
                           "--mode no_graph"]
            if reasons:
                left.append(f"{i.name}: {reasons[0]}")
            else:
                names.append(i.name)
        if not names:
            check_gpu(device)  # without a GPU, that one line, not every implementation's reason
            raise BenchError(f"--implementation all: nothing can run on {device}: "
                             + "; ".join(left))
        return names, left
    try:
        return parse_list(text, "--implementation", known), []
    except ValueError as e:
        raise ValueError(f"{e} (or 'all': those that can run here)") from None


def configure(defn: OpBench, argv: list[str], prog: str
              ) -> tuple[Config, argparse.Namespace, list, list[str]]:
    """Parse and check every flag; (config, args, points, notes). Raises ValueError naming the
    flag (a usage error) or BenchError."""
    parser = build_parser(defn, prog)
    argv = normalize_flags(argv)
    args = parser.parse_args(argv)
    args.explicit = given_flags(parser, argv)
    args.argv = argv
    device = parse_device(args.device)
    args.num_tokens = " ".join(args.num_tokens)
    if device.type == "cpu":
        if "implementation" not in args.explicit:
            args.implementation = "torch"
        for dest, value in defn.cpu_defaults.items():
            if dest not in args.explicit:
                setattr(args, dest, value)
    if args.no_graph:
        if "mode" in args.explicit and args.mode != "no_graph":
            raise ValueError(f"--no-graph: means --mode no_graph, and --mode {args.mode} was "
                             f"given too")
        args.mode = "no_graph"
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads: expected a positive integer, got {args.threads}")
    require_positive(args, ("graph_calls", "iters"))
    positive("--time-budget", args.time_budget)
    defn.configure(args, device)
    args.token_counts = parse_num_tokens(str(args.num_tokens))
    kinds = list(defn.kind_names)
    if len(kinds) > 1:
        kinds = parse_list(args.kinds, "--kinds", defn.kind_names)
    outputs = {}
    for flag in ("json", "csv", "plot"):
        path = getattr(args, flag)
        if path:
            other = outputs.setdefault(os.path.realpath(path), flag)
            if other != flag:
                raise ValueError(f"--{flag}: {path!r} is also the --{other} file (one would "
                                 f"overwrite the other)")
    impls, left = _implementations(args.implementation, device, defn, args.mode)
    baseline = args.baseline or impls[0]
    if baseline not in impls:
        raise ValueError(f"--baseline: expected one of the implementations run "
                         f"({', '.join(impls)}), got {baseline!r}")
    points = defn.points(args)
    if not points:
        raise ValueError("nothing to measure: the flags give no point")
    # A point that cannot run with these flags (it does not fit the cache, a shape the op
    # refuses) is a usage error: refused here, before any work, never a NaN row after a sweep.
    for point in points:
        reason = defn.skip_reason(point)
        if reason is not None:
            raise ValueError(f"the point at num_tokens={point.num_tokens} cannot run: {reason}")
    for flag in ("json", "csv", "plot"):
        if getattr(args, flag):
            check_output_path(f"--{flag}", getattr(args, flag))
    if args.plot:
        check_plot_format("--plot", args.plot)
    cfg = Config(implementations=impls, baseline=baseline, kinds=kinds, mode=args.mode,
                 timer=args.timer, hot_l2=args.hot_l2, graph_calls=args.graph_calls,
                 iters=args.iters, time_budget=args.time_budget, check=args.check,
                 verbose=args.verbose, device=device)
    notes = [f"--implementation all leaves out {line}" for line in left]
    return cfg, args, points, notes


# --- memory ------------------------------------------------------------------------------------------

def rotation(defn: OpBench, cfg: Config, point, l2: int) -> tuple[int, dict[str, bool]]:
    """(input sets, {kind: flush the L2 before each timed run}): :func:`timing.l2_rotation` for
    the kind that touches the fewest bytes of a set, at most one set per call of the timed graph
    (call ``i`` takes set ``i % sets``); a kind whose sets together stay under twice the L2 is
    flushed."""
    hot = cfg.l2_condition != "rotated"
    per = {k: defn.set_bytes(point, k) for k in cfg.kinds}
    sets, _ = timing.l2_rotation(hot, min(per.values()), l2, cfg.graph_calls)
    return sets, {k: not hot and sets * b < 2 * l2 for k, b in per.items()}


def _point_need(defn: OpBench, cfg: Config, point, l2: int) -> tuple[int, int]:
    """(state bytes, other bytes) a point needs on the device."""
    sets, flush = rotation(defn, cfg, point, l2)
    extra = sets * max(defn.set_bytes(point, k) for k in cfg.kinds) + defn.temp_bytes(point)
    extra += 2 * l2 if any(flush.values()) else 0
    return defn.state_bytes(point), extra


def plan_memory(defn: OpBench, cfg: Config, points: list, free: int | None, where: str,
                l2: int) -> None:
    """Raise :class:`BenchError` (naming the largest ``--num-blocks`` that fits, where the op's
    state is sized by it) if a point does not fit."""
    if free is None:
        return
    needs = [(p, *_point_need(defn, cfg, p, l2)) for p in points if not defn.skip_reason(p)]
    misfit = next(((p, st, ex) for p, st, ex in needs if st + ex + MARGIN_BYTES > free), None)
    if misfit is None:
        return
    p, state, extra = misfit
    msg = (f"the point at num_tokens={p.num_tokens} does not fit on {where}: it needs "
           f"{state / GiB:.2f} GiB for the caches plus {(extra + MARGIN_BYTES) / GiB:.2f} GiB for "
           f"inputs, checks and headroom, and {free / GiB:.2f} GiB is free. ")
    blocks = [(defn.block_bytes(q), ex) for q, _, ex in needs]
    if all(b for b, _ in blocks):
        largest = max(0, min((free - ex - MARGIN_BYTES) // b for b, ex in blocks))
        msg += (f"The largest --num-blocks that fits is {largest}." if largest else
                "No --num-blocks fits: lower --num-tokens or the shape, or free device memory.")
    else:
        msg += "Lower --num-tokens or the shape."
    raise BenchError(msg)


# --- the sweep ---------------------------------------------------------------------------------------

def _row(defn: OpBench, cfg: Config, env: Env, point, kind: str, impl: str, **fields) -> Row:
    base = dict(op=defn.name, kind=kind, implementation=impl, num_tokens=point.num_tokens,
                params=defn.params(point), timer=cfg.timer_name, mode=cfg.measured_mode,
                l2=cfg.l2_condition, bytes=defn.bytes(point, kind), copy_bw_gbps=env.copy_bw / 1e9,
                device=env.device_name, torch_version=env.torch_version,
                triton_version=env.triton_version, cuda_version=env.cuda_version,
                kvwrite_version=env.kvwrite_version)
    base.update(fields)
    return Row(**base)


def _cannot_run(defn: OpBench, cfg: Config, ctx, kind: str, impl: str) -> str | None:
    for op in defn.kind_ops(kind):
        info = registry.get(op, impl)
        reason = info.available(cfg.device)
        if reason is not None:
            return reason
        if cfg.measured_mode == "cudagraph" and not info.graph_safe:
            return (f"{impl} is not CUDA-graph safe (it syncs with the host); time it with "
                    "--mode no_graph")
    return defn.unsupported(ctx, kind, impl)


def _measure(defn: OpBench, cfg: Config, env: Env, point, ctx, kind: str, impl: str,
             sets: int, flush: torch.Tensor | None) -> Row:
    row = dict(rotation_sets=sets)
    reason = _cannot_run(defn, cfg, ctx, kind, impl)
    if reason is not None:
        return _row(defn, cfg, env, point, kind, impl, status=f"unsupported: {reason}", **row)
    try:
        if cfg.check:
            bad = defn.check(ctx, kind, impl)
            if bad is not None and bad is not UNCHECKED:
                return _row(defn, cfg, env, point, kind, impl, check="failed",
                            status=f"mismatch: {bad}", **row)
            if bad is None:
                row["check"] = "passed"
        call = defn.call(ctx, kind, impl)
        graph = cfg.measured_mode == "cudagraph"
        if cfg.timer == "host-sync":
            t = timing.time_host_sync(lambda: call(0), cfg.iters, graph=graph, device=cfg.device)
        elif cfg.is_cpu:
            t = timing.time_cpu(call, cfg.graph_calls, cfg.iters, cfg.time_budget)
        else:
            t = timing.time_device(call, cfg.graph_calls, cfg.iters, graph=graph, flush=flush,
                                   budget_s=cfg.time_budget)
    except OutOfMemoryError:
        raise
    except Exception as e:  # an implementation's failure marks its row; the sweep goes on
        return _row(defn, cfg, env, point, kind, impl,
                    status=f"error: {type(e).__name__}: {e}".splitlines()[0], **row)
    latency = t.mean if cfg.timer == "host-sync" else t.median
    nbytes = defn.bytes(point, kind)
    gbps = nbytes / t.median / 1e9
    return _row(defn, cfg, env, point, kind, impl, calls_per_sample=t.calls,
                samples=len(t.samples), latency_us=latency * 1e6, median_us=t.median * 1e6,
                p20_us=t.quantile(0.2) * 1e6, p80_us=t.quantile(0.8) * 1e6, mean_us=t.mean * 1e6,
                gbps=gbps, pct_copy_bw=100 * gbps * 1e9 / env.copy_bw, **row)


def point_label(defn: OpBench, point) -> str:
    params = defn.params(point)
    shown = [f"{params[k]}" for k, _ in defn.columns if k in params
             and k not in ("slots", "slot_params")]
    return " ".join(shown + [f"T={point.num_tokens}"])


def measure_env(cfg: Config, progress: Callable[[str], None]) -> Env:
    env = describe_env(cfg.device)
    env.copy_bytes = CPU_COPY_BYTES if cfg.is_cpu else COPY_BYTES
    free = available_memory(cfg.device)
    if free is not None:
        env.copy_bytes = max(2**20, min(env.copy_bytes, free // 8))
    progress(f"measuring the copy bandwidth ({env.copy_bytes / 2**20:.0f} MiB copies)")
    env.copy_bw = timing.copy_bandwidth(cfg.device, env.copy_bytes)
    floor = timing.launch_floor(cfg.device)
    env.launch_floor = math.nan if floor is None else floor
    return env


def sweep(defn: OpBench, cfg: Config, points: list,
          progress: Callable[[str], None] = lambda s: None) -> tuple[list[Row], Env]:
    """Every (point, kind, implementation), in that order, as rows; raises :class:`Interrupted`
    (with the rows so far) on Ctrl-C and :class:`BenchError` where memory runs out."""
    env = describe_env(cfg.device)
    free = available_memory(cfg.device)
    # Before the copy bandwidth is measured: a run that cannot fit stops at once.
    plan_memory(defn, cfg, points, free, f"{cfg.device} ({env.device_name})", env.l2_bytes)
    env = measure_env(cfg, progress)
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    rows: list[Row] = []
    try:
        _sweep(defn, cfg, env, points, progress, rows)
        return rows, env
    except KeyboardInterrupt:
        raise Interrupted(rows, env) from None
    except OutOfMemoryError as e:
        message = str(e).splitlines()[0]
    finally:
        defn.release()
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    raise BenchError(f"out of device memory on {env.device_name} ({message}); lower "
                     f"--num-tokens, --num-blocks or the shape")


def _sweep(defn: OpBench, cfg: Config, env: Env, points: list,
           progress: Callable[[str], None], rows: list[Row]) -> None:
    """Append each measurement to ``rows`` as it is made (kept when the sweep is interrupted)."""
    series = [(k, i) for k in cfg.kinds for i in cfg.implementations]
    total = len(points) * len(series)
    start = time.monotonic()
    flush_buf = None
    for point in points:
        label = point_label(defn, point)
        skip = defn.skip_reason(point)
        count, flush = rotation(defn, cfg, point, env.l2_bytes)
        ctx = None
        failed = None
        if skip is None:
            try:
                ctx = defn.prepare(point, count, cfg.device)
            except Skip as e:
                skip = str(e)
            except OutOfMemoryError:
                raise
            except Exception as e:  # the point cannot be built: its rows say why, the run fails
                failed = f"error: {type(e).__name__}: {e}".splitlines()[0]
        if skip is not None or failed is not None:
            status = failed or f"skipped: {skip}"
            rows += [_row(defn, cfg, env, point, k, i, status=status) for k, i in series]
            progress(f"{label}: {status}")
            continue
        if any(flush.values()) and flush_buf is None:
            flush_buf = torch.empty(2 * env.l2_bytes, dtype=torch.uint8, device=cfg.device)
        for kind, impl in series:
            row = _measure(defn, cfg, env, point, ctx, kind, impl, count,
                           flush_buf if flush[kind] else None)
            rows.append(row)
            name = f"{kind}:{impl}" if len(cfg.kinds) > 1 else impl
            done = f"[{len(rows)}/{total}] {label} {name}: "
            progress(done + (f"{row.latency_us:.3f} µs, {row.gbps:.1f} GB/s" if row.ok
                             else row.status) + eta(time.monotonic() - start, len(rows), total))
        del ctx


def eta(elapsed: float, done: int, total: int) -> str:
    """The progress lines' estimate of the time left: the mean time per measurement so far
    times the measurements left (", ETA 1:05"; empty when done or nothing is done yet)."""
    if done < 1 or done >= total:
        return ""
    left = round(elapsed / done * (total - done))
    h, rest = divmod(left, 3600)
    return f", ETA {h}:{rest // 60:02d}:{rest % 60:02d}" if h else f", ETA {left // 60}:{left % 60:02d}"


def compare_with_reference(run, reference, outputs: dict[str, torch.Tensor],
                           nan_dtypes: dict[str, torch.dtype] | None = None) -> str | None:
    """The check of ops whose outputs are small enough to copy: ``run(outs)`` and
    ``reference(outs)`` each write into their own copies of ``outputs`` ({name: tensor}); None
    when every copy's whole allocation holds the same bytes, else the first difference.
    ``nan_dtypes``: as :func:`kvwrite.testing.sanitize.compare_outputs`."""
    from ..testing.sanitize import compare_outputs

    got = {k: v.clone() for k, v in outputs.items()}
    want = {k: v.clone() for k, v in outputs.items()}
    run(got)
    reference(want)
    return compare_outputs(got, want, nan_dtypes)


# --- rendering ---------------------------------------------------------------------------------------

def _us(x: float) -> str:
    # vLLM prints f"{seconds * 1e6:.3f}" and tabulate re-reads it as a number.
    return f"{x:.3f}"


def _point_key(r: Row) -> tuple:
    return (r.num_tokens, tuple(sorted((k, str(v)) for k, v in r.params.items())))


def table(defn: OpBench, rows: Sequence[Row], cfg: Config) -> str:
    """The console table: one line per point; one latency column (vLLM's three columns for one
    series) or one per series, with speedups over the baseline and the op's extra columns."""
    points: dict[tuple, list[Row]] = {}
    for r in rows:
        points.setdefault(_point_key(r), []).append(r)
    firsts = [pr[0] for pr in points.values()]
    varying = {k for k, _ in defn.columns
               if len({str(getattr(r, k, "")) for r in firsts}) > 1}
    cols = [(k, h) for k, h in defn.columns if k in varying or k in defn.always_columns]
    multi_kind = len(cfg.kinds) > 1
    labels = list(dict.fromkeys(series_label(r, multi_kind) for r in rows))
    headers = [h for _, h in cols]
    single = len(labels) == 1
    if single:
        headers += ["latency (µs)"]
        if cfg.verbose:
            headers += ["p20 (µs)", "p80 (µs)", "GB/s", "% copy BW", "status"]
    else:
        headers += [f"{s} (µs)" for s in labels]
        others = [i for i in cfg.implementations if i != cfg.baseline]
        vs = not multi_kind and others
        if vs:
            headers += [f"{i} vs {cfg.baseline}" for i in others]
        extra_headers = None
        if cfg.verbose:
            headers += [f"{s} % copy BW" for s in labels]
    body = []
    single_extra: list[str] = []
    for pr in points.values():
        r0 = pr[0]
        line = [getattr(r0, k) for k, _ in cols]
        if single:
            line.append(_us(r0.latency_us))
            if cfg.verbose:
                line += [_us(r0.p20_us), _us(r0.p80_us), f"{r0.gbps:.1f}",
                         f"{r0.pct_copy_bw:.1f}", r0.status.split(":")[0]]
            extra = defn.extra_columns(pr)  # an op's columns (none for most ops' one series)
            if extra and not single_extra:
                single_extra = [h for h, _ in extra]
            line += [c for _, c in extra]
        else:
            by = {series_label(r, multi_kind): r for r in pr}
            lat = {s: by[s].latency_us if s in by else math.nan for s in labels}
            line += [_us(lat[s]) for s in labels]
            if vs:
                line += [f"{lat[cfg.baseline] / lat[i]:.2f}" for i in others]
            extra = defn.extra_columns(pr)
            if extra_headers is None:
                extra_headers = [h for h, _ in extra]
            line += [c for _, c in extra]
            if cfg.verbose:
                line += [f"{by[s].pct_copy_bw:.1f}" if s in by else "nan" for s in labels]
        body.append(line)
    if single and single_extra:
        headers += single_extra
    if not single and extra_headers:
        at = len(cols) + len(labels) + (len(others) if vs else 0)
        headers[at:at] = extra_headers
    return format_table(headers, body)


def notes(rows: Sequence[Row], multi_kind: bool) -> list[str]:
    """One line per (series, reason) for every row that was not measured, with its points."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if not r.ok:
            where = " ".join(str(v) for k, v in r.params.items() if k in ("layout",))
            groups.setdefault((f"{series_label(r, multi_kind)} {where}".strip(), r.status),
                              []).append(r.num_tokens)
    out = []
    for (who, status), ts in groups.items():
        v = sorted(set(ts))
        tokens = ", ".join(map(str, v)) if len(v) <= 4 else f"{v[0]}..{v[-1]} ({len(v)} points)"
        out.append(f"{who} num_tokens {tokens}: {status}")
    return out


def header_lines(defn: OpBench, cfg: Config, env: Env, args, points: list) -> list[str]:
    """What was measured, how, and on what."""
    calls = cfg.graph_calls

    def over(unit: str) -> str:
        return (f"up to {cfg.iters} {unit} (fewer past {cfg.time_budget:g} s per point, at least "
                f"{min(cfg.iters, timing.MIN_SAMPLES)})")
    lines = [f"kvwrite-bench {env.kvwrite_version} on {env.device_name} | torch "
             f"{env.torch_version}, triton {env.triton_version or '-'}, CUDA "
             f"{env.cuda_version or '-'}"]
    lines += defn.header(args, points)
    if cfg.timer == "host-sync":
        what = ("each replay of a CUDA graph of 1 call" if cfg.measured_mode == "cudagraph"
                else "each call")
        lines.append(f"timer: host-sync (vLLM's method): host clock around {what}, with a "
                     f"synchronize after it; latency = mean of {cfg.iters} calls")
    elif cfg.is_cpu:
        lines.append(f"CPU timings: host clock (time.perf_counter) around runs of {calls} calls; "
                     f"latency = median per call over {over('runs')}")
    if cfg.is_cpu:
        lines.append(f"CPU threads: {torch.get_num_threads()} (PyTorch's CPU kernels; --threads "
                     f"sets them, CPU timings depend on them)")
    elif cfg.measured_mode == "cudagraph":
        lines.append(f"timer: device: CUDA events around replays of one CUDA graph of {calls} "
                     f"calls; latency = median per call over {over('replays')}")
    else:
        lines.append(f"timer: device: CUDA events around {calls} back-to-back eager calls (launch "
                     f"cost included); latency = median per call over {over('runs')}")
    if cfg.is_cpu and cfg.mode == "cudagraph":
        lines.append("note: cudagraph mode needs a CUDA device; measured no_graph on the CPU")
    l2_mib = env.l2_bytes / 2**20
    if cfg.l2_condition == "rotated":
        lines.append(f"L2: rotated: the calls of a run rotate over input sets that together "
                     f"exceed 2x the {l2_mib:.0f} MiB L2 (up to {calls} sets; when {calls} are "
                     f"smaller, L2 is flushed before each run)")
    elif cfg.l2_condition == "hot":
        lines.append("L2: hot: the same inputs every call, as vLLM measures")
    else:
        lines.append("L2: not controlled on the CPU")
    lines.append(f"copy bandwidth: {env.copy_bw / 1e9:.0f} GB/s (copies of "
                 f"{env.copy_bytes / 2**20:.0f} MiB, bytes read + written, median of 10)")
    if not cfg.is_cpu:
        lines.append(timing.floor_line(None if math.isnan(env.launch_floor)
                                       else env.launch_floor))
    lines.append("check: each implementation against the torch reference at each point, before "
                 "timing" if cfg.check else "check: off (--no-check)")
    return lines


def render(defn: OpBench, cfg: Config, env: Env, args, points: list, rows: list[Row],
           launch: str, prog: str) -> tuple[str, dict]:
    """(the printed text, the JSON meta)."""
    header = header_lines(defn, cfg, env, args, points) + [launch]
    lines = ["# " + h for h in header]
    title = defn.title(args, cfg)
    if title:
        lines.append(title)
    lines.append(table(defn, rows, cfg))
    if len(cfg.implementations) > 1 and len(cfg.kinds) == 1:
        lines.append(f"speedup = {cfg.baseline} latency / the implementation's latency")
    nts = notes(rows, len(cfg.kinds) > 1)
    if nts:
        lines.append("notes (NaN rows):")
        lines += [f"  {n}" for n in nts]
    command = " ".join([prog, shlex.join(args.argv)]) if args.argv else prog
    meta = {
        "op": defn.name, "command": command, "argv": args.argv,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(cfg.device), "device_name": env.device_name,
        "torch_version": env.torch_version, "triton_version": env.triton_version,
        "cuda_version": env.cuda_version, "kvwrite_version": env.kvwrite_version,
        "l2_bytes": env.l2_bytes, "copy_bw_gbps": env.copy_bw / 1e9, "copy_bytes": env.copy_bytes,
        "launch_floor_us": None if math.isnan(env.launch_floor) else env.launch_floor * 1e6,
        "implementations": cfg.implementations, "baseline": cfg.baseline, "kinds": cfg.kinds,
        "threads": torch.get_num_threads(),
        "header": header, "notes": nts,
    }
    return "\n".join(lines), meta


def write_outputs(args, rows: list[Row], meta: dict, title: str) -> None:
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.csv:
        report.write_csv(args.csv, rows, meta["command"])
    if args.plot:
        from .plot import plot_rows
        plot_rows(rows, args.plot, title)


def main(defn: OpBench, argv: list[str], prog: str) -> int:
    """The subcommand: configure, sweep, print, write; the exit status (module doc of cli)."""
    try:
        cfg, args, points, lead = configure(defn, argv, prog)
    except ValueError as e:  # a usage error, as argparse's own: one line, exit status 2
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    check_gpu(cfg.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    reasons = {i: _cannot_run_anywhere(defn, cfg, i) for i in cfg.implementations}
    if all(r is not None for r in reasons.values()):
        raise BenchError(f"nothing can run on {cfg.device}: "
                         + "; ".join(f"{n}: {r}" for n, r in reasons.items()))

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for line in lead:
        progress(line)
    launch = launch_line(args.no_pdl, cfg.device)
    try:
        rows, env = sweep(defn, cfg, points, progress)
        interrupted = False
    except Interrupted as e:
        rows, env, interrupted = e.rows, e.env, True
    except KeyboardInterrupt:
        rows, interrupted = [], True
    if interrupted and not rows:
        print(f"{prog}: interrupted (Ctrl-C) before any point was measured", file=sys.stderr)
        return 130
    text, meta = render(defn, cfg, env, args, points, rows, launch, prog)
    print(text, flush=True)
    shape = defn.header(args, points)[:1]
    write_outputs(args, rows, meta, " | ".join([defn.name, *shape, f"{cfg.timer_name} timer, "
                                                f"{cfg.measured_mode}, L2 {cfg.l2_condition}",
                                                env.device_name]))
    total = len(points) * len(cfg.kinds) * len(cfg.implementations)
    if interrupted:
        print(f"{prog}: interrupted (Ctrl-C) after {len(rows)} of {total} measurements; the "
              f"table above and the files written hold those", file=sys.stderr)
        return 130
    if any(r.status.startswith(("mismatch", "error")) for r in rows):
        return 1
    if not any(r.ok for r in rows):
        print(f"{prog}: nothing was measured: every point was unsupported or skipped (see the "
              f"notes above)", file=sys.stderr)
        return NOTHING_MEASURED
    return 0


def _cannot_run_anywhere(defn: OpBench, cfg: Config, impl: str) -> str | None:
    for kind in cfg.kinds:
        reasons = [registry.get(op, impl).available(cfg.device) for op in defn.kind_ops(kind)]
        if all(r is None for r in reasons):
            return None
    return next(r for r in reasons if r is not None)
