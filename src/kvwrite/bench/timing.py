"""Timers: device time from CUDA events, vLLM's host clock with a sync per call, and a CPU clock.

Every timer takes ``call(i)``, which launches call number ``i`` of a run of ``calls`` back-to-back
calls (the caller rotates inputs with ``i``), and returns one :class:`Timing`: a list of per-call
samples, each the duration of one run divided by its number of calls.

- :func:`time_device`: ``graph=True`` captures the run in one CUDA graph and records CUDA events
  around each replay; ``graph=False`` records the events around the eager run (launch cost
  included). With ``flush``, that buffer is zeroed before each sample, outside the events.
- :func:`time_host_sync`: vLLM's benchmark method, kept for comparison with published numbers.
- :func:`time_cpu`: ``time.perf_counter`` around runs on the CPU.
- :func:`launch_floor`: an empty kernel launched as the cuda implementations launch, the floor
  every benchmark header reports beside the copy bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["Timing", "time_device", "time_host_sync", "time_cpu", "copy_bandwidth", "l2_bytes",
           "l2_rotation", "empty_kernel_floor", "launch_floor", "floor_line", "MIN_SAMPLES"]

# Fewer samples than this make p20/p80 meaningless; below it the time budget is ignored.
MIN_SAMPLES = 10
# A guess where the device does not report its L2 (Hopper has 50-60 MB).
DEFAULT_L2_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Timing:
    samples: list[float]  # seconds per call, one per timed run
    calls: int            # calls per timed run
    mean: float           # seconds per call over all timed runs

    def quantile(self, q: float) -> float:
        """Linear interpolation between order statistics (q in [0, 1])."""
        s = sorted(self.samples)
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def _sample_count(estimate_s: float, iters: int, budget_s: float) -> int:
    """At most ``iters`` samples, fewer when they would run past ``budget_s`` (never < MIN_SAMPLES)."""
    if estimate_s <= 0 or math.isinf(budget_s):
        return max(1, iters)
    by_budget = int(budget_s / estimate_s)
    return max(1, min(iters, max(MIN_SAMPLES, by_budget)))


def time_device(call: Callable[[int], None], calls: int, iters: int, *, graph: bool,
                flush: torch.Tensor | None = None, budget_s: float = math.inf) -> Timing:
    """Device time per call from CUDA events; ``iters`` samples at most (see the module doc)."""
    for i in range(calls):  # eager warm-up: compiles kernels before any capture
        call(i)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                call(i)
        run = g.replay
    else:
        def run() -> None:
            for i in range(calls):
                call(i)

    def sample() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        if flush is not None:
            flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        return start, end

    run()
    first = sample()
    torch.cuda.synchronize()
    n = _sample_count(first[0].elapsed_time(first[1]) / 1e3, iters, budget_s)
    events = [sample() for _ in range(n)]
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) / 1e3 / calls for s, e in events]
    return Timing(samples, calls, statistics.fmean(samples))


def time_host_sync(fn: Callable[[], None], iters: int, *, graph: bool, device: torch.device,
                   warmup: int = 3) -> Timing:
    """vLLM's method: ``fn`` once per iteration, a synchronize after each, host clock around the loop.

    ``graph=True`` captures one call in a CUDA graph and times its replays, as vLLM does. ``mean`` is
    the loop's total time over ``iters`` (vLLM's number); ``samples`` hold each iteration's time.
    """
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()  # eager warm-up: a kernel must be compiled before it is captured
    sync()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        sync()
        fn = g.replay

    def loop(n: int) -> tuple[float, list[float]]:
        samples = []
        sync()
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return (time.perf_counter() - start) / n, samples

    loop(warmup)
    mean, samples = loop(iters)
    return Timing(samples, 1, mean)


def time_cpu(call: Callable[[int], None], calls: int, iters: int,
             budget_s: float = math.inf) -> Timing:
    """Host clock around runs of ``calls`` calls on the CPU; ``iters`` samples at most."""
    def run() -> float:
        t0 = time.perf_counter()
        for i in range(calls):
            call(i)
        return time.perf_counter() - t0

    run()
    n = _sample_count(run(), iters, budget_s)
    # The count comes from one run; on the CPU later runs can be much slower (the reference's
    # allocations), so the budget is also checked as the samples come in (never below
    # MIN_SAMPLES).
    samples, spent = [], 0.0
    for _ in range(n):
        seconds = run()
        samples.append(seconds / calls)
        spent += seconds
        if len(samples) >= MIN_SAMPLES and spent > budget_s:
            break
    return Timing(samples, calls, statistics.fmean(samples))


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Median of ``reps`` copies of ``nbytes`` (CUDA events on a GPU, the host clock on the CPU).
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def graph_copy_bandwidth(device: torch.device, nbytes: int, rotate_bytes: int = 0,
                         calls: int = 20, iters: int = 30) -> float:
    """The copy bandwidth (bytes read + written per second) of ``nbytes`` copies timed as the
    benchmark times a call: ``calls`` copies in one CUDA graph, the median replay per copy; with
    ``rotate_bytes``, enough source/destination pairs (at most ``calls``) that one replay
    touches at least that many bytes, so no copy finds its data in L2."""
    pairs = max(1, min(calls, -(-rotate_bytes // (2 * nbytes))))
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device=device),
             torch.empty(nbytes, dtype=torch.uint8, device=device)) for _ in range(pairs)]

    def call(i: int) -> None:
        dst, src = bufs[i % pairs]
        dst.copy_(src)

    return 2 * nbytes / time_device(call, calls, iters, graph=True).median


def l2_rotation(hot: bool, per_set: int, l2: int, max_sets: int) -> tuple[int, bool]:
    """(input sets a run rotates over, flush the L2 before each timed run), the benchmarks' one
    rule. Hot: one set. Cold: no call may find its inputs in the L2, so the sets together exceed
    twice the L2 (its LRU is imperfect), at most ``max_sets`` of them; when that many are still
    smaller (small calls), the L2 is flushed before each run as well."""
    if hot:
        return 1, False
    sets = min(max_sets, max(1, -(-2 * l2 // max(per_set, 1))))
    return sets, sets * per_set < 2 * l2


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 size as the driver reports it (a 64 MiB guess where it does not)."""
    if device.type != "cuda":
        return DEFAULT_L2_BYTES
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return int(size) if size else DEFAULT_L2_BYTES


def empty_kernel_floor(replays: int = 50, calls: int = 20) -> float:
    """Seconds per call of an empty NVRTC kernel (``floor.cu``, one thread) on the current GPU,
    launched as the cuda implementations launch (with programmatic dependent launch where it is
    on and the GPU takes it): ``calls`` calls in one CUDA graph, the median over ``replays``."""
    from ..kernels import nvrtc

    index = torch.cuda.current_device()
    nvrtc.cuda_core().Device(index).set_current()
    arch, _ = nvrtc.device_arch(index)
    pdl = nvrtc.pdl_on() and nvrtc.pdl_capable(index)
    kernel = _floor_source().kernel(arch, "kvw_empty", (nvrtc.PDL_MACRO,) if pdl else ())
    config = nvrtc.launch_config(1, 1, 1, 1, pdl)
    return time_device(lambda i: nvrtc.launch(index, config, kernel), calls, replays,
                       graph=True).median


@functools.cache
def _floor_source():
    from ..kernels import nvrtc

    return nvrtc.KernelSource(__package__, "floor.cu", "kvwrite_floor")


def launch_floor(device: torch.device) -> float | None:
    """Seconds per call of :func:`empty_kernel_floor` on ``device``, timed as the benchmarks
    time (20 calls per CUDA graph, median): the floor under any small call, measured in the same
    run. None off CUDA or where the cuda implementations cannot run."""
    from ..kernels import nvrtc

    if device.type != "cuda" or nvrtc.setup_reason() is not None:
        return None
    with torch.cuda.device(device):
        return empty_kernel_floor()


def floor_line(floor: float | None) -> str:
    """The header line of :func:`launch_floor`'s measurement."""
    if floor is None:
        return "launch floor: n/a (no CUDA device with the cuda implementations)"
    return (f"launch floor: {floor * 1e6:.2f} µs per call (an empty NVRTC kernel launched as the "
            "cuda implementations launch, the same timer)")
