"""``kvwrite-bench mla``: vLLM's concat_and_cache_mla benchmark (its flags, sweep and table), plus
kvwrite's device timer, L2 control, bytes and % of the copy bandwidth, implementations side by
side, a byte check against the torch reference before timing, JSON/CSV and plots.

Each point follows vLLM's recipe: every RNG seeded with 42, ``kv_c`` and ``k_pe`` from
``torch.randn`` (with ``--strided``, ``k_pe`` is ``latent[:, L:]`` of a ``[T, L + P]`` randn
latent), unique slots from ``random.sample``, a zeroed ``[num_blocks, block_size, E]`` cache and
``scale = 0.1``. Further input sets (for L2 rotation) continue the same random streams.
``--slots`` decode, prefill or mixed and ``--pad-fraction`` (:mod:`kvwrite.bench.slots`) replace
only the slots; padding tokens (-1) write nothing and are not counted in bytes.

Exit status: 0, 1 when an implementation failed its check or raised, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import math
import random
import shlex
import sys

import numpy as np
import torch

from .. import __version__, registry
from ..dtypes import BENCH_DTYPES, MODEL_DTYPES
from ..ops.concat_and_cache_mla import OP, MlaMode, create_mla_cache, parse_mla_mode, validate
from ..ops.concat_and_cache_mla import reference as torch_ref
from ..testing.mla import mla_differing_bytes
from . import report, timing
from .cli import (
    add_launch_flags,
    add_slot_flags,
    check_output_paths,
    launch_line,
    normalize_flags,
    parse_implementations,
    slot_pattern,
)
from .slots import SlotPattern, make_slots

__all__ = ["MlaRow", "main", "run_benchmark", "build_parser", "bytes_moved"]

PROG = "kvwrite-bench mla"
SEED = 42
SCALE = 0.1
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"]
COPY_BYTES = 2**30


@dataclasses.dataclass
class MlaRow:
    """One measurement: one implementation at one num_tokens."""

    implementation: str
    layout: str                # "strided" (k_pe a slice of the latent) or "contiguous"
    dtype: str
    kv_cache_dtype: str
    kv_lora_rank: int
    pe_dim: int
    block_size: int
    num_blocks: int
    num_tokens: int
    slots: str                 # slot pattern: random, decode, prefill or mixed (bench.slots)
    slot_params: str           # the pattern and its parameters, e.g. decode(context_len=4096)
    pad_fraction: float        # fraction of the slots that are -1 padding
    timer: str                 # device or cpu
    mode: str                  # cudagraph or no_graph (what was measured)
    l2: str                    # rotated, hot or n/a (CPU)
    rotation_sets: int
    calls_per_sample: int
    samples: int
    latency_us: float          # median per call
    median_us: float
    p20_us: float
    p80_us: float
    mean_us: float
    bytes: int                 # n*(L+P)*in_bytes + n*entry_bytes + T*slot_bytes (n real tokens)
    gbps: float
    pct_copy_bw: float
    copy_bw_gbps: float
    check: str                 # passed, failed or skipped
    status: str                # ok, "unsupported: ...", "mismatch: ...", "error: ..."
    device: str
    torch_version: str
    triton_version: str
    cuda_version: str
    kvwrite_version: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def entry_bytes(mode: MlaMode, L: int, P: int, dtype: torch.dtype) -> int:
    if mode is MlaMode.AUTO:
        return (L + P) * dtype.itemsize
    return 656 if mode is MlaMode.FP8_DS_MLA else L + P


def bytes_moved(num_tokens: int, L: int, P: int, dtype: torch.dtype, mode: MlaMode,
                num_padding: int = 0) -> int:
    """Bytes one call reads and writes: the real tokens' inputs and entries, and the int64 slots
    of all ``num_tokens`` (padding slots are read; their tokens move nothing else)."""
    n = num_tokens - num_padding
    return n * ((L + P) * dtype.itemsize + entry_bytes(mode, L, P, dtype)) + num_tokens * 8


@dataclasses.dataclass
class _Set:
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    slot_mapping: torch.Tensor


def make_sets(num_tokens: int, L: int, P: int, dtype: torch.dtype, strided: bool, num_blocks: int,
              block_size: int, count: int, device, pattern: SlotPattern | None = None
              ) -> list[_Set]:
    """``count`` input sets with ``pattern``'s slots; with the default pattern (random, no
    padding) set 0 is vLLM's benchmark input (see the module doc). Raises ValueError where the
    pattern does not fit the cache."""
    num_slots = num_blocks * block_size
    if num_tokens > num_slots:
        raise ValueError(f"num_tokens: expected at most num_blocks * block_size = {num_slots}, "
                         f"got {num_tokens}")
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    sets = []
    for i in range(count):
        if strided:
            latent = torch.randn(num_tokens, L + P, dtype=dtype, device=device)
            kv_c = torch.randn(num_tokens, L, dtype=dtype, device=device)
            k_pe = latent[:, L:]
        else:
            kv_c = torch.randn(num_tokens, L, dtype=dtype, device=device)
            k_pe = torch.randn(num_tokens, P, dtype=dtype, device=device)
        batch = make_slots(pattern or SlotPattern(), num_tokens, num_blocks, block_size,
                           set_index=i)
        slots = torch.from_numpy(batch.slots).to(device)
        sets.append(_Set(kv_c, k_pe, slots))
    return sets


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark concat_and_cache_mla (the MLA latent cache write). vLLM's flags, "
                    "sweep and table, plus device timing, several implementations side by side, "
                    "bandwidth, a check before timing, JSON/CSV and plots.")
    seed = p.add_argument_group("vLLM's flags (same defaults; fp8_e4m3, fp8_e5m2, fp8_ds_mla added)")
    seed.add_argument("--kv-lora-rank", type=int, default=512)
    seed.add_argument("--pe-dim", type=int, default=64)
    seed.add_argument("--block-size", type=int, default=64)
    seed.add_argument("--num-blocks", type=int, default=2048)
    seed.add_argument("--dtype", choices=list(BENCH_DTYPES), default="bfloat16")
    seed.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    seed.add_argument("--strided", action="store_true",
                      help="pass k_pe as a slice of the latent projection, as the model does")
    more = p.add_argument_group("kvwrite's flags")
    more.add_argument("--implementation", default=None,
                      help="a registered implementation, a comma list, or 'all' (those available "
                           "on the device) (default: cuda; torch with --device cpu)")
    more.add_argument("--baseline", default=None,
                      help="the implementation speedups are relative to (default: the first)")
    more.add_argument("--num-tokens", default="1:65536",
                      help="a list (1,2,64) or a range LO:HI of doublings (default: 1:65536, "
                           "vLLM's 2^0..2^16)")
    more.add_argument("--hot-l2", action="store_true",
                      help="the same inputs every call (vLLM's condition) instead of rotating input "
                           "sets past the L2")
    more.add_argument("--graph-calls", type=int, default=20,
                      help="calls per CUDA graph (per eager run on the CPU) (default: 20)")
    more.add_argument("--iters", type=int, default=100, help="timed replays at most (default: 100)")
    more.add_argument("--time-budget", type=float, default=0.25, metavar="SECONDS",
                      help="timed seconds per point and implementation (at least 10 samples; "
                           "default: 0.25)")
    more.add_argument("--no-check", dest="check", action="store_false",
                      help="skip the byte check against the torch reference before timing")
    more.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    more.add_argument("--verbose", action="store_true", help="add spread and GB/s columns")
    more.add_argument("--json", metavar="PATH", help="write {meta, rows} as JSON")
    more.add_argument("--csv", metavar="PATH", help="write one line per measurement as CSV")
    more.add_argument("--plot", metavar="PATH.png", help="plot latency and GB/s (matplotlib)")
    add_slot_flags(p)
    add_launch_flags(p)
    return p


def _implementations(text: str | None, device: torch.device) -> list[str]:
    if text is None:
        text = "torch" if device.type == "cpu" else "cuda"
    return parse_implementations(text, device, OP)


def _parse_num_tokens(text: str) -> list[int]:
    from .cli import parse_num_tokens  # one syntax for every subcommand
    return parse_num_tokens(text)


def _env(device: torch.device) -> dict:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = ""
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch_version=torch.__version__, triton_version=triton_version,
                cuda_version=torch.version.cuda or "", kvwrite_version=__version__)


def _check(run, cache: torch.Tensor, s: _Set, mode: MlaMode, scale) -> str | None:
    """Run ``run`` once on a copy of the cache and compare every byte with the reference's."""
    want = cache.clone()
    torch_ref.run(s.kv_c, s.k_pe, want, s.slot_mapping, mode, scale)
    got = cache.clone()
    run(s.kv_c, s.k_pe, got, s.slot_mapping, mode, scale)
    if torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        return None
    bad = mla_differing_bytes(got, want, mode)  # NaN-aware in the fp8 codes only
    if not bool(bad.any()):
        return None
    first = int(torch.nonzero(bad)[0])
    e = cache.stride(1) * cache.element_size()
    return f"{int(bad.sum())} cache bytes differ from the reference (first: slot {first // e})"


def run_sweep(args, impls: list[str], device: torch.device, progress=lambda s: None):
    env = _env(device)
    pattern = slot_pattern(args)
    dtype = MODEL_DTYPES[args.dtype]
    mode = parse_mla_mode(args.kv_cache_dtype)
    L, P = args.kv_lora_rank, args.pe_dim
    cpu = device.type == "cpu"
    l2 = timing.l2_bytes(device)
    copy_bytes = 64 * 2**20 if cpu else COPY_BYTES
    progress(f"measuring the copy bandwidth ({copy_bytes >> 20} MiB copies)")
    copy_bw = timing.copy_bandwidth(device, copy_bytes)
    floor = timing.launch_floor(device)
    cache = create_mla_cache(args.num_blocks, args.block_size, L, P, mode, dtype, device)
    scale = torch.tensor([SCALE], dtype=torch.float32, device=device)
    run_scale = scale if mode.uses_scale else None
    num_slots = args.num_blocks * args.block_size
    l2_name = "n/a" if cpu else ("hot" if args.hot_l2 else "rotated")
    rows, flush_buf = [], None
    for T in _parse_num_tokens(args.num_tokens):
        base = dict(layout="strided" if args.strided else "contiguous",
                    dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=args.kv_cache_dtype,
                    kv_lora_rank=L, pe_dim=P, block_size=args.block_size,
                    num_blocks=args.num_blocks, num_tokens=T, slots=pattern.kind,
                    slot_params=pattern.describe(), pad_fraction=pattern.pad_fraction,
                    timer="cpu" if cpu else "device",
                    mode="no_graph" if cpu else "cudagraph", l2=l2_name, rotation_sets=0,
                    calls_per_sample=0, samples=0, latency_us=math.nan, median_us=math.nan,
                    p20_us=math.nan, p80_us=math.nan, mean_us=math.nan,
                    bytes=bytes_moved(T, L, P, dtype, mode, pattern.num_padding(T)), gbps=math.nan,
                    pct_copy_bw=math.nan, copy_bw_gbps=copy_bw / 1e9, check="skipped",
                    status="ok", **env)
        if num_slots < T:
            for name in impls:
                rows.append(MlaRow(implementation=name, **{**base, "status":
                            f"skipped: num_tokens {T} exceeds num_blocks * block_size = {num_slots}"}))
            continue
        per_set = T * ((L + P) * dtype.itemsize + 8)
        count, flush = timing.l2_rotation(args.hot_l2 or cpu, per_set, l2, args.graph_calls)
        try:
            sets = make_sets(T, L, P, dtype, args.strided, args.num_blocks, args.block_size,
                             count, device, pattern)
        except ValueError as e:  # the slot pattern does not fit the cache
            rows += [MlaRow(implementation=name, **{**base, "status": f"skipped: {e}"})
                     for name in impls]
            progress(f"T={T}: skipped: {e}")
            continue
        if flush and flush_buf is None:
            flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        validate(sets[0].kv_c, sets[0].k_pe, cache, sets[0].slot_mapping, mode, scale)
        for name in impls:
            info = registry.get(OP, name)
            row = dict(base, rotation_sets=count)
            reason = info.unsupported(sets[0].kv_c, cache, mode)
            if reason is None and not cpu and not info.graph_safe:
                reason = f"{name} is not CUDA-graph safe (it syncs with the host)"
            if reason is not None:
                rows.append(MlaRow(implementation=name, **{**row, "status": f"unsupported: {reason}"}))
                progress(f"T={T} {name}: unsupported: {reason}")
                continue
            run = info.run
            try:
                if args.check:
                    why = _check(run, cache, sets[0], mode, run_scale)
                    if why is not None:
                        rows.append(MlaRow(implementation=name, **{**row, "check": "failed",
                                                                     "status": f"mismatch: {why}"}))
                        progress(f"T={T} {name}: mismatch: {why}")
                        continue
                    row["check"] = "passed"

                def call(i: int, run=run, sets=sets) -> None:
                    s = sets[i % len(sets)]
                    run(s.kv_c, s.k_pe, cache, s.slot_mapping, mode, run_scale)

                if cpu:
                    t = timing.time_cpu(call, args.graph_calls, args.iters, args.time_budget)
                else:
                    t = timing.time_device(call, args.graph_calls, args.iters, graph=True,
                                           flush=flush_buf if flush else None,
                                           budget_s=args.time_budget)
            except Exception as e:  # an implementation's failure marks its row; the sweep goes on
                rows.append(MlaRow(implementation=name, **{
                    **row, "status": f"error: {type(e).__name__}: {e}".splitlines()[0]}))
                progress(f"T={T} {name}: {rows[-1].status}")
                continue
            gbps = base["bytes"] / t.median / 1e9
            rows.append(MlaRow(implementation=name, **{
                **row, "calls_per_sample": t.calls, "samples": len(t.samples),
                "latency_us": t.median * 1e6, "median_us": t.median * 1e6,
                "p20_us": t.quantile(0.2) * 1e6, "p80_us": t.quantile(0.8) * 1e6,
                "mean_us": t.mean * 1e6, "gbps": gbps, "pct_copy_bw": 100 * gbps * 1e9 / copy_bw}))
            progress(f"T={T} {name}: {t.median * 1e6:.3f} us, {gbps:.1f} GB/s")
    return rows, dict(env, copy_bw_gbps=copy_bw / 1e9, copy_bytes=copy_bytes, l2_bytes=l2,
                      launch_floor_us=None if floor is None else floor * 1e6)


def _table(rows: list[MlaRow], impls: list[str], baseline: str, verbose: bool) -> str:
    if len(impls) == 1 and not verbose:
        return report.format_table(["num_tokens", "latency (us)"],
                                   [[r.num_tokens, f"{r.latency_us:.3f}"] for r in rows])
    by_t: dict[int, dict[str, MlaRow]] = {}
    for r in rows:
        by_t.setdefault(r.num_tokens, {})[r.implementation] = r
    others = [i for i in impls if i != baseline]
    headers = (["num_tokens"] + [f"{i} (us)" for i in impls] + [f"{i} vs {baseline}" for i in others]
               + [f"{i} % copy BW" for i in impls])
    if verbose:
        headers += [f"{i} p20-p80 (us)" for i in impls] + ["bytes"]
    body = []
    for t, per in by_t.items():
        lat = {i: per[i].latency_us if i in per else math.nan for i in impls}
        line = [t] + [f"{lat[i]:.3f}" for i in impls]
        line += [f"{lat[baseline] / lat[i]:.2f}" for i in others]
        line += [f"{per[i].pct_copy_bw:.1f}" if i in per else "nan" for i in impls]
        if verbose:
            line += [f"{per[i].p20_us:.3f}-{per[i].p80_us:.3f}" if i in per else "nan"
                     for i in impls]
            line.append(next(iter(per.values())).bytes)
        body.append(line)
    return report.format_table(headers, body)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(normalize_flags(argv))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        parser.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    try:
        impls = _implementations(args.implementation, device)
        baseline = args.baseline or impls[0]
        if baseline not in impls:
            raise ValueError(f"--baseline: expected one of {', '.join(impls)}, got {baseline!r}")
        for flag in ("kv_lora_rank", "pe_dim", "block_size", "num_blocks", "graph_calls", "iters"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: expected a positive integer, got "
                                 f"{getattr(args, flag)}")
        num_tokens = _parse_num_tokens(args.num_tokens)
        pattern = slot_pattern(args)
        mode = parse_mla_mode(args.kv_cache_dtype)
        if mode is MlaMode.FP8_DS_MLA and (args.kv_lora_rank, args.pe_dim) != (512, 64):
            raise ValueError(f"--kv-cache-dtype fp8_ds_mla: needs --kv-lora-rank 512 and --pe-dim "
                             f"64, got {args.kv_lora_rank} and {args.pe_dim}")
        if mode is MlaMode.FP8_DS_MLA and args.dtype == "float":
            raise ValueError("--kv-cache-dtype fp8_ds_mla: needs --dtype half or bfloat16, got float")
        check_output_paths(args)  # results are never lost to a bad path after the sweep
    except ValueError as e:
        parser.error(str(e))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: error: no CUDA GPU is visible to PyTorch; pass --device cpu to run the "
              "torch implementation on the CPU", file=sys.stderr)
        return 2
    if args.plot:
        from .plot import _pyplot
        _pyplot()  # fail before the sweep, not after it

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    launch = launch_line(args, device)
    with torch.inference_mode():
        rows, env = run_sweep(args, impls, device, progress)
    timer = ("CPU: host clock around runs of " if device.type == "cpu" else
             "device: CUDA events around replays of one CUDA graph of ")
    header = [
        f"kvwrite-bench {env['kvwrite_version']} on {env['device']} | torch {env['torch_version']}, "
        f"triton {env['triton_version'] or '-'}, CUDA {env['cuda_version'] or '-'}",
        f"timer: {timer}{args.graph_calls} calls; latency = median per call",
        "L2: " + ("not controlled on the CPU" if device.type == "cpu" else
                  "hot: the same inputs every call" if args.hot_l2 else
                  "rotated: input sets exceeding 2x the L2 (flushed before each run when fewer)"),
        f"copy bandwidth: {env['copy_bw_gbps']:.0f} GB/s (bytes read + written); bytes per call = "
        "n*(L+P)*in_bytes + n*entry_bytes + T*8 (n = T less the padding)",
        "check: each implementation against the torch reference, every cache byte, before timing"
        if args.check else "check: off (--no-check)",
        "slots: " + pattern.explain(max(num_tokens), args.num_blocks, args.block_size),
        launch,
    ]
    if device.type != "cpu":
        floor = env["launch_floor_us"]
        header.insert(4, timing.floor_line(None if floor is None else floor * 1e-6))
    lines = ["# " + h for h in header]
    lines.append(f"concat_and_cache_mla: dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} "
                 f"kv_lora_rank={args.kv_lora_rank} pe_dim={args.pe_dim} strided={args.strided}")
    lines.append(_table(rows, impls, baseline, args.verbose))
    notes = [f"{r.implementation} T={r.num_tokens}: {r.status}" for r in rows if not r.ok]
    if notes:
        lines.append("notes (NaN rows):")
        lines += [f"  {n}" for n in notes]
    print("\n".join(lines), flush=True)
    command = " ".join([prog, shlex.join(argv)]) if argv else prog
    meta = dict(env, command=command, argv=argv, implementations=impls, baseline=baseline,
                header=header, notes=notes, op=OP,
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.csv:
        report.write_csv(args.csv, rows, command)
    if args.plot:
        from .plot import plot_rows
        plot_rows(rows, args.plot, f"concat_and_cache_mla: L={args.kv_lora_rank} P={args.pe_dim} "
                  f"bs={args.block_size} {args.dtype} kv={args.kv_cache_dtype} "
                  f"strided={args.strided} | slots {pattern.describe()} | "
                  f"{header[1].split(';')[0]} | L2 {rows[0].l2 if rows else ''} | {env['device']}")
    return 1 if any(r.status.startswith(("mismatch", "error")) for r in rows) else 0


def run_benchmark(num_tokens: int, kv_lora_rank: int, pe_dim: int, block_size: int,
                  num_blocks: int, dtype: torch.dtype, kv_cache_dtype: str, strided: bool,
                  device: str = "cuda", implementation: str = "cuda") -> float:
    """vLLM's function: the median latency in microseconds of one cache write (vLLM's inputs,
    the same inputs every call, a CUDA graph of 20 calls timed with CUDA events)."""
    mode = parse_mla_mode(kv_cache_dtype)
    dev = torch.device(device)
    dtype = MODEL_DTYPES[dtype] if isinstance(dtype, str) else dtype
    (s,) = make_sets(num_tokens, kv_lora_rank, pe_dim, dtype, strided, num_blocks, block_size, 1,
                     dev)
    cache = create_mla_cache(num_blocks, block_size, kv_lora_rank, pe_dim, mode, dtype, dev)
    scale = torch.tensor([SCALE], dtype=torch.float32, device=dev)
    validate(s.kv_c, s.k_pe, cache, s.slot_mapping, mode, scale)
    run = registry.get(OP, implementation).run
    sc = scale if mode.uses_scale else None

    def call(i: int) -> None:
        run(s.kv_c, s.k_pe, cache, s.slot_mapping, mode, sc)

    if dev.type == "cpu":
        return timing.time_cpu(call, 20, 20, budget_s=0.2).median * 1e6
    return timing.time_device(call, 20, 100, graph=True, budget_s=0.2).median * 1e6
