"""The TurboQuant cache write's benchmark on the engine (``kvwrite-bench turboquant``, SPEC §10.6):
``reshape_and_cache_turboquant`` for each preset into vLLM's cache (docs/ops/turboquant.md),
beside the fp8 write of the same shape (kind ``fp8``: ``reshape_and_cache_flash(..., "fp8")``
into a uint8 NHD cache) for scale, and vLLM's own store on the same cache (kind ``vllm``:
``triton_turboquant_store``, where vLLM is importable and a GPU runs it).

Inputs: key and value from ``torch.randn`` (RNGs seeded with 42), the slot pattern's slots, the
preset's tables from :func:`kvwrite.turboquant_tables` (the MSE presets; k8v4 has none) and the
fp8 scales ``amax / 448``. The cache is allocated as vLLM allocates it, uint8
``(num_blocks, H, block_size, slot_size_aligned)`` filled with random bytes, and passed as its
``transpose(1, 2)``. The check: the implementation and the torch reference each write a copy of
the whole allocation, which must hold the same bytes. vLLM's bytes are not checked: they differ
from kvwrite's by its own rounding (SPEC §10.5); vLLM runs no implementation of kvwrite, so it is
timed once, under the first implementation of the run.
Bytes per call: turboquant ``n*H*2*D*in_bytes + n*H*slot_size + T*8``, plus ``4*D*D + 4*(2^b - 1)``
(PiT and the midpoints) for the MSE presets (b = key bits); vllm the same; fp8
``n*H*2*D*(in_bytes + 1) + T*8`` (n = T less the padding).
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

__all__ = ["BENCH", "PRESETS", "OP", "vllm_store", "layout_of"]

OP = "reshape_and_cache_turboquant"
WRITE = "reshape_and_cache_flash"
PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
KINDS = ("turboquant", "fp8", "vllm")


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int
    preset: str
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    slots: SlotPattern


def _layout(p: Point):
    """The preset's slot sizes (SPEC §10.1), from the op: the one place they are decided."""
    return layout_of(p.head_size, p.preset)


def layout_of(head_size: int, preset: str):
    """``kvwrite.turboquant_layout(head_size, preset)``, looked up when called (as every public
    function here: a test may replace the package's)."""
    from ... import turboquant_layout

    return turboquant_layout(head_size, preset)


def vllm_store():
    """vLLM's TurboQuant store (``triton_turboquant_store``), or the reason it cannot be used."""
    try:
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
    except Exception as e:  # vLLM absent, or present without TurboQuant (before 0.20)
        return None, f"vLLM's triton_turboquant_store is not importable ({type(e).__name__}: {e})"
    return triton_turboquant_store, None


class TurboQuantBench(KeyValueBench):
    name = "turboquant"
    summary = ("the TurboQuant cache write (vLLM's presets), beside the fp8 write of the same "
               "shape and vLLM's store")
    description = ("Benchmark reshape_and_cache_turboquant (a rotated, Lloyd-Max-coded key and a "
                   "min-max-coded value in one byte slot per (token, head)) for each preset into "
                   "vLLM's cache, the fp8 write of the same shape beside it, and vLLM's "
                   "triton_turboquant_store on the same cache where vLLM is importable.")
    op = OP
    kinds = KINDS
    # vLLM's store runs no kvwrite implementation: nothing of the registry to be available.
    ops_of_kind = {"turboquant": (OP,), "fp8": (WRITE,), "vllm": ()}
    defaults = {"time_budget": 0.25}
    cpu_defaults = {"num_blocks": 16, "num_heads": 2, "num_tokens": "1:64",
                    "kinds": "turboquant,fp8", **engine.CPU_TIMING}
    columns = (("num_tokens", "num_tokens"), ("kv_cache_dtype", "preset"))
    always_columns = ("num_tokens", "kv_cache_dtype")
    bytes_formula = ("bytes per call: turboquant = n*H*2*D*in_bytes + n*H*slot_size + T*8 "
                     "(+ 4*D*D + 4*(2^b - 1) for the MSE presets: PiT and the midpoints); vllm the "
                     "same; fp8 = n*H*2*D*(in_bytes + 1) + T*8 (n = T less the padding)")

    def __init__(self):
        self._tables: dict[tuple[int, str], tuple] = {}

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--presets", default=",".join(PRESETS),
                       help=f"comma list of {', '.join(PRESETS)} (default: all)")
        g.add_argument("--num-heads", type=int, default=8, help="KV heads (default: 8)")
        g.add_argument("--head-size", type=int, default=128,
                       help="even for k8v4, a power of two for the MSE presets (their tables) "
                            "(default: 128)")
        engine.add_cache_flags(g, block_size=16, num_blocks=4096, dtype_help="key/value dtype")

    def configure(self, args, device) -> None:
        engine.require_positive(args, ("num_heads", "head_size", "block_size", "num_blocks"))
        args.preset_list = parse_list(args.presets, "--presets", PRESETS)
        for preset in args.preset_list:
            # The op decides which head sizes a preset takes, and turboquant_tables which have
            # tables: asked here, so a bad --head-size is refused before any work.
            try:
                from ... import turboquant_tables

                layout = layout_of(args.head_size, preset)
                if layout.key_bits != 8 and (args.head_size, preset) not in self._tables:
                    self._tables[(args.head_size, preset)] = turboquant_tables(args.head_size,
                                                                               preset)
            except ValueError as e:
                raise ValueError(f"--head-size: {preset} cannot take {args.head_size}: {e}") \
                    from None
        args.pattern = slot_pattern(args)

    def points(self, args) -> list:
        return [Point(t, preset, args.num_heads, args.head_size, args.block_size,
                      args.num_blocks, MODEL_DTYPES[args.dtype], args.pattern)
                for preset in args.preset_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(kv_cache_dtype=p.preset, dtype=str(p.dtype).removeprefix("torch."),
                    num_heads=p.num_heads, head_size=p.head_size, block_size=p.block_size,
                    num_blocks=p.num_blocks, **engine.slot_params(p.slots))

    def header(self, args, points) -> list[str]:
        lines = super().header(args, points)
        sizes = ", ".join(f"{preset} {layout_of(args.head_size, preset).slot_size}"
                          for preset in args.preset_list)
        lines.insert(1, f"cache: vLLM's, uint8 (num_blocks, H, block_size, slot_size_aligned) "
                        f"passed transposed; slot_size: {sizes}")
        lines.append("vllm: vLLM's triton_turboquant_store on the same cache, timed once (under "
                     "the first implementation); its bytes are not checked (SPEC §10.5)")
        return lines

    def block_bytes(self, p: Point) -> int:
        # The TurboQuant and the fp8 caches of a block, three times: the caches and the check's
        # two copies.
        slot = _layout(p).slot_size_aligned
        fp8 = 2 * formats.lookup("fp8").row_bytes(p.head_size)
        return 3 * p.block_size * p.num_heads * (slot + fp8)

    def temp_bytes(self, p: Point) -> int:
        # The tables, and vLLM's float32 temporaries (the keys, their rotation, the values).
        return 4 * p.head_size * p.head_size + 64 + 3 * 4 * p.num_tokens * p.num_heads * p.head_size

    def bytes(self, p: Point, kind: str) -> int:
        n = p.num_tokens - p.slots.num_padding(p.num_tokens)
        H, D, e = p.num_heads, p.head_size, p.dtype.itemsize
        if kind == "fp8":
            return n * H * 2 * D * (e + 1) + p.num_tokens * 8
        layout = _layout(p)
        tables = 4 * D * D + 4 * (2**layout.key_bits - 1) if layout.key_bits != 8 else 0
        return n * H * 2 * D * e + n * H * layout.slot_size + p.num_tokens * 8 + tables

    def prepare(self, p: Point, count: int, device):
        sets = point_sets(p, count, device, lambda: key_value_rows(p, device))
        layout = _layout(p)
        gen = torch.Generator(device=device).manual_seed(SEED)
        # vLLM's allocation: (num_blocks, H, block_size, slot_size_aligned), random bytes (so a
        # stray write shows), used as its transpose [num_blocks, block_size, H, S].
        alloc = torch.randint(0, 256, (p.num_blocks, p.num_heads, p.block_size,
                                       layout.slot_size_aligned),
                              dtype=torch.uint8, device=device, generator=gen)
        kv_cache = alloc.transpose(1, 2)
        PiT = midpoints = None
        if layout.key_bits != 8:
            PiT, _, midpoints = (t.to(device) for t in self._tables[(p.head_size, p.preset)])
        fp8_scales, fp8_caches = fp8_beside(p, sets, device)
        return {"point": p, "layout": layout, "sets": sets, "caches":
                {"turboquant": (kv_cache,), "fp8": fp8_caches, "vllm": (kv_cache,)},
                "tables": (PiT, midpoints), "fp8_scales": fp8_scales, "owner": None}

    def _writer(self, ctx, kind: str, impl: str, i: int, caches=None):
        """A call of ``kind`` on input set ``i`` writing into ``caches`` (default the point's)."""
        from ... import reshape_and_cache_turboquant

        key, value, slots = ctx["sets"][i]
        caches = caches or ctx["caches"][kind]
        if kind == "turboquant":
            PiT, midpoints = ctx["tables"]
            preset = ctx["point"].preset
            return lambda: reshape_and_cache_turboquant(
                key, value, caches[0], slots, preset, PiT, midpoints, implementation=impl)
        if kind == "fp8":
            return fp8_write(key, value, slots, caches, ctx["fp8_scales"], impl)
        store, _ = vllm_store()
        layout, (PiT, midpoints) = ctx["layout"], ctx["tables"]
        mse = layout.key_bits != 8
        # vLLM's launcher: key bits as mse_bits (not read on the fp8-key path), key_fp8 for k8v4.
        return lambda: store(key, value, caches[0], slots, PiT, midpoints, layout.key_bits,
                             layout.key_packed_size, layout.value_bits, not mse)

    def unsupported(self, ctx, kind, impl) -> str | None:
        if kind != "vllm":
            return None
        # vLLM's store runs no implementation: timed once, in the first implementation's column.
        if ctx["owner"] is None:
            ctx["owner"] = impl
        if ctx["owner"] != impl:
            return f"vllm runs no implementation: timed once, under {ctx['owner']}"
        _, reason = vllm_store()
        if reason is None and ctx["caches"]["vllm"][0].device.type != "cuda":
            reason = "vLLM's Triton store needs a CUDA device"
        return reason

    def check(self, ctx, kind, impl) -> str | None:
        if kind == "vllm":
            return engine.UNCHECKED  # vLLM rounds otherwise (SPEC §10.5): see the header
        caches = ctx["caches"][kind]
        return check_caches(lambda name, views: self._writer(ctx, kind, name, 0, views)(),
                            impl, caches, (torch.float8_e4m3fn,) * 2 if kind == "fp8" else ())

    def call(self, ctx, kind, impl):
        return cycling([self._writer(ctx, kind, impl, i) for i in range(len(ctx["sets"]))])


BENCH = TurboQuantBench()
