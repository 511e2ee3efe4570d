"""The sweep: for each layout and token count, build the point, check and time each implementation.

Also :func:`run_benchmark`, vLLM's benchmark function with its signature and method, and the
memory plan that refuses (with the largest ``--num-blocks`` that fits) a cache that would not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import os
from collections.abc import Callable

import torch

from .. import __version__, registry
from ..dtypes import BENCH_DTYPES, MODEL_DTYPES, parse_kv_cache_dtype, parse_model_dtype
from ..ops.reshape_and_cache_flash import OP, validate
from . import timing
from .check import SNAPSHOT_BYTES, check_point
from .report import Row
from .slots import SlotPattern
from .workload import CHUNK_BYTES, LAYOUTS, Case, fill_caches, make_caches, make_input_sets

__all__ = ["BenchError", "Interrupted", "Config", "Env", "run_sweep", "run_benchmark",
           "available_memory", "plan_memory", "DTYPES"]

DTYPES = {name: MODEL_DTYPES[name] for name in BENCH_DTYPES}  # vLLM's --dtype choices
# Kept free beyond the planned tensors: CUDA graphs, kernel modules, allocator rounding.
MARGIN_BYTES = 512 * 2**20
COPY_BYTES = 2**30
GiB = 2**30

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class BenchError(RuntimeError):
    """A condition the user must fix; printed as one message, never a traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the sweep, carrying the rows measured until then and the environment."""

    def __init__(self, rows: list[Row], env: Env):
        super().__init__()
        self.rows, self.env = rows, env


@dataclasses.dataclass
class Config:
    implementations: list[str]
    baseline: str
    layouts: list[str]
    num_tokens: list[int]
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    kv_cache_dtype: str
    per_head_scale: bool
    iters: int
    mode: str                # requested: cudagraph or no_graph
    timer: str               # device or host-sync
    hot_l2: bool
    graph_calls: int
    time_budget: float
    check: bool
    device: torch.device
    model: str = ""
    tp: int = 1
    slots: SlotPattern = SlotPattern()

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def measured_mode(self) -> str:
        """CUDA graphs need a GPU: on the CPU, cudagraph falls back to no_graph."""
        return "no_graph" if self.is_cpu else self.mode

    @property
    def timer_name(self) -> str:
        return "cpu" if self.is_cpu and self.timer == "device" else self.timer

    @property
    def l2_condition(self) -> str:
        if self.is_cpu:
            return "n/a"
        return "hot" if self.hot_l2 or self.timer == "host-sync" else "rotated"

    def shape(self, layout: str) -> Case:
        """The workload of ``layout``'s points (num_tokens is set per point)."""
        return Case.named_layout(layout, num_tokens=0, num_heads=self.num_heads,
                                 head_size=self.head_size, block_size=self.block_size,
                                 num_blocks=self.num_blocks, dtype=self.dtype,
                                 kv_cache_dtype=self.kv_cache_dtype,
                                 per_head_scale=self.per_head_scale, slots=self.slots)


@dataclasses.dataclass
class Env:
    device_name: str
    torch_version: str
    triton_version: str
    cuda_version: str
    kvwrite_version: str
    l2_bytes: int
    copy_bytes: int = 0
    copy_bw: float = math.nan   # bytes/s, read + written
    launch_floor: float = math.nan  # seconds per call of an empty kernel (timing.launch_floor)


def describe_env(device: torch.device) -> Env:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Env(name, torch.__version__, triton_version, torch.version.cuda or "", __version__,
               timing.l2_bytes(device))


def available_memory(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device`` (None where it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# --- L2 rotation and memory -----------------------------------------------------------------------

def rotation(cfg: Config, shape: Case, num_tokens: int, l2: int) -> tuple[int, bool]:
    """(input sets to rotate over, flush L2 before each timed run): :func:`timing.l2_rotation`
    for a rotated L2, with up to ``graph_calls`` sets."""
    return timing.l2_rotation(cfg.l2_condition != "rotated", shape.set_bytes(num_tokens), l2,
                              cfg.graph_calls)


def _point_bytes(cfg: Config, shape: Case, num_tokens: int, l2: int) -> int:
    """Device bytes a point needs beyond the caches."""
    sets, flush = rotation(cfg, shape, num_tokens, l2)
    need = sets * shape.set_bytes(num_tokens) + (2 * l2 if flush else 0)
    need += 2 * CHUNK_BYTES + 4 * SNAPSHOT_BYTES  # fill and check temporaries
    if "torch" in cfg.implementations and cfg.measured_mode == "no_graph":
        # Timed only without graphs; its gathers and float32 casts (fp8) at full size.
        need += shape.set_bytes(num_tokens) * (4 if shape.cache_dtype.is_fp8 else 1)
    return need


def _fmt_gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_memory(cfg: Config, free: int | None, where: str, l2: int) -> None:
    """Raise :class:`BenchError` naming the largest ``--num-blocks`` that fits, if the run does not."""
    if free is None:
        return
    shape = cfg.shape(cfg.layouts[0])  # every layout has the same bytes
    tokens = [t for t in cfg.num_tokens if t <= shape.num_slots] or [min(cfg.num_tokens)]
    extra = max(_point_bytes(cfg, shape, t, l2) for t in tokens) + MARGIN_BYTES
    need = shape.cache_bytes + extra
    if need <= free:
        return
    largest = max(0, (free - extra) // shape.block_bytes)
    msg = (f"the KV cache does not fit on {where}: --num-blocks {cfg.num_blocks} needs "
           f"{_fmt_gib(shape.cache_bytes)} for the K and V caches plus {_fmt_gib(extra)} for "
           f"inputs, checks and headroom at num_tokens={max(tokens)}, and {_fmt_gib(free)} is free. ")
    if largest == 0:
        msg += ("No --num-blocks fits: lower --num-tokens, --num-heads or --head-size, or free "
                "device memory.")
    else:
        msg += f"The largest --num-blocks that fits is {largest}"
        need_blocks = math.ceil(max(cfg.num_tokens) / cfg.block_size)
        if largest < need_blocks:
            msg += (f" (num_tokens above {largest * cfg.block_size} would then be skipped: they "
                    f"need more slots)")
        msg += "."
    raise BenchError(msg)


# --- one measurement ------------------------------------------------------------------------------

def _row(cfg: Config, env: Env, shape: Case, impl: str, num_tokens: int, **fields) -> Row:
    nan = math.nan
    base = dict(
        implementation=impl, layout=shape.layout_name, dtype=str(cfg.dtype).removeprefix("torch."),
        kv_cache_dtype=cfg.kv_cache_dtype, num_heads=cfg.num_heads, head_size=cfg.head_size,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks, num_tokens=num_tokens,
        per_head_scale=cfg.per_head_scale, model=cfg.model, tp=cfg.tp, slots=cfg.slots.kind,
        slot_params=cfg.slots.describe(), pad_fraction=cfg.slots.pad_fraction, timer=cfg.timer_name,
        mode=cfg.measured_mode, l2=cfg.l2_condition, rotation_sets=0, calls_per_sample=0,
        samples=0, latency_us=nan, median_us=nan, p20_us=nan, p80_us=nan, mean_us=nan,
        bytes=shape.bytes_moved(num_tokens), gbps=nan, pct_copy_bw=nan,
        copy_bw_gbps=env.copy_bw / 1e9, check="skipped", status="ok", device=env.device_name,
        torch_version=env.torch_version, triton_version=env.triton_version,
        cuda_version=env.cuda_version, kvwrite_version=env.kvwrite_version)
    base.update(fields)
    return Row(**base)


def _skip_reason(cfg: Config, shape: Case, num_tokens: int) -> str | None:
    if num_tokens > shape.num_slots:
        return (f"skipped: num_tokens {num_tokens} exceeds the cache's num_blocks * block_size = "
                f"{shape.num_slots} slots")
    if shape.cache_dtype.is_fp8 and shape.head_size % 16:
        return f"skipped: an fp8 cache needs head_size % 16 == 0 (vLLM's benchmark rule), got {shape.head_size}"
    return None


def _cannot_run(cfg: Config, info: registry.ImplInfo, inp, key_cache, shape: Case) -> str | None:
    reason = info.unsupported(inp.key, key_cache, shape.cache_dtype, inp.k_scale)
    if reason is None and cfg.measured_mode == "cudagraph" and not info.graph_safe:
        reason = f"{info.name} is not CUDA-graph safe (it syncs with the host); time it with --mode no_graph"
    return reason


def _measure(cfg: Config, env: Env, info: registry.ImplInfo, shape: Case, caches, sets,
             flush: torch.Tensor | None) -> Row:
    key_cache, value_cache = caches
    num_tokens = sets[0].slot_mapping.numel()
    row = dict(rotation_sets=len(sets))
    reason = _cannot_run(cfg, info, sets[0], key_cache, shape)
    if reason is not None:
        return _row(cfg, env, shape, info.name, num_tokens, status=f"unsupported: {reason}", **row)
    run = info.run
    args = [s.run_args(key_cache, value_cache, shape.cache_dtype) for s in sets]
    for a in args:
        reason = info.prepare(*a)
        if reason is not None:
            return _row(cfg, env, shape, info.name, num_tokens, status=f"unsupported: {reason}", **row)
    try:
        if cfg.check:
            reason = check_point(run, key_cache, value_cache, sets[0], shape)
            if reason is not None:
                return _row(cfg, env, shape, info.name, num_tokens, check="failed",
                            status=f"mismatch: {reason}", **row)
            row["check"] = "passed"
        n = len(args)

        def call(i: int) -> None:
            run(*args[i % n])

        graph = cfg.measured_mode == "cudagraph"
        if cfg.timer == "host-sync":
            t = timing.time_host_sync(lambda: call(0), cfg.iters, graph=graph, device=cfg.device)
        elif cfg.is_cpu:
            t = timing.time_cpu(call, cfg.graph_calls, cfg.iters, cfg.time_budget)
        else:
            t = timing.time_device(call, cfg.graph_calls, cfg.iters, graph=graph, flush=flush,
                                   budget_s=cfg.time_budget)
    except OutOfMemoryError:
        raise
    except Exception as e:  # an implementation's failure marks its row; the sweep goes on
        return _row(cfg, env, shape, info.name, num_tokens,
                    status=f"error: {type(e).__name__}: {e}".splitlines()[0], **row)
    latency = t.mean if cfg.timer == "host-sync" else t.median
    gbps = shape.bytes_moved(num_tokens) / t.median / 1e9
    return _row(cfg, env, shape, info.name, num_tokens, calls_per_sample=t.calls,
                samples=len(t.samples), latency_us=latency * 1e6, median_us=t.median * 1e6,
                p20_us=t.quantile(0.2) * 1e6, p80_us=t.quantile(0.8) * 1e6, mean_us=t.mean * 1e6,
                gbps=gbps, pct_copy_bw=100 * gbps * 1e9 / env.copy_bw, **row)


# --- the sweep ------------------------------------------------------------------------------------

def _oom_error(cfg: Config, env: Env, message: str) -> BenchError:
    free = available_memory(cfg.device)
    shape = cfg.shape(cfg.layouts[0])
    hint = ""
    if free is not None:
        extra = max(_point_bytes(cfg, shape, t, env.l2_bytes) for t in cfg.num_tokens) + MARGIN_BYTES
        hint = (f" The largest --num-blocks that fits now is about "
                f"{max(0, (free - extra) // shape.block_bytes)}.")
    return BenchError(f"out of device memory on {env.device_name} with --num-blocks "
                      f"{cfg.num_blocks} ({message}).{hint}")


def run_sweep(cfg: Config, progress: Callable[[str], None] = lambda s: None) -> tuple[list[Row], Env]:
    """Every (layout, num_tokens, implementation) of ``cfg``, in that order, as rows."""
    env = describe_env(cfg.device)
    where = f"{cfg.device} ({env.device_name})"
    free = available_memory(cfg.device)
    # Before the copy bandwidth is measured: a run that cannot fit stops at once.
    plan_memory(cfg, free, where, env.l2_bytes)
    env.copy_bytes = COPY_BYTES if not cfg.is_cpu else 64 * 2**20
    if free is not None:
        env.copy_bytes = max(2**20, min(env.copy_bytes, free // 8))
    progress(f"measuring the copy bandwidth ({env.copy_bytes / 2**20:.0f} MiB copies)")
    env.copy_bw = timing.copy_bandwidth(cfg.device, env.copy_bytes)
    floor = timing.launch_floor(cfg.device)
    env.launch_floor = math.nan if floor is None else floor
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    rows: list[Row] = []
    try:
        _sweep(cfg, env, progress, rows)
        return rows, env
    except KeyboardInterrupt:
        raise Interrupted(rows, env) from None
    except OutOfMemoryError as e:
        message = str(e).splitlines()[0]
    # Out of the except block the traceback, and with it the sweep's tensors, are gone.
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    raise _oom_error(cfg, env, message)


def _sweep(cfg: Config, env: Env, progress: Callable[[str], None], rows: list[Row]) -> None:
    """Append each measurement to ``rows`` as it is made (kept when the sweep is interrupted)."""
    infos = [registry.get(OP, name) for name in cfg.implementations]
    flush_buf = None
    total = len(cfg.layouts) * len(cfg.num_tokens) * len(infos)
    for layout in cfg.layouts:
        shape = cfg.shape(layout)
        caches = make_caches(shape, cfg.device)
        for num_tokens in cfg.num_tokens:
            skip = _skip_reason(cfg, shape, num_tokens)
            if skip:
                rows += [_row(cfg, env, shape, i.name, num_tokens, status=skip) for i in infos]
                progress(f"{layout} T={num_tokens}: {skip}")
                continue
            fill_caches(*caches, shape)
            count, flush = rotation(cfg, shape, num_tokens, env.l2_bytes)
            if flush and flush_buf is None:
                flush_buf = torch.empty(2 * env.l2_bytes, dtype=torch.uint8, device=cfg.device)
            try:
                sets = make_input_sets(shape, num_tokens, count, cfg.device)
            except ValueError as e:  # the slot pattern does not fit the cache
                skip = f"skipped: {e}"
                rows += [_row(cfg, env, shape, i.name, num_tokens, status=skip) for i in infos]
                progress(f"{layout} T={num_tokens}: {skip}")
                continue
            s0 = sets[0]
            validate(s0.key, s0.value, *caches, s0.slot_mapping, cfg.kv_cache_dtype, s0.k_scale,
                     s0.v_scale)
            for info in infos:
                row = _measure(cfg, env, info, shape, caches, sets, flush_buf if flush else None)
                rows.append(row)
                done = f"[{len(rows)}/{total}] {layout} T={num_tokens} {info.name}: "
                if row.ok:
                    progress(done + f"{row.latency_us:.3f} µs, {row.gbps:.1f} GB/s")
                else:
                    progress(done + row.status)
            del sets, s0
        del caches  # before the next layout allocates its own
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()


# --- vLLM's function ------------------------------------------------------------------------------

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
    "NHD", "HND" or "packed"; ``implementation`` is any registered name. Returns NaN where the
    implementation cannot run the case (as vLLM's returns NaN for Triton with HND); raises
    ValueError for an fp8 cache with ``head_size % 16 != 0`` and for more tokens than slots, as
    vLLM's does. The result is not checked against the reference: the command line does that.
    """
    cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if cache_dtype.is_fp8 and head_size % 16:
        raise ValueError(f"head_size: an fp8 kv-cache needs a multiple of 16, got {head_size}")
    info = registry.get(OP, implementation)
    if benchmark_mode not in ("cudagraph", "no_graph"):
        raise ValueError(f"benchmark_mode: expected 'cudagraph' or 'no_graph', got {benchmark_mode!r}")
    dev = torch.device(device)
    if benchmark_mode == "cudagraph" and dev.type != "cuda":
        raise ValueError(f"benchmark_mode: 'cudagraph' needs a CUDA device, got device={device!r}; "
                         "use 'no_graph'")
    dtype = parse_model_dtype(dtype)
    if kv_cache_layout not in LAYOUTS:
        raise ValueError(f"kv_cache_layout: expected one of {list(LAYOUTS)}, got {kv_cache_layout!r}")
    shape = Case.named_layout(kv_cache_layout, num_tokens=num_tokens, num_heads=num_heads,
                              head_size=head_size, block_size=block_size, num_blocks=num_blocks,
                              dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    (inp,) = make_input_sets(shape, num_tokens, 1, dev)
    key_cache, value_cache = make_caches(shape, dev)
    fill_caches(key_cache, value_cache, shape)
    reason = info.unsupported(inp.key, key_cache, cache_dtype, inp.k_scale)
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
