"""The gathers' case model (docs/ops/gather.md), shared by the tests, the sanitize cases and the
benchmark: :class:`Seqs` describes a batch of sequences (which output rows each request owns,
where its positions start, its block table, the index dtypes and strides, bad block ids, rows no
request owns), :func:`make_requests` builds its index tensors; one case class per op describes the
cache and the outputs and builds them (deterministic by seed; caches and outputs hold random
bytes, so a row that must keep its bytes is checked as well as a written one); and
:func:`assert_outputs_equal` compares whole output allocations byte for byte (NaN-aware only in
the dequantized elements, as the fp8 read rule allows).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..dtypes import CacheDType, parse_kv_cache_dtype
from ..layouts import KVAlloc, Layout, allocate_kv_cache
from ..ops.concat_and_cache_mla.op import DS_MLA_ENTRY
from .build import flag_parts
from .compare import differing_bytes, nan_mask, storage_bytes

__all__ = ["Seqs", "Requests", "make_requests", "mixed_seqs", "graph_seqs", "EntryCase",
           "EntryInputs", "make_entry_inputs", "FlashCase", "FlashInputs", "make_flash_inputs", "UpconvertCase",
           "UpconvertInputs", "make_upconvert_inputs", "IndexerCase", "IndexerInputs",
           "make_indexer_inputs", "random_bytes", "clone_tensor", "clone_tensors", "element_region",
           "assert_outputs_equal", "assert_all_outputs_equal", "SPECIAL_SCALES", "indexer_cache",
           "cuda_against_reference",
           "big_batch", "SANITIZE_SEQS"]

# Scales that every fp8 read must follow: zero, negative zero, negative, subnormal, tiny normal,
# huge, infinite and NaN (besides ordinary ones).
SPECIAL_SCALES = (0.37, 1.0, 0.0, -0.0, -2.5, 1e-40, 2.0**-126, 3e38, float("inf"),
                  -float("inf"), float("nan"))


@dataclasses.dataclass(frozen=True)
class Seqs:
    """A batch of B = len(lens) requests. Request r owns output rows [a_r, a_r + lens[r]) with
    a_0 = ``first`` and a_{r+1} = a_r + lens[r] (so cu_seq_lens = [a_0, ..., a_B]); a negative
    length is an empty request whose end lies before its start, where cu_seq_lens decreases (the
    case must leave no row owned twice). ``starts``: seq_starts (None: none). T_out = max(a) +
    ``rows_past`` (rows past every request; negative: T_out smaller than the total)."""

    lens: tuple[int, ...] = (5, 0, 17, 1, 3)
    first: int = 0
    starts: tuple[int, ...] | None = None
    rows_past: int = 2
    block_size: int = 16
    num_blocks: int = 12
    # block_table.size(1): None for the blocks the longest sequence needs (positions past it
    # keep their rows' bytes when it is smaller).
    max_blocks: int | None = None
    # block_table rows past B, and block ids planted in random used entries (bad ones: negative
    # or >= num_blocks).
    table_rows: int = 0
    bad_blocks: tuple[int, ...] = ()
    cu_dtype: torch.dtype = torch.int32
    ss_dtype: torch.dtype = torch.int32
    bt_dtype: torch.dtype = torch.int32
    # Every index tensor a view with non-unit strides (1-D: every 2nd/3rd element; the block
    # table transposed).
    strided: bool = False

    @property
    def num_req(self) -> int:
        return len(self.lens)

    @property
    def cu(self) -> list[int]:
        out = [self.first]
        for n in self.lens:
            out.append(out[-1] + n)
        return out

    @property
    def t_out(self) -> int:
        return max(0, max(self.cu) + self.rows_past)

    def needed_blocks(self) -> int:
        starts = self.starts or (0,) * self.num_req
        need = [-(-(s + n) // self.block_size) for s, n in zip(starts, self.lens, strict=True)
                if n > 0 and s + n > 0]
        return max(need, default=1)

    @property
    def id(self) -> str:
        lens = self.lens if len(self.lens) <= 6 else f"{len(self.lens)}seqs{sum(self.lens)}"
        parts = [f"L{lens}".replace(" ", ""), f"bs{self.block_size}"]
        if self.first:
            parts.append(f"first{self.first}")
        if self.starts is not None:
            parts.append("ss")
        if self.rows_past:
            parts.append(f"past{self.rows_past}")
        if self.max_blocks is not None:
            parts.append(f"mb{self.max_blocks}")
        if self.table_rows:
            parts.append(f"tr{self.table_rows}")
        if self.bad_blocks:
            parts.append("bad")
        names = {torch.int32: "32", torch.int64: "64"}
        parts.append("i" + names[self.cu_dtype] + names[self.ss_dtype] + names[self.bt_dtype])
        if self.strided:
            parts.append("strided")
        return "-".join(parts)


def graph_seqs(seed: int) -> Seqs:
    """Requests of the same shapes for seeds 0 and 1 with other values (lengths, starts, block
    ids): the inputs a CUDA-graph replay changes in place."""
    lens = (7, 0, 30, 2, 11) if seed == 0 else (1, 25, 3, 0, 12)
    starts = (2, 0, 13, 40, 5) if seed == 0 else (30, 1, -2, 7, 0)
    return Seqs(lens=lens, starts=starts, rows_past=3 if seed == 0 else 12, num_blocks=20,
                max_blocks=4, bad_blocks=(-1,) if seed == 0 else (20, 99))


def mixed_seqs(long: tuple[int, ...] = (300, 131), short: int = 40, max_short: int = 9,
               seed: int = 0, context: bool = True, **fields) -> Seqs:
    """A few long sequences and many short ones (MLA chunked prefill's shape), shuffled, with
    random context offsets (``seq_starts``) when ``context``."""
    gen = torch.Generator().manual_seed(seed)
    lens = list(long) + torch.randint(0, max_short + 1, (short,), generator=gen).tolist()
    order = torch.randperm(len(lens), generator=gen).tolist()
    lens = [lens[i] for i in order]
    starts = None
    if context:
        starts = tuple(torch.randint(0, 100, (len(lens),), generator=gen).tolist())
    fields.setdefault("num_blocks", 64)
    return Seqs(lens=tuple(lens), starts=starts, **fields)


@dataclasses.dataclass
class Requests:
    """The index tensors of a :class:`Seqs` (on one device)."""

    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor
    seq_starts: torch.Tensor | None
    t_out: int
    num_req: int

    @property
    def workspace_starts(self) -> torch.Tensor:
        """cu_seq_lens without its last entry: the same requests as workspace_starts (the last one
        then ends at T_out)."""
        return self.cu_seq_lens[:self.num_req]


def _index_1d(values: list[int], dtype: torch.dtype, strided: bool, step: int) -> torch.Tensor:
    if not strided:
        return torch.tensor(values, dtype=dtype)
    base = torch.full((max(1, len(values)) * step,), -7, dtype=dtype)
    view = base[::step][:len(values)]
    view.copy_(torch.tensor(values, dtype=dtype))
    return view


def make_requests(seqs: Seqs, gen: torch.Generator) -> Requests:
    """The block table (random valid block ids, the bad ones planted), cu_seq_lens and
    seq_starts of ``seqs``, on the CPU."""
    b = seqs.num_req
    rows = b + seqs.table_rows
    max_blocks = seqs.needed_blocks() if seqs.max_blocks is None else seqs.max_blocks
    table = torch.randint(0, seqs.num_blocks, (rows, max_blocks), generator=gen)
    for bad in seqs.bad_blocks:
        if b and max_blocks:
            r = int(torch.randint(0, b, (1,), generator=gen))
            n = max(1, min(max_blocks, -(-max(seqs.lens[r], 1) // seqs.block_size)))
            table[r, int(torch.randint(0, n, (1,), generator=gen))] = bad
    if seqs.strided:
        bt = torch.empty(max_blocks, rows, dtype=seqs.bt_dtype).t()
        bt.copy_(table)
    else:
        bt = table.to(seqs.bt_dtype)
    cu = _index_1d(seqs.cu, seqs.cu_dtype, seqs.strided, 2)
    ss = None
    if seqs.starts is not None:
        ss = _index_1d(list(seqs.starts), seqs.ss_dtype, seqs.strided, 3)
    return Requests(bt, cu, ss, seqs.t_out, b)


def random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill the whole allocation behind ``t`` with random bytes."""
    b = storage_bytes(t)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _moved(tensors: dict, device) -> dict:
    """The tensors on ``device``, views of one storage staying views of one storage."""
    out, storages = {}, {}
    for k, t in tensors.items():
        if t is None or not isinstance(t, torch.Tensor):
            out[k] = t
            continue
        key = t.untyped_storage().data_ptr()
        if key not in storages:
            storages[key] = storage_bytes(t).to(device)
        out[k] = storages[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    return out


def clone_tensor(t: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """A copy of ``t`` (on ``device``, default its own) with its whole allocation."""
    device = t.device if device is None else device
    copy = storage_bytes(t).to(device, copy=True)
    return copy.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def clone_tensors(*ts: torch.Tensor, device: str | torch.device | None = None
                  ) -> tuple[torch.Tensor, ...]:
    """Copies of ``ts`` with their whole allocations, views of one allocation (K and V halves of
    one output) staying views of one copy."""
    copies, out = {}, []
    for t in ts:
        key = t.untyped_storage().data_ptr()
        if key not in copies:
            copies[key] = storage_bytes(t).to(t.device if device is None else device, copy=True)
        out.append(copies[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()))
    return tuple(out)


def _strided_rows(rows: int, width: int, dtype: torch.dtype, pad: int, offset: int = 0
                  ) -> torch.Tensor:
    """A ``[rows, width]`` view with ``pad`` elements after each row and ``offset`` before the
    first."""
    base = torch.empty(offset + rows * (width + pad) + 1, dtype=dtype)
    return base[offset:offset + rows * (width + pad)].view(rows, width + pad)[:, :width]


def _cache(num_blocks: int, block_size: int, entry: tuple[int, ...], dtype: torch.dtype,
           pad: int, offset: int, transposed: bool, perm: tuple[int, ...] | None
           ) -> torch.Tensor:
    """A ``[num_blocks, block_size, *entry]`` cache: entries padded by ``pad`` elements (when the
    entry is 1-D) and starting ``offset`` elements in, blocks and slots swapped in memory
    (``transposed``), the entry's dims stored in the order ``perm``."""
    n_entry = math.prod(entry)
    if perm is not None:
        phys = tuple(entry[i] for i in perm)
        base = torch.empty(num_blocks, block_size, *phys, dtype=dtype)
        inv = [perm.index(i) for i in range(len(entry))]
        return base.permute(0, 1, *(2 + i for i in inv))
    width = n_entry + pad
    if transposed:
        base = torch.empty(offset + block_size * num_blocks * width, dtype=dtype)
        view = base[offset:].view(block_size, num_blocks, width).transpose(0, 1)
    else:
        base = torch.empty(offset + num_blocks * block_size * width, dtype=dtype)
        view = base[offset:].view(num_blocks, block_size, width)
    if not entry:
        return view[:, :, 0]
    return view[:, :, :n_entry] if len(entry) == 1 else view[:, :, :n_entry].unflatten(2, entry)


# --- gather_and_maybe_dequant_cache and cp_gather_cache -----------------------------------------

@dataclasses.dataclass(frozen=True)
class EntryCase:
    """A call of gather_and_maybe_dequant_cache (``entry`` 1-D, ``dtype`` float) or of
    cp_gather_cache (any ``entry`` and ``dtype``)."""

    seqs: Seqs = Seqs()
    entry: tuple[int, ...] = (576,)
    dtype: torch.dtype = torch.bfloat16  # dst's dtype (and the cache's unless fp8)
    kv_cache_dtype: str = "auto"  # gather_and_maybe_dequant_cache: "auto", "fp8", "fp8_e5m2"
    fp8_storage: str = "uint8"  # or "float8"
    cache_pad: int = 0
    cache_offset: int = 0
    cache_transposed: bool = False
    entry_perm: tuple[int, ...] | None = None  # cp_gather_cache: the entry dims' memory order
    dst_pad: int = 0
    dst_offset: int = 0
    dst_rows_extra: int = 0  # dst rows past T_out (num_tokens)
    scale: float = 0.37
    seed: int = 0

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        if not self.fp8:
            return None
        return parse_kv_cache_dtype(self.kv_cache_dtype).fp8_dtype

    @property
    def id(self) -> str:
        parts = [self.seqs.id, "x".join(map(str, self.entry)), str(self.dtype)[6:],
                 self.kv_cache_dtype]
        if self.fp8:
            parts.append(self.fp8_storage)
        flags = ((self.cache_pad, f"cpad{self.cache_pad}"),
                 (self.cache_offset, f"coff{self.cache_offset}"),
                 (self.cache_transposed, "transposed"),
                 (self.entry_perm, f"perm{self.entry_perm}".replace(" ", "")),
                 (self.dst_pad, f"dpad{self.dst_pad}"),
                 (self.dst_offset, f"doff{self.dst_offset}"),
                 (self.dst_rows_extra, f"extra{self.dst_rows_extra}"))
        flag_parts(parts, flags)
        if self.seed:
            parts.append(f"seed{self.seed}")
        return "-".join(parts)


@dataclasses.dataclass
class EntryInputs:
    src_cache: torch.Tensor
    dst: torch.Tensor
    req: Requests
    scale: torch.Tensor

    def dequant_args(self, case: EntryCase) -> tuple:
        """gather_and_maybe_dequant_cache's arguments (token_to_seq: zeros, never read)."""
        t2s = torch.zeros(self.req.t_out, dtype=torch.int32, device=self.dst.device)
        return (self.src_cache, self.dst, self.req.block_table, self.req.cu_seq_lens, t2s,
                self.req.t_out, case.kv_cache_dtype, self.scale, self.req.seq_starts)

    def cp_args(self) -> tuple:
        """cp_gather_cache's arguments."""
        return (self.src_cache, self.dst, self.req.block_table, self.req.cu_seq_lens,
                self.req.num_req, self.req.seq_starts)


def make_entry_inputs(case: EntryCase, device: str | torch.device = "cpu") -> EntryInputs:
    gen = torch.Generator().manual_seed(case.seed)
    req = make_requests(case.seqs, gen)
    s = case.seqs
    cache_dtype = case.dtype
    if case.fp8:
        cache_dtype = torch.uint8 if case.fp8_storage == "uint8" else case.fp8_dtype
    cache = _cache(s.num_blocks, s.block_size, case.entry, cache_dtype, case.cache_pad,
                   case.cache_offset, case.cache_transposed, case.entry_perm)
    random_bytes(cache, gen)
    rows = req.t_out + case.dst_rows_extra
    n = math.prod(case.entry)
    flat = _strided_rows(rows, n, case.dtype, case.dst_pad, case.dst_offset)
    if not case.entry:
        dst = flat[:, 0]
    else:
        dst = flat if len(case.entry) == 1 else flat.unflatten(1, case.entry)
    random_bytes(dst, gen)
    scale = torch.tensor([case.scale], dtype=torch.float32)
    m = _moved(dict(cache=cache, dst=dst, bt=req.block_table, cu=req.cu_seq_lens,
                    ss=req.seq_starts, scale=scale), device)
    return EntryInputs(m["cache"], m["dst"], Requests(m["bt"], m["cu"], m["ss"], req.t_out,
                                                      req.num_req), m["scale"])


# --- gather_cache_flash -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlashCase:
    seqs: Seqs = Seqs()
    num_heads: int = 4
    head_size: int = 32
    layout: Layout = Layout.NHD
    alloc: KVAlloc = KVAlloc.SEPARATE
    dtype: torch.dtype = torch.bfloat16  # the outputs' dtype (and the cache's unless fp8)
    kv_cache_dtype: str = "auto"
    fp8_storage: str = "uint8"
    per_head_scale: bool = False
    # The outputs: "separate" (two dense tensors), "fused" (halves of one [T, 2, H, D]), "padded"
    # (head and row strides padded, value_out's other than key_out's).
    outputs: str = "separate"
    scale: float = 0.37
    seed: int = 0

    @property
    def cache_dtype(self) -> CacheDType:
        return parse_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def id(self) -> str:
        parts = [self.seqs.id, f"H{self.num_heads}", f"D{self.head_size}", self.layout.value,
                 self.alloc.value, str(self.dtype)[6:], self.kv_cache_dtype]
        if self.cache_dtype.is_fp8:
            parts += [self.fp8_storage, "perhead" if self.per_head_scale else "pertensor"]
        if self.outputs != "separate":
            parts.append(self.outputs)
        if self.seed:
            parts.append(f"seed{self.seed}")
        return "-".join(parts)


@dataclasses.dataclass
class FlashInputs:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_out: torch.Tensor
    value_out: torch.Tensor
    req: Requests
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def args(self, case: FlashCase) -> tuple:
        return (self.key_cache, self.value_cache, self.key_out, self.value_out,
                self.req.block_table, self.req.cu_seq_lens, case.kv_cache_dtype, self.k_scale,
                self.v_scale, self.req.seq_starts)


def make_flash_inputs(case: FlashCase, device: str | torch.device = "cpu") -> FlashInputs:
    gen = torch.Generator().manual_seed(case.seed)
    req = make_requests(case.seqs, gen)
    s, h, d = case.seqs, case.num_heads, case.head_size
    cdt = case.cache_dtype
    cache_dtype = case.dtype
    if cdt.is_fp8:
        cache_dtype = torch.uint8 if case.fp8_storage == "uint8" else cdt.fp8_dtype
    elif cdt is not CacheDType.AUTO:
        cache_dtype = cdt.element_dtype(case.dtype)
    k, v = allocate_kv_cache(s.num_blocks, s.block_size, h, d, cache_dtype, case.layout,
                             case.alloc, "cpu")
    random_bytes(k, gen)
    random_bytes(v, gen)
    out_dtype = case.dtype if cdt.is_fp8 else cache_dtype
    t = req.t_out
    if case.outputs == "fused":
        both = torch.empty(t, 2, h, d, dtype=out_dtype)
        ko, vo = both[:, 0], both[:, 1]
    elif case.outputs == "padded":
        ko = torch.empty(t, h + 1, d + 3, dtype=out_dtype)[:, :h, :d]
        vo = torch.empty(t, h, d + 5, dtype=out_dtype)[:, :, 2:d + 2]
    else:
        ko, vo = torch.empty(t, h, d, dtype=out_dtype), torch.empty(t, h, d, dtype=out_dtype)
    random_bytes(ko, gen)
    random_bytes(vo, gen)
    n = h if case.per_head_scale else 1
    ks = (case.scale * torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float())).float()
    vs = (case.scale * 1.7 * torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float())).float()
    m = _moved(dict(k=k, v=v, ko=ko, vo=vo, bt=req.block_table, cu=req.cu_seq_lens,
                    ss=req.seq_starts, ks=ks, vs=vs), device)
    return FlashInputs(m["k"], m["v"], m["ko"], m["vo"],
                       Requests(m["bt"], m["cu"], m["ss"], req.t_out, req.num_req), m["ks"],
                       m["vs"])


# --- cp_gather_and_upconvert_fp8_kv_cache -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class UpconvertCase:
    """The requests of ``seqs`` as workspace_starts: the last one ends at T_out."""

    seqs: Seqs = Seqs()
    dtype: torch.dtype = torch.bfloat16
    fp8_storage: str = "uint8"
    cache_pad: int = 0
    cache_offset: int = 0
    cache_transposed: bool = False
    dst_pad: int = 0
    dst_offset: int = 0
    # Tile scales: "normal" (random binades), "special" (SPECIAL_SCALES among them), "random"
    # (any 32 bits).
    scales: str = "normal"
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.seqs.id, str(self.dtype)[6:], self.fp8_storage, self.scales]
        flags = ((self.cache_pad, f"cpad{self.cache_pad}"),
                 (self.cache_offset, f"coff{self.cache_offset}"),
                 (self.cache_transposed, "transposed"),
                 (self.dst_pad, f"dpad{self.dst_pad}"),
                 (self.dst_offset, f"doff{self.dst_offset}"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class UpconvertInputs:
    src_cache: torch.Tensor
    dst: torch.Tensor
    req: Requests

    def args(self) -> tuple:
        return (self.src_cache, self.dst, self.req.block_table, self.req.workspace_starts,
                self.req.num_req, self.req.seq_starts)


def make_upconvert_inputs(case: UpconvertCase,
                          device: str | torch.device = "cpu") -> UpconvertInputs:
    gen = torch.Generator().manual_seed(case.seed)
    req = make_requests(case.seqs, gen)
    s = case.seqs
    cache = _cache(s.num_blocks, s.block_size, (DS_MLA_ENTRY,), torch.uint8, case.cache_pad,
                   case.cache_offset, case.cache_transposed, None)
    random_bytes(cache, gen)
    if case.scales != "random":
        n = s.num_blocks * s.block_size * 4
        vals = torch.exp2(torch.randint(-20, 10, (n,), generator=gen).float())
        vals *= 1 + torch.rand(n, generator=gen)
        if case.scales == "special":
            sp = torch.tensor(SPECIAL_SCALES, dtype=torch.float32)
            vals[::3] = sp[torch.arange(0, n, 3) % sp.numel()]
        scale_bytes = vals.view(s.num_blocks, s.block_size, 4).contiguous().view(torch.uint8)
        cache[:, :, 512:528] = scale_bytes
    if case.fp8_storage == "float8":
        cache = cache.view(torch.float8_e4m3fn)
    dst = _strided_rows(req.t_out, 576, case.dtype, case.dst_pad, case.dst_offset)
    random_bytes(dst, gen)
    m = _moved(dict(cache=cache, dst=dst, bt=req.block_table, cu=req.cu_seq_lens,
                    ss=req.seq_starts), device)
    return UpconvertInputs(m["cache"], m["dst"],
                           Requests(m["bt"], m["cu"], m["ss"], req.t_out, req.num_req))


# --- cp_gather_indexer_k_quant_cache ------------------------------------------------------------

def indexer_cache(num_blocks: int, block_size: int, head_dim: int, groups: int,
                  page_pad: int = 0, offset: int = 0) -> torch.Tensor:
    """An indexer cache ``[num_blocks, block_size, D + 4G]`` uint8 with dense pages, ``page_pad``
    bytes between pages and ``offset`` bytes before the first."""
    width = head_dim + 4 * groups
    page = block_size * width + page_pad
    base = torch.zeros(offset + num_blocks * page, dtype=torch.uint8)
    return base.as_strided((num_blocks, block_size, width), (page, width, 1), offset)


@dataclasses.dataclass(frozen=True)
class IndexerCase:
    """The requests of ``seqs`` (no seq_starts: B = block_table rows)."""

    seqs: Seqs = Seqs()
    head_dim: int = 128
    groups: int = 1
    page_pad: int = 0
    cache_offset: int = 0
    k_dtype: torch.dtype = torch.uint8  # or torch.float8_e4m3fn
    k_layout: str = "dense"  # "dense", "padded" (row stride padded), "strided" (non-unit last)
    scale_dtype: torch.dtype = torch.uint8  # [T, 4G] bytes, or torch.float32 [T, G]
    scale_layout: str = "dense"
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.seqs.id, f"D{self.head_dim}", f"G{self.groups}", str(self.k_dtype)[6:],
                 self.k_layout, str(self.scale_dtype)[6:], self.scale_layout]
        if self.page_pad:
            parts.append(f"ppad{self.page_pad}")
        if self.cache_offset:
            parts.append(f"coff{self.cache_offset}")
        return "-".join(parts)


@dataclasses.dataclass
class IndexerInputs:
    kv_cache: torch.Tensor
    dst_k: torch.Tensor
    dst_scale: torch.Tensor
    req: Requests

    def args(self) -> tuple:
        return (self.kv_cache, self.dst_k, self.dst_scale, self.req.block_table,
                self.req.cu_seq_lens)


def _out(rows: int, width: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "padded":
        return torch.empty(rows, width + 7, dtype=dtype)[:, 3:width + 3]
    if layout == "strided":
        return torch.empty(rows, width * 2 + 1, dtype=dtype)[:, 1::2][:, :width]
    return torch.empty(rows, width, dtype=dtype)


def make_indexer_inputs(case: IndexerCase, device: str | torch.device = "cpu") -> IndexerInputs:
    gen = torch.Generator().manual_seed(case.seed)
    if case.seqs.starts is not None:
        raise ValueError(f"case {case.id}: the indexer gather takes no seq_starts")
    req = make_requests(case.seqs, gen)
    s = case.seqs
    cache = indexer_cache(s.num_blocks, s.block_size, case.head_dim, case.groups, case.page_pad,
                          case.cache_offset)
    random_bytes(cache, gen)
    k = _out(req.t_out, case.head_dim, case.k_dtype, case.k_layout)
    width = 4 * case.groups if case.scale_dtype == torch.uint8 else case.groups
    sc = _out(req.t_out, width, case.scale_dtype, case.scale_layout)
    random_bytes(k, gen)
    random_bytes(sc, gen)
    m = _moved(dict(cache=cache, k=k, sc=sc, bt=req.block_table, cu=req.cu_seq_lens), device)
    return IndexerInputs(m["cache"], m["k"], m["sc"],
                         Requests(m["bt"], m["cu"], None, req.t_out, req.num_req))


# --- comparison ---------------------------------------------------------------------------------

def element_region(t: torch.Tensor, cols: slice | None = None) -> torch.Tensor:
    """Per byte of the allocation behind ``t`` (on the CPU): does it hold an element of ``t``
    (of its last-dim columns ``cols``)."""
    mask = torch.zeros(storage_bytes(t).numel(), dtype=torch.bool)
    es = t.element_size()
    view = t if cols is None else t[..., cols]
    shape = (*view.shape, es)
    stride = (*(s * es for s in view.stride()), 1)
    mask.as_strided(shape, stride, view.storage_offset() * es).fill_(True)
    return mask


def assert_outputs_equal(actual: torch.Tensor, expected: torch.Tensor, name: str,
                         nan_cols: slice | None | bool = False,
                         also: tuple[torch.Tensor, ...] = ()) -> None:
    """Every byte of the allocation behind ``actual`` equals ``expected``'s. Where ``nan_cols`` is
    not False, two elements of the output (of its last-dim columns ``nan_cols``; None: all) that
    both decode to NaN count as equal (the dequantized ones: the read rule fixes NaN, not its
    bits); ``also``: other outputs in the same allocation whose elements count so too (K and V
    halves of one tensor). The message names the tensor, the first differing bytes (as output row
    and column where they lie in the output) and got vs want."""
    a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
    if a.numel() != e.numel():
        raise AssertionError(f"{name}: storage sizes differ ({a.numel()} vs {e.numel()} bytes)")
    diff = differing_bytes(a, e)
    if nan_cols is not False and bool(diff.any()):
        both = nan_mask(a, expected.dtype) & nan_mask(e, expected.dtype)
        region = element_region(expected, nan_cols)
        for other in also:
            if other.untyped_storage().data_ptr() == actual.untyped_storage().data_ptr():
                region |= element_region(other, nan_cols)
        diff &= ~(both & region)
    if bool(diff.any()):
        idx = torch.nonzero(diff).flatten()
        first = idx[:8].tolist()
        where = _locate(expected, first[0])
        raise AssertionError(
            f"{name}: {idx.numel()} bytes differ; first at byte offsets {first}{where}: got "
            f"{a[idx[:8]].tolist()}, want {e[idx[:8]].tolist()}")


def assert_all_outputs_equal(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...],
                             name: str, nan_cols: slice | None | bool = False,
                             labels: tuple[str, ...] | None = None) -> None:
    """:func:`assert_outputs_equal` for each output of a call (``labels``: their names, added to
    ``name`` in the message), each with the call's other outputs as ``also``: where two outputs
    are views of one allocation (key_out and value_out halves of one tensor), the whole
    allocation is compared for each, and the NaN allowance of ``nan_cols`` holds in the other
    output's elements too (a kernel's NaN payload may differ from the reference's there)."""
    if len(actual) != len(expected):
        raise ValueError(f"{name}: {len(actual)} outputs against {len(expected)} expected")
    for i, (got, want) in enumerate(zip(actual, expected, strict=True)):
        label = f"{name} {labels[i]}" if labels else name
        others = tuple(o for j, o in enumerate(actual) if j != i)
        assert_outputs_equal(got, want, label, nan_cols, others)


def _locate(t: torch.Tensor, byte: int) -> str:
    """`` (element [i, j, ...] of the output)`` for a byte of its allocation inside it, else ``
    (outside the output's elements)``."""
    es = t.element_size()
    off = byte // es - t.storage_offset()
    idx = []
    dims = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    rem = off
    for d in dims:
        st = t.stride(d)
        i = rem // st if st else 0
        if not 0 <= i < t.shape[d]:
            return " (outside the output's elements)"
        idx.append((d, i))
        rem -= i * st
    if rem != 0:
        return " (outside the output's elements)"
    return f" (element {[i for _, i in sorted(idx)]} of the output)"


# --- sanitize cases -------------------------------------------------------------------------------

def cuda_against_reference(op: str, build, args_of, outs_of, nan=False) -> str | None:
    """Run the cuda implementation of ``op`` on the GPU and the torch one on the CPU over the same
    inputs (``build(device)``; ``args_of(inputs)``, ``outs_of(inputs)``: the call's arguments and
    outputs); None when every output allocation is byte-equal (NaN-aware as
    :func:`assert_outputs_equal`'s ``nan_cols``), else what differs. For the sanitize cases of each
    gather (``tools/sanitize/<op>.py``)."""
    from .. import ops
    fn = getattr(getattr(ops, op), op)
    gpu, cpu = build("cuda"), build("cpu")
    fn(*args_of(gpu), implementation="cuda")
    fn(*args_of(cpu), implementation="torch")
    torch.cuda.synchronize()
    try:
        assert_all_outputs_equal(tuple(outs_of(gpu)), tuple(outs_of(cpu)), op, nan)
    except AssertionError as e:
        return str(e)
    return None


def big_batch(num_req: int, seed: int = 5, **fields) -> Seqs:
    """``num_req`` requests of 0-3 rows with context offsets from -2 (negative positions) to 40:
    past the shared memory's starts when ``num_req >= 2048``."""
    gen = torch.Generator().manual_seed(seed)
    lens = tuple(torch.randint(0, 4, (num_req,), generator=gen).tolist())
    starts = tuple(torch.randint(-2, 40, (num_req,), generator=gen).tolist())
    fields.setdefault("num_blocks", 200)
    return Seqs(lens=lens, starts=starts, **fields)


# The row rule's bounds, for every op's sanitize cases: negative and past-the-table positions,
# block ids past both ends, rows no request owns (before, between and after), T_out below the
# total, a block size that is not a power of two, strided int64 index tensors, more rows than one
# wave of CTAs, and batches past the shared memory's starts.
SANITIZE_SEQS = {
    "bounds": Seqs(lens=(9, 0, 40, 3, 17), starts=(-5, 3, 30, 200, 0), max_blocks=3,
                   bad_blocks=(-1, 12, 1 << 40, -(1 << 40)), num_blocks=12, rows_past=7,
                   bt_dtype=torch.int64),
    "gaps": Seqs(lens=(4, -14, 4), first=10, rows_past=3, block_size=7, num_blocks=5,
                 cu_dtype=torch.int64, strided=True),
    "short": Seqs(lens=(30, 30), rows_past=-25, block_size=5, num_blocks=13),
    "wave": mixed_seqs(long=(30000, 12000), short=300, max_short=12, num_blocks=3000,
                       bad_blocks=(-1, 3000)),
    "big-batch": big_batch(3000, bad_blocks=(-1, 200), rows_past=5),
}
