"""Moving caches (docs/ops/transfer.md, SPEC §9): what every transfer op shares.

The public ops (``swap_blocks``, ``swap_blocks_multi_layer``, ``relayout_kv_cache``,
``pack_kv_pages``, ``unpack_kv_pages``) validate their arguments and build one
:class:`TransferPlan`; every implementation's ``run(plan)`` and the copy-engine path read only
the plan. A plan is a list of strided copies (:class:`CopyJob`: raw bytes, every op in the
``"raw"`` page format) or, for the quantized page formats, one :class:`PageJob` (the kernels
quantize or decode), plus the mapping and the launch limits.

Addresses are bytes: a :class:`Side` is one tensor's storage seen as a 4-D grid
``(block, head, token, element)`` of ``elem_bytes``-byte elements, element ``[b, h, t, c]`` at
``side.ptr + b*sb + h*sh + t*st + c*sc`` bytes (``side.ptr``: the tensor's ``data_ptr()`` plus
``side.offset``, which already includes any head offset of a ``head_range``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .registry import ImplInfo, OpArg
from .registry import get as get_impl
from .registry import select as select_impl
from .validation import check_int, check_mutation_safe, require_tensor, shape_str

__all__ = ["Side", "CopyJob", "PageJob", "TransferPlan", "consecutive_runs", "ENGINES", "PAGE_FORMATS",
           "QUANTIZED_CACHE_DTYPES", "kv_page_bytes", "chunk_bytes", "parse_page_format",
           "check_kv_split", "check_max_ctas", "check_engine", "check_mapping",
           "check_head_range", "same_view", "call_device", "call_devices", "check_mapping_device",
           "check_host_mapping", "check_destinations", "capturing", "coalesce", "build_swap",
           "clear_plan_cache", "PLAN_CACHE_SIZE",
           "build_swap_bytes", "build_relayout", "build_pack", "build_unpack", "select", "byte_blocks",
           "mapped_pairs", "TENSORS_ARG", "HEAD_RANGE_ARG", "MAX_CTAS_ARG"]

ENGINES = ("auto", "sm", "ce")
# Page formats by spelling -> canonical name ("fp8" is "fp8_e4m3").
PAGE_FORMATS = {"raw": "raw", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
                "nvfp4": "nvfp4"}


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a copy: ``tensor`` (kept for its device, storage and lifetime) addressed as a
    grid of ``blocks`` blocks (ids ``>= blocks`` or ``< 0`` of a GPU mapping are skipped)."""

    tensor: torch.Tensor
    offset: int                          # bytes from tensor.data_ptr() to element [0, 0, 0, 0]
    strides: tuple[int, int, int, int]   # bytes per step of block, head, token, element
    blocks: int

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr() + self.offset

    @property
    def on_host(self) -> bool:
        return self.tensor.device.type == "cpu"


@dataclasses.dataclass(frozen=True)
class CopyJob:
    """For each mapping pair ``(i, j)`` (column 0 the source id, column 1 the destination's:
    pack's pairs are (cache block, page row), unpack's (page row, cache block)), every
    ``h < heads``, ``t < tokens``, ``c < elems``: the ``elem_bytes`` bytes of ``src[i, h, t, c]``
    are copied to ``dst[j, h, t, c]``. Built coalesced (:func:`coalesce`): where both sides are
    dense across a dim, it is merged into the elements, so ``elems * elem_bytes`` is the longest
    run the two sides share."""

    src: Side
    dst: Side
    heads: int
    tokens: int
    elems: int
    elem_bytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one (h, t) row where both sides' elements are dense (sc == elem_bytes)."""
        return self.elems * self.elem_bytes

    @property
    def dense_rows(self) -> bool:
        """Both sides' elements are adjacent: a row is one run of ``row_bytes`` bytes."""
        return self.src.strides[3] == self.elem_bytes and self.dst.strides[3] == self.elem_bytes


@dataclasses.dataclass(frozen=True)
class PageJob:
    """A quantized pack (caches -> pages) or unpack (pages -> caches), SPEC §9.4.

    ``caches[l]``: layer ``l``'s cache as a Side over ``(block, head k, token, element)`` whose
    head 0 is cache head ``hc(0)`` (offset included); element size that of ``cache_dtype``.
    ``pages``: a Side over ``(page row, head k, 0, byte)`` whose head 0 is the page's ``hp(0)``
    chunk (strides ``(row stride, chunk_bytes, 0, 1)``). Head chunk ``k`` of page row ``p``
    holds, from its first byte: float32 ``sigma(l, s)`` at ``4*(l*S + s)``; then the codes
    (fp8: one byte per element ``q = ((l*S + s)*N + t)*E + e``; nvfp4: element ``q`` in byte
    ``q // 2``, low nibble when ``e`` is even, then the group scale bytes ``r*E/16 + g`` from
    ``4*L*S + L*N*C/2``); zeros to ``chunk_bytes``.
    ``scale`` (pack only): float32 on the device, ``sigma(l, s)`` of chunk ``k`` at element
    ``l*scale_strides[0] + s*scale_strides[1] + k*scale_strides[2]`` from ``scale_offset``
    elements past ``scale.data_ptr()`` (broadcast dims have stride 0; the offset includes hc(0)).
    """

    direction: str                 # "pack" or "unpack"
    page_format: str               # "fp8_e4m3", "fp8_e5m2" or "nvfp4"
    caches: tuple[Side, ...]
    cache_dtype: torch.dtype       # float16, bfloat16 or float32 (one dtype for every layer)
    pages: Side
    heads: int                     # K = head count moved
    layers: int                    # L
    parts: int                     # S (kv_split)
    tokens: int                    # N
    row_elems: int                 # C
    chunk_bytes: int               # hb
    scale: torch.Tensor | None = None
    scale_strides: tuple[int, int, int] = (0, 0, 0)
    scale_offset: int = 0

    @property
    def part_elems(self) -> int:
        """E = C / S."""
        return self.row_elems // self.parts

    def code_align(self) -> int:
        """The alignment the aligned page kernels rely on, 0 where they cannot run: every group
        whole (``E % 16 == 0``), every layer's parts dense (element stride the element size)
        with their first element and every byte stride that moves an address (block; head where
        ``K > 1``; token where ``N > 1``) multiples of 16, so each group's cache bytes are one
        16-byte aligned run, and the page's chunks starting 16-byte aligned (its first byte, the
        row stride where there are two rows or more, ``hb``); then the alignment of every
        group's codes: the largest power of two dividing ``4*L*S`` (their offset in the chunk),
        at most a group's code bytes (16 fp8, 8 nvfp4). A stride of a dim of one index never
        moves an address and is not counted (as for copies)."""
        if self.part_elems % 16:
            return 0
        for side in self.caches:
            sb, sh, st, sc = side.strides
            moving = (sb if side.blocks > 1 else 0, sh if self.heads > 1 else 0,
                      st if self.tokens > 1 else 0)
            if sc != self.cache_dtype.itemsize or (side.ptr | _or(moving)) % 16:
                return 0
        prs = self.pages.strides[0] if self.pages.blocks > 1 else 0
        if (self.pages.ptr | prs | self.chunk_bytes) % 16:
            return 0
        most = 8 if self.page_format == "nvfp4" else 16
        codes_at = 4 * self.layers * self.parts
        return min(most, codes_at & -codes_at)

    def layer_runs(self, most: int, joins: Callable[[Side, Side], bool] | None = None
                   ) -> tuple[tuple[int, int], ...]:
        """The layers as runs ``(first layer, count)`` of at most ``most`` consecutive layers
        whose caches have the strides of their run's first (one launch of a page kernel each:
        the strides are its constants, the layers' addresses its slots); ``joins(first, side)``,
        where given, must hold too (an implementation's own limit on a run's addresses)."""
        return consecutive_runs(self.caches, most, lambda first, side: (
            side.strides == first.strides and (joins is None or joins(first, side))))


def consecutive_runs(items: Sequence, most: int, joins: Callable[[object, object], bool]
                     ) -> tuple[tuple[int, int], ...]:
    """``items`` as runs ``(first index, count)`` of at most ``most`` consecutive items, each
    item in its run's where ``joins(run's first item, item)``: the launches of a page kernel's
    layers (:meth:`PageJob.layer_runs`) and of a group of copy jobs (their storages the first
    job's pointers reach)."""
    runs: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        if runs:
            first, n = runs[-1]
            if n < most and joins(items[first], item):
                runs[-1] = (first, n + 1)
                continue
        runs.append((i, 1))
    return tuple(runs)


def _or(values) -> int:
    """The bitwise or of integers (an alignment test of all of them at once)."""
    out = 0
    for v in values:
        out |= v
    return out


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """A validated transfer: what every implementation's ``run(plan)`` reads.

    ``mapping``: the ``[n, 2]`` block mapping where the kernels read it (on ``device``, int32
    or int64, any strides: column 0 the source id, 1 the destination's, as the caller gave it);
    ``host_mapping``: the caller's CPU mapping (None for a GPU mapping), already checked (ids in
    range, distinct destinations). ``device``: the GPU of the call (None: both sides on the host;
    a call across two GPUs: the destination's, where its work runs). ``peer``: the source's GPU
    of a call across two GPUs (the kernels read it through peer addressing), else None.
    ``args``: the op's validated arguments by name (what the torch reference reads: it works on
    the tensors, not on the jobs).
    """

    op: str
    jobs: tuple[CopyJob, ...]
    page_job: PageJob | None
    mapping: torch.Tensor
    host_mapping: torch.Tensor | None
    pairs: int                      # n
    device: torch.device | None
    max_ctas: int | None
    engine: str                     # as requested: "auto", "sm" or "ce" (the op resolves it)
    args: dict
    peer: torch.device | None = None

    @property
    def early_trigger(self) -> bool:
        """Whether the call's kernels may let the next kernel of the stream be scheduled before
        they finish (programmatic dependent launch's early trigger): not under an SM budget
        (``max_ctas``). A triggered launch's CTAs are resident while they wait for the one before
        it, and each of them triggers the next at its start, so a call of many launches (Triton's,
        a launch per job) would hold up to every launch's CTAs at once, far beyond the budget,
        keeping a concurrent kernel off those SMs. Both implementations ask this."""
        return self.max_ctas is None


# --- the page: its size (SPEC §9.4) ---------------------------------------------------------------

# Cache dtypes the quantized page formats read (pack) and write (unpack).
QUANTIZED_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NVFP4_GROUP = 16  # elements per E4M3 scale byte (SPEC §6.1)


def parse_page_format(page_format) -> str:
    """The canonical name of a page format (:data:`PAGE_FORMATS`); ValueError naming
    ``page_format`` otherwise."""
    if not isinstance(page_format, str) or page_format not in PAGE_FORMATS:
        raise ValueError(f"page_format: expected one of {sorted(PAGE_FORMATS)}, got "
                         f"{page_format!r}")
    return PAGE_FORMATS[page_format]


def check_kv_split(kv_split, row_width: int, row_name: str = "C") -> int:
    """``kv_split`` S as an int >= 1 dividing the row width ``C``."""
    s = check_int("kv_split", kv_split, 1)
    if row_width % s:
        raise ValueError(f"kv_split: expected an int dividing {row_name} = {row_width}, got {s}")
    return s


def _check_quantized(fmt: str, dtype: torch.dtype, dtype_name: str, part_elems: int) -> None:
    if fmt == "raw":
        return
    if dtype not in QUANTIZED_CACHE_DTYPES:
        raise ValueError(f"{dtype_name}: page_format={fmt!r} expects caches of dtype "
                         f"torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    if fmt == "nvfp4" and part_elems % NVFP4_GROUP:
        raise ValueError(f"page_format: 'nvfp4' expects E = C / kv_split a multiple of "
                         f"{NVFP4_GROUP}, got E = {part_elems}")


def chunk_bytes(page_format: str, layers: int, parts: int, tokens: int, row_elems: int,
                elem_bytes: int) -> int:
    """``hb``: the bytes of one head chunk of a page (SPEC §9.4's table; ``page_format``
    canonical, arguments already validated)."""
    L, S, N, C = layers, parts, tokens, row_elems
    if page_format == "raw":
        return L * N * C * elem_bytes
    if page_format in ("fp8_e4m3", "fp8_e5m2"):
        return 16 * -(-(4 * L * S + L * N * C) // 16)
    return 16 * -(-(4 * L * S + L * N * C // 2 + L * N * C // NVFP4_GROUP) // 16)


def kv_page_bytes(num_layers, num_heads, block_size, row_width, dtype, *, kv_split=1,
                  page_format="raw") -> int:
    """``P``, the bytes of one transfer page (SPEC §9.4): ``num_heads`` head chunks of ``hb``
    bytes, each holding one block of ``num_layers`` layers of ``block_size`` tokens of
    ``row_width`` elements of ``dtype`` (the caches' dtype) in ``page_format``."""
    L = check_int("num_layers", num_layers, 1)
    H = check_int("num_heads", num_heads, 1)
    N = check_int("block_size", block_size, 1)
    C = check_int("row_width", row_width, 1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    fmt = parse_page_format(page_format)
    S = check_kv_split(kv_split, C, "row_width")
    _check_quantized(fmt, dtype, "dtype", C // S)
    es = torch.empty(0, dtype=dtype).element_size()
    return H * chunk_bytes(fmt, L, S, N, C, es)


# --- validation every transfer op shares (SPEC §9.1, §9.5) ---------------------------------------

def check_max_ctas(max_ctas) -> int | None:
    if max_ctas is None:
        return None
    if isinstance(max_ctas, bool) or not isinstance(max_ctas, int):
        raise TypeError(f"max_ctas: expected None or an int >= 1, got "
                        f"{type(max_ctas).__name__}")
    if max_ctas < 1:
        raise ValueError(f"max_ctas: expected None or an int >= 1, got {max_ctas}")
    return int(max_ctas)


def check_engine(engine) -> str:
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine: expected one of {list(ENGINES)}, got {engine!r}")
    return engine


def check_mapping(mapping, name: str = "block_mapping") -> int:
    """``mapping``: an ``[n, 2]`` int32/int64 tensor, any strides; returns n."""
    require_tensor(name, mapping)
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2], got {shape_str(mapping)}")
    if mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected dtype int64 or int32, got {mapping.dtype}")
    return mapping.shape[0]


def check_head_range(head_range, heads: Sequence[tuple[str, int]]) -> tuple[list[int], int]:
    """SPEC §9.3's rule for the head counts ``heads`` ((name, H) of each side): returns each
    side's first head and K, the heads moved. None: every side has one H, every head."""
    if head_range is None:
        (first, h), *rest = heads
        for name, other in rest:
            if other != h:
                raise ValueError(f"{name}: expected {h} heads (those of {first}; or pass "
                                 f"head_range), got {other}")
        return [0] * len(heads), h
    if (not isinstance(head_range, (tuple, list)) or len(head_range) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in head_range)):
        raise TypeError(f"head_range: expected None or two Python ints (h0, h1), got "
                        f"{head_range!r}")
    h0, h1 = int(head_range[0]), int(head_range[1])
    if not 0 <= h0 < h1:
        raise ValueError(f"head_range: expected 0 <= h0 < h1, got ({h0}, {h1})")
    k = h1 - h0
    firsts = []
    for name, h in heads:
        if h == k:
            firsts.append(0)       # the side holding the slice, indexed by k
        elif h >= h1:
            firsts.append(h0)      # a full side, indexed by h0 + k
        else:
            raise ValueError(f"head_range: ({h0}, {h1}) expects {name} with {k} heads (the "
                             f"slice) or at least {h1} (full), got {h}")
    return firsts, k


def _view_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same view: device, dtype, address, shape and strides."""
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage, offset, dtype, shape and strides (SPEC §9.2's in-place form)."""
    return _view_key(a) == _view_key(b)


def call_device(sides: Sequence[tuple[str, torch.Tensor]]) -> torch.device | None:
    """The GPU of a call whose tensors are ``sides`` ((name, tensor)) that runs on one GPU, or
    None where all are in host memory: :func:`call_devices` with every tensor a source and no
    peer (SPEC §9.1)."""
    return call_devices(sides, (), one_gpu="one GPU per call")[0]


def call_devices(sources: Sequence[tuple[str, torch.Tensor]],
                 destinations: Sequence[tuple[str, torch.Tensor]], *,
                 one_gpu: str | None = None) -> tuple[torch.device | None, torch.device | None]:
    """(the call's device, its peer): where a transfer's work runs and the other GPU it reads.

    ``sources``, ``destinations``: (name, tensor) of every tensor of each side (and of tensors
    read where a side is). The call's device is their GPU, or None where all are in host memory;
    the peer is None but for a call across two GPUs of the host (refused where ``one_gpu``, the
    reason an op takes one GPU, is given): the sources on one GPU, the destinations on
    another that can access it as a peer (NVLink or PCIe P2P). Such a call runs on the
    DESTINATION's device, which reads the source through peer addressing; its mapping lies on
    the host or on that device.

    Refused (ValueError naming the argument, before anything is enqueued): meta tensors,
    devices other than CUDA and the host, pageable host memory beside a GPU, two GPUs where the
    op takes one, three GPUs, a side on both GPUs, host memory beside two GPUs, two GPUs
    without peer access (naming the source)."""
    gpus: dict[torch.device, str] = {}
    named = [*sources, *destinations]
    for name, t in named:
        if t.device.type == "meta":
            raise ValueError(f"{name}: expected a tensor with memory (a CUDA device or the "
                             f"host), got a meta tensor")
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: expected a CUDA device or host memory, got {t.device}")
        if t.device.type == "cuda" and t.device not in gpus:
            if gpus and one_gpu is not None:
                (first, dev), = ((n, d) for d, n in gpus.items())
                raise ValueError(f"{name}: expected the device of {first} ({dev}) or pinned "
                                 f"host memory ({one_gpu}), got {t.device}")
            if len(gpus) == 2:
                listed = " and ".join(f"{d} ({n})" for d, n in gpus.items())
                raise ValueError(f"{name}: expected the device of the sources or of the "
                                 f"destinations ({listed}: at most two GPUs a call), got "
                                 f"{t.device}")
            gpus[t.device] = name
    if not gpus:
        return None, None
    if len(gpus) == 1:
        (device, first), = gpus.items()
        for name, t in named:
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError(f"{name}: expected pinned host memory (pin_memory=True or "
                                 f"cudaHostRegister) beside a GPU side ({first} on {device}), "
                                 f"got pageable host memory")
        return device, None
    # Two GPUs: one side's each (a side on both GPUs and host memory beside them are refused).
    src_name, src_dev = next(((n, t.device) for n, t in sources if t.device.type == "cuda"),
                             (None, None))
    dst_name, dst_dev = next(((n, t.device) for n, t in destinations if t.device.type == "cuda"),
                             (None, None))
    for side, (first, dev) in ((sources, (src_name, src_dev)), (destinations, (dst_name, dst_dev))):
        for name, t in side:
            if t.device.type == "cpu":
                raise ValueError(f"{name}: expected a GPU (a call across two GPUs, {src_dev} "
                                 f"and {dst_dev}, takes no host memory), got "
                                 f"{'pinned' if t.is_pinned() else 'pageable'} host memory")
            if dev is not None and t.device != dev:
                raise ValueError(f"{name}: expected the device of {first} ({dev}): a call "
                                 f"across two GPUs has its sources on one and its destinations "
                                 f"on the other, got {t.device}")
    if src_dev is None or dst_dev is None:  # unreachable: the loops above name the tensor
        raise ValueError(f"{src_name or dst_name}: expected the sources on one GPU and the "
                         f"destinations on the other")
    if not _can_access_peer(dst_dev.index, src_dev.index):
        raise ValueError(f"{src_name}: expected a GPU that {dst_dev} (the device of "
                         f"{dst_name}) can access as a peer, got {src_dev}: peer access "
                         f"between {src_dev} and {dst_dev} is unavailable")
    return dst_dev, src_dev


@functools.cache
def _can_access_peer(device: int, peer: int) -> bool:
    """Whether GPU ``device``'s kernels can address GPU ``peer``'s memory (cudaDeviceCanAccessPeer:
    NVLink or PCIe P2P between two GPUs of the host)."""
    return torch.cuda.can_device_access_peer(device, peer)


def check_mapping_device(mapping: torch.Tensor, device: torch.device | None,
                         peer: torch.device | None = None, name: str = "block_mapping") -> None:
    """A mapping lies on the host, or on the call's GPU (``device``; a call across two GPUs:
    the destination's, ``peer`` the source's)."""
    if mapping.device.type == "cpu":
        return
    if device is None or mapping.device != device:
        where = "host memory" if device is None else f"host memory or {device}"
        why = ("the destination's device: a call across two GPUs runs there" if peer is not None
               else "that of the sides")
        raise ValueError(f"{name}: expected {where} ({why}), got {mapping.device}")


def check_host_mapping(mapping: torch.Tensor, sources: Sequence[tuple[str, int]],
                       destinations: Sequence[tuple[str, int]], in_place: bool,
                       name: str = "block_mapping") -> None:
    """A CPU mapping, read now (SPEC §9.1): every source id below the block count of every
    source (``(name, blocks)``), every destination id below that of every destination, distinct
    destination ids; ``in_place``: no id both a source and a destination."""
    if mapping.shape[0] == 0:
        return
    # Plain Python over the ids: a few small torch ops would cost more host time than the copy.
    rows = mapping.tolist()
    for col, side in ((0, sources), (1, destinations)):
        ids = [r[col] for r in rows]
        lo, hi = min(ids), max(ids)
        for side_name, blocks in side:
            if lo < 0 or hi >= blocks:
                at = next(i for i, v in enumerate(ids) if v < 0 or v >= blocks)
                raise ValueError(f"{name}: expected ids in [0, {blocks}) in column {col} (the "
                                 f"block count of {side_name}), got {ids[at]} at row {at}")
    dst = [r[1] for r in rows]
    seen: set[int] = set()
    for i in dst:
        if i in seen:
            raise ValueError(f"{name}: expected distinct destination ids (column 1), got id {i} "
                             f"{dst.count(i)} times")
        seen.add(i)
    if in_place:
        both = [r[0] for r in rows if r[0] in seen]
        if both:
            raise ValueError(f"{name}: expected no id both a source and a destination (src and "
                             f"dst are the same view), got {both[0]}")


def check_destinations(destinations: Sequence[tuple[str, torch.Tensor]],
                       sources: Sequence[tuple[str, torch.Tensor]],
                       others: Sequence[tuple[str, torch.Tensor | None]] = ()) -> bool:
    """SPEC §9.5's rules on what a call writes: no destination with a zero stride over a dim of
    size > 1 or requiring grad, no two destinations the same view, and no input (``sources``,
    ``others``: the mapping, scale) sharing memory with a destination, unless every source is
    the same view as its destination (``sources[i]`` pairs with ``destinations[i]``; returns
    whether that in-place form holds). Overlaps between distinct destination views are not
    checked (their result is undefined)."""
    for name, t in destinations:
        for size, st in zip(t.shape, t.stride(), strict=True):
            if size > 1 and st == 0:
                raise ValueError(f"{name}: expected every element in its own memory, got stride "
                                 f"0 over a dim of size {size} (strides {tuple(t.stride())}, "
                                 f"shape {shape_str(t)})")
        if t.requires_grad:
            raise ValueError(f"{name}: expected a tensor that does not require grad (it is "
                             f"written in place), got requires_grad=True")
    views: dict[tuple, str] = {}
    for name, t in destinations:
        key = _view_key(t)
        if key in views:
            raise ValueError(f"{name}: expected a destination apart from {views[key]}, got the "
                             f"same view")
        views[key] = name
    in_place = len(sources) == len(destinations) and all(
        same_view(s, d) for (_, s), (_, d) in zip(sources, destinations, strict=True))
    inputs = [(n, t) for n, t in (others if in_place else (*sources, *others)) if t is not None]
    # Only inputs whose allocation meets a destination's can share memory with it: the byte
    # geometry is compared for those alone (a multi-layer call has 2L tensors: all pairs would
    # cost milliseconds of host time per call).
    spans = [(n, t, _span(t)) for n, t in inputs]
    for dst in destinations:
        lo, hi, dev = _span(dst[1])
        near = [(n, t) for n, t, (a, b, d) in spans if d == dev and a < hi and lo < b]
        check_mutation_safe(outputs=(dst,), inputs=near)
    return in_place


def _span(t: torch.Tensor) -> tuple[int, int, torch.device]:
    """The byte range of ``t``'s allocation and its device."""
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes(), t.device


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream of ``device`` (None: the current device) is being captured
    into a graph; False for a host device. A call's device need not be the current one (a call
    across two GPUs runs on its destination's)."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return False
    if device is None or device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device.index):
        return torch.cuda.is_current_stream_capturing()


def _mapping_plan(mapping: torch.Tensor, device: torch.device | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the mapping where the kernels read it, the caller's host mapping or None). A CPU mapping
    beside a GPU side is copied to that GPU through pinned memory (non_blocking: no host sync);
    under graph capture it is refused (its checks and values would be frozen into the graph)."""
    if mapping.device.type != "cpu":
        return mapping, None
    if device is None:
        return mapping, mapping
    if capturing(device):
        raise ValueError("block_mapping: expected a mapping on the GPU under CUDA graph capture "
                         "(a CPU mapping's checks and values would be frozen into the graph), "
                         "got a CPU tensor")
    # One contiguous pinned copy (a strided one would make .to() stage through pageable memory).
    staged = torch.empty(tuple(mapping.shape), dtype=mapping.dtype, pin_memory=True)
    staged.copy_(mapping)
    return staged.to(device, non_blocking=True), mapping


def _check_common(max_ctas, engine, quantized: bool, mapping: torch.Tensor) -> tuple:
    max_ctas = check_max_ctas(max_ctas)
    engine = check_engine(engine)
    if engine == "ce" and quantized:
        raise ValueError("engine: 'ce' copies raw bytes only: expected 'auto' or 'sm' with a "
                         "quantized page_format, got 'ce'")
    if engine == "ce" and mapping.device.type != "cpu":
        raise ValueError(f"engine: 'ce' reads the mapping on the host: expected 'auto' or 'sm' "
                         f"with a mapping on {mapping.device}, got 'ce'")
    return max_ctas, engine


# --- coalescing ------------------------------------------------------------------------------------

_Dim = tuple[int, int, int]  # (size, src stride, dst stride), bytes


def coalesce(dims: Sequence[_Dim], elem_bytes: int) -> list[_Dim]:
    """The dims of a copy (outermost first) with size-1 dims dropped, reordered outermost by the
    destination's stride (any order copies the same elements: each goes to its own index), and
    merged from the inside out wherever both sides are dense across a pair (outer stride ==
    inner size * inner stride on both sides). An innermost dim dense on both sides stays a dim of
    ``elem_bytes`` elements (the kernel picks the vector width)."""
    kept = sorted((d for d in dims if d[0] != 1), key=lambda d: (d[2], d[1]), reverse=True)
    out: list[_Dim] = []
    for d in reversed(kept):  # innermost first
        if out and d[1] == out[-1][0] * out[-1][1] and d[2] == out[-1][0] * out[-1][2]:
            n, s, t = out[-1]
            out[-1] = (n * d[0], s, t)
        else:
            out.append(d)
    return list(reversed(out))


def _jobs(src: torch.Tensor, dst: torch.Tensor, dims: Sequence[_Dim], es: int,
          src_offset: int = 0, dst_offset: int = 0) -> list[CopyJob]:
    """The coalesced CopyJobs of one (src, dst) pair of ``es``-byte elements whose block steps
    are the tensors' stride(0) and whose other dims are ``dims`` ((size, src stride, dst stride)
    in bytes); more than three dims after coalescing: one job per index of the outer ones (their
    offsets added)."""
    if any(n == 0 for n, _, _ in dims):
        return []
    c = coalesce(dims, es)
    outer, inner = c[:-3] if len(c) > 3 else [], c[-3:]
    inner = [(1, 0, 0)] * (3 - len(inner)) + inner
    if inner[2][0] == 1:  # a single element
        inner[2] = (1, es, es)
    sb, db = src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size()
    jobs = []
    for idx in itertools.product(*(range(n) for n, _, _ in outer)):
        so = src_offset + sum(i * s for i, (_, s, _) in zip(idx, outer, strict=True))
        do = dst_offset + sum(i * d for i, (_, _, d) in zip(idx, outer, strict=True))
        s = Side(src, so, (sb, inner[0][1], inner[1][1], inner[2][1]), src.shape[0])
        d = Side(dst, do, (db, inner[0][2], inner[1][2], inner[2][2]), dst.shape[0])
        jobs.append(CopyJob(s, d, inner[0][0], inner[1][0], inner[2][0], es))
    return jobs


def _plan(op: str, jobs, page_job, mapping, devices, max_ctas, engine, args,
          cache: _Miss | None = None, checks=None) -> TransferPlan:
    """The plan of a validated call (``devices``: (the call's device, its peer)). ``cache`` (a
    call whose plan may be reused, :func:`_cached`): its geometry is remembered (``checks()``:
    what a reuse must still check) and the plan is made from that record, as every later call
    with the same tensors makes it."""
    jobs = _shared_block_counts(jobs)
    device, peer = devices
    if cache is not None:
        recipe = _Recipe.of(cache, op, jobs, page_job, device, peer, args, checks())
        _remember(cache.key, recipe)
        return recipe.plan(cache.tensors, mapping, max_ctas, engine)
    kernel_mapping, host_mapping = _mapping_plan(mapping, device)
    return TransferPlan(op=op, jobs=tuple(jobs), page_job=page_job, mapping=kernel_mapping,
                        host_mapping=host_mapping, pairs=mapping.shape[0], device=device,
                        max_ctas=max_ctas, engine=engine, args=args, peer=peer)


def _shared_block_counts(jobs):
    """``jobs`` with each side's block count the least over the jobs (SPEC §9.1: a GPU mapping's
    pair with an id out of range of any tensor of its side is skipped whole, as the reference
    and the page kernels skip it; the copy kernels check a job's own count)."""
    if not jobs:
        return jobs
    src = min(j.src.blocks for j in jobs)
    dst = min(j.dst.blocks for j in jobs)
    if all(j.src.blocks == src and j.dst.blocks == dst for j in jobs):
        return jobs
    return [dataclasses.replace(j, src=dataclasses.replace(j.src, blocks=src),
                                dst=dataclasses.replace(j.dst, blocks=dst)) for j in jobs]


# --- the plan cache --------------------------------------------------------------------------------
#
# vLLM-style offloading calls a transfer op every step with the same cache tensors and a new small
# mapping: validating and planning 2L tensors costs far more host time than the copy. A call's
# geometry (jobs, page job, device, in-place form, the block counts its CPU mapping is checked
# against) depends only on its tensors (identity, address, shape, strides, storage offset, dtype,
# device, requires_grad), the grad and inference modes and its other arguments, so it is kept,
# keyed on exactly those, for a few calls (LRU). A hit still checks, as a miss would and in the
# same order, everything else: the mapping (form, device, its values where it is on the host, its
# memory against the destinations'), max_ctas and engine. The record holds weak references only
# (never a tensor: a cached call keeps no memory alive) and the hit's plan is made from the call's
# own tensors by the same code that makes a miss's, so a hit returns the plan a miss would.
# Assumed fixed for an allocation: whether host memory is pinned (a tensor whose memory is
# unregistered with cudaHostUnregister in place must not be passed again).

PLAN_CACHE_SIZE = 8
_PLANS: OrderedDict[tuple, _Recipe] = OrderedDict()   # least recently used first
_PLANS_LOCK = threading.Lock()


class _Keyed(tuple):
    """A tuple (a plan's ``jobs``, a page job's ``caches``) carrying ``launch_key``: an object
    (compared by identity) that is the same for every plan made from one cached record, so the
    launchers may memoize their per-call planning on it."""

    launch_key: object = None


@dataclasses.dataclass(frozen=True)
class _Miss:
    """A call that may be cached: its key and its tensors in key order."""

    key: tuple
    view: tuple
    tensors: tuple


@dataclasses.dataclass(frozen=True)
class _Checks:
    """What a reuse checks per call beyond the mapping's form, max_ctas and engine."""

    quantized: bool
    sources: list                     # (name, blocks) of check_host_mapping
    destinations: list
    in_place: bool
    spans: list                       # (lo, hi, device) of every destination's allocation


def _blocks(named) -> list[tuple[str, int]]:
    return [(n, t.shape[0]) for n, t in named]


def _spans(named) -> list:
    return [_span(t) for _, t in named]


def _key(head: tuple, tensors) -> _Miss | None:
    """The cache key of a call: ``head`` (its non-tensor arguments, already of plain types), the
    modes and the identity of every tensor (what the cache is indexed by: cheap to hash), and
    ``view``, every tensor's view (compared on a hit); None where the call is not cached (not
    plain strided tensors)."""
    # Subclasses (fake tensors under torch.compile, parameters) and tensors without an address
    # (sparse layouts) take the full path every time.
    if {*map(type, tensors)} != {torch.Tensor}:
        return None
    try:
        view = tuple([(t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device,
                       t.requires_grad) for t in tensors])
    except RuntimeError:
        return None
    ids = tuple(map(id, tensors))
    key = (head, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), ids)
    return _Miss(key, view, tuple(tensors))


class _Recipe:
    """A cached call: its plan with every tensor replaced by its index in the key's tensors."""

    __slots__ = ("view", "refs", "op", "jobs", "page", "device", "peer", "args", "checks")

    @classmethod
    def of(cls, miss: _Miss, op, jobs, page_job, device, peer, args, checks: _Checks
           ) -> _Recipe:
        r = cls()
        index: dict[int, int] = {}
        for i, t in enumerate(miss.tensors):
            index.setdefault(id(t), i)

        def side(x: Side) -> tuple[int, dict]:
            return index[id(x.tensor)], {**vars(x), "tensor": None}

        def arg(v):
            if isinstance(v, torch.Tensor):
                return 1, index[id(v)]
            if isinstance(v, tuple) and v and all(isinstance(x, torch.Tensor) for x in v):
                return 2, tuple(index[id(x)] for x in v)
            return 0, v

        r.view = miss.view
        r.refs = tuple(weakref.ref(t) for t in miss.tensors)
        r.op, r.device, r.peer, r.checks = op, device, peer, checks
        r.jobs = tuple((*side(j.src), *side(j.dst), {**vars(j), "src": None, "dst": None})
                       for j in jobs)
        r.page = None
        if page_job is not None:
            fields = {f.name: getattr(page_job, f.name) for f in dataclasses.fields(page_job)}
            fields["caches"] = tuple(side(x) for x in page_job.caches)
            fields["pages"] = side(page_job.pages)
            fields["scale"] = None if page_job.scale is None else index[id(page_job.scale)]
            r.page = fields
        r.args = tuple((name, *arg(v)) for name, v in args.items())
        return r

    def plan(self, tensors, mapping, max_ctas, engine) -> TransferPlan:
        """The plan of a call with ``tensors`` (those of the key), validated ``max_ctas`` and
        ``engine`` and a checked ``mapping``.

        Its Sides and CopyJobs are made as their constructors would (each field set, the
        tensors those of this call) without running them: a multi-layer call makes 3L of them
        per call, and a frozen dataclass's __init__ costs twice the host time. Neither class has
        a __post_init__ or __slots__ (test_transfer's plan-cache tests compare with a miss)."""
        new = object.__new__
        jobs = _Keyed(self._jobs(tensors, new))
        jobs.launch_key = self
        page_job = None
        if self.page is not None:
            p = self.page
            caches = _Keyed(_side(new, tensors, i, f) for i, f in p["caches"])
            caches.launch_key = self
            page_job = PageJob(**{**p, "caches": caches, "pages": _side(new, tensors, *p["pages"]),
                                  "scale": None if p["scale"] is None else tensors[p["scale"]]})
        args = {}
        for name, kind, v in self.args:
            args[name] = (v if kind == 0 else tensors[v] if kind == 1
                          else tuple(tensors[i] for i in v))
        kernel_mapping, host_mapping = _mapping_plan(mapping, self.device)
        return TransferPlan(op=self.op, jobs=jobs, page_job=page_job, mapping=kernel_mapping,
                            host_mapping=host_mapping, pairs=mapping.shape[0], device=self.device,
                            max_ctas=max_ctas, engine=engine, args=args, peer=self.peer)

    def _jobs(self, tensors, new):
        for si, sf, di, df, jf in self.jobs:
            s = new(Side)
            f = s.__dict__
            f.update(sf)
            f["tensor"] = tensors[si]
            d = new(Side)
            f = d.__dict__
            f.update(df)
            f["tensor"] = tensors[di]
            j = new(CopyJob)
            f = j.__dict__
            f.update(jf)
            f["src"], f["dst"] = s, d
            yield j


def _side(new, tensors, i: int, fields: dict) -> Side:
    s = new(Side)
    s.__dict__.update(fields)
    s.__dict__["tensor"] = tensors[i]
    return s


def _remember(key: tuple, recipe: _Recipe) -> None:
    with _PLANS_LOCK:
        _PLANS[key] = recipe
        _PLANS.move_to_end(key)
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)


def _cached(miss: _Miss | None, mapping, max_ctas, engine) -> TransferPlan | None:
    """The plan of a call whose tensors match a cached record, after the checks a miss makes of
    the other arguments (in a miss's order; every tensor check passed when the record was made);
    None: not cached, or the mapping's memory meets a destination's (the full path names it)."""
    if miss is None:
        return None
    recipe = _PLANS.get(miss.key)
    if recipe is None or recipe.view != miss.view or not all(
            r() is t for r, t in zip(recipe.refs, miss.tensors, strict=True)):
        return None
    c = recipe.checks
    check_mapping(mapping)
    check_mapping_device(mapping, recipe.device, recipe.peer)
    max_ctas, engine = _check_common(max_ctas, engine, c.quantized, mapping)
    lo, hi, dev = _span(mapping)
    if any(d == dev and a < hi and lo < b for a, b, d in c.spans):
        return None
    if mapping.device.type == "cpu":
        check_host_mapping(mapping, c.sources, c.destinations, c.in_place)
    with _PLANS_LOCK:  # most recently used last (another thread may have dropped it)
        if miss.key in _PLANS:
            _PLANS.move_to_end(miss.key)
    return recipe.plan(miss.tensors, mapping, max_ctas, engine)


def clear_plan_cache() -> None:
    """Forget every cached plan (tests; a process that unpins host memory in place)."""
    with _PLANS_LOCK:
        _PLANS.clear()


def _listed(value, listed: bool):
    """A side's tensors for the key: ``value`` itself, or the list/tuple's items; None where the
    argument is not of that form (the full path names the error)."""
    if not listed:
        return (value,)
    return tuple(value) if type(value) in (list, tuple) else None


def _plain_ints(*values) -> bool:
    return all(type(v) is int for v in values)


def _head_key(head_range):
    if head_range is None:
        return None
    if type(head_range) in (tuple, list) and len(head_range) == 2 and _plain_ints(*head_range):
        return tuple(head_range)
    return False  # not cached


def _tensors(name: str, value, listed: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a side given as one tensor (``listed`` False) or a list/tuple of L >= 1."""
    if not listed:
        require_tensor(name, value)
        return [(name, value)]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of tensors, got "
                        f"{type(value).__name__}")
    if not value:
        raise ValueError(f"{name}: expected at least one tensor, got none")
    out = [(f"{name}[{i}]", t) for i, t in enumerate(value)]
    for n, t in out:
        require_tensor(n, t)
    return out


def _one_device(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Every tensor of a side's list lies on one device (that of its first)."""
    first, t0 = named[0]
    for name, t in named[1:]:
        if t.device != t0.device:
            raise ValueError(f"{name}: expected device {t0.device} (that of {first}), got "
                             f"{t.device}")


def _validate_sides(src, dst, mapping, max_ctas, engine, quantized=False,
                    one_gpu: str | None = None):
    """Types, the mapping's form, devices and the engine keywords shared by every builder:
    returns ((device, peer device), n, max_ctas, engine). ``one_gpu``: :func:`call_devices`'
    (the reason an op takes one GPU; None: it takes two, a peer call)."""
    n = check_mapping(mapping)
    for side in (src, dst):
        _one_device(side)
    devices = call_devices(src, dst, one_gpu=one_gpu)
    check_mapping_device(mapping, *devices)
    max_ctas, engine = _check_common(max_ctas, engine, quantized, mapping)
    return devices, n, max_ctas, engine


# --- the plan builders -----------------------------------------------------------------------------

def _build_swap(src, dst, block_mapping, *, op: str = "swap_blocks",
                names: tuple[str, str] = ("src", "dst"), listed: bool = False, max_ctas=None,
                engine="auto", cache: _Miss | None = None) -> TransferPlan:
    """Validate and plan :func:`kvwrite.swap_blocks` (one pair, ``listed`` False) or
    :func:`kvwrite.swap_blocks_multi_layer` (two lists, ``listed`` True, ``names`` theirs):
    SPEC §9.2. Jobs: each pair's coalesced copy of its whole block shape (several jobs where more
    than three dims remain). ``args``: ``src``, ``dst`` (tuples)."""
    s = _tensors(names[0], src, listed)
    d = _tensors(names[1], dst, listed)
    if len(s) != len(d):
        raise ValueError(f"{names[1]}: expected {len(s)} tensors (as many as {names[0]}), got "
                         f"{len(d)}")
    for (sn, a), (dn, b) in zip(s, d, strict=True):
        if a.dim() < 1:
            raise ValueError(f"{sn}: expected at least 1 dim [num_blocks, ...], got shape "
                             f"{shape_str(a)}")
        if b.dtype != a.dtype:
            raise ValueError(f"{dn}: expected the dtype of {sn} ({a.dtype}), got {b.dtype}")
        if b.shape[1:] != a.shape[1:]:
            raise ValueError(f"{dn}: expected the block shape of {sn} {tuple(a.shape[1:])}, got "
                             f"{tuple(b.shape[1:])} (shape {shape_str(b)})")
    devices, n, max_ctas, engine = _validate_sides(s, d, block_mapping, max_ctas, engine)
    in_place = check_destinations(d, s, (("block_mapping", block_mapping),))
    if block_mapping.device.type == "cpu":
        check_host_mapping(block_mapping, [(nm, t.shape[0]) for nm, t in s],
                           [(nm, t.shape[0]) for nm, t in d], in_place)
    jobs = []
    for (_, a), (_, b) in zip(s, d, strict=True):
        es = a.element_size()
        jobs += _jobs(a, b, [(size, sa * es, sb * es) for size, sa, sb
                             in zip(a.shape[1:], a.stride()[1:], b.stride()[1:], strict=True)],
                      es)
    args = {"src": tuple(t for _, t in s), "dst": tuple(t for _, t in d)}
    return _plan(op, jobs, None, block_mapping, devices, max_ctas, engine, args, cache,
                 lambda: _Checks(False, _blocks(s), _blocks(d), in_place, _spans(d)))


def _build_swap_bytes(src, dst, block_size_in_bytes, block_mapping, *, max_ctas=None,
                      engine="auto", cache: _Miss | None = None) -> TransferPlan:
    """Validate and plan vLLM's four-argument form of :func:`kvwrite.swap_blocks` (SPEC §9.2):
    block ``i`` is the ``block_size_in_bytes`` bytes ``i * stride(0) * element_size()`` bytes
    after ``data_ptr()``. One job: heads = tokens = 1, elems = block_size_in_bytes bytes.
    ``args``: ``src``, ``dst`` (1-tuples), ``block_size_in_bytes``."""
    require_tensor("src", src)
    require_tensor("dst", dst)
    if isinstance(block_size_in_bytes, bool) or not isinstance(block_size_in_bytes, int):
        raise TypeError(f"block_size_in_bytes: expected an int, got "
                        f"{type(block_size_in_bytes).__name__}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() < 1:
            raise ValueError(f"{name}: expected at least 1 dim [num_blocks, ...], got shape "
                             f"{shape_str(t)}")
    for name, t in (("src", src), ("dst", dst)):
        step = t.stride(0) * t.element_size()
        if not 0 < block_size_in_bytes <= step:
            raise ValueError(f"block_size_in_bytes: expected 0 < block_size_in_bytes <= "
                             f"{name}.stride(0) * element_size() = {step}, got "
                             f"{block_size_in_bytes}")
        if t.shape[0]:
            last = (t.storage_offset() * t.element_size() + (t.shape[0] - 1) * step
                    + block_size_in_bytes)
            if last > t.untyped_storage().nbytes():
                raise ValueError(f"block_size_in_bytes: expected every byte of {name}'s "
                                 f"{t.shape[0]} blocks in its storage ({t.untyped_storage().nbytes()} "
                                 f"bytes), got {block_size_in_bytes} bytes reaching byte {last}")
    s, d = [("src", src)], [("dst", dst)]
    devices, n, max_ctas, engine = _validate_sides(s, d, block_mapping, max_ctas, engine)
    # The destination is its blocks' bytes, whatever its dims: checked as a byte view.
    dst_bytes = byte_blocks(dst, block_size_in_bytes)
    src_bytes = byte_blocks(src, block_size_in_bytes)
    in_place = check_destinations([("dst", dst_bytes)], [("src", src_bytes)],
                                  (("block_mapping", block_mapping),))
    if dst.requires_grad:
        raise ValueError("dst: expected a tensor that does not require grad (it is written in "
                         "place), got requires_grad=True")
    if block_mapping.device.type == "cpu":
        check_host_mapping(block_mapping, [("src", src.shape[0])], [("dst", dst.shape[0])],
                           in_place)
    job = CopyJob(Side(src, 0, (src.stride(0) * src.element_size(), 0, 0, 1), src.shape[0]),
                  Side(dst, 0, (dst.stride(0) * dst.element_size(), 0, 0, 1), dst.shape[0]),
                  1, 1, block_size_in_bytes, 1)
    args = {"src": (src,), "dst": (dst,), "block_size_in_bytes": block_size_in_bytes}
    return _plan("swap_blocks", [job], None, block_mapping, devices, max_ctas, engine, args, cache,
                 lambda: _Checks(False, _blocks(s), _blocks(d), in_place, _spans(d)))


def byte_blocks(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The four-argument form's blocks of ``t`` as a uint8 ``[num_blocks, nbytes]`` view."""
    es = t.element_size()
    storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), 0, (t.untyped_storage().nbytes(),))
    return storage.as_strided((t.shape[0], nbytes), (t.stride(0) * es, 1),
                              t.storage_offset() * es)


def _check_4d(named, what: str) -> None:
    for name, t in named:
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims {what}, got shape {shape_str(t)}")


def _build_relayout(src, dst, block_mapping, head_range=None, *, max_ctas=None,
                    engine="auto", cache: _Miss | None = None) -> TransferPlan:
    """Validate and plan :func:`kvwrite.relayout_kv_cache` (SPEC §9.3): ``src``/``dst`` 4-D
    ``(num_blocks, H, N, C)`` views or two lists of them. Jobs: one per layer, dims (K heads,
    N, C), coalesced. ``args``: ``src``, ``dst`` (tuples), ``src_head``, ``dst_head`` (first
    head of each side), ``heads`` (K)."""
    listed = not isinstance(src, torch.Tensor)
    s = _tensors("src", src, listed)
    d = _tensors("dst", dst, listed)
    if len(s) != len(d):
        raise ValueError(f"dst: expected {len(s)} tensors (as many as src), got {len(d)}")
    _check_4d(s, "(num_blocks, H, N, C)")
    _check_4d(d, "(num_blocks, H, N, C)")
    (sn0, a0), (dn0, _) = s[0], d[0]
    for name, t in [*s[1:], *d]:
        if t.dtype != a0.dtype:
            raise ValueError(f"{name}: expected the dtype of {sn0} ({a0.dtype}), got {t.dtype}")
    for (sn, a), (dn, b) in zip(s, d, strict=True):
        if b.shape[2:] != a.shape[2:]:
            raise ValueError(f"{dn}: expected the N and C of {sn} {tuple(a.shape[2:])}, got "
                             f"{tuple(b.shape[2:])}")
    firsts, k = None, None
    for (sn, a), (dn, b) in zip(s, d, strict=True):
        f, kk = check_head_range(head_range, [(sn, a.shape[1]), (dn, b.shape[1])])
        if firsts is not None and (f, kk) != (firsts, k):
            raise ValueError(f"{sn}: expected the head counts of {sn0} and {dn0} for every "
                             f"layer, got {a.shape[1]} and {b.shape[1]}")
        firsts, k = f, kk
    devices, n, max_ctas, engine = _validate_sides(s, d, block_mapping, max_ctas, engine)
    in_place = check_destinations(d, s, (("block_mapping", block_mapping),))
    if block_mapping.device.type == "cpu":
        check_host_mapping(block_mapping, [(nm, t.shape[0]) for nm, t in s],
                           [(nm, t.shape[0]) for nm, t in d], in_place)
    hs, hd = firsts
    jobs = []
    for (_, a), (_, b) in zip(s, d, strict=True):
        es = a.element_size()
        dims = [(k, a.stride(1) * es, b.stride(1) * es)] + [
            (size, sa * es, sb * es) for size, sa, sb
            in zip(a.shape[2:], a.stride()[2:], b.stride()[2:], strict=True)]
        jobs += _jobs(a, b, dims, es, hs * a.stride(1) * es, hd * b.stride(1) * es)
    args = {"src": tuple(t for _, t in s), "dst": tuple(t for _, t in d), "src_head": hs,
            "dst_head": hd, "heads": k}
    return _plan("relayout_kv_cache", jobs, None, block_mapping, devices, max_ctas, engine, args,
                 cache, lambda: _Checks(False, _blocks(s), _blocks(d), in_place, _spans(d)))


def _page_geometry(caches_named, pages, kv_split, head_range, page_format):
    """What pack and unpack share: (fmt, S, hb, cache first head, page first head, K)."""
    _check_4d(caches_named, "(num_blocks, H_c, N, C)")
    first, c0 = caches_named[0]
    for name, t in caches_named[1:]:
        if t.dtype != c0.dtype:
            raise ValueError(f"{name}: expected the dtype of {first} ({c0.dtype}), got {t.dtype}")
        if t.shape[1:] != c0.shape[1:]:
            raise ValueError(f"{name}: expected the H_c, N, C of {first} {tuple(c0.shape[1:])}, "
                             f"got {tuple(t.shape[1:])}")
    fmt = parse_page_format(page_format)
    L = len(caches_named)
    _, Hc, N, C = c0.shape
    S = check_kv_split(kv_split, C)
    _check_quantized(fmt, c0.dtype, first, C // S)
    require_tensor("pages", pages)
    if pages.dtype != torch.uint8:
        raise ValueError(f"pages: expected dtype uint8, got {pages.dtype}")
    if pages.dim() != 2:
        raise ValueError(f"pages: expected 2 dims [num_pages, P], got shape {shape_str(pages)}")
    P = pages.shape[1]
    if P > 1 and pages.stride(1) != 1:
        raise ValueError(f"pages: expected a unit last stride, got strides {tuple(pages.stride())}")
    if pages.shape[0] > 1 and pages.stride(0) < P:
        raise ValueError(f"pages: expected a row stride >= P = {P}, got strides "
                         f"{tuple(pages.stride())}")
    hb = chunk_bytes(fmt, L, S, N, C, c0.element_size())
    if P == 0 or P % hb:
        raise ValueError(f"pages: expected P a positive multiple of the head chunk "
                         f"({hb} bytes for page_format={fmt!r}, L={L}, kv_split={S}, N={N}, "
                         f"C={C}), got P = {P}")
    (hc, hp), k = check_head_range(head_range, [(first, Hc), ("pages", P // hb)])
    return fmt, S, hb, hc, hp, k


def _scale_strides(scale, L, S, Hc, hc, device_of: torch.Tensor, device):
    """``scale``: float32, broadcastable to [L, S, H_c], on the caches' device (pinned there
    when that is the host beside a GPU: the kernels read it)."""
    require_tensor("scale", scale)
    if scale.dtype != torch.float32:
        raise ValueError(f"scale: expected dtype float32, got {scale.dtype}")
    if scale.device != device_of.device:
        raise ValueError(f"scale: expected device {device_of.device} (that of the caches), got "
                         f"{scale.device}")
    if device is not None and scale.device.type == "cpu" and not scale.is_pinned():
        raise ValueError(f"scale: expected pinned host memory (the caches' memory, read by the "
                         f"kernels of {device}), got pageable host memory")
    try:
        b = torch.broadcast_to(scale, (L, S, Hc))
    except RuntimeError:
        raise ValueError(f"scale: expected a shape broadcastable to [L, S, H_c] = "
                         f"[{L}, {S}, {Hc}], got {shape_str(scale)}") from None
    st = tuple(int(x) for x in b.stride())
    return st, hc * st[2]  # elements past scale.data_ptr(): broadcast_to keeps the offset


def _build_pack(caches, pages, block_mapping, *, kv_split=1, head_range=None, page_format="raw",
                scale=None, max_ctas=None, engine="auto", unpack: bool = False,
                cache: _Miss | None = None) -> TransferPlan:
    """Validate and plan :func:`kvwrite.pack_kv_pages` (or, ``unpack``, unpack_kv_pages, whose
    arguments are the same but ``scale``): SPEC §9.4.

    Raw: one CopyJob per layer ``l`` and part ``s`` (caches[l]'s part s, heads hc(k), against
    the pages seen as (row stride, hb, E*es, es) from byte ``hp0*hb + (l*S + s)*N*E*es``);
    quantized: one PageJob. ``args``: ``caches`` (tuple), ``pages``, ``kv_split``,
    ``page_format`` (canonical), ``scale``, ``cache_head``, ``page_head``, ``heads`` (K),
    ``chunk_bytes`` (hb)."""
    c = _tensors("caches", caches, True)
    fmt, S, hb, hc, hp, k = _page_geometry(c, pages, kv_split, head_range, page_format)
    c0 = c[0][1]
    L = len(c)
    _, Hc, N, C = c0.shape
    E = C // S
    quantized = fmt != "raw"
    if unpack:
        src, dst = [("pages", pages)], c
    else:
        src, dst = c, [("pages", pages)]
    extra = []
    if not unpack and scale is not None:
        require_tensor("scale", scale)
        extra = [("scale", scale)]
    elif not unpack and quantized:
        raise ValueError(f"scale: page_format={fmt!r} needs a float32 tensor broadcastable to "
                         f"[L, S, H_c], got None")
    # One GPU a call: pages move between GPUs through a transport (docs/ops/transfer.md).
    op = "unpack_kv_pages" if unpack else "pack_kv_pages"
    devices, n, max_ctas, engine = _validate_sides(
        src, dst, block_mapping, max_ctas, engine, quantized,
        one_gpu=f"one GPU per call of {op}: pages move between GPUs through a transport such "
                f"as torch.distributed")
    scale_strides, scale_offset = (0, 0, 0), 0
    if extra:
        scale_strides, scale_offset = _scale_strides(scale, L, S, Hc, hc, c0, devices[0])
    others = [("block_mapping", block_mapping), *extra]
    check_destinations(dst, [] if unpack else src, [*others, *(src if unpack else [])])
    if block_mapping.device.type == "cpu":
        cache_blocks = [(nm, t.shape[0]) for nm, t in c]
        page_rows = [("pages", pages.shape[0])]
        check_host_mapping(block_mapping, page_rows if unpack else cache_blocks,
                           cache_blocks if unpack else page_rows, False)
    es = c0.element_size()
    jobs, page_job = [], None
    if not quantized:
        for l_, (_, t) in enumerate(c):
            tes = t.element_size()
            for s in range(S):
                cache_off = (s * E * t.stride(3) + hc * t.stride(1)) * tes
                page_off = hp * hb + (l_ * S + s) * N * E * es
                dims = [(k, t.stride(1) * tes, hb), (N, t.stride(2) * tes, E * es),
                        (E, t.stride(3) * tes, es)]
                if unpack:
                    dims = [(size, b, a) for size, a, b in dims]
                    jobs += _jobs(pages, t, dims, tes, page_off, cache_off)
                else:
                    jobs += _jobs(t, pages, dims, tes, cache_off, page_off)
    else:
        sides = tuple(Side(t, hc * t.stride(1) * es,
                           (t.stride(0) * es, t.stride(1) * es, t.stride(2) * es,
                            t.stride(3) * es), t.shape[0]) for _, t in c)
        page_side = Side(pages, hp * hb, (pages.stride(0), hb, 0, 1), pages.shape[0])
        page_job = PageJob(direction="unpack" if unpack else "pack", page_format=fmt,
                           caches=sides, cache_dtype=c0.dtype, pages=page_side, heads=k,
                           layers=L, parts=S, tokens=N, row_elems=C, chunk_bytes=hb,
                           scale=None if unpack else scale, scale_strides=scale_strides,
                           scale_offset=scale_offset)
    args = {"caches": tuple(t for _, t in c), "pages": pages, "kv_split": S, "page_format": fmt,
            "scale": None if unpack else scale, "cache_head": hc, "page_head": hp, "heads": k,
            "chunk_bytes": hb}
    cache_blocks, page_rows = _blocks(c), [("pages", pages.shape[0])]
    return _plan(op, jobs, page_job, block_mapping, devices, max_ctas, engine, args, cache,
                 lambda: _Checks(quantized, page_rows if unpack else cache_blocks,
                         cache_blocks if unpack else page_rows, False, _spans(dst)))


# --- the public builders: the plan cache first, the full path on a miss ----------------------------

def build_swap(src, dst, block_mapping, *, op: str = "swap_blocks",
               names: tuple[str, str] = ("src", "dst"), listed: bool = False, max_ctas=None,
               engine="auto") -> TransferPlan:
    """Validate and plan :func:`kvwrite.swap_blocks` (one pair, ``listed`` False) or
    :func:`kvwrite.swap_blocks_multi_layer` (two lists, ``listed`` True, ``names`` theirs):
    SPEC §9.2. Jobs: each pair's coalesced copy of its whole block shape (several jobs where more
    than three dims remain). ``args``: ``src``, ``dst`` (tuples). Cached (see the plan cache)."""
    a, b = _listed(src, listed), _listed(dst, listed)
    miss = None if a is None or b is None else _key(("swap", op, names, listed, len(a)), a + b)
    return _cached(miss, block_mapping, max_ctas, engine) or _build_swap(
        src, dst, block_mapping, op=op, names=names, listed=listed, max_ctas=max_ctas,
        engine=engine, cache=miss)


def build_swap_bytes(src, dst, block_size_in_bytes, block_mapping, *, max_ctas=None,
                     engine="auto") -> TransferPlan:
    """Validate and plan vLLM's four-argument form of :func:`kvwrite.swap_blocks` (SPEC §9.2):
    block ``i`` is the ``block_size_in_bytes`` bytes ``i * stride(0) * element_size()`` bytes
    after ``data_ptr()``. One job: heads = tokens = 1, elems = block_size_in_bytes bytes.
    ``args``: ``src``, ``dst`` (1-tuples), ``block_size_in_bytes``. Cached (see the plan cache:
    the storages' sizes, which this form checks, are part of the key)."""
    miss = None
    if (_plain_ints(block_size_in_bytes) and type(src) is torch.Tensor
            and type(dst) is torch.Tensor):
        miss = _key(("bytes", block_size_in_bytes, src.untyped_storage().nbytes(),
                     dst.untyped_storage().nbytes()), (src, dst))
    return _cached(miss, block_mapping, max_ctas, engine) or _build_swap_bytes(
        src, dst, block_size_in_bytes, block_mapping, max_ctas=max_ctas, engine=engine,
        cache=miss)


def build_relayout(src, dst, block_mapping, head_range=None, *, max_ctas=None,
                   engine="auto") -> TransferPlan:
    """Validate and plan :func:`kvwrite.relayout_kv_cache` (SPEC §9.3): ``src``/``dst`` 4-D
    ``(num_blocks, H, N, C)`` views or two lists of them. Jobs: one per layer, dims (K heads,
    N, C), coalesced. ``args``: ``src``, ``dst`` (tuples), ``src_head``, ``dst_head`` (first
    head of each side), ``heads`` (K). Cached (see the plan cache)."""
    listed = not isinstance(src, torch.Tensor)
    a, b, h = _listed(src, listed), _listed(dst, listed), _head_key(head_range)
    miss = None
    if a is not None and b is not None and h is not False:
        miss = _key(("relayout", listed, len(a), h), a + b)
    return _cached(miss, block_mapping, max_ctas, engine) or _build_relayout(
        src, dst, block_mapping, head_range, max_ctas=max_ctas, engine=engine, cache=miss)


def build_pack(caches, pages, block_mapping, *, kv_split=1, head_range=None, page_format="raw",
               scale=None, max_ctas=None, engine="auto", unpack: bool = False) -> TransferPlan:
    """Validate and plan :func:`kvwrite.pack_kv_pages` (or, ``unpack``, unpack_kv_pages, whose
    arguments are the same but ``scale``): SPEC §9.4.

    Raw: one CopyJob per layer ``l`` and part ``s`` (caches[l]'s part s, heads hc(k), against
    the pages seen as (row stride, hb, E*es, es) from byte ``hp0*hb + (l*S + s)*N*E*es``);
    quantized: one PageJob. ``args``: ``caches`` (tuple), ``pages``, ``kv_split``,
    ``page_format`` (canonical), ``scale``, ``cache_head``, ``page_head``, ``heads`` (K),
    ``chunk_bytes`` (hb). Cached (see the plan cache)."""
    c, h = _listed(caches, True), _head_key(head_range)
    miss = None
    if (c is not None and h is not False and _plain_ints(kv_split) and type(page_format) is str
            and type(unpack) is bool):
        tensors = c + (pages,) + (() if scale is None else (scale,))
        miss = _key(("pack", unpack, len(c), kv_split, h, page_format, scale is None), tensors)
    return _cached(miss, block_mapping, max_ctas, engine) or _build_pack(
        caches, pages, block_mapping, kv_split=kv_split, head_range=head_range,
        page_format=page_format, scale=scale, max_ctas=max_ctas, engine=engine, unpack=unpack,
        cache=miss)


def build_unpack(pages, caches, block_mapping, *, kv_split=1, head_range=None,
                 page_format="raw", max_ctas=None, engine="auto") -> TransferPlan:
    """Validate and plan :func:`kvwrite.unpack_kv_pages` (SPEC §9.4): as :func:`build_pack`
    with the sides swapped (raw jobs' src the pages) and no scale."""
    return build_pack(caches, pages, block_mapping, kv_split=kv_split, head_range=head_range,
                      page_format=page_format, max_ctas=max_ctas, engine=engine, unpack=True)


def select(op: str, plan: TransferPlan, implementation: str | None = None) -> ImplInfo:
    """The implementation that runs ``plan``: the named one or the preferred one that can
    (:func:`kvwrite.registry.select` with ``(plan,)``); both sides on the host: the torch
    implementation only (SPEC §9.1)."""
    if plan.device is not None:
        return select_impl(op, (plan,), implementation)
    info = get_impl(op, "torch" if implementation is None else implementation)
    if info.name != "torch":
        raise ValueError(f"implementation={implementation!r} cannot run this call: both sides "
                         f"are in host memory (the torch implementation only)")
    return info


def mapped_pairs(plan: TransferPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(source ids, destination ids) of the pairs a plan copies, int64 on the host: a GPU
    mapping's pairs with an id outside ``[0, blocks)`` of any tensor of its side skipped (a CPU
    mapping's are all in range). Reads the mapping on the host (a sync): for the references."""
    m = (plan.host_mapping if plan.host_mapping is not None else plan.mapping).cpu()
    m = m.to(torch.int64)
    i, j = m[:, 0], m[:, 1]
    ok = torch.ones_like(i, dtype=torch.bool)
    for ids, counts in ((i, src_blocks), (j, dst_blocks)):
        for blocks in counts:
            ok &= (ids >= 0) & (ids < blocks)
    return i[ok], j[ok]


# How the transfer ops' arguments cross into their torch.compile custom ops
# (kvwrite.registry.custom_op): lists of tensors as lists, a head range as a list of two ints
# (back to a tuple), max_ctas as given (None or an int: validated by the op itself).
TENSORS_ARG = OpArg(list[torch.Tensor], list)
HEAD_RANGE_ARG = OpArg(list[int] | None, lambda h: None if h is None else list(h),
                                lambda h: None if h is None else tuple(h))
MAX_CTAS_ARG = OpArg(int | None)
