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

import torch

__all__ = ["Side", "CopyJob", "PageJob", "TransferPlan", "ENGINES", "PAGE_FORMATS"]

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


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """A validated transfer: what every implementation's ``run(plan)`` reads.

    ``mapping``: the ``[n, 2]`` block mapping where the kernels read it (on ``device``, int32
    or int64, any strides: column 0 the source id, 1 the destination's, as the caller gave it);
    ``host_mapping``: the caller's CPU mapping (None for a GPU mapping), already checked (ids in
    range, distinct destinations). ``device``: the GPU of the call (None: both sides on the host).
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
