"""reshape_and_cache_flash's benchmark on the engine (:mod:`kvwrite.bench.engine`): vLLM's
benchmark_reshape_and_cache_flash.py (its flags, defaults, sweep and table) plus kvwrite's.

Points: layouts (NHD then HND by default) x num_tokens (2^1 .. 2^16). Each point follows vLLM's
recipe (:mod:`kvwrite.bench.workload`: RNGs seeded with 42, random key/value, unique random
slots, random caches, ``k_scale = key.amax() / 64``, or the values of ``--fp8-scales K,V``); the
check before timing is :func:`kvwrite.bench.check.check_point` (every written row byte for byte,
and whole blocks around them for stray writes). Bytes per call:
``2*N*H*D*(in_bytes + cache_bytes) + T*slot_bytes`` (N = T less the padding). :func:`run_benchmark` is vLLM's function with its signature and method.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ... import registry
from ...dtypes import BENCH_DTYPES, MODEL_DTYPES, parse_kv_cache_dtype, parse_model_dtype
from ...layouts import layout_alloc, parse_layout_names
from ...ops.reshape_and_cache_flash import OP, validate
from .. import engine, timing
from ..check import SNAPSHOT_BYTES, check_point
from ..engine import OpBench, slot_pattern
from ..models import apply_model, get_model, heads_per_rank, model_cache_blocks
from ..workload import (
    CHUNK_BYTES,
    Case,
    fill_caches,
    make_caches,
    make_input_sets,
)

__all__ = ["BENCH", "run_benchmark", "DTYPES", "HEAD_SIZES"]

DTYPES = {name: MODEL_DTYPES[name] for name in BENCH_DTYPES}  # vLLM's --dtype choices
HEAD_SIZES = [64, 80, 96, 112, 120, 128, 192, 256]


@dataclasses.dataclass(frozen=True)
class Point:
    case: Case          # the shape, dtypes, layout and slots (num_tokens set per point)
    model: str = ""
    tp: int = 1
    fp8_scales: tuple[float, float] | None = None  # (k, v); None: amax / 64 (vLLM's recipe)

    @property
    def num_tokens(self) -> int:
        return self.case.num_tokens


class ReshapeAndCacheFlashBench(OpBench):
    name = OP
    summary = "reshape_and_cache_flash: vLLM's cache-write benchmark (the default subcommand)"
    description = ("Benchmark reshape_and_cache_flash (writing new K/V rows into a paged KV "
                   "cache): vLLM's flags, defaults and table, plus device timing, several "
                   "implementations side by side, bandwidth, JSON/CSV and plots.")
    op = OP
    has_slots = True
    has_model = True
    tp_flag = True
    defaults = {"num_tokens": "2:65536"}
    # vLLM's shape (128 heads, 65536 blocks) needs a 64 GiB cache; this one runs its 16 points
    # in seconds on 2 cores with the torch reference.
    cpu_defaults = {"num_heads": 8, "num_blocks": 16, "num_tokens": "2:256", "iters": 10,
                    "graph_calls": 5}
    columns = (("num_tokens", "num_tokens"), ("layout", "layout"))
    always_columns = ("num_tokens", "layout")

    def __init__(self) -> None:
        self._caches: tuple | None = None   # (layout case key, (key_cache, value_cache))

    def add_flags(self, p) -> None:
        g = p.add_argument_group("vLLM's flags (same defaults and choices)")
        g.add_argument("--num-heads", type=int, default=128, help="KV heads (default: 128)")
        g.add_argument("--head-size", type=int, choices=HEAD_SIZES, default=128,
                       help="(default: 128)")
        g.add_argument("--block-size", type=int, choices=[16, 32], default=16,
                       help="(default: 16)")
        g.add_argument("--num-blocks", type=int, default=128 * 512, help="(default: 65536)")
        g.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                       help="key/value dtype (default: bfloat16)")
        g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                       default="auto", help="fp8 = fp8_e4m3 (default: auto)")
        more = p.add_argument_group("kvwrite's flags")
        more.add_argument("--layouts", default="NHD,HND",
                          help="comma list of NHD, HND (K and V blocks interleaved, as vLLM's "
                               "benchmark allocates them), packed (alias LBNHC: vLLM's default "
                               "per-layer cache, one [num_blocks, block_size, H, 2*D] allocation, "
                               "K = [..., :D], V = [..., D:]), HND-packed (alias LBHNC: "
                               "[num_blocks, H, block_size, 2*D], FlashInfer's order on SM100), "
                               "or all (default: NHD,HND, vLLM's sweep)")
        more.add_argument("--per-head-scale", action="store_true",
                          help="fp8: one scale per head (its amax over tokens and dims / 64)")
        more.add_argument("--fp8-scales", default=None,
                          help="K,V: every fp8 k_scale is K and every v_scale V (per tensor, or "
                               "each head's with --per-head-scale), e.g. 1,1, vLLM's scales when "
                               "none are calibrated (default: amax / 64, vLLM's benchmark; "
                               "given, the values are a param of the rows)")

    def configure(self, args, device) -> None:
        if device.type == "cpu" and args.model and "num_heads" not in args.explicit:
            args.num_heads = get_model(args.model).num_kv_heads
        args.max_position = None
        if args.model:
            apply_model(args)  # sets args.max_position with a sequence --slots
        engine.require_positive(args, ("num_heads", "num_blocks"))
        args.num_heads = heads_per_rank(args.num_heads, args.tp)
        args.layout_list = parse_layout_names(args.layouts, "--layouts")
        for flag, given in (("--per-head-scale", args.per_head_scale),
                            ("--fp8-scales", args.fp8_scales is not None)):
            if given and not args.kv_cache_dtype.startswith("fp8"):
                raise ValueError(f"{flag}: scales an fp8 cache, and --kv-cache-dtype is "
                                 f"{args.kv_cache_dtype}")
        args.fp8_scale_pair = (None if args.fp8_scales is None
                               else engine.parse_fp8_scales(args.fp8_scales))
        args.pattern = slot_pattern(args, args.max_position)
        if args.model and "num_blocks" not in args.explicit:
            args.num_blocks = model_cache_blocks(args)

    def points(self, args) -> list:
        return [Point(Case.named_layout(layout, num_tokens=t, num_heads=args.num_heads,
                                        head_size=args.head_size, block_size=args.block_size,
                                        num_blocks=args.num_blocks, dtype=DTYPES[args.dtype],
                                        kv_cache_dtype=args.kv_cache_dtype,
                                        per_head_scale=args.per_head_scale, slots=args.pattern),
                      args.model or "", args.tp, args.fp8_scale_pair)
                for layout in args.layout_list for t in args.token_counts]

    def params(self, p: Point) -> dict:
        c = p.case
        return dict(layout=c.layout_name, dtype=str(c.dtype).removeprefix("torch."),
                    kv_cache_dtype=c.kv_cache_dtype, num_heads=c.num_heads,
                    head_size=c.head_size, block_size=c.block_size, num_blocks=c.num_blocks,
                    per_head_scale=c.per_head_scale, model=p.model, tp=p.tp,
                    **engine.slot_params(c.slots),
                    # Only where asked for: the committed rows (amax / 64) keep their identity.
                    **({"fp8_scales": list(p.fp8_scales)} if p.fp8_scales is not None else {}))

    def header(self, args, points) -> list[str]:
        c = points[0].case
        model = (f" ({args.model}, tp={args.tp})" if args.model
                 else (f" (tp={args.tp})" if args.tp > 1 else ""))
        scale = ", per-head scales" if c.per_head_scale and c.cache_dtype.is_fp8 else ""
        if points[0].fp8_scales is not None:
            scale += ", fp8 scales k={} v={}".format(*points[0].fp8_scales)
        return [f"shape: num_heads={c.num_heads}{model} head_size={c.head_size} "
                f"block_size={c.block_size} num_blocks={c.num_blocks} "
                f"dtype={str(c.dtype).removeprefix('torch.')} "
                f"kv_cache_dtype={c.kv_cache_dtype}{scale}",
                engine.slots_line(c.slots, points, c.num_blocks, c.block_size),
                "bytes per call = 2*N*H*D*(in_bytes + cache_bytes) + T*slot_bytes "
                "(N = T less the padding)"]

    def title(self, args, cfg) -> str:
        return (f"Benchmark results for implementation {','.join(cfg.implementations)} "
                f"(measuring with {cfg.measured_mode}):")

    def set_bytes(self, p: Point, kind: str) -> int:
        return p.case.set_bytes()

    def state_bytes(self, p: Point) -> int:
        return p.case.cache_bytes

    def temp_bytes(self, p: Point) -> int:
        # The fill and check temporaries, the torch reference's float32 casts.
        c = p.case
        return 2 * CHUNK_BYTES + 4 * SNAPSHOT_BYTES + c.set_bytes() * (4 if c.cache_dtype.is_fp8
                                                                       else 1)

    def block_bytes(self, p: Point) -> int:
        return p.case.block_bytes

    def bytes(self, p: Point, kind: str) -> int:
        return p.case.bytes_moved()

    def skip_reason(self, p: Point) -> str | None:
        c = p.case
        if c.cache_dtype.is_fp8 and c.head_size % 16:
            return (f"--kv-cache-dtype {c.kv_cache_dtype}: an fp8 cache needs --head-size % 16 "
                    f"== 0 (vLLM's benchmark rule), got --head-size {c.head_size}")
        return c.slots.fit_reason(c.num_tokens, c.num_blocks, c.block_size)

    def prepare(self, p: Point, count: int, device):
        c = p.case
        key = (c.layout, c.alloc, c.num_blocks, c.block_size, c.num_heads, c.head_size,
               c.cache_tensor_dtype, device)
        if self._caches is None or self._caches[0] != key:
            self._caches = None  # free the last layout's caches before allocating these
            if device.type == "cuda":
                torch.cuda.empty_cache()
            self._caches = (key, make_caches(c, device))
        caches = self._caches[1]
        fill_caches(*caches, c)
        with engine.skip_unless_fits():
            sets = make_input_sets(c, c.num_tokens, count, device, p.fp8_scales)
        s0 = sets[0]
        validate(s0.key, s0.value, *caches, s0.slot_mapping, c.kv_cache_dtype, s0.k_scale,
                 s0.v_scale)
        return p, caches, sets

    def release(self) -> None:
        self._caches = None

    def unsupported(self, ctx, kind, impl) -> str | None:
        p, (key_cache, value_cache), sets = ctx
        info = registry.get(OP, impl)
        reason = info.unsupported(sets[0].key, key_cache, p.case.cache_dtype, sets[0].k_scale,
                                  sets[0].v_scale)
        if reason is not None:
            return reason
        for s in sets:  # a peer's per-argument preparation, outside the timed calls
            reason = info.prepare(*s.run_args(key_cache, value_cache, p.case.cache_dtype))
            if reason is not None:
                return reason
        return None

    def check(self, ctx, kind, impl) -> str | None:
        p, (key_cache, value_cache), sets = ctx
        return check_point(registry.get(OP, impl).run, key_cache, value_cache, sets[0], p.case)

    def call(self, ctx, kind, impl):
        p, (key_cache, value_cache), sets = ctx
        run = registry.get(OP, impl).run
        args = [s.run_args(key_cache, value_cache, p.case.cache_dtype) for s in sets]
        n = len(args)

        def call(i: int) -> None:
            run(*args[i % n])
        return call


BENCH = ReshapeAndCacheFlashBench()


def run_benchmark(num_tokens: int, num_heads: int, head_size: int, block_size: int,
                  num_blocks: int, dtype: torch.dtype, kv_cache_dtype: str, kv_cache_layout: str,
                  num_iters: int, implementation: str, benchmark_mode: str,
                  device: str = "cuda") -> float:
    """Latency in seconds of one call at ``num_tokens``, measured as vLLM's benchmark does.

    vLLM's inputs (RNGs seeded with 42, random key/value, unique random slots, fresh random
    caches, ``k_scale = key.amax() / 64``) and its method: the host clock around each call with a
    ``synchronize`` after it, 3 warm-up calls, the mean of ``num_iters``, the same inputs every
    call (warm L2). ``benchmark_mode="cudagraph"`` captures one call in a CUDA graph and times its
    replays. ``dtype`` is a torch dtype (or "half", "bfloat16", "float"); ``kv_cache_layout`` is
    "NHD", "HND", "packed" or "HND-packed" (or an alias: LBNHC, LBHNC); ``implementation`` is any registered name. Returns NaN where the
    implementation cannot run the case (as vLLM's returns NaN for Triton with HND); raises
    ValueError for an fp8 cache with ``head_size % 16 != 0`` and for more tokens than slots, as
    vLLM's does. The result is not checked against the reference: the command line does that.
    """
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if cache_dtype.is_fp8 and head_size % 16:
        raise ValueError(f"head_size: an fp8 kv-cache needs a multiple of 16, got {head_size}")
    info = registry.get(OP, implementation)
    if benchmark_mode not in ("cudagraph", "no_graph"):
        raise ValueError(f"benchmark_mode: expected 'cudagraph' or 'no_graph', got "
                         f"{benchmark_mode!r}")
    dev = torch.device(device)
    if benchmark_mode == "cudagraph" and dev.type != "cuda":
        raise ValueError(f"benchmark_mode: 'cudagraph' needs a CUDA device, got device={device!r}; "
                         "use 'no_graph'")
    dtype = parse_model_dtype(dtype)
    try:
        layout_alloc(kv_cache_layout)
    except ValueError as e:
        raise ValueError(f"kv_cache_layout: {str(e).removeprefix('layout: ')}") from None
    shape = Case.named_layout(kv_cache_layout, num_tokens=num_tokens, num_heads=num_heads,
                              head_size=head_size, block_size=block_size, num_blocks=num_blocks,
                              dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    (inp,) = make_input_sets(shape, num_tokens, 1, dev)
    key_cache, value_cache = make_caches(shape, dev)
    fill_caches(key_cache, value_cache, shape)
    reason = info.unsupported(inp.key, key_cache, cache_dtype, inp.k_scale, inp.v_scale)
    run_args = inp.run_args(key_cache, value_cache, cache_dtype)
    if reason is None:
        reason = info.prepare(*run_args)
    if reason is not None or (benchmark_mode == "cudagraph" and not info.graph_safe):
        return math.nan
    call = functools.partial(info.run, *run_args)
    t = timing.time_host_sync(call, num_iters, graph=benchmark_mode == "cudagraph", device=dev)
    del call, inp, key_cache, value_cache  # free the cache before the next call allocates one
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return t.mean
