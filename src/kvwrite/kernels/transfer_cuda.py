"""The CUDA implementation of every transfer op (SPEC §9): ``transfer.cu`` compiled at run time
with NVRTC, launched on PyTorch's current stream. The ops' ``cuda_impl`` modules re-export
:func:`available`, :func:`unsupported` and :func:`run`.

A :class:`~kvwrite.transfer.TransferPlan` runs as:

- its raw copies (``plan.jobs``): ``transfer_copy_kernel<VB, IDX, U>`` (rows longer than a warp
  covers: a warp's segment of 32 * U vectors of one row) or ``transfer_copy_rows_kernel<VB, IDX,
  U, LANES>`` (rows of at most 32 vectors: LANES lanes a row, U rows a lane, :func:`copy_lanes`),
  one launch per group of at most :data:`SLOTS` jobs of one geometry (strides, counts, block
  counts and vector width VB; the jobs of a multi-layer call of one layout form one group, so 64
  layers take two launches).
  The jobs' pointers are scalar arguments in fixed slots: cuda.core's launch takes scalars only,
  and a pointer table on the device would need an allocation and a host copy each call, which a
  CUDA graph captured without a warm-up call cannot hold.
- its quantized pages (``plan.page_job``): ``transfer_pack_kernel<FMT, IN, IDX, ALIGNED, U>`` or
  ``transfer_unpack_kernel<FMT, OUT, IDX, ALIGNED, U>``, one launch per run of at most
  :data:`SLOTS` consecutive layers with equal strides (layer pointers in slots as above); the
  first pack launch also writes every chunk's scales and zero tail. ALIGN > 0 (fixed-width
  accesses, U groups a lane in flight) where :func:`page_align` allows, else the general variant
  (ALIGN = 0, U = 1).

Every kernel is a persistent grid-stride loop: at most ``plan.max_ctas`` CTAs per launch where
set, else enough to cover the work up to ``ctas_per_sm`` CTAs per SM. Graph-safe: no
allocation, no host synchronization, no host copy; the mapping and ``scale`` are read on the
device (a pair with an id outside a side's ``[0, blocks)`` is skipped).
"""

from __future__ import annotations

import dataclasses

import torch

from ..transfer import CopyJob, PageJob, TransferPlan
from . import copy_engine, launch, nvrtc

__all__ = ["TransferTuning", "TUNING", "SOURCE", "SLOTS", "available", "unsupported", "run",
           "all_kernel_names", "compile_kernel", "copy_launches", "page_launches", "copy_name",
           "page_name", "page_align", "page_aligns", "page_unit_elems", "page_unroll",
           "page_launch_args", "PageLaunchArgs", "magic", "copy_lanes", "copy_rows_unroll",
           "copy_calls", "CopyCall", "ROWS_MOST", "grid_size", "pair_major", "halve_rows"]

SOURCE = nvrtc.KernelSource(__package__, "transfer.cu", "kvwrite_transfer")
# Pointer slots per launch (KVW_SLOTS in transfer.cu): (src, dst) pairs of a copy launch, layer
# pointers of a page launch. 64: a 32-layer call's K and V (64 jobs) or DeepSeek-V3's 61
# layers in one launch, with 128 + 20 eight-byte parameters (far below the 4 KiB limit).
# Measured against 32 (H200, 128 / 1024 blocks, every SM, tuning-log 104): raw pages
# Llama-3-8B pack 1840 -> 1882 / 1916 -> 1926 GB/s, unpack 1828 -> 1892 / 1941 -> 1939;
# DeepSeek-V3 relayout 1899-1925 -> 1938-1954 at 128 blocks (jobs a launch 8 / 16 / 32 before:
# Llama-3-8B raw pack 1638 / 1731 / 1842-1855 at 128 blocks).
SLOTS = 64
# The page kernels' FMT (transfer.cu: DT_E4M3, DT_E5M2, KVW_NVFP4).
_FMT = {"fp8_e4m3": launch.DT_E4M3, "fp8_e5m2": launch.DT_E5M2, "nvfp4": 6}


@dataclasses.dataclass(frozen=True, eq=False)
class TransferTuning(launch.PdlPolicy):
    """The launch constants of the transfer kernels. ``TUNING`` is what every call uses unless a
    caller passes another one (tests forcing a path)."""

    # Threads per CTA of the copy kernel: 1024, the most a CTA takes. Measured (H200, Llama-3-8B
    # pages, 32 layers, docs/tuning-log.md change 72): a budget of max_ctas CTAs moves more the
    # more warps each holds (d2h at 4 CTAs: 512 threads 43 GB/s, 1024 threads 50).
    copy_threads: int = 1024
    # The most vectors a lane loads before its stores (U, compiled in): a warp's segment is 32 * U
    # vectors of one row, U the largest power of two up to this whose segment the row fills (see
    # copy_unroll); rows of at most 32 vectors: one vector of each of U rows, U this up to
    # ROWS_MOST (copy_rows_unroll). Device to device: 2, measured (H200, 32 Llama-3-8B layers,
    # 128 random blocks, all SMs, change 72): U 2 / 4 / 8 at 1024 threads 1923 / 1865 / 1809 GB/s
    # (the device copy: 2086). The rows kernel with each step's rows taken from its first
    # (tuning-log 87), relayout and raw pages, 128 / 1024 blocks: U = 2 1825-1854 / 1896-1930,
    # U = 4 1784-1840 / 1919-1936 (the device copy: 2111): 2 kept.
    loads_in_flight: int = 2
    # The same where a side is in pinned host memory: 8, measured (change 72): d2h at 1 CTA,
    # U 2 / 4 / 8: 25 / 38 / 38 GB/s; at 2 and 4 CTAs every U gives 50-52 (the link: 55).
    # Peer reads (a source on another GPU) too, measured on a pair of H200s (NVLink, 32
    # Llama-3-8B layers, 128-1024 blocks, tuning-log 78), GB/s at 4 / 8 / all CTAs: U = 2 72 /
    # 140 / 374, U = 8 169 / 334 / 375, U = 16 78 / 155 at 4 / 8.
    loads_in_flight_host: int = 8
    # U of a rows launch that reads pinned host memory (h2d: unpacking raw pages, a relayout from
    # the host): 4. Measured (H200, 32 Llama-3-8B layers, raw unpack of 16-128 blocks, tuning-log
    # 87), GB/s at 1 / 2 / 4 CTAs: U = 4 24.8 / 46.7 / 50.3, U = 8 13.6 / 26.2 / 47.7 (the link:
    # 55), where d2h packing gained from 8 (1 CTA 41.6 vs 27.7, 2-4 CTAs 51.5-52.2 vs 28.9-33.9).
    host_read_rows: int = 4
    # A peer's long rows (a swap's whole blocks: more than 32 vectors) moved as rows of this many
    # vectors by the rows kernel (U = loads_in_flight_host rows a lane, each step's rows taken
    # from its first's address) where their vectors are dense and a multiple of it; 0: warp
    # segments (transfer_copy_kernel). Measured: tuning-log 87.
    peer_row_vectors: int = 32
    # Threads of a copy launch to pinned host memory (d2h), over its CTA budget (copy_threads):
    # 512, at least 128 a CTA. Measured (H200, 32 Llama-3-8B layers d2h, max_ctas=4, beside bf16
    # causal SDPA [1, 32, 8192, 128], change 72): 1024-thread CTAs 51.9 / 52.2 GB/s at 16 / 128
    # blocks and the attention 1.06 / 1.39 of its time alone (a CTA that fills its SM keeps the
    # attention's CTAs off it); 128-thread CTAs 51.7 / 50.7 GB/s and 0.91 / 0.96. The same split
    # of h2d took it from 50.7 to 25.9 GB/s (reads wait a round trip): h2d keeps 1024.
    host_threads: int = 512
    host_cta_threads: int = 128
    # Jobs per copy launch, at most SLOTS: every slot (fewest launches; measured at SLOTS).
    jobs_per_launch: int = SLOTS
    # The order of a rows launch's rows (pair_major): "auto" (by where its jobs lie), "jobs" or
    # "pairs" (tests forcing one).
    rows_order: str = "auto"
    # Dense rows of this many vectors, in a device copy on every SM (no max_ctas), are moved as
    # two jobs of half rows where the halves fit one launch's slots (halve_rows); 0: never.
    # Measured (H200, 32 Llama-3-8B layers of 512-byte rows, relayout, two rounds, GB/s at 16 /
    # 128 / 1024 blocks, tuning-log 107): to LBHNC 1438-1559 / 1823-1832 / 1916-1922 as rows of
    # 32 vectors, 1437-1546 / 1912 / 1956 as half rows (16 lanes a row, two rows a warp's
    # load); to a page-first buffer 1465-1479 / 1812-1818 / 1904-1905 against 1485-1565 / 1923-
    # 1926 / 1993-1996; at max_ctas=4 half rows lost 3% (96-98 against 99-100): not there.
    half_rows: int = 32
    # Threads per CTA of the page kernels (a warp's item: 32 * U groups of 16 elements of one
    # (pair, chunk, layer, part) segment): 1024, as the copy kernel (launch bounds: at most 64
    # registers a thread, tests/test_transfer_cuda.py). Measured (H200, 32 Llama-3-8B layers,
    # 128 / 1024 blocks, every SM, tuning-log 88), GB/s of page bytes: 1024 threads fp8 pack
    # 936 / 1000, NVFP4 pack 616 / 658, unpack fp8 1183 / 1248, NVFP4 718 / 749; 512 threads, two
    # CTAs an SM: 901 / 942, 588 / 618, 1208 / 1262, 743 / 750; before the unit walk one CTA of
    # 512 threads lost 18% (fp8 pack 639 vs 776), four of 256 6%.
    page_threads: int = 1024
    # The most cache bytes a lane's units cover in a warp item of the aligned page variants (U
    # units of page_unit_elems elements: fp8 16-byte vectors, nvfp4 groups of 16; U the largest
    # power of two within this whose item of 32 * U units the segment fills). 64: a pack's
    # 1024-thread CTA holds 64 KiB of reads in flight, twice the copy kernel's at its measured
    # best (U = 2 vectors of 16 bytes), within 64 registers (bfloat16 groups: U = 2; float32
    # groups: 1; fp8 vectors: 4). Measured before the unit walk (tuning-log 88; 128 / 1024
    # blocks, bfloat16): 32 bytes fp8 pack 604 / 629 GB/s, 64 776 / 823, 128 817 / 881 (NVFP4
    # unpack 613 / 667 against 674 / 733); with the walk, 128 bytes spill the pack's registers
    # (fp8: 124 bytes). The NVFP4 pack's two batches an item spill 36 bytes of invariants at 64
    # (tuning-log 109). The graph-timed sweep of 32 / 64 / 128 (tuning-log 108's run 2, µs):
    # NVFP4 pack (one batch) 156.5 / 119.7 / 124.2, unpack 123.5 / 104.2 / 122.7, fp8 unpack
    # 115.0 / 112.4 / 113.9.
    page_bytes_in_flight: int = 64
    # CTAs per SM where max_ctas is None (a persistent grid that covers the GPU): one CTA of
    # 1024 threads (the copy kernel's registers, at most 64 a thread at U = 8 (ptxas, sm_90,
    # tests/test_transfer_cuda.py), leave no room for a second).
    ctas_per_sm: int = 1
    # CTAs per SM of the page kernels where max_ctas is None: one of 1024 threads (64 registers a
    # thread fill the SM's 65536).
    page_ctas_per_sm: int = 1


TUNING = TransferTuning()


def available(device: torch.device) -> str | None:
    """None on a CUDA device with cuda.core and NVRTC, else why not (what to install)."""
    return nvrtc.available(device)


def unsupported(plan: TransferPlan) -> str | None:
    """Every plan with a GPU side runs; two host sides are the torch implementation's."""
    if plan.device is None:
        return "both sides in host memory (the torch implementation copies those)"
    return None


def _idx(mapping: torch.Tensor) -> str:
    return launch.int_type(mapping.dtype)


def copy_unroll(nvec: int, most: int) -> int:
    """U of a launch whose rows have ``nvec`` vectors: the largest power of two up to ``most``
    whose warp segment (32 * U vectors) the row fills, 1 for rows shorter than a warp's 32."""
    u = 1
    while u * 2 <= most and 64 * u <= nvec:
        u *= 2
    return u


# The most rows a lane of transfer_copy_rows_kernel moves at once. A lane decomposes its first row
# of a step and takes the next ones (the same block's later tokens) from its address, so only
# the loaded vectors grow with U; at U = 8 a step whose rows leave that block moves them two at a
# time (all eight rows' addresses held spilled past the launch bounds' 64 registers; as it is,
# 40-62 registers and no stack, tests/test_transfer_cuda.py). A device copy takes U = 2
# (loads_in_flight), a peer's source or a pinned host destination 8 (loads_in_flight_host), a
# pinned host source 4 (host_read_rows). Measured (H200 pair, 32 Llama-3-8B layers, tuning-log
# 87), GB/s: peer relayout to LBHNC at 4 / 8 CTAs U = 8 191 / 364, U = 4 123 / 244 (the rows
# decomposed one by one, as before: U = 4 62 / 122); raw pages d2h at 4 CTAs U = 8 52.2, U = 4
# 30.5 (before: 15.9).
ROWS_MOST = 8


def copy_lanes(nvec: int) -> int:
    """Lanes a row of ``nvec`` vectors takes in transfer_copy_rows_kernel: the least power of two
    >= nvec where nvec <= 32 (a warp then moves 32 // lanes rows a load instead of one row, whose
    segment left 32 - nvec lanes idle), else 0: segments of one row (transfer_copy_kernel).
    Rows of 17-31 vectors keep 32 lanes (as a segment would), but U of them a lane."""
    if nvec > 32:
        return 0
    lanes = 1
    while lanes < nvec:
        lanes *= 2
    return lanes


def copy_rows_unroll(most: int) -> int:
    """U of a rows launch (rows a lane loads before its stores): ``most`` up to :data:`ROWS_MOST`,
    a power of two."""
    u = 1
    while u * 2 <= min(most, ROWS_MOST):
        u *= 2
    return u


def pair_major(cl: CopyLaunch, order: str = "auto") -> bool:
    """Whether the rows launch ``cl`` walks its rows pair-major ((pair, job, head, token), not
    (job, pair, head, token)): ``order`` "pairs" or "jobs" where it is not "auto"; else where its
    jobs (two or more) lie inside one block of a side, every job's pointer on that side less than
    a block stride from the others' (a page-first buffer's layers, a page's chunks: the grid then
    finishes each block's region of that buffer before it moves on, instead of striding over
    every block once a job). Jobs in allocations of their own on both sides (per-layer caches)
    keep job-major: each job's region walked whole. Measured (H200, 32 Llama-3-8B layers,
    every SM, two rounds, GB/s at 128 / 1024 blocks, tuning-log 105), job-major against
    pair-major: relayout to a page-first buffer 1789 / 1900 against 1813-1821 / 1906; raw pack
    1885 / 1904-1910 against 1785-1929 / 1993; raw unpack 1897-1908 / 1940 against 1883-1896 /
    1968; relayout to per-layer LBHNC 1831-1836 / 1917-1920 against 1805-1809 / 1894."""
    if order != "auto":
        return order == "pairs"
    if len(cl.pointers) < 2:
        return False
    for side, stride in ((0, cl.geometry[0]), (1, cl.geometry[4])):
        ptrs = [p[side] for p in cl.pointers]
        if max(ptrs) - min(ptrs) < abs(stride):
            return True
    return False


def halve_rows(cl: CopyLaunch, tuning: TransferTuning = TUNING) -> CopyLaunch | None:
    """``cl`` with each job cut into two jobs of half rows (the second half's pointers moved by
    half a row's vectors; job order: a job's halves together) where its rows are dense rows of
    ``tuning.half_rows`` vectors and twice its jobs fit one launch's slots; None elsewhere. The
    same bytes move either way; copy_calls asks it for device copies on every SM."""
    g = cl.geometry
    nvec, ppe = g[12], g[13]
    if not tuning.half_rows or nvec != tuning.half_rows or nvec % 2 or ppe != 1:
        return None
    if 2 * len(cl.pointers) > _jobs_per_launch(tuning):
        return None
    half = nvec // 2 * cl.vb  # bytes: a dense row's vectors are vb apart on both sides
    pointers = tuple(q for s, d in cl.pointers for q in ((s, d), (s + half, d + half)))
    return CopyLaunch(cl.vb, pointers, (*g[:12], nvec // 2, ppe), g[10] * g[11] * (nvec // 2))


def copy_name(vb: int, mapping_dtype: torch.dtype, unroll: int, lanes: int = 0) -> str:
    """The name expression of a copy kernel variant: segments of one row (``lanes`` 0) or
    ``lanes`` lanes a row."""
    if lanes:
        return (f"transfer_copy_rows_kernel<{vb}, {launch.int_type(mapping_dtype)}, {unroll}, "
                f"{lanes}>")
    return f"transfer_copy_kernel<{vb}, {launch.int_type(mapping_dtype)}, {unroll}>"


def page_name(direction: str, page_format: str, cache_dtype: torch.dtype,
              mapping_dtype: torch.dtype, align: int = 0, unroll: int = 1) -> str:
    """The name expression of a page kernel variant (``align``: its ALIGN, 0 for the general
    variant, see :func:`page_align`; ``unroll``: its U, 1 for the general one)."""
    kern = "transfer_pack_kernel" if direction == "pack" else "transfer_unpack_kernel"
    return (f"{kern}<{_FMT[page_format]}, {launch.kind(cache_dtype)}, "
            f"{launch.int_type(mapping_dtype)}, {align}, {unroll}>")


def page_aligns(page_format: str) -> tuple[int, ...]:
    """The ALIGN values of a page format's aligned variants (up to a group's code bytes)."""
    return (4, 8) if page_format == "nvfp4" else (4, 8, 16)


def all_kernel_names(tuning: TransferTuning = TUNING) -> list[str]:
    """Every variant :func:`run` can launch with ``tuning`` (for compile tests)."""
    most = max(tuning.loads_in_flight, tuning.loads_in_flight_host)
    unrolls = [u for u in (1, 2, 4, 8, 16, 32) if u <= most]
    names = [copy_name(vb, dt, u) for vb in (1, 2, 4, 8, 16)
             for dt in (torch.int32, torch.int64) for u in unrolls]
    row_unrolls = sorted({copy_rows_unroll(tuning.loads_in_flight),
                          copy_rows_unroll(tuning.loads_in_flight_host),
                          copy_rows_unroll(tuning.host_read_rows)})
    names += [copy_name(vb, dt, u, lanes) for vb in (1, 2, 4, 8, 16)
              for dt in (torch.int32, torch.int64) for u in row_unrolls
              for lanes in (1, 2, 4, 8, 16, 32)]
    for d in ("pack", "unpack"):
        for c in (torch.float16, torch.bfloat16, torch.float32):
            for f in _FMT:
                most = page_unroll(f, c, 1 << 30, tuning.page_bytes_in_flight)
                variants = [(0, 1)] + [(a, u) for a in page_aligns(f)
                                       for u in (1, 2, 4, 8, 16) if u <= most]
                names += [page_name(d, f, c, dt, a, u) for dt in (torch.int32, torch.int64)
                          for a, u in variants]
    return names


# Compile kernel variants to one cubin for an arch with NVRTC (no GPU needed): tests and probes.
compile_kernel = SOURCE.compile


@dataclasses.dataclass(frozen=True)
class CopyLaunch:
    """One copy launch: its variant, the (src, dst) pointers of its jobs, and the geometry that
    follows them in the kernel's parameters, and the vectors it moves per pair."""

    vb: int
    pointers: tuple[tuple[int, int], ...]
    geometry: tuple[int, ...]   # ssb, ssh, sst, ssc, dsb, dsh, dst, dsc, sblocks, dblocks,
    #                             heads, tokens, nvec, ppe
    vectors_per_pair: int


# The launches of the last few cached plans (their keys hold no tensor: weak references only).
_MEMO = launch.BoundedMemo(16)


def _job_launch_key(job: CopyJob) -> tuple[int, tuple[int, ...]] | None:
    """(VB, geometry) of a job, None where it moves nothing. A stride over a dim of one index
    never moves an address: it counts as 0 (neither in the vector width nor in the grouping)."""
    if job.heads * job.tokens * job.elems == 0:
        return None
    src, dst = job.src, job.dst

    def strides(side):
        sb, sh, st, sc = side.strides
        return (sb, sh if job.heads > 1 else 0, st if job.tokens > 1 else 0,
                sc if job.elems > 1 else 0)

    ss, ds = strides(src), strides(dst)
    if job.dense_rows:
        vb = launch.align((src.ptr, dst.ptr, *ss[:3], *ds[:3], job.row_bytes))
        nvec, ppe = job.row_bytes // vb, 1
        ss, ds = ss[:3] + (vb,), ds[:3] + (vb,)
    else:
        vb = launch.align((src.ptr, dst.ptr, *ss, *ds, job.elem_bytes))
        ppe = job.elem_bytes // vb
        nvec = job.elems * ppe
    return vb, (*ss, *ds, src.blocks, dst.blocks, job.heads, job.tokens, nvec, ppe)


def _jobs_per_launch(tuning: TransferTuning) -> int:
    """The most jobs one copy launch takes: ``tuning.jobs_per_launch`` within 1..SLOTS."""
    return max(1, min(SLOTS, tuning.jobs_per_launch))


def copy_launches(jobs: tuple[CopyJob, ...], tuning: TransferTuning = TUNING
                  ) -> list[CopyLaunch]:
    """The copy launches of ``jobs``: grouped by (VB, geometry) in their first job's order, each
    group cut into launches of at most ``tuning.jobs_per_launch`` jobs. No GPU needed.

    Memoized for job tuples of a cached plan (``jobs.launch_key``, kvwrite.transfer's plan
    cache: the same key means the same jobs, pointers included)."""
    memo = getattr(jobs, "launch_key", None)
    if memo is not None:
        hit = _MEMO.get((memo, tuning))
        if hit is not None:
            return list(hit)
    per = _jobs_per_launch(tuning)
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for job in jobs:
        key = _job_launch_key(job)
        if key is not None:
            groups.setdefault(key, []).append((job.src.ptr, job.dst.ptr))
    out = []
    for (vb, geometry), ptrs in groups.items():
        vpp = geometry[10] * geometry[11] * geometry[12]
        for i in range(0, len(ptrs), per):
            out.append(CopyLaunch(vb, tuple(ptrs[i:i + per]), geometry, vpp))
    if memo is not None:
        _MEMO.put((memo, tuning), tuple(out))
    return out


@dataclasses.dataclass(frozen=True)
class PageLaunch:
    """One page launch: its first layer, its layer pointers, the cache strides they share."""

    l0: int
    pointers: tuple[int, ...]
    strides: tuple[int, int, int, int]


def page_launches(pj: PageJob) -> list[PageLaunch]:
    """Runs of at most :data:`SLOTS` consecutive layers with equal strides. No GPU needed.
    Memoized as :func:`copy_launches` (``pj.caches.launch_key``)."""
    memo = getattr(pj.caches, "launch_key", None)
    if memo is not None:
        hit = _MEMO.get((memo, "pages"))
        if hit is not None:
            return list(hit)
    caches = pj.caches
    out = [PageLaunch(l0, tuple(c.ptr for c in caches[l0:l0 + n]), caches[l0].strides)
           for l0, n in pj.layer_runs(SLOTS)]
    if memo is not None:
        _MEMO.put((memo, "pages"), tuple(out))
    return out


def page_align(pj: PageJob) -> int:
    """transfer.cu's ALIGN for ``pj``: :meth:`PageJob.code_align` (0: the general variant), but
    0 where a row part's elements of all N tokens (``N * E``) reach 2^32 (the aligned variants
    walk a segment's units in 32-bit indices: transfer.cu's UnitWalk)."""
    return 0 if pj.tokens * pj.part_elems >= 1 << 32 else pj.code_align()


def page_unit_elems(page_format: str, align: int, cache_dtype: torch.dtype) -> int:
    """Elements of a lane's unit in a page variant (transfer.cu's page_unit_elems): a group of 16,
    but in the aligned fp8 variants one 16-byte cache vector (fp8 codes are per element), so that
    a warp's cache accesses are whole sectors."""
    return 16 // cache_dtype.itemsize if align and page_format != "nvfp4" else 16


def page_batches(page_format: str, direction: str) -> int:
    """Batches of 32 * U units a page kernel's warp item moves one after the other (transfer.cu's
    page_batches): its decomposition, mapping pair, addresses and scale once for all of them. 2,
    but 1 for the nvfp4 unpack (two slowed it). Measured: tuning-log 90 and 109."""
    return 1 if page_format == "nvfp4" and direction == "unpack" else 2


def page_unroll(page_format: str, cache_dtype: torch.dtype, units: int,
                bytes_in_flight: int) -> int:
    """U of an aligned page launch whose segments hold ``units`` units: the largest power of two
    whose units' cache bytes fit ``bytes_in_flight`` (at least 1) and whose warp item (32 * U
    units) the segment fills."""
    unit_bytes = page_unit_elems(page_format, 16, cache_dtype) * cache_dtype.itemsize
    return copy_unroll(units, max(1, bytes_in_flight // unit_bytes))


@dataclasses.dataclass(frozen=True)
class PageLaunchArgs:
    """One page launch as :func:`run` makes it: variant, grid, threads and every argument."""

    name: str
    grid: int
    threads: int
    args: tuple[int, ...]


def page_launch_args(plan: TransferPlan, tuning: TransferTuning = TUNING,
                     sm_count: int | None = None) -> list[PageLaunchArgs]:
    """The launches of ``plan.page_job`` (no GPU needed where ``sm_count`` is given: the SMs a
    grid without ``max_ctas`` may fill; else the plan's device's)."""
    pj = plan.page_job
    if sm_count is None:
        index = plan.device.index if plan.device.index is not None else \
            torch.cuda.current_device()
        sm_count = nvrtc.device_arch(index)[1]
    align = page_align(pj)
    L, S, N, E, K = pj.layers, pj.parts, pj.tokens, pj.part_elems, pj.heads
    G = -(-E // page_unit_elems(pj.page_format, align, pj.cache_dtype))  # units a row part
    u = page_unroll(pj.page_format, pj.cache_dtype, N * G, tuning.page_bytes_in_flight) \
        if align else 1
    name = page_name(pj.direction, pj.page_format, pj.cache_dtype, plan.mapping.dtype, align, u)
    segs = -(-(N * G) // (32 * u * page_batches(pj.page_format, pj.direction)))  # items a segment
    cblocks = min(side.blocks for side in pj.caches)
    pages = pj.pages
    page_args = (pages.ptr, pages.strides[0], pj.chunk_bytes, pages.blocks)
    pack = pj.direction == "pack"
    head = _mapping_args(plan)
    if pack:
        head += (pj.scale.data_ptr() + 4 * pj.scale_offset, *pj.scale_strides)
    threads = tuning.page_threads
    out = []
    for pl in page_launches(pj):
        slots = list(pl.pointers) + [0] * (SLOTS - len(pl.pointers))
        nl = len(pl.pointers)
        per_chunk = nl * S * segs + (1 if pack and pl.l0 == 0 else 0)
        work = plan.pairs * K * per_chunk  # warp items
        small = int(work < 1 << 32 and N * G < 1 << 32)
        geometry = (pl.l0, nl, L, S, N, E, K, *pl.strides, cblocks, *page_args, segs,
                    magic(per_chunk), magic(K), magic(segs), magic(S), magic(G), small)
        grid = grid_size(work, threads // 32, sm_count, plan.max_ctas, tuning.page_ctas_per_sm)
        out.append(PageLaunchArgs(name, grid, threads, (*head, *slots, *geometry)))
    return out


LAUNCHES = launch.LaunchCache()


def _launchable(name: str, index: int, trigger: bool) -> launch.Launchable:
    """Variant ``name`` on device ``index``; its PDL twin triggers the next kernel early only
    with ``trigger`` (a plan's ``early_trigger``: not under an SM budget)."""
    lau = LAUNCHES.get((name, index, trigger))
    if lau is None:
        launch.require_setup()
        kernel, pdl_kernel = nvrtc.load_kernels(SOURCE, name, (), index, trigger=trigger)
        lau = LAUNCHES[(name, index, trigger)] = launch.Launchable(kernel, pdl_kernel, index, ())
    return lau


def grid_size(work_items: int, per_cta: int, sms: int, max_ctas: int | None,
              ctas_per_sm: int) -> int:
    """CTAs of a launch: enough for the work, at most ctas_per_sm per SM of ``sms``, at most
    max_ctas."""
    grid = min(-(-work_items // per_cta), sms * ctas_per_sm)
    if max_ctas is not None:
        grid = min(grid, max_ctas)
    return max(1, grid)


def _grid(work_items: int, per_cta: int, index: int, max_ctas: int | None,
          ctas_per_sm: int) -> int:
    return grid_size(work_items, per_cta, nvrtc.device_arch(index)[1], max_ctas, ctas_per_sm)


def _launch(name: str, index: int, work_items: int, per_cta: int, threads: int,
            max_ctas: int | None, ctas_per_sm: int, tuning: TransferTuning, trigger: bool,
            *args) -> None:
    lau = _launchable(name, index, trigger)
    grid = _grid(work_items, per_cta, index, max_ctas, ctas_per_sm)
    kernel, pdl = lau.pick(grid, tuning.pdl_max_ctas)
    nvrtc.launch(index, nvrtc.launch_config(grid, 1, threads, 1, pdl), kernel, *args)


def magic(d: int) -> int:
    """transfer.cu's fdiv constant of divisor ``d`` >= 1: ceil(2^64 / d), 0 for d == 1, as the
    signed 64-bit integer of its bits (a launch argument is a signed 64-bit int: d == 2 gives
    2^63)."""
    m = 0 if d == 1 else ((1 << 64) - 1) // d + 1
    return m - (1 << 64) if m >= 1 << 63 else m


def _mapping_args(plan: TransferPlan) -> tuple[int, int, int, int]:
    m = plan.mapping
    return m.data_ptr(), m.stride(0), m.stride(1), plan.pairs


def copy_threads(to_host: bool, max_ctas: int | None, tuning: TransferTuning = TUNING) -> int:
    """Threads per CTA of a copy launch: ``tuning.copy_threads``, but where the copy writes pinned
    host memory and reads device memory only (``to_host``), ``tuning.host_threads`` spread over
    the CTA budget (at least ``tuning.host_cta_threads`` a CTA, a multiple of 32), so that a
    budget of a few CTAs leaves room on their SMs for the kernels it overlaps. Reads of host
    memory keep whole CTAs: each load waits a PCIe round trip, and only many of them in flight
    keep the link busy."""
    if not to_host:
        return tuning.copy_threads
    ctas = max_ctas if max_ctas is not None else 1 << 30
    share = tuning.host_threads // ctas // 32 * 32
    return max(tuning.host_cta_threads, min(tuning.copy_threads, share))


@dataclasses.dataclass(frozen=True)
class CopyCall:
    """One copy kernel launch as :func:`run` makes it: the variant, its units of work (warp
    segments, or rows), the units a warp takes a step, threads per CTA, CTAs per SM where
    max_ctas is None, and the kernel's arguments."""

    name: str
    work: int
    per_warp: int
    threads: int
    ctas_per_sm: int
    args: tuple


def copy_calls(plan: TransferPlan, tuning: TransferTuning = TUNING) -> list[CopyCall]:
    """The copy launches of ``plan`` (no GPU needed: the CPU emulation of the kernel,
    tests/test_transfer_emu.py, runs exactly these)."""
    margs = _mapping_args(plan)
    mdt = plan.mapping.dtype
    reads_host = any(j.src.on_host for j in plan.jobs)
    writes_host = any(j.dst.on_host for j in plan.jobs)
    # A peer source (another GPU's memory over NVLink) is read a round trip away, as pinned host
    # memory is: its loads in flight too.
    remote = reads_host or writes_host or plan.peer is not None
    most = tuning.loads_in_flight_host if remote else tuning.loads_in_flight
    threads = copy_threads(writes_host and not reads_host, plan.max_ctas, tuning)
    ctas_per_sm = tuning.ctas_per_sm * (tuning.copy_threads // threads)
    # Half rows only on every SM of one GPU, device memory both sides (halve_rows' measurement).
    halves = plan.max_ctas is None and not remote
    out = []
    for cl in copy_launches(plan.jobs, tuning):
        if halves:
            cl = halve_rows(cl, tuning) or cl
        slots = [0] * (2 * SLOTS)
        for i, (s, d) in enumerate(cl.pointers):
            slots[2 * i], slots[2 * i + 1] = s, d
        geometry = cl.geometry
        if plan.peer is not None:
            geometry = _short_rows(geometry, tuning.peer_row_vectors)
        heads, tokens, nvec, ppe = geometry[10:]
        rows = len(cl.pointers) * plan.pairs * heads * tokens
        lanes = copy_lanes(nvec)
        if lanes:
            u = copy_rows_unroll(tuning.host_read_rows if reads_host else most)
            segs, work, per_warp = 1, rows, 32 // lanes * u
        else:
            u = copy_unroll(nvec, most)
            segs = -(-nvec // (32 * u))
            work, per_warp = rows * segs, 1  # warp segments
        # The rows kernel's order (pair_major: its last argument) and inner count.
        pm = bool(lanes) and pair_major(cl, tuning.rows_order)
        order = (int(pm),) if lanes else ()
        magics = (magic(segs), magic(tokens), magic(heads),
                  magic(len(cl.pointers) if pm else plan.pairs))
        out.append(CopyCall(copy_name(cl.vb, mdt, u, lanes), work, per_warp, threads, ctas_per_sm,
                            (*margs, *slots, len(cl.pointers), *geometry[:12], nvec,
                             ppe.bit_length() - 1, segs, *magics, *order)))
    return out


def _short_rows(geometry: tuple, vectors: int) -> tuple:
    """``geometry`` (a CopyLaunch's) with its rows cut into rows of ``vectors`` vectors (the
    pieces of a row become its tokens) where its rows are longer than that, their vectors dense
    (one piece an element) and a multiple of it, and heads or tokens 1 (so the cut rows keep one
    stride); else ``geometry``."""
    ssb, ssh, sst, ssc, dsb, dsh, dst_, dsc, sblocks, dblocks, heads, tokens, nvec, ppe = geometry
    if not vectors or nvec <= vectors or nvec % vectors or ppe != 1 or min(heads, tokens) != 1:
        return geometry
    if tokens != 1:  # the tokens become the heads
        heads, ssh, dsh = tokens, sst, dst_
    return (ssb, ssh, vectors * ssc, ssc, dsb, dsh, vectors * dsc, dsc, sblocks, dblocks, heads,
            nvec // vectors, vectors, ppe)


def run(plan: TransferPlan, *, tuning: TransferTuning = TUNING) -> None:
    """Launch ``plan``'s kernels on PyTorch's current stream of ``plan.device`` (validated by
    the public op). A call across two GPUs runs on the destination's device (``plan.device``):
    its kernels read the source (``plan.peer``) through unified addressing once peer access is
    enabled; nothing here depends on where a pointer lies (no pointer attribute is read, the
    launch device and stream are ``plan.device``'s)."""
    if plan.pairs == 0:
        return
    index = plan.device.index if plan.device.index is not None else torch.cuda.current_device()
    if plan.peer is not None:
        copy_engine.enable_peer_access(torch.device("cuda", index), plan.peer)
    # The call's device current: its context is the one the kernels are loaded into and its
    # stream's, whichever device the caller had current.
    with torch.cuda.device(index):
        for c in copy_calls(plan, tuning):
            _launch(c.name, index, c.work, c.threads // 32 * c.per_warp, c.threads,
                    plan.max_ctas, c.ctas_per_sm, tuning, plan.early_trigger, *c.args)
        if plan.page_job is not None:
            _run_pages(plan, index, tuning)


def _run_pages(plan: TransferPlan, index: int, tuning: TransferTuning) -> None:
    for pa in page_launch_args(plan, tuning, nvrtc.device_arch(index)[1]):
        lau = _launchable(pa.name, index, plan.early_trigger)
        kernel, pdl = lau.pick(pa.grid, tuning.pdl_max_ctas)
        nvrtc.launch(index, nvrtc.launch_config(pa.grid, 1, pa.threads, 1, pdl), kernel,
                     *pa.args)
