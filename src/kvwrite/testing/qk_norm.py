"""The case model of fused_qk_norm_rope and fused_qk_norm_rope_and_reshape_cache_flash
(docs/ops/fused_qk_norm_rope.md): a :class:`QkNormCase` names one call, :func:`make_qk_norm_inputs`
builds its tensors (a packed qkv, weights, a real RoPE table, positions with the out-of-range ones
the case asks for, special values where asked, and the caches, slots and scales of
reshape_and_cache_flash's case model), ``NORM_CASES`` and ``FUSED_CASES`` are the matrices every
implementation is tested on, ``GPU_NORM_CASES`` and ``GPU_FUSED_CASES`` the larger ones for the
GPU (model shapes, every cache format and layout)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ..dtypes import parse_kv_cache_dtype
from ..layouts import KVAlloc, Layout
from .build import flag_parts
from .cases import Case, make_inputs
from .compare import storage_bytes
from .rope import RotaryWriteCase, cos_sin_table, draw_positions

__all__ = ["QkNormCase", "QkNormInputs", "make_qk_norm_inputs", "clone_inputs", "geometry",
           "differences", "NORM_CASES", "FUSED_CASES", "GPU_NORM_CASES", "GPU_FUSED_CASES",
           "SPECIALS"]

# Special rows a case may plant (see _plant_specials).
SPECIALS = ("", "zeros", "nan", "inf", "huge", "tiny")


@dataclasses.dataclass(frozen=True)
class QkNormCase(RotaryWriteCase):
    """(T_rot = position_ids.numel(); the cache write: the fused op only.)"""
    num_q_heads: int = 4
    num_k_heads: int = 2
    num_v_heads: int | None = None   # None: num_k_heads
    dtype: torch.dtype = torch.float16
    # The weights' dtypes: "same" (qkv's), a torch dtype, or None (no weight).
    q_weight: torch.dtype | str | None = "same"
    k_weight: torch.dtype | str | None = "same"
    weight_offset: float = 0.0
    eps: float = 1e-6
    # 2-D qkv [T_pad, (Hq+Hk+Hv)*D] instead of [T_pad, Hq+Hk+Hv, D].
    flat: bool = False
    # Extra columns after each token's heads (a token stride wider than the heads).
    row_pad: int = 0
    # Extra elements after each head (3-D qkv only): heads head_size + head_pad elements apart, as
    # vLLM's wide[..., :head_size] slices; the padding holds random bits that must not change.
    head_pad: int = 0
    special: str = ""
    num_blocks: int = 8
    # query_out: None, "same" (qkv's dtype), "fp8_e4m3" or "fp8_e5m2"; "spare": a region of
    # qkv's own allocation past the heads (qkv's dtype).
    query_out: str | None = None
    q_scale_per_head: bool = False
    # fp8 scales (k, v and q): "" random ones (not powers of two); "pow2": POW2_SCALES by head
    # (v's reversed), 1.0 where a scale is per tensor; "fast16": FAST16_SCALES by head (v's
    # reversed; k and v only).
    fp8_scales: str = ""

    @property
    def num_values(self) -> int:
        return self.num_k_heads if self.num_v_heads is None else self.num_v_heads

    def weight_dtype(self, which: str) -> torch.dtype | None:
        w = self.q_weight if which == "q" else self.k_weight
        return self.dtype if w == "same" else w

    @property
    def id(self) -> str:
        def dt(d):
            return str(d).removeprefix("torch.")

        parts = [f"T{self.num_tokens}", f"q{self.num_q_heads}k{self.num_k_heads}"
                 f"v{self.num_values}", f"D{self.head_size}", f"rot{self.rot}",
                 "neox" if self.is_neox else "gptj", dt(self.dtype), "cs" + dt(self.cos_sin_dtype)]
        for w in ("q", "k"):
            wd = self.weight_dtype(w)
            parts.append(f"{w}w-" + ("none" if wd is None else dt(wd)))
        if self.weight_offset:
            parts.append(f"off{self.weight_offset:g}")
        if self.eps != 1e-6:
            parts.append(f"eps{self.eps:g}")
        parts += self.write_id_parts()
        if self.query_out:
            parts.append("qout-" + self.query_out + ("-perhead" if self.q_scale_per_head else ""))
        flags = ((self.extra_rows, "extra"), (self.bad_positions, "badpos"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.flat, "flat"), (self.row_pad, "rowpad"),
                 (self.head_pad, f"headpad{self.head_pad}"),
                 (not self.rotate_key_in_place, "keyout"), (self.special, self.special),
                 (self.fp8_scales, f"scales-{self.fp8_scales}"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class QkNormInputs:
    qkv: torch.Tensor
    num_heads_q: int
    num_heads_k: int
    num_heads_v: int
    head_dim: int
    eps: float
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    cos_sin_cache: torch.Tensor
    is_neox: bool
    position_ids: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    weight_offset: float
    rotate_key_in_place: bool
    query_out: torch.Tensor | None
    q_scale: torch.Tensor | None

    def norm_args(self) -> tuple:
        """The positional arguments of fused_qk_norm_rope."""
        return (self.qkv, self.num_heads_q, self.num_heads_k, self.num_heads_v, self.head_dim,
                self.eps, self.q_weight, self.k_weight, self.cos_sin_cache, self.is_neox,
                self.position_ids)

    def norm_kwargs(self) -> dict:
        return dict(weight_offset=self.weight_offset)

    def fused_args(self) -> tuple:
        """The positional arguments of fused_qk_norm_rope_and_reshape_cache_flash."""
        return (*self.norm_args(), self.key_cache, self.value_cache, self.slot_mapping,
                self.k_scale, self.v_scale, self.kv_cache_dtype)

    def fused_kwargs(self) -> dict:
        return dict(weight_offset=self.weight_offset,
                    rotate_key_in_place=self.rotate_key_in_place, query_out=self.query_out,
                    q_scale=self.q_scale)

    def heads(self) -> torch.Tensor:
        """qkv as ``[T_pad, Hq+Hk+Hv, D]``."""
        return self.qkv if self.qkv.dim() == 3 else self.qkv.unflatten(1, (-1, self.head_dim))

    def tensors(self, cache: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor of the call by name (None ones left out; the caches only with
        ``cache``)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and (cache or f.name not in (
                    "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale")):
                out[f.name] = v
        return out


def _weight(case: QkNormCase, which: str, gen: torch.Generator) -> torch.Tensor | None:
    wd = case.weight_dtype(which)
    if wd is None:
        return None
    d = case.head_size
    if case.weight_offset:  # (1 + w) norms store small weights around 0
        w = 0.2 * torch.randn(d, generator=gen)
    else:
        w = 1.0 + 0.25 * torch.randn(d, generator=gen)
    w[0] = -0.0  # a negative zero weight: kept as -0.0 without an offset
    if d > 2:
        w[1] = 0.0
    return w.to(wd)


def _plant_specials(case: QkNormCase, x: torch.Tensor, gen: torch.Generator) -> None:
    """Special rows in the query and key heads of ``x`` ([rows, H, D] float32, before the cast):
    per token a few heads made entirely zero ("zeros"), one element NaN ("nan") or ±inf ("inf"),
    elements so large that the sum of squares overflows ("huge"; float32 and bfloat16 rows), or
    so small that their squares underflow ("tiny")."""
    T = case.num_tokens
    heads = case.num_q_heads + case.num_k_heads
    for t in range(T):
        for h in range(heads):
            if (t + h) % 3:
                continue
            if case.special == "zeros":
                x[t, h] = 0.0
                if (t + h) % 2:
                    x[t, h, ::3] = -0.0
            elif case.special == "nan":
                x[t, h, (t * 7 + h) % case.head_size] = float("nan")
            elif case.special == "inf":
                x[t, h, (t * 5 + h) % case.head_size] = float("inf") if h % 2 else -float("inf")
            elif case.special == "huge":
                big = 1e30 if case.dtype != torch.float16 else 6e4
                x[t, h, : case.head_size // 2] = torch.where(
                    x[t, h, : case.head_size // 2] < 0, -big, big)
            elif case.special == "tiny":
                tiny = {torch.float32: 1e-40, torch.bfloat16: 1e-39, torch.float16: 1e-7}
                x[t, h] *= tiny[case.dtype]


def make_qk_norm_inputs(case: QkNormCase, device: str | torch.device = "cpu",
                        seed: int = 0) -> QkNormInputs:
    """The tensors of ``case`` on ``device``; the same seed gives the same bytes.

    Device-independent by construction: everything is built on the CPU, then (for another
    device) each allocation is moved once, whole, and every view is re-created over it with its
    shape, strides and offset (:func:`clone_inputs`). So a build on any device has the CPU
    build's allocation sizes, view geometry, sharing (K and V of one cache, ``query_out`` in
    qkv's spare region) and bytes, padding included, and comparisons of whole allocations
    across devices compare like with like (:func:`geometry` describes all of it)."""
    inp = _build_on_cpu(case, seed)
    if torch.device(device) == torch.device("cpu"):
        return inp
    return clone_inputs(inp, device)


@functools.cache
def _table(max_position: int, rot_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The RoPE table, computed once per shape (each build gets its own copy)."""
    return cos_sin_table(max_position, rot_dim, dtype)


def _build_on_cpu(case: QkNormCase, seed: int) -> QkNormInputs:
    gen = torch.Generator(device="cpu").manual_seed(seed + 2000)
    T, Tc = case.num_tokens, case.num_cache_tokens
    rows = T + case.extra_rows
    hq, hk, hv, d = case.num_q_heads, case.num_k_heads, case.num_values, case.head_size
    heads = hq + hk + hv
    if case.head_pad and case.flat:
        raise ValueError("head_pad: padded heads need a 3-D qkv (flat=False)")
    hs = d + case.head_pad  # the head stride
    width = heads * hs + case.row_pad + (hq * d if case.query_out == "spare" else 0)
    x = torch.randn(rows, width, generator=gen)
    hx = x[:, :heads * hs].view(rows, heads, hs)[..., :d]
    # Spread magnitudes: rows of different scales (the norm takes them out).
    hx.mul_(torch.exp2(torch.randint(-6, 7, (rows, heads, 1), generator=gen).float()))
    if case.cache_dtype.is_fp8:  # the value rows over the fp8 range
        hx[:, hq + hk:].mul_(torch.exp2(torch.randint(-12, 8, (rows, hv, d),
                                                      generator=gen).float()))
    if case.special:
        _plant_specials(case, hx, gen)
    buf = x.to(case.dtype)
    qkv = buf[:, :heads * hs]
    query_out = None
    q_scale = None
    if case.query_out == "spare":
        query_out = buf[:, width - hq * d:]
    elif case.query_out == "same":
        query_out = torch.randn(rows, hq * d, generator=gen).to(case.dtype)
    elif case.query_out in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = torch.float8_e4m3fn if case.query_out == "fp8_e4m3" else torch.float8_e5m2
        query_out = torch.randint(0, 256, (rows, hq * d), dtype=torch.uint8,
                                  generator=gen).view(fp8)
        n = hq if case.q_scale_per_head else 1
        q_scale = (torch.rand(n, generator=gen) * 0.9 + 0.1) * 0.02
    q_weight, k_weight = _weight(case, "q", gen), _weight(case, "k", gen)

    positions = draw_positions(case, T, gen)
    cos_sin = _table(case.max_position, case.rot, case.cos_sin_dtype).clone()

    # The caches, slots and scales from the cache write's model (its key and value unused), with
    # enough blocks for the slots (norm-only cases of many tokens).
    n_valid = Tc - case.padding_slots - case.out_of_range_slots
    num_blocks = max(case.num_blocks, -(-n_valid // case.block_size))
    cache_case = Case(num_tokens=Tc, num_heads=hk, head_size=d, block_size=case.block_size,
                      num_blocks=num_blocks, dtype=case.dtype,
                      kv_cache_dtype=case.kv_cache_dtype, layout=case.layout, alloc=case.alloc,
                      per_head_scale=case.per_head_scale, fp8_storage=case.fp8_storage,
                      slot_dtype=case.slot_dtype, padding_slots=case.padding_slots,
                      out_of_range_slots=case.out_of_range_slots)
    ci = make_inputs(cache_case, "cpu", seed)
    if case.fp8_scales == "pow2":
        if case.cache_dtype.is_fp8:
            ci.k_scale.copy_(_pow2_scales(ci.k_scale))
            ci.v_scale.copy_(_pow2_scales(ci.v_scale, reverse=True))
        if q_scale is not None:
            q_scale = _pow2_scales(q_scale)
    elif case.fp8_scales == "fast16":
        if case.cache_dtype.is_fp8:
            ci.k_scale.copy_(_listed_scales(ci.k_scale, FAST16_SCALES))
            ci.v_scale.copy_(_listed_scales(ci.v_scale, FAST16_SCALES, reverse=True))
    elif case.fp8_scales:
        raise ValueError(f"fp8_scales: expected '', 'pow2' or 'fast16', got {case.fp8_scales!r}")

    if query_out is not None and not case.flat:
        query_out = query_out.unflatten(1, (hq, d))
    if not case.flat:
        qkv = qkv.unflatten(1, (heads, hs))[..., :d]
    return QkNormInputs(
        qkv=qkv, num_heads_q=hq, num_heads_k=hk, num_heads_v=hv, head_dim=d, eps=case.eps,
        q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cos_sin, is_neox=case.is_neox,
        position_ids=positions, key_cache=ci.key_cache, value_cache=ci.value_cache,
        slot_mapping=ci.slot_mapping, kv_cache_dtype=case.kv_cache_dtype,
        k_scale=ci.k_scale if case.cache_dtype.is_fp8 else None,
        v_scale=ci.v_scale if case.cache_dtype.is_fp8 else None,
        weight_offset=case.weight_offset, rotate_key_in_place=case.rotate_key_in_place,
        query_out=query_out, q_scale=q_scale)


def clone_inputs(inp: QkNormInputs, device: str | torch.device | None = None) -> QkNormInputs:
    """A copy (on ``device``; default each tensor's own) with every allocation copied once,
    whole, and every view re-created over its copy with the same shape, strides and offset:
    slices of one allocation stay slices of one, and the bytes outside the views (row padding,
    the other half of an interleaved or packed cache) come along."""
    storages: dict[int, torch.Tensor] = {}

    def copy(t):
        if t is None:
            return None
        s = t.untyped_storage()
        # Empty allocations all have address 0: each is its own.
        key = s.data_ptr() if s.nbytes() else ("empty", id(t))
        if key not in storages:
            storages[key] = storage_bytes(t).to(t.device if device is None else device,
                                                copy=True)
        return storages[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    fields = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
    return QkNormInputs(**{k: copy(v) if isinstance(v, torch.Tensor) else v
                           for k, v in fields.items()})


def geometry(inp: QkNormInputs) -> dict[str, tuple]:
    """Per tensor of the call: dtype, shape, strides, storage offset, the size of its whole
    allocation in bytes, and which of the call's allocations it lies in (numbered in field
    order): what two builds must share for their whole allocations to be compared byte for byte,
    on any device (meta tensors included)."""
    allocations: dict[int, int] = {}
    out = {}
    for name, t in inp.tensors().items():
        s = t.untyped_storage()
        which = allocations.setdefault(s._cdata, len(allocations))
        out[name] = (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), s.nbytes(), which)
    return out


def _norm_matrix() -> list[QkNormCase]:
    cases = []
    # Pairing × rotary fraction × row dtype (the CPU interpreter runs float16 and float32).
    for neox, rot, dtype in itertools.product((True, False), (None, 32),
                                              (torch.float16, torch.float32, torch.bfloat16)):
        cases.append(QkNormCase(is_neox=neox, rot_dim=rot, dtype=dtype))
    cases += [
        QkNormCase(num_tokens=0),
        QkNormCase(num_tokens=1, num_q_heads=1, num_k_heads=1, num_v_heads=0),
        QkNormCase(num_tokens=9, bad_positions=3, pos_dtype=torch.int32, extra_rows=2),
        QkNormCase(weight_offset=1.0, q_weight=torch.float32, k_weight=torch.bfloat16),
        QkNormCase(q_weight=None, k_weight=torch.float16, dtype=torch.float32, flat=True),
        QkNormCase(q_weight=None, k_weight=None, eps=0, row_pad=8),
        QkNormCase(head_size=80, rot_dim=40, num_q_heads=3, num_k_heads=1, is_neox=False,
                   dtype=torch.float32),
        QkNormCase(head_size=46, num_q_heads=2, num_k_heads=2, rot_dim=18),
        QkNormCase(head_size=6, rot_dim=2, num_q_heads=5, num_k_heads=3, num_tokens=4),
        QkNormCase(head_size=128, num_q_heads=8, num_k_heads=2, num_tokens=5, weight_offset=1.0),
        QkNormCase(head_size=256, num_q_heads=2, num_k_heads=1, num_tokens=3, dtype=torch.float32),
        QkNormCase(head_size=512, num_q_heads=2, num_k_heads=1, num_tokens=2, is_neox=False),
        QkNormCase(special="zeros", num_tokens=5),
        QkNormCase(special="zeros", eps=0, num_tokens=5, dtype=torch.float32),
        QkNormCase(special="nan", num_tokens=5, dtype=torch.float32),
        QkNormCase(special="inf", num_tokens=5),
        QkNormCase(special="huge", num_tokens=5, dtype=torch.float32),
        QkNormCase(special="tiny", num_tokens=5, dtype=torch.float32),
        QkNormCase(special="tiny", num_tokens=5, eps=0),
    ]
    # Padded heads (wide[..., :D] of vLLM's wider rows): D = 128 in rows of 192, D = 80 in rows
    # of 144 with partial GPT-J rotary, head strides that break 16-byte alignment (66 float16
    # elements: 4-byte chunks; 65 float32 elements: single elements) with partial neox rotary.
    cases += [
        QkNormCase(head_size=128, head_pad=64, num_tokens=5, bad_positions=1),
        QkNormCase(head_size=80, head_pad=64, rot_dim=40, num_q_heads=3, num_k_heads=1,
                   is_neox=False, dtype=torch.float32, weight_offset=1.0),
        QkNormCase(head_size=64, head_pad=2, rot_dim=32, extra_rows=2),
        QkNormCase(head_size=64, head_pad=1, dtype=torch.float32, row_pad=3, q_weight=None),
        QkNormCase(head_size=128, head_pad=64, dtype=torch.bfloat16, num_tokens=5),
    ]
    return cases


# Scales of fp8_scales="pow2": powers of two the kernels multiply by (1.0: vLLM's default; the
# extremes 2^-126 and 2^126) and, between them, scales that take the quotient (2^127 and a
# subnormal power: their reciprocals are not normal floats; 3.0).
POW2_SCALES = (1.0, 0.5, 2.0**-126, 2.0**126, 2.0**127, 2.0**-7, 3.0, 2.0**-149)


# Scales of fp8_scales="fast16" (kvw/fp8.cuh's fp8_quantize_fast16 in the fused QK-norm write's
# large-call build: 16-bit rows, 2^-60 <= s <= 2^60 for bfloat16, <= 1 for float16): scales
# under which one product an element would give another code for some inputs (the correction
# step's cases), the range's ends, 0.05 (near fp8 midpoints), 300 (bfloat16's range only) and
# scales just outside (1 + 2^-23 for float16 rows, 2^-61 for both) that take the quotient. One
# element (per tensor): the first.
FAST16_SCALES = (float(torch.tensor(0x3CF55556, dtype=torch.int32).view(torch.float32)),
                 float(torch.tensor(0x393B8E38, dtype=torch.int32).view(torch.float32)),
                 1.0 - 2.0**-24, 2.0**-60, 1.0 + 2.0**-23, 0.05, 300.0, 2.0**-61)


def _listed_scales(like: torch.Tensor, scales: tuple[float, ...],
                   reverse: bool = False) -> torch.Tensor:
    """``like``'s shape filled with ``scales`` by element (reversed with ``reverse``)."""
    n = like.numel()
    v = [scales[i % len(scales)] for i in range(n)]
    return torch.tensor(v[::-1] if reverse else v, dtype=torch.float32).reshape(like.shape)


def _pow2_scales(like: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """``like``'s shape filled with POW2_SCALES by element (1.0 for one element)."""
    if like.numel() == 1:
        return torch.ones_like(like)
    return _listed_scales(like, POW2_SCALES, reverse)


def _fused_matrix() -> list[QkNormCase]:
    cases = []
    # Every layout × allocation × a few cache dtypes.
    for layout, alloc, kv in itertools.product(Layout, KVAlloc, ("auto", "fp8", "fp8_e5m2")):
        cases.append(QkNormCase(layout=layout, alloc=alloc, kv_cache_dtype=kv))
    # Row dtypes against cache dtypes.
    for dtype, kv in itertools.product((torch.float16, torch.float32, torch.bfloat16),
                                       ("auto", "float16", "bfloat16", "float32", "fp8")):
        cases.append(QkNormCase(dtype=dtype, kv_cache_dtype=kv, layout=Layout.HND,
                                is_neox=False, rot_dim=48))
    cases += [
        QkNormCase(kv_cache_dtype="fp8", per_head_scale=True, fp8_storage="float8",
                   dtype=torch.float32, weight_offset=1.0, k_weight=torch.bfloat16),
        QkNormCase(num_tokens=0),
        QkNormCase(num_tokens=1, num_q_heads=1, num_k_heads=1),
        QkNormCase(num_tokens=12, cache_tokens=7, extra_rows=2),
        QkNormCase(num_tokens=9, cache_tokens=0),
        QkNormCase(num_tokens=20, bad_positions=4, pos_dtype=torch.int32, slot_dtype=torch.int32,
                   padding_slots=3, out_of_range_slots=3, kv_cache_dtype="fp8", num_blocks=2),
        QkNormCase(num_tokens=9, flat=True, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED,
                   row_pad=4),
        QkNormCase(num_tokens=9, rotate_key_in_place=False, query_out="same",
                   alloc=KVAlloc.PACKED, bad_positions=2, dtype=torch.float32),
        QkNormCase(num_tokens=9, query_out="spare", rotate_key_in_place=False, flat=True),
        QkNormCase(num_tokens=9, query_out="spare", bad_positions=2),
        QkNormCase(num_tokens=9, query_out="fp8_e4m3", kv_cache_dtype="fp8", bad_positions=2,
                   dtype=torch.float32),
        QkNormCase(num_tokens=9, query_out="fp8_e5m2", q_scale_per_head=True,
                   kv_cache_dtype="fp8_e5m2", per_head_scale=True, layout=Layout.HND,
                   alloc=KVAlloc.PACKED),
        QkNormCase(num_tokens=5, head_size=80, rot_dim=20, num_q_heads=3, num_k_heads=1,
                   is_neox=False, dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
        QkNormCase(num_tokens=5, head_size=46, num_q_heads=2, num_k_heads=2,
                   kv_cache_dtype="fp8", layout=Layout.HND, q_weight=None),
        QkNormCase(num_tokens=4, head_size=6, rot_dim=2, num_q_heads=5, num_k_heads=3,
                   block_size=5, num_blocks=3, k_weight=None, eps=0),
        QkNormCase(num_tokens=6, head_size=128, num_q_heads=8, num_k_heads=2, num_blocks=4,
                   kv_cache_dtype="fp8", layout=Layout.HND, alloc=KVAlloc.PACKED,
                   weight_offset=1.0),
        QkNormCase(num_tokens=5, special="zeros", kv_cache_dtype="fp8", eps=0,
                   dtype=torch.float32, query_out="fp8_e4m3"),
        QkNormCase(num_tokens=5, special="nan", kv_cache_dtype="fp8_e5m2", dtype=torch.float32),
        QkNormCase(num_tokens=5, special="inf"),
        QkNormCase(num_tokens=9, num_q_heads=8, num_k_heads=8, head_size=128,
                   dtype=torch.bfloat16, kv_cache_dtype="fp8", per_head_scale=True,
                   fp8_scales="pow2"),
    ]
    # Padded heads (see _norm_matrix): the value heads and the cache write through the head
    # stride too, query_out (dense) in place and apart, a spare region after padded heads.
    cases += [
        QkNormCase(num_tokens=9, head_size=128, head_pad=64, layout=Layout.HND, bad_positions=2,
                   padding_slots=2),
        QkNormCase(num_tokens=5, head_size=80, head_pad=64, rot_dim=20, num_q_heads=3,
                   num_k_heads=1, is_neox=False, dtype=torch.float32, kv_cache_dtype="fp8_e5m2"),
        QkNormCase(num_tokens=9, head_size=64, head_pad=2, rot_dim=32, query_out="same",
                   rotate_key_in_place=False, dtype=torch.float32, alloc=KVAlloc.INTERLEAVED),
        QkNormCase(num_tokens=9, head_size=64, head_pad=1, query_out="spare",
                   alloc=KVAlloc.PACKED, kv_cache_dtype="float32"),
        QkNormCase(num_tokens=9, head_size=128, head_pad=64, dtype=torch.bfloat16,
                   kv_cache_dtype="fp8", per_head_scale=True),
    ]
    return cases


def _gpu_norm_matrix() -> list[QkNormCase]:
    """Model shapes: Qwen3-8B (32, 8, 128), Qwen3-30B-A3B (32, 4, 128), Gemma 3 (8, 4, 256 with
    (1 + w)), head_dim 64, 80, 512; GQA and MHA; both pairings and every row dtype (each shape
    with three of the six combinations, Qwen3-8B with all); partial rotary; every weight kind;
    the special rows. Sized for a GPU run of a few minutes (each case is a kernel build)."""
    cases = []
    shapes = [(32, 8, 8, 128), (32, 4, 4, 128), (8, 4, 4, 256), (16, 16, 16, 64),
              (12, 2, 2, 80), (8, 1, 1, 512), (32, 32, 32, 128)]
    combos = [(torch.bfloat16, True), (torch.float16, False), (torch.float32, True)]
    for i, (hq, hk, hv, d) in enumerate(shapes):
        extra = [(torch.bfloat16, False), (torch.float16, True), (torch.float32, False)]
        for dtype, neox in combos + (extra if i == 0 else []):
            cases.append(QkNormCase(num_tokens=37, num_q_heads=hq, num_k_heads=hk,
                                    num_v_heads=hv, head_size=d, dtype=dtype, is_neox=neox,
                                    weight_offset=1.0 if d == 256 else 0.0, bad_positions=2,
                                    max_position=4096))
    for rot in (64, 32, 2):
        cases.append(QkNormCase(num_tokens=16, num_q_heads=32, num_k_heads=8, head_size=128,
                                rot_dim=rot, dtype=torch.bfloat16))
    for qw, kw, offset in ((None, None, 0.0), (torch.float32, torch.bfloat16, 1.0),
                           (torch.float16, None, 0.0), (torch.float32, torch.float16, 0.0)):
        cases.append(QkNormCase(num_tokens=16, num_q_heads=32, num_k_heads=8, head_size=128,
                                q_weight=qw, k_weight=kw, weight_offset=offset))
    for special in SPECIALS[1:]:
        for dtype, eps in ((torch.bfloat16, 1e-6), (torch.float32, 0)):
            cases.append(QkNormCase(num_tokens=9, num_q_heads=32, num_k_heads=8, head_size=128,
                                    dtype=dtype, special=special, eps=eps))
    cases += [QkNormCase(num_tokens=3000, num_q_heads=32, num_k_heads=8, head_size=128,
                         dtype=torch.bfloat16, max_position=8192, bad_positions=5,
                         extra_rows=3),
              QkNormCase(num_tokens=33, head_size=128, num_q_heads=32, num_k_heads=8,
                         cos_sin_dtype=torch.bfloat16, dtype=torch.bfloat16, flat=True,
                         row_pad=16, pos_dtype=torch.int32)]
    # Padded heads: Qwen3-8B's D = 128 in rows of 192 (small and large calls), D = 80 in rows of
    # 144, strides that break 16-byte alignment (8-byte and 2-byte chunks), partial rotary.
    for hp, d, dtype, neox, rot in ((64, 128, torch.bfloat16, True, None),
                                    (64, 128, torch.float16, False, 64),
                                    (64, 80, torch.bfloat16, True, None),
                                    (64, 80, torch.float32, False, 40),
                                    (4, 128, torch.bfloat16, True, None),
                                    (1, 128, torch.bfloat16, True, 64),
                                    (2, 64, torch.float32, True, None)):
        cases.append(QkNormCase(num_tokens=37, num_q_heads=32, num_k_heads=8, head_size=d,
                                head_pad=hp, dtype=dtype, is_neox=neox, rot_dim=rot,
                                bad_positions=2, max_position=4096))
    cases.append(QkNormCase(num_tokens=3000, num_q_heads=32, num_k_heads=8, head_size=128,
                            head_pad=64, dtype=torch.bfloat16, max_position=8192,
                            bad_positions=5, extra_rows=3))
    return cases


def _gpu_fused_matrix() -> list[QkNormCase]:
    """Every cache format of the cache write in both layouts on the model shapes, every K/V
    allocation (interleaved, separate, packed) in both layouts with uint8 and float8 fp8
    storage, every query destination (plain, spare region, fp8 per tensor and per head),
    rotate_key_in_place=False, head_dim 46, 80, 512, the special rows, padding and out-of-range
    slots and positions, T < T_rot and T = 0, many tokens. Sized for a GPU run of a few minutes
    (each case is a kernel build)."""
    cases = []
    formats = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2")
    shapes = ((32, 8, 128, torch.bfloat16), (8, 4, 256, torch.bfloat16),
              (16, 16, 64, torch.float16))
    for (hq, hk, d, dtype), kv, layout in itertools.product(shapes, formats, Layout):
        fp8 = kv.startswith("fp8")
        cases.append(QkNormCase(
            num_tokens=21, num_q_heads=hq, num_k_heads=hk, head_size=d, dtype=dtype,
            kv_cache_dtype=kv, layout=layout, alloc=KVAlloc.INTERLEAVED, num_blocks=4,
            padding_slots=2, out_of_range_slots=2, bad_positions=2,
            per_head_scale=fp8 and d == 128, weight_offset=1.0 if d == 256 else 0.0,
            max_position=4096))
    for layout, alloc in itertools.product(Layout, KVAlloc):
        kv = "auto" if layout is Layout.NHD else "fp8"
        cases.append(QkNormCase(num_tokens=17, num_q_heads=32, num_k_heads=8, head_size=128,
                                dtype=torch.bfloat16, kv_cache_dtype=kv, layout=layout,
                                alloc=alloc, num_blocks=4, is_neox=False,
                                fp8_storage="float8" if alloc is KVAlloc.PACKED else "uint8"))
    for qo, kv in itertools.product(("fp8_e4m3", "fp8_e5m2", "same", "spare"), ("auto", "fp8")):
        per_head = kv == "fp8"
        cases.append(QkNormCase(num_tokens=19, num_q_heads=32, num_k_heads=8, head_size=128,
                                dtype=torch.bfloat16, kv_cache_dtype=kv, query_out=qo,
                                q_scale_per_head=per_head and qo.startswith("fp8"),
                                rotate_key_in_place=per_head, bad_positions=2, num_blocks=4,
                                alloc=KVAlloc.PACKED))
    for d, kv in itertools.product((80, 512, 46), ("auto", "fp8")):
        cases.append(QkNormCase(num_tokens=11, num_q_heads=4, num_k_heads=2, head_size=d,
                                kv_cache_dtype=kv, dtype=torch.float32 if d == 46 else
                                torch.bfloat16, num_blocks=2))
    for special in SPECIALS[1:]:
        cases.append(QkNormCase(num_tokens=9, num_q_heads=32, num_k_heads=8, head_size=128,
                                dtype=torch.float32, special=special,
                                eps=0 if special in ("zeros", "tiny") else 1e-6,
                                kv_cache_dtype="fp8", query_out="fp8_e4m3", num_blocks=2))
    cases += [
        QkNormCase(num_tokens=4000, cache_tokens=3900, num_q_heads=32, num_k_heads=8,
                   head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16,
                   num_blocks=260, padding_slots=40, out_of_range_slots=10, bad_positions=5,
                   alloc=KVAlloc.PACKED, max_position=8192, extra_rows=3),
        QkNormCase(num_tokens=64, cache_tokens=0, num_q_heads=32, num_k_heads=8, head_size=128,
                   dtype=torch.bfloat16, kv_cache_dtype="fp8"),
        QkNormCase(num_tokens=30, num_q_heads=32, num_k_heads=8, head_size=128,
                   dtype=torch.bfloat16, block_size=12, num_blocks=3, slot_dtype=torch.int32,
                   pos_dtype=torch.int32, layout=Layout.HND, kv_cache_dtype="fp8_e5m2"),
    ]
    # Padded heads (see _gpu_norm_matrix) against auto and fp8 caches and the query
    # destinations, small and large calls.
    for hp, d, kv, qo, rot in ((64, 128, "auto", None, None), (64, 128, "fp8", "fp8_e4m3", None),
                               (64, 80, "auto", "same", 40), (64, 80, "fp8", None, None),
                               (4, 128, "fp8", None, 64), (1, 128, "auto", "spare", None)):
        cases.append(QkNormCase(num_tokens=21, num_q_heads=32, num_k_heads=8, head_size=d,
                                head_pad=hp, dtype=torch.bfloat16, kv_cache_dtype=kv,
                                query_out=qo, rot_dim=rot, rotate_key_in_place=qo is None,
                                num_blocks=4, padding_slots=2, bad_positions=2,
                                max_position=4096, alloc=KVAlloc.PACKED))
    cases.append(QkNormCase(num_tokens=4000, cache_tokens=3900, num_q_heads=32, num_k_heads=8,
                            head_size=128, head_pad=64, dtype=torch.bfloat16,
                            kv_cache_dtype="fp8", num_blocks=260, bad_positions=5,
                            max_position=8192))
    # Power-of-two scales (one product an element) beside scales that take the quotient, per
    # head and per tensor (1.0), fp8 caches and queries of both kinds, the special rows, small
    # and large calls.
    for kv, qo, per_head, dtype, special, t in (
            ("fp8", None, True, torch.bfloat16, "", 19),
            ("fp8_e5m2", None, True, torch.float16, "", 19),
            ("fp8", None, False, torch.bfloat16, "", 19),
            ("fp8", None, True, torch.bfloat16, "nan", 9),
            ("fp8_e5m2", None, True, torch.float16, "huge", 9),
            ("fp8", None, True, torch.bfloat16, "", 4000),
            ("fp8", "fp8_e4m3", True, torch.bfloat16, "", 19),
            ("fp8_e5m2", "fp8_e5m2", True, torch.float32, "nan", 9)):
        cases.append(QkNormCase(num_tokens=t, num_q_heads=32, num_k_heads=8, head_size=128,
                                dtype=dtype, kv_cache_dtype=kv, query_out=qo,
                                per_head_scale=per_head,
                                q_scale_per_head=per_head and qo is not None,
                                fp8_scales="pow2", special=special, padding_slots=2,
                                num_blocks=260 if t > 1000 else 4, max_position=8192,
                                alloc=KVAlloc.PACKED))
    # fp8_quantize_fast16's scales (the large-call build: 16-bit rows, FAST16_SCALES) beside
    # scales just outside, per head and per tensor, both fp8 kinds and 16-bit dtypes, the
    # special rows (NaN, ±inf and past every clamp), small calls (the small-call build, its
    # quotient) and large ones.
    for kv, per_head, dtype, special, t in (
            ("fp8", True, torch.bfloat16, "", 19), ("fp8_e5m2", True, torch.float16, "", 19),
            ("fp8", True, torch.bfloat16, "huge", 9), ("fp8_e5m2", True, torch.bfloat16, "inf", 9),
            ("fp8", True, torch.float16, "nan", 9), ("fp8", False, torch.bfloat16, "", 4000),
            ("fp8_e5m2", True, torch.float16, "", 4000)):
        cases.append(QkNormCase(num_tokens=t, num_q_heads=32, num_k_heads=8, head_size=128,
                                dtype=dtype, kv_cache_dtype=kv, per_head_scale=per_head,
                                fp8_scales="fast16", special=special, padding_slots=2,
                                num_blocks=260 if t > 1000 else 4, max_position=8192,
                                alloc=KVAlloc.PACKED))
    return cases


NORM_CASES: list[QkNormCase] = _norm_matrix()
FUSED_CASES: list[QkNormCase] = _fused_matrix()
GPU_NORM_CASES: list[QkNormCase] = _gpu_norm_matrix()
GPU_FUSED_CASES: list[QkNormCase] = _gpu_fused_matrix()


def differences(got: QkNormInputs, want: QkNormInputs, nan_equal: bool = False,
                names: tuple[str, ...] | None = None) -> str | None:
    """None when every tensor of the two calls (or those of ``names``) holds the same bytes over
    its whole allocation, else what differs (tensor, first differing bytes, got vs want). With
    ``nan_equal``, elements that decode to NaN on both sides (any sign or payload; fp8 codes of
    uint8 caches decoded by the cache's format) count as equal.

    The two may lie on different devices: each whole allocation is brought to the CPU (never a
    view alone, whose copy would be compact and lose the padding and the other tensors of its
    allocation). Their views must have the same geometry (dtype, shape, strides, offset,
    allocation size, sharing), else that is what differs."""
    from .compare import assert_caches_equal

    gt, wt = got.tensors(), want.tensors()
    if set(gt) != set(wt):
        return f"tensors differ: got {sorted(gt)}, want {sorted(wt)}"
    gg, wg = geometry(got), geometry(want)
    fields = ("dtype", "shape", "stride", "storage_offset", "allocation bytes", "allocation")
    fp8 = parse_kv_cache_dtype(want.kv_cache_dtype)
    for name in names or tuple(wt):
        for field, g, w in zip(fields, gg[name], wg[name], strict=True):
            if g != w:
                return f"{name}: {field} differs (got {g}, want {w})"
        decode = fp8.fp8_dtype if fp8.is_fp8 and name in ("key_cache", "value_cache") else None
        try:
            assert_caches_equal(gt[name], wt[name], name, decode, nan_equal)
        except AssertionError as e:
            return str(e)
    return None

