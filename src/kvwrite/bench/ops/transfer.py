"""Moving caches on the engine (``kvwrite-bench transfer``, SPEC §9.6): block copies to pinned
host memory and back, between GPU buffers, relayouts, and transfer pages, by SMs (a CTA budget)
or copy engines, beside the peers serving engines use today.

A point is a model's caches (``--model``: its layers, heads, block size and row width), a
direction, an op (``swap``: swap_blocks_multi_layer between caches of one layout; ``relayout``:
relayout_kv_cache from vLLM's LBNHC to LBHNC or to a page-first buffer; ``pack``/``unpack``:
pack_kv_pages/unpack_kv_pages with raw, fp8 or nvfp4 pages), an engine (``sm`` with a
``--max-ctas`` budget, ``ce``, or a peer: ``vllm-loop``, one copy per tensor and block as vLLM's
``swap_blocks``; ``batch``, one ``cuMemcpyBatchAsync`` of the same runs as vLLM's
``swap_blocks_batch``; ``torch``, index_select/index_copy_ per layer), and a block count (the
engine's ``--num-tokens`` axis, ``--blocks`` here). The mapping is on the CPU (vLLM's offload
calls), ids distinct and random (seed 42) or, ``--contiguous``, ``0..n-1`` on both sides.

Every figure is destination bytes (the page side for pack and unpack) over device time, beside
the limit of its direction measured in the same run (pinned host each way and device to device:
one 1 GiB ``cudaMemcpyAsync``, best of 5); each row also gives the host time of the call. The
check: the destination allocations, filled with one byte pattern, written by the series and by
the torch reference, hold the same bytes. Overlap points run the transfer on a side stream
beside an attention stand-in on the main stream (bf16 causal scaled_dot_product_attention of
``[1, 32, 8192, 128]``, repeated to cover the transfer): the row's time is the pair's, and its
params say the attention's time per call alone and overlapped (the repeated sequence over its
repeat count), their ratio, the repeat count and the transfer's time overlapped.

``--direction p2p`` (issue #46; two GPUs, not in the default list): the source on cuda:0 and the
destination on cuda:1 (``p2p:0to1``), and back (``p2p:1to0``), for swap, relayout and
``handoff`` (pack_kv_pages on the source GPU, ``torch.cuda.nccl.broadcast`` of the pages, then
unpack_kv_pages on the other); its limits are a 1 GiB ``copy_`` between the GPUs each way, with
NCCL's broadcast of the same bytes beside them. Each call is bridged to cuda:0's stream, where
the engine records its events (:func:`_bridged`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from .. import engine
from ..engine import OpBench, parse_list

__all__ = ["BENCH", "MODELS", "Point", "Model"]

SEED = 42
# Eager calls timed on the host for an sm point's host column before its graphs are captured.
HOST_SAMPLES = 5
OP = "swap_blocks_multi_layer"
GiB = 2**30
MAX_POINT_BYTES = 4 * GiB
LIMIT_BYTES = GiB  # the limits: one copy of this many bytes, best of LIMIT_REPS
LIMIT_REPS = 5
PATTERN = 0xA5     # what the check fills destinations with (bytes not written keep it)
ATTENTION_SHAPE = (1, 32, 8192, 128)
SAMPLES_KEPT = 64  # host-time samples kept per series
# The overlap's rounds a series: the attention alone and beside the transfer in turn, an even
# count so that each order comes as often.
OVERLAP_ROUNDS = 8
# The overlap params (attention per call) and their console columns.
OVERLAP_COLUMNS = (("attention_us", "attn alone (µs)"),
                   ("attention_overlapped_us", "attn overlapped (µs)"),
                   ("attention_slowdown", "attn slowdown"),
                   ("transfer_overlapped_us", "transfer overlapped (µs)"))


@dataclasses.dataclass(frozen=True)
class Model:
    """A model's per-layer cache: ``layers`` tensors of blocks of ``tokens`` rows of ``heads``
    heads of ``row`` elements (K|V rows: ``kv_split`` 2; MLA's latent rows: 1)."""

    name: str
    layers: int
    heads: int
    tokens: int
    row: int
    kv_split: int
    caches: tuple[str, ...]  # bf16, and fp8 rows (uint8) where the model has them


MODELS = {m.name: m for m in (
    Model("llama3-8b", 32, 8, 16, 256, 2, ("bf16",)),        # 64 KiB per layer and block
    Model("qwen3-32b", 64, 8, 16, 256, 2, ("bf16",)),
    Model("deepseek-v3", 61, 1, 64, 576, 1, ("bf16", "fp8")),  # rows of 1152 and 576 bytes
)}
DIRECTIONS = ("d2h", "h2d", "d2d", "relayout")
# Between two GPUs of the host (peer access): cuda:0 -> cuda:1 and back. ``--direction p2p``
# names both; they are not in the default list (a one-GPU machine could not run it).
P2P = ("p2p:0to1", "p2p:1to0")
P2P_DEVICES = {"p2p:0to1": (0, 1), "p2p:1to0": (1, 0)}  # (source GPU, destination GPU)
OPS = ("swap", "relayout", "pack", "unpack", "handoff")
FORMATS = ("raw", "fp8", "nvfp4")
TARGETS = ("LBHNC", "page_first_direct")
ENGINES = ("sm", "ce")
PEERS = ("vllm-loop", "batch", "torch")
# Which directions each op runs in (the side on the host: pack's pages, unpack's pages).
# handoff: pack on the source GPU, NCCL's broadcast of the pages to the other, unpack there.
OP_DIRECTIONS = {"swap": ("d2h", "h2d", "d2d", *P2P), "relayout": ("relayout", *P2P),
                 "pack": ("d2h", "d2d"), "unpack": ("h2d", "d2d"), "handoff": P2P}
PAGE_OPS = ("pack", "unpack", "handoff")
PEERS_OF = {"swap": PEERS, "relayout": ("torch",), "pack": (), "unpack": (), "handoff": ()}


@dataclasses.dataclass(frozen=True)
class Point:
    num_tokens: int          # blocks moved (the engine's sweep axis)
    model: str
    cache: str               # bf16 or fp8
    direction: str
    op: str
    page_format: str         # pack/unpack: raw, fp8, nvfp4; "" otherwise
    target: str              # relayout: LBHNC or page_first_direct; "" otherwise
    engine: str              # sm, ce or a peer
    max_ctas: int | None     # sm only
    overlap: bool
    contiguous: bool
    layers: int

    @property
    def blocks(self) -> int:
        return self.num_tokens

    @property
    def spec(self) -> Model:
        return MODELS[self.model]

    @property
    def p2p(self) -> bool:
        return self.direction in P2P

    @property
    def elem(self) -> int:
        return 2 if self.cache == "bf16" else 1

    def layer_block_bytes(self) -> int:
        m = self.spec
        return m.heads * m.tokens * m.row * self.elem

    def page_bytes(self) -> int:
        """P: the page row of every layer of a block (kvwrite.kv_page_bytes)."""
        import kvwrite

        m = self.spec
        dtype = torch.bfloat16 if self.cache == "bf16" else torch.uint8
        return kvwrite.kv_page_bytes(self.layers, m.heads, m.tokens, m.row, dtype,
                                     kv_split=m.kv_split, page_format=self.page_format)

    def dst_bytes(self) -> int:
        """Destination bytes of one call (the page side for pack, unpack and handoff)."""
        if self.op in PAGE_OPS:
            return self.blocks * self.page_bytes()
        return self.blocks * self.layers * self.layer_block_bytes()

    def src_bytes(self) -> int:
        if self.op == "unpack":
            return self.blocks * self.page_bytes()
        return self.blocks * self.layers * self.layer_block_bytes()

    @property
    def limit(self) -> str:
        if self.p2p:
            return self.direction  # the peer copy of that way
        return {"d2h": "d2h", "h2d": "h2d"}.get(self.direction, "d2d")


def _check_p2p(device) -> None:
    """``--direction p2p`` runs between cuda:0 and cuda:1: a usage error (ValueError naming
    --direction and the GPU count) before any work where PyTorch sees fewer than 2 GPUs, and
    --device must be the first of them (the engine's events and memory plan are on it)."""
    count = torch.cuda.device_count()  # 0 on a build or machine without CUDA
    if count < 2:
        raise ValueError(f"--direction p2p: copies between cuda:0 and cuda:1 and needs 2 CUDA "
                         f"GPUs; PyTorch sees {count}")
    if device.type != "cuda" or device.index not in (None, 0):
        raise ValueError(f"--direction p2p: runs from --device cuda (or cuda:0) and copies "
                         f"between cuda:0 and cuda:1 ({count} GPUs seen), got --device {device}")


def _ctas(text: str):
    if text == "all":
        return None
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"expected a positive integer or 'all', got {text!r}")
    return v


class TransferBench(OpBench):
    name = "transfer"
    summary = "moving caches: swap, relayout, pack, unpack (d2h, h2d, d2d; p2p between GPUs)"
    description = ("Benchmark the transfer ops (SPEC §9): swap_blocks_multi_layer, "
                   "relayout_kv_cache, pack_kv_pages and unpack_kv_pages between GPU caches, "
                   "pinned host memory and GPU buffers, by SMs under a CTA budget or by copy "
                   "engines (and between two GPUs: --direction p2p, with an NCCL handoff), "
                   "beside vLLM's block copies, one batched copy and PyTorch, each "
                   "against the bandwidth limit of its direction measured in the same run, and "
                   "beside attention on another stream.")
    op = OP
    defaults = {"num_tokens": "1,16,128,1024", "time_budget": 0.25, "graph_calls": 5,
                "iters": 20}
    cpu_defaults = {"model": "llama3-8b", "layers": 2, "num_tokens": "1,2", "engine": "sm",
                    "max_ctas": "all", "peers": "torch", **engine.CPU_TIMING}
    columns = (("model", "model"), ("cache", "cache"), ("direction", "direction"), ("operation", "op"),
               ("page_format", "format"), ("target", "target"), ("engine", "engine"),
               ("max_ctas", "max_ctas"), ("overlap", "overlap"), ("num_tokens", "blocks"))
    always_columns = ("operation", "engine", "num_tokens")

    def __init__(self) -> None:
        self._state: tuple | None = None        # (key, tensors) of the last point's sides
        self._limits: dict[str, float] = {}     # direction -> bytes/s
        self._nccl: dict[str, float] = {}       # p2p direction -> NCCL broadcast bytes/s
        self._nccl_note = ""                    # why there is no NCCL figure, if there is none
        self._any_p2p = False
        self._host: dict = {}                   # point -> host seconds of the last series
        self._overlap: dict = {}                # point -> the last series' overlap events
        self._attention = None
        self._past: list[int] = []
        self._any_overlap = False

    # -- flags and points
    def add_flags(self, p) -> None:
        g = p.add_argument_group("the points (SPEC §9.6)")
        g.add_argument("--model", default=",".join(MODELS),
                       help=f"comma list of {', '.join(MODELS)} (layers, heads, block size, "
                            f"row: llama3-8b 32x8x16x256 bf16, qwen3-32b 64x8x16x256 bf16, "
                            f"deepseek-v3 61x1x64x576 bf16 and fp8 rows) (default: all)")
        g.add_argument("--layers", type=int, default=None,
                       help="the first N layers of each model only (default: all)")
        g.add_argument("--direction", default=",".join(DIRECTIONS),
                       help="comma list of d2h (GPU cache -> pinned host), h2d, d2d (GPU -> "
                            "GPU buffer), relayout (GPU, LBNHC -> LBHNC and -> page-first), p2p "
                            "(cuda:0 -> cuda:1 and back: swap, relayout, handoff; or one way: "
                            "p2p:0to1, p2p:1to0; needs 2 GPUs) (default: d2h,h2d,d2d,relayout)")
        g.add_argument("--op", default=",".join(OPS),
                       help="comma list of swap (swap_blocks_multi_layer, one layout), relayout, "
                            "pack, unpack (pack_kv_pages, unpack_kv_pages), handoff (p2p only: "
                            "pack, NCCL broadcast of the pages, unpack) (default: all)")
        g.add_argument("--page-format", default=",".join(FORMATS),
                       help="pack, unpack: comma list of raw, fp8, nvfp4 (default: all)")
        g.add_argument("--blocks", default=None,
                       help="blocks moved per call: a list or LO:HI, as --num-tokens (the same "
                            "axis here) (default: 1,16,128,1024; points past 4 GiB skipped)")
        g.add_argument("--contiguous", action="store_true",
                       help="ids 0..n-1 on both sides (long runs) instead of distinct random "
                            "ids (seed 42)")
        g.add_argument("--engine", default=",".join(ENGINES),
                       help="comma list of sm (kernels, under each --max-ctas), ce (copy "
                            "engines; raw copies only) (default: sm,ce)")
        g.add_argument("--max-ctas", default="1,2,4,8,all",
                       help="sm: comma list of CTA budgets, positive integers or all (default: "
                            "1,2,4,8,all)")
        g.add_argument("--peers", default=",".join(PEERS),
                       help="comma list of vllm-loop, batch, torch, or none: the peers of swap "
                            "(torch also of relayout) (default: all)")
        g.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="leave out the d2h/h2d points run beside attention")

    def configure(self, args, device) -> None:
        if args.blocks is not None:
            if "num_tokens" in args.explicit:
                raise ValueError("--blocks: the same axis as --num-tokens here; give one of them")
            args.num_tokens = args.blocks
        if args.mode == "cudagraph":
            if "mode" in args.explicit:
                raise ValueError("--mode: transfer's calls read a CPU block_mapping, which a CUDA "
                                 "graph cannot capture; use --mode no_graph (the default here)")
            args.mode = "no_graph"
        args.model_list = parse_list(args.model, "--model", list(MODELS))
        if args.layers is not None and args.layers < 1:
            raise ValueError(f"--layers: expected a positive integer, got {args.layers}")
        given = parse_list(args.direction, "--direction", (*DIRECTIONS, "p2p", *P2P))
        args.direction_list = list(dict.fromkeys(
            d for g in given for d in (P2P if g == "p2p" else (g,))))
        if any(d in P2P for d in args.direction_list):
            _check_p2p(device)
        args.op_list = parse_list(args.op, "--op", OPS)
        args.format_list = parse_list(args.page_format, "--page-format", FORMATS)
        args.engine_list = parse_list(args.engine, "--engine", ENGINES)
        args.ctas_list = parse_list(args.max_ctas, "--max-ctas", convert=_ctas)
        args.peer_list = ([] if args.peers == "none"
                          else parse_list(args.peers, "--peers", PEERS))
        args.on_gpu = device.type == "cuda"
        if not any(d in OP_DIRECTIONS[o] for o in args.op_list for d in args.direction_list):
            raise ValueError(f"--direction: none of {args.direction} is a direction of --op "
                             f"{args.op} (swap: d2h, h2d, d2d, p2p; relayout: relayout, p2p; "
                             f"pack: d2h, d2d; unpack: h2d, d2d; handoff: p2p)")

    def points(self, args) -> list:
        self._past: list[int] = []
        out = []
        for name in args.model_list:
            m = MODELS[name]
            layers = min(args.layers or m.layers, m.layers)
            for cache in m.caches:
                for op in args.op_list:
                    for direction in (d for d in args.direction_list if d in OP_DIRECTIONS[op]):
                        out += self._group(args, name, cache, op, direction, layers)
        kept = [p for p in out if p.dst_bytes() <= MAX_POINT_BYTES]
        self._any_overlap = any(p.overlap for p in kept)
        self._any_p2p = any(p.p2p for p in kept)
        self._past = sorted({p.num_tokens for p in out} - {p.num_tokens for p in kept})
        return kept

    def _group(self, args, model, cache, op, direction, layers) -> list[Point]:
        formats = args.format_list if op in PAGE_OPS else [""]
        targets = list(TARGETS) if op == "relayout" else [""]
        out = []
        for fmt in formats:
            if fmt in ("fp8", "nvfp4") and cache != "bf16":
                continue  # quantized pages read and write float caches
            for target in targets:
                engines = []
                for e in args.engine_list:
                    if e == "ce" and fmt in ("fp8", "nvfp4"):
                        continue  # copy engines move raw bytes only
                    engines += ([(e, c) for c in args.ctas_list] if e == "sm" else [(e, None)])
                engines += [(e, None) for e in args.peer_list if e in PEERS_OF[op]]
                host = direction in ("d2h", "h2d")
                for e, ctas in engines:
                    overlaps = [False]
                    if args.overlap and args.on_gpu and host and e in ENGINES:
                        overlaps.append(True)
                    for ov in overlaps:
                        for n in args.token_counts:
                            out.append(Point(n, model, cache, direction, op, fmt, target, e,
                                             ctas, ov, args.contiguous, layers))
        return out

    def params(self, p: Point) -> dict:
        m = p.spec
        # "operation": a Row's `op` is the benchmark's name.
        out = dict(model=p.model, cache=p.cache, direction=p.direction, operation=p.op,
                   page_format=p.page_format, target=p.target, engine=p.engine,
                   max_ctas=("-" if p.engine != "sm" else
                             "all" if p.max_ctas is None else p.max_ctas),
                   overlap=p.overlap, contiguous=p.contiguous, layers=p.layers, heads=m.heads,
                   block_size=m.tokens, row=m.row, dst_bytes=p.dst_bytes())
        limit = self._limits.get(p.limit)
        if limit is not None:
            out.update(limit=p.limit, limit_gbps=limit / 1e9)
        nccl = self._nccl.get(p.direction)
        if nccl is not None:
            out["nccl_gbps"] = nccl / 1e9
        host = self._host.get(p)
        if host:
            out["host_us"] = statistics.median(host) * 1e6
        out.update(self._overlap_params(p))
        return out

    def header(self, args, points) -> list[str]:
        models = sorted({p.model for p in points}, key=list(MODELS).index)
        shapes = "; ".join(f"{n}: {MODELS[n].layers} layers, H={MODELS[n].heads}, "
                           f"N={MODELS[n].tokens}, C={MODELS[n].row} (LBNHC)" for n in models)
        lines = [f"shape: {shapes}" + (f"; first {args.layers} layers" if args.layers else ""),
                 "blocks: " + ("ids 0..n-1 on both sides (--contiguous)" if args.contiguous
                               else "distinct random ids (seed 42)") + "; sm: replays of a "
                 "CUDA graph of one call, its block_mapping on the GPU (host column: the eager "
                 "call with a CPU block_mapping); ce and peers: eager calls, a CPU mapping",
                 "GB/s = destination bytes (the page side for pack and unpack) / device time; "
                 "% limit against the limit of its direction (limit column)"]
        if self._limits:
            lines.append("limits (one 1 GiB cudaMemcpyAsync, best of 5; p2p: a 1 GiB copy_ "
                         "between the GPUs, peer access on): " + ", ".join(
                             f"{k} {v / 1e9:.1f} GB/s" for k, v in self._limits.items()))
        if self._nccl or self._nccl_note:
            lines.append("NCCL (torch.cuda.nccl.broadcast of 1 GiB from the source GPU to the "
                         "other, one process, best of 5): " + (", ".join(
                             f"{k} {v / 1e9:.1f} GB/s" for k, v in self._nccl.items())
                             or self._nccl_note))
        if any(p.p2p for p in points):
            lines.append("p2p: source on cuda:a, destination on cuda:b; the call runs on the "
                         "destination's current stream, bracketed by the events of cuda:0's "
                         "stream (two cross-device stream waits per call); handoff = "
                         "pack_kv_pages on the source GPU, torch.cuda.nccl.broadcast of the "
                         "pages, unpack_kv_pages on the other (GB/s of page bytes; eager calls, sm included)")
        if self._past:
            lines.append(f"skipped: blocks {', '.join(map(str, self._past))} of some points "
                         f"(past 4 GiB a call)")
        lines.append("peers: vllm-loop = one cudaMemcpyAsync per tensor and block (vLLM's "
                     "swap_blocks; vLLM's own where importable), batch = one cuMemcpyBatchAsync "
                     "of the same runs (swap_blocks_batch), torch = index_select/index_copy_ per "
                     "layer")
        if any(p.overlap for p in points):
            lines.append(f"overlap: the transfer on a side stream beside bf16 causal "
                         f"scaled_dot_product_attention {list(ATTENTION_SHAPE)} on the main "
                         f"stream, repeated to cover it (attention_repeat); time = the pair's; "
                         f"attention_us alone and attention_overlapped_us per attention call "
                         f"(medians of {OVERLAP_ROUNDS} rounds after the timed calls, alone and "
                         f"beside the transfer in turn), attention_slowdown = the geometric mean "
                         f"of the rounds' overlapped / alone (low, high: their extremes); "
                         f"transfer_overlapped_us")
        return lines

    # -- memory and bytes
    def bytes(self, p: Point, kind: str) -> int:
        return p.dst_bytes()

    def set_bytes(self, p: Point, kind: str) -> int:
        return p.src_bytes() + p.dst_bytes()

    def _gpu_sides(self, p: Point) -> tuple[bool, bool]:
        src_gpu = p.p2p or p.direction in ("d2h", "d2d", "relayout")
        dst_gpu = p.p2p or p.direction in ("h2d", "d2d", "relayout")
        return src_gpu, dst_gpu

    def _side_bytes(self, p: Point) -> tuple[int, int]:
        nb = self._num_blocks(p)
        cache = nb * p.layers * p.layer_block_bytes()
        pages = nb * p.page_bytes() if p.op in PAGE_OPS else cache
        return {"pack": (cache, pages), "unpack": (pages, cache),
                "handoff": (cache + pages, pages + cache)}.get(p.op, (cache, cache))

    def state_bytes(self, p: Point) -> int:
        src_gpu, dst_gpu = self._gpu_sides(p)
        src, dst = self._side_bytes(p)
        return src * src_gpu + dst * dst_gpu

    def temp_bytes(self, p: Point) -> int:
        _, dst_gpu = self._gpu_sides(p)
        attention = 4 * math.prod(ATTENTION_SHAPE) * 2 if p.overlap else 0
        return self._side_bytes(p)[1] * dst_gpu + attention  # the check's snapshot

    @staticmethod
    def _num_blocks(p: Point) -> int:
        return 2 * p.blocks  # room for distinct random ids on both sides

    # -- one point
    def _sides(self, p: Point, device) -> dict:
        key = (p.model, p.cache, p.direction, p.op, p.page_format, p.target, p.blocks,
               p.layers, str(device))
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        self._state = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self._state = (key, _make_sides(p, _side_devices(p, device), self._num_blocks(p)))
        return self._state[1]

    def prepare(self, p: Point, count: int, device):
        if device.type == "cuda":
            self._measure_limits(device)
            if self._any_p2p:
                self._measure_p2p_limits()
        elif not self._limits:
            self._limits = _cpu_limits()
        sides = self._sides(p, device)
        gen = torch.Generator().manual_seed(SEED)
        nb = self._num_blocks(p)
        maps = []
        for _ in range(count):
            if p.contiguous:
                src = dst = torch.arange(p.blocks)
            else:
                src = torch.randperm(nb, generator=gen)[:p.blocks]
                dst = torch.randperm(nb, generator=gen)[:p.blocks]
            maps.append(torch.stack([src, dst], 1).to(torch.int64))
        self._host.pop(p, None)
        self._overlap.pop(p, None)
        src_dev, dst_dev = _side_devices(p, device)
        # "run": the call's device (the destination GPU of a p2p call: its current stream takes
        # the work); "gpus": every GPU the call touches (synchronized, bridged when timed).
        run = dst_dev if dst_dev.type == "cuda" else src_dev
        gpus = list(dict.fromkeys(d for d in (src_dev, dst_dev) if d.type == "cuda"))
        return {"point": p, "sides": sides, "maps": maps, "device": device, "reference": None,
                "owner": None, "peer_runs": {}, "run": run, "gpus": gpus}

    def unsupported(self, ctx, kind, impl) -> str | None:
        p: Point = ctx["point"]
        self._host.pop(p, None)      # what a series before this one measured
        self._overlap.pop(p, None)
        if p.engine != "sm":
            # ce and the peers do not run the implementation: timed once, in the first column.
            if ctx["owner"] is None:
                ctx["owner"] = impl
            if ctx["owner"] != impl:
                return f"{p.engine} runs no implementation: timed once, under {ctx['owner']}"
        if p.engine in ("ce", "vllm-loop", "batch") and ctx["device"].type != "cuda":
            return f"{p.engine} needs a CUDA device"
        if p.engine == "batch":
            from ...kernels import copy_engine

            return copy_engine.batch_reason(ctx["device"])
        return None

    def check(self, ctx, kind, impl) -> str | None:
        from ...testing.compare import differing_bytes, storage_bytes

        p: Point = ctx["point"]
        outs = _unique(ctx["sides"]["dst"])
        if ctx["reference"] is None:
            _fill(outs)
            self._writer(ctx, "torch", 0, reference=True)()
            _sync_all(ctx)
            ctx["reference"] = [storage_bytes(t).clone() for t in outs]
        _fill(outs)
        self._writer(ctx, impl, 0)()
        _sync_all(ctx)
        nan = (ctx["sides"]["dtype"]
               if p.op in ("unpack", "handoff") and p.page_format in ("fp8", "nvfp4") else None)
        for n, (t, want) in enumerate(zip(outs, ctx["reference"], strict=True)):
            diff = differing_bytes(storage_bytes(t), want, nan)
            if bool(diff.any()):
                at = torch.nonzero(diff.flatten())[:4].flatten().tolist()
                return (f"destination {n}: {int(diff.sum())} bytes differ from the torch "
                        f"reference, first at byte offsets {at}")
        return None

    def call(self, ctx, kind, impl):
        p: Point = ctx["point"]
        writers = [self._writer(ctx, impl, i) for i in range(len(ctx["maps"]))]
        host = self._host.setdefault(p, [])
        host.clear()

        def eager(i: int) -> None:
            t0 = time.perf_counter()
            writers[i % len(writers)]()
            host.append(time.perf_counter() - t0)
            del host[:-SAMPLES_KEPT]

        timed = _bridged(ctx, eager) if p.p2p else eager
        if p.engine == "sm" and ctx["device"].type == "cuda" and p.op != "handoff":
            # The kernels' device time: each input set's call captured once into a CUDA graph
            # with its mapping on the GPU, and replayed (eager calls with a CPU mapping would
            # time the host's validation and launches whenever they outlast the copy). The host
            # column is the eager call's, with the CPU mapping, as an engine makes it.
            for i in range(HOST_SAMPLES):
                timed(i)
            _sync(ctx["device"])
            replays = self._graphs(ctx, impl)

            def replay(i: int) -> None:
                with torch.cuda.device(ctx["run"]):
                    replays[i % len(replays)].replay()

            if p.p2p:
                replay = _bridged(ctx, replay)
            return self._overlapped(ctx, replay) if p.overlap else replay
        if not p.overlap:
            return timed
        return self._overlapped(ctx, timed)

    def _graphs(self, ctx, impl: str) -> list:
        """One CUDA graph per input set: the series' call with that set's mapping on the GPU."""
        device = ctx["run"]  # a p2p call's mapping and capture: on the destination GPU
        graphs = []
        with torch.cuda.device(device):
            for i, m in enumerate(ctx["maps"]):
                write = self._writer(ctx, impl, i, mapping=m.to(device))
                write()  # outside capture first: kernels built and loaded
                _sync_all(ctx)
                g = torch.cuda.CUDAGraph()
                # A capture stream of this device (torch.cuda.graph's default one lives on the
                # device current when it was first made).
                with torch.cuda.graph(g, stream=torch.cuda.Stream(device)):
                    write()
                graphs.append(g)
        _sync_all(ctx)
        return graphs

    def release(self) -> None:
        self._state = None
        self._attention = None

    def extra_columns(self, point_rows) -> list[tuple[str, str]]:
        cells = []
        for row in point_rows:
            label = "" if len(point_rows) == 1 else f"{row.implementation} "
            cells += [(f"{label}GB/s", f"{row.gbps:.1f}"),
                      (f"{label}% limit", f"{_pct_limit(row):.1f}"),
                      (f"{label}host (µs)", f"{row.params.get('host_us', math.nan):.1f}")]
            for key, head in OVERLAP_COLUMNS if self._any_overlap else ():
                cells.append((f"{label}{head}", _param_cell(row, key)))
        return cells

    # The report: a table per model, cache and limit (its GB/s in the heading), a line per
    # point, and per block count and series the console's figures: GB/s with its % of the
    # direction's limit (not of the device copy bandwidth), the host time, and beside attention
    # the attention's slowdown (per call overlapped / alone).
    report_split = ("model", "cache", "limit")

    def report_columns(self, rows) -> list:
        cols = [("GB/s (% limit)", lambda r: f"{r.gbps:.1f} ({_pct_limit(r):.0f}%)"),
                ("host µs", lambda r: f"{r.params.get('host_us', math.nan):.0f}")]
        if any(r.params.get("overlap") for r in rows):
            cols.append(("attn slowdown", lambda r: _param_cell(r, "attention_slowdown")))
        return cols

    # -- the calls
    def _writer(self, ctx, impl: str, i: int, reference: bool = False, mapping=None):
        """One call of the point's series on mapping set ``i`` (the reference: the torch
        implementation of the op, engine sm; ``mapping``: that set's mapping elsewhere, e.g. on
        the GPU)."""
        import kvwrite

        p: Point = ctx["point"]
        s = ctx["sides"]
        mapping = ctx["maps"][i] if mapping is None else mapping
        engine_ = "sm" if reference else p.engine
        kw = dict(implementation="torch" if reference else impl)
        if engine_ in ("sm", "ce"):
            kw.update(engine=engine_, max_ctas=p.max_ctas if engine_ == "sm" else None)
        else:
            return self._peer(ctx, engine_, i)
        m = p.spec
        if p.op == "swap":
            return lambda: kvwrite.swap_blocks_multi_layer(s["src"], s["dst"], mapping, **kw)
        if p.op == "relayout":
            return lambda: kvwrite.relayout_kv_cache(s["src"], s["dst"], mapping, **kw)
        if p.op == "handoff":
            return _handoff(p, s, mapping, kw)
        if p.op == "pack":
            return lambda: kvwrite.pack_kv_pages(s["src"], s["dst"][0], mapping,
                                                 kv_split=m.kv_split, page_format=p.page_format,
                                                 scale=s["scale"], **kw)
        return lambda: kvwrite.unpack_kv_pages(s["src"][0], s["dst"], mapping,
                                               kv_split=m.kv_split, page_format=p.page_format,
                                               **kw)

    def _peer(self, ctx, peer: str, i: int):
        p: Point = ctx["point"]
        s = ctx["sides"]
        mapping = ctx["maps"][i]
        device = ctx["run"]  # a p2p peer copies on the destination GPU's stream (peer pointers)
        if peer == "torch":
            src_i = mapping[:, 0].to(s["src"][0].device)
            dst_j = mapping[:, 1].to(s["dst"][0].device)
            # non_blocking only into the GPU: a host destination's index_copy_ reads the copy
            # on the CPU at once.
            nb = s["dst"][0].device.type == "cuda"

            def torch_peer() -> None:
                for a, b in zip(s["src"], s["dst"], strict=True):
                    b.index_copy_(0, dst_j, a.index_select(0, src_i).to(b.device, non_blocking=nb))
            return torch_peer
        from ...kernels import copy_engine

        if peer == "vllm-loop":
            vllm = _vllm_swap_blocks()
            if vllm is not None and p.op == "swap" and not p.p2p:  # vLLM's wants one device
                size = [a.stride(0) * a.element_size() for a in s["src"]]
                return lambda: [vllm(a, b, n, mapping)
                                for a, b, n in zip(s["src"], s["dst"], size, strict=True)]
        runs = ctx["peer_runs"].get(i)
        if runs is None:
            runs = ctx["peer_runs"][i] = _block_runs(s["src"], s["dst"], mapping)
        dst_ptrs, src_ptrs, sizes = runs
        if peer == "vllm-loop":
            return lambda: copy_engine.copy_loop(dst_ptrs, src_ptrs, sizes,
                                                 copy_engine.stream_handle(device))
        return lambda: copy_engine.copy_batch(dst_ptrs, src_ptrs, sizes,
                                              copy_engine.stream_handle(device), device)

    # -- the limits and the overlap
    def _measure_limits(self, device) -> None:
        if self._limits:
            return
        dev = torch.empty(LIMIT_BYTES, dtype=torch.uint8, device=device)
        dev2 = torch.empty_like(dev)
        host = torch.empty(LIMIT_BYTES, dtype=torch.uint8, pin_memory=True)
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host), ("d2d", dev2, dev)):
            best = math.inf
            for _ in range(LIMIT_REPS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)  # one cudaMemcpyAsync
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            self._limits[name] = LIMIT_BYTES / best
        del dev, dev2, host

    def _measure_p2p_limits(self) -> None:
        """The p2p limits: one 1 GiB copy_ from one GPU to the other each way (PyTorch enables
        peer access and issues one cudaMemcpyAsync on the source's stream between two barriers
        with the destination's stream, so events on the destination's stream bracket it), best
        of LIMIT_REPS; and NCCL's broadcast of the same bytes in this process
        (torch.cuda.nccl.broadcast from the source GPU, on each GPU's current stream)."""
        if any(d in self._limits for d in P2P):
            return
        bufs = {i: torch.empty(LIMIT_BYTES, dtype=torch.uint8, device=f"cuda:{i}")
                for i in (0, 1)}
        for name, (a, b) in P2P_DEVICES.items():
            dst_stream = torch.cuda.current_stream(b)
            best = math.inf
            for _ in range(LIMIT_REPS):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(dst_stream)
                bufs[b].copy_(bufs[a], non_blocking=True)
                e1.record(dst_stream)
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1) / 1e3)
            self._limits[name] = LIMIT_BYTES / best
        try:
            from torch.cuda import nccl

            if not nccl.is_available([bufs[0], bufs[1]]):
                raise RuntimeError("torch.cuda.nccl.is_available() is False for these buffers")
            for name, (a, b) in P2P_DEVICES.items():
                pair = [bufs[a], bufs[b]]
                nccl.broadcast(pair, root=0)  # creates the communicators
                torch.cuda.synchronize(a)
                torch.cuda.synchronize(b)
                self._nccl[name] = LIMIT_BYTES / min(
                    _bridged_time(lambda pair=pair: nccl.broadcast(pair, root=0), (a, b))
                    for _ in range(LIMIT_REPS))
        except Exception as e:  # no NCCL in this build, or it cannot run here: the header says
            self._nccl_note = f"not measured ({type(e).__name__}: {str(e).splitlines()[0]})"
        del bufs

    def _overlapped(self, ctx, transfer):
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        p: Point = ctx["point"]
        device = ctx["device"]
        if self._attention is None:
            gen = torch.Generator(device=device).manual_seed(SEED)
            qkv = [torch.randn(ATTENTION_SHAPE, generator=gen, device=device,
                               dtype=torch.bfloat16) for _ in range(3)]
            self._attention = (qkv, torch.cuda.Stream(device))
        (q, k, v), side = self._attention

        def attention() -> None:
            sdpa(q, k, v, is_causal=True)

        alone = _event_time(attention)
        once = _event_time(lambda: transfer(0))
        repeat = max(1, math.ceil(once / alone))

        def attentions(main) -> list:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record(main)
            for _ in range(repeat):
                attention()
            ev[1].record(main)
            return ev

        def pair(i: int) -> list:
            """The transfer on the side stream beside the repeated attention on the main one:
            events [transfer start, end, attention start, end]."""
            main = torch.cuda.current_stream(device)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            side.wait_stream(main)
            with torch.cuda.stream(side):
                ev[0].record(side)
                transfer(i)
                ev[1].record(side)
            ev += attentions(main)
            main.wait_stream(side)
            return ev

        def alone_seq() -> list:
            return attentions(torch.cuda.current_stream(device))

        got = self._overlap[p] = {"repeat": repeat, "timed": 0, "pair": pair, "alone": alone_seq}

        def call(i: int) -> None:
            pair(i)
            got["timed"] += 1
        return call

    def _overlap_params(self, p: Point) -> dict:
        """The overlap figures, measured once a series after its timed calls (which time the
        pair): OVERLAP_ROUNDS rounds of the attention alone and the pair, the two in turn
        (alone first, then the pair first), so that clock drift over the series, which the
        attention alone measured once before it does not see, cancels. The slowdown is the
        geometric mean of the rounds' ratios, its low and high their extremes."""
        got = self._overlap.get(p)
        if not got or not got["timed"]:
            return {}
        if "params" not in got:
            rounds = []
            for r in range(OVERLAP_ROUNDS):
                if r % 2:
                    both = got["pair"](r)
                    alone = got["alone"]()
                else:
                    alone = got["alone"]()
                    both = got["pair"](r)
                rounds.append((alone, both))
            rounds[-1][0][1].synchronize()
            rounds[-1][1][3].synchronize()
            n = got["repeat"]
            # Per attention call on both sides: the overlapped figure is the repeated sequence's
            # time over its repeat count, so that it compares with one call alone (the issue's
            # target: attention beside a max_ctas=4 transfer within 5% of attention alone).
            a = [s.elapsed_time(e) * 1e3 / n for (s, e), _ in rounds]  # µs
            o = [c.elapsed_time(d) * 1e3 / n for _, (_, _, c, d) in rounds]
            x = [s.elapsed_time(e) * 1e3 for _, (s, e, _, _) in rounds]
            ratios = [b / c for b, c in zip(o, a, strict=True)]
            got["params"] = dict(
                attention_us=statistics.median(a), attention_overlapped_us=statistics.median(o),
                attention_repeat=n,
                attention_slowdown=math.exp(statistics.fmean(map(math.log, ratios))),
                attention_slowdown_low=min(ratios), attention_slowdown_high=max(ratios),
                transfer_overlapped_us=statistics.median(x))
            for key in ("pair", "alone"):  # the graphs and buffers they hold go with the series
                got.pop(key)
        return got["params"]


# --- the table's cells --------------------------------------------------------------------------

def _pct_limit(row) -> float:
    """A row's GB/s in % of the limit of its direction measured in its run (nan without)."""
    limit = row.params.get("limit_gbps")
    return 100 * row.gbps / limit if limit and row.ok else math.nan


def _param_cell(row, key: str) -> str:
    """An overlap param's cell: "-" where the row has none (not an overlap point, or a file
    written before it was measured)."""
    v = row.params.get(key)
    if v is None:
        return "-"
    return f"{v:.2f}" if key == "attention_slowdown" else f"{v:.1f}"


# --- building the sides -------------------------------------------------------------------------

def _random_fill(t: torch.Tensor, gen: torch.Generator, float_values: bool) -> None:
    """Random values (float caches: normal values, no NaN; bytes otherwise), made on the tensor's
    device (a pinned host tensor: on the CPU)."""
    if float_values and t.dtype.is_floating_point:
        t.copy_(torch.randn(t.shape, generator=gen, device=gen.device).to(t.dtype))
    else:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                generator=gen, device=gen.device,
                                                dtype=torch.uint8))


def _side_devices(p: Point, device) -> tuple[torch.device, torch.device]:
    """(source device, destination device) of a point: the host for a pinned side (on the CPU
    every side is the host), the run's GPU, or a p2p direction's two GPUs."""
    if p.p2p:
        a, b = P2P_DEVICES[p.direction]
        return torch.device("cuda", a), torch.device("cuda", b)
    host = torch.device("cpu")
    src_gpu = p.direction in ("d2h", "d2d", "relayout")
    dst_gpu = p.direction in ("h2d", "d2d", "relayout")
    if p.op == "pack":
        src_gpu = True  # the caches; the pages are the direction's destination
    if p.op == "unpack":
        dst_gpu = True
    return (device if src_gpu else host), (device if dst_gpu else host)


def _make_sides(p: Point, devices, nb: int) -> dict:
    import kvwrite

    m = p.spec
    dtype = torch.bfloat16 if p.cache == "bf16" else torch.uint8
    src_dev, dst_dev = devices
    run = dst_dev if dst_dev.type == "cuda" else src_dev
    pin = run.type == "cuda"
    src_gpu = p.p2p or p.direction in ("d2h", "d2d", "relayout")
    dst_gpu = p.p2p or p.direction in ("h2d", "d2d", "relayout")

    def where(gpu: bool, dev: torch.device) -> dict:
        return dict(device=dev) if gpu else dict(pin_memory=pin)

    gen = torch.Generator(device=src_dev if src_dev.type == "cuda" else run).manual_seed(SEED)

    def lbnhc(gpu: bool, dev: torch.device) -> list[torch.Tensor]:
        """vLLM's per-layer caches [nb, N, H, C] as logical [nb, H, N, C] views."""
        return [torch.empty(nb, m.tokens, m.heads, m.row, dtype=dtype, **where(gpu, dev))
                .permute(0, 2, 1, 3) for _ in range(p.layers)]

    float_values = dtype == torch.bfloat16
    out: dict = {"dtype": dtype, "scale": None}
    quantized = p.page_format in ("fp8", "nvfp4")
    if p.op == "swap":
        out["src"] = [t.permute(0, 2, 1, 3) for t in lbnhc(src_gpu, src_dev)]  # [nb, N, H, C]
        out["dst"] = [t.permute(0, 2, 1, 3) for t in lbnhc(dst_gpu, dst_dev)]
    elif p.op == "relayout":
        out["src"] = lbnhc(True, src_dev)
        if p.target == "LBHNC":
            out["dst"] = [torch.empty(nb, m.heads, m.tokens, m.row, dtype=dtype, device=dst_dev)
                          for _ in range(p.layers)]
        else:  # one page-first buffer [nb, L, H, N, C]: a block of every layer together
            buf = torch.empty(nb, p.layers, m.heads, m.tokens, m.row, dtype=dtype,
                              device=dst_dev)
            out["dst"] = [buf[:, layer] for layer in range(p.layers)]
    elif p.op == "handoff":  # caches and pages on each GPU; the pages travel by NCCL
        P = p.page_bytes()
        out["src"], out["dst"] = lbnhc(True, src_dev), lbnhc(True, dst_dev)
        out["pages"] = [torch.empty(nb, P, dtype=torch.uint8, device=d)
                        for d in (src_dev, dst_dev)]
        if quantized:
            out["scale"] = torch.full((1,), 0.01, dtype=torch.float32, device=src_dev)
    else:
        P = p.page_bytes()
        caches_dev = src_dev if p.op == "pack" else dst_dev
        pages_gpu = dst_gpu if p.op == "pack" else src_gpu
        caches = lbnhc(True, caches_dev)
        pages = torch.empty(nb, P, dtype=torch.uint8, **where(pages_gpu, caches_dev))
        if quantized:
            out["scale"] = torch.full((1,), 0.01, dtype=torch.float32, device=caches_dev)
        if p.op == "pack":
            out["src"], out["dst"] = caches, [pages]
        else:
            out["src"], out["dst"] = [pages], caches
    if p.op != "unpack":
        for t in _unique(out["src"]):
            _random_fill(t, gen, float_values)
    if p.op == "unpack":  # pages worth decoding: every block of the caches packed
        src = lbnhc(True, dst_dev)
        for t in src:
            _random_fill(t, gen, float_values)
        ids = torch.arange(nb)
        kvwrite.pack_kv_pages(src, out["src"][0], torch.stack([ids, ids], 1),
                              kv_split=m.kv_split, page_format=p.page_format,
                              scale=None if p.page_format == "raw"
                              else torch.full((1,), 0.01, dtype=torch.float32, device=dst_dev))
        _sync(dst_dev)
    for d in devices:
        _sync(d)
    return out


def _unique(tensors) -> list[torch.Tensor]:
    """One view per allocation (a page-first buffer's layers share one)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _fill(tensors) -> None:
    from ...testing.compare import storage_bytes

    for t in tensors:
        storage_bytes(t).fill_(PATTERN)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_all(ctx) -> None:
    for d in ctx["gpus"]:
        _sync(d)


def _bridged(ctx, fn):
    """``fn`` (a call of a p2p point) ordered with the current stream of the run's device
    (cuda:0), on which the engine records its events: every other GPU's current stream waits
    for it before the call, and it waits for them after, so the events bracket the work
    enqueued on either GPU (two cross-device stream waits per call)."""
    main_dev = torch.device("cuda", torch.cuda.current_device())
    others = [d for d in ctx["gpus"] if d != main_dev]

    def call(i: int) -> None:
        main = torch.cuda.current_stream(main_dev)
        for d in others:
            torch.cuda.current_stream(d).wait_stream(main)
        fn(i)
        for d in others:
            main.wait_stream(torch.cuda.current_stream(d))
    return call


def _bridged_time(fn, gpus) -> float:
    """Seconds of ``fn`` (work on the current streams of ``gpus``, indices) between two events of
    the first GPU's stream, the others bridged to it."""
    main = torch.cuda.current_stream(gpus[0])
    others = [torch.cuda.current_stream(g) for g in gpus[1:]]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(main)
    for o in others:
        o.wait_stream(main)
    fn()
    for o in others:
        main.wait_stream(o)
    e1.record(main)
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3


def _handoff(p: Point, s: dict, mapping, kw: dict):
    """A handoff call: pack the mapped blocks of every layer into page rows 0..n-1 on the source
    GPU, NCCL's broadcast of those rows to the other GPU's pages (in this process), unpack them
    into the mapped destination blocks there."""
    from torch.cuda import nccl

    import kvwrite

    m = p.spec
    n = mapping.shape[0]
    rows = torch.arange(n, dtype=mapping.dtype, device=mapping.device)
    pack_map = torch.stack([mapping[:, 0], rows], 1)
    unpack_map = torch.stack([rows, mapping[:, 1]], 1)
    src_pages, dst_pages = (t[:n] for t in s["pages"])  # leading rows: contiguous
    fmt = dict(kv_split=m.kv_split, page_format=p.page_format)

    def handoff() -> None:
        kvwrite.pack_kv_pages(s["src"], src_pages, pack_map, scale=s["scale"], **fmt, **kw)
        nccl.broadcast([src_pages, dst_pages], root=0)
        kvwrite.unpack_kv_pages(dst_pages, s["dst"], unpack_map, **fmt, **kw)
    return handoff


def _block_runs(src, dst, mapping):
    """vLLM's runs: for each tensor and pair, the block's bytes (``stride(0)`` elements) from
    ``id * stride(0)`` of each side."""
    import numpy as np

    m = mapping.numpy()
    d, s, n = [], [], []
    for a, b in zip(src, dst, strict=True):
        size = a.stride(0) * a.element_size()
        s.append(a.data_ptr() + m[:, 0] * size)
        d.append(b.data_ptr() + m[:, 1] * b.stride(0) * b.element_size())
        n.append(np.full(len(m), size, dtype=np.uint64))
    cat = np.concatenate
    return cat(d).astype(np.uint64), cat(s).astype(np.uint64), cat(n)


def _vllm_swap_blocks():
    """vLLM's swap_blocks where vLLM is importable, else None."""
    try:
        from vllm import _custom_ops  # type: ignore[import-not-found]
    except Exception:
        return None
    return getattr(_custom_ops, "swap_blocks", None)


def _event_time(fn, reps: int = 3) -> float:
    """Seconds of ``fn`` on the current stream: median of ``reps`` timed after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _cpu_limits() -> dict[str, float]:
    """On the CPU every side is host memory: one host copy's bandwidth stands for each limit."""
    n = 64 * 2**20
    a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    b.copy_(a)
    best = math.inf
    for _ in range(LIMIT_REPS):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return {k: n / best for k in ("d2h", "h2d", "d2d")}


BENCH = TransferBench()
