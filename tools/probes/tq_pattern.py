"""``probe tq-pattern``: what reshape_and_cache_turboquant's access pattern costs on this GPU.

The TurboQuant benchmark (``kvwrite-bench turboquant``: its points, input sets, L2 rule, timer
and table) with more kinds: ``pattern``, a minimal kernel (``kvw_tq_pattern<4>`` in kernels.cu)
that reads the same key and value rows and slots and writes the preset's slot bytes at the same
cache addresses (vLLM's allocation, heads outermost) with none of the op's work; ``pattern_1``
the same with one 16-byte piece of K and of V a lane at a time instead of four (fewer bytes in
flight, fewer rows a warp: faster at small T); ``pattern_nhd``, the pattern kernel into a cache
of the same size allocated ``(num_blocks, block_size, H, slot_size_aligned)`` (a token's heads
side by side: its slots one contiguous run). The faster of the first two is the floor of the
op's pattern; ``pattern`` over ``pattern_nhd`` is what the layout costs. Their bytes are not
checked (they write no TurboQuant fields); every kind runs under each implementation named, so
name one. Input rows of at most 512 bytes (head size 128: 256 in bfloat16).

``pattern_row`` and ``pattern_row_nhd`` (``kvw_tq_row_pattern``) are the small calls' floor: a
warp a row, 32-bit indices and no loop, the slot's bytes as ``pattern`` writes them, into the two
caches.

    python -m tools.probes tq-pattern --implementation cuda
"""

from __future__ import annotations

import torch

from kvwrite.bench import engine
from kvwrite.bench.ops.turboquant import OP, TurboQuantBench, layout_of
from kvwrite.bench.workload import cycling

from . import common

__all__ = ["TqPatternBench", "pattern_call", "row_pattern_call", "main"]

CTA = 256  # threads
ROW_CTA = 128  # kvw_tq_row_pattern's threads: 4 rows a CTA


def pattern_call(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 slots: torch.Tensor, slot_bytes: int, block_size: int, pieces: int = 4):
    """A call of the pattern kernel (``pieces``: U, the 16-byte pieces of K and of V a lane
    loads at a time): key/value ``[T, H, D]`` with unit element stride and rows of 16 to 512
    bytes, a power of two of 16-byte pieces, ``cache`` a uint8 ``[num_blocks, block_size, H,
    S]`` view of any strides, int64 slots."""
    t, h, d = key.shape
    row_bytes = d * key.element_size()
    pieces_per_row = row_bytes // 16
    if (row_bytes % 16 or pieces_per_row & (pieces_per_row - 1) or pieces_per_row > 32
            or block_size & (block_size - 1)):
        raise common.ProbeError("tq-pattern needs rows of 16 to 512 bytes (a power of two of "
                                "16-byte pieces) and a power-of-two block size, got "
                                f"{row_bytes} and {block_size}")
    pdl = common.pdl_launches()
    kern = common.kernel(f"kvw_tq_pattern<{pieces}>", pdl)
    rows_per_warp = 32 * pieces // pieces_per_row
    ctas = max(1, -(-t * h // (CTA // 32 * rows_per_warp)))
    return common.launch(kern, (ctas, 1), CTA,
                         *_args(key, value, cache, slots, slot_bytes, block_size), pdl=pdl)


def _args(key, value, cache, slots, slot_bytes: int, block_size: int) -> tuple[int, ...]:
    """Both pattern kernels' arguments (kernels.cu's KVW_TQ_PATTERN_PARAMS)."""
    t, h, d = key.shape
    es = key.element_size()
    sb, sp, sh = cache.stride()[:3]
    return (key.data_ptr(), value.data_ptr(), cache.data_ptr(), slots.data_ptr(), t * h, h,
            d * es, key.stride(0) * es, key.stride(1) * es, value.stride(0) * es,
            value.stride(1) * es, sb, sp, sh, block_size.bit_length() - 1, slot_bytes,
            cache.shape[0] * block_size, 0)


def row_pattern_call(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                     slots: torch.Tensor, slot_bytes: int, block_size: int):
    """A call of ``kvw_tq_row_pattern``: a warp a (token, head) row (arguments as
    :func:`pattern_call`'s; rows of a multiple of 4 bytes, fewer than 2^31 rows)."""
    t, h, d = key.shape
    row_bytes = d * key.element_size()
    if row_bytes % 4 or block_size & (block_size - 1) or t * h >= 2**31:
        raise common.ProbeError("tq-pattern's row kernel needs rows of a multiple of 4 bytes, a "
                                "power-of-two block size and fewer than 2^31 rows, got "
                                f"{row_bytes}, {block_size} and {t * h}")
    pdl = common.pdl_launches()
    kern = common.kernel("kvw_tq_row_pattern", pdl)
    return common.launch(kern, (max(1, -(-t * h // (ROW_CTA // 32))), 1), ROW_CTA,
                         *_args(key, value, cache, slots, slot_bytes, block_size), pdl=pdl)


class TqPatternBench(TurboQuantBench):
    name = "tq-pattern"
    summary = "the TurboQuant write's access pattern without its work"
    kinds = ("turboquant", "pattern", "pattern_nhd", "pattern_1", "pattern_row",
             "pattern_row_nhd", "fp8")
    ops_of_kind = {"turboquant": (OP,), "pattern": (), "pattern_nhd": (), "pattern_1": (),
                   "pattern_row": (), "pattern_row_nhd": (),
                   "fp8": TurboQuantBench.ops_of_kind["fp8"]}
    defaults = {"time_budget": 0.15,
                "kinds": ("turboquant", "pattern", "pattern_1", "pattern_nhd", "pattern_row",
                          "pattern_row_nhd", "fp8")}
    cpu_defaults = {**TurboQuantBench.cpu_defaults, "kinds": "turboquant,pattern,pattern_1"}

    def block_bytes(self, p) -> int:
        # The benchmark's, and the contiguous cache of the pattern_nhd kind.
        return super().block_bytes(p) + p.block_size * p.num_heads * \
            layout_of(p.head_size, p.preset).slot_size_aligned

    def bytes(self, p, kind: str) -> int:
        if kind.startswith("pattern"):  # the op's bytes without the tables
            n = p.num_tokens - p.slots.num_padding(p.num_tokens)
            return (n * p.num_heads * (2 * p.head_size * p.dtype.itemsize
                                       + layout_of(p.head_size, p.preset).slot_size)
                    + p.num_tokens * 8)
        return super().bytes(p, kind)

    def prepare(self, p, count: int, device):
        ctx = super().prepare(p, count, device)
        s = ctx["layout"].slot_size_aligned
        nhd = torch.empty(p.num_blocks, p.block_size, p.num_heads, s, dtype=torch.uint8,
                          device=device)
        for kind in ("pattern", "pattern_1", "pattern_row"):
            ctx["caches"][kind] = ctx["caches"]["turboquant"]
        ctx["caches"]["pattern_nhd"] = ctx["caches"]["pattern_row_nhd"] = (nhd,)
        return ctx

    def unsupported(self, ctx, kind, impl) -> str | None:
        if kind.startswith("pattern") and ctx["caches"][kind][0].device.type != "cuda":
            return "the pattern kernel needs a CUDA device"
        return super().unsupported(ctx, kind, impl)

    def check(self, ctx, kind, impl) -> str | None:
        if kind.startswith("pattern"):
            return engine.UNCHECKED  # no TurboQuant fields: the module doc
        return super().check(ctx, kind, impl)

    def call(self, ctx, kind, impl):
        if not kind.startswith("pattern"):
            return super().call(ctx, kind, impl)
        p, cache = ctx["point"], ctx["caches"][kind][0]
        if kind.startswith("pattern_row"):
            return cycling([row_pattern_call(k, v, cache, s, ctx["layout"].slot_size,
                                             p.block_size) for k, v, s in ctx["sets"]])
        pieces = 1 if kind == "pattern_1" else 4
        return cycling([pattern_call(k, v, cache, s, ctx["layout"].slot_size, p.block_size,
                                     pieces) for k, v, s in ctx["sets"]])


def main(argv: list[str], prog: str) -> int:
    """The engine's subcommand; its exit status returned, not raised (usage errors: 2)."""
    try:
        return engine.main(TqPatternBench(), argv, prog)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except engine.BenchError as e:
        raise common.ProbeError(str(e)) from None
