"""``kvwrite-bench rope``: fused RoPE + cache write against kvwrite's own unfused pair.

    kvwrite-bench rope [--num-tokens 1 16 4096 ...] [--model llama-3.1-8b] [--json F] ...
    python benchmarks/kernels/benchmark_fused_rope_kvcache.py     # vLLM's flags and table

Per point (dtype, cache dtype, heads, layout, T) and implementation it times, with the device
timer (a CUDA graph of ``--graph-calls`` calls, CUDA events, median per call):
- ``fused``: fused_rope_and_reshape_cache_flash;
- ``pair``: rotary_embedding then reshape_and_cache_flash (the unfused baseline);
- ``rotary``: rotary_embedding alone;
after checking each implementation's bytes against the torch reference on the same inputs.

Bytes per call (what must move; the L2 can only lower it): fused
``T*(2*Hq*D*e + (2 + k)*H*D*e + 2*H*D*c + rot*t + p + s)`` (query read and written, key read,
written back when ``k`` = 1, value read, both caches written, a table row, position and slot);
the pair reads the key once more: ``+ T*H*D*e``; rotary alone ``T*(2*(Hq + H)*D*e + rot*t + p)``.
``pair bytes / fused bytes`` is the most the fusion can gain once both are bandwidth-bound.

By default the inputs rotate over enough sets that the bytes a call touches in them (each once:
in-place rows count once) exceed twice the L2 for every kind timed (cold L2; at most one set per
call of the timed graph, ``--graph-calls``; a kind whose sets stay smaller, at small T, has the
L2 flushed before each timed run as well); ``--hot-l2`` uses the same inputs every call (vLLM's
condition).

Slots and positions: ``--slots`` (:mod:`kvwrite.bench.slots`) picks the slots; with decode,
prefill or mixed each token's position is its place in its sequence (decode: its context length;
a prefill or the mixed chunk: start..start+n-1; padding: 0), and the pattern keeps every position
below the cos/sin table's ``--max-position`` rows (contexts capped at max_position - 1, the chunk
ending below it), so every real token is rotated and cached and the check covers all of them.
``random`` keeps uniform random positions in ``[0, max_position)``. ``--model`` with decode,
prefill or mixed takes the seed benchmark's serving shape (:class:`kvwrite.bench.models.ServingShape`),
a table of the model's context window and, on a GPU, vLLM's 65536 cache blocks; flags given win.
Padding tokens (-1 slots) are rotated (their positions are in the table) but write no cache row:
the bytes count the cache writes and value reads of the real tokens only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import random
import shlex
import sys

import torch

from .. import registry
from ..dtypes import CacheDType, parse_kv_cache_dtype, parse_model_dtype
from ..layouts import KVAlloc, Layout, allocate_kv_cache, fill_uniform
from ..ops.fused_rope_and_reshape_cache_flash import OP as FUSED
from ..ops.reshape_and_cache_flash import OP as WRITE
from ..ops.rotary_embedding import OP as ROPE
from ..testing.rope import cos_sin_table
from . import report
from .cli import (
    add_launch_flags,
    add_slot_flags,
    check_output_paths,
    given_flags,
    launch_line,
    slot_pattern,
)
from .models import MODELS, get_model, serving_flags
from .slots import SlotPattern, make_slots
from .timing import (
    copy_bandwidth,
    floor_line,
    l2_bytes,
    l2_rotation,
    launch_floor,
    time_cpu,
    time_device,
)

__all__ = ["RopeRow", "main", "vllm_main", "point_bytes"]

SEED = 42
NUM_BLOCKS = 256
# --model with a sequence slot pattern on a GPU: the seed benchmark's (vLLM's) cache size, so that
# decode contexts are not capped by the blocks each sequence can own.
SERVING_NUM_BLOCKS = 128 * 512


@dataclasses.dataclass
class RopeRow:
    kind: str                # fused, pair or rotary
    implementation: str      # "fused:cuda" etc. (the plot's series)
    impl: str
    layout: str
    dtype: str
    kv_cache_dtype: str
    num_q_heads: int
    num_heads: int
    head_size: int
    rot_dim: int
    is_neox: bool
    model: str
    num_tokens: int
    slots: str               # slot pattern: random, decode, prefill or mixed (bench.slots)
    slot_params: str         # the pattern and its parameters
    pad_fraction: float
    max_position: int        # rows of the cos/sin table
    num_blocks: int
    block_size: int
    l2: str
    rotation_sets: int
    calls_per_sample: int
    samples: int
    latency_us: float
    p20_us: float
    p80_us: float
    bytes: int
    gbps: float
    pct_copy_bw: float
    copy_bw_gbps: float
    check: str
    status: str
    device: str


@dataclasses.dataclass(frozen=True)
class Point:
    dtype: torch.dtype
    cache_dtype: CacheDType
    num_q_heads: int
    num_heads: int
    head_size: int
    rot_dim: int
    is_neox: bool
    layout: str
    num_tokens: int
    num_blocks: int
    block_size: int
    max_position: int
    model: str = ""
    slots: SlotPattern = SlotPattern()

    @property
    def cache_bytes(self) -> int:
        return self.cache_dtype.element_size(self.dtype)


def point_bytes(p: Point, kind: str, key_in_place: bool = True) -> int:
    """Bytes one call must move. Every token is rotated; the value read and the cache writes (and
    the pair's second key read) are the n real tokens' only (padding slots write nothing)."""
    e, c, t = p.dtype.itemsize, p.cache_bytes, 4  # float32 table
    T, Hq, H, D = p.num_tokens, p.num_q_heads, p.num_heads, p.head_size
    n = T - p.slots.num_padding(T)
    if kind == "rotary":
        return T * (2 * (Hq + H) * D * e + p.rot_dim * t + 8)
    fused = (T * (2 * Hq * D * e + (1 + int(key_in_place)) * H * D * e + p.rot_dim * t + 8 + 8)
             + n * (H * D * e + 2 * H * D * c))
    return fused + (n * H * D * e if kind == "pair" else 0)


def _layout_alloc(name: str) -> tuple[Layout, KVAlloc]:
    if name == "packed":
        return Layout.NHD, KVAlloc.PACKED
    return Layout(name), KVAlloc.INTERLEAVED


@dataclasses.dataclass
class _Set:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


def _make_sets(p: Point, count: int, device, gen) -> list[_Set]:
    """``count`` input sets; the slots are ``p.slots``'s, the positions the sequences' (random:
    uniform in the table). Raises ValueError where the pattern does not fit the cache."""
    sets = []
    random.seed(SEED)  # the random pattern's stream (make_slots)
    for i in range(count):
        T = p.num_tokens
        qkv = torch.randn(T, p.num_q_heads + 2 * p.num_heads, p.head_size, device=device,
                          generator=gen, dtype=torch.float32).to(p.dtype)
        hq, h = p.num_q_heads, p.num_heads
        batch = make_slots(p.slots, T, p.num_blocks, p.block_size, set_index=i)
        pos = batch.positions()
        if pos is None:
            positions = torch.randint(0, p.max_position, (T,), device=device, generator=gen)
        else:
            positions = torch.from_numpy(pos).to(device)
        sets.append(_Set(qkv[:, :hq], qkv[:, hq:hq + h], qkv[:, hq + h:], positions,
                         torch.from_numpy(batch.slots).to(device)))
    return sets


def _caches(p: Point, device, gen):
    layout, alloc = _layout_alloc(p.layout)
    cdt = torch.uint8 if p.cache_dtype.is_fp8 else p.cache_dtype.element_dtype(p.dtype)
    kc, vc = allocate_kv_cache(p.num_blocks, p.block_size, p.num_heads, p.head_size, cdt, layout,
                               alloc, device)
    bound = p.head_size**-0.5
    fill_uniform(kc, p.cache_dtype, -bound, bound, gen)
    fill_uniform(vc, p.cache_dtype, -bound, bound, gen)
    return kc, vc


def _callers(p: Point, impl: str, kind: str, sets, caches, table, scales):
    kc, vc = caches
    ks, vs = scales
    kv = p.cache_dtype.value

    def fused(i):
        s = sets[i % len(sets)]
        kvwrite_fused(s.query, s.key, s.value, s.positions, table, p.is_neox, kc, vc, s.slots,
                      ks, vs, kv, implementation=impl)

    def pair(i):
        s = sets[i % len(sets)]
        kvwrite_rope(s.positions, s.query, s.key, p.head_size, table, p.is_neox,
                     implementation=impl)
        kvwrite_write(s.key, s.value, kc, vc, s.slots, kv, ks, vs, implementation=impl)

    def rotary(i):
        s = sets[i % len(sets)]
        kvwrite_rope(s.positions, s.query, s.key, p.head_size, table, p.is_neox,
                     implementation=impl)

    return {"fused": fused, "pair": pair, "rotary": rotary}[kind]


def kvwrite_fused(*a, **k):
    from .. import fused_rope_and_reshape_cache_flash
    fused_rope_and_reshape_cache_flash(*a, **k)


def kvwrite_rope(*a, **k):
    from .. import rotary_embedding
    rotary_embedding(*a, **k)


def kvwrite_write(*a, **k):
    from .. import reshape_and_cache_flash
    reshape_and_cache_flash(*a, **k)


def _check(p: Point, impl: str, kind: str, device, table, scales) -> str | None:
    """None when ``impl`` writes the torch reference's bytes on one input set, else what
    differs."""
    outs = []
    for name in (impl, "torch"):
        gen = torch.Generator(device=device).manual_seed(SEED)
        sets = _make_sets(p, 1, device, gen)
        caches = _caches(p, device, gen)
        ref_kind = "pair" if kind == "pair" else kind
        _callers(p, name, ref_kind, sets, caches, table, scales)(0)
        s = sets[0]
        outs.append([s.query, s.key, *caches])
    torch.cuda.synchronize() if device.type == "cuda" else None
    for what, a, b in zip(("query", "key", "key_cache", "value_cache"), *outs, strict=True):
        if kind == "rotary" and what.endswith("cache"):
            continue
        ab = a.contiguous().view(torch.uint8) if a.dtype != torch.uint8 else a.contiguous()
        bb = b.contiguous().view(torch.uint8) if b.dtype != torch.uint8 else b.contiguous()
        if not torch.equal(ab, bb):
            return f"{what}: {int((ab != bb).sum())} bytes differ from the torch reference"
    return None


def set_footprint(p: Point, kind: str) -> int:
    """Bytes of one input set that a ``kind`` call touches (each once, however often it reads
    or writes them): the query and key rows and the positions for ``rotary``, also the value
    rows and the slots for ``fused`` and ``pair``. The caches and the table are shared by the
    sets."""
    rows = p.num_q_heads + p.num_heads + (0 if kind == "rotary" else p.num_heads)
    per_token = rows * p.head_size * p.dtype.itemsize + 8 + (0 if kind == "rotary" else 8)
    return p.num_tokens * per_token


def rotation(p: Point, args, l2: int, kinds=("fused", "pair", "rotary")
             ) -> tuple[int, dict[str, bool]]:
    """(input sets, {kind: flush the L2 before each timed run}) for a point: the sets of
    :func:`timing.l2_rotation` for the kind that touches the fewest bytes of a set, at most one
    per call of the timed graph (call ``i`` takes set ``i % sets`` and a graph replays only its
    ``--graph-calls`` calls); a kind whose sets together stay under twice the L2 is flushed."""
    least = min(set_footprint(p, k) for k in kinds)
    sets, _ = l2_rotation(args.hot_l2, least, l2, args.graph_calls)
    return sets, {k: not args.hot_l2 and sets * set_footprint(p, k) < 2 * l2 for k in kinds}


def measure(p: Point, impls: list[str], kinds: list[str], args, device, copy_bw: float,
            env_device: str) -> list[RopeRow]:
    gen = torch.Generator(device=device).manual_seed(SEED)
    table = cos_sin_table(p.max_position, p.rot_dim, torch.float32, device=device)
    scales = (None, None)
    if p.cache_dtype.is_fp8:
        scales = (torch.full((1,), 0.05, device=device), torch.full((1,), 0.04, device=device))
    l2 = l2_bytes(device)
    count, flush = rotation(p, args, l2, kinds)
    flush_buf = None
    if any(flush.values()) and device.type == "cuda":
        flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=device)
    try:
        sets = _make_sets(p, count, device, gen)
    except ValueError as e:  # the slot pattern does not fit the cache
        sets, skipped = None, f"skipped: {e}"
    caches = _caches(p, device, gen) if sets else None
    rows = []
    for kind in kinds:
        for impl in impls:
            op = {"fused": FUSED, "pair": WRITE, "rotary": ROPE}[kind]
            status, check, timing = "ok", "skipped", None
            info = registry.get(op, impl)
            reason = info.available(device)
            if (reason is None and not info.graph_safe and args.graph
                    and device.type == "cuda"):
                reason = "not graph-safe (syncs with the host)"
            if kind == "pair" and reason is None:
                r2 = registry.get(ROPE, impl)
                reason = r2.available(device)
            if sets is None:
                status = skipped
            elif reason is not None:
                status = f"unsupported: {reason}"
            else:
                try:
                    bad = _check(p, impl, kind, device, table, scales)
                    check = "passed" if bad is None else "failed"
                    if bad is not None:
                        status = f"mismatch: {bad}"
                    else:
                        call = _callers(p, impl, kind, sets, caches, table, scales)
                        if device.type == "cuda":
                            timing = time_device(call, args.graph_calls, args.iters,
                                                 graph=args.graph,
                                                 flush=flush_buf if flush[kind] else None,
                                                 budget_s=args.time_budget)
                        else:
                            timing = time_cpu(call, args.graph_calls, args.iters,
                                              budget_s=args.time_budget)
                except Exception as e:  # reported in the row, the sweep goes on
                    status = f"error: {type(e).__name__}: {e}"
            nbytes = point_bytes(p, kind)
            lat = timing.median * 1e6 if timing else math.nan
            gbps = nbytes / lat / 1e3 if timing else math.nan
            rows.append(RopeRow(
                kind=kind, implementation=f"{kind}:{impl}", impl=impl, layout=p.layout,
                dtype=str(p.dtype).removeprefix("torch."), kv_cache_dtype=p.cache_dtype.value,
                num_q_heads=p.num_q_heads, num_heads=p.num_heads, head_size=p.head_size,
                rot_dim=p.rot_dim, is_neox=p.is_neox, model=p.model, num_tokens=p.num_tokens,
                slots=p.slots.kind, slot_params=p.slots.describe(),
                pad_fraction=p.slots.pad_fraction, max_position=p.max_position,
                num_blocks=p.num_blocks, block_size=p.block_size,
                l2="hot" if args.hot_l2 else "rotated", rotation_sets=count,
                calls_per_sample=args.graph_calls, samples=len(timing.samples) if timing else 0,
                latency_us=lat, p20_us=timing.quantile(0.2) * 1e6 if timing else math.nan,
                p80_us=timing.quantile(0.8) * 1e6 if timing else math.nan, bytes=nbytes,
                gbps=gbps, pct_copy_bw=100 * gbps * 1e9 / copy_bw if timing else math.nan,
                copy_bw_gbps=copy_bw / 1e9, check=check, status=status, device=env_device))
    return rows


def _heads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(";"):
        hq, h, d = (int(x) for x in part.split(","))
        out.append((hq, h, d))
    return out


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Benchmark fused_rope_and_reshape_cache_flash against kvwrite's unfused pair "
        "(rotary_embedding + reshape_and_cache_flash) and rotary_embedding alone."))
    p.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 128, 2048])
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"cache blocks, raised to 2*T/block_size where T needs more (default: "
                        f"{NUM_BLOCKS}; {SERVING_NUM_BLOCKS} on a GPU with --model and a decode, "
                        f"prefill or mixed --slots)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=200, help="timed samples at most")
    p.add_argument("--warmup", type=int, default=10,
                   help="accepted for vLLM compatibility; the device timer warms up by itself")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3")
    p.add_argument("--heads", default="32,32,128;32,8,128",
                   help="semicolon list of Hq,H,D (default: MHA(32,32,128) and GQA(32,8,128))")
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="heads and head size of a preset (32 query heads per 8 KV heads); with "
                        "--slots decode, prefill or mixed also the seed benchmark's serving shape "
                        "(T, contexts up to the context window, a table of that many rows)")
    p.add_argument("--rot-dim", type=int, default=None, help="(default: head size)")
    p.add_argument("--gptj", action="store_true", help="GPT-J pairing instead of neox")
    p.add_argument("--max-position", type=int, default=4096,
                   help="rows of the cos/sin table; positions stay below it (default: 4096; the "
                        "model's context window with --model and a sequence --slots pattern)")
    p.add_argument("--layouts", default="NHD", help="comma list of NHD, HND, packed")
    p.add_argument("--implementation", default="all",
                   help="comma list of implementations or 'all' (those available)")
    p.add_argument("--kinds", default="fused,pair,rotary")
    p.add_argument("--hot-l2", action="store_true")
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--no-graph", dest="graph", action="store_false")
    p.add_argument("--time-budget", type=float, default=0.5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None)
    add_slot_flags(p)
    add_launch_flags(p)
    return p


def apply_serving_shape(args, given: set[str]) -> None:
    """``--model`` with a decode, prefill or mixed pattern: the serving shape's flags
    (:func:`kvwrite.bench.models.serving_flags`; those in ``given`` win), a table of the model's
    context window, and on a GPU :data:`SERVING_NUM_BLOCKS` blocks unless --num-blocks is given.
    Then --num-blocks takes its default where unset."""
    if args.model:
        flags = serving_flags(args.model, args.slots, given)
        for dest, value in flags.items():
            setattr(args, dest, value)
        if flags and args.num_blocks is None and torch.device(args.device).type == "cuda":
            args.num_blocks = SERVING_NUM_BLOCKS
    if args.num_blocks is None:
        args.num_blocks = NUM_BLOCKS


def pattern_of(args) -> SlotPattern:
    """The slot pattern of ``args``; sequence patterns keep positions below the table's rows."""
    return slot_pattern(args, None if args.slots == "random" else args.max_position)


def _points(args) -> list[Point]:
    heads = _heads(args.heads)
    pattern = pattern_of(args)
    model = ""
    if args.model:
        m = get_model(args.model)
        heads, model = [(m.num_kv_heads * 4, m.num_kv_heads, m.head_dim)], m.name
    pts = []
    for dt in args.dtypes.split(","):
        for kv in args.kv_cache_dtypes.split(","):
            for hq, h, d in heads:
                for layout in args.layouts.split(","):
                    for T in args.num_tokens:
                        nb = max(args.num_blocks or NUM_BLOCKS, -(-2 * T // args.block_size))
                        pts.append(Point(parse_model_dtype(dt), parse_kv_cache_dtype(kv), hq, h,
                                         d, args.rot_dim or d, not args.gptj, layout, T, nb,
                                         args.block_size, args.max_position, model, pattern))
    return pts


def _impls(text: str, device) -> list[str]:
    if text != "all":
        return text.split(",")
    return [i.name for i in registry.all_impls(FUSED) if i.available(device) is None
            and (i.graph_safe or device.type != "cuda")]


def run_rows(args, progress=lambda s: None) -> tuple[list[RopeRow], float, str]:
    device = torch.device(args.device)
    env_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    copy_bw = copy_bandwidth(device, 256 << 20)
    impls = _impls(args.implementation, device)
    rows = []
    for p in _points(args):
        progress(f"{str(p.dtype).removeprefix('torch.')} {p.cache_dtype.value} "
                 f"({p.num_q_heads},{p.num_heads},{p.head_size}) {p.layout} N={p.num_tokens}")
        rows += measure(p, impls, args.kinds.split(","), args, device, copy_bw, env_device)
    return rows, copy_bw, env_device


def _us(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2f}"


def summary_table(rows: list[RopeRow]) -> str:
    """One line per point: every implementation's fused and pair µs, the best pair / best fused
    speedup, the byte-count bound (pair bytes / fused bytes) and % of copy bandwidth."""
    keys = list(dict.fromkeys((r.dtype, r.kv_cache_dtype, r.num_q_heads, r.num_heads,
                               r.head_size, r.layout, r.num_tokens) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    headers = ["dtype", "cache", "heads", "layout", "N"]
    headers += [f"{k} {i} µs" for k in ("fused", "pair", "rotary") for i in impls
                if any(r.kind == k and r.impl == i for r in rows)]
    headers += ["best pair/fused", "bound", "fused %BW", "rotary %BW"]
    out = []
    for key in keys:
        pr = [r for r in rows if (r.dtype, r.kv_cache_dtype, r.num_q_heads, r.num_heads,
                                  r.head_size, r.layout, r.num_tokens) == key]
        by = {(r.kind, r.impl): r for r in pr}
        line = [key[0], key[1], f"({key[2]},{key[3]},{key[4]})", key[5], key[6]]
        line += [_us(by[(k, i)].latency_us) for k in ("fused", "pair", "rotary") for i in impls
                 if any(r.kind == k and r.impl == i for r in rows)]

        def best(kind, pr=pr):
            c = [r for r in pr if r.kind == kind and not math.isnan(r.latency_us)]
            return min(c, key=lambda r: r.latency_us) if c else None
        bf, bp, br = best("fused"), best("pair"), best("rotary")
        line.append(f"{bp.latency_us / bf.latency_us:.2f}x" if bf and bp else "nan")
        line.append(f"{bp.bytes / bf.bytes:.3f}x" if bf and bp else "nan")
        line.append(f"{bf.pct_copy_bw:.1f}" if bf else "nan")
        line.append(f"{br.pct_copy_bw:.1f}" if br else "nan")
        out.append(line)
    return report.format_table(headers, out)


def main(argv: list[str] | None = None, prog: str = "kvwrite-bench rope") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        apply_serving_shape(args, given_flags(parser, argv))
        pattern = pattern_of(args)
        check_output_paths(args)  # results are never lost to a bad path after the sweep
    except ValueError as e:
        parser.error(str(e))
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: error: --device cuda: no CUDA GPU visible to PyTorch", file=sys.stderr)
        return 2
    launch = launch_line(args, torch.device(args.device))
    rows, copy_bw, dev = run_rows(args, lambda s: print(s, file=sys.stderr))
    floor = launch_floor(torch.device(args.device))
    top = max(args.num_tokens)
    header = [
        f"{dev}, torch {torch.__version__}, copy bandwidth {copy_bw / 1e9:.0f} GB/s, device timer "
        f"({args.graph_calls} calls per CUDA graph, median), L2 "
        + ("hot" if args.hot_l2 else
           "rotated (input sets past 2x the L2; flushed before each run when fewer)"),
        "slots: " + pattern.explain(top, max(args.num_blocks, -(-2 * top // args.block_size)),
                                    args.block_size),
        "positions: " + (f"uniform random in [0, {args.max_position})" if pattern.kind == "random"
                         else f"each token's position in its sequence (padding: 0), all below "
                              f"the cos/sin table's {args.max_position} rows: every real token is "
                              f"rotated and cached, and checked"),
        launch,
    ]
    if torch.device(args.device).type == "cuda":
        header.insert(1, floor_line(floor))
    print("\n".join("# " + h for h in header))
    print(summary_table(rows))
    bad = [r for r in rows if r.status.startswith(("mismatch", "error"))]
    for r in rows:
        if r.status != "ok" and not r.status.startswith("unsupported"):
            print(f"# {r.implementation} N={r.num_tokens} {r.layout}: {r.status}")
    command = f"{prog} {shlex.join(argv)}"
    if args.json:
        report.write_json(args.json, rows, {"command": command, "device": dev,
                                            "copy_bw_gbps": copy_bw / 1e9, "header": header,
                                            "launch_floor_us": None if floor is None
                                            else floor * 1e6,
                                            "slots": pattern.describe(),
                                            "date": datetime.datetime.now().isoformat()})
    if args.csv:
        report.write_csv(args.csv, rows, command)
    if args.plot:
        from .plot import plot_rows
        plot_rows([r for r in rows if r.kind == "fused"], args.plot,
                  f"fused RoPE + cache write | slots {pattern.describe()} | {dev}")
    return 1 if bad else 0


def vllm_main(argv: list[str] | None = None, prog: str = "benchmark_fused_rope_kvcache.py") -> int:
    """vLLM's benchmark_fused_rope_kvcache.py: its flags, matrix, table and sanity lines, with
    kvwrite's rotary_embedding + reshape_and_cache_flash as the unfused side."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 128, 2048])
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--implementation", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    ns = build_parser(prog).parse_args([
        "--num-tokens", *map(str, args.num_tokens), "--num-blocks", str(args.num_blocks),
        "--iters", str(args.iters), "--implementation", args.implementation,
        "--kinds", "fused,pair", "--hot-l2"])
    rows, copy_bw, dev = run_rows(ns)
    table = []
    speed = {}
    for r in rows:
        if r.kind != "fused":
            continue
        pair = next(x for x in rows if x.kind == "pair" and x.impl == r.impl
                    and (x.dtype, x.kv_cache_dtype, x.num_q_heads, x.num_heads, x.num_tokens)
                    == (r.dtype, r.kv_cache_dtype, r.num_q_heads, r.num_heads, r.num_tokens))
        sp = pair.latency_us / r.latency_us
        speed.setdefault(r.num_tokens, []).append(sp)
        kind = "MHA" if r.num_q_heads == r.num_heads else "GQA"
        table.append([r.dtype, r.kv_cache_dtype, f"{kind}({r.num_q_heads},{r.num_heads},"
                      f"{r.head_size})", r.num_tokens, _us(pair.latency_us),
                      _us(r.latency_us), f"{sp:.2f}x"])
    print(f"# {dev}; device timer, hot L2; unfused = kvwrite rotary_embedding + "
          f"reshape_and_cache_flash ({args.implementation})")
    print(report.format_table(["dtype", "cache", "heads", "N", "unfused (µs)", "fused (µs)",
                               "speedup"], table))
    ok = True
    for n, need in ((1, 2.0), (2048, 1.3)):
        if n in speed:
            worst = min(speed[n])
            passed = worst >= need
            ok &= passed
            print(f"sanity: N={n} speedup >= {need}x: {'PASS' if passed else 'FAIL'} "
                  f"(min {worst:.2f}x)")
    if args.json:
        report.write_json(args.json, rows, {"command": f"{prog} {shlex.join(sys.argv[1:])}",
                                            "device": dev, "copy_bw_gbps": copy_bw / 1e9})
    return 0 if ok else 1
