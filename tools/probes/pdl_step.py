"""``probe pdl-step``: programmatic dependent launch in a serving-like step, on and off.

Each step, captured 20 to a CUDA graph with the same inputs every step (hot L2): a cuBLAS
``torch.mm`` writing the qkv rows ([T, 4096] x [4096, (Hq + 2H) * D] bfloat16), then
``fused_rope_and_reshape_cache_flash`` on them (GQA(32,8,128) by default, auto cache, NHD), then
a torch elementwise kernel reading the key cache. For each implementation and T it prints the
op back to back (the benchmarks' condition) and the op's share of a step (the step's time less
that of the same step without the op), without and with programmatic dependent launch
(kvwrite.kernels.nvrtc.use_pdl; it is left on afterwards, as by default).

    python -m tools.probes pdl-step [--tokens 1,16,256] [--impls cuda,triton] [--replays 50]
"""

from __future__ import annotations

import argparse

import torch

from kvwrite import fused_rope_and_reshape_cache_flash, registry
from kvwrite.bench import timing
from kvwrite.bench.engine import Parser
from kvwrite.kernels import nvrtc
from kvwrite.layouts import KVAlloc, Layout, allocate_kv_cache
from kvwrite.ops.fused_rope_and_reshape_cache_flash import OP
from kvwrite.testing.rope import cos_sin_table

from . import common

HQ, H, D, HIDDEN, BLOCKS, BLOCK_SIZE, MAX_POSITION = 32, 8, 128, 4096, 4096, 16, 8192


def _args(argv: list[str], prog: str) -> argparse.Namespace:
    p = Parser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,16,256", help="token counts (default: 1,16,256)")
    p.add_argument("--impls", default="cuda,triton", help="implementations (default: cuda,triton)")
    p.add_argument("--replays", type=int, default=50, help="timed graph replays (default: 50)")
    args = p.parse_args(argv)
    args.tokens = common.int_list("--tokens", args.tokens)
    if max(args.tokens) > BLOCKS * BLOCK_SIZE:
        raise common.ProbeError(f"--tokens: at most {BLOCKS * BLOCK_SIZE} (the cache's slots), "
                                f"got {max(args.tokens)}")
    args.impls = common.str_list("--impls", args.impls, ("cuda", "triton"))
    if args.replays < 1:
        raise common.ProbeError(f"--replays: expected a positive integer, got {args.replays}")
    return args


def main(argv: list[str], prog: str) -> int:
    args = _args(argv, prog)
    common.require_gpu()
    dev = torch.device("cuda")
    for name in args.impls:
        reason = registry.get(OP, name).available(dev)
        if reason is not None:
            raise common.ProbeError(f"--impls: {name} cannot run here: {reason}")
    gen = torch.Generator(device=dev).manual_seed(0)
    table = cos_sin_table(MAX_POSITION, D, torch.float32, device=dev)
    kc, vc = allocate_kv_cache(BLOCKS, BLOCK_SIZE, H, D, torch.bfloat16, Layout.NHD,
                               KVAlloc.INTERLEAVED, dev)
    kc.zero_()
    vc.zero_()
    width = (HQ + 2 * H) * D
    w = (torch.randn(HIDDEN, width, device=dev, generator=gen) * 0.01).to(torch.bfloat16)
    out = torch.empty(BLOCK_SIZE, H, D, device=dev, dtype=torch.bfloat16)
    capable = nvrtc.pdl_capable(torch.cuda.current_device()) if nvrtc.setup_reason() is None \
        else False
    print(f"# {torch.cuda.get_device_name()}: us, median of {args.replays} replays of "
          f"{common.CALLS} steps in one CUDA graph, hot L2; GQA({HQ},{H},{D}) auto NHD; "
          f"PDL off -> on" + ("" if capable else " (this device takes no PDL: both plain)"),
          flush=True)
    before = nvrtc.pdl_on()
    try:
        for T in args.tokens:
            _point(T, args, dev, gen, table, kc, vc, w, out)
    finally:
        nvrtc.use_pdl(before)
    return 0


def _point(T: int, args, dev, gen, table, kc, vc, w, out) -> None:
    """Prints one line per implementation for T tokens."""
    x = torch.randn(T, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
    qkv = torch.empty(T, w.shape[1], device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, MAX_POSITION, (T,), device=dev, generator=gen)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, device=dev, generator=gen)[:T]
    q, k, v = qkv.view(T, HQ + 2 * H, D).split([HQ, H, H], dim=1)

    def gemm_and_reader(i):
        torch.mm(x, w, out=qkv)
        torch.add(kc[0], 1, out=out)

    def timed(call) -> float:
        return timing.time_device(call, common.CALLS, args.replays, graph=True).median

    for impl in args.impls:
        def op(i, impl=impl):
            fused_rope_and_reshape_cache_flash(q, k, v, pos, table, True, kc, vc, slots, None,
                                               None, "auto", implementation=impl)

        def step(i, op=op):
            torch.mm(x, w, out=qkv)
            op(i)
            torch.add(kc[0], 1, out=out)

        got = {}
        for on in (False, True):
            nvrtc.use_pdl(on)
            base = timed(gemm_and_reader)
            got[on] = (timed(op), timed(step) - base)
        print(f"T={T:5d} {impl:6s}  op back to back {got[False][0] * 1e6:6.2f} -> "
              f"{got[True][0] * 1e6:6.2f}   op's share of a step {got[False][1] * 1e6:6.2f} -> "
              f"{got[True][1] * 1e6:6.2f}", flush=True)
