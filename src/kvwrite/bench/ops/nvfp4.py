"""The NVFP4 cache write's benchmark on the engine (``kvwrite-bench nvfp4``):
``reshape_and_cache_flash(..., "nvfp4" | "nvfp4_4over6")`` into vLLM's page layout (allocated as
:func:`kvwrite.create_kv_caches_with_random_flash` does), beside the fp8 write of the same shape
(kind ``fp8``: ``reshape_and_cache_flash(..., "fp8")`` into a uint8 ``[.., H, D]`` cache) for
scale.

Inputs: key and value from ``torch.randn`` (RNGs seeded with 42), the slot pattern's slots, the
global scales ``k = amax / (6 * 448)`` (so the block scales span E4M3) and the fp8 scales
``amax / 448``. The check: the implementation and the torch reference each write a copy of the
whole allocation, which must hold the same bytes.
Bytes per call: nvfp4 ``n*H*2*D*in_bytes + n*H*2*(D/2 + D/16) + T*8``; fp8
``n*H*2*D*(in_bytes + 1) + T*8`` (n = T less the padding).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import formats, registry
from ...dtypes import MODEL_DTYPES, CacheDType
from ...layouts import create_kv_caches_with_random_flash, parse_layout_names
from ...ops.nvfp4 import OP, flash_run_args
from ...ops.reshape_and_cache_flash import OP as WRITE
from ...testing.slots import SlotPattern
from .. import engine
from ..engine import compare_with_reference, parse_list, slot_pattern
from ..workload import KeyValueBench, key_value_rows, point_sets

__all__ = ["BENCH"]

SEED = 42
KINDS = ("nvfp4", "fp8")


def _row_bytes(kind: str, head_size: int) -> int:
    """Bytes of one (token, head) of the kind's cache: its format's row (kvwrite.formats)."""
    return formats.lookup("nvfp4" if kind == "nvfp4" else "fp8").row_bytes(head_size)


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    mode: str                # nvfp4 or nvfp4_4over6
    v_scale_layout: str      # linear or swizzled
    layout: str              # NHD or HND
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    slots: SlotPattern


class Nvfp4Bench(KeyValueBench):
    name = "nvfp4"
    summary = "the NVFP4 cache write (vLLM's page layout), beside the fp8 write of the same shape"
    description = ("Benchmark reshape_and_cache_flash's NVFP4 modes (E2M1 codes, an E4M3 scale "
                   "per 16 elements, a float32 scale per tensor) into vLLM's page layout, and the "
                   "fp8 write of the same shape beside it.")
    op = OP
    kinds = KINDS
    ops_of_kind = {"nvfp4": (OP,), "fp8": (WRITE,)}
    defaults = {"time_budget": 0.25}
    cpu_defaults = {"num_blocks": 16, "num_tokens": "1:256", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("kv_cache_dtype", "mode"),
               ("v_scale_layout", "v scales"),
               ("layout", "layout"))
    always_columns = ("num_tokens", "layout")
    bytes_formula = ("bytes per call: nvfp4 = n*H*2*D*in_bytes + n*H*2*(D/2 + D/16) + T*8; fp8 = "
                     "n*H*2*D*(in_bytes + 1) + T*8 (n = T less the padding)")

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--modes", default="nvfp4",
                       help="comma list of nvfp4, nvfp4_4over6 (default: nvfp4)")
        g.add_argument("--v-scale-layouts", default="swizzled",
                       help="comma list of linear, swizzled (the SM100 4-token swizzle; vLLM's "
                            "default on every GPU below compute capability 12) (default: "
                            "swizzled)")
        g.add_argument("--layouts", default="NHD", help="comma list of NHD, HND (default: NHD)")
        g.add_argument("--num-heads", type=int, default=8, help="KV heads (default: 8)")
        g.add_argument("--head-size", type=int, default=128,
                       help="a multiple of 16; 64 with swizzled V scales (default: 128)")
        engine.add_cache_flags(g, block_size=16, num_blocks=4096, dtype_help="key/value dtype")

    def configure(self, args, device) -> None:
        engine.require_positive(args, ("num_heads", "head_size", "block_size", "num_blocks"))
        if args.head_size % 16:
            raise ValueError(f"--head-size: NVFP4 needs a multiple of 16, got {args.head_size}")
        args.mode_list = parse_list(args.modes, "--modes", ["nvfp4", "nvfp4_4over6"])
        args.vsl_list = parse_list(args.v_scale_layouts, "--v-scale-layouts",
                                   ["linear", "swizzled"])
        if "swizzled" in args.vsl_list and (args.head_size % 64 or args.block_size % 4):
            raise ValueError(f"--v-scale-layouts: swizzled V scales need --head-size % 64 == 0 "
                             f"and --block-size % 4 == 0, got {args.head_size} and "
                             f"{args.block_size} (use linear)")
        args.layout_list = parse_layout_names(
            args.layouts, "--layouts", ("NHD", "HND"),
            " (vLLM's NVFP4 pages interleave K and V blocks; there is no packed NVFP4 cache)")
        args.pattern = slot_pattern(args)

    def points(self, args) -> list:
        return [Point(t, mode, vsl, layout, args.num_heads, args.head_size, args.block_size,
                      args.num_blocks, MODEL_DTYPES[args.dtype], args.pattern)
                for mode in args.mode_list for vsl in args.vsl_list
                for layout in args.layout_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(kv_cache_dtype=p.mode, v_scale_layout=p.v_scale_layout, layout=p.layout,
                    dtype=str(p.dtype).removeprefix("torch."), num_heads=p.num_heads,
                    head_size=p.head_size, block_size=p.block_size, num_blocks=p.num_blocks,
                    **engine.slot_params(p.slots))

    def block_bytes(self, p: Point) -> int:
        # Both caches of a block (nvfp4 and fp8), three times: the caches and the check's two.
        per_slot = p.num_heads * 2 * sum(_row_bytes(k, p.head_size) for k in KINDS)
        return 3 * p.block_size * per_slot

    def bytes(self, p: Point, kind: str) -> int:
        n = p.num_tokens - p.slots.num_padding(p.num_tokens)
        H, D, e = p.num_heads, p.head_size, p.dtype.itemsize
        written = _row_bytes(kind, D)
        return n * H * 2 * D * e + n * H * 2 * written + p.num_tokens * 8

    def prepare(self, p: Point, count: int, device):
        sets = point_sets(p, count, device, lambda: key_value_rows(p, device))
        key, value, _ = sets[0]
        k4 = (key.abs().amax().float() / (6 * 448)).reshape(1)
        v4 = (value.abs().amax().float() / (6 * 448)).reshape(1)
        k8 = (key.abs().amax().float() / 448).reshape(1)
        v8 = (value.abs().amax().float() / 448).reshape(1)
        (kc,), (vc,) = create_kv_caches_with_random_flash(
            p.num_blocks, p.block_size, 1, p.num_heads, p.head_size, p.mode, seed=SEED,
            device=device, cache_layout=p.layout)
        (k8c,), (v8c,) = create_kv_caches_with_random_flash(
            p.num_blocks, p.block_size, 1, p.num_heads, p.head_size, "fp8", seed=SEED,
            device=device, cache_layout=p.layout)
        runs = [flash_run_args(key, value, kc, vc, slots, p.mode, k4, v4, p.v_scale_layout)
                for key, value, slots in sets]
        fp8 = [(key, value, k8c, v8c, slots, CacheDType.FP8_E4M3, k8, v8)
               for key, value, slots in sets]
        return {"nvfp4": runs, "fp8": fp8}, {"nvfp4": (kc, vc), "fp8": (k8c, v8c)}

    def check(self, ctx, kind, impl) -> str | None:
        runs, caches = ctx
        args = runs[kind][0]
        op = OP if kind == "nvfp4" else WRITE
        kc, vc = caches[kind]

        def writer(name):
            run = registry.get(op, name).run

            def write(out):
                a = list(args)
                for i, t in enumerate(a):  # the copies take the places of the caches' views
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == \
                            kc.untyped_storage().data_ptr():
                        a[i] = out["cache"].as_strided(t.shape, t.stride(), t.storage_offset())
                run(*a)
            return write
        base = torch.empty(0, dtype=torch.uint8, device=kc.device).set_(
            kc.untyped_storage(), 0, (kc.untyped_storage().nbytes(),))
        nan = None if kind == "nvfp4" else {"cache": torch.float8_e4m3fn}
        return compare_with_reference(writer(impl), writer("torch"), {"cache": base}, nan)

    def call(self, ctx, kind, impl):
        runs, _ = ctx
        run = registry.get(OP if kind == "nvfp4" else WRITE, impl).run
        args = runs[kind]

        def call(i: int) -> None:
            run(*args[i % len(args)])
        return call


BENCH = Nvfp4Bench()
