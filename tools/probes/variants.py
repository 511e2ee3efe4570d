"""``probe variants``: implementations and variants of their tuning at the performance issue's
points, in one process, against the copy bandwidth measured in the same run.

    python -m tools.probes variants --impls triton,cuda --set triton.tile_bytes=4096|8192

Per point and column: µs per call (:func:`.common.time_call`: 20 calls in one CUDA graph, median
of replays, hot L2) and the share of the copy bandwidth (bytes read + written,
``Case.bytes_moved``). Inputs: set 0 of the benchmark's recipe
(:func:`kvwrite.bench.workload.make_input_sets`), caches from ``make_caches``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import torch

from kvwrite import registry
from kvwrite.bench import report
from kvwrite.bench.engine import Parser
from kvwrite.bench.workload import LAYOUTS, Case, InputSet
from kvwrite.ops.reshape_and_cache_flash import OP

from . import common

__all__ = ["POINTS", "ProbeRow", "Column", "select_points", "measure", "build_parser", "main"]

# (H, D, layout, kv_cache_dtype, T): the points of the performance issue.
POINTS = [
    *[(128, 128, lo, kv, t) for lo in ("NHD", "HND", "packed") for kv in ("auto", "fp8")
      for t in (2, 4, 1024, 4096, 16384, 65536)],
    *[(8, 128, lo, kv, t) for lo in ("NHD", "HND", "packed") for kv in ("auto", "fp8")
      for t in (2, 64, 1024, 32768, 65536)],
]


@dataclasses.dataclass
class ProbeRow:
    """One column at one point (``--json`` rows)."""

    probe: str
    column: str              # implementation, with the variant's settings
    num_heads: int
    head_size: int
    layout: str
    kv_cache_dtype: str
    num_tokens: int
    latency_us: float        # NaN where the column cannot run the point
    pct_copy_bw: float
    copy_bw_gbps: float
    status: str              # ok, or why not
    device: str


@dataclasses.dataclass(frozen=True)
class Column:
    """One timed column: its label and how it builds a call at a point (or says why it cannot)."""

    label: str
    make: Callable[[Case, torch.Tensor, torch.Tensor, InputSet], Callable[[], None] | str]


def impl_column(impl: str, variant: common.Variant) -> Column:
    info = registry.get(OP, impl)

    def make(shape: Case, kc, vc, inp: InputSet):
        args = inp.run_args(kc, vc, shape.cache_dtype)
        reason = info.unsupported(inp.key, kc, shape.cache_dtype, args[6], args[7])
        return reason if reason is not None else common.impl_call(impl, args, variant)

    return Column(variant.tag(impl), make)


def select_points(tokens: str, filters: str) -> list[tuple[int, int, str, str, int]]:
    """The issue's points, or their shapes at ``tokens``; only labels (H-D-layout-kv-T)
    containing one of the comma-separated ``filters``."""
    points = POINTS
    if tokens:
        shapes = dict.fromkeys(p[:4] for p in POINTS)
        points = [(*sh, t) for sh in shapes for t in common.int_list("--tokens", tokens)]
    if filters:
        wanted = [f for f in filters.split(",") if f]
        points = [p for p in points if any(f in "-".join(map(str, p)) for f in wanted)]
    if not points:
        raise common.ProbeError(f"--filter: no point's label (H-D-layout-kv-T) contains any of "
                                f"{filters!r}")
    return points


def measure(probe: str, columns: list[Column], points, num_blocks: int, replays: int,
            scale: float | None, bw: float) -> list[ProbeRow]:
    """Time every column at every point; print one table line per point as it is measured."""
    device = torch.cuda.get_device_name()
    headers = ["H", "D", "layout", "kv", "T"] + [f"{c.label} µs" for c in columns] + [
        f"{c.label} %bw" for c in columns]
    rows: list[ProbeRow] = []
    lines = []
    caches_of: dict[tuple, tuple] = {}
    for h, d, layout, kv, t in points:
        shape = common.point_shape(h, d, layout, kv, num_blocks)
        if shape not in caches_of:
            caches_of.clear()
            torch.cuda.empty_cache()
            caches_of[shape] = common.point_caches(shape)
        kc, vc = caches_of[shape]
        inp = common.point_sets(shape, t, 1, scale)[0]
        nbytes = shape.bytes_moved(t)
        line = [h, d, layout, kv, t]
        pcts = []
        for col in columns:
            call = col.make(shape, kc, vc, inp)
            if isinstance(call, str):
                us = pct = math.nan
                status = f"unsupported: {call}"
            else:
                sec = common.time_call(call, replays)
                us, pct, status = sec * 1e6, 100 * nbytes / sec / bw, "ok"
            rows.append(ProbeRow(probe, col.label, h, d, layout, kv, t, us, pct, bw / 1e9,
                                 status, device))
            line.append(f"{us:.2f}")
            pcts.append(f"{pct:.1f}")
        lines.append(line + pcts)
        print(f"  {h}-{d}-{layout}-{kv}-{t}: " + " ".join(line[5:]), flush=True)
        del inp
    print(report.format_table(headers, lines), flush=True)
    return rows


def print_header(bw: float, floors: bool = True) -> None:
    line = (f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s (read+write); "
            f"us per call, {common.CALLS} calls in one CUDA graph, median of replays, hot L2")
    if floors:
        tfloor = common.empty_triton_floor()
        line += (f"; empty kernel {common.empty_kernel_floor() * 1e6:.2f} us/call (NVRTC), "
                 f"{tfloor * 1e6 if tfloor is not None else math.nan:.2f} (Triton)")
    print(line, flush=True)


def add_point_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--filter", default="",
                   help="only points whose label (H-D-layout-kv-T, e.g. 128-128-HND-fp8-4096) "
                        "contains one of these comma-separated strings")
    p.add_argument("--tokens", default="",
                   help="comma-separated token counts at each of the issue's shapes instead of "
                        "the issue's points")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    p.add_argument("--blocks", type=int, default=8192,
                   help="cache blocks of 16 slots (default: 8192; kvwrite-bench's: 65536)")
    p.add_argument("--scale", type=float, default=None,
                   help="fp8 scale of K and V (default: amax / 64, as the benchmark)")
    p.add_argument("--json", default=None, metavar="PATH", help="write {meta, rows} as JSON")


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = Parser(
        prog=prog, description="Time implementations and variants of their tuning (--set) at the "
                               "performance issue's points, with the copy bandwidth of this run.")
    p.add_argument("--impls", default="triton,cuda",
                   help=f"comma list of implementations (default: triton,cuda; layouts: "
                        f"{', '.join(LAYOUTS)})")
    p.add_argument("--set", action="append", default=[], metavar="IMPL.FIELD=V1|V2",
                   help="a tuning field and its alternatives, e.g. triton.tile_bytes=4096|8192 "
                        "(fields of CudaTuning / TritonTuning; repeatable: every combination)")
    add_point_arguments(p)
    return p


def write_json(path: str | None, probe: str, rows: list[ProbeRow], argv: list[str]) -> None:
    if path:
        report.write_json(path, rows, {"probe": probe, "argv": argv,
                                       "device_name": torch.cuda.get_device_name()})


def main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    impls = common.timed_impls(args.impls)
    vs = common.variants(args.set)
    points = select_points(args.tokens, args.filter)
    common.require_gpu()
    bw = common.copy_bandwidth()
    print_header(bw)
    # A variant that sets only another implementation's fields repeats a column: once each.
    columns = list({c.label: c for c in (impl_column(impl, v) for impl in impls
                                         for v in vs)}.values())
    rows = measure("variants", columns, points, args.blocks, args.replays, args.scale, bw)
    write_json(args.json, "variants", rows, argv)
    return 0
