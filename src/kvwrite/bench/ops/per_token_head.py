"""reshape_and_cache_flash_per_token_head_quant's benchmark on the engine (``kvwrite-bench
per-token-head``): the int8, fp8 and int4 per-(token, head) formats, vLLM's packed rows by
default.

Inputs: ``key`` and ``value`` from ``torch.randn`` (RNGs seeded with 42), the slot pattern's
slots, caches from :func:`create_per_token_head_caches`. The check before timing: the
implementation and the torch reference write copies of the whole allocations, which must hold the
same bytes, and the implementation's rows read back with :func:`dequantize_per_token_head` must
lie within the format's half step of the input (:func:`check_roundtrip`).
Bytes per call: ``n*H*(Dk + Dv)*in_bytes + n*H*(Dq_k + Dq_v + 8) + T*8`` (the real tokens' rows
read, codes and one 4-byte scale per (token, head) written, K and V; the slots).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import registry
from ...dtypes import MODEL_DTYPES
from ...layouts import parse_layout_names
from ...ops.reshape_and_cache_flash_per_token_head_quant import (
    OP,
    PerTokenHeadMode,
    create_per_token_head_caches,
    parse_kv_quant_mode,
    validate,
)
from ...testing.per_token_head import (
    assert_pth_caches_equal,
    check_roundtrip,
    clone_pth_caches,
)
from ...testing.slots import SlotPattern
from .. import engine
from ..engine import parse_list, slot_pattern
from ..models import apply_model, heads_per_rank, model_cache_blocks
from ..workload import KeyValueBench, key_value_rows, point_sets

__all__ = ["BENCH"]

MODES = ("int8", "fp8", "int4")


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    mode: PerTokenHeadMode
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    layout: str
    kv_alloc: str
    model: str
    slots: SlotPattern

    @property
    def dq(self) -> int:
        return self.mode.quantized_size(self.head_size)

    @property
    def row(self) -> int:
        """Bytes of a row with its scale: Dq + 4 (the mode's format, kvwrite.formats)."""
        return self.mode.format.row_bytes(self.head_size)


class PerTokenHeadBench(KeyValueBench):
    name = OP
    summary = "per-(token, head) quantized cache write: int8, fp8, int4 with scales beside rows"
    description = ("Benchmark reshape_and_cache_flash_per_token_head_quant: each (token, head) "
                   "row of K and V quantized with its own scale, computed in the kernel, codes "
                   "and scale written into vLLM's cache rows.")
    op = OP
    has_model = True
    tp_flag = True
    defaults = {"time_budget": 0.25}
    # One layout on the CPU, as before the vLLM orders joined the defaults: a small shape that
    # runs in seconds.
    cpu_defaults = {"layouts": "NHD", "num_blocks": 32, "num_tokens": "1:256", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("kv_quant_mode", "mode"), ("layout", "layout"),
               ("kv_alloc", "kv_alloc"), ("num_heads", "H"))
    always_columns = ("num_tokens", "kv_quant_mode")
    bytes_formula = ("bytes per call = n*H*2*D*in_bytes + n*H*2*(Dq + 4) + T*8 (Dq = D, or D/2 "
                     "for int4; n = T less the padding)")

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--modes", default="int8,fp8,int4",
                       help="comma list of int8, fp8, int4 (the *_per_token_head formats) "
                            "(default: int8,fp8,int4)")
        g.add_argument("--num-heads", type=int, default=8, help="KV heads (default: 8)")
        g.add_argument("--head-size", type=int, default=128, help="(default: 128; int4: even)")
        engine.add_cache_flags(g, block_size=16, num_blocks=4096, dtype_help="key/value dtype")
        g.add_argument("--layouts", default="NHD,HND",
                       help="comma list of NHD, HND: the order of (slot, head); with --kv-alloc "
                            "packed these are vLLM's two default per-layer orders, LBNHC and "
                            "LBHNC (default: NHD,HND)")
        g.add_argument("--kv-alloc", default="packed",
                       help="comma list of packed (vLLM's serving rows: K codes, K scale, V "
                            "codes, V scale), interleaved, separate (default: packed)")

    def configure(self, args, device) -> None:
        if args.model:
            apply_model(args)
        engine.require_positive(args, ("num_heads", "head_size", "block_size", "num_blocks"))
        args.num_heads = heads_per_rank(args.num_heads, args.tp)
        args.mode_list = [parse_kv_quant_mode(f"{m}_per_token_head")
                          for m in parse_list(args.modes, "--modes", MODES)]
        if any(m.is_int4 for m in args.mode_list) and args.head_size % 2:
            raise ValueError(f"--head-size: int4 needs an even head size, got {args.head_size}")
        args.layout_list = parse_layout_names(
            args.layouts, "--layouts", ("NHD", "HND"),
            " (the (slot, head) order; K|V packing is --kv-alloc packed, the default)")
        args.alloc_list = parse_list(args.kv_alloc, "--kv-alloc",
                                     ["packed", "interleaved", "separate"])
        if any(a != "separate" for a in args.alloc_list):
            for m in args.mode_list:
                if m.quantized_size(args.head_size) % 4:
                    raise ValueError(f"--head-size: {m.value} rows of {args.head_size} elements "
                                     f"hold {m.quantized_size(args.head_size)} code bytes, not a "
                                     f"multiple of 4 as the packed and interleaved rows need "
                                     f"(use --kv-alloc separate)")
        args.pattern = slot_pattern(args)
        if args.model and "num_blocks" not in args.explicit:
            args.num_blocks = model_cache_blocks(args)

    def points(self, args) -> list:
        return [Point(t, mode, args.num_heads, args.head_size, args.block_size, args.num_blocks,
                      MODEL_DTYPES[args.dtype], layout, alloc, args.model or "", args.pattern)
                for mode in args.mode_list for layout in args.layout_list
                for alloc in args.alloc_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(kv_quant_mode=p.mode.short, layout=p.layout, kv_alloc=p.kv_alloc,
                    dtype=str(p.dtype).removeprefix("torch."), num_heads=p.num_heads,
                    head_size=p.head_size, block_size=p.block_size, num_blocks=p.num_blocks,
                    model=p.model, **engine.slot_params(p.slots))

    def block_bytes(self, p: Point) -> int:
        # K and V rows of a block with their scales, three times: the caches and the check's two.
        return 3 * p.block_size * p.num_heads * 2 * p.row

    def bytes(self, p: Point, kind: str) -> int:
        n = p.num_tokens - p.slots.num_padding(p.num_tokens)
        H, D = p.num_heads, p.head_size
        return n * H * 2 * D * p.dtype.itemsize + n * H * 2 * p.row + p.num_tokens * 8

    def prepare(self, p: Point, count: int, device):
        sets = point_sets(p, count, device, lambda: key_value_rows(p, device))
        caches = create_per_token_head_caches(p.num_blocks, p.block_size, p.num_heads,
                                              p.head_size, p.mode, cache_layout=p.layout,
                                              kv_alloc=p.kv_alloc, device=device)
        key, value, slots = sets[0]
        validate(key, value, *caches, slots, p.mode)
        return p, caches, sets

    def unsupported(self, ctx, kind, impl) -> str | None:
        p, caches, sets = ctx
        key, value, _ = sets[0]
        return registry.get(OP, impl).unsupported(key, value, caches[0], caches[1], p.mode)

    def check(self, ctx, kind, impl) -> str | None:
        """The implementation's bytes equal the reference's over the whole allocations, and its
        rows read back lie within the format's half step of the input."""
        p, caches, sets = ctx
        key, value, slots = sets[0]
        got, want = clone_pth_caches(caches), clone_pth_caches(caches)
        registry.get(OP, impl).run(key, value, *got, slots, p.mode)
        registry.get(OP, "torch").run(key, value, *want, slots, p.mode)
        try:
            assert_pth_caches_equal(got, want, p.mode, (p.dq, p.dq))
        except AssertionError as e:
            return str(e)
        return check_roundtrip(key, value, *got, slots, p.mode)

    def call(self, ctx, kind, impl):
        p, caches, sets = ctx
        run = registry.get(OP, impl).run

        def call(i: int) -> None:
            key, value, slots = sets[i % len(sets)]
            run(key, value, *caches, slots, p.mode)
        return call


BENCH = PerTokenHeadBench()
