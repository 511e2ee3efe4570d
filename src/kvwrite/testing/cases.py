"""reshape_and_cache_flash's workload model, shared by the tests, the benchmark and the probes.

One :class:`Case` describes a call: shape, dtypes, layout and allocation (incl. packed), slots,
and the bytes it moves. Two input recipes build its tensors from it: :func:`make_inputs` for the
tests (random cache bytes, inputs spread over the fp8 range, unique random slots plus the padding
and out-of-range slots the case asks for) and ``kvwrite.bench.workload.make_input_sets`` for the
benchmark (vLLM's recipe). ``CASES`` is the matrix every implementation is tested on.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..dtypes import FP8_MAX, CacheDType
from ..layouts import KVAlloc, Layout, allocate_kv_cache, layout_alloc, layout_name
from .build import FlashWriteCase, fill_random_bytes, flag_parts, make_slot_mapping
from .compare import copy_allocations
from .slots import SlotPattern

__all__ = ["Case", "Inputs", "CASES", "make_inputs", "clone_caches", "special_values",
           "reciprocal_traps"]


@dataclasses.dataclass(frozen=True)
class Case(FlashWriteCase):
    num_heads: int = 8
    head_size: int = 64
    num_blocks: int = 12
    # key/value as slices of one fused [T, Hq + 2H, D] qkv tensor (token stride (Hq + 2H) * D).
    fused_qkv: bool = False
    # fp8 special values (NaN, ±inf, ±0, subnormals, past the maximum) in the inputs.
    special_values: bool = False
    # The benchmark's slot pattern (kvwrite.testing.slots): random (vLLM's), decode, prefill, mixed,
    # with its padding fraction. make_inputs (the tests' recipe) uses padding_slots instead.
    slots: SlotPattern = SlotPattern()

    @classmethod
    def named_layout(cls, name: str, **fields) -> Case:
        """A case whose layout and allocation are a benchmark layout name (NHD, HND: K and V
        blocks interleaved as vLLM allocates them; packed: one [.., 2*D] allocation)."""
        layout, alloc = layout_alloc(name)
        return cls(layout=layout, alloc=alloc, **fields)

    @property
    def layout_name(self) -> str:
        """NHD, HND or packed where the allocation is the benchmark's; else layout-allocation."""
        return layout_name(self.layout, self.alloc)

    @property
    def in_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def cache_elem_bytes(self) -> int:
        return self.cache_dtype.element_size(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K plus one block of V."""
        return 2 * self.block_size * self.num_heads * self.head_size * self.cache_elem_bytes

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def num_real(self, num_tokens: int | None = None) -> int:
        """Tokens that write: all but the slot pattern's padding."""
        t = self.num_tokens if num_tokens is None else num_tokens
        return t - self.slots.num_padding(t)

    def set_bytes(self, num_tokens: int | None = None) -> int:
        """Bytes of one input set: key, value and the slot mapping."""
        t = self.num_tokens if num_tokens is None else num_tokens
        return (2 * t * self.num_heads * self.head_size * self.in_bytes
                + t * self.slot_dtype.itemsize)

    def bytes_moved(self, num_tokens: int | None = None) -> int:
        """Bytes one call reads and writes: ``2*N*H*D*(in_bytes + cache_bytes) + T*slot_bytes``,
        N = the tokens that write (T less the slot pattern's padding, whose rows are not read)."""
        t = self.num_tokens if num_tokens is None else num_tokens
        return (2 * self.num_real(t) * self.num_heads * self.head_size * (self.in_bytes + self.cache_elem_bytes)
                + t * self.slot_dtype.itemsize)

    @property
    def id(self) -> str:
        parts = [f"T{self.num_tokens}", f"H{self.num_heads}", f"D{self.head_size}",
                 f"bs{self.block_size}", str(self.dtype).replace("torch.", ""),
                 *self.cache_id_parts()]
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.extra_rows, "extra"), (self.fused_qkv, "qkv"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.special_values, "special"))
        flag_parts(parts, flags)
        if not self.slots.is_default:
            parts.append(self.slots.id)
        return "-".join(parts)


@dataclasses.dataclass
class Inputs:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        return (self.key, self.value, self.key_cache, self.value_cache, self.slot_mapping,
                self.kv_cache_dtype, self.k_scale, self.v_scale)


def special_values(cache_dtype: CacheDType) -> list[float]:
    """Inputs that exercise every branch of the fp8 rule (before division by the scale)."""
    fp8 = cache_dtype.fp8_dtype
    mx = FP8_MAX[fp8]
    tiny = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[fp8]  # smallest subnormal
    return [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, mx, -mx,
            mx * 1.01, -mx * 1.2, mx * 1000, tiny, -tiny, tiny * 0.5, tiny * 0.5001, -tiny * 1.5,
            tiny * 2.5, 1e-30, -1e-30, 1.0625, 1.1875, 17.0, 1e38, -3e38]


def reciprocal_traps(fp8: torch.dtype, scale: float) -> list[float]:
    """float32 values x for which fp8(x / scale) != fp8(x * (1 / scale)) in float32 arithmetic.

    They sit next to the midpoints between adjacent fp8 values, where the one-ulp error of the
    reciprocal form changes the rounding; only a true division gets them right.
    """
    s = torch.tensor(scale, dtype=torch.float32)
    codes = torch.arange(0, 127, dtype=torch.uint8).view(fp8).float()
    codes = codes[torch.isfinite(codes)]
    mids = ((codes[:-1] + codes[1:]) / 2 * s).float()
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(float("-inf")))
    x = torch.cat([down, mids, up])
    x = x[torch.isfinite(x)]
    mx = FP8_MAX[fp8]
    by_div = (x / s).clamp(-mx, mx).to(fp8).view(torch.uint8)
    by_rcp = (x * (1 / s)).clamp(-mx, mx).to(fp8).view(torch.uint8)
    return x[by_div != by_rcp].tolist()


_SPECIAL_SCALES = (0.37, 2.7, 1.3)  # each has reciprocal traps for e4m3 and e5m2


def special_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k_scale and v_scale of ``n`` elements for special-value cases (v_scale: k's reversed)."""
    k = torch.tensor([_SPECIAL_SCALES[h % 3] for h in range(n)], dtype=torch.float32)
    return k, k.flip(0).clone()


def random_scales(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k_scale and v_scale of ``n`` elements that are not powers of two, so division and
    reciprocal-multiply can differ."""
    k_scale = (torch.rand(n, generator=gen) * 0.9 + 0.1) * 3.0
    v_scale = (torch.rand(n, generator=gen) * 0.9 + 0.1) * 0.37
    return k_scale, v_scale


def key_value_rows(num_tokens: int, extra_rows: int, num_heads: int, head_size: int,
                   dtype: torch.dtype, fused_qkv: bool, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value rows ``[num_tokens + extra_rows, H, D]``; with ``fused_qkv`` slices of
    one ``[rows, 2H + 2H, D]`` qkv tensor."""
    rows = num_tokens + extra_rows
    if fused_qkv:
        hq = 2 * num_heads
        qkv = torch.randn(rows, hq + 2 * num_heads, head_size, generator=gen).to(dtype)
        return qkv[:, hq:hq + num_heads], qkv[:, hq + num_heads:]
    key = torch.randn(rows, num_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(rows, num_heads, head_size, generator=gen).to(dtype)
    return key, value


def spread_fp8_magnitudes(tensors, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Scale each element by a random power of two over the whole fp8 range (subnormals,
    normals and saturation)."""
    for t in tensors:
        mag = torch.exp2(torch.randint(-20, 12, t.shape, generator=gen).float())
        t.mul_(mag.to(dtype))


def plant_special_values(cache_dtype: CacheDType, key: torch.Tensor, value: torch.Tensor,
                         scales: tuple[torch.Tensor, torch.Tensor], num_tokens: int) -> None:
    """Per head of key and value: the fp8 rule's special values, then the reciprocal traps of
    that head's scale."""
    fp8 = cache_dtype.fp8_dtype
    T, H, D = num_tokens, key.shape[1], key.shape[2]
    for t, sc in zip((key, value), scales, strict=True):
        for h in range(H):
            s = float(sc[h if sc.numel() > 1 else 0])
            vals = torch.tensor(special_values(cache_dtype) + reciprocal_traps(fp8, s))
            row = t[:T, h].reshape(-1).clone()
            n = min(vals.numel(), row.numel())
            row[:n] = vals[:n].to(t.dtype)
            t[:T, h].copy_(row.view(T, D))


def make_inputs(case: Case, device: str | torch.device = "cpu", seed: int = 0) -> Inputs:
    """Build the tensors of `case` on `device`; the caches' allocations hold random bits."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, H, D = case.num_tokens, case.num_heads, case.head_size
    key, value = key_value_rows(T, case.extra_rows, H, D, case.dtype, case.fused_qkv, gen)
    cdt = case.cache_dtype
    n = H if case.per_head_scale else 1
    if cdt.is_fp8:
        spread_fp8_magnitudes((key, value), case.dtype, gen)
        if case.special_values:
            plant_special_values(cdt, key, value, special_scales(n), T)

    slot_mapping = make_slot_mapping(case.id, T, case.num_blocks * case.block_size,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen,
                                     distinct_padding=False)

    key_cache, value_cache = allocate_kv_cache(case.num_blocks, case.block_size, H, D,
                                               case.cache_tensor_dtype, case.layout, case.alloc, "cpu")
    # Random bits over the whole allocation (the other half of a packed cache too, NaN patterns
    # included), so that a stray or a missing write shows.
    fill_random_bytes((key_cache, value_cache), gen)

    if cdt.is_fp8 and case.special_values:
        k_scale, v_scale = special_scales(n)
    elif cdt.is_fp8:
        k_scale, v_scale = random_scales(n, gen)
    else:
        k_scale = v_scale = torch.ones(1)

    moved = copy_allocations((key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale),
                             device, copy=False)
    return Inputs(*moved[:5], case.kv_cache_dtype, *moved[5:])


def clone_caches(inp: Inputs, device: str | torch.device | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of both caches (on `device`, default theirs) with their whole allocations, so bytes
    outside the logical views and the sharing of one allocation by K and V are kept."""
    key_cache, value_cache = copy_allocations((inp.key_cache, inp.value_cache), device)
    return key_cache, value_cache


def _matrix() -> list[Case]:
    cases: list[Case] = []
    # Every layout × allocation × cache dtype on a modest shape.
    for layout, alloc, kv in itertools.product(
            Layout, KVAlloc, ["auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2"]):
        cases.append(Case(layout=layout, alloc=alloc, kv_cache_dtype=kv, num_tokens=7))
    # Input dtypes against every cache dtype.
    for dtype, kv in itertools.product((torch.float16, torch.float32),
                                       ["auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2"]):
        cases.append(Case(dtype=dtype, kv_cache_dtype=kv, layout=Layout.HND))
    # Odd shapes.
    for h, d in ((1, 64), (13, 80), (8, 96), (3, 120), (5, 46), (2, 256), (1, 1), (4, 2)):
        for kv in ("auto", "fp8"):
            for layout in Layout:
                cases.append(Case(num_heads=h, head_size=d, kv_cache_dtype=kv, layout=layout,
                                  num_tokens=129 if h * d <= 512 else 7, num_blocks=16))
    # fp8 details: per-head scales, float8 storage, special values, e5m2.
    for kv, per_head, storage, layout in itertools.product(
            ("fp8", "fp8_e5m2"), (False, True), ("uint8", "float8"), Layout):
        cases.append(Case(kv_cache_dtype=kv, per_head_scale=per_head, fp8_storage=storage,
                          layout=layout, alloc=KVAlloc.PACKED, special_values=True, num_tokens=9,
                          num_heads=4, head_size=32, dtype=torch.float32))
    # Slots and rows.
    cases += [
        Case(num_tokens=1),
        Case(num_tokens=0),
        Case(num_tokens=0, extra_rows=3),
        Case(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
        Case(num_tokens=9, padding_slots=9),
        Case(num_tokens=5, out_of_range_slots=5, kv_cache_dtype="fp8", layout=Layout.HND),
        Case(num_tokens=7, extra_rows=5, fused_qkv=True, layout=Layout.HND, alloc=KVAlloc.INTERLEAVED),
        Case(num_tokens=7, fused_qkv=True, kv_cache_dtype="fp8", per_head_scale=True, alloc=KVAlloc.PACKED),
        Case(num_tokens=129, num_heads=2, head_size=64, block_size=32, num_blocks=6,
             padding_slots=10, slot_dtype=torch.int32, layout=Layout.HND, alloc=KVAlloc.PACKED),
        Case(num_tokens=192, num_heads=1, head_size=64, block_size=16, num_blocks=12),  # every slot
    ]
    return cases


CASES: list[Case] = _matrix()
