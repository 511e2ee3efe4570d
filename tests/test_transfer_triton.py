"""The Triton transfer kernels (kvwrite.kernels.triton_transfer) on plans built by hand.

Raw copies are compared with a per-pair torch loop over the mapping's ``.tolist()`` values,
quantized pages with the torch rules (kvwrite.dtypes.quantize, ops/nvfp4/rule.py,
kvwrite.gather.fp8_dequant, readers.dequantize_groups) chunk by chunk; always on whole
allocations, so bytes outside what a plan writes must keep their values. On CPU the kernels run
under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``): every case runs there,
since the kernels round fp8 and bfloat16 by integer operations, not by the casts the interpreter
rounds differently. The gpu-marked tests add pinned host sides, CUDA graphs and larger shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvwrite.dtypes import CacheDType, quantize
from kvwrite.gather import fp8_dequant
from kvwrite.kernels import triton_transfer as tt
from kvwrite.kernels.triton_support import next_pow2
from kvwrite.ops.nvfp4.readers import dequantize_groups
from kvwrite.ops.nvfp4.rule import pack_codes, quantize_groups, unpack_codes
from kvwrite.testing.compare import storage_bytes
from kvwrite.transfer import CopyJob, PageJob, Side, TransferPlan

HAS_CUDA = torch.cuda.is_available()
_cpu_reason = None if HAS_CUDA else tt.available(torch.device("cpu"))
interpreter = pytest.mark.skipif(
    HAS_CUDA or _cpu_reason is not None,
    reason="interpreter tests run where there is no GPU" if HAS_CUDA else str(_cpu_reason))
gpu = pytest.mark.gpu  # conftest.py skips these where there is no GPU
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# --- building plans ------------------------------------------------------------------------------

def side(view: torch.Tensor, offset: int = 0) -> Side:
    """A 4-D view as a Side (byte strides; ``offset`` bytes past its first element)."""
    es = view.element_size()
    return Side(view, offset, tuple(s * es for s in view.stride()), view.shape[0])


def copy_job(src: torch.Tensor, dst: torch.Tensor) -> CopyJob:
    _, h, n, c = src.shape
    return CopyJob(side(src), side(dst), h, n, c, src.element_size())


def make_plan(mapping: torch.Tensor, jobs=(), page_job=None, max_ctas=None) -> TransferPlan:
    return TransferPlan(op="test", jobs=tuple(jobs), page_job=page_job, mapping=mapping,
                        host_mapping=None, pairs=mapping.shape[0], device=mapping.device,
                        max_ctas=max_ctas, engine="sm", args={})


def random_fill(t: torch.Tensor, seed: int) -> None:
    """Random bits over the whole allocation behind ``t``."""
    g = torch.Generator().manual_seed(seed)
    raw = storage_bytes(t)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def alloc(shape, dtype, device, seed, pin=False) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    random_fill(t, seed)
    return t


def rebuilt(view: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``view``'s geometry (shape, strides, storage offset) over the flat byte copy ``raw`` of
    its allocation. Pass the view itself, not ``view.cpu()``: a device view's ``.cpu()`` is a
    new tensor at offset 0 (compact strides where the view is not dense), so its geometry is
    not the view's."""
    es = view.element_size()
    flat = raw.view(view.dtype) if es > 1 else raw
    return flat.as_strided(view.shape, view.stride(), view.storage_offset())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def mapping_tensor(pairs, dtype, device, layout="plain") -> torch.Tensor:
    """[n, 2] of ``dtype``: contiguous, column-major (strides (1, n)) or with padded rows."""
    m = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(dtype)
    if layout == "columns":
        m = m.t().contiguous().t()
    elif layout == "padded":
        m = torch.cat([m, torch.full_like(m, 99)], dim=1)[:, :2]
    return m.to(device)


def finish(device: str) -> None:
    """Wait for the kernels: a pinned host result is read without a device copy."""
    if device == "cuda":
        torch.cuda.synchronize()


def in_range(i, j, src_blocks, dst_blocks) -> bool:
    return 0 <= i < src_blocks and 0 <= j < dst_blocks


# --- raw copies ----------------------------------------------------------------------------------

def check_copies(pairs_list, views, device, max_ctas=None, map_dtype=torch.int64,
                 layout="plain", tuning=tt.TUNING) -> None:
    """Run a plan of one job per (src, dst) view pair and compare both sides' whole allocations
    with a per-pair loop."""
    mapping = mapping_tensor(pairs_list, map_dtype, device, layout)
    want = {}
    for src, dst in views:
        for t in (src, dst):
            key = t.untyped_storage().data_ptr()
            want.setdefault(key, (t, storage_bytes(t).cpu().clone()))
    for src, dst in views:
        exp_dst = rebuilt(dst, want[dst.untyped_storage().data_ptr()][1])
        src_now = bits(src.cpu())
        for i, j in mapping.cpu().tolist():
            if in_range(i, j, src.shape[0], dst.shape[0]):
                bits(exp_dst)[j] = src_now[i]
    tt.run(make_plan(mapping, [copy_job(s, d) for s, d in views], max_ctas=max_ctas),
           tuning=tuning)
    finish(device)
    for t, raw in want.values():
        got = storage_bytes(t).cpu()
        diff = (got != raw).nonzero().flatten()
        assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


PAIRS = [[0, 3], [4, 1], [2, 2], [-1, 0], [1, 5], [3, -7], [6, 4], [2, 0]]  # some ids out of range


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_ctas", [1, 3, None])
@pytest.mark.parametrize("map_dtype, layout", [(torch.int64, "plain"), (torch.int32, "columns"),
                                               (torch.int32, "padded")])
def test_same_layout(device, max_ctas, map_dtype, layout):
    src = alloc((5, 2, 4, 8), torch.bfloat16, device, 1)
    dst = alloc((6, 2, 4, 8), torch.bfloat16, device, 2)
    check_copies(PAIRS, [(src, dst)], device, max_ctas, map_dtype, layout)


@pytest.mark.parametrize("device", DEVICES)
def test_relayout_heads_tokens_swapped_and_padded(device):
    """LBNHC -> LBHNC-like: rows dense, heads and tokens strided differently; padded blocks."""
    src = alloc((5, 3, 4, 8), torch.float16, device, 3)[:, :, :2].permute(0, 2, 1, 3)
    dst = alloc((6, 2, 3, 10), torch.float16, device, 4)[..., 1:9]  # 2-byte aligned rows
    check_copies(PAIRS, [(src, dst)], device)


@pytest.mark.parametrize("device", DEVICES)
def test_head_slice_both_ways(device):
    full = alloc((5, 4, 3, 16), torch.float32, device, 5)
    part = alloc((6, 2, 3, 16), torch.float32, device, 6)
    check_copies(PAIRS, [(full[:, 1:3], part)], device)
    full2 = alloc((7, 4, 3, 16), torch.float32, device, 7)
    check_copies(PAIRS, [(part, full2[:, 2:4])], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32, torch.float64])
def test_elements_not_dense(device, dtype):
    """An element stride != its size on one side: copied element by element."""
    src = alloc((5, 2, 6, 3), dtype, device, 8).transpose(2, 3)  # (5, 2, 3, 6), sc = 3
    dst = alloc((6, 2, 3, 6), dtype, device, 9)
    check_copies(PAIRS, [(src, dst)], device, max_ctas=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", [0, 1, 2, 4, 8])
def test_vector_width_from_offsets(device, shift):
    """Views starting ``shift`` bytes into their storage: the widest vector dividing every
    address is used (16 for shift 0), bytes around the views untouched."""
    base_s = alloc((5 * 64 + 16,), torch.uint8, device, 10)
    base_d = alloc((6 * 64 + 16,), torch.uint8, device, 11)
    src = base_s[shift:shift + 5 * 64].view(5, 1, 2, 32)
    dst = base_d[16 - shift:16 - shift + 6 * 64].view(6, 1, 2, 32)
    check_copies(PAIRS, [(src, dst)], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_ctas", [1, 4, None])
def test_long_rows_split_across_programs(device, max_ctas):
    """swap_blocks' four-argument form: one row of block_size_in_bytes per block (less than the
    block stride: the padding is not copied), tiles smaller than a row."""
    src = alloc((5, 3000), torch.float16, device, 12)
    dst = alloc((6, 3100), torch.float16, device, 13)
    nbytes = 2900 * 2
    job = CopyJob(Side(src, 0, (3000 * 2, 0, 0, 1), 5), Side(dst, 0, (3100 * 2, 0, 0, 1), 6),
                  1, 1, nbytes, 1)
    mapping = mapping_tensor(PAIRS, torch.int64, device)
    want_d = storage_bytes(dst).cpu().clone()
    want_s = storage_bytes(src).cpu().clone()
    for i, j in PAIRS:
        if in_range(i, j, 5, 6):
            want_d[j * 6200:j * 6200 + nbytes] = want_s[i * 6000:i * 6000 + nbytes]
    tt.run(make_plan(mapping, [job], max_ctas=max_ctas),
           tuning=tt.TritonTuning(copy_tile_bytes=1024, one_tile_copy_bytes=1024))
    finish(device)
    assert torch.equal(storage_bytes(dst).cpu(), want_d)
    assert torch.equal(storage_bytes(src).cpu(), want_s)


@pytest.mark.parametrize("device", DEVICES)
def test_several_layers_and_in_place(device):
    """Two jobs (a hybrid model's layers: own dtypes, shapes, block counts) and a copy inside one
    cache (same view on both sides, sources and destinations distinct)."""
    a_s, a_d = alloc((5, 2, 4, 8), torch.int16, device, 14), alloc((6, 2, 4, 8), torch.int16,
                                                                    device, 15)
    b_s, b_d = alloc((7, 1, 2, 12), torch.float32, device, 16), alloc((4, 1, 2, 12),
                                                                      torch.float32, device, 17)
    check_copies(PAIRS, [(a_s, a_d), (b_s, b_d)], device, max_ctas=2)
    c = alloc((8, 2, 2, 8), torch.float16, device, 18)
    check_copies([[0, 5], [1, 6], [2, 7]], [(c, c)], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_ctas", [2, None])
def test_jobs_of_one_shape_share_a_launch(device, max_ctas):
    """40 layers of one shape, each its own allocation (some views past their storage's start, a
    source allocated after its destination: offsets of both signs): two launches (SLOTS = 32,
    then 8) whose offsets select each job's tensors; whole allocations compared. A layer of
    another dtype (the sixth) is its own launch, after them (groups in their first job's
    order)."""
    views = []
    for n in range(40):
        dst = alloc((7, 2, 4, 8), torch.float16, device, 100 + n)
        src = alloc((6 + n % 3, 2, 4, 8), torch.float16, device, 200 + n)[n % 3:]
        views.append((src, dst))
    views.insert(5, (alloc((5, 2, 4, 8), torch.float32, device, 99),
                     alloc((6, 2, 4, 8), torch.float32, device, 98)))
    check_copies(PAIRS, views, device, max_ctas=max_ctas)
    plan = make_plan(mapping_tensor(PAIRS, torch.int64, device, "plain"),
                     [copy_job(s, d) for s, d in views], max_ctas=max_ctas)
    launches = tt.copy_launches(plan)
    assert [len(cl.jobs) for cl in launches] == [32, 8, 1]
    assert [len(cl.src_offs) for cl in launches] == [32, 8, 1]
    assert launches[2].jobs == (5,)
    assert all(cl.grid[0] <= (max_ctas or 1 << 30) for cl in launches)


@pytest.mark.skipif(tt.triton is None, reason="needs Triton")
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_one_tile_programs(max_ctas):
    """Without an SM budget a launch between the memories of the device it runs on takes a
    program a tile (copies: tiles of one_tile_copy_bytes); under a budget, or with
    one_tile_programs off, the persistent programs (the interpreter's one SM: 4) and
    copy_tile_bytes; a pack whose part rows take several steps keeps them too, its unpack not.
    A pinned host side or a peer GPU's is not the launch device's memory."""
    src = torch.zeros(12, 8, 16, 128, dtype=torch.bfloat16)
    dst = torch.zeros(12, 8, 16, 128, dtype=torch.bfloat16)
    mapping = torch.tensor([[i, 11 - i] for i in range(10)], dtype=torch.int64)
    off = dataclasses.replace(tt.TUNING, one_tile_programs=False)
    for tuning in (tt.TUNING, off):
        one = max_ctas is None and tuning.one_tile_programs
        (cl,) = tt.copy_launches(make_plan(mapping, [copy_job(src, dst)] * 3,
                                           max_ctas=max_ctas), tuning)
        tile = cl.kw["BLOCK_R"] * cl.kw["BLOCK_C"] * 16 // cl.kw["VEC"]  # 16-byte vectors
        # The persistent programs' tile is host_read_tile_bytes here: CPU tensors are host
        # memory (on the GPU, a device source's is copy_tile_bytes).
        assert tile == (tuning.one_tile_copy_bytes if one else tuning.host_read_tile_bytes)
        assert cl.job_tiles == 10 * 8 * 16 * 256 // tile
        assert cl.grid == ((3 * cl.job_tiles,) if one else (max_ctas or 4,))
        assert cl.kw["ONE_TILE"] == one
    steps = dataclasses.replace(tt.TUNING, page_tile_elems=64, budget_page_tile_elems=64)
    g = Pages("fp8_e4m3", torch.bfloat16, "cpu", L=2, S=1, N=16, C=256, Hp=2, pool_offset=0,
              token_major=())
    m = mapping_tensor([[0, 1], [2, 3]], torch.int64, "cpu")
    for tuning, pack_one in ((tt.TUNING, True), (steps, False)):
        (pack,) = tt.page_launches(make_plan(m, page_job=g.job("pack"), max_ctas=max_ctas),
                                   tuning)
        (unpack,) = tt.page_launches(make_plan(m, page_job=g.job("unpack"),
                                               max_ctas=max_ctas), tuning)
        assert pack.kw["NCH"] == (1 if pack_one else 4) == unpack.kw["NCH"]
        for pl, one in ((pack, pack_one), (unpack, True)):
            one = one and max_ctas is None
            assert pl.grid == ((pl.tiles * pl.layers,) if one else (max_ctas or 4,))
            assert pl.kw["ONE_TILE"] == one
    gpu_plan = dataclasses.replace(make_plan(mapping, [copy_job(src, dst)]),
                                   device=torch.device("cuda", 0))
    assert not tt._one_tile(gpu_plan, tt.TUNING, side(src), side(dst))


@pytest.mark.skipif(tt.triton is None, reason="needs Triton")
def test_host_writes_spread_a_launchs_warps():
    """A launch writing pinned host memory has ``host_write_launch_warps`` (8) in all over its
    programs, 2 to 4 a program: one or two programs keep 4 (their loads in flight), four or
    more take 2 each (room on their SMs for a concurrent kernel)."""
    src = torch.zeros(64, 8, 16, 256, dtype=torch.bfloat16)
    dst = torch.zeros(64, 8, 16, 256, dtype=torch.bfloat16)
    mapping = torch.tensor([[i, 63 - i] for i in range(64)], dtype=torch.int32)
    for max_ctas, warps in [(1, 4), (2, 4), (4, 2), (8, 2)]:
        (cl,) = tt.copy_launches(make_plan(mapping, [copy_job(src, dst)], max_ctas=max_ctas))
        assert (cl.grid, cl.kw["num_warps"]) == ((max_ctas,), warps)


@pytest.mark.parametrize("device", DEVICES)
def test_no_pairs_writes_nothing(device):
    src = alloc((5, 2, 4, 8), torch.float16, device, 19)
    dst = alloc((6, 2, 4, 8), torch.float16, device, 20)
    check_copies([], [(src, dst)], device)


class _Recorder:
    """A stand-in for a Triton kernel: ``kernel[grid](*args, **kw)`` records the launch's
    ``PDL`` and ``PDL_TRIGGER``."""

    def __init__(self):
        self.launches: list[tuple[bool, bool]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((kw["PDL"], kw["PDL_TRIGGER"]))


@pytest.mark.skipif(tt.triton is None, reason="needs Triton")
@pytest.mark.parametrize("max_ctas", [None, 4])
def test_no_early_trigger_under_an_sm_budget(monkeypatch, max_ctas):
    """Under ``max_ctas`` no launch lets the next kernel be scheduled early (a triggered launch's
    programs sit resident waiting for the one before, so a call's launch per job would hold every
    job's programs at once); without it the tuning's policy stands. Copy and page launches; PDL
    forced on (the CPU never takes it)."""
    monkeypatch.setattr(tt, "pdl_launch", lambda *a: (True, True))
    copies, pages = _Recorder(), _Recorder()
    monkeypatch.setattr(tt, "_copy_kernel", copies)
    monkeypatch.setattr(tt, "_pack_kernel", pages)
    mapping = torch.tensor(PAIRS, dtype=torch.int32)
    a, b = torch.zeros(5, 2, 4, 8), torch.zeros(6, 2, 4, 8)
    tt.run(make_plan(mapping, [copy_job(a, b), copy_job(b, a)], max_ctas=max_ctas))
    tt.run(make_plan(mapping[:2], page_job=Pages("fp8_e4m3", torch.float16, "cpu").job("pack"),
                     max_ctas=max_ctas))
    want = (True, max_ctas is None)
    assert copies.launches == [want, want]
    assert pages.launches and set(pages.launches) == {want}


# --- quantized pages -----------------------------------------------------------------------------

def chunk_bytes(fmt: str, L: int, S: int, N: int, C: int) -> int:
    data = 4 * L * S + (L * N * C // 2 + L * N * C // 16 if fmt == "nvfp4" else L * N * C)
    return 16 * math.ceil(data / 16)


def midpoints(fmt: str, shape, g: torch.Generator) -> torch.Tensor:
    """float32 values halfway between two adjacent fp8 codes of ``fmt`` (nearest-even ties; any
    for "nvfp4"), random signs: exact in float16 and bfloat16."""
    fp8 = FP8.get(fmt, torch.float8_e4m3fn)
    top = 0x7D if fp8 == torch.float8_e4m3fn else 0x7A
    c = torch.randint(0, top + 1, shape, generator=g, dtype=torch.int32)
    lo = c.to(torch.uint8).view(fp8).float()
    hi = (c + 1).to(torch.uint8).view(fp8).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (lo + hi) / 2 * sign


class Pages:
    """A page geometry: ``caches`` (L views [B, H_c, N, C]), ``pages`` (a view [R, H_p * hb] into
    a wider pool), heads ``hc0 + k`` of the caches and ``hp0 + k`` of the pages, k < K."""

    def __init__(self, fmt, dtype, device, L=2, S=2, N=3, C=32, B=5, R=4, Hc=3, Hp=3, hc0=1,
                 hp0=0, K=2, seed=0, pin_pages=False, ties=False, token_major=None,
                 pool_offset=8):
        self.fmt, self.dtype, self.L, self.S, self.N, self.C, self.K = fmt, dtype, L, S, N, C, K
        self.E, self.hc0, self.hp0, self.Hc = C // S, hc0, hp0, Hc
        self.hb = chunk_bytes(fmt, L, S, N, C)
        # Layers of one cache each, strides free per tensor: the odd layers are token-major
        # (LBNHC) unless ``token_major`` lists those that are.
        self.caches = []
        for layer in range(L):
            if layer in token_major if token_major is not None else layer % 2:
                t = alloc((B + layer, N, Hc, C), dtype, device, seed + layer).transpose(1, 2)
            else:
                t = alloc((B + layer, Hc, N, C), dtype, device, seed + layer)
            g = torch.Generator().manual_seed(seed + 50 + layer)
            vals = torch.randn(t.shape, generator=g) * torch.exp2(
                torch.randint(-20, 12, t.shape, generator=g).float())
            vals.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -3e38])
            if ties:
                vals = midpoints(fmt, t.shape, g)
            t.copy_(vals.to(dtype))
            self.caches.append(t)
        # Pinned pages are host memory: pin_memory applies to CPU tensors only.
        pool = alloc((R, Hp * self.hb + 32), torch.uint8, "cpu" if pin_pages else device,
                     seed + 9, pin=pin_pages)
        # Rows 8 bytes past 16-byte alignment by default (pool_offset): the page kernels'
        # general form; 0 (rows of a multiple of 16 bytes) their aligned one.
        self.pages = pool[:, pool_offset:pool_offset + Hp * self.hb]
        g = torch.Generator().manual_seed(seed + 99)
        self.scale = (torch.rand((L, S, Hc), generator=g) * 4 + 0.01).to(device)
        if ties:
            # Pack: powers of two <= 1 (x / sigma is the midpoint itself, in range of float16);
            # unpack: 1 + 2^-8 times one, so D(c, sigma) has ties in bfloat16 and float16.
            self.scale = torch.exp2(torch.randint(-3, 1, (L, S, Hc), generator=g).float())
            self.scale[:, 0] *= 1.00390625
            self.scale = self.scale.to(device)

    def job(self, direction, scale=None) -> PageJob:
        caches = tuple(side(c, self.hc0 * c.stride(1) * c.element_size()) for c in self.caches)
        pages = Side(self.pages, self.hp0 * self.hb, (self.pages.stride(0), self.hb, 0, 1),
                     self.pages.shape[0])
        kw = {}
        if direction == "pack":
            sc = self.scale if scale is None else scale
            st = sc.expand(self.L, self.S, -1).stride() if sc.dim() == 3 else (0, 0, 0)
            kw = dict(scale=sc, scale_strides=st, scale_offset=self.hc0 * st[2])
        return PageJob(direction, self.fmt, caches, self.dtype, pages, self.K, self.L, self.S,
                       self.N, self.C, self.hb, **kw)

    def packed_chunk(self, b: int, k: int, scale: torch.Tensor) -> torch.Tensor:
        """The torch rules' head chunk of cache block b, head hc0 + k."""
        L, S, N, E = self.L, self.S, self.N, self.E
        out = torch.zeros(self.hb, dtype=torch.uint8)
        hdr = 4 * L * S
        for layer in range(L):
            for s in range(S):
                sig = scale.cpu().expand(L, S, -1)[layer, s, min(self.hc0 + k,
                                                                  scale.shape[-1] - 1)]
                ls = layer * S + s
                out[4 * ls:4 * ls + 4] = sig.reshape(1).view(torch.uint8)
                x = self.caches[layer].cpu()[b, self.hc0 + k, :, s * E:(s + 1) * E]
                if self.fmt == "nvfp4":
                    codes, sb = quantize_groups(x.reshape(-1, 16), sig)
                    packed = pack_codes(codes.reshape(N, E)).flatten()
                    out[hdr + ls * N * E // 2:hdr + (ls + 1) * N * E // 2] = packed
                    at = hdr + L * N * S * E // 2 + ls * N * E // 16
                    out[at:at + N * E // 16] = sb
                else:
                    q = quantize(x.reshape(1, N, E), CacheDType(self.fmt), sig.reshape(1),
                                 torch.uint8)
                    out[hdr + ls * N * E:hdr + (ls + 1) * N * E] = q.flatten()
        return out

    def unpacked(self, chunk: torch.Tensor, layer: int, s: int) -> torch.Tensor:
        """[N, E] of the cache dtype: the torch rules' decode of (layer, part s) of a chunk."""
        L, S, N, E = self.L, self.S, self.N, self.E
        hdr, ls = 4 * L * S, layer * S + s
        sig = chunk[4 * ls:4 * ls + 4].view(torch.float32)
        if self.fmt == "nvfp4":
            packed = chunk[hdr + ls * N * E // 2:hdr + (ls + 1) * N * E // 2].reshape(N, E // 2)
            at = hdr + L * N * S * E // 2 + ls * N * E // 16
            sb = chunk[at:at + N * E // 16].reshape(N, E // 16)
            v = dequantize_groups(unpack_codes(packed).reshape(N, E // 16, 16), sb, sig)
            return v.reshape(N, E).to(self.dtype)
        codes = chunk[hdr + ls * N * E:hdr + (ls + 1) * N * E].reshape(N, E)
        return fp8_dequant(codes, FP8[self.fmt], sig, self.dtype)


def check_pack(g: Pages, pairs_list, device, max_ctas=None, scale=None, tuning=tt.TUNING
               ) -> None:
    scale = g.scale if scale is None else scale
    mapping = mapping_tensor(pairs_list, torch.int64, device)
    want_pages = storage_bytes(g.pages).cpu().clone()
    exp = rebuilt(g.pages, want_pages)
    caches_before = [storage_bytes(c).cpu().clone() for c in g.caches]
    blocks = min(c.shape[0] for c in g.caches)
    for b, p in pairs_list:
        if in_range(b, p, blocks, g.pages.shape[0]):
            for k in range(g.K):
                at = (g.hp0 + k) * g.hb
                exp[p, at:at + g.hb] = g.packed_chunk(b, k, scale)
    tt.run(make_plan(mapping, page_job=g.job("pack", scale), max_ctas=max_ctas), tuning=tuning)
    finish(device)
    got = storage_bytes(g.pages).cpu()
    diff = (got != want_pages).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} page bytes differ, first at {diff[:8].tolist()}"
    for c, before in zip(g.caches, caches_before, strict=True):
        assert torch.equal(storage_bytes(c).cpu(), before)


def check_unpack(g: Pages, pairs_list, device, max_ctas=None, random_codes=False,
                 ties=False, tuning=tt.TUNING) -> None:
    mapping = mapping_tensor(pairs_list, torch.int32, device)
    # Pages holding the torch rules' chunks of the caches (another seed), or random codes.
    src = Pages(g.fmt, g.dtype, "cpu", L=g.L, S=g.S, N=g.N, C=g.C, K=g.K, Hc=g.Hc, hc0=g.hc0,
                hp0=g.hp0, seed=77, ties=ties)
    rows = g.pages.cpu().clone()
    for p in range(rows.shape[0]):
        for k in range(g.K):
            chunk = src.packed_chunk(p % 5, k, src.scale)
            if random_codes:
                gen = torch.Generator().manual_seed(p * 8 + k)
                hdr = 4 * g.L * g.S
                chunk[hdr:] = torch.randint(0, 256, (g.hb - hdr,), dtype=torch.uint8,
                                            generator=gen)
                if g.fmt == "fp8_e4m3" or g.fmt == "nvfp4":  # no NaN codes (scale bytes)
                    chunk[hdr:][(chunk[hdr:] & 0x7F) == 0x7F] = 0x7E
                else:
                    chunk[hdr:][(chunk[hdr:] & 0x7F) > 0x7C] = 0x7C
            at = (g.hp0 + k) * g.hb
            rows[p, at:at + g.hb] = chunk
    g.pages.copy_(rows.to(g.pages.device))
    pages_before = storage_bytes(g.pages).cpu().clone()
    want = [storage_bytes(c).cpu().clone() for c in g.caches]
    exp = [rebuilt(c, w) for c, w in zip(g.caches, want, strict=True)]
    blocks = min(c.shape[0] for c in g.caches)
    for p, b in pairs_list:
        if in_range(p, b, g.pages.shape[0], blocks):
            for k in range(g.K):
                chunk = rows[p, (g.hp0 + k) * g.hb:(g.hp0 + k + 1) * g.hb]
                for layer in range(g.L):
                    for s in range(g.S):
                        exp[layer][b, g.hc0 + k, :, s * g.E:(s + 1) * g.E] = \
                            g.unpacked(chunk, layer, s)
    tt.run(make_plan(mapping, page_job=g.job("unpack"), max_ctas=max_ctas), tuning=tuning)
    finish(device)
    for layer, (c, w) in enumerate(zip(g.caches, want, strict=True)):
        got = storage_bytes(c).cpu()
        diff = (got != w).nonzero().flatten()
        assert diff.numel() == 0, \
            f"layer {layer}: {diff.numel()} bytes differ, first at {diff[:8].tolist()}"
    assert torch.equal(storage_bytes(g.pages).cpu(), pages_before)


PAGE_PAIRS = [[0, 2], [3, 0], [-1, 1], [4, 3], [2, 9], [5, 1]]  # block 5 is past layer 0's 5
FORMATS = ["fp8_e4m3", "fp8_e5m2", "nvfp4"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack(device, fmt, dtype):
    check_pack(Pages(fmt, dtype, device), PAGE_PAIRS, device, max_ctas=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS[:2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_ties_to_even(device, fmt, dtype):
    """Quotients exactly halfway between two fp8 codes round to the even one."""
    check_pack(Pages(fmt, dtype, device, ties=True, seed=4), PAGE_PAIRS, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_one_scale_one_part(device, fmt):
    """A [1] scale (broadcast), kv_split 1, one layer, every head of the page."""
    g = Pages(fmt, torch.bfloat16, device, L=1, S=1, C=48, Hp=2, hp0=0, K=2, hc0=0, seed=3)
    check_pack(g, PAGE_PAIRS, device, scale=torch.tensor([0.37], device=device))


@pytest.mark.skipif(tt.triton is None, reason="needs Triton")
@pytest.mark.parametrize("capability, native", [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_page_kernels_take_the_float8_conversion_where_the_gpu_has_it(monkeypatch, capability,
                                                                      native):
    """fp8 codes by Triton's float8 conversion only on sm_89 and later (triton_support.native_fp8:
    below it Triton has no e4m3 type and the kernels would not compile), by integer operations
    elsewhere, in both directions. No GPU needed: the launches of a plan on cuda:0 under a budget
    (no SM count asked), its capability faked."""
    from kvwrite.kernels import triton_support

    monkeypatch.setattr(triton_support, "_native_fp8_device", lambda index: capability >= (8, 9))
    g = Pages("fp8_e4m3", torch.bfloat16, "cpu")
    m = mapping_tensor([[0, 1]], torch.int64, "cpu")
    for direction in ("pack", "unpack"):
        plan = dataclasses.replace(make_plan(m, page_job=g.job(direction), max_ctas=2),
                                   device=torch.device("cuda", 0))
        assert {pl.kw["NATIVE"] for pl in tt.page_launches(plan)} == {native}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_pages(device, fmt, dtype):
    """Pages and caches whose every address and stride is a multiple of 16 bytes
    (PageJob.code_align > 0): the kernels' vector form on the GPU, both directions, a
    token-major layer among them."""
    g = Pages(fmt, dtype, device, L=3, N=16, C=64, pool_offset=0, token_major={1}, seed=6)
    assert g.job("pack").code_align() > 0
    check_pack(g, PAGE_PAIRS, device, max_ctas=3)
    check_unpack(g, [[q, b] for b, q in PAGE_PAIRS], device, random_codes=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("halves_groups", [1, 1024])
def test_nvfp4_pack_takes_both_group_forms(device, aligned, halves_groups):
    """The NVFP4 pack's two forms of a group (nvfp4_halves_groups: as two halves a thread, or
    whole across two threads), each general and aligned (code words stored as words), write
    the same bytes: whole allocations against the reference."""
    tuning = dataclasses.replace(tt.TUNING, nvfp4_halves_groups=halves_groups)
    g = Pages("nvfp4", torch.bfloat16, device, L=3, N=16, C=64, seed=12,
              pool_offset=0 if aligned else 8, token_major={1})
    assert (g.job("pack").code_align() >= 4) == aligned
    check_pack(g, PAGE_PAIRS, device, tuning=tuning)
    check_pack(g, PAGE_PAIRS, device, max_ctas=2, tuning=tuning)


@pytest.mark.parametrize("max_ctas", [None, 4])
def test_nvfp4_halves_launch_the_pack_only(max_ctas):
    """Rows of 8 groups (nvfp4_halves_groups): the pack takes the halves form, at most a warp per
    32 of a tile's 256 groups; the unpack keeps its warps (page_warps / budget_page_warps)."""
    g = Pages("nvfp4", torch.bfloat16, "cpu", L=2, N=16, C=256, Hp=2, pool_offset=0,
              token_major=())
    m = mapping_tensor([[0, 1]], torch.int64, "cpu")
    warps = tt.TUNING.budget_page_warps if max_ctas else tt.TUNING.page_warps
    (pack,) = tt.page_launches(make_plan(m, page_job=g.job("pack"), max_ctas=max_ctas))
    (unpack,) = tt.page_launches(make_plan(m, page_job=g.job("unpack"), max_ctas=max_ctas))
    assert pack.kw["HALVES"] and pack.kw["BLOCK_R"] * pack.kw["BLOCK_E"] == 256
    assert pack.kw["num_warps"] == min(warps, 8)
    assert "HALVES" not in unpack.kw and unpack.kw["num_warps"] == warps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("fmt", FORMATS[1:])
def test_layers_of_one_layout_share_a_page_launch(monkeypatch, device, direction, fmt):
    """Six layers, each its own allocation (block counts differ), the fifth token-major: one
    launch for layers 0-3 (equal strides: the layers' offsets select their tensors), one for 4,
    one for 5; with two layers a launch, 0-1, 2-3, 4, 5; where no other layer's storage is in
    the first's reach (the offset range cut to 200 elements: layer 0's first element is 96
    past its storage's start, every other allocation at least 1440 - 96 elements away), a
    launch a layer. Whole allocations compared each time."""
    g = Pages(fmt, torch.float16, device, L=6, token_major={4}, seed=8)
    check = check_pack if direction == "pack" else check_unpack
    pairs = PAGE_PAIRS if direction == "pack" else [[q, b] for b, q in PAGE_PAIRS]
    two = tt.TritonTuning(jobs_per_launch=2)
    for tuning, runs in [(tt.TUNING, [(0, 4), (4, 1), (5, 1)]),
                         (two, [(0, 2), (2, 2), (4, 1), (5, 1)]),
                         ("far", [(n, 1) for n in range(6)])]:
        if tuning == "far":
            monkeypatch.setattr(tt, "_OFFSET_MOST", 200)
            tuning = tt.TUNING
        check(g, pairs, device, max_ctas=3, tuning=tuning)
        plan = make_plan(mapping_tensor(pairs, torch.int64, device, "plain"),
                         page_job=g.job(direction, g.scale if direction == "pack" else None),
                         max_ctas=3)
        launches = tt.page_launches(plan, tuning)
        assert [(pl.l0, pl.layers) for pl in launches] == runs
        assert [len(pl.cache_offs) for pl in launches] == [next_pow2(n) for _, n in runs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack(device, fmt, dtype):
    check_unpack(Pages(fmt, dtype, device), [[q, b] for b, q in PAGE_PAIRS], device, max_ctas=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_every_code(device, fmt, dtype):
    """Random code (and NVFP4 scale) bytes: subnormal fp8 codes, saturated values, overflow to
    the cache dtype's infinity."""
    check_unpack(Pages(fmt, dtype, device, C=64), [[0, 1], [2, 4], [3, 0]], device,
                 random_codes=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_unpack_ties_to_even(device, fmt, dtype):
    """sigma = 2^e (1 + 2^-8): decoded values halfway between two of the cache dtype's round to
    the even one."""
    check_unpack(Pages(fmt, dtype, device, C=64), [[0, 1], [2, 4], [3, 0]], device,
                 random_codes=True, ties=True)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_negative_zero_with_old_unary_minus(monkeypatch, dtype):
    """Triton releases before triton-lang/triton#10270 compile a float's ``-x`` as ``0 - x``
    (-(+0.0) is +0.0 there, the GPU machine's release among them): NVFP4's code 8 and negative
    codes under a zero scale byte still unpack to -0.0. The interpreter is made to negate that
    way."""
    from triton.language.semantic import TritonSemantic

    def minus(self, x):
        zero = self.make_tensor(self.builder.get_null_value(x.type.scalar.to_ir(self.builder)),
                                x.type.scalar)
        return self.sub(zero, x, True)

    monkeypatch.setattr(TritonSemantic, "minus", minus)
    check_unpack(Pages("nvfp4", dtype, "cpu", C=64), [[0, 1], [2, 4], [3, 0]], "cpu",
                 random_codes=True)


# --- compiled for the GPU, without one ----------------------------------------------------------

# Run in a process without TRITON_INTERPRET (whose kernels are compiled ones): every launch of a
# few plans is compiled for sm_90 by Triton (ASTSource, the launch's own arguments and
# constants: tensors 16-byte aligned as Triton specializes them) and its PTX's vector accesses
# are counted.
_COMPILE = r"""
import dataclasses, inspect, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from kvwrite.kernels import triton_transfer as tt
from kvwrite.kernels.triton_support import next_pow2
import test_transfer_triton as T
TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.int16: "*i16", torch.uint8: "*u8",
      torch.int32: "*i32", torch.int64: "*i64"}
out = []
class Compile:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        def call(*args, **kw):
            params = list(inspect.signature(self.fn.fn).parameters)
            sig, consts, attrs, opts = {}, {}, {}, {}
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    sig[params[i]] = TY[a.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(a, tuple):  # the copy kernel's offsets
                    sig[params[i]] = tuple("i64" if abs(x) >= 2**31 else "i32" for x in a)
                else:
                    sig[params[i]] = "i64" if abs(a) >= 2**31 else "i32"
            for n, v in kw.items():
                if n in params:
                    sig[n] = "constexpr"
                    consts[(params.index(n),)] = v
                elif n in ("num_warps", "enable_fp_fusion"):
                    opts[n] = v
            # sm_90 with the float8 conversion (what an H200 gets: counted), and sm_80 without
            # it (triton_support.native_fp8 there: Triton has no e4m3 type below sm_89).
            for arch, native in ((80, False), (90, True)):
                if "NATIVE" in params:
                    consts[(params.index("NATIVE"),)] = native
                src = ASTSource(fn=self.fn, signature=sig, constexprs=consts, attrs=attrs)
                ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                     options=opts).asm["ptx"]
            out.append([self.fn.__name__, len(re.findall(r"ld\.global\.v4", ptx)),
                        len(re.findall(r"st\.global\.v4", ptx))])
        return call
for name in ("_copy_kernel", "_pack_kernel", "_unpack_kernel"):
    setattr(tt, name, Compile(getattr(tt, name)))
src = T.alloc((5, 2, 4, 128), torch.bfloat16, "cpu", 1)
dst = T.alloc((6, 4, 2, 128), torch.bfloat16, "cpu", 2).transpose(1, 2)
tt.run(T.make_plan(T.mapping_tensor([[0, 1]] * 64, torch.int32, "cpu"), [T.copy_job(src, dst)]))
for fmt in T.FORMATS:
    m = T.mapping_tensor([[0, 1]], torch.int64, "cpu")
    for g in (T.Pages(fmt, torch.bfloat16, "cpu", L=1),
              T.Pages(fmt, torch.bfloat16, "cpu", L=2, N=16, C=64, Hp=2, pool_offset=0,
                      token_major=())):
        assert (g.job("pack").code_align() > 0) == (g.L == 2), fmt
        tt.run(T.make_plan(m, page_job=g.job("pack")))
        tt.run(T.make_plan(m, page_job=g.job("unpack")))
print(json.dumps(out))
"""


def test_kernels_compile_for_the_gpu():
    """Every kernel compiles for sm_90 and for sm_80 (no GPU needed; the page kernels with the
    float8 conversion on sm_90 only), a copy of 256-byte rows moves 16-byte vectors, several
    loads before their stores, and the page kernels move 16-byte vectors where the job is
    aligned (PageJob.code_align)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(tt.__file__), "..", ".."),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [name for name, *_ in got] == ["_copy_kernel"] + ["_pack_kernel", "_unpack_kernel"] * 6
    assert got[0][1] >= 2 and got[0][2] >= 2, got
    # Aligned pages (the second page case of each format): the cache moved as whole 16-byte
    # vectors, loaded by pack and stored by unpack; the general case has none.
    for n, fmt in enumerate(FORMATS):
        pack, unpack = got[1 + 4 * n + 2], got[1 + 4 * n + 3]
        assert pack[1] >= 1 and unpack[2] >= 1, (fmt, pack, unpack)
        assert got[1 + 4 * n][1] == got[1 + 4 * n + 1][2] == 0, (fmt, got)


# --- GPU only: pinned host sides, graphs, larger shapes ------------------------------------------

@gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("max_ctas", [1, 4, None])
def test_pinned_host_copies(direction, max_ctas):
    """A pinned host side is read or written by the kernel directly (zero-copy)."""
    host = alloc((64, 2, 16, 128), torch.bfloat16, "cpu", 21, pin=True)
    dev = alloc((48, 2, 16, 128), torch.bfloat16, "cuda", 22)
    src, dst = (dev, host) if direction == "d2h" else (host, dev)
    pairs = [[i, (i * 7) % 40] for i in range(40)] + [[-1, 3], [5, 1000]]
    mapping = mapping_tensor(pairs, torch.int32, "cuda")
    want = storage_bytes(dst).cpu().clone()
    exp = rebuilt(dst, want)
    for i, j in pairs:
        if in_range(i, j, src.shape[0], dst.shape[0]):
            bits(exp)[j] = bits(src.cpu())[i]
    tt.run(make_plan(mapping, [copy_job(src, dst)], max_ctas=max_ctas))
    torch.cuda.synchronize()
    assert torch.equal(storage_bytes(dst).cpu(), want)


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_pinned_host_pages(fmt):
    g = Pages(fmt, torch.bfloat16, "cuda", pin_pages=True, seed=5)
    assert g.pages.is_pinned()
    check_pack(g, PAGE_PAIRS, "cuda", max_ctas=4)
    torch.cuda.synchronize()
    check_unpack(g, [[q, b] for b, q in PAGE_PAIRS], "cuda", max_ctas=4)
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("kind", ["copy", "pack"])
def test_cuda_graph_first_call_captured(kind):
    """The first call of a variant (shapes no other test uses) is the captured one; replays read
    the mapping's current values."""
    pin = kind == "copy"
    src = alloc((9, 3, 5, 40), torch.float16, "cpu" if pin else "cuda", 23, pin=pin)
    dst = alloc((9, 3, 5, 40), torch.float16, "cuda", 24)
    g = Pages("nvfp4", torch.float16, "cuda", L=3, S=1, N=5, C=80, Hc=3, hc0=0, K=3, Hp=3,
              seed=31)
    mapping = mapping_tensor([[0, 1], [2, 3]], torch.int64, "cuda")
    plan = make_plan(mapping, [copy_job(src, dst)] if kind == "copy" else (),
                     page_job=g.job("pack") if kind == "pack" else None, max_ctas=2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tt.run(plan)
    mapping.copy_(torch.tensor([[4, 0], [1, 3]], device="cuda"))
    if kind == "copy":
        want = storage_bytes(dst).cpu().clone()
        exp = rebuilt(dst, want)
        exp[0], exp[3] = src.cpu()[4], src.cpu()[1]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(storage_bytes(dst).cpu(), want)
    else:
        want = storage_bytes(g.pages).cpu().clone()
        exp = rebuilt(g.pages, want)
        for b, p in [[4, 0], [1, 3]]:
            for k in range(g.K):
                exp[p, k * g.hb:(k + 1) * g.hb] = g.packed_chunk(b, k, g.scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(storage_bytes(g.pages).cpu(), want)


@gpu
@pytest.mark.parametrize("max_ctas", [1, 4, None])
@pytest.mark.parametrize("map_dtype, layout", [(torch.int64, "plain"), (torch.int32, "columns")])
def test_large_copies(max_ctas, map_dtype, layout):
    """Llama-3-8B-like blocks (64 KiB a layer and block) and a relayout of them."""
    src = alloc((96, 16, 8, 256), torch.bfloat16, "cuda", 25)
    dst = alloc((80, 16, 8, 256), torch.bfloat16, "cuda", 26)
    dst2 = alloc((80, 8, 16, 256), torch.bfloat16, "cuda", 27).transpose(1, 2)
    pairs = [[(i * 37) % 96, i] for i in range(80)] + [[-1, 0], [0, 80]]
    check_copies(pairs, [(src, dst), (src, dst2)], "cuda", max_ctas, map_dtype, layout)


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_pages(fmt, dtype):
    g = Pages(fmt, dtype, "cuda", L=4, S=2, N=16, C=256, B=24, R=20, Hc=8, Hp=4, hc0=4, hp0=0,
              K=4, seed=11)
    pairs = [[i, (i * 3) % 20] for i in range(20)] + [[-1, 2]]
    check_pack(g, pairs, "cuda")
    check_unpack(g, [[q, b] for b, q in pairs], "cuda", max_ctas=4)
