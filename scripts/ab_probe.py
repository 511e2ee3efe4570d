"""A/B probe: an earlier revision's kernels next to the working tree's, in one process.

Loads ``cuda_impl.py``, ``triton_impl.py`` and ``reshape_and_cache.cu`` as they were at ``--base``
(a git revision) as separate modules, and times each implementation both ways on the same
caches, inputs and slots: 20 calls in one CUDA graph, CUDA events, median of replays (hot L2),
the mean over ``--seeds`` slot sets, the two versions alternating in order from one slot set to
the next. Before timing, each point checks that both versions write the same bytes. Small-T
differences of a few hundredths of a microsecond are visible this way, where separate runs move
by 0.1-0.2 us.

    PYTHONPATH=src python scripts/ab_probe.py --base HEAD~1 --impls cuda --heads 8 --tokens 2,64
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from kvwrite.bench.workload import layout_alloc
from kvwrite.dtypes import parse_kv_cache_dtype
from kvwrite.layouts import allocate_kv_cache
from kvwrite.ops.reshape_and_cache_flash import cuda_impl, triton_impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_probe import copy_bandwidth, point_inputs, time_graph  # noqa: E402

IMPLS = "src/kvwrite/impls"


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def base_modules(rev: str, tmp: str) -> dict:
    """{"cuda": module, "triton": module} of the implementations as they were at ``rev``."""
    mods = {}
    for impl in ("cuda", "triton"):
        path = os.path.join(tmp, f"{impl}_impl.py")
        with open(path, "w") as f:
            f.write(_git_show(rev, f"{IMPLS}/{impl}_impl.py"))
        spec = importlib.util.spec_from_file_location(f"kvwrite.impls.{impl}_impl_base", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[impl] = mod
    source = _git_show(rev, f"{IMPLS}/reshape_and_cache.cu")
    mods["cuda"].kernel_source = lambda: source
    return mods


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--impls", default="cuda,triton")
    ap.add_argument("--heads", default="8")
    ap.add_argument("--tokens", default="2,64")
    ap.add_argument("--layouts", default="NHD,HND,packed")
    ap.add_argument("--kv", default="fp8")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=65536,
                    help="cache blocks of 16 slots (kvwrite-bench's default: 65536)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:  # kept while Triton may read the sources
        run(args, base_modules(args.base, tmp))


def time_point(versions, h: int, t: int, kv: str, kc, vc, args) -> dict[str, float]:
    """Mean us per call of each version at one point; raises if they write different bytes."""
    cdt = parse_kv_cache_dtype(kv)
    times: dict[str, list[float]] = {name: [] for name, _ in versions}
    for seed in range(args.seeds):
        key, value, slots, ks, vs = point_inputs(t, h, kc.shape[-1], kc.shape[0] * 16, seed=seed)
        calls = {name: functools.partial(mod.run, key, value, kc, vc, slots, cdt, ks, vs)
                 for name, mod in versions}
        if seed == 0:  # every version writes the same bytes
            blk, pg = slots // 16, slots % 16
            written = []
            for call in calls.values():
                kc[blk, pg] = 0
                vc[blk, pg] = 0
                call()
                written.append((kc[blk, pg].clone(), vc[blk, pg].clone()))
            for name, (wk, wv) in zip(calls, written, strict=True):
                if not (torch.equal(wk, written[0][0]) and torch.equal(wv, written[0][1])):
                    raise SystemExit(f"{name} wrote other bytes than {versions[0][0]} at "
                                     f"H={h} T={t} {kv}")
        order = list(calls) if seed % 2 == 0 else list(calls)[::-1]
        for name in order:
            times[name].append(time_graph(calls[name], args.replays))
    return {name: statistics.mean(v) * 1e6 for name, v in times.items()}


def run(args, base: dict) -> None:
    new = {"cuda": cuda_impl, "triton": triton_impl}
    impls = args.impls.split(",")
    versions = [(f"{i}@{args.base}", base[i]) for i in impls] + [(i, new[i]) for i in impls]
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {copy_bandwidth() / 1e9:.0f} GB/s; "
          f"us per call, mean over {args.seeds} slot sets (hot L2), {args.blocks} blocks")
    print(f"{'H':>4} {'T':>6} {'layout':>7} {'kv':>5} " + " ".join(f"{n:>16}" for n, _ in versions))
    for h in (int(x) for x in args.heads.split(",")):
        for kv in args.kv.split(","):
            storage = torch.uint8 if parse_kv_cache_dtype(kv).is_fp8 else torch.bfloat16
            for lname in args.layouts.split(","):
                layout, alloc = layout_alloc(lname)
                caches = allocate_kv_cache(args.blocks, 16, h, 128, storage, layout, alloc, "cuda")
                for t in (int(x) for x in args.tokens.split(",")):
                    res = time_point(versions, h, t, kv, *caches, args)
                    print(f"{h:>4} {t:>6} {lname:>7} {kv:>5} "
                          + " ".join(f"{res[n]:>16.3f}" for n, _ in versions), flush=True)
                del caches
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
