"""indexer_k_quant_and_cache's benchmark on the engine (``kvwrite-bench indexer``): DeepSeek-V3.2's
lightning-indexer key write, at vLLM's shape (D = 128, one quant group of 128, a
``[2048, 64, 132]`` uint8 cache) by default.

``--scale-fmts``: ue8m0, mxfp8 (vLLM 0.33's UE8M0 exponent bytes; groups of 128 only) and
float32 scales. Inputs: ``k`` from ``torch.randn`` (RNGs seeded with 42), the slot pattern's slots. The check runs
the implementation and the torch reference on copies of the cache and compares every byte.
Bytes per call: ``T*D*in_bytes + n*(D + 4G) + T*8`` (k read, codes and scales of the n real tokens
written, the slots).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import registry
from ...dtypes import MODEL_DTYPES
from ...ops.indexer_k_quant_and_cache import (
    OP,
    create_indexer_k_cache,
    entry_size,
    parse_scale_fmt,
    validate,
)
from ...ops.indexer_k_quant_and_cache.op import ScaleFormat, check_group_size
from ...testing.slots import SlotPattern
from .. import engine
from ..engine import SlotsBench, compare_with_reference, parse_list, slot_pattern
from ..workload import point_sets

__all__ = ["BENCH"]


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    head_dim: int
    quant_block_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    scale_fmt: str
    slots: SlotPattern

    @property
    def entry(self) -> int:
        return entry_size(self.head_dim, self.quant_block_size)


class IndexerBench(SlotsBench):
    name = OP
    summary = ("DeepSeek-V3.2's indexer key write (fp8 codes + group scales, ue8m0, mxfp8 or "
               "float32)")
    description = ("Benchmark indexer_k_quant_and_cache: the lightning indexer's key quantized to "
                   "e4m3 with one scale per group, written into its paged cache (all codes of a "
                   "page, then all scales).")
    op = OP
    defaults = {"time_budget": 0.25}
    cpu_defaults = {"num_blocks": 16, "num_tokens": "1:256", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("scale_fmt", "scale_fmt"))

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--head-dim", type=int, default=128, help="D (default: 128)")
        g.add_argument("--quant-block-size", type=int, default=128,
                       help="elements per scale group, dividing D (default: 128)")
        engine.add_cache_flags(g, block_size=64, num_blocks=2048, dtype_help="k's dtype")
        g.add_argument("--scale-fmts", default="ue8m0",
                       help="comma list of ue8m0 (power-of-two scales), mxfp8 (the same scales "
                            "as 4 UE8M0 exponent bytes, vLLM 0.33; --quant-block-size 128) and "
                            "float32 (default: ue8m0)")

    def configure(self, args, device) -> None:
        engine.require_positive(args, ("head_dim", "quant_block_size", "block_size", "num_blocks"))
        if args.head_dim % args.quant_block_size:
            raise ValueError(f"--quant-block-size: expected a divisor of --head-dim "
                             f"{args.head_dim}, got {args.quant_block_size}")
        args.fmt_list = parse_list(args.scale_fmts, "--scale-fmts",
                                   [f.value for f in (ScaleFormat.UE8M0, ScaleFormat.MXFP8,
                                                      ScaleFormat.FLOAT32)])
        for fmt in args.fmt_list:
            try:
                check_group_size(parse_scale_fmt(fmt), args.quant_block_size)
            except ValueError as e:
                why = str(e).removeprefix("quant_block_size: ")
                raise ValueError(f"--quant-block-size: {why} (--scale-fmts {fmt})") from None
        args.pattern = slot_pattern(args)

    def points(self, args) -> list:
        return [Point(t, args.head_dim, args.quant_block_size, args.block_size, args.num_blocks,
                      MODEL_DTYPES[args.dtype], fmt, args.pattern)
                for fmt in args.fmt_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(dtype=str(p.dtype).removeprefix("torch."), scale_fmt=p.scale_fmt,
                    head_dim=p.head_dim, quant_block_size=p.quant_block_size,
                    block_size=p.block_size, num_blocks=p.num_blocks, **engine.slot_params(p.slots))

    def header(self, args, points) -> list[str]:
        return [f"shape: head_dim={args.head_dim} quant_block_size={args.quant_block_size} "
                f"block_size={args.block_size} num_blocks={args.num_blocks} dtype={args.dtype} "
                f"(cache [{args.num_blocks}, {args.block_size}, {points[0].entry}] uint8)",
                engine.slots_line(args.pattern, points, args.num_blocks, args.block_size),
                "bytes per call = T*D*in_bytes + n*(D + 4*G) + T*8 (n = T less the padding)"]

    def set_bytes(self, p: Point, kind: str) -> int:
        return p.num_tokens * (p.head_dim * p.dtype.itemsize + 8)

    def block_bytes(self, p: Point) -> int:
        return 3 * p.block_size * p.entry  # the cache and the check's two copies

    def bytes(self, p: Point, kind: str) -> int:
        n = p.num_tokens - p.slots.num_padding(p.num_tokens)
        return p.num_tokens * (p.head_dim * p.dtype.itemsize + 8) + n * p.entry

    def prepare(self, p: Point, count: int, device):
        sets = point_sets(p, count, device, lambda: (
            torch.randn(p.num_tokens, p.head_dim, dtype=p.dtype, device=device),))
        cache = create_indexer_k_cache(p.num_blocks, p.block_size, p.head_dim,
                                       p.quant_block_size, device)
        validate(sets[0][0], cache, sets[0][1], p.quant_block_size, p.scale_fmt)
        return p, cache, sets, parse_scale_fmt(p.scale_fmt)

    def unsupported(self, ctx, kind, impl) -> str | None:
        p, cache, sets, fmt = ctx
        return registry.get(OP, impl).unsupported(sets[0][0], cache, fmt)

    def check(self, ctx, kind, impl) -> str | None:
        p, cache, sets, fmt = ctx
        k, slots = sets[0]

        def writer(name):
            run = registry.get(OP, name).run
            return lambda out: run(k, out["kv_cache"], slots, p.quant_block_size, fmt)
        return compare_with_reference(writer(impl), writer("torch"), {"kv_cache": cache})

    def call(self, ctx, kind, impl):
        p, cache, sets, fmt = ctx
        run = registry.get(OP, impl).run

        def call(i: int) -> None:
            k, slots = sets[i % len(sets)]
            run(k, cache, slots, p.quant_block_size, fmt)
        return call


BENCH = IndexerBench()
