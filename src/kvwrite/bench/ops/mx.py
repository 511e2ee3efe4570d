"""The microscaling cache write's benchmark on the engine (``kvwrite-bench mx``, SPEC §10.6):
``reshape_and_cache_flash(..., "mxfp8" | "mxfp4")`` (docs/ops/mx.md) into SGLang's caches, beside
the fp8 write of the same shape (kind ``fp8``: ``reshape_and_cache_flash(..., "fp8")`` into a
uint8 NHD cache) for scale.

Inputs: key and value from ``torch.randn`` (RNGs seeded with 42), the slot pattern's slots, the
fp8 scales ``amax / 448`` (the MX modes read none). The caches are allocated as SGLang's token
pool allocates them: per layer a K and a V data buffer, uint8 ``[num_blocks * block_size, H, F]``
(F = D for mxfp8, D/2 for mxfp4), and a K and a V scale buffer, uint8
``[num_blocks * block_size, H, D/32]`` (``--scale-layouts linear``, viewed as
``[num_blocks, block_size, H, D/32]``) or ``[num_blocks, H, block_size/128, 32, 4, 4]``
(``interleaved128``, the page-128 FA4 layout), all filled with random bytes. The check: the
implementation and the torch reference each write copies of the four whole allocations, which must
hold the same bytes.
Bytes per call: mxfp8 ``n*H*2*D*in_bytes + n*H*2*(D + D/32) + T*8``; mxfp4
``n*H*2*D*in_bytes + n*H*2*(D/2 + D/32) + T*8``; fp8 ``n*H*2*D*(in_bytes + 1) + T*8`` (n = T less
the padding).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import formats
from ...dtypes import MODEL_DTYPES
from ...testing.slots import SlotPattern
from .. import engine
from ..engine import parse_list, slot_pattern
from ..workload import (
    SEED,
    KeyValueBench,
    check_caches,
    cycling,
    fp8_beside,
    fp8_write,
    key_value_rows,
    point_sets,
)

__all__ = ["BENCH", "MODES", "OP"]

# The hidden op behind reshape_and_cache_flash's MX modes (its implementations are timed).
OP = "mx_kv_write"
WRITE = "reshape_and_cache_flash"
MODES = ("mxfp8", "mxfp4")
SCALE_RULES = ("ceil", "floor")
SCALE_LAYOUTS = ("linear", "interleaved128")
GROUP = 32            # elements per E8M0 scale (SPEC §10.3)
INTERLEAVE = 128      # interleaved128: token offsets per scale tile
KINDS = ("mx", "fp8")


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    mode: str                # mxfp8 or mxfp4
    scale_rule: str          # ceil or floor
    scale_layout: str        # linear or interleaved128
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    slots: SlotPattern


def _row_bytes(name: str, head_size: int) -> int:
    """Bytes of one (token, head) of a format's cache, its scales included: the format's record
    (kvwrite.formats)."""
    return formats.lookup(name).row_bytes(head_size)


def scale_cache(p: Point, device, gen: torch.Generator) -> torch.Tensor:
    """One random-filled uint8 scale cache of the point's layout, as the op takes it."""
    nb, bs, H, G = p.num_blocks, p.block_size, p.num_heads, p.head_size // GROUP
    if p.scale_layout == "interleaved128":
        return torch.randint(0, 256, (nb, H, bs // INTERLEAVE, 32, 4, G), dtype=torch.uint8,
                             device=device, generator=gen)
    # SGLang's flat buffer [slots, H, D/32], viewed as [num_blocks, block_size, H, D/32].
    t = torch.randint(0, 256, (nb * bs, H, G), dtype=torch.uint8, device=device, generator=gen)
    return t.view(nb, bs, H, G)


class MxBench(KeyValueBench):
    name = "mx"
    summary = "the MXFP8 and MXFP4 cache writes (SGLang's caches), beside the fp8 write"
    description = ("Benchmark reshape_and_cache_flash's microscaling modes (E4M3 or E2M1 elements, "
                   "one E8M0 power-of-two scale per 32 in a scale cache) into SGLang's caches, and "
                   "the fp8 write of the same shape beside it.")
    op = OP
    kinds = KINDS
    ops_of_kind = {"mx": (OP,), "fp8": (WRITE,)}
    defaults = {"time_budget": 0.25}
    cpu_defaults = {"num_blocks": 16, "num_heads": 2, "num_tokens": "1:256", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("kv_cache_dtype", "mode"),
               ("scale_rule", "rule"), ("scale_layout", "scales"))
    always_columns = ("num_tokens", "kv_cache_dtype")
    bytes_formula = ("bytes per call: mxfp8 = n*H*2*D*in_bytes + n*H*2*(D + D/32) + T*8; mxfp4 = "
                     "n*H*2*D*in_bytes + n*H*2*(D/2 + D/32) + T*8; fp8 = n*H*2*D*(in_bytes + 1) + "
                     "T*8 (n = T less the padding)")

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--modes", default=",".join(MODES),
                       help=f"comma list of {', '.join(MODES)} (default: both)")
        g.add_argument("--scale-rules", default="ceil",
                       help="comma list of ceil (the scale 2^ceil(log2(amax/M)): SGLang's, "
                            "FlashInfer's), floor (OCP MX v1.0's) (default: ceil)")
        g.add_argument("--scale-layouts", default="linear",
                       help="comma list of linear ([num_blocks, block_size, H, D/32]: SGLang's "
                            "token pool), interleaved128 (the page-128 FA4 layout; needs "
                            "--head-size 128 and --block-size a multiple of 128) (default: linear)")
        g.add_argument("--num-heads", type=int, default=8, help="KV heads (default: 8)")
        g.add_argument("--head-size", type=int, default=128,
                       help="a multiple of 32 (default: 128)")
        engine.add_cache_flags(g, block_size=16, num_blocks=4096, dtype_help="key/value dtype")

    def configure(self, args, device) -> None:
        engine.require_positive(args, ("num_heads", "head_size", "block_size", "num_blocks"))
        if args.head_size % GROUP:
            raise ValueError(f"--head-size: the MX modes need a multiple of {GROUP}, got "
                             f"{args.head_size}")
        args.mode_list = parse_list(args.modes, "--modes", MODES)
        args.rule_list = parse_list(args.scale_rules, "--scale-rules", SCALE_RULES)
        args.scale_layout_list = parse_list(args.scale_layouts, "--scale-layouts", SCALE_LAYOUTS)
        if "interleaved128" in args.scale_layout_list and (
                args.head_size != 128 or args.block_size % INTERLEAVE):
            raise ValueError(f"--scale-layouts: interleaved128 needs --head-size 128 and "
                             f"--block-size a multiple of {INTERLEAVE}, got {args.head_size} and "
                             f"{args.block_size} (use linear)")
        args.pattern = slot_pattern(args)

    def points(self, args) -> list:
        return [Point(t, mode, rule, layout, args.num_heads, args.head_size, args.block_size,
                      args.num_blocks, MODEL_DTYPES[args.dtype], args.pattern)
                for mode in args.mode_list for rule in args.rule_list
                for layout in args.scale_layout_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(kv_cache_dtype=p.mode, scale_rule=p.scale_rule, scale_layout=p.scale_layout,
                    dtype=str(p.dtype).removeprefix("torch."), num_heads=p.num_heads,
                    head_size=p.head_size, block_size=p.block_size, num_blocks=p.num_blocks,
                    **engine.slot_params(p.slots))

    def header(self, args, points) -> list[str]:
        lines = super().header(args, points)
        lines.insert(1, "caches: SGLang's, uint8: K and V data [num_blocks*block_size, H, F] (F = "
                        "D, or D/2 for mxfp4), K and V scales per --scale-layouts (one byte per "
                        "32 elements)")
        return lines

    def block_bytes(self, p: Point) -> int:
        # The K and V rows of a block in the MX caches (data and scales) and the fp8 caches,
        # three times: the caches and the check's two copies.
        per_slot = p.num_heads * 2 * (_row_bytes(p.mode, p.head_size)
                                      + _row_bytes("fp8", p.head_size))
        return 3 * p.block_size * per_slot

    def bytes(self, p: Point, kind: str) -> int:
        n = p.num_tokens - p.slots.num_padding(p.num_tokens)
        H, D, e = p.num_heads, p.head_size, p.dtype.itemsize
        written = _row_bytes(p.mode if kind == "mx" else "fp8", D)
        return n * H * 2 * D * e + n * H * 2 * written + p.num_tokens * 8

    def prepare(self, p: Point, count: int, device):
        sets = point_sets(p, count, device, lambda: key_value_rows(p, device))
        gen = torch.Generator(device=device).manual_seed(SEED)
        f = p.head_size if p.mode == "mxfp8" else p.head_size // 2
        shape = (p.num_blocks, p.block_size, p.num_heads, f)
        kd, vd = (torch.randint(0, 256, (p.num_blocks * p.block_size, p.num_heads, f),
                                dtype=torch.uint8, device=device, generator=gen).view(shape)
                  for _ in range(2))
        ks, vs = scale_cache(p, device, gen), scale_cache(p, device, gen)
        fp8_scales, fp8_caches = fp8_beside(p, sets, device)
        return {"point": p, "sets": sets, "fp8_scales": fp8_scales,
                "caches": {"mx": (kd, vd, ks, vs), "fp8": fp8_caches}}

    def _writer(self, ctx, kind: str, impl: str, i: int, caches=None):
        """A call of ``kind`` on input set ``i`` writing into ``caches`` (default the point's)."""
        from ... import reshape_and_cache_flash  # at call time: a test may replace it

        key, value, slots = ctx["sets"][i]
        caches = caches or ctx["caches"][kind]
        if kind == "fp8":
            return fp8_write(key, value, slots, caches, ctx["fp8_scales"], impl)
        p: Point = ctx["point"]
        kd, vd, ks, vs = caches
        return lambda: reshape_and_cache_flash(
            key, value, kd, vd, slots, p.mode, None, None, k_scale_cache=ks, v_scale_cache=vs,
            scale_rule=p.scale_rule, scale_layout=p.scale_layout, implementation=impl)

    def check(self, ctx, kind, impl) -> str | None:
        # Two NaN codes count as equal in e4m3fn data (SPEC §10.3 leaves which NaN unspecified;
        # randn inputs hold none); E2M1 NaN is one code and the scales have none.
        e4m3 = kind == "fp8" or ctx["point"].mode == "mxfp8"
        return check_caches(lambda name, views: self._writer(ctx, kind, name, 0, views)(),
                            impl, ctx["caches"][kind], (torch.float8_e4m3fn,) * 2 if e4m3 else ())

    def call(self, ctx, kind, impl):
        return cycling([self._writer(ctx, kind, impl, i) for i in range(len(ctx["sets"]))])


BENCH = MxBench()
