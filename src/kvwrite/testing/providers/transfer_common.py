"""What the conformance providers of the five transfer ops (SPEC §9) share: cases as data
(layouts, dtypes, which side lives in pinned host memory on a GPU run, where the mapping lives),
the arguments built over random bytes, a seed's random mapping (new ids for graph replays),
wrong writers as the reference with its plan changed, and the Provider built from those. Each
op's rule against an independent oracle: tests/test_transfer.py."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

import kvwrite

from ..compare import assert_caches_equal
from ..conformance import BadInput, Example, Provider, WrongWriter
from ..transfer import mapping, random_values, random_view

__all__ = ["TransferCase", "build", "transfer_provider", "skipping_last_pair", "cases_of",
           "page_cases"]


@dataclasses.dataclass(frozen=True)
class TransferCase:
    """One call of a transfer op. ``op``: "swap", "swap_bytes", "multi", "relayout", "pack",
    "unpack". ``host``: on a GPU run, the side ("src" or "dst": for pack the caches are the
    source, for unpack the pages) in pinned host memory (None: both on the GPU). ``gpu_mapping``:
    on a GPU run, the mapping on the GPU (else on the host). ``map_dtype``: its dtype, given as
    a transposed, strided view. ``max_ctas``: the SM budget keyword (the last argument ``build``
    returns)."""
    op: str
    dtype: torch.dtype = torch.bfloat16
    host: str | None = None
    gpu_mapping: bool = False
    map_dtype: torch.dtype = torch.int64
    page_format: str = "raw"
    head_range: tuple[int, int] | None = None
    layers: int = 2
    max_ctas: int | None = None


# Blocks of each side, and the pairs a seed maps (distinct destinations, a repeated source).
SRC_BLOCKS, DST_BLOCKS, PAIRS = 7, 6, 3


def _pairs(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + seed)
    dst = torch.randperm(DST_BLOCKS, generator=g)[:PAIRS].tolist()
    src = torch.randint(0, SRC_BLOCKS, (PAIRS - 1,), generator=g).tolist()
    return [[s, d] for s, d in zip([*src, src[0]], dst, strict=True)]


def _place(t: torch.Tensor, device: str, on_host: bool) -> torch.Tensor:
    """``t`` (a CPU view) with its whole allocation moved to ``device``, or pinned on a GPU run
    where ``on_host``."""
    if device == "cpu":
        return t
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0,
                                                 (t.untyped_storage().nbytes(),))
    raw = raw.pin_memory() if on_host else raw.to(device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _cache(blocks: int, heads: int, layer: int, dtype, seed: int, values: bool, n=4, c=32):
    """A logical (blocks, H, N, C) view: vLLM's order (block, token, head, C) with a padded
    block stride on even layers, dense (block, head, token, C) on odd ones."""
    make = random_values if values else random_view
    if layer % 2 == 0:
        return make((blocks, heads, n, c), (n * heads * c + 8, c, heads * c, 1), dtype,
                    offset=3, seed=seed)
    return make((blocks, heads, n, c), None, dtype, seed=seed)


def build(case: TransferCase, device: str, seed: int) -> tuple:
    """The arguments of the provider's ``call``: the op's positional ones (pack/unpack: then
    ``head_range``, ``page_format`` and pack's ``scale``), then ``max_ctas``."""
    return (*_build(case, device, seed), case.max_ctas)


def _build(case: TransferCase, device: str, seed: int) -> tuple:
    src_host = device != "cpu" and case.host == "src"
    dst_host = device != "cpu" and case.host == "dst"
    m = mapping(_pairs(seed), case.map_dtype, odd_strides=True)
    m = m.to(device) if device != "cpu" and case.gpu_mapping else m
    s0 = 100 * seed
    if case.op in ("swap", "swap_bytes", "multi"):
        shapes = [(4, 2, 16), (3, 8)][: 1 if case.op != "multi" else case.layers]
        srcs, dsts = [], []
        for i, shape in enumerate(shapes):
            st = [a * 2 for a in torch.empty(shape).stride()]
            srcs.append(_place(random_view((SRC_BLOCKS, *shape), None, case.dtype,
                                           offset=1, seed=s0 + i), device, src_host))
            pad = st[0] * shape[0] + 4
            dsts.append(_place(random_view((DST_BLOCKS, *shape),
                                           (pad, *(x for x in torch.empty(shape).stride())),
                                           case.dtype, seed=s0 + 50 + i), device, dst_host))
        if case.op == "swap":
            return (srcs[0], dsts[0], m)
        if case.op == "swap_bytes":
            return (srcs[0], dsts[0], srcs[0].stride(0) * srcs[0].element_size() - 6, m)
        return (tuple(srcs), list(dsts), m)
    if case.op == "relayout":
        src = [_place(_cache(SRC_BLOCKS, 4, i, case.dtype, s0 + i, False), device, src_host)
               for i in range(case.layers)]
        k = 4 if case.head_range is None else case.head_range[1] - case.head_range[0]
        dst = [_place(_cache(DST_BLOCKS, k, i + 1, case.dtype, s0 + 50 + i, False), device,
                      dst_host) for i in range(case.layers)]
        return (src, dst, m, case.head_range)
    values = case.page_format != "raw"
    caches = [_cache(SRC_BLOCKS if case.op == "pack" else DST_BLOCKS, 4, i, case.dtype,
                     s0 + i, values) for i in range(case.layers)]
    k = 4 if case.head_range is None else case.head_range[1] - case.head_range[0]
    P = k * kvwrite.kv_page_bytes(case.layers, 1, 4, 32, case.dtype, kv_split=2,
                                  page_format=case.page_format)
    rows = DST_BLOCKS if case.op == "pack" else SRC_BLOCKS
    pages = random_view((rows, P), (P + 24, 1), torch.uint8, seed=s0 + 50)
    if case.op == "unpack":
        # Pages a pack wrote (their sigmas valid), the caches then overwritten.
        full = [_cache(rows, 4, i, case.dtype, s0 + 70 + i, True) for i in range(case.layers)]
        kvwrite.pack_kv_pages(full, pages, mapping([[r, r] for r in range(rows)]),
                              kv_split=2, head_range=case.head_range,
                              page_format=case.page_format,
                              scale=torch.tensor([0.5, 1.0, 2.0, 0.25]))
    scale = None
    if values:
        scale = _place(torch.tensor([[[0.5], [2.0]]]).expand(case.layers, 2, 1)
                       * torch.tensor([1.0, 0.5, 0.25, 4.0]), device,
                       case.op == "pack" and src_host)
    cache_host = src_host if case.op == "pack" else dst_host
    page_host = dst_host if case.op == "pack" else src_host
    caches = [_place(c, device, cache_host) for c in caches]
    pages = _place(pages, device, page_host)
    if case.op == "pack":
        return (caches, pages, m, case.head_range, case.page_format, scale)
    return (pages, caches, m, case.head_range, case.page_format)


def _call(op: str) -> Callable:
    """The op called on ``build``'s arguments (its keywords from their positions)."""
    fn = getattr(kvwrite, op)
    if op == "pack_kv_pages":
        def call(caches, pages, m, head_range, page_format, scale, max_ctas,
                 implementation=None):
            fn(caches, pages, m, kv_split=2, head_range=head_range, page_format=page_format,
               scale=scale, max_ctas=max_ctas, implementation=implementation)
    elif op == "unpack_kv_pages":
        def call(pages, caches, m, head_range, page_format, max_ctas, implementation=None):
            fn(pages, caches, m, kv_split=2, head_range=head_range, page_format=page_format,
               max_ctas=max_ctas, implementation=implementation)
    else:
        def call(*args, implementation=None):
            fn(*args[:-1], max_ctas=args[-1], implementation=implementation)
    return call


def _flat(args: tuple) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def skipping_last_pair(op: str) -> Callable[..., None]:
    """A wrong writer: the public op through the torch reference, whose plan's mapping lacks its
    last pair."""
    ref = importlib.import_module(f"kvwrite.ops.{op}.reference")

    def write(*args) -> None:
        real = ref.run

        def broken(plan):
            host = plan.host_mapping if plan.host_mapping is not None else plan.mapping
            real(dataclasses.replace(plan, host_mapping=host[:-1], mapping=plan.mapping[:-1]))
        ref.run = broken
        try:
            _call(op)(*args, implementation="torch")
        finally:
            ref.run = real
    return write


def _skip(info, case: TransferCase, args: tuple) -> str | None:
    return None


def transfer_provider(op: str, *, mutates: int, cases: tuple[Example, ...],
                      graph_cases: tuple[Example, ...] = (),
                      compile_cases: tuple[Example, ...] = (),
                      small_tile_cases: tuple[Example, ...] = (),
                      wrong: tuple[WrongWriter, ...] = (),
                      bad: tuple[BadInput, ...] = ()) -> Provider:
    """``mutates``: the position of the written argument (a tensor or a list of them)."""
    def written_of(args: tuple) -> list[torch.Tensor]:
        w = args[mutates]
        return list(w) if isinstance(w, (list, tuple)) else [w]

    def with_written(args: tuple, copies: list[torch.Tensor]) -> tuple:
        out = list(args)
        out[mutates] = (type(args[mutates])(copies) if isinstance(args[mutates], (list, tuple))
                        else copies[0])
        return tuple(out)

    def check(case, got, want) -> None:
        """Every byte of each written allocation (a list's tensors named by index)."""
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_caches_equal(g, w, f"{names[op]}[{i}]" if len(got) > 1 else names[op])

    names = {"swap_blocks": "dst", "swap_blocks_multi_layer": "dst_caches",
             "relayout_kv_cache": "dst", "pack_kv_pages": "pages",
             "unpack_kv_pages": "caches"}
    return Provider(op=op, call=_call(op), build=build, mutates=(mutates,),
                    mutated_names=(names[op],), check=check, skip=_skip, public=getattr(kvwrite, op),
                    cases=cases, graph_cases=graph_cases, compile_cases=compile_cases,
                    small_tile_cases=small_tile_cases, graph_warmup=False, graph_seeds=(1, 2),
                    wrong_writers=wrong, bad_inputs=bad, tensors_of=_flat, written_of=written_of,
                    with_written=with_written)


def cases_of(op: str, **extra) -> tuple[Example, ...]:
    """Each op's byte cases: device to device (CPU mapping, int64) and with the mapping on the
    GPU (int32), d2h and h2d through pinned host memory (GPU runs; host to host on the CPU)."""
    base = TransferCase(op, **extra)
    return (Example("d2d", base),
            Example("d2d-1-cta", dataclasses.replace(base, max_ctas=1), gpu=True),
            Example("d2d-gpu-mapping", dataclasses.replace(base, gpu_mapping=True,
                                                           map_dtype=torch.int32)),
            Example("d2h-4-ctas", dataclasses.replace(base, host="dst", max_ctas=4), gpu=True),
            Example("h2d", dataclasses.replace(base, host="src", gpu_mapping=True), gpu=True))


# Every page format the transfer pages take (SPEC §9.4), as the page ops' cases spell them.
PAGE_FORMATS = ("raw", "fp8", "fp8_e5m2", "nvfp4")


def page_cases(op: str) -> list[Example]:
    """:func:`cases_of` for each page format of pack (``op`` "pack") or unpack, ids prefixed
    with the format."""
    return [dataclasses.replace(ex, id=f"{fmt}-{ex.id}") for fmt in PAGE_FORMATS
            for ex in cases_of(op, page_format=fmt)]

