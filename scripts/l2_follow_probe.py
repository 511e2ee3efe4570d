"""Does a call leave the L2 worse for the kernel that runs after it? (A check of cache hints:
input lines kept in L2 at high priority would crowd out the next kernel's working set.)

For each variant, three CUDA graphs of 20 back-to-back items: the call alone, a follower alone
(``--reps`` copies between two buffers of ``--follower-mib`` MiB each, which stay in L2), and
call + follower. The follower's time after the call is (pair - call); against the follower alone
it shows what the call did to the L2. Hot inputs, as scripts/perf_probe.py.

    PYTHONPATH=src python scripts/l2_follow_probe.py --impls triton \
        --set "triton._EVICT_FIRST_MAX_BYTES=0|1<<40"
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_probe import (  # noqa: E402
    apply_variant,
    op_call,
    parse_variants,
    point_inputs,
    time_graph,
    variant_label,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="triton,cuda")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--points", default="8-HND-fp8-65536,128-NHD-auto-4096,128-HND-fp8-16384",
                    help="comma-separated H-layout-kv-T")
    ap.add_argument("--follower-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()

    n = args.follower_mib << 20
    a = torch.randn(n // 4, device="cuda")
    b = torch.empty_like(a)

    def follower():
        for _ in range(args.reps):
            b.copy_(a)

    alone = time_graph(follower, args.replays)
    print(f"# {torch.cuda.get_device_name()}  follower: {args.reps} x copy of {args.follower_mib} "
          f"MiB, alone {alone * 1e6:.2f} us")
    print(f"{'variant':<48} {'point':<18} {'call us':>9} {'follower after':>15} {'ratio':>6}")
    for impl in args.impls.split(","):
        for variant in parse_variants(args.set):
            apply_variant(variant)
            tag = impl + (f"[{variant_label(variant)}]" if variant else "")
            for pt in args.points.split(","):
                h, lo, kv, t = pt.split("-")
                h, t = int(h), int(t)
                cdt = parse_kv_cache_dtype(kv)
                cache_dtype = torch.uint8 if cdt.is_fp8 else torch.bfloat16
                kc, vc = allocate_kv_cache(8192, 16, h, 128, cache_dtype, Layout(lo),
                                           KVAlloc.INTERLEAVED, "cuda")
                key, value, slots, ks, vs = point_inputs(t, h, 128, kc.shape[0] * 16)
                call = op_call(impl, key, value, kc, vc, slots, kv, ks, vs)

                def pair(call=call):
                    call()
                    follower()

                c = time_graph(call, args.replays)
                p = time_graph(pair, args.replays)
                print(f"{tag:<48} {pt:<18} {c * 1e6:>9.2f} {(p - c) * 1e6:>15.2f} "
                      f"{(p - c) / alone:>6.2f}", flush=True)
                del kc, vc, key, value


if __name__ == "__main__":
    main()
