"""fused_rope_and_reshape_cache_flash's benchmark on the engine (``kvwrite-bench rope``): the fused
op against kvwrite's own unfused pair and rotary_embedding alone.

Kinds timed at each point (dtype, cache dtype, heads, layout, T):
- ``fused``: fused_rope_and_reshape_cache_flash;
- ``pair``: rotary_embedding then reshape_and_cache_flash (the unfused baseline);
- ``rotary``: rotary_embedding alone;
after checking each implementation's bytes against the torch reference on the same inputs.

Bytes per call (what must move): fused ``T*(2*Hq*D*e + (2 + k)*H*D*e + 2*H*D*c + rot*t + p + s)``
(query read and written, key read, written back when ``k`` = 1, value read, both caches written, a
table row, position and slot; the value read and cache writes count the real tokens only); the
pair reads the key once more: ``+ N*H*D*e``; rotary alone ``T*(2*(Hq + H)*D*e + rot*t + p)``.
``pair bytes / fused bytes`` is the most the fusion can gain once both are bandwidth-bound.

Slots and positions: with decode, prefill or mixed ``--slots`` each token's position is its place
in its sequence (padding: 0), below the table's ``--max-position`` rows; random keeps uniform
random positions. ``--model`` takes the preset's heads (32 query heads per 8 KV heads) and, with a
sequence pattern, the serving shape, a table of the model's context window and, on a GPU, vLLM's
65536 cache blocks; flags given win. :func:`vllm_main` is vLLM's benchmark_fused_rope_kvcache.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shlex
import sys

import torch

from ...dtypes import CacheDType, parse_kv_cache_dtype, parse_model_dtype
from ...layouts import allocate_kv_cache, fill_uniform, layout_alloc, parse_layout_names
from ...ops.fused_rope_and_reshape_cache_flash import OP as FUSED
from ...ops.reshape_and_cache_flash import OP as WRITE
from ...ops.rotary_embedding import OP as ROPE
from ...testing.rope import cos_sin_table
from ...testing.slots import SlotPattern, make_slots
from .. import engine, report
from ..engine import OpBench, parse_list, slot_pattern
from ..models import apply_serving_flags, get_model

# The names after vllm_main are shared with qk-norm-rope's benchmark.
__all__ = ["BENCH", "Point", "point_bytes", "set_footprint", "make_sets", "vllm_main", "HeadsPoint",
           "rope_write_bytes", "positions_and_slots", "FP8_SCALES", "fp8_scales", "first_difference",
           "add_cache_dtypes_flag", "add_layouts_flag"]

SEED = 42
NUM_BLOCKS = 256
# --model with a sequence slot pattern on a GPU: vLLM's cache size, so that decode contexts are
# not capped by the blocks each sequence can own.
SERVING_NUM_BLOCKS = 128 * 512
KINDS = ("fused", "pair", "rotary")


@dataclasses.dataclass(frozen=True)
class HeadsPoint:
    """The fields that lead a point of the RoPE + cache write benchmarks (this one's and
    qk-norm-rope's): the dtypes and the heads."""
    dtype: torch.dtype
    cache_dtype: CacheDType
    num_q_heads: int
    num_heads: int           # KV heads (= value heads)
    head_size: int

    @property
    def cache_bytes(self) -> int:
        return self.cache_dtype.element_size(self.dtype)


@dataclasses.dataclass(frozen=True)
class Point(HeadsPoint):
    rot_dim: int
    is_neox: bool
    layout: str
    num_tokens: int
    num_blocks: int
    block_size: int
    max_position: int
    model: str = ""
    slots: SlotPattern = SlotPattern()


def rope_write_bytes(p, kind: str, table_row: int, key_in_place: bool = True) -> int:
    """Bytes one call of a RoPE + cache write benchmark must move (``p``: a :class:`HeadsPoint`
    with ``num_tokens`` and ``slots``; ``table_row``: the bytes of a cos/sin table row read per
    token): ``fused``, ``pair`` (the key read once more) or any other kind, the rotation alone.
    Every token is rotated; the value read and the cache writes (and the pair's second key read)
    are the n real tokens' only (padding slots write nothing)."""
    e, c = p.dtype.itemsize, p.cache_bytes
    T, Hq, H, D = p.num_tokens, p.num_q_heads, p.num_heads, p.head_size
    n = T - p.slots.num_padding(T)
    if kind not in ("fused", "pair"):
        return T * (2 * (Hq + H) * D * e + table_row + 8)
    fused = (T * (2 * Hq * D * e + (1 + int(key_in_place)) * H * D * e + table_row + 8 + 8)
             + n * (H * D * e + 2 * H * D * c))
    return fused + (n * H * D * e if kind == "pair" else 0)


def point_bytes(p: Point, kind: str, key_in_place: bool = True) -> int:
    """Bytes one call must move (:func:`rope_write_bytes`, a float32 table of ``rot_dim``)."""
    return rope_write_bytes(p, kind, p.rot_dim * 4, key_in_place)


def set_footprint(p: Point, kind: str) -> int:
    """Bytes of one input set that a ``kind`` call touches (each once, however often it reads
    or writes them): the query and key rows and the positions for ``rotary``, also the value
    rows and the slots for ``fused`` and ``pair``. The caches and the table are shared."""
    rows = p.num_q_heads + p.num_heads + (0 if kind == "rotary" else p.num_heads)
    per_token = rows * p.head_size * p.dtype.itemsize + 8 + (0 if kind == "rotary" else 8)
    return p.num_tokens * per_token


@dataclasses.dataclass
class InputSet:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


def positions_and_slots(p, set_index: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Input set ``set_index``'s positions and slots: ``p.slots``'s slots (make_slots), the
    positions the sequences' (random: uniform below ``p.max_position``, drawn from ``gen``).
    Raises ValueError where the pattern does not fit the cache."""
    T = p.num_tokens
    batch = make_slots(p.slots, T, p.num_blocks, p.block_size, set_index=set_index)
    pos = batch.positions()
    if pos is None:
        positions = torch.randint(0, p.max_position, (T,), device=device, generator=gen)
    else:
        positions = torch.from_numpy(pos).to(device)
    return positions, torch.from_numpy(batch.slots).to(device)


def make_sets(p: Point, count: int, device, gen) -> list[InputSet]:
    """``count`` input sets; the slots are ``p.slots``'s, the positions the sequences' (random:
    uniform in the table). Raises ValueError where the pattern does not fit the cache."""
    sets = []
    random.seed(SEED)  # the random pattern's stream (make_slots)
    for i in range(count):
        T = p.num_tokens
        qkv = torch.randn(T, p.num_q_heads + 2 * p.num_heads, p.head_size, device=device,
                          generator=gen, dtype=torch.float32).to(p.dtype)
        hq, h = p.num_q_heads, p.num_heads
        sets.append(InputSet(qkv[:, :hq], qkv[:, hq:hq + h], qkv[:, hq + h:],
                             *positions_and_slots(p, i, device, gen)))
    return sets


# The benchmarks' fp8 cache scales (k, v), unless a run sets others (qk-norm-rope --fp8-scales).
FP8_SCALES = (0.05, 0.04)


def fp8_scales(p, device, values: tuple[float, float] = FP8_SCALES) -> tuple:
    """(k_scale, v_scale) tensors of ``values`` for the point's fp8 caches; (None, None) for
    other caches."""
    if not p.cache_dtype.is_fp8:
        return None, None
    return tuple(torch.full((1,), x, device=device) for x in values)


def first_difference(names, got, want) -> str | None:
    """None when each pair of tensors holds the same bytes, else the first that differs, named
    by ``names``."""
    for what, a, b in zip(names, got, want, strict=True):
        ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        if not torch.equal(ab, bb):
            return f"{what}: {int((ab != bb).sum())} bytes differ from the torch reference"
    return None


def make_caches(p: Point, device, gen):
    layout, alloc = layout_alloc(p.layout)
    cdt = torch.uint8 if p.cache_dtype.is_fp8 else p.cache_dtype.element_dtype(p.dtype)
    kc, vc = allocate_kv_cache(p.num_blocks, p.block_size, p.num_heads, p.head_size, cdt, layout,
                               alloc, device)
    bound = p.head_size**-0.5
    fill_uniform(kc, p.cache_dtype, -bound, bound, gen)
    fill_uniform(vc, p.cache_dtype, -bound, bound, gen)
    return kc, vc


def kind_call(p: Point, impl: str, kind: str, sets, caches, table, scales):
    """``call(i)`` of one kind, through the public ops (validation included, as a user calls)."""
    from ... import fused_rope_and_reshape_cache_flash, reshape_and_cache_flash, rotary_embedding

    kc, vc = caches
    ks, vs = scales
    kv = p.cache_dtype.value

    def fused(i):
        s = sets[i % len(sets)]
        fused_rope_and_reshape_cache_flash(s.query, s.key, s.value, s.positions, table, p.is_neox,
                                           kc, vc, s.slots, ks, vs, kv, implementation=impl)

    def pair(i):
        s = sets[i % len(sets)]
        rotary_embedding(s.positions, s.query, s.key, p.head_size, table, p.is_neox,
                         implementation=impl)
        reshape_and_cache_flash(s.key, s.value, kc, vc, s.slots, kv, ks, vs, implementation=impl)

    def rotary(i):
        s = sets[i % len(sets)]
        rotary_embedding(s.positions, s.query, s.key, p.head_size, table, p.is_neox,
                         implementation=impl)

    return {"fused": fused, "pair": pair, "rotary": rotary}[kind]


def check(p: Point, impl: str, kind: str, device, table, scales, caller=kind_call) -> str | None:
    """None when ``impl`` writes the torch reference's bytes (query, key, caches) on one fresh
    input set, else what differs."""
    outs = []
    for name in (impl, "torch"):
        gen = torch.Generator(device=device).manual_seed(SEED)
        sets = make_sets(p, 1, device, gen)
        caches = make_caches(p, device, gen)
        caller(p, name, kind, sets, caches, table, scales)(0)
        s = sets[0]
        outs.append([s.query, s.key, *caches])
    keep = 2 if kind == "rotary" else 4  # rotary alone writes no cache
    got, want = (o[:keep] for o in outs)
    return first_difference(("query", "key", "key_cache", "value_cache")[:keep], got, want)


def add_cache_dtypes_flag(g) -> None:
    """--kv-cache-dtypes of the RoPE + cache write benchmarks (this one's and qk-norm-rope's)."""
    g.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3",
                   help="comma list of cache dtypes: auto, bfloat16, float16, float32, fp8, "
                        "fp8_e4m3, fp8_e5m2 (default: auto,fp8_e4m3)")


def add_layouts_flag(g, see: str = "") -> None:
    """--layouts of the RoPE + cache write benchmarks; ``see``: a reference in its help."""
    g.add_argument("--layouts", default="NHD,packed,HND-packed",
                   help=f"comma list of NHD, HND, packed (alias LBNHC), HND-packed (alias LBHNC) "
                        f"or all{see} (default: NHD,packed,HND-packed: NHD and vLLM's two "
                        f"default per-layer orders)")


def parse_heads(text: str) -> list[tuple[int, int, int]]:
    """``--heads``: a semicolon list of Hq,H,D."""
    out = []
    for part in text.split(";"):
        try:
            hq, h, d = (int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"--heads: expected a semicolon list of Hq,H,D (positive integers, "
                             f"e.g. 32,8,128;32,32,128), got {text!r}") from None
        if min(hq, h, d) < 1:
            raise ValueError(f"--heads: expected positive head counts and head size, got {part!r}")
        out.append((hq, h, d))
    return out


class FusedRopeBench(OpBench):
    name = FUSED
    summary = "RoPE + cache write: fused, the unfused pair, rotary_embedding alone"
    description = ("Benchmark fused_rope_and_reshape_cache_flash against kvwrite's unfused pair "
                   "(rotary_embedding + reshape_and_cache_flash) and rotary_embedding alone.")
    op = FUSED
    kinds = KINDS
    ops_of_kind = {"fused": (FUSED,), "pair": (ROPE, WRITE), "rotary": (ROPE,)}
    has_slots = True
    has_model = True
    defaults = {"num_tokens": "1,8,128,2048", "implementation": "all", "iters": 200,
                "time_budget": 0.5}
    # One layout on the CPU, as before the vLLM orders joined the defaults: a small shape that
    # runs in seconds.
    cpu_defaults = {"layouts": "NHD", "heads": "8,2,64", "dtypes": "bfloat16",
                    "kv_cache_dtypes": "auto,fp8_e4m3", "num_tokens": "1,16,64", "iters": 5,
                    "graph_calls": 2, "time_budget": 0.05}
    columns = (("dtype", "dtype"), ("kv_cache_dtype", "cache"), ("heads", "heads"),
               ("layout", "layout"), ("num_tokens", "N"))
    always_columns = ("dtype", "kv_cache_dtype", "heads", "layout", "num_tokens")

    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points")
        g.add_argument("--dtypes", default="bfloat16,float16",
                       help="comma list of query/key/value dtypes (default: bfloat16,float16)")
        add_cache_dtypes_flag(g)
        g.add_argument("--heads", default="32,32,128;32,8,128",
                       help="semicolon list of Hq,H,D (default: MHA(32,32,128) and GQA(32,8,128))")
        g.add_argument("--rot-dim", type=int, default=None,
                       help="rotated dims, even, at most the head size (default: the head size)")
        g.add_argument("--gptj", action="store_true", help="GPT-J pairing instead of neox")
        g.add_argument("--max-position", type=int, default=4096,
                       help="rows of the cos/sin table; positions stay below it (default: 4096; "
                            "the model's context window with --model and a sequence --slots)")
        add_layouts_flag(g, " (docs/benchmark.md)")
        g.add_argument("--num-blocks", type=int, default=None,
                       help=f"cache blocks, raised at each T to twice the blocks its slot "
                            f"pattern needs where that is more "
                            f"(default: {NUM_BLOCKS}; {SERVING_NUM_BLOCKS} on a GPU with --model "
                            f"and a decode, prefill or mixed --slots)")
        g.add_argument("--block-size", type=int, default=16, help="(default: 16)")

    def configure(self, args, device) -> None:
        if args.model:
            if "heads" in args.explicit:
                raise ValueError("--model: sets --heads; got --heads too")
            flags = apply_serving_flags(args)
            if flags and args.num_blocks is None and device.type == "cuda":
                args.num_blocks = SERVING_NUM_BLOCKS
            m = get_model(args.model)
            args.heads = f"{m.num_kv_heads * 4},{m.num_kv_heads},{m.head_dim}"
        if args.num_blocks is None:
            args.num_blocks = NUM_BLOCKS
        engine.require_positive(args, ("num_blocks", "block_size", "max_position"))
        args.head_list = parse_heads(args.heads)
        if args.rot_dim is not None:
            if args.rot_dim < 2 or args.rot_dim % 2:
                raise ValueError(f"--rot-dim: expected a positive even number, got "
                                 f"{args.rot_dim}")
            small = min(d for _, _, d in args.head_list)
            if args.rot_dim > small:
                raise ValueError(f"--rot-dim: expected at most the head size ({small}), got "
                                 f"{args.rot_dim}")
        args.dtype_list = parse_list(args.dtypes, "--dtypes",
                                     convert=lambda x: parse_model_dtype(x, "--dtypes"))
        args.kv_list = parse_list(args.kv_cache_dtypes, "--kv-cache-dtypes",
                                  convert=parse_kv_cache_dtype)
        args.layout_list = parse_layout_names(args.layouts, "--layouts")
        args.pattern = slot_pattern(args, None if args.slots == "random" else args.max_position)

    def points(self, args) -> list:
        pts = []
        for dt in args.dtype_list:
            for kv in args.kv_list:
                for hq, h, d in args.head_list:
                    for layout in args.layout_list:
                        for t in args.token_counts:
                            nb = args.pattern.cache_blocks(t, args.block_size, args.num_blocks)
                            pts.append(Point(dt, kv, hq, h, d, args.rot_dim or d, not args.gptj,
                                             layout, t, nb, args.block_size, args.max_position,
                                             args.model or "", args.pattern))
        return pts

    def params(self, p: Point) -> dict:
        return dict(layout=p.layout, dtype=str(p.dtype).removeprefix("torch."),
                    kv_cache_dtype=p.cache_dtype.value,
                    heads=f"({p.num_q_heads},{p.num_heads},{p.head_size})",
                    num_q_heads=p.num_q_heads, num_heads=p.num_heads, head_size=p.head_size,
                    rot_dim=p.rot_dim, is_neox=p.is_neox, model=p.model,
                    **engine.slot_params(p.slots), max_position=p.max_position,
                    num_blocks=p.num_blocks, block_size=p.block_size)

    def header(self, args, points) -> list[str]:
        pattern = args.pattern
        return [f"shape: heads (Hq,H,D)={args.heads} rot_dim={args.rot_dim or 'D'} "
                f"{'gptj' if args.gptj else 'neox'} block_size={args.block_size} "
                f"num_blocks={args.num_blocks}",
                engine.slots_line(pattern, points, args.num_blocks, args.block_size, grown=True),
                "positions: " + (f"uniform random in [0, {args.max_position})"
                                 if pattern.kind == "random" else
                                 f"each token's position in its sequence (padding: 0), all below "
                                 f"the cos/sin table's {args.max_position} rows: every real token "
                                 f"is rotated and cached, and checked"),
                "bytes per call: fused = T*(2*Hq*D*e + 2*H*D*e + rot*4 + 16) + N*(H*D*e + "
                "2*H*D*c); pair = fused + N*H*D*e; rotary = T*(2*(Hq+H)*D*e + rot*4 + 8) "
                "(N = T less the padding)",
                "columns: best pair/fused = the fastest pair's latency / the fastest fused's; "
                "bound = pair bytes / fused bytes, the most the fusion can gain once both are "
                "bandwidth-bound; fused %BW and rotary %BW = the fastest one's GB/s as a "
                "percentage of the copy bandwidth"]

    def set_bytes(self, p: Point, kind: str) -> int:
        return set_footprint(p, kind)

    def temp_bytes(self, p: Point) -> int:
        return p.max_position * p.rot_dim * 4

    def block_bytes(self, p: Point) -> int:
        # K and V of a block, three times: the benchmark's caches and the check's two.
        return 3 * 2 * p.block_size * p.num_heads * p.head_size * p.cache_bytes

    def bytes(self, p: Point, kind: str) -> int:
        return point_bytes(p, kind)

    def prepare(self, p: Point, count: int, device):
        gen = torch.Generator(device=device).manual_seed(SEED)
        table = cos_sin_table(p.max_position, p.rot_dim, torch.float32, device=device)
        scales = fp8_scales(p, device)
        with engine.skip_unless_fits():
            sets = make_sets(p, count, device, gen)
        return p, sets, make_caches(p, device, gen), table, scales, device

    def check(self, ctx, kind, impl) -> str | None:
        p, _, _, table, scales, device = ctx
        return check(p, impl, kind, device, table, scales)

    def call(self, ctx, kind, impl):
        p, sets, caches, table, scales, _ = ctx
        return kind_call(p, impl, kind, sets, caches, table, scales)

    def extra_columns(self, point_rows) -> list[tuple[str, str]]:
        def best(kind):
            c = [r for r in point_rows if r.kind == kind and not math.isnan(r.latency_us)]
            return min(c, key=lambda r: r.latency_us) if c else None
        bf, bp, br = best("fused"), best("pair"), best("rotary")
        return [("best pair/fused", f"{bp.latency_us / bf.latency_us:.2f}x" if bf and bp
                 else "nan"),
                ("bound", f"{bp.bytes / bf.bytes:.3f}x" if bf and bp else "nan"),
                ("fused %BW", f"{bf.pct_copy_bw:.1f}" if bf else "nan"),
                ("rotary %BW", f"{br.pct_copy_bw:.1f}" if br else "nan")]


BENCH = FusedRopeBench()


def vllm_main(argv: list[str] | None = None, prog: str = "benchmark_fused_rope_kvcache.py") -> int:
    """vLLM's benchmark_fused_rope_kvcache.py: its flags, matrix (bfloat16/float16 x
    auto/fp8_e4m3 x MHA(32,32,128)/GQA(32,8,128), neox), table and sanity lines, with kvwrite's
    rotary_embedding + reshape_and_cache_flash as the unfused side; measured by the engine (hot
    L2, as vLLM measures), each implementation checked first."""
    p = engine.Parser(prog=prog, description=vllm_main.__doc__)
    p.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 128, 2048])
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--implementation", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(engine.normalize_flags(list(sys.argv[1:] if argv is None else argv)))
    inner = ["--num-tokens", ",".join(map(str, args.num_tokens)), "--num-blocks",
             str(args.num_blocks), "--iters", str(args.iters), "--implementation",
             args.implementation, "--kinds", "fused,pair", "--hot-l2"]
    try:
        cfg, ns, points, _ = engine.configure(BENCH, inner, prog)
        if args.json:
            engine.check_output_path("--json", args.json)
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    launch = engine.launch_line(False, cfg.device)
    rows, env = engine.sweep(BENCH, cfg, points, lambda s: print(s, file=sys.stderr))
    table, speed = [], {}
    for r in rows:
        if r.kind != "fused":
            continue
        pair = next(x for x in rows if x.kind == "pair" and x.implementation == r.implementation
                    and x.params == r.params and x.num_tokens == r.num_tokens)
        sp = pair.latency_us / r.latency_us
        speed.setdefault(r.num_tokens, []).append(sp)
        kind = "MHA" if r.num_q_heads == r.num_heads else "GQA"
        table.append([r.dtype, r.kv_cache_dtype, f"{kind}({r.num_q_heads},{r.num_heads},"
                      f"{r.head_size})", r.num_tokens, f"{pair.latency_us:.2f}",
                      f"{r.latency_us:.2f}", f"{sp:.2f}x"])
    print(f"# {env.device_name}; device timer, hot L2; unfused = kvwrite rotary_embedding + "
          f"reshape_and_cache_flash ({args.implementation}); {launch}")
    print(report.format_table(["dtype", "cache", "heads", "N", "unfused (µs)", "fused (µs)",
                               "speedup"], table))
    ok = not any(r.status.startswith(("mismatch", "error")) for r in rows)
    for n, need in ((1, 2.0), (2048, 1.3)):
        if n in speed:
            worst = min(speed[n])
            passed = worst >= need
            ok &= passed
            print(f"sanity: N={n} speedup >= {need}x: {'PASS' if passed else 'FAIL'} "
                  f"(min {worst:.2f}x)")
    if args.json:
        _, meta = engine.render(BENCH, cfg, env, ns, points, rows, launch, prog)
        meta["command"] = f"{prog} {shlex.join(sys.argv[1:] if argv is None else argv)}"
        report.write_json(args.json, rows, meta)
    return 0 if ok else 1
