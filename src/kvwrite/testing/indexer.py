"""indexer_k_quant_and_cache's case model: one :class:`IndexerCase` describes a call (head dim and
group size, input dtype, scale format, block size, page stride and alignment, token stride, slots,
special values); :func:`make_indexer_inputs` builds its tensors; :func:`assert_indexer_caches_equal`
is the byte comparison over the whole allocation (two NaN codes count as equal only where a page
holds codes, as the fp8 rule allows); :func:`decode_scales` and :func:`dequantize_rows` read
slots' scale bytes and codes back in each scale format (round trips, consumers); ``INDEXER_CASES`` is the matrix every implementation is
tested on (small enough for the CPU), ``INDEXER_GPU_CASES`` the larger one for the GPU."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..ops.indexer_k_quant_and_cache.op import (
    E4M3_MAX,
    MXFP8_GROUP,
    ScaleFormat,
    entry_size,
    parse_scale_fmt,
)
from .build import WriteCase, flag_parts, make_slot_mapping
from .compare import copy_allocations, differing_bytes, nan_mask, storage_bytes

__all__ = ["IndexerCase", "IndexerInputs", "INDEXER_CASES", "INDEXER_GPU_CASES",
           "make_indexer_inputs", "clone_cache", "assert_indexer_caches_equal",
           "indexer_differing_bytes", "pow2_boundary_amaxes", "exact_quotient_inputs",
           "decode_scales", "dequantize_rows"]


@dataclasses.dataclass(frozen=True)
class IndexerCase(WriteCase):
    head_dim: int = 128
    quant_block_size: int = 128
    scale_fmt: str = "ue8m0"
    # k as a slice of a wider [T, D + k_pad] tensor (token stride D + k_pad).
    k_pad: int = 0
    # Pages page_pad bytes apart beyond their size (kv_cache.stride(0) free), the first one
    # cache_offset bytes into the allocation (unaligned pages when odd).
    page_pad: int = 0
    cache_offset: int = 0
    # Groups that exercise every branch of the scale: all zero (the 1e-4 floor), tiny, one NaN,
    # all NaN, ±inf, the largest finite values, and (float32 input) amaxes whose scale is exactly
    # or a few ulps above a power of two.
    special_values: bool = False
    seed_offset: int = 0

    @property
    def groups(self) -> int:
        return self.head_dim // self.quant_block_size

    @property
    def entry(self) -> int:
        return entry_size(self.head_dim, self.quant_block_size)

    @property
    def id(self) -> str:
        parts = [f"T{self.num_tokens}", f"D{self.head_dim}", f"q{self.quant_block_size}",
                 f"bs{self.block_size}", str(self.dtype).removeprefix("torch."), self.scale_fmt]
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.extra_rows, "extra"), (self.k_pad, f"kpad{self.k_pad}"),
                 (self.page_pad, f"ppad{self.page_pad}"),
                 (self.cache_offset, f"coff{self.cache_offset}"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.special_values, "special"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class IndexerInputs:
    k: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    quant_block_size: int
    scale_fmt: str

    def args(self) -> tuple:
        return (self.k, self.kv_cache, self.slot_mapping, self.quant_block_size, self.scale_fmt)


def pow2_boundary_amaxes(exponents=range(-20, 60, 7), ulps: int = 6) -> list[float]:
    """float32 amaxes whose scale ``s = RN(amax / 448)`` is a power of two ``2^e`` exactly, or
    lies a few ulps above one (``2^e < s < 2^e * (1 + 8 * 2^-23)``): "ue8m0" must keep the first
    and round the others up to ``2^(e+1)``, which ``exp2f(ceilf(log2f(s)))`` can get wrong for
    ``|e| >= 4``. Only float32 inputs hold them (16-bit amaxes divided by 448 are powers of two or
    far from one)."""
    out = []
    for e in exponents:
        p = torch.tensor(2.0**e, dtype=torch.float32)
        base = torch.tensor(448.0, dtype=torch.float32) * p  # exact: s = 2^e
        out.append(float(base))
        a = base
        found = 0
        for _ in range(64):
            a = torch.nextafter(a, torch.tensor(float("inf")))
            s = a / torch.tensor(448.0)
            step = (s.view(torch.int32) - p.view(torch.int32)).item()
            if 0 < step <= 8:
                out.append(float(a))
                found += 1
                if found == ulps:
                    break
    return out


def _plant_specials(x: torch.Tensor, case: IndexerCase) -> None:
    """One special group per group slot of the first tokens, in order (x is [T, D])."""
    q = case.quant_block_size
    finfo = torch.finfo(case.dtype)
    f32 = case.dtype == torch.float32

    def fill(vals):
        return lambda t: t.copy_(torch.tensor(vals, dtype=torch.float32).to(t.dtype).repeat(
            -(-q // len(vals)))[:q])

    specials = [
        lambda t: t.zero_().view(-1)[::3].neg_(),                   # zeros, some -0: floor
        lambda t: t.mul_(1e-7 if f32 else finfo.tiny * 8),          # amax < 1e-4: floor
        lambda t: t.view(-1).__setitem__(q // 2, float("nan")),     # one NaN
        lambda t: t.fill_(float("nan")),                            # all NaN: floor
        lambda t: t.view(-1).__setitem__(q - 1, float("inf")),      # +inf: s = inf
        lambda t: t.view(-1).__setitem__(0, -float("inf")),         # -inf
        fill([finfo.max, -finfo.max, 0.5, -0.0]),                   # the largest values
        fill([E4M3_MAX, -E4M3_MAX / 2, 1.0, 3.0]),                  # s = 1 exactly
        fill([E4M3_MAX + 256 * finfo.eps, -1.0, 2.0, 0.5]),         # 1 ulp above: s just above 1
        lambda t: t.div_(t.abs().amax()).mul_(finfo.max / 3),       # huge
    ]
    if f32:
        for a in pow2_boundary_amaxes():
            specials.append(lambda t, a=a: t.clamp_(-a / 2, a / 2).view(-1).__setitem__(
                (q // 3) % q, -a))
    groups = x.view(x.shape[0], -1, q)
    n = 0
    for tok in range(groups.shape[0]):
        for g in range(groups.shape[1]):
            if n < len(specials):
                specials[n](groups[tok, g])
            n += 1


def make_indexer_inputs(case: IndexerCase, device: str | torch.device = "cpu",
                        seed: int = 0) -> IndexerInputs:
    """Build the tensors of ``case`` on ``device``; the cache's allocation holds random bits."""
    gen = torch.Generator(device="cpu").manual_seed(seed + case.seed_offset)
    T, D, q = case.num_tokens, case.head_dim, case.quant_block_size
    rows = T + case.extra_rows
    x = torch.randn(rows, D + case.k_pad, generator=gen)
    # A magnitude per group, so that group scales differ over many binades (16-bit inputs stay
    # finite; float16 reaches its subnormals).
    lo, hi = {torch.float16: (-20, 8), torch.bfloat16: (-40, 40),
              torch.float32: (-60, 60)}[case.dtype]
    mag = torch.exp2(torch.randint(lo, hi, (rows, D // q), generator=gen).float())
    x[:, :D] *= mag.repeat_interleave(q, dim=1)
    x = x.to(case.dtype)
    k = x[:, :D]
    if case.special_values:
        _plant_specials(k[:T], case)

    slot_mapping = make_slot_mapping(case.id, T, case.num_slots,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen)

    E, bs = case.entry, case.block_size
    page = bs * E + case.page_pad
    base = torch.randint(0, 256, (case.cache_offset + case.num_blocks * page,), dtype=torch.uint8,
                         generator=gen)
    kv_cache = base.as_strided((case.num_blocks, bs, E), (page, E, 1), case.cache_offset)

    k, kv_cache, slot_mapping = copy_allocations((k, kv_cache, slot_mapping), device, copy=False)
    return IndexerInputs(k, kv_cache, slot_mapping, q, case.scale_fmt)


def clone_cache(cache: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """A copy of ``cache`` (on ``device``, default its own) with its whole allocation."""
    return copy_allocations([cache], device)[0]


def _code_region(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per byte of the cache's allocation: does a page hold an fp8 code there."""
    mask = torch.zeros(storage_bytes(cache).numel(), dtype=torch.bool)  # on the CPU
    nb, bs, _ = cache.shape
    mask.as_strided((nb, bs * head_dim), (cache.stride(0), 1), cache.storage_offset()).fill_(True)
    return mask


def indexer_differing_bytes(actual: torch.Tensor, expected: torch.Tensor,
                            head_dim: int) -> torch.Tensor:
    """Bool mask over the allocation's bytes where two caches differ; two codes that both decode
    to e4m3 NaN count as equal, only in the pages' code regions."""
    a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
    if a.numel() != e.numel():
        raise AssertionError(f"storage sizes differ ({a.numel()} vs {e.numel()} bytes)")
    diff = differing_bytes(a, e)
    if not bool(diff.any()):
        return diff
    fp8 = torch.float8_e4m3fn
    return diff & ~(nan_mask(a, fp8) & nan_mask(e, fp8) & _code_region(expected, head_dim))


def _where(cache: torch.Tensor, head_dim: int, byte: int) -> str:
    """Which block, slot and code or scale byte an allocation offset is."""
    nb, bs, E = cache.shape
    rel = byte - cache.storage_offset()
    b, p = divmod(rel, cache.stride(0)) if nb > 1 else (0, rel)
    if not 0 <= b < nb or p >= bs * E:
        return "outside every page"
    if p < bs * head_dim:
        o, d = divmod(p, head_dim)
        return f"block {b} slot {o} code {d}"
    o, c = divmod(p - bs * head_dim, E - head_dim)
    return f"block {b} slot {o} scale {c // 4} byte {c % 4}"


def assert_indexer_caches_equal(actual: torch.Tensor, expected: torch.Tensor, head_dim: int,
                                name: str = "kv_cache") -> None:
    """Every byte of the allocation behind ``actual`` equals ``expected``'s (see
    :func:`indexer_differing_bytes`); stray writes outside the slots are caught too. The message
    names the first differing bytes by block, slot and code or scale."""
    diff = indexer_differing_bytes(actual, expected, head_dim)
    if bool(diff.any()):
        a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
        idx = torch.nonzero(diff).flatten()
        first = idx[:8].tolist()
        where = [_where(expected, head_dim, i) for i in first[:4]]
        raise AssertionError(f"{name}: {idx.numel()} bytes differ; first at byte offsets {first} "
                             f"({'; '.join(where)}): got {a[idx[:8]].tolist()}, expected "
                             f"{e[idx[:8]].tolist()}")


def exact_quotient_inputs(case: IndexerCase, device: str | torch.device = "cpu", seed: int = 0,
                          ) -> IndexerInputs:
    """``case``'s inputs with k replaced by values whose quotients are normal e4m3 values: each
    group holds ±448 * 2^k once (so its scale is 2^k exactly, with or without "ue8m0") and
    e4m3 values times 2^k elsewhere. Any rounding of x / s gives the same code, so a kernel's
    indexing, scales and page layout are checked on them apart from its rounding."""
    inp = make_indexer_inputs(case, "cpu", seed)
    gen = torch.Generator().manual_seed(seed + 11)
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes) & (codes >= 2.0**-6)]
    rows, D = inp.k.shape
    q = case.quant_block_size
    pick = codes[torch.randint(0, codes.numel(), (rows, D), generator=gen)]
    pick *= torch.where(torch.rand(rows, D, generator=gen) < 0.5, -1.0, 1.0)
    grp = pick.view(rows, D // q, q)
    grp[:, :, 0] = torch.where(torch.rand(rows, D // q, generator=gen) < 0.5, -448.0, 448.0)
    lo, hi = (-8, 8) if case.dtype == torch.float16 else (-20, 20)
    grp *= torch.exp2(torch.randint(lo, hi, (rows, D // q, 1), generator=gen).float())
    k = inp.k.clone()
    k.copy_(pick.to(case.dtype))
    return IndexerInputs(k.to(device), clone_cache(inp.kv_cache, device),
                         inp.slot_mapping.to(device), q, case.scale_fmt)


def decode_scales(scale_bytes: torch.Tensor, scale_fmt: str | ScaleFormat) -> torch.Tensor:
    """float32 scales ``[n, G]`` from slots' scale bytes ``[n, 4G]`` uint8 (as the cache or the
    gather's uint8 ``dst_scale`` holds them): each group's little-endian float32, or for "mxfp8"
    ``2^(byte - 127)`` of its first UE8M0 byte (0xFF: +inf; the writer stores the same byte 4
    times, a reader takes any)."""
    n = scale_bytes.shape[0]
    b = scale_bytes.contiguous().view(n, -1, 4)
    if not parse_scale_fmt(scale_fmt).exponent_bytes:
        return b.reshape(n, -1).view(torch.float32)
    e = b[:, :, 0].to(torch.int32)
    # byte << 23 is the float32 2^(byte - 127) for bytes 1..254 and +inf for 0xFF; byte 0 is the
    # subnormal 2^-127.
    bits = torch.where(e == 0, 1 << 22, e << 23)
    return bits.view(torch.float32)


def dequantize_rows(codes: torch.Tensor, scale_bytes: torch.Tensor,
                    scale_fmt: str | ScaleFormat, dtype: torch.dtype = torch.float32,
                    ) -> torch.Tensor:
    """Rows ``[n, D]`` of ``dtype``: each e4m3 code (``codes`` ``[n, D]`` uint8 or
    float8_e4m3fn) times its group's scale (:func:`decode_scales`). float64 holds every product
    exactly; in float32 a code near 448 times a scale near 2^120 overflows to inf."""
    s = decode_scales(scale_bytes, scale_fmt).to(dtype)
    n, d = codes.shape
    x = codes.contiguous().view(torch.float8_e4m3fn).to(dtype).view(n, s.shape[1], -1)
    return (x * s[:, :, None]).view(n, d)


def _matrix() -> list[IndexerCase]:
    cases: list[IndexerCase] = []
    for dtype, fmt in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                        ("ue8m0", "mxfp8", "float32")):
        cases.append(IndexerCase(dtype=dtype, scale_fmt=fmt))
        # float32: 84 groups more, the power-of-two boundaries.
        cases.append(IndexerCase(dtype=dtype, scale_fmt=fmt, special_values=True, num_blocks=8,
                                 num_tokens=96 if dtype == torch.float32 else 12))
    for (D, q), fmt in itertools.product(((64, 64), (128, 64), (256, 128), (128, 32), (96, 96),
                                          (80, 16), (40, 8), (128, 1), (6, 3)),
                                         ("ue8m0", "")):
        cases.append(IndexerCase(head_dim=D, quant_block_size=q, scale_fmt=fmt, num_tokens=9,
                                 block_size=7, num_blocks=3))
    for bs in (1, 16, 64):
        cases.append(IndexerCase(block_size=bs, num_blocks=max(1, 64 // bs), num_tokens=13,
                                 padding_slots=2, out_of_range_slots=2))
    cases += [
        IndexerCase(num_tokens=1),
        IndexerCase(num_tokens=0, extra_rows=2),
        IndexerCase(num_tokens=9, padding_slots=9),
        IndexerCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
        IndexerCase(num_tokens=9, extra_rows=3, k_pad=8, page_pad=16, slot_dtype=torch.int32),
        IndexerCase(num_tokens=6, k_pad=1, page_pad=3, cache_offset=1, scale_fmt="fp32"),
        IndexerCase(num_tokens=6, k_pad=2, page_pad=1, cache_offset=3, dtype=torch.float32,
                    head_dim=64, quant_block_size=32, block_size=5),
        IndexerCase(num_tokens=64, block_size=16, num_blocks=4),  # every slot
        IndexerCase(num_tokens=40, head_dim=512, quant_block_size=512, block_size=8,
                    num_blocks=6, special_values=True, dtype=torch.float32),
        # "mxfp8" with two groups a slot, unaligned pages (byte-by-byte scale stores), padding.
        IndexerCase(num_tokens=9, head_dim=2 * MXFP8_GROUP, scale_fmt="mxfp8", block_size=7,
                    num_blocks=3, k_pad=1, page_pad=1, cache_offset=3, padding_slots=1,
                    out_of_range_slots=1, special_values=True, slot_dtype=torch.int32),
    ]
    return cases


INDEXER_CASES: list[IndexerCase] = _matrix()


def _gpu_matrix() -> list[IndexerCase]:
    cases: list[IndexerCase] = []
    geometries = ((128, 128), (64, 64), (128, 64), (256, 128), (512, 128), (128, 32), (96, 96),
                  (80, 16), (128, 1), (6, 3))
    # Every geometry, input dtype and scale format; block sizes and slot types in turn.
    for i, ((D, q), dtype, fmt) in enumerate(itertools.product(
            geometries, (torch.bfloat16, torch.float16, torch.float32), ("ue8m0", "float32"))):
        bs = (1, 16, 64)[i % 3]
        cases.append(IndexerCase(head_dim=D, quant_block_size=q, dtype=dtype, scale_fmt=fmt,
                                 block_size=bs, num_blocks=max(2, 512 // bs), num_tokens=300,
                                 padding_slots=7, out_of_range_slots=5, special_values=True,
                                 slot_dtype=torch.int32 if i % 2 else torch.int64))
    for dtype, fmt in itertools.product((torch.bfloat16, torch.float32), ("ue8m0", "float32")):
        cases += [
            IndexerCase(dtype=dtype, scale_fmt=fmt, num_tokens=1000, extra_rows=24, k_pad=3,
                        page_pad=5, cache_offset=1, block_size=64, num_blocks=20),
            IndexerCase(dtype=dtype, scale_fmt=fmt, num_tokens=1000, k_pad=64, page_pad=64,
                        block_size=64, num_blocks=20, slot_dtype=torch.int32),
            IndexerCase(dtype=dtype, scale_fmt=fmt, num_tokens=4096, block_size=64,
                        num_blocks=64),  # every slot
        ]
    # "mxfp8" (groups of 128 only), after the others so that their order stays.
    for i, ((D, q), dtype) in enumerate(itertools.product(
            [g for g in geometries if g[1] == MXFP8_GROUP],
            (torch.bfloat16, torch.float16, torch.float32))):
        bs = (1, 16, 64)[i % 3]
        cases.append(IndexerCase(head_dim=D, quant_block_size=q, dtype=dtype, scale_fmt="mxfp8",
                                 block_size=bs, num_blocks=max(2, 512 // bs), num_tokens=300,
                                 padding_slots=7, out_of_range_slots=5, special_values=True,
                                 page_pad=i % 2, cache_offset=i % 4,
                                 slot_dtype=torch.int32 if i % 2 else torch.int64))
    for dtype in (torch.bfloat16, torch.float32):
        cases += [
            IndexerCase(dtype=dtype, scale_fmt="mxfp8", num_tokens=1000, extra_rows=24, k_pad=3,
                        page_pad=5, cache_offset=1, block_size=64, num_blocks=20),
            IndexerCase(dtype=dtype, scale_fmt="mxfp8", num_tokens=4096, block_size=64,
                        num_blocks=64),  # every slot
        ]
    return cases


INDEXER_GPU_CASES: list[IndexerCase] = _gpu_matrix()
