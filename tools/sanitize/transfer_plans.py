"""Hand-built transfer plans and their torch oracles, shared by tests/test_transfer_cuda.py and the
memcheck cases of the transfer ops (``tools/sanitize/{swap_blocks, swap_blocks_multi_layer,
relayout_kv_cache, pack_kv_pages, unpack_kv_pages}.py``).

A raw copy is given as pairs of views ``(src, dst)``, 4-D ``(blocks, H, N, C)`` of one dtype (the
4-argument swap_blocks form: :func:`block_bytes_view`, a block's bytes as ``(blocks, 1, 1, bytes)``
uint8); :func:`copy_job` turns a pair into a :class:`~kvwrite.transfer.CopyJob` (not coalesced:
a plan's jobs need not be), and :func:`raw_oracle` copies ``dst[j] = src[i]`` per mapping pair on
CPU copies of the whole allocations (pairs with an id outside a side's blocks skipped).

A quantized page job (:class:`PageCase`) follows SPEC §9.4: :func:`pack_oracle` builds each
written head chunk from the torch rules (``kvwrite.dtypes.quantize``, the NVFP4 rule of
``kvwrite.ops.nvfp4.rule``), :func:`unpack_oracle` decodes it (``kvwrite.gather.fp8_dequant``,
``value(c) * float(S) * sigma``).
"""

from __future__ import annotations

import dataclasses

import torch

from kvwrite.dtypes import CacheDType, quantize
from kvwrite.gather import bits_view, fp8_dequant
from kvwrite.ops.nvfp4 import rule
from kvwrite.testing.compare import copy_allocations, storage_bytes
from kvwrite.testing.sanitize import compare_outputs
from kvwrite.transfer import CopyJob, PageJob, Side, TransferPlan

__all__ = ["PAIRS", "COPY_KINDS", "ROW_LAYOUTS", "row_views", "copy_views", "side",
           "block_bytes_view", "copy_job", "make_plan", "mapping_tensor", "raw_oracle",
           "run_copy_case", "PageCase", "page_chunk_bytes", "pack_oracle", "unpack_oracle",
           "run_page_case", "FP8"]

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_CACHE_DTYPE = {"fp8_e4m3": CacheDType.FP8_E4M3, "fp8_e5m2": CacheDType.FP8_E5M2}


def side(view: torch.Tensor) -> Side:
    """A 4-D view as a Side: its own data_ptr, byte strides, size(0) blocks."""
    es = view.element_size()
    return Side(view, 0, tuple(s * es for s in view.stride()), view.shape[0])


def block_bytes_view(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """Block ``i`` of ``t`` as swap_blocks' 4-argument form sees it: the ``block_bytes`` bytes from
    ``i * stride(0) * element_size()`` past ``t.data_ptr()``, as a uint8 ``(blocks, 1, 1,
    block_bytes)`` view with strides ``(stride(0) * es, 0, 0, 1)``."""
    es = t.element_size()
    return storage_bytes(t).as_strided((t.shape[0], 1, 1, block_bytes),
                                       (t.stride(0) * es, 0, 0, 1), t.storage_offset() * es)


def copy_job(src: torch.Tensor, dst: torch.Tensor) -> CopyJob:
    """The CopyJob of two 4-D views of one dtype and one ``shape[1:]``."""
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:], (src.shape, dst.shape)
    _, h, n, c = src.shape
    return CopyJob(side(src), side(dst), h, n, c, src.element_size())


def mapping_tensor(pairs: list[tuple[int, int]], dtype: torch.dtype, device,
                   strided: bool = False) -> torch.Tensor:
    """``[n, 2]`` on ``device``; ``strided``: a transposed ``[2, n]`` allocation's view (strides
    (1, n)) with a column of padding, so neither stride is the contiguous one."""
    t = torch.tensor(pairs, dtype=dtype).reshape(-1, 2)
    if strided:
        n = t.shape[0]
        buf = torch.full((3, n), -7, dtype=dtype)
        buf[0], buf[2] = t[:, 0], t[:, 1]
        t = buf.to(device).as_strided((n, 2), (1, 2 * n))
        return t
    return t.to(device)


def make_plan(op: str, jobs, mapping: torch.Tensor, pairs: int, device: torch.device,
              max_ctas: int | None = None, page_job: PageJob | None = None) -> TransferPlan:
    return TransferPlan(op=op, jobs=tuple(jobs), page_job=page_job, mapping=mapping,
                        host_mapping=None, pairs=pairs, device=device, max_ctas=max_ctas,
                        engine="sm", args={})


def raw_oracle(views: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]
               ) -> list[torch.Tensor]:
    """The destinations after the copies, on CPU copies of their whole allocations: for each
    mapping pair (i, j) in order and each view pair, ``dst[j] = src[i]`` (bits), skipped where
    ``i`` or ``j`` is outside its side's blocks."""
    srcs = copy_allocations([s for s, _ in views], "cpu")
    dsts = copy_allocations([d for _, d in views], "cpu")
    for s, d in zip(srcs, dsts, strict=True):
        for i, j in pairs:
            if 0 <= i < s.shape[0] and 0 <= j < d.shape[0]:
                bits_view(d)[j] = bits_view(s)[i]
    return dsts


def run_copy_case(op: str, views: list[tuple[torch.Tensor, torch.Tensor]],
                  pairs: list[tuple[int, int]], run, *, mapping_dtype=torch.int64,
                  strided_mapping: bool = False, max_ctas: int | None = None,
                  jobs: list[CopyJob] | None = None) -> str | None:
    """``run(plan)`` (a cuda ``run``, or the CPU emulation of the kernels where every view is on
    the host) over the copy jobs of ``views`` (``jobs`` where given, else :func:`copy_job` of
    each pair) against :func:`raw_oracle`: None where every destination allocation and every
    source allocation holds the expected bytes, else the first difference."""
    device = next((t.device for pair in views for t in pair if t.device.type == "cuda"),
                  torch.device("cpu"))
    want = raw_oracle(views, pairs)
    src_before = copy_allocations([s for s, _ in views], "cpu")
    mapping = mapping_tensor(pairs, mapping_dtype, device, strided_mapping)
    if jobs is None:
        jobs = [copy_job(s, d) for s, d in views]
    run(make_plan(op, jobs, mapping, len(pairs), device, max_ctas))
    got = {f"dst{n}": d for n, (_, d) in enumerate(views)}
    got.update({f"src{n}": s for n, (s, _) in enumerate(views)})
    expected = {f"dst{n}": w for n, w in enumerate(want)}
    expected.update({f"src{n}": s for n, s in enumerate(src_before)})
    return compare_outputs(got, expected)


PAIRS = [(0, 3), (2, 0), (5, 1), (-1, 2), (1, 7), (4, 5)]  # (-1, 2), (1, 7): skipped (7 > 5)


def copy_views(kind: str, device, pinned: str | None = None):
    """(src, dst) view pairs of one layout kind on ``device`` (``pinned`` "src" or "dst": that
    side in pinned host memory)."""
    g = torch.Generator().manual_seed(7)

    def alloc(shape, dtype, where):
        x = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(torch.int16)
        x = x.view(torch.float16).to(dtype) if dtype.is_floating_point else x.to(dtype)
        if where == "host":
            return x.pin_memory()
        return x.to(device)

    sw = "host" if pinned == "src" else "dev"
    dw = "host" if pinned == "dst" else "dev"
    if kind == "dense":      # same layout both sides
        return [(alloc((6, 2, 4, 16), torch.bfloat16, sw), alloc((6, 2, 4, 16), torch.bfloat16,
                                                                  dw))]
    if kind == "relayout":   # (B, H, N, C) -> (B, N, H, C) seen as (B, H, N, C)
        return [(alloc((6, 2, 4, 16), torch.bfloat16, sw),
                 alloc((6, 4, 2, 16), torch.bfloat16, dw).transpose(1, 2))]
    if kind == "odd":        # rows of 5 float16 in padded rows (2-byte vectors), 3 heads
        return [(alloc((6, 3, 4, 7), torch.float16, sw)[..., 1:6],
                 alloc((6, 3, 4, 5), torch.float16, dw))]
    if kind == "strided":    # every other element on the source (element by element)
        return [(alloc((6, 2, 4, 16), torch.float32, sw)[..., ::2],
                 alloc((6, 2, 4, 8), torch.float32, dw))]
    if kind == "bytes":      # uint8 rows at an odd offset (1-byte vectors)
        return [(alloc((6, 2, 3, 11), torch.uint8, sw)[..., 1:10],
                 alloc((6, 2, 3, 9), torch.uint8, dw))]
    if kind == "heads":      # head_range (1, 3): src full, dst the slice
        return [(alloc((6, 4, 4, 8), torch.float16, sw)[:, 1:3],
                 alloc((6, 2, 4, 8), torch.float16, dw))]
    if kind == "block_bytes":  # 4-argument form: 1000 bytes of 1024-byte blocks
        return [(block_bytes_view(alloc((6, 512), torch.float16, sw), 1000),
                 block_bytes_view(alloc((7, 512), torch.float16, dw), 1000))]
    if kind == "long_rows":    # 4-argument form: 1 MiB rows, spread over CTAs
        return [(block_bytes_view(alloc((6, 1 << 19), torch.float16, sw), 1 << 20),
                 block_bytes_view(alloc((6, 1 << 19), torch.float16, dw), 1 << 20))]
    raise ValueError(kind)


COPY_KINDS = ["dense", "relayout", "odd", "strided", "bytes", "heads", "block_bytes", "long_rows"]

# Row layouts of row_views: (vector width the kernels take, vectors of a row of n).
ROW_LAYOUTS = {"dense16": (16, lambda n: n), "relayout16": (16, lambda n: n),
               "odd2": (2, lambda n: n), "bytes1": (1, lambda n: n),
               "pieces4": (4, lambda n: 2 * -(-n // 2))}


def row_views(layout: str, n: int, device, seed: int = 0, pinned: str | None = None):
    """(views, jobs): two (src, dst) view pairs of one geometry (two jobs of one launch) whose rows
    have ``n`` vectors of ROW_LAYOUTS[layout] (pieces4: 2 * ceil(n / 2)), 6 blocks a side, 2 heads,
    3 tokens, random bytes; ``pinned`` "src" or "dst": that side in pinned host memory.
    dense16 / relayout16: int32 rows of 16 * n bytes, the relayout's destination (B, N, H, C);
    odd2: float16 rows inside padded rows; bytes1: uint8 rows at odd offsets; pieces4: 8-byte
    elements, every other one on the source, both sides 4-aligned (non-dense rows, 2 pieces an
    element)."""
    g = torch.Generator().manual_seed(seed)

    def buf(nbytes, where):
        x = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        return x.pin_memory() if where == pinned else x.to(device)

    views, jobs = [], []
    for _ in range(2):
        if layout in ("dense16", "relayout16"):
            src = buf(6 * 2 * 3 * 16 * n, "src").view(torch.int32).view(6, 2, 3, 4 * n)
            dst = buf(6 * 2 * 3 * 16 * n, "dst").view(torch.int32)
            dst = (dst.view(6, 2, 3, 4 * n) if layout == "dense16"
                   else dst.view(6, 3, 2, 4 * n).transpose(1, 2))
        elif layout == "odd2":
            src = buf(6 * 2 * 3 * 2 * (n + 3), "src").view(torch.float16).view(6, 2, 3, n + 3)
            dst = buf(6 * 2 * 3 * 2 * (n + 1), "dst").view(torch.float16).view(6, 2, 3, n + 1)
            src, dst = src[..., 1:n + 1], dst[..., :n]
        elif layout == "bytes1":
            src = buf(6 * 2 * 3 * (n + 2), "src").view(6, 2, 3, n + 2)[..., 1:n + 1]
            dst = buf(6 * 2 * 3 * (n + 1), "dst").view(6, 2, 3, n + 1)[..., 1:]
        elif layout == "pieces4":
            e = -(-n // 2)
            src = buf(6 * 2 * 3 * 16 * e + 4, "src")[4:].as_strided(
                (6, 2, 3, e, 8), (96 * e, 48 * e, 16 * e, 16, 1))
            dst = buf(6 * 2 * 3 * 8 * e + 12, "dst")[12:].as_strided(
                (6, 2, 3, e, 8), (48 * e, 24 * e, 8 * e, 8, 1))
            views.append((src, dst))
            jobs.append(CopyJob(Side(src, 0, src.stride()[:4], 6),
                                Side(dst, 0, dst.stride()[:4], 6), 2, 3, e, 8))
            continue
        else:
            raise ValueError(layout)
        views.append((src, dst))
        jobs.append(copy_job(src, dst))
    return views, jobs


# ------------------------------------------------------------------------------------------
# Quantized pages
# ------------------------------------------------------------------------------------------
def page_chunk_bytes(page_format: str, L: int, S: int, N: int, C: int) -> int:
    """hb of SPEC §9.4's table."""
    lnc = L * N * C
    used = 4 * L * S + (lnc // 2 + lnc // 16 if page_format == "nvfp4" else lnc)
    return 16 * -(-used // 16)


@dataclasses.dataclass
class PageCase:
    """A quantized pack or unpack over ``L`` caches ``(num_blocks, Hc, N, C)`` (padded rows:
    ``C + pad`` elements allocated per row, so bytes between rows must not change) and a page
    pool whose rows are ``row_pad`` bytes longer than ``Hp * hb``; heads ``hc0 + k`` of the
    caches pair with chunks ``hp0 + k`` of the pages, ``k < K``."""

    direction: str
    page_format: str
    cache_dtype: torch.dtype
    L: int = 3
    S: int = 2
    N: int = 4
    C: int = 32
    Hc: int = 3
    Hp: int = 4
    K: int = 2
    hc0: int = 1
    hp0: int = 1
    num_blocks: int = 5
    num_pages: int = 4
    pad: int = 3
    row_pad: int = 3
    scale_shape: str = "full"      # "full" [L, S, Hc], "tensor" [1], "head" [Hc]
    pages_pinned: bool = False
    pairs: tuple = ((0, 2), (3, 0), (-1, 1), (4, 3), (2, 9))
    page_offset: int = 5           # bytes of the pool before the first page row
    scale_value: float | None = None  # every scale this value (else random, positive)
    special: bool = False          # caches of special values (SPECIAL_VALUES * scale, cyclic)

    @property
    def E(self) -> int:
        return self.C // self.S

    @property
    def hb(self) -> int:
        return page_chunk_bytes(self.page_format, self.L, self.S, self.N, self.C)

    def make(self, device, seed: int = 0):
        """(caches, pages, scale): random caches (some NaN, inf and huge values), random page
        bytes (unpack: each chunk's sigma header finite and positive), positive scales."""
        g = torch.Generator().manual_seed(seed)
        caches = []
        for _ in range(self.L):
            full = torch.randn(self.num_blocks, self.Hc, self.N, self.C + self.pad,
                               generator=g) * 3
            flat = full.view(-1)
            pick = torch.randint(0, flat.numel(), (6,), generator=g)
            flat[pick[0]], flat[pick[1]] = float("nan"), float("inf")
            flat[pick[2]], flat[pick[3]] = -1e4, 1e-6
            if self.special:
                vals = special_values(self.page_format) * (self.scale_value or 1.0)
                vals = vals[torch.randperm(vals.numel(), generator=g)]
                full = vals.repeat(-(-full.numel() // vals.numel()))[:full.numel()].view_as(full)
            caches.append(full.to(self.cache_dtype).to(device)[..., :self.C])
        rows = self.Hp * self.hb + self.row_pad
        at0 = self.page_offset
        pool = torch.randint(0, 256, (self.num_pages * rows + at0,), dtype=torch.uint8,
                             generator=g)
        if self.direction == "unpack":
            for p in range(self.num_pages):
                for h in range(self.Hp):
                    at = at0 + p * rows + h * self.hb
                    sig = torch.exp(torch.rand(self.L * self.S, generator=g) * 6 - 3)
                    pool[at:at + 4 * self.L * self.S] = sig.view(torch.uint8)
        pool = pool.pin_memory() if self.pages_pinned else pool.to(device)
        pages = pool[at0:].as_strided((self.num_pages, self.Hp * self.hb), (rows, 1))
        full_scale = torch.exp(torch.rand(self.L, self.S, self.Hc, generator=g) * 4 - 2)
        if self.scale_value is not None:
            full_scale.fill_(self.scale_value)
        scale = {"full": full_scale, "tensor": full_scale[0, 0, :1],
                 "head": full_scale[0, 0]}[self.scale_shape].contiguous().to(device)
        return caches, pages, scale

    def page_job(self, caches, pages, scale) -> PageJob:
        es = caches[0].element_size()
        cache_sides = tuple(Side(c, self.hc0 * c.stride(1) * es,
                                 tuple(s * es for s in c.stride()), c.shape[0]) for c in caches)
        page_side = Side(pages, self.hp0 * self.hb, (pages.stride(0), self.hb, 0, 1),
                         pages.shape[0])
        sc, strides, offset = None, (0, 0, 0), 0
        if self.direction == "pack":
            sc = torch.broadcast_to(scale, (self.L, self.S, self.Hc))
            strides = sc.stride()
            offset = self.hc0 * strides[2]
        return PageJob(direction=self.direction, page_format=self.page_format, caches=cache_sides,
                       cache_dtype=self.cache_dtype, pages=page_side, heads=self.K,
                       layers=self.L, parts=self.S, tokens=self.N, row_elems=self.C,
                       chunk_bytes=self.hb, scale=sc, scale_strides=strides,
                       scale_offset=offset)


def special_values(page_format: str) -> torch.Tensor:
    """float32 values that test a page format's rounding at scale 1: every finite value of the
    fp8 format (or of E2M1 times a few scales), the midpoints between neighbours (ties), values
    past the largest (saturation), +-inf, NaN, +-0 and tiny values. Each is a bfloat16 and a
    float16 value too (at most 5 significant bits, exponents within float16's range), so the
    cache holds it exactly."""
    if page_format == "nvfp4":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        vals = torch.cat([grid * s for s in (1.0, 0.25, 8.0, 2.0 ** -6)])
        vals = torch.cat([vals, (vals[1:] + vals[:-1]) / 2])
    else:
        fp8 = FP8[page_format]
        codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        fin = codes[torch.isfinite(codes)].unique()           # sorted, -max .. max
        vals = torch.cat([fin, (fin[1:] + fin[:-1]) / 2])
        big = fin.abs().max().item()
        vals = torch.cat([vals, torch.tensor([big * 1.25, -big * 1.5, big * 4])])
    extra = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 2.0 ** -14,
                          -(2.0 ** -14), 65504.0 / 2])
    vals = torch.cat([vals, -vals, extra])
    return vals


def _in_range(case: PageCase, cache_id: int, page_id: int) -> bool:
    return 0 <= cache_id < case.num_blocks and 0 <= page_id < case.num_pages


def pack_oracle(case: PageCase, caches, pages, scale) -> torch.Tensor:
    """The page pool after the pack (CPU copy of its whole allocation): each mapped (b, p) and
    k, chunk hp0 + k of row p = scales, codes, zeros (SPEC §9.4)."""
    (out,) = copy_allocations([pages], "cpu")
    cs = copy_allocations(caches, "cpu")
    sc = torch.broadcast_to(scale.cpu(), (case.L, case.S, case.Hc))
    L, S, N, E, hb = case.L, case.S, case.N, case.E, case.hb
    lnc = L * N * case.C
    for b, p in case.pairs:
        if not _in_range(case, b, p):
            continue
        for k in range(case.K):
            hc = case.hc0 + k
            chunk = torch.zeros(hb, dtype=torch.uint8)
            sig = sc[:, :, hc].reshape(-1).contiguous()
            chunk[:4 * L * S] = sig.view(torch.uint8)
            for layer in range(L):
                for s in range(S):
                    x = cs[layer][b, hc, :, s * E:(s + 1) * E]          # [N, E]
                    sigma = sc[layer, s, hc].reshape(1)
                    r0 = (layer * S + s) * N
                    if case.page_format == "nvfp4":
                        codes, big_s = rule.quantize_groups(x.reshape(-1, 16), sigma)
                        packed = rule.pack_codes(codes).reshape(-1)   # N * E / 2 bytes
                        at = 4 * L * S + r0 * E // 2
                        chunk[at:at + packed.numel()] = packed
                        at = 4 * L * S + lnc // 2 + r0 * E // 16
                        chunk[at:at + big_s.numel()] = big_s
                    else:
                        q = quantize(x.reshape(N, 1, E), _CACHE_DTYPE[case.page_format], sigma,
                                     torch.uint8).reshape(-1)
                        at = 4 * L * S + r0 * E
                        chunk[at:at + q.numel()] = q
            h = case.hp0 + k
            out[p, h * hb:(h + 1) * hb] = chunk
    return out


def unpack_oracle(case: PageCase, pages, caches) -> list[torch.Tensor]:
    """The caches after the unpack (CPU copies of their whole allocations)."""
    (pg,) = copy_allocations([pages], "cpu")
    cs = copy_allocations(caches, "cpu")
    L, S, N, E, hb = case.L, case.S, case.N, case.E, case.hb
    lnc = L * N * case.C
    for p, b in case.pairs:
        if not _in_range(case, b, p):
            continue
        for k in range(case.K):
            h = case.hp0 + k
            chunk = pg[p, h * hb:(h + 1) * hb].clone()
            sig = chunk[:4 * L * S].view(torch.float32)
            for layer in range(L):
                for s in range(S):
                    sigma = sig[layer * S + s].reshape(1)
                    r0 = (layer * S + s) * N
                    if case.page_format == "nvfp4":
                        at = 4 * L * S + r0 * E // 2
                        codes = rule.unpack_codes(chunk[at:at + N * E // 2]).reshape(N, E)
                        at = 4 * L * S + lnc // 2 + r0 * E // 16
                        big_s = rule.e4m3_value(chunk[at:at + N * E // 16]).reshape(N, E // 16)
                        vs = rule.e2m1_values(codes) * big_s.repeat_interleave(16, dim=1)
                        y = (vs * sigma).to(case.cache_dtype)
                    else:
                        at = 4 * L * S + r0 * E
                        y = fp8_dequant(chunk[at:at + N * E].reshape(N, E),
                                        FP8[case.page_format], sigma, case.cache_dtype)
                    cs[layer][b, case.hc0 + k, :, s * E:(s + 1) * E] = y
    return cs


def run_page_case(case: PageCase, run, *, mapping_dtype=torch.int64,
                  strided_mapping: bool = False, max_ctas: int | None = None,
                  seed: int = 0, device=None) -> str | None:
    """``run(plan)`` (a cuda ``run``) over ``case`` on ``device`` (default: the current GPU; the
    CPU for an emulated kernel) against its oracle: every page and cache allocation compared
    whole (fp8 pages: NaN codes of either sign equal; unpacked caches: NaN of any payload
    equal)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    caches, pages, scale = case.make(device, seed)
    pj = case.page_job(caches, pages, scale)
    mapping = mapping_tensor(list(case.pairs), mapping_dtype, device, strided_mapping)
    plan = make_plan(f"{case.direction}_kv_pages", [], mapping, len(case.pairs), device,
                     max_ctas, pj)
    if case.direction == "pack":
        want_pages = pack_oracle(case, caches, pages, scale)
        want_caches = copy_allocations(caches, "cpu")
    else:
        want_caches = unpack_oracle(case, pages, caches)
        (want_pages,) = copy_allocations([pages], "cpu")
    run(plan)
    got = {"pages": pages, **{f"cache{n}": c for n, c in enumerate(caches)}}
    want = {"pages": want_pages, **{f"cache{n}": c for n, c in enumerate(want_caches)}}
    if case.direction == "pack":  # the caches are sources: every bit kept
        nan = {"pages": FP8[case.page_format]} if case.page_format in FP8 else {}
    else:
        nan = {f"cache{n}": case.cache_dtype for n in range(case.L)}
    return compare_outputs(got, want, nan)


def copy_cases(op: str, kinds: list[tuple[str, str | None, int | None]], run=None) -> list:
    """Memcheck cases ``(id, check)`` of raw copies: each ``(kind, pinned, max_ctas)`` of
    :func:`copy_views` through ``run`` (default: kvwrite.kernels.transfer_cuda.run) against the
    per-pair loop, int32 strided and int64 mappings with out-of-range ids."""
    def check(kind, pinned, max_ctas, dtype):
        def go():
            views = copy_views(kind, "cuda", pinned)
            return run_copy_case(op, views, PAIRS, run or _cuda_run(), mapping_dtype=dtype,
                                 strided_mapping=dtype == torch.int32, max_ctas=max_ctas)
        return go
    out = []
    for kind, pinned, max_ctas in kinds:
        for dtype in (torch.int64, torch.int32):
            case_id = (f"{kind}-{pinned or 'device'}-ctas{max_ctas or 'all'}-"
                       f"{str(dtype).removeprefix('torch.')}")
            out.append((case_id, check(kind, pinned, max_ctas, dtype)))
    return out


def page_cases(direction: str, run=None) -> list:
    """Memcheck cases of quantized pages (``direction`` "pack" or "unpack") against the torch
    rules: every format, a padded page pool with misaligned chunks, head ranges, more layers
    than a launch's slots, pinned pages."""
    cases = {
        "fp8_e4m3-bf16": PageCase(direction, "fp8_e4m3", torch.bfloat16),
        "fp8_e5m2-f32-odd-parts": PageCase(direction, "fp8_e5m2", torch.float32, C=10, S=2),
        "nvfp4-f16": PageCase(direction, "nvfp4", torch.float16, scale_shape="head"),
        "nvfp4-bf16-many-layers-pinned": PageCase(direction, "nvfp4", torch.bfloat16, L=35, N=2,
                                                  C=16, S=1, pages_pinned=True,
                                                  scale_shape="tensor"),
        # the aligned variants (transfer_cuda.page_align): ALIGN 16 with U = 4, ALIGN 4 (codes at
        # 4*L*S = 12) with U = 2
        "fp8_e4m3-bf16-aligned": PageCase(direction, "fp8_e4m3", torch.bfloat16, L=2, N=16,
                                          C=256, pad=0, row_pad=16, page_offset=32),
        "nvfp4-f16-aligned-codes-at-12": PageCase(direction, "nvfp4", torch.float16, L=3, S=1,
                                                  N=16, C=128, pad=0, row_pad=16,
                                                  page_offset=32),
    }

    def check(case):
        return lambda: run_page_case(case, run or _cuda_run(), max_ctas=3)
    return [(case_id, check(case)) for case_id, case in cases.items()]


def _cuda_run():
    from kvwrite.kernels.transfer_cuda import run
    return run
