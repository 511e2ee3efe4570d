"""The MX writes' case model: one :class:`MxCase` describes a call of
``reshape_and_cache_flash(..., "mxfp8" | "mxfp4")`` (shapes, dtypes, rule, the data caches' layout
of §1.2, the scale caches' layout, dtype and allocation, slots, special values);
:func:`make_mx_inputs` builds its arguments (deterministic by seed, random bytes over every
allocation), in the order :func:`call_mx` takes them; ``MX_CASES`` is the matrix every
implementation is tested on (SPEC §10.3)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from .. import formats
from ..layouts import allocate_kv_cache, layout_alloc
from ..ops.mx_kv_write import flash_run_args, scale_cache_shape
from ..ops.reshape_and_cache_flash import reshape_and_cache_flash
from .build import WriteCase, fill_random_bytes, flag_parts, make_slot_mapping
from .compare import storage_bytes

__all__ = ["MxCase", "MX_CASES", "MX_GPU_CASES", "DATA_LAYOUTS", "SCALE_ALLOCS", "MUTATES",
           "NAMES", "make_mx_inputs", "call_mx", "special_groups", "run_args", "mx_differences",
           "assert_mx_caches_equal"]

# §1.2's data cache layouts (kvwrite.layouts' names) and SGLang's inline rows ("inline": each row
# [F data bytes | D/32 scale bytes], the scale caches viewing the tails; linear scales only).
DATA_LAYOUTS = ("NHD", "HND", "packed", "HND-packed", "inline")
# The scale caches: one allocation each ("separate"), K and V blocks of one allocation
# ("interleaved"), or ("permuted") a linear cache stored [nb, H, bs, G] and viewed logically.
SCALE_ALLOCS = ("separate", "interleaved", "permuted")
# The positions call_mx's arguments write: key_cache, value_cache, k_scale_cache, v_scale_cache.
MUTATES = (2, 3, 6, 7)
NAMES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
# The e4m3fn NaN codes: which one an mxfp8 NaN element stores is unspecified (SPEC §10.3).
_E4M3_NAN = (0x7F, 0xFF)


@dataclasses.dataclass(frozen=True)
class MxCase(WriteCase):
    num_heads: int = 2
    head_size: int = 64
    kv_cache_dtype: str = "mxfp8"
    layout: str = "NHD"
    cache_storage: str = "uint8"        # mxfp8: "uint8" or "float8" (float8_e4m3fn)
    scale_layout: str = "linear"
    scale_storage: str = "uint8"        # "uint8" or "e8m0" (float8_e8m0fnu)
    scale_alloc: str = "separate"
    scale_rule: str = "ceil"
    special_values: bool = False

    @property
    def id(self) -> str:
        parts = [self.kv_cache_dtype, self.layout, f"T{self.num_tokens}", f"H{self.num_heads}",
                 f"D{self.head_size}", f"bs{self.block_size}",
                 str(self.dtype).removeprefix("torch."), self.scale_rule, self.scale_layout,
                 self.scale_alloc]
        flags = ((self.cache_storage != "uint8", self.cache_storage),
                 (self.scale_storage != "uint8", self.scale_storage),
                 (self.extra_rows, "extra"),
                 (self.padding_slots, f"padslots{self.padding_slots}"),
                 (self.out_of_range_slots, f"oor{self.out_of_range_slots}"),
                 (self.special_values, "special"),
                 (self.slot_dtype == torch.int32, "i32"))
        return "-".join(flag_parts(parts, flags))


def special_groups(element_max: float) -> list[list[float]]:
    """Groups of 32 that exercise every branch of SPEC §10.3's rule for an element of largest
    value ``element_max`` (448 or 6): zero, -0, NaN (one, all), +-inf, tiny values (bfloat16
    subnormals), amax exactly M * 2^k and one float32 ulp above, amax whose mantissa is above
    m_M (floor saturates), and a power of two."""
    nan, inf = float("nan"), float("inf")
    m = element_max
    ulp_above = torch.tensor(m * 2.0**-3, dtype=torch.float32)
    above = torch.nextafter(ulp_above, torch.tensor(float("inf"))).item()
    return [
        [0.0] * 32,
        [-0.0, 0.0] * 16,
        [nan] + [1.0, -0.5] * 15 + [0.25],
        [nan] * 32,
        [inf] + [1.0, -2.0, 3.0e-30, 0.0] * 7 + [-1.0, 5.0, 0.5],
        [-inf, inf] + [0.75] * 30,
        [1.0e-40, -9.2e-41, 2.0**-133] + [2.0**-130 * (1 + i / 8) for i in range(29)],
        [m * 2.0**-3] + [m * 2.0**-3 * i / 32 for i in range(31)],
        [above] + [-m * 2.0**-3] * 3 + [m * 2.0**-6 * i / 7 for i in range(28)],
        [1.9 * 2.0**10, -1.8 * 2.0**10] + [1.0 + i / 16 for i in range(30)],
        [2.0**-5] * 16 + [-(2.0**-7)] * 16,
    ]


def _cases() -> list[MxCase]:
    c = MxCase
    cases = []
    for mode, layout in itertools.product(("mxfp8", "mxfp4"), DATA_LAYOUTS):
        cases.append(c(kv_cache_dtype=mode, layout=layout, num_tokens=9, padding_slots=2,
                       out_of_range_slots=1, special_values=True))
    for mode in ("mxfp8", "mxfp4"):
        cases += [
            c(kv_cache_dtype=mode, scale_rule="floor", special_values=True, num_tokens=6,
              dtype=torch.float32),
            c(kv_cache_dtype=mode, head_size=128, block_size=128, num_blocks=2,
              scale_layout="interleaved128", num_tokens=7, padding_slots=1, special_values=True,
              scale_storage="e8m0"),
            c(kv_cache_dtype=mode, head_size=128, block_size=256, num_blocks=2, layout="HND",
              scale_layout="interleaved128", scale_alloc="interleaved", num_tokens=5,
              dtype=torch.float16, scale_rule="floor", slot_dtype=torch.int32),
            c(kv_cache_dtype=mode, scale_alloc="interleaved", scale_storage="e8m0",
              dtype=torch.float16, num_tokens=5, extra_rows=3, slot_dtype=torch.int32),
            c(kv_cache_dtype=mode, scale_alloc="permuted", head_size=32, num_heads=3,
              block_size=4, num_tokens=6, dtype=torch.float32, special_values=True),
        ]
    cases.append(c(kv_cache_dtype="mxfp8", cache_storage="float8", layout="HND-packed",
                   num_tokens=6, special_values=True, scale_storage="e8m0"))
    return cases


MX_CASES = _cases()
# Larger calls for the GPU (many tokens per block, every head size the layouts take).
# 400 slots at least: room for the 292 placed tokens at every block size.
MX_GPU_CASES = [dataclasses.replace(case, num_tokens=300, num_blocks=-(-400 // case.block_size),
                                    padding_slots=5, out_of_range_slots=3)
                for case in MX_CASES]


def _scale_caches(case: MxCase, device) -> tuple[torch.Tensor, torch.Tensor]:
    nb, bs, h, d = case.num_blocks, case.block_size, case.num_heads, case.head_size
    shape = scale_cache_shape(case.scale_layout, nb, bs, h, d)
    if case.scale_alloc == "separate":
        return (torch.empty(shape, dtype=torch.uint8, device=device),
                torch.empty(shape, dtype=torch.uint8, device=device))
    if case.scale_alloc == "interleaved":
        both = torch.empty((nb, 2, *shape[1:]), dtype=torch.uint8, device=device)
        return both[:, 0], both[:, 1]
    if case.scale_layout != "linear":
        raise ValueError(f"case {case.id}: 'permuted' scale caches are linear ones")
    phys = (nb, h, bs, shape[3])
    return (torch.empty(phys, dtype=torch.uint8, device=device).permute(0, 2, 1, 3),
            torch.empty(phys, dtype=torch.uint8, device=device).permute(0, 2, 1, 3))


def make_mx_inputs(case: MxCase, device="cpu", seed: int = 0) -> tuple:
    """The arguments of :func:`call_mx` for ``case``: random rows (special groups in some where
    asked), random bytes over every cache allocation, the slots."""
    gen = torch.Generator().manual_seed(seed)
    t, h, d = case.num_tokens, case.num_heads, case.head_size
    rows = t + case.extra_rows
    fmt = formats.lookup(case.kv_cache_dtype)
    f = fmt.data_bytes(d)
    key = torch.randn(rows, h, d, generator=gen) * 2.0
    value = torch.randn(rows, h, d, generator=gen) * 0.01
    if case.special_values:
        element_max = 448.0 if fmt.element_bits() == 8 else 6.0
        groups = torch.tensor(special_groups(element_max), dtype=torch.float32).reshape(-1)
        for x, shift in ((key, 0), (value, 3)):
            flat = x.view(-1)
            n = min(groups.numel(), flat.numel())
            flat[:n] = groups.roll(32 * shift)[:n]
    key, value = key.to(case.dtype).to(device), value.to(case.dtype).to(device)
    if case.layout == "inline":
        if case.scale_layout != "linear":
            raise ValueError(f"case {case.id}: inline rows hold linear scales")
        inline = torch.empty(case.num_blocks, 2, case.block_size, h, fmt.row_bytes(d),
                            dtype=torch.uint8, device=device)
        kc, vc = inline[:, 0, ..., :f], inline[:, 1, ..., :f]
        ks, vs = inline[:, 0, ..., f:], inline[:, 1, ..., f:]
    else:
        layout, alloc = layout_alloc(case.layout)
        kc, vc = allocate_kv_cache(case.num_blocks, case.block_size, h, f, torch.uint8, layout,
                                   alloc, device)
        ks, vs = _scale_caches(case, device)
    fill_random_bytes((kc, vc, ks, vs), gen)
    if case.cache_storage == "float8":
        kc, vc = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
    if case.scale_storage == "e8m0":
        ks, vs = ks.view(torch.float8_e8m0fnu), vs.view(torch.float8_e8m0fnu)
    slots = make_slot_mapping(case.id, t, case.num_slots, case.padding_slots,
                              case.out_of_range_slots, case.slot_dtype, gen).to(device)
    return (key, value, kc, vc, slots, case.kv_cache_dtype, ks, vs, case.scale_rule,
            case.scale_layout)


def call_mx(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale_cache,
            v_scale_cache, scale_rule, scale_layout, implementation=None) -> None:
    """``reshape_and_cache_flash`` with the MX keywords from positional arguments."""
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
                            scale_rule=scale_rule, scale_layout=scale_layout,
                            implementation=implementation)


def run_args(args: tuple) -> tuple:
    """The internal op's validated ``run`` arguments of :func:`call_mx`'s ``args``."""
    return flash_run_args(*args)


def _view_mask(t: torch.Tensor) -> torch.Tensor:
    """Bool per byte of ``t``'s allocation: does a byte of the view ``t`` hold it."""
    marks = torch.zeros_like(storage_bytes(t))
    es = t.element_size()
    marks.as_strided(t.shape + (es,), tuple(es * st for st in t.stride()) + (1,),
                     es * t.storage_offset()).fill_(1)
    return marks.bool()


def mx_differences(case_mode: str, got, want) -> str | None:
    """None where the four written tensors' allocations (key_cache, value_cache, k_scale_cache,
    v_scale_cache, in that order) hold the same bytes, else what differs: every byte exact, but
    for mxfp8 data-cache bytes where both hold an e4m3fn NaN code (which one is unspecified)."""
    nan_ok = {}
    if case_mode == "mxfp8":
        for g, w in zip(got[:2], want[:2], strict=True):
            a, e = storage_bytes(g).cpu(), storage_bytes(w).cpu()
            both = (torch.isin(a, torch.tensor(_E4M3_NAN, dtype=torch.uint8))
                    & torch.isin(e, torch.tensor(_E4M3_NAN, dtype=torch.uint8)))
            key = (g.device, g.untyped_storage().data_ptr())
            nan_ok[key] = nan_ok.get(key, torch.zeros_like(both)) | (both & _view_mask(g).cpu())
    for name, g, w in zip(NAMES, got, want, strict=True):
        a, e = storage_bytes(g).cpu(), storage_bytes(w).cpu()
        if a.numel() != e.numel():
            return f"{name}: allocation sizes differ ({a.numel()} vs {e.numel()} bytes)"
        diff = a != e
        ok = nan_ok.get((g.device, g.untyped_storage().data_ptr()))
        if ok is not None:
            diff &= ~ok
        where = torch.nonzero(diff).flatten()
        if where.numel():
            first = where[:8].tolist()
            return (f"{name}: {where.numel()} bytes differ; first at byte offsets {first}: got "
                    f"{a[where[:8]].tolist()}, expected {e[where[:8]].tolist()}")
    return None


def assert_mx_caches_equal(case: MxCase, got, want) -> None:
    why = mx_differences(case.kv_cache_dtype, list(got), list(want))
    if why is not None:
        raise AssertionError(why)
