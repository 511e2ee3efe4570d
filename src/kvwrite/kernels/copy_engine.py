"""The ``"ce"`` engine of the transfer ops (SPEC §9.5): copy engines instead of SMs.

A raw transfer (:class:`kvwrite.transfer.TransferPlan` of :class:`CopyJob`\\ s, a CPU mapping) is
the list of its contiguous runs (:func:`runs`): the byte ranges both sides share, so a layout
change splits a block into rows. :func:`run` submits every run of the call as one
``cuMemcpyBatchAsync`` (driver >= 12.8), or one ``cuMemcpyAsync`` per run where the driver has no
batched copies, on PyTorch's current stream of the plan's device; sources are read in stream
order (``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: never ``ANY``, whose DMA may read a source before
earlier work on the stream has written it). Nothing waits for the host. The host's work per
call is a few numpy operations per job geometry (the runs) and one foreign call with the arrays
(no Python object per run).

:func:`resolve` is the one rule that picks ``"sm"`` or ``"ce"`` for every op; :func:`copy_loop`
and :func:`copy_batch` submit given runs (the benchmark's peers: vLLM's ``swap_blocks``, one
copy per tensor and block, and ``swap_blocks_batch``, one batch).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import numpy as np
import torch

from ..transfer import CopyJob, TransferPlan, capturing, select

__all__ = ["batch_reason", "loop_reason", "runs", "job_runs", "run_bytes", "resolve", "run", "execute",
           "copy_loop", "copy_batch", "stream_handle", "enable_peer_access", "AUTO_MIN_RUN",
           "BATCH_DRIVER"]

# "auto" takes the copy engines only where every run is at least this long: shorter runs are
# bound by the engines' per-copy cost, and an SM copy keeps up with PCIe there (SPEC §9.5).
AUTO_MIN_RUN = 64 * 1024
# cuMemcpyBatchAsync came with CUDA 12.8 (cuDriverGetVersion's encoding: 1000*major + 10*minor).
BATCH_DRIVER = 12080


def _driver():
    from cuda.bindings import driver

    return driver


@functools.cache
def loop_reason(device: torch.device) -> str | None:
    """None where single copies (``cuMemcpyAsync``) can be submitted on ``device``, else why."""
    if device.type != "cuda":
        return f"copy engines need a CUDA device, got {device.type!r}"
    try:
        _driver()
    except ImportError:
        return "the copy-engine path needs cuda.bindings (pip install cuda-bindings)"
    return None


@functools.cache
def batch_reason(device: torch.device) -> str | None:
    """None where ``cuMemcpyBatchAsync`` is usable on ``device`` (a driver of CUDA 12.8 or later,
    whose library exports it: :func:`_batch_entry`), else why not."""
    reason = loop_reason(device)
    if reason is not None:
        return reason
    driver = _driver()
    try:
        err, v = driver.cuDriverGetVersion()
    except Exception as e:  # no driver library at all
        return f"no CUDA driver ({str(e).splitlines()[0]})"
    if int(err) != 0:
        return f"cuDriverGetVersion returned {err}"
    if v < BATCH_DRIVER:
        shown = f"{v // 1000}.{v % 1000 // 10}"
        return f"the driver supports CUDA {shown}; cuMemcpyBatchAsync needs 12.8 or later"
    try:
        _batch_entry()
    except (OSError, AttributeError) as e:
        return f"the driver library has no cuMemcpyBatchAsync ({str(e).splitlines()[0]})"
    return None


# --- the runs ------------------------------------------------------------------------------------

def _geometry(job: CopyJob) -> tuple:
    """What a job's runs depend on besides its pointers and block strides: jobs of one geometry
    have the same runs per pair at the same offsets from their blocks (a swap's layers)."""
    return (job.heads, job.tokens, job.elems, job.elem_bytes, job.src.strides[1:],
            job.dst.strides[1:])


def _adjacent(heads, tokens, elems, elem_bytes, s, d) -> tuple[bool, bool]:
    """(tokens merge, heads merge) of a dense-row geometry (:func:`_geometry`; ``s``, ``d``: the
    head, token and element strides): whether consecutive rows are adjacent on both sides across
    tokens, and then also across heads (so a pair's rows are one run)."""
    rb = elems * elem_bytes
    tok = tokens == 1 or (s[1] == rb and d[1] == rb)
    head = tok and (heads == 1 or (s[0] == tokens * rb and d[0] == tokens * rb))
    return tok, head


def _run_bytes(heads, tokens, elems, elem_bytes, s, d) -> int:
    if not (s[2] == elem_bytes and d[2] == elem_bytes):  # CopyJob.dense_rows
        return elem_bytes
    tok, head = _adjacent(heads, tokens, elems, elem_bytes, s, d)
    if head:
        return heads * tokens * elems * elem_bytes
    return (tokens if tok else 1) * elems * elem_bytes


def run_bytes(job: CopyJob) -> int:
    """The bytes of each run of ``job`` (every run of a job has the same length)."""
    return _run_bytes(*_geometry(job))


@functools.lru_cache(maxsize=16)
def _pattern(heads, tokens, elems, elem_bytes, s, d) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets of a pair's runs from its source and destination blocks (same order: h, t,
    c), for a geometry (:func:`_geometry`; cached: a call's layers share one, and so do the calls
    of an engine). Read-only: shared by every call."""
    if s[2] == elem_bytes and d[2] == elem_bytes:
        tok, head = _adjacent(heads, tokens, elems, elem_bytes, s, d)
        h = np.arange(1 if head else heads, dtype=np.int64)
        t = np.arange(1 if tok else tokens, dtype=np.int64)
        c = np.zeros(1, dtype=np.int64)
    else:
        h = np.arange(heads, dtype=np.int64)
        t = np.arange(tokens, dtype=np.int64)
        c = np.arange(elems, dtype=np.int64)

    def grid(st) -> np.ndarray:
        out = (h[:, None, None] * st[0] + t[None, :, None] * st[1]
               + c[None, None, :] * st[2]).reshape(-1)
        out.flags.writeable = False
        return out
    return grid(s), grid(d)


def _empty() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.zeros(0, dtype=np.uint64) for _ in range(3))


def _grouped_runs(jobs, src_ids: np.ndarray, dst_ids: np.ndarray):
    """The runs of ``jobs`` for the pairs ``(src_ids[m], dst_ids[m])``, job by job, pair by pair,
    as uint64 (dst, src, sizes). Vectorized per geometry: the runs of the jobs of one geometry
    are one broadcast sum (job base + id * block stride) + run offset, placed at each job's
    position of the output; the Python loop is over jobs for their pointers only."""
    pairs = src_ids.size
    if pairs == 0 or not jobs:
        return _empty()
    groups: dict[tuple, list[int]] = {}
    # Per job: source ptr, source block stride, destination ptr, destination block stride.
    rows = []
    for k, job in enumerate(jobs):
        rows.append((job.src.ptr, job.src.strides[0], job.dst.ptr, job.dst.strides[0]))
        if job.heads * job.tokens * job.elems:
            groups.setdefault(_geometry(job), []).append(k)
    base = np.array(rows, dtype=np.int64)
    count = np.zeros(len(jobs), dtype=np.int64)  # runs per pair of each job (0: no elements)
    size = np.zeros(len(jobs), dtype=np.int64)
    for g, ks in groups.items():
        count[ks] = _pattern(*g)[0].size
        size[ks] = _run_bytes(*g)
    per_job = count * pairs
    total = int(per_job.sum())
    if total == 0:
        return _empty()
    start = np.cumsum(per_job) - per_job
    dst = np.empty(total, dtype=np.int64)
    src = np.empty(total, dtype=np.int64)
    for g, ks in groups.items():
        so, do = _pattern(*g)
        b = base[ks]  # [K, 4]
        # [K, pairs, runs]: the block of each pair of each job, then the run in the block.
        s = (b[:, 0, None] + src_ids[None, :] * b[:, 1, None])[:, :, None] + so[None, None, :]
        d = (b[:, 2, None] + dst_ids[None, :] * b[:, 3, None])[:, :, None] + do[None, None, :]
        if len(groups) == 1 and len(ks) == len(jobs):  # every job, in order: no scatter
            src[:], dst[:] = s.reshape(-1), d.reshape(-1)
            continue
        at = (start[ks][:, None] + np.arange(pairs * so.size, dtype=np.int64)[None, :]).reshape(-1)
        src[at], dst[at] = s.reshape(-1), d.reshape(-1)
    sizes = np.repeat(size, per_job).astype(np.uint64)
    return dst.astype(np.uint64), src.astype(np.uint64), sizes


def job_runs(job: CopyJob, src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst_ptrs, src_ptrs, sizes) of ``job`` for the pairs ``(src_ids[m], dst_ids[m])``, pair
    by pair, uint64."""
    return _grouped_runs((job,), np.asarray(src_ids, dtype=np.int64).reshape(-1),
                         np.asarray(dst_ids, dtype=np.int64).reshape(-1))


def runs(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst_ptrs, src_ptrs, sizes): every contiguous run common to both sides of every job of
    ``plan`` for every pair of its CPU mapping (job by job, pair by pair), as uint64 arrays.

    A dense-row job whose rows are also adjacent on both sides gives one run per pair; rows
    adjacent across tokens only, one per (pair, head); else one per (pair, head, token) row. A job
    whose elements are not adjacent on a side gives one run per element. Runs are not merged
    across pairs (a pair is vLLM's unit: one block of one tensor)."""
    if plan.host_mapping is None:
        raise ValueError("block_mapping: the copy engines take a CPU mapping only (the runs are "
                         "read on the host)")
    m = plan.host_mapping.to(torch.int64).numpy()
    return _grouped_runs(plan.jobs, m[:, 0], m[:, 1])


# --- the rule ----------------------------------------------------------------------------------

def resolve(plan: TransferPlan) -> str:
    """``"sm"`` or ``"ce"`` for ``plan`` (SPEC §9.5).

    ``"ce"`` as requested (a CUDA graph cannot capture it: ValueError naming ``engine``);
    ``"auto"``: ``"ce"`` for a raw host<->device call with a CPU mapping, outside capture, whose
    runs are all at least :data:`AUTO_MIN_RUN` bytes, on a driver with batched copies; else
    ``"sm"``. A host-to-host call (``plan.device`` None) is the torch reference's: ``"sm"``; so
    is a call across two GPUs (``plan.peer``) under ``"auto"``: device to device, where an SM
    copy outruns the copy engines (unmeasured across NVLink: ``kvwrite-bench transfer
    --direction p2p`` times both)."""
    if plan.engine not in ("auto", "sm", "ce"):
        raise ValueError(f"engine: expected 'auto', 'sm' or 'ce', got {plan.engine!r}")
    if plan.device is None or plan.engine == "sm":
        return "sm"
    if plan.engine == "ce":
        if capturing(plan.device):
            raise ValueError("engine: 'ce' cannot be captured in a CUDA graph (copy engines "
                             "need the mapping on the host at every call); use 'sm' or 'auto'")
        # The op's validation refuses these first (naming engine): the copy engines move raw
        # bytes between addresses read on the host.
        assert plan.page_job is None and plan.host_mapping is not None, plan
        reason = loop_reason(plan.device)
        if reason is not None:
            raise ValueError(f"engine: 'ce' cannot run here: {reason}")
        return "ce"
    if (plan.page_job is not None or plan.host_mapping is None or plan.pairs == 0
            or not plan.jobs or plan.peer is not None or capturing(plan.device)):
        return "sm"
    if not all(job.src.on_host != job.dst.on_host for job in plan.jobs):
        return "sm"  # device to device: copy engines are far slower than SMs (SPEC §9.7)
    if any(run_bytes(job) < AUTO_MIN_RUN for job in plan.jobs):
        return "sm"
    return "ce" if batch_reason(plan.device) is None else "sm"


# --- submitting --------------------------------------------------------------------------------

@functools.cache
def _primary_context(index: int):
    driver = _driver()
    _check(driver.cuInit(0), "cuInit")
    err, dev = driver.cuDeviceGet(index)
    _check((err,), "cuDeviceGet")
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)  # PyTorch's context; kept for the process
    _check((err,), "cuDevicePrimaryCtxRetain")
    return ctx


def _check(result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")


def stream_handle(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check(_driver().cuCtxSetCurrent(_primary_context(index)), "cuCtxSetCurrent")
    return torch.cuda.current_stream(index).cuda_stream


# (device, peer) index pairs whose peer access this process has enabled (or found enabled).
_PEERS: set[tuple[int, int]] = set()


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let work on ``device`` (a call's device: its destination's) address ``peer``'s memory
    (its source's): ``cuCtxEnablePeerAccess`` in ``device``'s primary context (PyTorch's), once
    per pair and process. Access enabled before, by PyTorch's own cross-device copies or anyone
    else, is fine. Kernels need it to read the peer's memory (Triton's launcher also checks
    each pointer with cuPointerGetAttribute in the current context, which fails for a peer
    pointer without it); copy engines move the bytes without host staging with it. The
    transfer ops validated that ``device`` can access ``peer`` (kvwrite.transfer.call_devices).

    Never during a graph capture: CUDA refuses ``cuCtxEnablePeerAccess`` then, even in relaxed
    capture mode and even for access already on (two H200s:
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated). A captured call of a
    pair this process has not enabled raises, before any driver call, saying what to do."""
    key = (device.index, peer.index)
    if key in _PEERS:
        return
    if capturing(device):
        raise RuntimeError(
            f"peer access from {device} to {peer} was not enabled by an earlier call, and CUDA "
            f"refuses to enable it while a graph is captured: make one call across these GPUs "
            f"before capturing")
    driver = _driver()
    with torch.cuda.device(device.index):
        _check(driver.cuCtxSetCurrent(_primary_context(device.index)), "cuCtxSetCurrent")
        err, = driver.cuCtxEnablePeerAccess(_primary_context(peer.index), 0)
    if err not in (driver.CUresult.CUDA_SUCCESS,
                   driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise RuntimeError(f"cuCtxEnablePeerAccess ({device} reading {peer}) failed: {err}")
    _PEERS.add(key)


def copy_loop(dst_ptrs, src_ptrs, sizes, stream: int) -> None:
    """One ``cuMemcpyAsync`` per run on the stream handle ``stream`` (vLLM's ``swap_blocks``:
    one ``cudaMemcpyAsync`` per tensor and block). PyTorch's primary context must be current
    (:func:`run` makes it so; the benchmark calls it after :func:`stream_handle`)."""
    driver = _driver()
    s = driver.CUstream(stream)
    ptr = driver.CUdeviceptr
    for d, src, n in zip(np.asarray(dst_ptrs).tolist(), np.asarray(src_ptrs).tolist(),
                         np.asarray(sizes).tolist(), strict=True):
        _check(driver.cuMemcpyAsync(ptr(d), ptr(src), n, s), "cuMemcpyAsync")


@functools.cache
def _attributes():
    driver = _driver()
    a = driver.CUmemcpyAttributes()
    # Stream order: a source is read after the work enqueued before it (never ANY, SPEC §9.7).
    a.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    # A hint: transfers run beside attention, which should keep its SMs and bandwidth.
    a.flags = int(driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    return a


# The driver's cuMemcpyBatchAsync as CUDA 12.8 defined it:
#   CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
#       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
#       CUstream hStream)
# called through ctypes with the runs' uint64 arrays as they are. cuda.bindings' wrapper takes
# lists of CUdeviceptr objects and of Python ints (numpy arrays are refused), so a call of n runs
# built 2n objects and converted 3n items back: ~0.2 us a run on the host, before the driver
# starts the first copy. A driver keeps every entry point under the name and signature of the
# release that introduced it (CUDA 13 added its failIdx-less form as cuMemcpyBatchAsync_v2), so
# this one is the same on every driver >= 12.8 whichever cuda.bindings is installed.
_ENTRY_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
               ctypes.c_void_p)
_ATTRIBUTE_STARTS = np.zeros(1, dtype=np.uint64)  # attrsIdxs: one attribute set from copy 0
_NO_INDEX = 2**64 - 1                             # failIdx where no copy is at fault (SIZE_MAX)


@functools.cache
def _batch_entry():
    """The driver library's ``cuMemcpyBatchAsync`` (the CUDA 12.8 signature above); OSError or
    AttributeError where the library or the symbol is missing."""
    entry = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync  # the library PyTorch has loaded
    entry.argtypes = _ENTRY_ARGS
    entry.restype = ctypes.c_int
    return entry


def _batch(dst_ptrs, src_ptrs, sizes, stream: int) -> None:
    n = np.ascontiguousarray(sizes, dtype=np.uint64)
    dsts = np.ascontiguousarray(dst_ptrs, dtype=np.uint64)
    srcs = np.ascontiguousarray(src_ptrs, dtype=np.uint64)
    if not dsts.size == srcs.size == n.size:
        raise ValueError(f"copy_batch: expected as many destinations, sources and sizes, got "
                         f"{dsts.size}, {srcs.size} and {n.size}")
    attributes = _attributes()
    fail = ctypes.c_size_t(_NO_INDEX)
    # The driver reads these host arrays during the call only; they are held here until it
    # returns (CUdeviceptr and size_t are 64-bit: the uint64 arrays are the C arrays).
    err = _batch_entry()(dsts.ctypes.data, srcs.ctypes.data, n.ctypes.data, n.size,
                         attributes.getPtr(), _ATTRIBUTE_STARTS.ctypes.data, 1,
                         ctypes.addressof(fail), stream)
    if err != 0:
        where = f" at copy {fail.value}" if fail.value < n.size else ""
        with contextlib.suppress(ValueError):  # a code this cuda.bindings does not name
            err = _driver().CUresult(err)
        raise RuntimeError(f"cuMemcpyBatchAsync failed{where}: {err}")


_SIDE: dict[int, tuple] = {}


def copy_batch(dst_ptrs, src_ptrs, sizes, stream: int, device: torch.device) -> None:
    """One ``cuMemcpyBatchAsync`` of the runs, in stream order with ``stream`` (vLLM's
    ``swap_blocks_batch``). The legacy default stream (handle 0) is refused by the driver
    (vllm#46379): there the batch runs on a side stream between two events, so it still starts
    after the work before it and the work after it waits for it."""
    if len(sizes) == 0:
        return
    if stream != 0:
        _batch(dst_ptrs, src_ptrs, sizes, stream)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = (torch.cuda.Stream(index), torch.cuda.Event(), torch.cuda.Event())
    side, before, after = _SIDE[index]
    main = torch.cuda.current_stream(index)
    before.record(main)
    side.wait_event(before)
    _batch(dst_ptrs, src_ptrs, sizes, side.cuda_stream)
    after.record(side)
    main.wait_event(after)


def run(plan: TransferPlan) -> None:
    """Submit every run of ``plan`` (:func:`runs`) on PyTorch's current stream of its device
    (a call across two GPUs: the destination's, the source read through unified addressing):
    one batch where the driver has batched copies, else one copy per run. No host sync."""
    assert plan.page_job is None and plan.host_mapping is not None and plan.device is not None
    dst, src, sizes = runs(plan)
    if sizes.size == 0:
        return
    if plan.peer is not None:
        enable_peer_access(plan.device, plan.peer)
    # stream_handle makes the device's context current: the caller's device comes back after.
    with torch.cuda.device(plan.device):
        stream = stream_handle(plan.device)
        if batch_reason(plan.device) is None:
            copy_batch(dst, src, sizes, stream, plan.device)
        else:
            copy_loop(dst, src, sizes, stream)


def execute(op: str, plan: TransferPlan, implementation: str | None) -> None:
    """Run a validated plan (what every transfer op does last): pick the implementation (it
    raises where none can run the call), resolve the engine, then run nothing where no pair is
    mapped, else the copy engines' path or the implementation's ``run``."""
    info = select(op, plan, implementation)
    engine = "sm" if plan.device is None else resolve(plan)
    if plan.pairs == 0:
        return
    if engine == "ce":
        run(plan)
    else:
        info.run(plan)
