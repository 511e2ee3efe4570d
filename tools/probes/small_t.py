"""``probe small-t``: where a latency-bound call's time goes.

Times, at small token counts, the implementations next to a minimal NVRTC kernel that does only
the unavoidable work (``kvw_small`` in kernels.cu: one slot load per thread, one 16-byte load of K
and of V, one store of each; for fp8 also the scales' loads and the division-free quotient), on
the same caches and slots. Cache layouts: NHD, HND, and HNDpad (HND with its head stride padded
by ``--pad`` elements: the same work at addresses that are not 4 KiB apart), to separate what the
kernels do from what the addresses cost. Each figure is the mean over ``--seeds`` input sets (set
i = slot set i of the benchmark's recipe) of the time per call (:func:`.common.time_call`), since
at these sizes the slots' addresses alone move a call by about 0.1-0.2 us. Head size 128,
bfloat16 input, K and V blocks interleaved in one allocation per cache.

    python -m tools.probes small-t --heads 8,128 --tokens 2,64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from kvwrite.bench import report
from kvwrite.bench.engine import Parser
from kvwrite.testing.compare import differing_bytes

from . import common

__all__ = ["D", "LAYOUTS", "strides", "kernel_name", "small_caches", "build_parser", "main"]

D = 128  # head size (bfloat16 input)
LAYOUTS = ("NHD", "HND", "HNDpad")
KV = ("auto", "fp8")


def strides(layout: str, num_heads: int, pad: int) -> tuple[int, int, int]:
    """(block, page, head) strides in elements of one cache (K and V blocks interleaved)."""
    bs = common.BLOCK_SIZE
    if layout == "NHD":
        return 2 * bs * num_heads * D, num_heads * D, D
    head = bs * D + (pad if layout == "HNDpad" else 0)
    return 2 * num_heads * head, D, head


def kernel_name(num_heads: int, layout: str, fp8: bool, pad: int) -> str:
    """The name expression of the minimal kernel for these caches."""
    b, p, hs = strides(layout, num_heads, pad)
    return f"kvw_small<{num_heads}, {int(fp8)}, {p}LL, {hs}LL, {b}LL>"


def small_caches(layout: str, num_heads: int, pad: int, num_blocks: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) ``[num_blocks, 16, H, D]`` views of one allocation with
    :func:`strides` (V's block follows K's)."""
    b, p, hs = strides(layout, num_heads, pad)
    storage = torch.empty(num_blocks * b, dtype=dtype, device="cuda")
    shape, st = (num_blocks, common.BLOCK_SIZE, num_heads, D), (b, p, hs, 1)
    return storage.as_strided(shape, st), storage.as_strided(shape, st, b // 2)


@dataclasses.dataclass
class SmallRow:
    column: str
    num_heads: int
    num_tokens: int
    layout: str
    kv_cache_dtype: str
    latency_us: float    # mean over the input sets
    seeds: int
    device: str


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = Parser(
        prog=prog, description="Small calls: the implementations next to a minimal kernel doing "
                               "only the unavoidable work, on the same caches and slots, mean "
                               "over several slot sets.")
    p.add_argument("--heads", default="8,128", help="comma list of KV head counts (default: 8,128)")
    p.add_argument("--tokens", default="2", help="comma list of token counts (default: 2)")
    p.add_argument("--layouts", default="NHD,HND,HNDpad",
                   help="comma list of NHD, HND, HNDpad (default: all three)")
    p.add_argument("--kv", default="auto,fp8", help="comma list of auto, fp8 (default: both)")
    p.add_argument("--pad", type=int, default=64,
                   help="extra head stride of HNDpad in elements, a multiple of 8 (default: 64)")
    p.add_argument("--seeds", type=int, default=5, help="input sets per point (default: 5)")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    p.add_argument("--blocks", type=int, default=8192, help="cache blocks (default: 8192)")
    p.add_argument("--impls", default="cuda,triton",
                   help="comma list of implementations (default: cuda,triton)")
    p.add_argument("--set", action="append", default=[], metavar="IMPL.FIELD=V1|V2",
                   help="tuning variants, as for `probe variants`: one line each")
    p.add_argument("--json", default=None, metavar="PATH", help="write {meta, rows} as JSON")
    return p


def main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    heads = common.int_list("--heads", args.heads)
    tokens = common.int_list("--tokens", args.tokens)
    layouts = common.str_list("--layouts", args.layouts, LAYOUTS)
    kvs = common.str_list("--kv", args.kv, KV)
    impls = common.timed_impls(args.impls)
    vs = common.variants(args.set)
    if args.pad < 0 or args.pad % 8:
        raise common.ProbeError(f"--pad: expected a non-negative multiple of 8, got {args.pad}")
    if args.seeds < 1:
        raise common.ProbeError(f"--seeds: expected a positive integer, got {args.seeds}")
    common.require_gpu()
    device = torch.cuda.get_device_name()
    floor = common.empty_kernel_floor()
    print(f"# {device}  empty kernel {floor * 1e6:.2f} us/call; mean over {args.seeds} slot "
          f"sets, us per call (hot L2)", flush=True)
    headers = ["H", "T", "layout", "kv", "min"] + impls + ["variant"]
    lines, rows = [], []
    for h in heads:
        for lo in layouts:
            for kv in kvs:
                shape = common.point_shape(h, D, "HND" if lo != "NHD" else "NHD", kv,
                                           args.blocks)
                kc, vc = small_caches(lo, h, args.pad, args.blocks, shape.cache_tensor_dtype)
                fp8 = shape.cache_dtype.is_fp8
                kern = common.kernel(kernel_name(h, lo, fp8, args.pad))
                for t in tokens:
                    res: dict[tuple, list[float]] = {}
                    for seed, inp in enumerate(common.point_sets(shape, t, args.seeds)):
                        minimal = common.launch(
                            kern, (-(-t * h * 16 // 128), 1), 128, inp.key.data_ptr(),
                            inp.value.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                            inp.slot_mapping.data_ptr(), inp.k_scale.data_ptr(),
                            inp.v_scale.data_ptr(), t)
                        if seed == 0:
                            _check_minimal(minimal, inp, kc, vc, shape, f"H={h} {lo} {kv}")
                        res.setdefault(("min",), []).append(common.time_call(minimal,
                                                                             args.replays))
                        run_args = inp.run_args(kc, vc, shape.cache_dtype)
                        for i, v in enumerate(vs):
                            for impl in impls:
                                call = common.impl_call(impl, run_args, v)
                                res.setdefault((i, impl), []).append(
                                    common.time_call(call, args.replays))
                    mean_min = statistics.mean(res[("min",)]) * 1e6
                    for i, v in enumerate(vs):
                        means = [statistics.mean(res[(i, k)]) * 1e6 for k in impls]
                        lines.append([h, t, lo, kv, f"{mean_min:.3f}",
                                      *(f"{m:.3f}" for m in means), v.label or "-"])
                        print("  " + " ".join(map(str, lines[-1])), flush=True)
                        rows += [SmallRow(v.tag(k), h, t, lo, kv, m, args.seeds, device)
                                 for k, m in zip(impls, means, strict=True)]
                    rows.append(SmallRow("min", h, t, lo, kv, mean_min, args.seeds, device))
                del kc, vc
                torch.cuda.empty_cache()
    print(report.format_table(headers, lines), flush=True)
    if args.json:
        report.write_json(args.json, rows, {"probe": "small-t", "argv": argv,
                                            "device_name": device})
    return 0


def _check_minimal(minimal, inp, kc, vc, shape, where: str) -> None:
    """The minimal kernel writes what the op writes (the torch reference) at these slots."""
    slots = inp.slot_mapping
    blk, pg = slots // common.BLOCK_SIZE, slots % common.BLOCK_SIZE
    minimal()
    got = [c[blk, pg].contiguous().view(torch.uint8) for c in (kc, vc)]
    common.impl_call("torch", inp.run_args(kc, vc, shape.cache_dtype))()
    want = [c[blk, pg].contiguous().view(torch.uint8) for c in (kc, vc)]
    if any(differing_bytes(g, w).any() for g, w in zip(got, want, strict=True)):
        raise common.ProbeError(f"the minimal kernel wrote other bytes than the torch reference "
                                f"at {where}")
