"""The NVFP4 writes' case model: one :class:`Nvfp4Case` describes a call (shapes, dtypes, rule,
the cache form and layout, V scales' layout, input slices, slots, scales, special values);
:func:`make_nvfp4_inputs` builds its tensors (deterministic by seed); :meth:`Nvfp4Inputs.call`
runs the public entry point; ``NVFP4_CASES`` is the CPU matrix every implementation is tested
on, ``NVFP4_GPU_CASES`` the larger one the GPU runs (docs/ops/nvfp4.md)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..ops.nvfp4 import (
    append_run_args,
    flash_run_args,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
    page_bytes,
)
from .build import WriteCase, flag_parts
from .compare import storage_bytes

__all__ = ["Nvfp4Case", "Nvfp4Inputs", "NVFP4_CASES", "NVFP4_GPU_CASES", "FORMS",
           "make_nvfp4_inputs", "special_groups", "clone_tensors", "clone_inputs",
           "assert_storages_equal", "tie_group_6_5"]

# vLLM's page layout ("vllm"), FlashInfer's separate tensors as a (k, v) tuple, as one 5-D
# tensor with K/V on dim 1 ("stacked"), and as a tuple of strided views into padded pages
# ("padded").
FORMS = ("vllm", "tuple", "stacked", "padded")


@dataclasses.dataclass(frozen=True)
class Nvfp4Case(WriteCase):
    num_heads: int = 2
    head_size: int = 64
    kv_cache_dtype: str = "nvfp4"      # FlashInfer's forms: "nvfp4" only (their one rule)
    layout: str = "NHD"                 # NHD or HND (FlashInfer's kv_layout)
    v_scale_layout: str | None = "linear"  # vllm form: None (the device's default), linear, swizzled
    form: str = "vllm"
    # vllm form: extra bytes after each block's K and V sides (s0 > bs*H*F); padded form: extra
    # bytes per entry row (data and scales).
    pad: int = 0
    qkv_slices: bool = False            # key/value are slices of a fused [T, Hq + 2H, D] qkv
    misaligned: bool = False            # inputs start 1 element past a 16-byte boundary
    special_values: bool = False        # the special groups of docs/ops/nvfp4.md in the rows
    k_scale: float = 2.0**-5  # a power of two: the special groups' ties are exact ties
    v_scale: float = 0.003
    scale_as_number: bool = False       # FlashInfer forms: Python-number scales

    @property
    def four_over_six(self) -> bool:
        return self.kv_cache_dtype == "nvfp4_4over6"

    @property
    def id(self) -> str:
        parts = [self.form, self.layout, f"T{self.num_tokens}", f"H{self.num_heads}",
                 f"D{self.head_size}", f"bs{self.block_size}",
                 str(self.dtype).removeprefix("torch."), self.kv_cache_dtype]
        if self.form == "vllm":
            parts.append(f"v-{self.v_scale_layout or 'default'}")
        flags = ((self.pad, f"pad{self.pad}"), (self.extra_rows, "extra"),
                 (self.qkv_slices, "qkv"), (self.misaligned, "misaligned"),
                 (self.padding_slots, f"padslots{self.padding_slots}"),
                 (self.out_of_range_slots, f"oor{self.out_of_range_slots}"),
                 (self.special_values, "special"),
                 (self.scale_as_number, "pyscale"),
                 (self.slot_dtype == torch.int32, "i32"))
        return "-".join(flag_parts(parts, flags))


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def tie_group_6_5(k: float = 1.0) -> list[float]:
    """a = 11.25k: x = 2.34375k, 4.6875k, 9.375k sit on E2M1 midpoints by division (1.25, 2.5,
    5 times d = 1.875k) and take codes 3, 5, 7 by the reciprocal (docs/ops/nvfp4.md; exact for a
    power-of-two k)."""
    return [11.25 * k, 2.34375 * k, 4.6875 * k, 9.375 * k] + [0.0] * 12


def special_groups(k: float) -> list[list[float]]:
    """Groups of 16 that exercise every branch of the rule for the per-tensor scale ``k``: all
    zero, -0, one huge value, subnormal and saturating scales, s <= 2^-10, exact E2M1 and E4M3
    ties (exact where k is a power of two, and the inputs hold the values: bfloat16 does), NaN
    (one, all), +-inf."""
    nan, inf = float("nan"), float("inf")
    six_k = _f32(6.0 * k)
    return [
        [0.0] * 16,
        [-0.0] * 16,
        [0.0, -0.0] * 8,
        [1e30] + [1.0, -1.0, 0.5, -0.25] * 3 + [3.0, -2.0, 0.0],
        # a/(6k) just below 2^-6: S subnormal
        [six_k * 2.0**-7 * (1 + i / 32) * (-1) ** i for i in range(16)],
        # a/(6k) past 448: S saturates at 448
        [six_k * 600.0] + [six_k * 600.0 * i / 16 for i in range(1, 16)],
        # a/(6k) = 2^-10 exactly: a tie between 0 and 2^-9, to S = 0
        [six_k * 2.0**-10] + [six_k * 2.0**-11] * 15,
        # a/(6k) = 2^-10 * 1.01: S = 2^-9 (0x01)
        [six_k * 2.0**-10 * 1.01] * 16,
        # E4M3 ties: s = 1.0625 (between 1 and 1.125), 1.1875, 1.5 * 2^-9 (subnormal)
        [six_k * 1.0625] + [0.1 * six_k] * 15,
        [six_k * 1.1875] + [-0.1 * six_k] * 15,
        [six_k * 1.5 * 2.0**-9] * 16,
        # E2M1 ties: a = 6k makes d = k; every midpoint times k and its negative
        [six_k] + [m * k for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)]
        + [-m * k for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)] + [0.0],
        tie_group_6_5(k),
        [nan] + [k] * 15,
        [nan] * 16,
        [-nan, 2.0 * k, -3.0 * k] + [0.5 * k] * 13,
        [inf, k, -k] + [0.0] * 13,
        [-inf] + [2.0 * k] * 15,
        [inf, -inf] + [k] * 14,
    ]


def _cases() -> list[Nvfp4Case]:
    c = Nvfp4Case
    cases = []
    for form, layout, kv in itertools.product(FORMS, ("NHD", "HND"), ("nvfp4", "nvfp4_4over6")):
        if form != "vllm" and kv != "nvfp4":
            continue  # FlashInfer's form has one rule
        cases.append(c(form=form, layout=layout, kv_cache_dtype=kv, padding_slots=1,
                       out_of_range_slots=1))
    for v_layout in ("linear", "swizzled", None):
        for layout in ("NHD", "HND"):
            cases.append(c(layout=layout, v_scale_layout=v_layout, special_values=True,
                           num_tokens=9, block_size=8))
    for d, h, bs in ((16, 3, 1), (48, 1, 5), (80, 2, 4), (128, 1, 4), (256, 1, 2), (96, 4, 3)):
        cases.append(c(head_size=d, num_heads=h, block_size=bs, num_tokens=5, num_blocks=3))
    cases += [
        c(dtype=torch.float16, special_values=True, v_scale_layout="swizzled"),
        c(dtype=torch.float32, special_values=True, layout="HND"),
        c(dtype=torch.float32, kv_cache_dtype="nvfp4_4over6", special_values=True),
        c(kv_cache_dtype="nvfp4_4over6", special_values=True, v_scale_layout="swizzled"),
        c(qkv_slices=True, extra_rows=3, slot_dtype=torch.int32, padding_slots=2,
          out_of_range_slots=2),
        c(form="tuple", qkv_slices=True, layout="HND", scale_as_number=True),
        c(form="stacked", special_values=True, scale_as_number=True, slot_dtype=torch.int32),
        c(form="padded", pad=8, special_values=True, layout="HND"),
        c(form="padded", pad=3, misaligned=True),
        c(misaligned=True, pad=5, num_heads=1, head_size=16, block_size=1),
        c(pad=7, layout="HND", v_scale_layout="swizzled"),
        c(num_tokens=0, extra_rows=2),
        c(num_tokens=1, num_heads=8, head_size=128, block_size=16),
        c(num_tokens=40, num_heads=1, head_size=64, block_size=4, num_blocks=16,
          v_scale_layout="swizzled", padding_slots=5, out_of_range_slots=3),
    ]
    return cases


NVFP4_CASES = _cases()


def _gpu_cases() -> list[Nvfp4Case]:
    """The GPU matrix: every form, layout, rule and V scale layout over D 64/128/256 (and other
    multiples of 16 with linear scales), block sizes, GQA head counts, dtypes, slots and inputs.
    About 100 cases: each compiles its own Triton and CUDA builds."""
    c = Nvfp4Case
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    cases = list(NVFP4_CASES)
    i = 0
    for form, layout, kv, d in itertools.product(FORMS, ("NHD", "HND"),
                                                 ("nvfp4", "nvfp4_4over6"), (64, 128, 256)):
        if form != "vllm" and kv != "nvfp4":
            continue
        for v_layout in (("linear", "swizzled") if form == "vllm" else ("linear",)):
            i += 1
            cases.append(c(form=form, layout=layout, kv_cache_dtype=kv, dtype=dtypes[i % 3],
                           head_size=d, v_scale_layout=v_layout, num_heads=8 if d < 256 else 2,
                           num_tokens=300, num_blocks=40, block_size=16, padding_slots=7,
                           out_of_range_slots=5, special_values=True,
                           qkv_slices=d == 128, extra_rows=4,
                           slot_dtype=torch.int32 if i % 2 else torch.int64,
                           scale_as_number=form != "vllm" and d == 256))
    for j, d in enumerate((16, 32, 48, 80, 96, 112, 144, 192)):
        bs = (1, 3, 16, 32)[j % 4]
        cases.append(c(head_size=d, block_size=bs, num_heads=5, num_tokens=100,
                       num_blocks=-(-128 // bs), special_values=True, padding_slots=3,
                       dtype=dtypes[j % 3], layout=("NHD", "HND")[j % 2]))
    for h in (1, 4, 16, 64):
        cases.append(c(num_heads=h, head_size=128, num_tokens=70, block_size=32, num_blocks=4,
                       v_scale_layout="swizzled", layout="HND"))
    cases += [c(num_tokens=20000, num_heads=8, head_size=128, block_size=16, num_blocks=1300),
              c(num_tokens=4096, num_heads=2, head_size=64, block_size=16, num_blocks=300,
                kv_cache_dtype="nvfp4_4over6", v_scale_layout="swizzled", layout="HND"),
              c(misaligned=True, num_tokens=64, head_size=128, pad=3),
              c(form="padded", pad=5, misaligned=True, num_tokens=64, head_size=256)]
    return cases


NVFP4_GPU_CASES = _gpu_cases()


@dataclasses.dataclass
class Nvfp4Inputs:
    case: Nvfp4Case
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | float
    v_scale: torch.Tensor | float
    # vllm form: key_cache, value_cache; FlashInfer forms: paged_kv_cache, kv_cache_sf
    caches: tuple

    def tensors(self) -> list[torch.Tensor]:
        """The written tensors (each compared over its whole allocation)."""
        out = []
        for c in self.caches:
            out += list(c) if isinstance(c, tuple) else [c]
        return out

    def call(self, implementation: str | None = None) -> None:
        """The public entry point of this case's form."""
        from ..ops.reshape_and_cache_flash import reshape_and_cache_flash
        c = self.case
        if c.form == "vllm":
            reshape_and_cache_flash(self.key, self.value, *self.caches, self.slot_mapping,
                                    c.kv_cache_dtype, self.k_scale, self.v_scale,
                                    v_scale_layout=c.v_scale_layout,
                                    implementation=implementation)
        else:
            nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
                self.key, self.value, self.slot_mapping, *self.caches, self.k_scale,
                self.v_scale, c.layout, implementation=implementation)

    def run_args(self) -> tuple:
        """The internal op's validated ``run`` arguments for this call."""
        c = self.case
        if c.form == "vllm":
            return flash_run_args(self.key, self.value, *self.caches, self.slot_mapping,
                                  c.kv_cache_dtype, self.k_scale, self.v_scale, c.v_scale_layout)
        return append_run_args(self.key, self.value, self.slot_mapping, *self.caches,
                               self.k_scale, self.v_scale, c.layout)

    def with_caches(self, caches: tuple) -> Nvfp4Inputs:
        return dataclasses.replace(self, caches=caches)


def _rows(case: Nvfp4Case, g: torch.Generator) -> torch.Tensor:
    """Float32 rows [T_pad, H, D]: per-group magnitudes spread over 2^-8 .. 2^8 times the scale's
    reach, special groups where asked."""
    t_pad = case.num_tokens + case.extra_rows
    h, d = case.num_heads, case.head_size
    n = t_pad * h * (d // 16)
    x = torch.randn(n, 16, generator=g)
    mag = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g).float())
    x = (x * mag).reshape(t_pad, h, d)
    return x


def _specials(x: torch.Tensor, k: float, g: torch.Generator) -> None:
    """Overwrite some groups of ``x`` (float32 [T, H, D]) with special groups."""
    groups = x.reshape(-1, 16)
    sp = special_groups(k)
    idx = torch.randperm(groups.shape[0], generator=g)[:len(sp)]
    for i, row in zip(idx.tolist(), sp, strict=False):
        groups[i] = torch.tensor(row, dtype=torch.float32)


def _input_pair(case: Nvfp4Case, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    k = _rows(case, g)
    v = _rows(case, g)
    if case.special_values:
        _specials(k, _f32(case.k_scale), g)
        _specials(v, _f32(case.v_scale), g)
    k, v = k.to(case.dtype), v.to(case.dtype)
    if case.special_values:
        # Negative NaNs (casts to 16 bits drop a NaN's sign), by their bits.
        ints = {2: torch.int16, 4: torch.int32}[k.element_size()]
        bits = {torch.bfloat16: -63, torch.float16: -511, torch.float32: -4194303}[case.dtype]
        for t in (k, v):
            flat = t.view(ints).reshape(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:3]] = bits
    t_pad, h, d = k.shape
    if case.qkv_slices:
        hq = 3
        qkv = torch.randn(t_pad, hq + 2 * h, d, generator=g).to(case.dtype)
        qkv[:, hq:hq + h] = k
        qkv[:, hq + h:] = v
        qkv = qkv.to(device)
        return qkv[:, hq:hq + h], qkv[:, hq + h:]
    if case.misaligned:
        buf = torch.empty(2 * k.numel() + 2, dtype=case.dtype, device=device)
        kk = buf[1:1 + k.numel()].view(k.shape)
        vv = buf[1 + k.numel():1 + 2 * k.numel()].view(v.shape)
        kk.copy_(k)
        vv.copy_(v)
        return kk, vv
    return k.to(device), v.to(device)


def _slots(case: Nvfp4Case, g: torch.Generator, device) -> torch.Tensor:
    num_slots = case.num_blocks * case.block_size
    t = case.num_tokens
    slots = torch.randperm(num_slots, generator=g)[:t]
    if slots.numel() < t:
        # More tokens than slots: the rest go past the cache (skipped). Never a duplicate slot:
        # which of two tokens with one slot wins is undefined, so no test may depend on it.
        slots = torch.cat([slots, num_slots + torch.arange(t - slots.numel())])
    pos = torch.randperm(t, generator=g)
    npad = min(case.padding_slots, t)
    slots[pos[:npad]] = -1
    noor = min(case.out_of_range_slots, t - npad)
    slots[pos[npad:npad + noor]] = num_slots + torch.randint(0, 1000, (noor,), generator=g)
    return slots.to(case.slot_dtype).to(device)


def _random_bytes(shape, g: torch.Generator, device) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)


def _vllm_caches(case: Nvfp4Case, g, device) -> tuple:
    nb, bs, h, d = case.num_blocks, case.block_size, case.num_heads, case.head_size
    f = page_bytes(d)
    side = bs * h * f
    # (nb, 2 sides (+ pad bytes each)) as vLLM allocates, permuted to logical order.
    buf = _random_bytes((nb * 2 * (side + case.pad) + case.pad,), g, device)
    s0 = 2 * (side + case.pad)
    strides = (s0, h * f, f, 1) if case.layout == "NHD" else (s0, f, bs * f, 1)
    k = buf.as_strided((nb, bs, h, f), strides, case.pad)
    v = buf.as_strided((nb, bs, h, f), strides, case.pad + side + case.pad)
    return (k, v)


def _fi_pair(case: Nvfp4Case, per_head: int, dtype: torch.dtype, g, device):
    """FlashInfer's (k, v) of one kind (data: per_head = D/2 uint8; scales: D/16 float8)."""
    p, e, h = case.num_blocks, case.block_size, case.num_heads
    phys = (p, e, h, per_head) if case.layout == "NHD" else (p, h, e, per_head)
    if case.form == "stacked":
        shape = (phys[0], 2, *phys[1:])
        t = _random_bytes(shape, g, device)
        return t.view(dtype) if dtype != torch.uint8 else t
    if case.form == "padded":
        out = []
        for _ in range(2):
            full = _random_bytes((*phys[:3], per_head + case.pad), g, device)
            t = full[..., case.pad:]
            out.append(t.view(dtype) if dtype != torch.uint8 else t)
        return tuple(out)
    out = []
    for _ in range(2):
        t = _random_bytes(phys, g, device)
        out.append(t.view(dtype) if dtype != torch.uint8 else t)
    return tuple(out)


def make_nvfp4_inputs(case: Nvfp4Case, device: str | torch.device = "cpu",
                      seed: int = 0) -> Nvfp4Inputs:
    g = torch.Generator().manual_seed(seed)
    key, value = _input_pair(case, g, device)
    slots = _slots(case, g, device)
    if case.form == "vllm":
        caches = _vllm_caches(case, g, device)
    else:
        caches = (_fi_pair(case, case.head_size // 2, torch.uint8, g, device),
                  _fi_pair(case, case.head_size // 16, torch.float8_e4m3fn, g, device))
    if case.scale_as_number and case.form != "vllm":
        ks, vs = case.k_scale, case.v_scale
    else:
        ks = torch.tensor([case.k_scale], dtype=torch.float32, device=device)
        vs = torch.tensor(case.v_scale, dtype=torch.float32, device=device)
    return Nvfp4Inputs(case, key, value, slots, ks, vs, caches)


def clone_tensors(tensors: list[torch.Tensor], device: str | torch.device | None = None
                  ) -> list[torch.Tensor]:
    """Copies of ``tensors`` over copies of their whole allocations (on ``device``, default
    theirs); tensors sharing an allocation share its copy."""
    storages: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in storages:
            storages[key] = storage_bytes(t).to(device or t.device, copy=True)
        out.append(storages[key].view(t.dtype).as_strided(t.shape, t.stride(),
                                                          t.storage_offset()))
    return out


def clone_inputs(inp: Nvfp4Inputs, device=None) -> Nvfp4Inputs:
    """``inp`` with its caches replaced by copies of their whole allocations."""
    flat = clone_tensors(inp.tensors(), device)
    it = iter(flat)
    caches = tuple(tuple(next(it) for _ in c) if isinstance(c, tuple) else next(it)
                   for c in inp.caches)
    return inp.with_caches(caches)


def assert_storages_equal(actual: list[torch.Tensor], expected: list[torch.Tensor],
                          what: str = "cache") -> None:
    """Every byte of the allocations behind each pair, with the first differing offsets."""
    seen = set()
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        key = a.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        ab, eb = storage_bytes(a).cpu(), storage_bytes(e).cpu()
        if ab.numel() != eb.numel():
            raise AssertionError(f"{what}[{i}]: allocation sizes differ ({ab.numel()} vs "
                                 f"{eb.numel()} bytes)")
        diff = torch.nonzero(ab != eb).flatten()
        if diff.numel():
            first = diff[:8].tolist()
            raise AssertionError(
                f"{what}[{i}]: {diff.numel()} bytes differ; first at byte offsets {first} "
                f"(from the allocation's start): got {ab[diff[:8]].tolist()}, expected "
                f"{eb[diff[:8]].tolist()}")
