"""QK-norm + RoPE + cache write's benchmark on the engine (``kvwrite-bench qk-norm-rope``).

Kinds timed at each point:
- ``fused``: fused_qk_norm_rope_and_reshape_cache_flash (one kernel);
- ``pair``: fused_qk_norm_rope, then reshape_and_cache_flash on qkv's key and value heads (the
  unfused sequence);
- ``norm_rope``: fused_qk_norm_rope alone;
each checked against the torch reference's bytes (qkv and both caches) on fresh inputs first.

Shapes come from ``--model`` (query heads, KV heads, head dim, the weight convention):
qwen3-8b (32, 8, 128), qwen3-30b-a3b (32, 4, 128), gemma-3-12b (16, 8, 256, (1 + w)) and
gemma-3-27b (32, 16, 128, (1 + w)), from their config.json; or ``--heads Hq,Hk,D``. Inputs:
qkv from ``torch.randn`` (RNGs seeded with 42), random positions below the cos/sin table's rows
(the model's context window by default; or the sequences' positions with a decode, prefill or
mixed ``--slots``), the table in qkv's dtype by default (``--cos-sin-dtype``), weights
``1 + randn/8``, fp8 scales 0.05/0.04 (``--fp8-scales K,V`` sets others, e.g. vLLM's usual 1,1;
on an H200 the fused call's time did not depend on them: tuning-log 83).

The defaults cover issue #42's configuration: Qwen3-8B, bf16 qkv ``[T, 48*128]``, a bf16 table
``[40960, 128]``, a cache of ``max(256, 2T/16)`` blocks of 16 with random unique slots, auto and
fp8_e4m3, the fused call and the pair, in NHD and vLLM's two default per-layer orders (packed =
LBNHC, HND-packed = LBHNC); ``--hot-l2`` gives its L2 condition. The ops rewrite qkv in place and
the timed calls reuse their input sets (one set with ``--hot-l2``), so later calls see qkv already
normalized and rotated: no copy enters the timed region, and what a call reads and writes does
not depend on the values (docs/benchmark.md).

Bytes per call (e = qkv's element size, c = the cache's, s = the table's, N = the real tokens):
fused ``T*(2*(Hq + Hk)*D*e + D*s + 16) + N*(Hv*D*e + 2*Hk*D*c)`` (qkv's q and k read and
written, a table row of D, position and slot per token; v read and both cache rows written per
real token); pair = fused + ``N*Hk*D*e`` (the key read again); norm_rope
``T*(2*(Hq + Hk)*D*e + D*s + 8)``.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from ... import fused_qk_norm_rope, reshape_and_cache_flash
from ...dtypes import parse_kv_cache_dtype, parse_model_dtype
from ...layouts import parse_layout_names
from ...ops.fused_qk_norm_rope import OP as NORM_ROPE
from ...ops.fused_qk_norm_rope_and_reshape_cache_flash import OP as FUSED
from ...ops.fused_qk_norm_rope_and_reshape_cache_flash import (
    fused_qk_norm_rope_and_reshape_cache_flash,
)
from ...ops.reshape_and_cache_flash import OP as WRITE
from ...testing.rope import cos_sin_table
from ...testing.slots import SlotPattern
from .. import engine
from ..engine import OpBench, parse_list, slot_pattern
from ..models import MODELS
from .fused_rope_and_reshape_cache_flash import (
    FP8_SCALES,
    HeadsPoint,
    add_cache_dtypes_flag,
    add_layouts_flag,
    first_difference,
    fp8_scales,
    make_caches,
    positions_and_slots,
    rope_write_bytes,
)

__all__ = ["BENCH", "PRESETS"]

SEED = 42
EPS = 1e-6
# name -> (query heads, KV heads, head dim, weight_offset): the presets of bench/models.py (every
# subcommand's --model list) whose model has a QK norm; the others' shapes have no norm weight
# convention, and --model refuses them naming these.
PRESETS = {m.name: (m.num_q_heads, m.num_kv_heads, m.head_dim, m.qk_norm)
           for m in MODELS.values() if m.qk_norm is not None}


def parse_models(text: str) -> list[str]:
    """``--model``: a comma list of the presets with a QK norm (ValueError names the flag)."""
    def one(name: str) -> str:
        name = name.lower()
        if name in MODELS and name not in PRESETS:
            raise ValueError(f"--model: {name} has no QK norm; qk-norm-rope takes "
                             f"{', '.join(PRESETS)} (or --heads Hq,Hk,D)")
        if name not in PRESETS:
            raise ValueError(f"--model: expected a comma list of {', '.join(PRESETS)} (the "
                             f"presets with a QK norm), got {name!r}")
        return name
    return parse_list(text, "--model", convert=one)
KINDS = ("fused", "pair", "norm_rope")


@dataclasses.dataclass(frozen=True)
class Point(HeadsPoint):
    weight_offset: float
    layout: str
    cos_sin_dtype: torch.dtype
    num_tokens: int
    num_blocks: int
    block_size: int
    max_position: int
    model: str
    slots: SlotPattern
    fp8_scales: tuple[float, float] = FP8_SCALES


def point_bytes(p: Point, kind: str) -> int:
    """:func:`rope_write_bytes` with a table row of D in the table's dtype."""
    return rope_write_bytes(p, kind, p.head_size * p.cos_sin_dtype.itemsize)


class QkNormRopeBench(OpBench):
    name = FUSED
    summary = "QK-norm + RoPE + cache write: fused, the unfused sequence, norm+rope alone"
    description = ("Benchmark fused_qk_norm_rope_and_reshape_cache_flash against kvwrite's "
                   "unfused sequence (fused_qk_norm_rope, then reshape_and_cache_flash) and "
                   "fused_qk_norm_rope alone.")
    op = FUSED
    kinds = KINDS
    ops_of_kind = {"fused": (FUSED,), "pair": (NORM_ROPE, WRITE), "norm_rope": (NORM_ROPE,)}
    has_slots = True
    defaults = {"num_tokens": "1,16,256,1024,4096,16384", "time_budget": 0.25}
    # One layout on the CPU, as before the vLLM orders joined the defaults: a small shape that
    # runs in seconds.
    cpu_defaults = {"layouts": "NHD", "heads": "4,2,64", "num_tokens": "1,16,64",
                    **engine.CPU_TIMING, "kv_cache_dtypes": "auto"}
    columns = (("model", "model"), ("kv_cache_dtype", "cache"), ("heads", "heads"),
               ("layout", "layout"), ("num_tokens", "N"))
    always_columns = ("kv_cache_dtype", "num_tokens")

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--model", default="qwen3-8b",
                       help=f"comma list of {', '.join(PRESETS)}: query and KV heads, head dim "
                            f"and weight convention (default: qwen3-8b; --heads instead sets "
                            f"them directly)")
        g.add_argument("--heads", default=None,
                       help="Hq,Hk,D instead of --model (the (x r) w norm)")
        g.add_argument("--dtype", default="bfloat16", help="qkv's dtype (default: bfloat16)")
        add_cache_dtypes_flag(g)
        add_layouts_flag(g)
        g.add_argument("--max-position", type=int, default=None,
                       help="rows of the cos/sin table (default: the model's context window, "
                            "max_position_embeddings: 40960 for qwen3-8b; 4096 with --heads)")
        g.add_argument("--cos-sin-dtype", choices=["float32", "bfloat16", "float16"],
                       default=None,
                       help="the cos/sin table's dtype (default: qkv's dtype, as vLLM's rotary "
                            "embedding holds its table for a bf16 or fp16 model)")
        g.add_argument("--num-blocks", type=int, default=256,
                       help="cache blocks, raised at each T to twice the blocks its slot "
                            "pattern needs where that is more "
                            "(default: 256: max(256, 2*T/16) blocks of 16 with random slots)")
        g.add_argument("--block-size", type=int, default=16, help="(default: 16)")
        default = ",".join(str(x) for x in FP8_SCALES)
        g.add_argument("--fp8-scales", default=default,
                       help=f"K,V: the fp8 caches' k_scale and v_scale (default: {default}; "
                            "other values are a param of the rows)")

    def configure(self, args, device) -> None:
        if "model" in args.explicit and "heads" not in args.explicit:
            args.heads = None  # the CPU's small default shape gives way to the model's
        if args.heads is not None:
            if "model" in args.explicit:
                raise ValueError("--heads: sets the shape --model would; give one of them")
            try:
                hq, h, d = (int(x) for x in args.heads.split(","))
            except ValueError:
                raise ValueError(f"--heads: expected Hq,Hk,D (positive integers), got "
                                 f"{args.heads!r}") from None
            if min(hq, h, d) < 1 or d % 2:
                raise ValueError(f"--heads: expected positive counts and an even head dim, got "
                                 f"{args.heads!r}")
            args.shapes = [("", (hq, h, d, 0.0))]
        else:
            args.shapes = [(m, PRESETS[m]) for m in parse_models(args.model)]
        if args.max_position is None:
            args.max_position = (4096 if args.heads is not None
                                 else min(MODELS[m].max_position for m, _ in args.shapes))
            args.positions = {m: 4096 if args.heads is not None else MODELS[m].max_position
                              for m, _ in args.shapes}
        else:
            args.positions = {m: args.max_position for m, _ in args.shapes}
        engine.require_positive(args, ("max_position", "num_blocks", "block_size"))
        args.dtype_t = parse_model_dtype(args.dtype, "--dtype")
        args.cos_sin_t = (args.dtype_t if args.cos_sin_dtype is None
                          else parse_model_dtype(args.cos_sin_dtype, "--cos-sin-dtype"))
        args.kv_list = parse_list(args.kv_cache_dtypes, "--kv-cache-dtypes",
                                  convert=parse_kv_cache_dtype)
        args.layout_list = parse_layout_names(args.layouts, "--layouts")
        args.pattern = slot_pattern(args, None if args.slots == "random" else args.max_position)
        args.fp8_scale_pair = engine.parse_fp8_scales(args.fp8_scales)

    def points(self, args) -> list:
        return [Point(args.dtype_t, kv, hq, h, d, wo, layout, args.cos_sin_t, t,
                      args.pattern.cache_blocks(t, args.block_size, args.num_blocks),
                      args.block_size, args.positions[model], model, args.pattern,
                      args.fp8_scale_pair)
                for model, (hq, h, d, wo) in args.shapes for kv in args.kv_list
                for layout in args.layout_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        return dict(model=p.model, layout=p.layout, dtype=str(p.dtype).removeprefix("torch."),
                    cos_sin_dtype=str(p.cos_sin_dtype).removeprefix("torch."),
                    kv_cache_dtype=p.cache_dtype.value,
                    heads=f"({p.num_q_heads},{p.num_heads},{p.head_size})",
                    num_q_heads=p.num_q_heads, num_heads=p.num_heads, head_size=p.head_size,
                    weight_offset=p.weight_offset, num_blocks=p.num_blocks,
                    block_size=p.block_size, max_position=p.max_position,
                    **engine.slot_params(p.slots),
                    # Only where asked for: the committed rows (0.05, 0.04) keep their identity.
                    **({"fp8_scales": list(p.fp8_scales)} if p.cache_dtype.is_fp8 and
                       p.fp8_scales != FP8_SCALES else {}))

    def header(self, args, points) -> list[str]:
        shapes = "; ".join(f"{m or 'heads'} (Hq,Hk,D)=({hq},{h},{d})"
                           f"{' (1 + w)' if wo else ''}" for m, (hq, h, d, wo) in args.shapes)
        table = str(args.cos_sin_t).removeprefix("torch.")
        rows = ", ".join(sorted({str(v) for v in args.positions.values()}))
        return [f"shape: {shapes}, neox, eps={EPS}, block_size={args.block_size}, cos/sin table "
                f"{table} [{rows}, D]" + (
                    f", fp8 scales k={args.fp8_scale_pair[0]} v={args.fp8_scale_pair[1]}"
                    if any(kv.is_fp8 for kv in args.kv_list) else ""),
                engine.slots_line(args.pattern, points, args.num_blocks, args.block_size,
                                  grown=True),
                "bytes per call: fused = T*(2*(Hq + Hk)*D*e + D*s + 16) + N*(Hv*D*e + 2*Hk*D*c); "
                "pair = fused + N*Hk*D*e; norm_rope = T*(2*(Hq + Hk)*D*e + D*s + 8) (s = the "
                "table's element size; N = T less the padding)"]

    def set_bytes(self, p: Point, kind: str) -> int:
        rows = p.num_q_heads + p.num_heads + (0 if kind == "norm_rope" else p.num_heads)
        return p.num_tokens * (rows * p.head_size * p.dtype.itemsize + 16)

    def block_bytes(self, p: Point) -> int:
        return 3 * 2 * p.block_size * p.num_heads * p.head_size * p.cache_bytes

    def temp_bytes(self, p: Point) -> int:
        return p.max_position * p.head_size * p.cos_sin_dtype.itemsize

    def bytes(self, p: Point, kind: str) -> int:
        return point_bytes(p, kind)

    def _inputs(self, p: Point, count: int, device, gen):
        random.seed(SEED)
        sets = []
        H3 = p.num_q_heads + 2 * p.num_heads
        for i in range(count):
            qkv = torch.randn(p.num_tokens, H3 * p.head_size, device=device, generator=gen,
                              dtype=torch.float32).to(p.dtype)
            sets.append((qkv, *positions_and_slots(p, i, device, gen)))
        return sets

    def prepare(self, p: Point, count: int, device):
        gen = torch.Generator(device=device).manual_seed(SEED)
        with engine.skip_unless_fits():
            sets = self._inputs(p, count, device, gen)
        table = cos_sin_table(p.max_position, p.head_size, p.cos_sin_dtype, device=device)
        w = [(1 + torch.randn(p.head_size, device=device, generator=gen) / 8).to(p.dtype)
             for _ in range(2)]
        return (p, sets, make_caches(p, device, gen), table, w,
                fp8_scales(p, device, p.fp8_scales), device)

    def _caller(self, ctx, kind: str, impl: str, sets=None, caches=None):
        p, default_sets, default_caches, table, (qw, kw), (ks, vs), _ = ctx
        sets = sets or default_sets
        kc, vc = caches or default_caches
        Hq, H, D, kv = p.num_q_heads, p.num_heads, p.head_size, p.cache_dtype.value

        def call(i: int) -> None:
            qkv, pos, slots = sets[i % len(sets)]
            if kind == "fused":
                fused_qk_norm_rope_and_reshape_cache_flash(
                    qkv, Hq, H, H, D, EPS, qw, kw, table, True, pos, kc, vc, slots, ks, vs, kv,
                    weight_offset=p.weight_offset, implementation=impl)
                return
            fused_qk_norm_rope(qkv, Hq, H, H, D, EPS, qw, kw, table, True, pos,
                               weight_offset=p.weight_offset, implementation=impl)
            if kind == "pair":
                heads = qkv.view(qkv.shape[0], Hq + 2 * H, D)
                reshape_and_cache_flash(heads[:, Hq:Hq + H], heads[:, Hq + H:], kc, vc, slots, kv,
                                        ks, vs, implementation=impl)
        return call

    def check(self, ctx, kind, impl) -> str | None:
        """``impl`` and the torch reference on fresh copies of one input set and of the caches:
        qkv and both caches must hold the same bytes."""
        p, _, _, _, _, _, device = ctx
        outs = []
        for name in (impl, "torch"):
            gen = torch.Generator(device=device).manual_seed(SEED + 1)
            sets = self._inputs(p, 1, device, gen)
            caches = make_caches(p, device, gen)
            self._caller(ctx, kind, name, sets, caches)(0)
            outs.append([sets[0][0], *caches])
        keep = 1 if kind == "norm_rope" else 3  # norm_rope alone writes no cache
        got, want = (o[:keep] for o in outs)
        return first_difference(("qkv", "key_cache", "value_cache")[:keep], got, want)

    def call(self, ctx, kind, impl):
        return self._caller(ctx, kind, impl)


BENCH = QkNormRopeBench()
