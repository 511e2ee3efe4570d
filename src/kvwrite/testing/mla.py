"""concat_and_cache_mla's case model: one :class:`MlaCase` describes a call (shapes, dtypes, mode,
fp8_ds_mla's tile scale rule, cache strides and alignment, input slices, slots, special values;
``pe_dim=0`` with fp8_ds_mla is a NoPE layer); :func:`make_mla_inputs` builds
its tensors; :func:`assert_mla_caches_equal` is the byte comparison (NaN-aware only in the fp8
codes, as the fp8 rule allows); ``MLA_CASES`` is the matrix every implementation is tested on."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..dtypes import FP8_MAX
from ..ops.concat_and_cache_mla.op import (
    DEFAULT_DS_MLA_SCALE,
    DS_MLA_L,
    DS_MLA_TILE,
    MlaMode,
    entry_size,
    parse_mla_mode,
)
from .build import WriteCase, flag_parts, make_slot_mapping
from .cases import reciprocal_traps
from .compare import copy_allocations, differing_bytes, nan_mask, storage_bytes

__all__ = ["MlaCase", "MlaInputs", "MLA_CASES", "make_mla_inputs", "clone_cache",
           "assert_mla_caches_equal", "mla_differing_bytes", "every_16_bit_pattern_tiles",
           "ds_midpoint_tiles"]


@dataclasses.dataclass(frozen=True)
class MlaCase(WriteCase):
    kv_lora_rank: int = 512
    pe_dim: int = 64
    kv_cache_dtype: str = "auto"
    # fp8_ds_mla's tile scale rule ("pow2" or "amax"); the default in every other mode.
    ds_mla_scale: str = DEFAULT_DS_MLA_SCALE.value
    # fp8 modes: "uint8" (vLLM's storage) or "float8" (torch's float8 dtype).
    fp8_storage: str = "uint8"
    # kv_c and k_pe as slices of one latent projection [T, L + P] (token stride L + P), with
    # latent_pad more elements per row after them.
    latent_slices: bool = False
    latent_pad: int = 0
    # Cache entries padded by cache_pad elements and starting cache_offset elements into their
    # row (so rows may be unaligned); cache_transposed puts slots outermost in memory.
    cache_pad: int = 0
    cache_offset: int = 0
    cache_transposed: bool = False
    # NaN, ±inf, ±0, subnormals, saturating values; for fp8_ds_mla zero, NaN, all-NaN, inf and
    # tiny tiles too.
    special_values: bool = False
    scale: float = 0.37

    @property
    def mode(self) -> MlaMode:
        return parse_mla_mode(self.kv_cache_dtype)

    @property
    def entry(self) -> int:
        return entry_size(self.mode, self.kv_lora_rank, self.pe_dim)

    @property
    def cache_tensor_dtype(self) -> torch.dtype:
        mode = self.mode
        if mode is MlaMode.AUTO:
            return self.dtype
        if mode is MlaMode.FP8_DS_MLA or self.fp8_storage == "uint8":
            return torch.uint8
        return mode.fp8_dtype

    @property
    def id(self) -> str:
        parts = [f"T{self.num_tokens}", f"L{self.kv_lora_rank}", f"P{self.pe_dim}",
                 f"bs{self.block_size}", str(self.dtype).removeprefix("torch."), self.kv_cache_dtype]
        if self.mode is MlaMode.FP8_DS_MLA:
            parts.append(self.ds_mla_scale)
        if self.mode.uses_scale:
            parts.append(self.fp8_storage)
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.extra_rows, "extra"), (self.latent_slices, "latent"),
                 (self.latent_pad, f"lpad{self.latent_pad}"),
                 (self.cache_pad, f"cpad{self.cache_pad}"),
                 (self.cache_offset, f"coff{self.cache_offset}"),
                 (self.cache_transposed, "transposed"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.special_values, "special"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class MlaInputs:
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    scale: torch.Tensor
    ds_mla_scale: str = DEFAULT_DS_MLA_SCALE.value

    def args(self) -> tuple:
        return (self.kv_c, self.k_pe, self.kv_cache, self.slot_mapping, self.kv_cache_dtype,
                self.scale)

    def kwargs(self) -> dict:
        """The keyword-only arguments of the call (``ds_mla_scale``)."""
        return {"ds_mla_scale": self.ds_mla_scale}


def _fp8_specials(fp8: torch.dtype) -> list[float]:
    mx = FP8_MAX[fp8]
    tiny = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[fp8]
    return [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, mx, -mx,
            mx * 1.01, -mx * 1.2, mx * 1000, tiny, -tiny, tiny * 0.5, tiny * 0.5001, -tiny * 1.5,
            tiny * 2.5, 1e-30, -1e-30, 1.0625, 1.1875, 17.0, 1e38, -3e38]


def _with_amax(t: torch.Tensor, amax: float, above: bool = False) -> None:
    """Tile ``t`` (finite) scaled below ``amax / 2`` with one element ``-amax`` (the 16-bit value
    of ``amax``; with ``above``, the next 16-bit value above it)."""
    t.mul_(amax / 2 / float(t.float().abs().amax().clamp_min(1e-30)))
    v = torch.tensor([amax]).to(t.dtype)
    if above:
        v = (v.view(torch.int16) + 1).view(t.dtype)
    t[3] = -v[0]


def _plant_ds_specials(x: torch.Tensor, gen: torch.Generator) -> None:
    """Tiles that exercise every branch of both tile scale rules: zeros (with -0), a NaN among
    values, all NaN, ±inf, values whose amax / 448 is below FLT_MIN, the largest finite values,
    elements at the tile maximum (quotient exactly ±448), amax exactly 448 * 2^k (a power-of-two
    amax / 448, which "pow2" keeps) and one 16-bit step above it (rounded up a binade), amax /
    448 below, at and just above float32(1e-4) ("pow2"'s floor)."""
    tiles = x.view(x.shape[0], -1, DS_MLA_TILE)[:, :DS_MLA_L // DS_MLA_TILE]
    finfo = torch.finfo(x.dtype)
    floor_amax = 448 * 1e-4  # amax / 448 near float32(1e-4)
    specials = [
        lambda t: t.zero_().view(-1)[::3].neg_(),                        # zeros, some -0
        lambda t: t.view(-1).__setitem__(5, float("nan")),              # one NaN
        lambda t: t.fill_(float("nan")),                                # all NaN
        lambda t: t.view(-1).__setitem__(7, float("inf")),              # +inf
        lambda t: t.view(-1).__setitem__(9, -float("inf")),             # -inf
        lambda t: t.mul_(finfo.tiny * 2.0**-2),                         # amax/448 < FLT_MIN
        lambda t: t.copy_(torch.full_like(t, finfo.max)).view(-1)[1::2].neg_(),  # largest
        lambda t: t.view(-1)[:4].copy_(torch.tensor([finfo.max, -finfo.max, 0.5, -0.0])),
        lambda t: _with_amax(t, 448.0),                                 # amax / 448 = 1
        lambda t: _with_amax(t, 448.0, above=True),
        lambda t: _with_amax(t, 448.0 * 2.0**5),
        lambda t: _with_amax(t, 448.0 * 2.0**5, above=True),
        lambda t: _with_amax(t, 448.0 * 2.0**-6),
        lambda t: _with_amax(t, 448.0 * 2.0**-6, above=True),
        lambda t: _with_amax(t, floor_amax * 0.3),                      # below the 1e-4 floor
        lambda t: _with_amax(t, floor_amax),
        lambda t: _with_amax(t, floor_amax, above=True),
        lambda t: _with_amax(t, 448.0 * 2.0**-13),                      # the floor's power
        lambda t: _with_amax(t, 448.0 * 2.0**-13, above=True),
    ]
    n = 0
    for tok in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            if n < len(specials):
                specials[n](tiles[tok, j])
            n += 1
    # Random further NaNs and infinities past the special tiles' rows (x may be a slice:
    # indexed by row and column).
    first = min(x.shape[0] - 1, -(-n // tiles.shape[1]))
    n = max(2, x.numel() // 97)
    r = torch.randint(first, x.shape[0], (n,), generator=gen)
    c = torch.randint(0, x.shape[1], (n,), generator=gen)
    x[r[::2], c[::2]] = float("nan")
    x[r[1::2], c[1::2]] = float("inf")


def _random_rows(rows: int, n: int, dtype: torch.dtype, gen: torch.Generator,
                 spread: bool) -> torch.Tensor:
    x = torch.randn(rows, n, generator=gen)
    if spread:  # magnitudes over the whole fp8 range: subnormals, normals and saturation
        x *= torch.exp2(torch.randint(-20, 12, (rows, n), generator=gen).float())
    return x.to(dtype)


def make_mla_inputs(case: MlaCase, device: str | torch.device = "cpu", seed: int = 0) -> MlaInputs:
    """Build the tensors of ``case`` on ``device``; the cache's allocation holds random bits."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, L, P = case.num_tokens, case.kv_lora_rank, case.pe_dim
    rows = T + case.extra_rows
    mode = case.mode
    spread = mode.uses_scale
    if case.latent_slices:
        latent = _random_rows(rows, L + P + case.latent_pad, case.dtype, gen, spread)
        kv_c, k_pe = latent[:, :L], latent[:, L:L + P]
    else:
        kv_c = _random_rows(rows, L, case.dtype, gen, spread)
        k_pe = _random_rows(rows, P, case.dtype, gen, spread)
    if mode is MlaMode.FP8_DS_MLA:
        # A magnitude per tile, so that tile scales differ over many binades.
        lo, hi = (-16, 8) if case.dtype == torch.float16 else (-30, 30)
        mag = torch.exp2(torch.randint(lo, hi, (rows, L // DS_MLA_TILE), generator=gen).float())
        kv_c.mul_(mag.repeat_interleave(DS_MLA_TILE, dim=1).to(case.dtype))
        if case.special_values:
            _plant_ds_specials(kv_c, gen)
    elif mode.uses_scale and case.special_values:
        fp8 = mode.fp8_dtype
        vals = torch.tensor(_fp8_specials(fp8)) * case.scale
        vals = torch.cat([vals, torch.tensor(reciprocal_traps(fp8, case.scale))])
        for t in (kv_c, k_pe):
            flat = t[:T].reshape(-1).clone()
            n = min(vals.numel(), flat.numel())
            flat[:n] = vals[:n].to(t.dtype)
            t[:T].copy_(flat.view(T, -1))

    slot_mapping = make_slot_mapping(case.id, T, case.num_blocks * case.block_size,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen)

    E = case.entry
    width = case.cache_offset + E + case.cache_pad
    dt = case.cache_tensor_dtype
    if case.cache_transposed:
        base = torch.empty(case.block_size, case.num_blocks, width, dtype=dt).transpose(0, 1)
    else:
        base = torch.empty(case.num_blocks, case.block_size, width, dtype=dt)
    b = storage_bytes(base)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    kv_cache = base[:, :, case.cache_offset:case.cache_offset + E]
    scale = torch.tensor([case.scale], dtype=torch.float32)

    kv_c, k_pe, kv_cache, slot_mapping, scale = copy_allocations(
        (kv_c, k_pe, kv_cache, slot_mapping, scale), device, copy=False)
    return MlaInputs(kv_c, k_pe, kv_cache, slot_mapping, case.kv_cache_dtype, scale,
                     case.ds_mla_scale)


def clone_cache(cache: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """A copy of ``cache`` (on ``device``, default its own) with its whole allocation."""
    return copy_allocations([cache], device)[0]


def _code_region(cache: torch.Tensor, mode: MlaMode) -> torch.Tensor:
    """Per byte of the cache's allocation: does it hold an fp8 code of an entry."""
    mask = torch.zeros(storage_bytes(cache).numel(), dtype=torch.bool)  # on the CPU
    es = cache.element_size()
    n = DS_MLA_L if mode is MlaMode.FP8_DS_MLA else cache.shape[2]
    nb, bs = cache.shape[:2]
    mask.as_strided((nb, bs, n * es), (cache.stride(0) * es, cache.stride(1) * es, 1),
                    cache.storage_offset() * es).fill_(True)
    return mask


def mla_differing_bytes(actual: torch.Tensor, expected: torch.Tensor,
                        mode: MlaMode) -> torch.Tensor:
    """Bool mask over the allocation's bytes where two caches differ. Two fp8 codes that both
    decode to NaN (any sign or payload) count as equal, only where the cache holds fp8 codes."""
    a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
    if a.numel() != e.numel():
        raise AssertionError(f"storage sizes differ ({a.numel()} vs {e.numel()} bytes)")
    diff = differing_bytes(a, e)
    if mode is MlaMode.AUTO or not bool(diff.any()):
        return diff
    fp8 = mode.fp8_dtype
    both_nan = nan_mask(a, fp8) & nan_mask(e, fp8) & _code_region(expected, mode)
    return diff & ~both_nan


def assert_mla_caches_equal(actual: torch.Tensor, expected: torch.Tensor, mode: MlaMode,
                            name: str = "kv_cache") -> None:
    """Every byte of the allocation behind ``actual`` equals ``expected``'s (see
    :func:`mla_differing_bytes`); stray writes outside the entries are caught too."""
    diff = mla_differing_bytes(actual, expected, mode)
    if bool(diff.any()):
        a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
        idx = torch.nonzero(diff).flatten()
        first = idx[:8].tolist()
        raise AssertionError(f"{name}: {idx.numel()} bytes differ; first at byte offsets {first}: "
                             f"got {a[idx[:8]].tolist()}, expected {e[idx[:8]].tolist()}")


def every_16_bit_pattern_tiles(dtype: torch.dtype) -> torch.Tensor:
    """kv_c rows ``[128, 512]`` holding every 16-bit pattern of ``dtype`` once, shuffled (fixed
    seed) so that tiles mix magnitudes, with one tile in 8 left with only its small values (the
    tile scale then comes from a small amax)."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    gen = torch.Generator().manual_seed(1)
    x = bits[torch.randperm(65536, generator=gen)].view(dtype).clone()
    tiles = x.view(512, DS_MLA_TILE)
    small = tiles[::8].float().abs()
    tiles[::8] = torch.where(small < 1.0, tiles[::8], torch.zeros_like(tiles[::8]))
    return x.view(128, DS_MLA_L)


def ds_midpoint_tiles(dtype: torch.dtype) -> torch.Tensor:
    """fp8_ds_mla kv_c rows ``[R, 512]`` whose quotients lie on or next to e4m3 rounding boundaries.

    Exact tiles: amax = 448 * c * 2^k (so the tile's scale is exactly c * 2^k, c in {1, 3, 5, 7},
    k in [-2, 4]), then x = m * c * 2^k for every midpoint m between neighbouring e4m3 values,
    with the tile's sign: x / s is exactly m and round-to-nearest-even decides. Near tiles: for the
    128 amax values of ``dtype`` whose scale s = RN(amax / 448) admits the most values x of
    ``dtype`` with x / s within 2^-22 (relative) of a midpoint but not on it, those x. A quantizer
    that brackets x / s with approximate reciprocals must fall back to the exact quotient on
    both kinds; one that multiplies by RN(1 / s) gets about 730 of them wrong. Every tile starts
    with its amax; the rest of a near tile is zeros."""
    codes = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    vals = codes.float()  # 0 .. 448, ascending
    mids = (vals[:-1] + vals[1:]) / 2  # 126 midpoints, 5 significant bits at most
    tiles = []
    for c in (1.0, 3.0, 5.0, 7.0):
        for k in range(-2, 5):
            for sign in (1.0, -1.0):
                s = c * 2.0**k
                amax = torch.tensor([448.0 * s]).to(dtype)
                below = (amax.view(torch.int16) - 1).view(dtype)
                tiles.append(torch.cat([amax, (mids * s).to(dtype), below]) * sign)
    # Near tiles: every finite positive normal amax of dtype, its scale as the kernels compute it.
    lo, hi = (0x0400, 0x7C00) if dtype == torch.float16 else (0x0080, 0x7F80)
    amax = torch.arange(lo, hi, dtype=torch.int32).to(torch.int16).view(dtype)
    s = (amax.float() / 448.0).clamp(min=2.0**-126).double()
    m = mids.double()
    x = (m[None, :] * s[:, None]).to(dtype)
    rel = (x.double() / s[:, None] - m[None, :]).abs() / m[None, :]
    near = (rel > 0) & (rel < 2.0**-22) & (x.float() <= amax.float()[:, None])
    best = near.sum(1).argsort(descending=True, stable=True)[:128]
    for r, row in enumerate(best.tolist()):
        xs = x[row][near[row]]
        tile = torch.zeros(DS_MLA_TILE, dtype=dtype)
        tile[0] = amax[row]
        tile[1:1 + xs.numel()] = xs
        tiles.append(tile if r % 2 == 0 else -tile)
    return torch.stack(tiles).reshape(-1, DS_MLA_L)


def _matrix() -> list[MlaCase]:
    cases: list[MlaCase] = []
    modes = ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla")
    for kv, dtype in itertools.product(modes, (torch.float16, torch.bfloat16, torch.float32)):
        if kv == "fp8_ds_mla" and dtype == torch.float32:
            continue
        cases.append(MlaCase(kv_cache_dtype=kv, dtype=dtype))
    for kv in modes:
        cases += [
            MlaCase(kv_cache_dtype=kv, latent_slices=True, extra_rows=3, num_tokens=9),
            MlaCase(kv_cache_dtype=kv, cache_pad=16, cache_transposed=True, block_size=8),
            MlaCase(kv_cache_dtype=kv, cache_pad=3, cache_offset=1, num_tokens=5),
            MlaCase(kv_cache_dtype=kv, latent_slices=True, latent_pad=1, num_tokens=6),
            MlaCase(kv_cache_dtype=kv, num_tokens=9, padding_slots=3, out_of_range_slots=2,
                    slot_dtype=torch.int32),
            MlaCase(kv_cache_dtype=kv, num_tokens=6, special_values=True,
                    dtype=torch.float16 if kv == "fp8_ds_mla" else torch.float32),
            MlaCase(kv_cache_dtype=kv, num_tokens=6, special_values=True),
        ]
    # fp8_ds_mla: the earlier tile scale rule ("amax"; the cases above take the default "pow2"),
    # and NoPE layers (pe_dim 0: the rotary bytes become zeros) under both rules.
    cases += [
        MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax", num_tokens=6,
                special_values=True),
        MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax", num_tokens=6,
                special_values=True, dtype=torch.float16),
        MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale="amax", num_tokens=9, padding_slots=3,
                out_of_range_slots=2, slot_dtype=torch.int32, cache_transposed=True),
    ]
    for rule in ("pow2", "amax"):
        cases += [
            MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale=rule, pe_dim=0, num_tokens=9,
                    padding_slots=2, out_of_range_slots=1),
            MlaCase(kv_cache_dtype="fp8_ds_mla", ds_mla_scale=rule, pe_dim=0, num_tokens=6,
                    latent_slices=True, latent_pad=3, cache_pad=3, cache_offset=1,
                    special_values=True, dtype=torch.float16),
        ]
    # fp8 in float8 storage.
    for kv in ("fp8", "fp8_e5m2"):
        cases.append(MlaCase(kv_cache_dtype=kv, fp8_storage="float8", special_values=True,
                             num_tokens=4, dtype=torch.float32))
    # Other latent geometries (plain modes take any L and P).
    for (L, P), kv in itertools.product(((256, 32), (10, 3), (1, 1), (96, 40), (128, 64)),
                                        ("auto", "fp8", "fp8_e5m2")):
        cases.append(MlaCase(kv_lora_rank=L, pe_dim=P, kv_cache_dtype=kv, num_tokens=33,
                             num_blocks=6, block_size=7))
    cases += [
        MlaCase(num_tokens=1),
        MlaCase(num_tokens=0),
        MlaCase(num_tokens=0, extra_rows=2, kv_cache_dtype="fp8_ds_mla"),
        MlaCase(num_tokens=9, padding_slots=9, kv_cache_dtype="fp8_ds_mla"),
        MlaCase(num_tokens=64, block_size=16, num_blocks=4, kv_cache_dtype="fp8_ds_mla"),  # all
        MlaCase(num_tokens=129, block_size=64, num_blocks=3, kv_cache_dtype="fp8_ds_mla",
                padding_slots=5, slot_dtype=torch.int32),
        MlaCase(num_tokens=129, block_size=64, num_blocks=3, kv_cache_dtype="auto",
                latent_slices=True),
    ]
    return cases


MLA_CASES: list[MlaCase] = _matrix()
