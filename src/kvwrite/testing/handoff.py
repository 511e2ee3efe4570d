"""A prefill -> decode handoff of cache blocks between two processes through transfer pages, with
torch.distributed as the transport (NCCL between GPUs, gloo between host tensors): the logic that
docs/examples/pd_handoff.py runs and tests/test_distributed.py checks.

Two scenarios, each for a page format (raw, fp8, nvfp4) and a pair of vLLM stride orders:

- ``tp1_to_tp2``: rank 0 holds a TP = 1 cache (``HEADS`` heads, the source order) and packs
  blocks of every layer into pages (``pack_kv_pages``). A page keeps heads outermost, so the
  share of each page of the rank owning heads ``[h0, h1)`` is one contiguous byte range: rank 0
  sends rank 1 only that range of each page row and unpacks its own range in place (a view with
  the row stride of the whole page, ``head_range``); rank 1 unpacks what it received. Each rank's
  destination cache has ``HEADS // 2`` heads in the destination order.
- ``tp2_to_tp1``: each rank holds its ``HEADS // 2`` heads (the source order) and packs them into
  pages of its own heads only (``head_range``); rank 1 sends its pages, and rank 0 unpacks both
  into one ``HEADS``-head cache (the destination order; ``head_range`` says which heads).

Checks, on every destination byte (the whole allocation: blocks not mapped keep their bytes):
raw pages carry the source's bits; fp8 and nvfp4 pages decode to the reads of the quantized
pages (docs/ops/transfer.md: fp8(x / σ) · σ, nvfp4's group rule), taken from the torch
implementation's unpack of the same pages into a plain full-head cache (rank 0 sends rank 1 its
slice of that reference). Communication comes first, the checks last, so a failing check never
leaves the other rank waiting.

:func:`spawn` starts both ranks in child processes (a file store, a timeout, each child's
traceback in the error); :func:`run_rank` is one rank's part where the process group exists
already (``torchrun``).
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import NamedTuple

import torch

from .compare import copy_allocations, differing_bytes, storage_bytes

__all__ = ["LAYOUTS", "FORMATS", "SCENARIOS", "Case", "default_cases", "run_rank", "spawn"]

LAYERS, HEADS, BLOCK_SIZE, HEAD_SIZE, BLOCKS = 2, 4, 16, 64, 6
ROW = 2 * HEAD_SIZE            # vLLM's K|V row: kv_split = 2
KV_SPLIT = 2
HALF = HEADS // 2              # heads per rank at TP = 2
SRC_BLOCKS, DST_BLOCKS = [4, 0, 3], [1, 5, 2]   # cache block ids: page row i carries SRC_BLOCKS[i]
DTYPE = torch.bfloat16
FORMATS = ("raw", "fp8", "nvfp4")
SCENARIOS = ("tp1_to_tp2", "tp2_to_tp1")
TIMEOUT_S = 120.0


def _lbnhc(device, heads: int) -> list[torch.Tensor]:
    # vLLM's default per-layer order: [blocks, N, H, C] in memory.
    return [torch.empty(BLOCKS, BLOCK_SIZE, heads, ROW, dtype=DTYPE, device=device)
            .transpose(1, 2) for _ in range(LAYERS)]


def _lbhnc(device, heads: int) -> list[torch.Tensor]:
    return [torch.empty(BLOCKS, heads, BLOCK_SIZE, ROW, dtype=DTYPE, device=device)
            for _ in range(LAYERS)]


def _bhlnc(device, heads: int) -> list[torch.Tensor]:
    # One allocation [blocks, H, L, N, C]: a block's stride spans every layer.
    buf = torch.empty(BLOCKS, heads, LAYERS, BLOCK_SIZE, ROW, dtype=DTYPE, device=device)
    return [buf[:, :, layer] for layer in range(LAYERS)]


def _blnhc(device, heads: int) -> list[torch.Tensor]:
    buf = torch.empty(BLOCKS, LAYERS, BLOCK_SIZE, heads, ROW, dtype=DTYPE, device=device)
    return [buf[:, layer].transpose(1, 2) for layer in range(LAYERS)]


# Each order: L logical (blocks, H, N, C) views of a cache of ``heads`` heads.
LAYOUTS = {"LBNHC": _lbnhc, "LBHNC": _lbhnc, "BHLNC": _bhlnc, "BLNHC": _blnhc}


class Case(NamedTuple):
    """One handoff: a scenario, a page format, the source and destination stride orders."""

    scenario: str
    page_format: str
    src: str
    dst: str

    def __str__(self) -> str:
        return f"{self.scenario} {self.page_format} {self.src}->{self.dst}"


def _case(case) -> Case:
    case = Case(*case)
    if case.scenario not in SCENARIOS or case.page_format not in FORMATS \
            or case.src not in LAYOUTS or case.dst not in LAYOUTS:
        raise ValueError(f"a handoff case: expected a scenario of {SCENARIOS}, a format of "
                         f"{FORMATS} and two orders of {tuple(LAYOUTS)}, got {tuple(case)}")
    return case


def default_cases(pairs=(("LBNHC", "LBHNC"), ("BHLNC", "LBNHC"))) -> list[Case]:
    """Both scenarios, every page format, each (source order, destination order) pair."""
    return [Case(s, f, a, b) for s in SCENARIOS for f in FORMATS for a, b in pairs]


def _truth(page_format: str) -> list[torch.Tensor]:
    """The TP = 1 cache's logical (blocks, H, N, C) values of every layer, on the host, the same
    on every rank (seeded): random bits for raw pages (NaN and inf patterns included), finite
    normal values for the quantized ones."""
    g = torch.Generator().manual_seed(46)
    shape = (BLOCKS, HEADS, BLOCK_SIZE, ROW)
    if page_format == "raw":
        return [torch.randint(0, 256, (*shape[:-1], ROW * 2), generator=g, dtype=torch.uint8)
                .view(DTYPE) for _ in range(LAYERS)]
    return [(torch.randn(shape, generator=g) * 3).to(DTYPE) for _ in range(LAYERS)]


def _sigma(device) -> torch.Tensor:
    """σ per head (the quantized formats' scale, [H] broadcast to [L, S, H])."""
    return torch.tensor([0.05 * (h + 1) for h in range(HEADS)], dtype=torch.float32,
                        device=device)


def _cache(order: str, device, heads: int, values=None, seed: int = 0) -> list[torch.Tensor]:
    """A cache of ``heads`` heads in ``order``: its allocations random bytes (seed), then the
    logical views set to ``values`` (host tensors, one per layer) where given."""
    caches = LAYOUTS[order](device, heads)
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for t in caches:
        raw = storage_bytes(t)
        if raw.data_ptr() not in seen:
            seen.add(raw.data_ptr())
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    for t, v in zip(caches, values or (), strict=False):
        t.copy_(v)
    return caches


def _page_bytes(page_format: str) -> int:
    import kvwrite

    return kvwrite.kv_page_bytes(LAYERS, HEADS, BLOCK_SIZE, ROW, DTYPE, kv_split=KV_SPLIT,
                                 page_format=page_format)


def _pairs(pairs) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64)  # on the host: checked there (vLLM's form)


def _reference(page_format: str, parts, device) -> list[torch.Tensor]:
    """The reads of quantized pages: the torch implementation's unpack of ``parts`` ((pages,
    head_range) each) into a plain full-head cache, page row i into block i; per layer
    (rows, H, N, C)."""
    import kvwrite

    n = len(SRC_BLOCKS)
    ref = [torch.zeros(n, HEADS, BLOCK_SIZE, ROW, dtype=DTYPE, device=device)
           for _ in range(LAYERS)]
    rows = _pairs([[i, i] for i in range(n)])
    for pages, head_range in parts:
        kvwrite.unpack_kv_pages(pages, ref, rows, kv_split=KV_SPLIT, head_range=head_range,
                                page_format=page_format, implementation="torch")
    return ref


def _check(rank: int, case: Case, dst: list[torch.Tensor], before: list[torch.Tensor],
           want: list[torch.Tensor]) -> None:
    """Every byte of ``dst``'s allocations: the mapped blocks hold ``want`` (per layer, page row
    order), everything else its bytes of ``before``."""
    expected = copy_allocations(before)
    for e, w in zip(expected, want, strict=True):
        e[DST_BLOCKS] = w.to(e.device)
    seen = set()
    for n, (got, exp) in enumerate(zip(dst, expected, strict=True)):
        key = got.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        diff = differing_bytes(storage_bytes(got).cpu(), storage_bytes(exp).cpu())
        if bool(diff.any()):
            at = torch.nonzero(diff).flatten()[:4].tolist()
            raise AssertionError(f"rank {rank}, {case}: the destination allocation of layer {n}: "
                                 f"{int(diff.sum())} of {diff.numel()} bytes differ from the "
                                 f"expected, first at byte offsets {at}")


def _send(t: torch.Tensor, to: int) -> None:
    import torch.distributed as dist

    dist.send(t.contiguous().view(torch.uint8), to)


def _recv(like_shape, dtype, device, frm: int) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty(like_shape, dtype=dtype, device=device)
    dist.recv(out.view(torch.uint8), frm)
    return out


def _tp1_to_tp2(rank: int, case: Case, device, kw: dict) -> str:
    import kvwrite

    _, fmt, src_order, dst_order = case
    P = _page_bytes(fmt)
    hb = P // HEADS                       # one head chunk
    share = HALF * hb                     # a rank's heads of one page row: one contiguous range
    h0, h1 = rank * HALF, (rank + 1) * HALF
    n = len(SRC_BLOCKS)
    truth = _truth(fmt)
    quantized = fmt != "raw"
    ref_shape = (LAYERS, n, HALF, BLOCK_SIZE, ROW)
    if rank == 0:
        src = _cache(src_order, device, HEADS, truth, seed=1)
        pages = torch.empty(n, P, dtype=torch.uint8, device=device)
        kvwrite.pack_kv_pages(src, pages, _pairs([[b, i] for i, b in enumerate(SRC_BLOCKS)]),
                              kv_split=KV_SPLIT, page_format=fmt,
                              scale=_sigma(device) if quantized else None, **kw)
        _send(pages[:, share:], 1)        # rank 1's heads only
        mine = pages                      # all H heads; head_range picks [0, H/2)
        if quantized:
            ref = _reference(fmt, [(pages, None)], device)
            _send(torch.stack([r[:, HALF:] for r in ref]), 1)
            want = [r[:, :HALF] for r in ref]
    else:
        mine = _recv((n, share), torch.uint8, device, 0)   # a slice page: its H/2 heads only
        if quantized:
            want = list(_recv(ref_shape, DTYPE, device, 0))
    if not quantized:
        want = [t[SRC_BLOCKS, h0:h1] for t in truth]
    dst = _cache(dst_order, device, HALF, seed=10 + rank)
    before = copy_allocations(dst)
    kvwrite.unpack_kv_pages(mine, dst, _pairs([[i, b] for i, b in enumerate(DST_BLOCKS)]),
                            kv_split=KV_SPLIT, head_range=(h0, h1), page_format=fmt, **kw)
    _sync(device)
    _check(rank, case, dst, before, want)
    return f"heads [{h0}, {h1}) of {n} blocks unpacked ({n} x {mine.shape[1]} page bytes)"


def _tp2_to_tp1(rank: int, case: Case, device, kw: dict) -> str:
    import kvwrite

    _, fmt, src_order, dst_order = case
    P = _page_bytes(fmt)
    share = P // 2
    h0, h1 = rank * HALF, (rank + 1) * HALF
    n = len(SRC_BLOCKS)
    truth = _truth(fmt)
    quantized = fmt != "raw"
    src = _cache(src_order, device, HALF, [t[:, h0:h1] for t in truth], seed=20 + rank)
    pages = torch.empty(n, share, dtype=torch.uint8, device=device)  # this rank's heads only
    kvwrite.pack_kv_pages(src, pages, _pairs([[b, i] for i, b in enumerate(SRC_BLOCKS)]),
                          kv_split=KV_SPLIT, head_range=(h0, h1), page_format=fmt,
                          scale=_sigma(device)[h0:h1] if quantized else None, **kw)
    if rank == 1:
        _send(pages, 0)
        return f"heads [{h0}, {h1}) of {n} blocks packed and sent ({n} x {share} page bytes)"
    theirs = _recv((n, share), torch.uint8, device, 1)
    parts = [(pages, (0, HALF)), (theirs, (HALF, HEADS))]
    dst = _cache(dst_order, device, HEADS, seed=30)
    before = copy_allocations(dst)
    mapping = _pairs([[i, b] for i, b in enumerate(DST_BLOCKS)])
    for part, head_range in parts:
        kvwrite.unpack_kv_pages(part, dst, mapping, kv_split=KV_SPLIT, head_range=head_range,
                                page_format=fmt, **kw)
    _sync(device)
    want = _reference(fmt, parts, device) if quantized else [t[SRC_BLOCKS] for t in truth]
    _check(rank, case, dst, before, want)
    return f"all {HEADS} heads of {n} blocks unpacked from both ranks' pages"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_rank(rank: int, device, cases) -> list[str]:
    """Rank ``rank``'s part of every case (the default process group exists, 2 ranks); one line
    per case. ``device``: this rank's (cuda:rank with NCCL, cpu with gloo). Raises
    AssertionError naming the rank and case at the first wrong byte."""
    device = torch.device(device)
    kw = {} if device.type == "cuda" else {"implementation": "torch"}
    lines = []
    for case in cases:
        case = _case(case)
        run = _tp1_to_tp2 if case.scenario == "tp1_to_tp2" else _tp2_to_tp1
        lines.append(f"rank {rank}, {case}: {run(rank, case, device, kw)}")
    return lines


def _child(rank: int, init_method: str, backend: str, cases, results) -> None:
    """One spawned rank: its process group, its cases, and (rank, ok, lines or traceback) on
    ``results``."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))
        try:
            lines = run_rank(rank, device, cases)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, lines))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn(backend: str, cases, timeout: float = TIMEOUT_S) -> list[str]:
    """Run every case on two spawned ranks (``backend`` "nccl": cuda:0 and cuda:1; "gloo": host
    tensors) and return their lines. Raises AssertionError with the failing child's traceback
    (its check's message last), or when a child dies or the pair outlasts ``timeout`` seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got: dict[int, tuple[bool, object]] = {}
    with tempfile.TemporaryDirectory() as folder:
        init = "file://" + os.path.join(folder, "store")   # no port to race for
        cases = [tuple(_case(c)) for c in cases]  # checked here, sent as plain tuples
        procs = [ctx.Process(target=_child, args=(r, init, backend, cases, results),
                             daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        problem = None
        try:
            while len(got) < 2 and problem is None:
                try:
                    rank, ok, what = results.get(timeout=0.5)
                    got[rank] = (ok, what)
                    if not ok:
                        break
                    continue
                except queue_mod.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a report put just before exiting
                    while not results.empty():
                        rank, ok, what = results.get()
                        got[rank] = (ok, what)
                    dead = [r for r in dead if r not in got]
                    if dead:
                        problem = "; ".join(f"rank {r} exited with status {procs[r].exitcode} "
                                            f"without a report" for r in dead)
                elif time.monotonic() > deadline:
                    missing = [r for r in range(2) if r not in got]
                    problem = f"timed out after {timeout:.0f} s waiting for rank(s) {missing}"
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    failed = [f"rank {r} failed:\n{what}" for r, (ok, what) in sorted(got.items()) if not ok]
    if problem:
        failed.append(problem)
    if failed:
        raise AssertionError(f"the {backend} handoff failed: " + "\n".join(failed))
    return [line for r in range(2) for line in got[r][1]]
