"""``probe l2-follow``: does a call leave the L2 worse for the kernel that runs after it? (A check
of cache hints: input lines kept in L2 at high priority would crowd out the next kernel's
working set.)

For each column, three CUDA graphs of 20 back-to-back items: the call alone, a follower alone
(``--reps`` copies between two buffers of ``--follower-mib`` MiB each, which stay in L2), and
call + follower. The follower's time after the call is (pair - call); against the follower
alone it shows what the call did to the L2. Hot inputs (set 0 of the benchmark's recipe).

    python -m tools.probes l2-follow --impls triton --set "triton.evict_first_max_bytes=-1|0x10000000000"
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kvwrite.bench import report
from kvwrite.bench.engine import Parser
from kvwrite.bench.workload import LAYOUTS
from kvwrite.dtypes import parse_kv_cache_dtype

from . import common

__all__ = ["parse_point", "build_parser", "main"]


def parse_point(text: str) -> tuple[int, str, str, int]:
    """``"8-HND-fp8-65536"`` -> (8, "HND", "fp8", 65536)."""
    parts = text.split("-")
    ok = (len(parts) == 4 and parts[0].isdigit() and int(parts[0]) > 0 and parts[3].isdigit()
          and int(parts[3]) > 0 and parts[1] in LAYOUTS)
    if ok:
        try:
            parse_kv_cache_dtype(parts[2])
        except ValueError:
            ok = False
    if not ok:
        raise common.ProbeError(f"--points: expected H-LAYOUT-KV-T items such as 8-HND-fp8-65536 "
                                f"(LAYOUT one of {', '.join(LAYOUTS)}), got {text!r}")
    h, layout, kv, t = int(parts[0]), parts[1], parts[2], int(parts[3])
    return h, layout, kv, t


@dataclasses.dataclass
class FollowRow:
    column: str
    point: str
    call_us: float
    follower_after_us: float
    follower_alone_us: float
    ratio: float
    device: str


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = Parser(
        prog=prog, description="Time a follower kernel (L2-resident copies) right after a call, "
                               "against the follower alone: what the call left in the L2.")
    p.add_argument("--impls", default="triton,cuda",
                   help="comma list of implementations (default: triton,cuda)")
    p.add_argument("--set", action="append", default=[], metavar="IMPL.FIELD=V1|V2",
                   help="tuning variants, as for `probe variants`")
    p.add_argument("--points", default="8-HND-fp8-65536,128-NHD-auto-4096,128-HND-fp8-16384",
                   help="comma list of H-LAYOUT-KV-T (head size 128)")
    p.add_argument("--follower-mib", type=int, default=16,
                   help="size of each of the follower's two buffers (default: 16)")
    p.add_argument("--reps", type=int, default=2, help="copies per follower (default: 2)")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    p.add_argument("--blocks", type=int, default=8192, help="cache blocks (default: 8192)")
    p.add_argument("--json", default=None, metavar="PATH", help="write {meta, rows} as JSON")
    return p


def main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    impls = common.timed_impls(args.impls)
    vs = common.variants(args.set)
    points = [parse_point(x) for x in args.points.split(",") if x.strip()]
    if args.follower_mib < 1 or args.reps < 1:
        raise common.ProbeError("--follower-mib and --reps: expected positive integers")
    common.require_gpu()
    device = torch.cuda.get_device_name()
    a = torch.randn((args.follower_mib << 20) // 4, device="cuda")
    b = torch.empty_like(a)

    def follower():
        for _ in range(args.reps):
            b.copy_(a)

    alone = common.time_call(follower, args.replays)
    print(f"# {device}  follower: {args.reps} x copy of {args.follower_mib} MiB, alone "
          f"{alone * 1e6:.2f} us", flush=True)
    columns = list({v.tag(i): (i, v) for i in impls for v in vs}.items())
    lines, rows = [], []
    for h, layout, kv, t in points:
        shape = common.point_shape(h, 128, layout, kv, args.blocks)
        kc, vc = common.point_caches(shape)
        inp = common.point_sets(shape, t)[0]
        run_args = inp.run_args(kc, vc, shape.cache_dtype)
        pt = f"{h}-{layout}-{kv}-{t}"
        for tag, (impl, v) in columns:
            call = common.impl_call(impl, run_args, v)

            def pair(call=call):
                call()
                follower()

            c = common.time_call(call, args.replays)
            p = common.time_call(pair, args.replays)
            rows.append(FollowRow(tag, pt, c * 1e6, (p - c) * 1e6, alone * 1e6, (p - c) / alone,
                                  device))
            lines.append([tag, pt, f"{c * 1e6:.2f}", f"{(p - c) * 1e6:.2f}",
                          f"{(p - c) / alone:.2f}"])
            print("  " + " ".join(lines[-1]), flush=True)
        del kc, vc, inp, run_args
        torch.cuda.empty_cache()
    print(report.format_table(["column", "point", "call us", "follower after us", "ratio"],
                              lines), flush=True)
    if args.json:
        report.write_json(args.json, rows, {"probe": "l2-follow", "argv": argv,
                                            "device_name": device})
    return 0
