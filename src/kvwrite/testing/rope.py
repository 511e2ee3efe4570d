"""The case model of rotary_embedding and fused_rope_and_reshape_cache_flash
(docs/ops/rotary_embedding.md): a
:class:`RopeCase` names one call, :func:`make_rope_inputs` builds its tensors (a real RoPE
cos/sin table, random rows, positions with the out-of-range ones the case asks for, and the
caches, slots and scales of reshape_and_cache_flash's case model), ``ROPE_CASES`` and
``FUSED_CASES`` are the matrices every implementation is tested on."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..layouts import KVAlloc, Layout
from .build import FlashWriteCase, flag_parts
from .cases import Case, make_inputs

__all__ = ["RotaryWriteCase", "RopeCase", "RopeInputs", "make_rope_inputs", "cos_sin_table",
           "draw_positions", "ROPE_CASES", "FUSED_CASES", "PADDED_ROPE_CASES",
           "PADDED_FUSED_CASES"]


@dataclasses.dataclass(frozen=True)
class RotaryWriteCase(FlashWriteCase):
    """The fields of a rotary embedding's case, then of its cache write (the fused ops':
    reshape_and_cache_flash's Case's); num_tokens is T_rot = positions.numel() (extra_rows: rows
    past T_rot)."""
    cache_tokens: int | None = None  # T = slot_mapping.numel() (<= T_rot); None: T_rot
    head_size: int = 64
    rot_dim: int | None = None     # None: head_size
    is_neox: bool = True
    cos_sin_dtype: torch.dtype = torch.float32
    max_position: int = 64
    bad_positions: int = 0         # positions outside [0, max_position)
    pos_dtype: torch.dtype = torch.int64
    rotate_key_in_place: bool = True

    @property
    def rot(self) -> int:
        return self.head_size if self.rot_dim is None else self.rot_dim

    @property
    def num_cache_tokens(self) -> int:
        return self.num_tokens if self.cache_tokens is None else self.cache_tokens

    def write_id_parts(self) -> list[str]:
        """The case id's parts of the cache write: its tokens, the cache, the positions' and the
        slots' dtypes."""
        parts = [] if self.cache_tokens is None else [f"Tc{self.cache_tokens}"]
        parts += self.cache_id_parts()
        if self.pos_dtype == torch.int32:
            parts.append("pos32")
        if self.slot_dtype == torch.int32:
            parts.append("slot32")
        return parts


@dataclasses.dataclass(frozen=True)
class RopeCase(RotaryWriteCase):
    num_q_heads: int = 8
    num_heads: int = 2             # KV heads
    num_blocks: int = 12
    # query, key and value as slices of one [T_pad, Hq + 2H, D] qkv tensor.
    fused_qkv: bool = False
    # 2-D inputs [T_pad, H * D].
    flat: bool = False
    # rotary_embedding with key=None.
    no_key: bool = False
    query_out: bool = False
    # Padded heads (3-D form only): elements after each head of query, key, value and query_out,
    # so each is a [..., :D] slice of rows of heads (D + pad) apart, as vLLM passes them; the
    # padding holds random bytes that no call may change. With fused_qkv, one buffer whose token
    # row is Hq heads of (D + pad_q), then H of (D + pad_k), then H of (D + pad_v).
    head_pad: tuple[int, int, int, int] = (0, 0, 0, 0)

    def __post_init__(self):
        if any(self.head_pad) and self.flat:
            raise ValueError("head_pad: the 2-D (flat) form has dense heads")

    @property
    def id(self) -> str:
        parts = [f"T{self.num_tokens}", f"Hq{self.num_q_heads}", f"H{self.num_heads}",
                 f"D{self.head_size}", f"rot{self.rot}", "neox" if self.is_neox else "gptj",
                 str(self.dtype).removeprefix("torch."),
                 "cs" + str(self.cos_sin_dtype).removeprefix("torch.")]
        parts += self.write_id_parts()
        flags = ((self.extra_rows, "extra"), (self.bad_positions, "badpos"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.fused_qkv, "qkv"), (self.flat, "flat"), (self.no_key, "nokey"),
                 (not self.rotate_key_in_place, "keyout"),
                 (self.query_out, "qout"))
        flag_parts(parts, flags)
        if any(self.head_pad):
            parts.append("hpad" + "_".join(map(str, self.head_pad)))
        return "-".join(parts)


@dataclasses.dataclass
class RopeInputs:
    query: torch.Tensor
    key: torch.Tensor | None
    value: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    query_out: torch.Tensor | None
    rotate_key_in_place: bool
    is_neox: bool
    head_size: int

    def rotary_args(self) -> tuple:
        """The arguments of rotary_embedding."""
        return (self.positions, self.query, self.key, self.head_size, self.cos_sin_cache,
                self.is_neox)

    def fused_args(self) -> tuple:
        """The positional arguments of fused_rope_and_reshape_cache_flash."""
        return (self.query, self.key, self.value, self.positions, self.cos_sin_cache,
                self.is_neox, self.key_cache, self.value_cache, self.slot_mapping, self.k_scale,
                self.v_scale, self.kv_cache_dtype)

    def fused_kwargs(self) -> dict:
        return dict(rotate_key_in_place=self.rotate_key_in_place, query_out=self.query_out)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the call by name (None ones left out)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v
        return out


def cos_sin_table(max_position: int, rot_dim: int, dtype: torch.dtype = torch.float32,
                  base: float = 10000.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """vLLM's RoPE table ``[max_position, rot_dim]``: cos then sin of ``p * base^(-2i/rot_dim)``
    (computed in float64, rounded once to ``dtype``)."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype).to(device).contiguous()


def draw_positions(case: RotaryWriteCase, num: int, gen: torch.Generator) -> torch.Tensor:
    """``num`` random positions in ``[0, max_position)`` of the case's dtype, ``bad_positions``
    of them (at random indices) out of range: -1, max_position, the int32 extremes, ..."""
    pos = torch.randint(0, case.max_position, (num,), generator=gen)
    if case.bad_positions:
        where = torch.randperm(num, generator=gen)[:case.bad_positions]
        bad = [-1, case.max_position, -(2**31), case.max_position + 17, -7, 2**31 - 1]
        for i, w in enumerate(where.tolist()):
            pos[w] = bad[i % len(bad)]
    return pos.to(case.pos_dtype)


def _heads(t: torch.Tensor, flat: bool) -> torch.Tensor:
    return t.flatten(1) if flat else t


def _padded(parts: list[torch.Tensor], pads: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """``parts`` (``[rows, H_i, D]`` each) copied into one buffer of random bytes whose token row
    holds each part's heads ``D + pads[i]`` apart, one part after another; the views of them."""
    rows, d = parts[0].shape[0], parts[0].shape[2]
    widths = [p.shape[1] * (d + pad) for p, pad in zip(parts, pads, strict=True)]
    es = parts[0].element_size()
    buf = torch.randint(0, 256, (rows, sum(widths) * es), dtype=torch.uint8, generator=gen)
    buf = buf.view(parts[0].dtype)
    views, at = [], 0
    for p, pad, w in zip(parts, pads, widths, strict=True):
        v = buf[:, at:at + w].unflatten(1, (p.shape[1], d + pad))[..., :d]
        v.copy_(p)
        views.append(v)
        at += w
    return views


def make_rope_inputs(case: RopeCase, device: str | torch.device = "cpu",
                     seed: int = 0) -> RopeInputs:
    """The tensors of ``case`` on ``device``; the same seed gives the same bytes."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1000)
    T, Tc = case.num_tokens, case.num_cache_tokens
    rows = T + case.extra_rows
    H, Hq, D = case.num_heads, case.num_q_heads, case.head_size
    # The cache part (caches, slots, scales, key and value rows) from the cache write's model.
    cache_case = Case(num_tokens=Tc, num_heads=H, head_size=D, block_size=case.block_size,
                      num_blocks=case.num_blocks, dtype=case.dtype,
                      kv_cache_dtype=case.kv_cache_dtype, layout=case.layout, alloc=case.alloc,
                      per_head_scale=case.per_head_scale, fp8_storage=case.fp8_storage,
                      slot_dtype=case.slot_dtype, extra_rows=rows - Tc,
                      padding_slots=case.padding_slots,
                      out_of_range_slots=case.out_of_range_slots)
    ci = make_inputs(cache_case, "cpu", seed)
    query = torch.randn(rows, Hq, D, generator=gen).to(case.dtype)
    if case.cache_dtype.is_fp8:  # the cache write's magnitudes, for the query too
        query.mul_(torch.exp2(torch.randint(-8, 8, query.shape, generator=gen).float()).to(case.dtype))
    key, value = ci.key, ci.value
    if case.fused_qkv:
        qkv = torch.empty(rows, Hq + 2 * H, D, dtype=case.dtype)
        qkv[:, :Hq].copy_(query)
        qkv[:, Hq:Hq + H].copy_(key)
        qkv[:, Hq + H:].copy_(value)
        query, key, value = qkv[:, :Hq], qkv[:, Hq:Hq + H], qkv[:, Hq + H:]
    query_out = None
    if case.query_out:
        query_out = torch.randn(rows, Hq, D, generator=gen).to(case.dtype)
    if any(case.head_pad):
        # The rows' values are those of the dense case (the padding draws from its own stream).
        pad_gen = torch.Generator(device="cpu").manual_seed(seed + 2000)
        pq, pk, pv, po = case.head_pad
        if case.fused_qkv:
            query, key, value = _padded([query, key, value], [pq, pk, pv], pad_gen)
        else:
            query, key, value = (_padded([t], [p], pad_gen)[0]
                                 for t, p in ((query, pq), (key, pk), (value, pv)))
        if query_out is not None:
            query_out = _padded([query_out], [po], pad_gen)[0]

    positions = draw_positions(case, T, gen)
    cos_sin = cos_sin_table(case.max_position, case.rot, case.cos_sin_dtype)

    def dev(t):
        return None if t is None else t.to(device)

    # Move each allocation whole (padding included), so views of one buffer stay views of one.
    moved: dict[int, torch.Tensor] = {}
    query, key, value, query_out = (_to_device(t, device, moved)
                                    for t in (query, key, value, query_out))
    moved_cache = make_inputs(cache_case, device, seed)  # same bytes, caches' sharing kept
    return RopeInputs(
        query=_heads(query, case.flat), key=None if case.no_key else _heads(key, case.flat),
        value=_heads(value, case.flat), positions=dev(positions), cos_sin_cache=dev(cos_sin),
        key_cache=moved_cache.key_cache, value_cache=moved_cache.value_cache,
        slot_mapping=moved_cache.slot_mapping, kv_cache_dtype=case.kv_cache_dtype,
        k_scale=moved_cache.k_scale if case.cache_dtype.is_fp8 else None,
        v_scale=moved_cache.v_scale if case.cache_dtype.is_fp8 else None,
        query_out=None if query_out is None else _heads(query_out, case.flat),
        rotate_key_in_place=case.rotate_key_in_place, is_neox=case.is_neox, head_size=D)


def _to_device(t: torch.Tensor | None, device, moved: dict[int, torch.Tensor]
               ) -> torch.Tensor | None:
    """``t`` on ``device`` as the same view of a copy of its whole storage (bytes outside the
    view included); ``moved`` holds the storages already copied, so that views of one storage
    stay views of one."""
    if t is None:
        return None
    st = t.untyped_storage()
    if st.data_ptr() not in moved:
        store = torch.empty(st.nbytes(), dtype=torch.uint8)
        store.untyped_storage().copy_(st)
        moved[st.data_ptr()] = store.to(device)
    return moved[st.data_ptr()].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


# Padded heads (head_pad): vLLM's D = 80 in rows of 144, D = 128 in rows of 192, paddings that
# break 16-byte alignment (odd ones: 2-byte; GPT-J needs even), each tensor its own padding.
PADDED_ROPE_CASES: list[RopeCase] = [
    RopeCase(num_tokens=7, num_q_heads=4, num_heads=2, head_size=80, head_pad=(64, 64, 0, 0),
             dtype=torch.float16, bad_positions=1),
    RopeCase(num_tokens=7, num_q_heads=4, num_heads=2, head_size=80, head_pad=(64, 64, 0, 0),
             extra_rows=2),
    RopeCase(num_tokens=5, num_q_heads=4, num_heads=2, head_size=128, head_pad=(64, 64, 0, 0),
             is_neox=False, dtype=torch.float32),
    RopeCase(num_tokens=6, num_q_heads=3, num_heads=2, rot_dim=32, head_pad=(1, 6, 0, 0),
             dtype=torch.float16, pos_dtype=torch.int32),
    RopeCase(num_tokens=6, num_q_heads=3, num_heads=2, head_pad=(2, 4, 0, 0), is_neox=False,
             dtype=torch.float16),
    RopeCase(num_tokens=9, num_q_heads=4, num_heads=2, head_pad=(16, 8, 24, 0), fused_qkv=True,
             dtype=torch.float32),
    RopeCase(num_tokens=5, num_q_heads=4, num_heads=2, head_pad=(3, 0, 0, 0), no_key=True,
             dtype=torch.float16),
]
PADDED_FUSED_CASES: list[RopeCase] = [
    RopeCase(num_tokens=7, num_q_heads=4, num_heads=2, head_size=80, head_pad=(64, 64, 64, 0),
             dtype=torch.float16, kv_cache_dtype="fp8", bad_positions=1, padding_slots=1),
    RopeCase(num_tokens=7, num_q_heads=4, num_heads=2, head_size=128, head_pad=(64, 64, 64, 0),
             layout=Layout.HND),
    RopeCase(num_tokens=6, num_q_heads=3, num_heads=2, head_pad=(1, 3, 5, 7), query_out=True,
             rotate_key_in_place=False, dtype=torch.float16, alloc=KVAlloc.PACKED),
    RopeCase(num_tokens=6, num_q_heads=3, num_heads=2, rot_dim=48, head_pad=(2, 6, 4, 10),
             query_out=True, is_neox=False, dtype=torch.float32, cache_tokens=4),
    RopeCase(num_tokens=9, num_q_heads=4, num_heads=2, head_pad=(8, 16, 24, 0), fused_qkv=True,
             dtype=torch.float16, kv_cache_dtype="fp8", per_head_scale=True, layout=Layout.HND),
]


def _rope_matrix() -> list[RopeCase]:
    cases = []
    # Pairing × rotary fraction × dtype × table dtype.
    for neox, rot, dtype in itertools.product((True, False), (None, 32),
                                              (torch.bfloat16, torch.float16, torch.float32)):
        cases.append(RopeCase(is_neox=neox, rot_dim=rot, dtype=dtype))
    for cs in (torch.bfloat16, torch.float16):
        cases.append(RopeCase(dtype=cs, cos_sin_dtype=cs))
        cases.append(RopeCase(dtype=torch.float32, cos_sin_dtype=cs, is_neox=False))
    cases += [
        RopeCase(num_tokens=0),
        RopeCase(num_tokens=1, num_q_heads=1, num_heads=1),
        RopeCase(num_tokens=33, bad_positions=6, pos_dtype=torch.int32, extra_rows=3),
        RopeCase(num_tokens=9, fused_qkv=True, flat=True, num_q_heads=4, num_heads=4),
        RopeCase(num_tokens=9, no_key=True, dtype=torch.float16),
        RopeCase(num_tokens=5, head_size=80, rot_dim=20, num_q_heads=3, num_heads=1,
                 is_neox=False, dtype=torch.float32),
        RopeCase(num_tokens=5, head_size=46, num_q_heads=2, num_heads=2, dtype=torch.float16),
        RopeCase(num_tokens=4, head_size=6, rot_dim=2, num_q_heads=5, num_heads=3,
                 dtype=torch.float16, fused_qkv=True),
        RopeCase(num_tokens=17, head_size=128, num_q_heads=32, num_heads=8, bad_positions=3),
    ]
    cases += PADDED_ROPE_CASES
    return cases


def _fused_matrix() -> list[RopeCase]:
    cases = []
    # Every layout × allocation × a few cache dtypes.
    for layout, alloc, kv in itertools.product(Layout, KVAlloc, ("auto", "fp8", "fp8_e5m2")):
        cases.append(RopeCase(layout=layout, alloc=alloc, kv_cache_dtype=kv, dtype=torch.float16))
    # Input dtypes against cache dtypes, pairings, partial rotary, table dtypes.
    for dtype, kv in itertools.product((torch.bfloat16, torch.float32),
                                       ("auto", "float16", "float32", "fp8")):
        cases.append(RopeCase(dtype=dtype, kv_cache_dtype=kv, layout=Layout.HND, is_neox=False,
                              rot_dim=48))
    cases += [
        RopeCase(dtype=torch.bfloat16, cos_sin_dtype=torch.bfloat16, kv_cache_dtype="fp8",
                 per_head_scale=True, fp8_storage="float8"),
        RopeCase(dtype=torch.float16, cos_sin_dtype=torch.float16, alloc=KVAlloc.PACKED),
        RopeCase(num_tokens=0),
        RopeCase(num_tokens=1, num_q_heads=1, num_heads=1, dtype=torch.float16),
        RopeCase(num_tokens=12, cache_tokens=7, extra_rows=2, dtype=torch.float16),
        RopeCase(num_tokens=33, bad_positions=6, pos_dtype=torch.int32, slot_dtype=torch.int32,
                 padding_slots=4, out_of_range_slots=3, dtype=torch.float16,
                 kv_cache_dtype="fp8", num_blocks=4),
        RopeCase(num_tokens=9, fused_qkv=True, flat=True, dtype=torch.float16,
                 layout=Layout.HND, alloc=KVAlloc.INTERLEAVED),
        RopeCase(num_tokens=9, fused_qkv=True, rotate_key_in_place=False, query_out=True,
                 dtype=torch.float16, kv_cache_dtype="fp8", per_head_scale=True,
                 alloc=KVAlloc.PACKED),
        RopeCase(num_tokens=9, rotate_key_in_place=False, dtype=torch.float32, bad_positions=2),
        RopeCase(num_tokens=9, query_out=True, dtype=torch.float32, is_neox=False,
                 bad_positions=2, flat=True),
        RopeCase(num_tokens=5, head_size=80, rot_dim=20, num_q_heads=3, num_heads=1,
                 is_neox=False, dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
        RopeCase(num_tokens=5, head_size=46, num_q_heads=2, num_heads=2, dtype=torch.float16,
                 kv_cache_dtype="fp8", layout=Layout.HND),
        RopeCase(num_tokens=4, head_size=6, rot_dim=2, num_q_heads=5, num_heads=3,
                 dtype=torch.float16, fused_qkv=True, block_size=5, num_blocks=3),
        RopeCase(num_tokens=20, head_size=128, num_q_heads=32, num_heads=8, num_blocks=4,
                 kv_cache_dtype="fp8", layout=Layout.HND, alloc=KVAlloc.PACKED),
        RopeCase(num_tokens=20, head_size=128, num_q_heads=32, num_heads=32, num_blocks=4,
                 dtype=torch.float16, bad_positions=2),
    ]
    cases += PADDED_FUSED_CASES
    return cases


ROPE_CASES: list[RopeCase] = _rope_matrix()
FUSED_CASES: list[RopeCase] = _fused_matrix()
