"""``probe pattern``: what the access pattern of reshape_and_cache_flash costs on this GPU.

A minimal NVRTC kernel (``kvw_pattern`` in kernels.cu) moves the same bytes to the same cache
addresses as the op, with none of its work (fp8: each bfloat16's high byte instead of the
quotient), at the issue's points, next to the implementations if asked; ``evict_last``: the same
with evict-last loads.

    python -m tools.probes pattern --kinds plain,evict_last --impls cuda --filter 8-128-HND
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvwrite.bench.engine import Parser

from . import common
from .variants import (
    Column,
    add_point_arguments,
    impl_column,
    measure,
    print_header,
    select_points,
    write_json,
)

__all__ = ["KINDS", "pattern_call", "build_parser", "main"]

KINDS = ("plain", "evict_last")


def pattern_call(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, fp8: bool,
                 evict_last: bool = False) -> Callable[[], None]:
    """A call of the pattern kernel on these tensors: key/value ``[T, H, D]`` bfloat16 with unit
    head and element strides, caches ``[num_blocks, 16, H, D]`` (bfloat16, or uint8 for fp8)
    with D a multiple of 16 bytes of cache, int64 slots, all of them valid."""
    kern = common.kernel(f"kvw_pattern<{'true' if evict_last else 'false'}>")
    t, h, d = key.shape
    es = key_cache.element_size()
    out_chunk_elems = 16 // es
    chunks, cph = h * d // out_chunk_elems, d // out_chunk_elems
    threads = min(256, chunks)
    sb, ss, sh = (x * es for x in key_cache.stride()[:3])
    return common.launch(kern, (t, -(-chunks // threads)), threads, key.data_ptr(),
                         value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                         slots.data_ptr(), key.stride(0) * key.element_size(), chunks, cph,
                         sb, ss, sh, int(fp8))


def pattern_column(kind: str) -> Column:
    def make(shape, kc, vc, inp):
        if shape.block_size != 16 or shape.head_size * kc.element_size() % 16:
            return "the pattern kernel needs block size 16 and rows of 16-byte chunks"
        return pattern_call(inp.key, inp.value, kc, vc, inp.slot_mapping,
                            shape.cache_dtype.is_fp8, kind == "evict_last")

    return Column(f"pattern[{kind}]", make)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = Parser(
        prog=prog, description="Time a minimal kernel with the op's access pattern and none of "
                               "its work (the floor of this pattern on this GPU) at the "
                               "performance issue's points.")
    p.add_argument("--kinds", default="plain",
                   help="comma list of plain, evict_last (evict-last loads) (default: plain)")
    p.add_argument("--impls", default="",
                   help="implementations to time next to it (default: none)")
    add_point_arguments(p)
    return p


def main(argv: list[str], prog: str) -> int:
    args = build_parser(prog).parse_args(argv)
    kinds = common.str_list("--kinds", args.kinds, KINDS)
    impls = common.timed_impls(args.impls) if args.impls else []
    points = select_points(args.tokens, args.filter)
    common.require_gpu()
    bw = common.copy_bandwidth()
    print_header(bw)
    default = common.variants([])[0]
    columns = [pattern_column(k) for k in kinds] + [impl_column(i, default) for i in impls]
    rows = measure("pattern", columns, points, args.blocks, args.replays, args.scale, bw)
    write_json(args.json, "pattern", rows, argv)
    return 0
