"""reshape_and_cache_flash_per_token_head_quant's case model: one :class:`PthCase` describes a call
(shapes, dtypes, mode, cache layout and allocation, input slices, slots, special values);
:func:`make_pth_inputs` builds its tensors; :func:`assert_pth_caches_equal` is the byte comparison
of whole allocations (NaN-aware only in the fp8 codes, as the contract allows);
:func:`roundtrip_error` / :func:`check_roundtrip` read written rows back and compare them with
the input within the format's half step (the check a user or the benchmark runs);
``PTH_CASES`` is the CPU matrix and ``PTH_GPU_CASES`` the GPU one."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math

import torch

from ..ops.reshape_and_cache_flash_per_token_head_quant.caches import (
    create_per_token_head_caches,
    dequantize_per_token_head,
)
from ..ops.reshape_and_cache_flash_per_token_head_quant.op import (
    PerTokenHeadMode,
    parse_kv_quant_mode,
)
from .build import WriteCase, flag_parts, make_slot_mapping
from .compare import copy_allocations, storage_bytes

__all__ = ["PthCase", "PthInputs", "PTH_CASES", "PTH_GPU_CASES", "make_pth_inputs",
           "clone_pth_caches", "pth_differing_bytes", "assert_pth_caches_equal",
           "roundtrip_error", "check_roundtrip", "half_step_bound", "special_rows", "INT8",
           "FP8", "INT4"]

INT8, FP8, INT4 = (m.value for m in PerTokenHeadMode)
CACHE_NAMES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


class _ForeignMode(enum.Enum):
    """An enum of another package whose member names are the mode strings (as vLLM's
    KVQuantMode): the op accepts its members by their lowercased names."""

    INT8_PER_TOKEN_HEAD = 1
    FP8_PER_TOKEN_HEAD = 2
    INT4_PER_TOKEN_HEAD = 3


@dataclasses.dataclass(frozen=True)
class PthCase(WriteCase):
    num_heads: int = 4
    head_size: int = 64
    head_size_v: int | None = None  # None: head_size
    kv_quant_mode: str = INT8
    # Data cache dtype: "" vLLM's storage (int8; uint8 for fp8 and int4), "float8" (fp8 as
    # float8_e4m3fn), "int8" (int4 bytes as int8).
    storage: str = ""
    layout: str = "NHD"  # NHD or HND
    alloc: str = "packed"  # packed, interleaved or separate
    # Inline layouts: the data caches as vLLM passes them, rows of Dq + 4 bytes ending with the
    # scale (E > Dq, overlapping the scale caches outside [..., :Dq]).
    vllm_rows: bool = False
    # Bytes of padding at the end of each cache row (inline layouts), or after the codes and
    # between scales (separate).
    row_pad: int = 0
    # Build the caches with create_per_token_head_caches (needs Dk == Dv, no padding).
    via_allocator: bool = False
    # key and value as slices of one fused qkv [T, (2H + H) Dk + H Dv] (token stride free).
    fused_qkv: bool = False
    # key/value heads spaced head_size + head_pad elements apart (head stride free).
    head_pad: int = 0
    special_values: bool = False
    # How kv_quant_mode is passed: "str", "enum" (the op's enum), "foreign" (another package's
    # enum of the same names) or "none" (inferred from the cache dtype; int8 and fp8 only).
    mode_arg: str = "str"

    @property
    def mode(self) -> PerTokenHeadMode:
        return parse_kv_quant_mode(self.kv_quant_mode)

    @property
    def dk(self) -> int:
        return self.head_size

    @property
    def dv(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.storage == "float8":
            return torch.float8_e4m3fn
        if self.storage == "int8":
            return torch.int8
        return self.mode.storage_dtype

    @property
    def id(self) -> str:
        parts = [self.mode.short, f"T{self.num_tokens}", f"H{self.num_heads}",
                 f"D{self.dk}" + (f"v{self.dv}" if self.dv != self.dk else ""),
                 f"bs{self.block_size}", str(self.dtype).removeprefix("torch."), self.layout,
                 self.alloc]
        if self.storage:
            parts.append(self.storage)
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.vllm_rows, "vllmrows"), (self.row_pad, f"rpad{self.row_pad}"),
                 (self.via_allocator, "alloc"), (self.extra_rows, "extra"),
                 (self.fused_qkv, "qkv"), (self.head_pad, f"hpad{self.head_pad}"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.special_values, "special"),
                 (self.mode_arg != "str", f"mode-{self.mode_arg}"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class PthInputs:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor
    v_scale_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_quant_mode: object

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.key_cache, self.value_cache, self.k_scale_cache, self.v_scale_cache

    def args(self) -> tuple:
        """The op's positional arguments (kv_quant_mode last)."""
        return (self.key, self.value, *self.caches, self.slot_mapping, self.kv_quant_mode)


# --- values -----------------------------------------------------------------------------------

def special_rows(d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows of ``d`` elements (float32, exact in ``dtype``) for every special case of the
    contract: all zero (with -0), all NaN, one NaN, +inf, -inf, constant heads (both signs), a
    head whose amax / 127 is below the floor, +inf only (with NaNs), -inf only, +inf and -inf,
    ties of every rounding (int8 scale 1, 2 and 3, int4 scale 1 and 3, fp8 halfway codes at
    scale 1 and 3: a quotient by a reciprocal misses some of those at 3), values one
    float32 ulp beside those ties (float32 input), a head far from zero (int4 saturates),
    subnormal inputs, the dtype's largest values (int4's max - min overflows)."""
    nan, inf = float("nan"), float("inf")
    finfo = torch.finfo(dtype)
    ar = torch.arange(d, dtype=torch.float32)
    rows = []

    def row(vals) -> None:
        r = torch.zeros(d)
        v = torch.as_tensor(vals, dtype=torch.float32).flatten()[:d]
        r[:v.numel()] = v
        rows.append(r)

    row(torch.where(ar % 3 == 0, -0.0, 0.0))                        # all zero, some -0
    row(torch.full((d,), nan))                                       # all NaN
    row(torch.cat([torch.tensor([nan]), torch.linspace(-3, 5, d - 1)]))  # one NaN
    row(torch.cat([torch.tensor([1.0, inf]), torch.linspace(-2, 2, d - 2)]))  # +inf
    row(torch.cat([torch.tensor([-inf, 0.5]), torch.linspace(-2, 2, d - 2)]))  # -inf
    row(torch.full((d,), 3.0))                                       # constant
    row(torch.full((d,), -0.375))                                    # constant, negative
    row(torch.linspace(-1, 1, d) * 2.0**-14)                         # amax / 127 < floor
    row(torch.where(ar % 2 == 0, inf, nan))                          # +inf only, NaNs
    row(torch.full((d,), -inf))                                      # -inf only
    row(torch.where(ar % 2 == 0, inf, -inf))                         # +inf and -inf
    # int8, s = 1 (amax 127): every k + 1/2 of both signs.
    ties = torch.tensor([127.0, -0.5, 0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 63.5, -3.5, 4.5])
    row(ties.repeat(-(-d // ties.numel())))
    row(ties.repeat(-(-d // ties.numel())) * 2.0)                    # s = 2
    row(ties.repeat(-(-d // ties.numel())) * 3.0)                    # s = 3: 1/s inexact
    # int4, s = 1 (max - min = 15), zp = 7: x + 7 at every half.
    i4 = torch.tensor([-7.0, 8.0, -6.5, -0.5, 0.5, 1.5, 7.5, -3.5, 2.5, 6.5, -1.5, 0.0])
    row(i4.repeat(-(-d // i4.numel())))
    i4b = torch.tensor([-7.5, 7.5, -6.5, -0.5, 0.5, 1.5, 6.5, -3.5, 2.5, 5.5, -1.5, 0.0])  # zp tie
    row(i4b.repeat(-(-d // i4b.numel())))
    row(i4.repeat(-(-d // i4.numel())) * 3.0)                       # s = 3
    # fp8, s = 1 (amax 448): e4m3 midpoints.
    f8 = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, -2.125, 0.0009765625, 0.0029296875,
                       -0.0048828125, 240.0, 416.0, -304.0])
    row(f8.repeat(-(-d // f8.numel())))
    row(f8.repeat(-(-d // f8.numel())) * 3.0)                       # s = 3
    if dtype == torch.float32:
        up = torch.nextafter(ties, torch.tensor(inf))
        down = torch.nextafter(ties, torch.tensor(-inf))
        near = torch.stack([up, down], 1).flatten()
        near[0] = 127.0  # keep s = 1
        row(near.repeat(-(-d // near.numel())))
        halves = i4[2:]
        near4 = torch.cat([torch.tensor([-7.0, 8.0]),  # keep s = 1, zp = 7
                           torch.stack([torch.nextafter(halves, torch.tensor(inf)),
                                        torch.nextafter(halves, torch.tensor(-inf))], 1).flatten()])
        row(near4.repeat(-(-d // near4.numel())))
    if dtype == torch.float32:
        row(_reciprocal_trap_row(127.0))  # int8: x / s and x * (1 / s) round apart
        row(_reciprocal_trap_row(448.0))  # fp8
    row(1000.0 + torch.linspace(0, 1, d))                            # far from zero
    row(-1000.0 - torch.linspace(0, 3, d))
    row(torch.linspace(-3, 3, d) * finfo.tiny)                       # subnormal / tiny
    row(torch.where(ar % 2 == 0, finfo.max, -finfo.max))             # largest values
    row(torch.where(ar % 3 == 0, finfo.max, 0.25))
    return [r.to(dtype).float() for r in rows]


def _reciprocal_trap_row(div: float) -> torch.Tensor:
    """A float32 row: amax (so that s = RN(amax / div) is 0.37 or next to it), then values x
    for which the code of RN(x / s) differs from that of RN(x * RN(1 / s)) (int8's rhaz for div
    127, e4m3 for 448): only a true quotient gets them right."""
    amax = torch.tensor(div * 0.37, dtype=torch.float32)
    s = amax / torch.tensor(div)
    r = 1.0 / s
    if div == 127.0:
        mids = ((torch.arange(-126, 127, dtype=torch.float32) + 0.5) * s).float()
    else:
        codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = ((codes[:-1] + codes[1:]) / 2 * s).float()
        mids = torch.cat([mids, -mids])
    x = torch.cat([mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                   torch.nextafter(mids, torch.tensor(float("-inf")))])
    x = x[x.abs() <= amax]

    def code(q):
        if div == 127.0:
            n = q.trunc()
            return torch.where((q - n).abs() >= 0.5, n + q.sign(), n)
        return q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).float()

    traps = x[code(x / s) != code(x * r)]
    return torch.cat([amax[None], traps])


def _random_rows(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal values with a magnitude per (token, head) over many binades and an offset per row
    (so that int4 rows are not always centred on zero)."""
    t, h, d = shape
    lo, hi = (-14, 12) if dtype == torch.float16 else (-24, 24)
    mag = torch.exp2(torch.randint(lo, hi, (t, h, 1), generator=gen).float())
    off = torch.randn(t, h, 1, generator=gen) * 0.6
    return ((torch.randn(t, h, d, generator=gen) + off) * mag).to(dtype)


def _plant_specials(x: torch.Tensor, n_tokens: int, gen: torch.Generator, first: int) -> None:
    """Special rows into the (token, head) rows of x [T, H, D] below n_tokens, from ``first``
    in the list on, in order, the rest random."""
    rows = special_rows(x.shape[2], x.dtype)
    k = first
    for t in range(n_tokens):
        for h in range(x.shape[1]):
            x[t, h] = rows[k % len(rows)].to(x.dtype)
            k += 1


# --- allocation --------------------------------------------------------------------------------

def _align4(n: int) -> int:
    return -(-n // 4) * 4


def _allocate(case: PthCase, gen: torch.Generator):
    """The four cache tensors of ``case`` on the CPU, their allocations full of random bytes."""
    nb, bs, h = case.num_blocks, case.block_size, case.num_heads
    mode = case.mode
    dqk, dqv = mode.quantized_size(case.dk), mode.quantized_size(case.dv)
    hnd = case.layout == "HND"
    dt = case.cache_dtype
    if case.via_allocator:
        caches = create_per_token_head_caches(nb, bs, h, case.dk, mode, cache_layout=case.layout,
                                              kv_alloc=case.alloc, device="cpu")
        caches = (caches[0].view(dt), caches[1].view(dt), caches[2], caches[3])
    elif case.alloc == "separate":
        def data(dq):
            shape = (nb, h, bs, dq + case.row_pad) if hnd else (nb, bs, h, dq + case.row_pad)
            t = torch.empty(shape, dtype=dt)
            return (t.permute(0, 2, 1, 3) if hnd else t)[..., :dq]

        def scales():
            k = 2 if case.row_pad else 1  # row_pad: every other float of [..., 2]
            shape = (nb, h, bs, k) if hnd else (nb, bs, h, k)
            t = torch.empty(shape, dtype=torch.float32)
            return (t.permute(0, 2, 1, 3) if hnd else t)[..., k - 1]

        caches = (data(dqk), data(dqv), scales(), scales())
    else:
        # Inline: each row is codes, scale (4-byte aligned), as vLLM's rows; packed puts K and V
        # rows side by side, interleaved alternates K and V blocks.
        ks_at = _align4(dqk)
        if case.alloc == "packed":
            v_at = ks_at + 4
            vs_at = _align4(v_at + dqv)
            width = _align4(vs_at + 4 + case.row_pad)
            shape = (nb, h, bs, width) if hnd else (nb, bs, h, width)
            raw = torch.empty(shape, dtype=torch.uint8)
            raw = raw.permute(0, 2, 1, 3) if hnd else raw
            k_rows, v_rows = raw, raw[..., v_at:]
            vs_at -= v_at
        else:
            vs_at = _align4(dqv)
            width = _align4(max(ks_at, vs_at) + 4 + case.row_pad)
            shape = (nb, 2, h, bs, width) if hnd else (nb, 2, bs, h, width)
            raw = torch.empty(shape, dtype=torch.uint8)
            raw = raw.permute(0, 1, 3, 2, 4) if hnd else raw
            k_rows, v_rows = raw[:, 0], raw[:, 1]
        f32 = raw.view(torch.float32)  # the scales, as strided float32 views of the rows
        if case.alloc == "packed":
            k_scale = f32[..., ks_at // 4]
            v_scale = f32[..., (ks_at + 4 + vs_at) // 4]
        else:
            k_scale, v_scale = f32[:, 0, ..., ks_at // 4], f32[:, 1, ..., vs_at // 4]
        ek = ks_at + 4 if case.vllm_rows else dqk
        ev = vs_at + 4 if case.vllm_rows else dqv
        caches = (k_rows[..., :ek].view(dt), v_rows[..., :ev].view(dt), k_scale, v_scale)
    seen = set()
    for c in caches:
        b = storage_bytes(c)
        if b.data_ptr() not in seen:
            seen.add(b.data_ptr())
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    return caches


def _inputs(case: PthCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = case.num_tokens + case.extra_rows
    h, dk, dv = case.num_heads, case.dk, case.dv
    if case.fused_qkv:
        hq = 2 * h
        qkv = _random_rows((rows, 1, (hq + h) * dk + h * dv), case.dtype, gen)[:, 0]
        # Magnitudes per head: the fused row got one magnitude; give each head its own.
        key = qkv[:, hq * dk:(hq + h) * dk].unflatten(1, (h, dk))
        value = qkv[:, (hq + h) * dk:].unflatten(1, (h, dv))
        for t in (key, value):
            t.copy_(_random_rows(t.shape, case.dtype, gen))
    else:
        key = _random_rows((rows, h, dk + case.head_pad), case.dtype, gen)[..., :dk]
        value = _random_rows((rows, h, dv + case.head_pad), case.dtype, gen)[..., :dv]
    if case.special_values:
        n = min(case.num_tokens, rows)
        _plant_specials(key, n, gen, 0)
        _plant_specials(value, n, gen, 5)
    return key, value


def _mode_arg(case: PthCase):
    if case.mode_arg == "enum":
        return case.mode
    if case.mode_arg == "foreign":
        return _ForeignMode[case.mode.name]
    if case.mode_arg == "none":
        return None
    return case.kv_quant_mode


def make_pth_inputs(case: PthCase, device: str | torch.device = "cpu", seed: int = 0) -> PthInputs:
    """Build the tensors of ``case`` on ``device`` (deterministic by ``seed``); every cache
    allocation holds random bytes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    key, value = _inputs(case, gen)
    caches = _allocate(case, gen)
    T = case.num_tokens
    slot_mapping = make_slot_mapping(case.id, T, case.num_blocks * case.block_size,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen)

    return PthInputs(*copy_allocations((key, value, *caches, slot_mapping), device, copy=False),
                     _mode_arg(case))


def clone_pth_caches(caches, device: str | torch.device | None = None) -> tuple:
    """Copies of the four cache tensors (on ``device``, default their own) with their whole
    allocations, tensors that shared an allocation sharing the copy."""
    return tuple(copy_allocations(caches, device))


# --- comparison --------------------------------------------------------------------------------

def _groups(caches) -> list[list[int]]:
    """Indices of the cache tensors, grouped by allocation."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(caches):
        groups.setdefault(c.untyped_storage().data_ptr(), []).append(i)
    return list(groups.values())


def _region(t: torch.Tensor, nbytes: int, ncols: int | None = None) -> torch.Tensor:
    """Per byte of t's allocation (on the CPU): does it lie in t's elements (the first ``ncols``
    of the last dim of a 4-dim data cache)."""
    mask = torch.zeros(nbytes, dtype=torch.bool)
    es = t.element_size()
    shape, stride = list(t.shape), [s * es for s in t.stride()]
    if ncols is not None:
        shape[-1] = ncols
    mask.as_strided(shape + [es], stride + [1], t.storage_offset() * es).fill_(True)
    return mask


def _locate(off: int, caches, dq: tuple[int, int]) -> str:
    """Which of the four tensors (and which element) holds byte ``off`` of their allocation."""
    for name, t, n in zip(CACHE_NAMES, caches, (*dq, None, None), strict=True):
        es = t.element_size()
        idx = torch.full((storage_bytes(t).numel(),), -1, dtype=torch.int64)
        shape = list(t.shape)
        numel = math.prod(shape) * es
        view = idx.as_strided(shape + [es], [s * es for s in t.stride()] + [1],
                              t.storage_offset() * es)
        view.copy_(torch.arange(numel, dtype=torch.int64).view(shape + [es]))
        flat = int(idx[off])
        if flat < 0:
            continue
        pos = []
        rest = flat // es
        for size in reversed(shape):
            pos.append(rest % size)
            rest //= size
        where = list(reversed(pos))
        inside = "" if n is None or where[-1] < n else f" (past [..., :{n}]: never written)"
        return f"{name}{where}{inside}"
    return "no cache element (padding between rows: never written)"


def pth_differing_bytes(actual, expected, mode: PerTokenHeadMode, dq: tuple[int, int]
                        ) -> list[tuple[list[int], torch.Tensor]]:
    """For each allocation behind the four caches: (the indices of the caches in it, a bool mask
    of its bytes where ``actual`` and ``expected`` differ). Two fp8 codes that both decode to NaN
    (any sign or payload) count as equal, only within ``[..., :Dq]`` of the data caches."""
    out = []
    for group in _groups(actual):
        a = storage_bytes(actual[group[0]]).cpu()
        e = storage_bytes(expected[group[0]]).cpu()
        if a.numel() != e.numel():
            raise AssertionError(f"{'+'.join(CACHE_NAMES[i] for i in group)}: allocation sizes "
                                 f"differ ({a.numel()} vs {e.numel()} bytes)")
        diff = a != e
        if mode is PerTokenHeadMode.FP8_PER_TOKEN_HEAD and bool(diff.any()):
            codes = torch.zeros_like(diff)
            for i in group:
                if i < 2:
                    codes |= _region(expected[i], e.numel(), dq[i])
            nan = (torch.isnan(a.view(torch.float8_e4m3fn).float())
                   & torch.isnan(e.view(torch.float8_e4m3fn).float()))
            diff &= ~(nan & codes)
        out.append((group, diff))
    return out


def assert_pth_caches_equal(actual, expected, mode: PerTokenHeadMode,
                            dq: tuple[int, int], what: str = "") -> None:
    """Every byte of every allocation behind the four caches ``actual`` equals ``expected``'s
    (see :func:`pth_differing_bytes`); stray writes outside the written rows are caught too. The
    message names the tensor and the element of the first differing bytes, got and want."""
    for group, diff in pth_differing_bytes(actual, expected, mode, dq):
        if bool(diff.any()):
            a = storage_bytes(actual[group[0]]).cpu()
            e = storage_bytes(expected[group[0]]).cpu()
            idx = torch.nonzero(diff).flatten()
            first = idx[:6].tolist()
            cpu = tuple(c.cpu() if c.device.type != "cpu" else c for c in
                        clone_pth_caches(expected, "cpu"))
            where = "; ".join(f"byte {o}: {_locate(o, cpu, dq)} got {int(a[o])} want {int(e[o])}"
                              for o in first[:3])
            names = "+".join(CACHE_NAMES[i] for i in group)
            raise AssertionError(f"{what}{names}: {idx.numel()} bytes differ; first {where}; "
                                 f"offsets {first}")


# --- the round trip ----------------------------------------------------------------------------

_E4M3_MIN_NORMAL = 2.0**-6


def _fp8_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values at |v| (float64): 2^(e - 4) in binade e >= -6, 2^-10 below."""
    a = v.abs().clamp(min=_E4M3_MIN_NORMAL)
    return torch.exp2(torch.floor(torch.log2(a)) - 4.0)


def half_step_bound(x: torch.Tensor, xh: torch.Tensor, entry: torch.Tensor,
                    mode: PerTokenHeadMode) -> torch.Tensor:
    """The largest ``|x̂ - x|`` the format allows (float64, per element) for finite rows ``x``
    ``[..., D]`` read back as ``xh`` with scale cache entries ``[...]``: ``s/2`` for int8 and int4
    (int4: where the row straddles zero), half an e4m3 step of ``x/s`` times ``s`` for fp8; plus
    the float32 roundings (the quotient's, the product's) and int4's ``< 2^-19`` relative loss of
    the scale's low bits."""
    x64, xh64 = x.double(), xh.double()
    if mode.is_int4:
        s = (entry.view(torch.int32) & -16).view(torch.float32).double()
    else:
        s = entry.double()
    s = s[..., None]
    slack = xh64.abs() * 2.0**-23
    if mode is PerTokenHeadMode.FP8_PER_TOKEN_HEAD:
        q = torch.maximum((x64 / s).abs(), (xh64 / s).abs())
        return (_fp8_half_step(q) + q * 2.0**-21) * s + slack
    if mode.is_int4:
        return s * (0.5 + 2.0**-14) + slack
    return s * (0.5 + 2.0**-16) + slack


def _rows_error(x: torch.Tensor, xh: torch.Tensor, entry: torch.Tensor,
                mode: PerTokenHeadMode) -> tuple[torch.Tensor, torch.Tensor]:
    """(error / bound per element, which rows take part) of rows x ``[N, H, D]`` read back as
    xh with their scale entries ``[N, H]``. Rows with a NaN or infinite element take no part,
    nor (int4) rows whose values do not straddle zero, nor rows whose scale is infinite."""
    x64, xh64 = x.double(), xh.double()
    # Rows with an element at 2^127 or more may read back as ±inf (q * s rounds past float32's
    # largest value): no bound there either.
    rows = (x64.abs() < 2.0**127).all(dim=-1)
    if mode.is_int4:
        rows &= (x64.amin(dim=-1) <= 0) & (x64.amax(dim=-1) >= 0)
        rows &= torch.isfinite((entry.view(torch.int32) & -16).view(torch.float32))
    else:
        rows &= torch.isfinite(entry)
    ratio = (xh64 - x64).abs() / half_step_bound(x, xh, entry, mode)
    ratio = torch.where(torch.isnan(ratio), float("inf"), ratio)  # a NaN read back fails
    return torch.where(rows[..., None], ratio, 0.0), rows


def _written_tokens(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The tokens whose slot is in range and not shared with another token (a duplicate slot
    may hold either token's row)."""
    slots = slot_mapping.long().cpu()
    ok = (slots >= 0) & (slots < num_slots)
    uniq, counts = torch.unique(slots[ok], return_counts=True)
    once = torch.isin(slots, uniq[counts == 1]) & ok
    return torch.nonzero(once).flatten()


# Tokens read back at a time (bounds the float64 temporaries of a large call).
_ROUNDTRIP_CHUNK = 4096


def _roundtrip(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping,
               kv_quant_mode) -> tuple[float, str | None]:
    """(worst ratio of error to bound, the first failure's description or None)."""
    mode = parse_kv_quant_mode(kv_quant_mode, key_cache.dtype)
    nb, bs = key_cache.shape[:2]
    tokens = _written_tokens(slot_mapping, nb * bs)
    worst, first = 0.0, None
    for c0 in range(0, tokens.numel(), _ROUNDTRIP_CHUNK):
        part = tokens[c0:c0 + _ROUNDTRIP_CHUNK]
        slots = slot_mapping.long()[part.to(slot_mapping.device)]
        for name, x, cache, scales in (("key", key, key_cache, k_scale_cache),
                                       ("value", value, value_cache, v_scale_cache)):
            xt = x[part.to(x.device)].float()
            xh = dequantize_per_token_head(cache, scales, slots, mode, head_size=x.shape[2])
            entry = scales[slots // bs, slots % bs]
            ratio, _ = _rows_error(xt, xh, entry, mode)
            worst = max(worst, float(ratio.max()))
            bad = torch.nonzero(ratio > 1.0)
            if first is None and bad.numel():
                n, h, d = bad[0].tolist()
                got, want = float(xh[n, h, d]), float(xt[n, h, d])
                first = (f"{name}: {bad.shape[0]} elements read back ({mode.value}) farther from "
                         f"the input than the format's half step; first token {int(part[n])}, "
                         f"head {h}, element {d}: input {want!r}, read back {got!r}, error "
                         f"{abs(got - want):.6g} = {float(ratio[n, h, d]):.4g} x the bound")
    return worst, first


def roundtrip_error(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache,
                    slot_mapping, kv_quant_mode=None) -> float:
    """After a write of ``key``/``value`` with these arguments: the worst ``|x̂ - x| / bound``
    over the rows read back (<= 1 passes), where ``x̂`` is :func:`dequantize_per_token_head`'s
    value and ``bound`` the format's half step: ``s/2`` (int8, int4) or half an e4m3 step of
    ``x/s`` times ``s`` (fp8), plus float32 rounding (and int4's ``< 2^-19`` relative loss of
    the scale's low bits). Rows read: tokens with an in-range slot no other token shares; rows
    with a NaN or infinite element or one of magnitude 2^127 or more (its read-back product may
    overflow), int4 rows whose values do not straddle zero (the zero point saturates) and rows
    whose scale is infinite are skipped. 0.0 when no row qualifies. Syncs with the host; reads
    back 4096 tokens at a time."""
    return _roundtrip(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache,
                      slot_mapping, kv_quant_mode)[0]


def check_roundtrip(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache,
                    slot_mapping, kv_quant_mode=None) -> str | None:
    """:func:`roundtrip_error`'s check: None when every row read back lies within the format's
    half step of the input, else where the first one does not (tensor, token, head, element,
    input, read back, and the error as a multiple of the bound)."""
    return _roundtrip(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache,
                      slot_mapping, kv_quant_mode)[1]


# --- the matrices -------------------------------------------------------------------------------

_LAYOUTS = [(lay, alloc) for alloc in ("packed", "interleaved", "separate")
            for lay in ("NHD", "HND")]


def _cpu_matrix() -> list[PthCase]:
    cases: list[PthCase] = []
    modes = (INT8, FP8, INT4)
    for mode, dtype in itertools.product(modes, (torch.float16, torch.bfloat16, torch.float32)):
        cases.append(PthCase(kv_quant_mode=mode, dtype=dtype, num_tokens=5, num_heads=2))
    for mode, (lay, alloc) in itertools.product(modes, _LAYOUTS):
        cases.append(PthCase(kv_quant_mode=mode, layout=lay, alloc=alloc, num_tokens=5,
                             num_heads=3, head_size=32))
    for mode in modes:
        storage = {FP8: "float8", INT4: "int8"}.get(mode, "")
        cases += [
            PthCase(kv_quant_mode=mode, special_values=True, num_tokens=8, num_heads=4,
                    head_size=16, dtype=torch.float32),
            PthCase(kv_quant_mode=mode, special_values=True, num_tokens=8, num_heads=4,
                    head_size=16, dtype=torch.bfloat16, alloc="interleaved", layout="HND"),
            PthCase(kv_quant_mode=mode, special_values=True, num_tokens=6, num_heads=3,
                    head_size=24, dtype=torch.float16, alloc="separate"),
            PthCase(kv_quant_mode=mode, vllm_rows=True, num_tokens=6, head_size=32,
                    head_size_v=16, layout="HND"),
            PthCase(kv_quant_mode=mode, vllm_rows=True, alloc="interleaved", num_tokens=6,
                    head_size=16, head_size_v=48, row_pad=8),
            PthCase(kv_quant_mode=mode, alloc="separate", head_size=20, head_size_v=12,
                    row_pad=3, layout="HND", num_tokens=5),
            PthCase(kv_quant_mode=mode, fused_qkv=True, extra_rows=3, num_tokens=6,
                    head_size=32, num_heads=2, storage=storage),
            PthCase(kv_quant_mode=mode, head_pad=2, num_tokens=5, head_size=16,
                    block_size=5, num_blocks=3, alloc="separate"),
            PthCase(kv_quant_mode=mode, num_tokens=9, padding_slots=3, out_of_range_slots=2,
                    slot_dtype=torch.int32, head_size=16, num_heads=1),
            PthCase(kv_quant_mode=mode, via_allocator=True, num_tokens=5, head_size=32,
                    alloc="interleaved", layout="HND"),
            PthCase(kv_quant_mode=mode, via_allocator=True, num_tokens=5, head_size=16),
            PthCase(kv_quant_mode=mode, mode_arg="enum", num_tokens=3, head_size=8),
            PthCase(kv_quant_mode=mode, mode_arg="foreign", num_tokens=3, head_size=8),
        ]
        if mode != INT4:
            cases.append(PthCase(kv_quant_mode=mode, mode_arg="none", num_tokens=3, head_size=8,
                                 storage="float8" if mode == FP8 else ""))
            cases.append(PthCase(kv_quant_mode=mode, head_size=13, head_size_v=7,
                                 alloc="separate", num_tokens=4))
        else:
            cases.append(PthCase(kv_quant_mode=mode, head_size=14, head_size_v=6,
                                 alloc="separate", num_tokens=4, head_pad=1))
    cases += [
        PthCase(num_tokens=0),
        PthCase(num_tokens=0, extra_rows=2, kv_quant_mode=INT4),
        PthCase(num_tokens=1, num_heads=1, head_size=2, kv_quant_mode=INT4, alloc="separate"),
        PthCase(num_tokens=1, num_heads=1, head_size=1, alloc="separate"),
        PthCase(num_tokens=6, padding_slots=6, kv_quant_mode=FP8),
        PthCase(num_tokens=64, num_blocks=4, block_size=16, num_heads=1, head_size=8),  # all
    ]
    return cases


PTH_CASES: list[PthCase] = _cpu_matrix()


def _gpu_matrix() -> list[PthCase]:
    """Every mode x input dtype x head size x allocation (packed, interleaved, separate), NHD and
    HND alternating (each mode, dtype and allocation sees both), with the other factors (block
    size, GQA head count, slot dtype, padding, vLLM rows, fused qkv, storage, special values)
    cycled over them; then Dk != Dv, odd and unaligned shapes, special values and large calls."""
    cases: list[PthCase] = []
    cyc = itertools.count()
    for mode, dtype, d, alloc in itertools.product(
            (INT8, FP8, INT4), (torch.float16, torch.bfloat16, torch.float32),
            (64, 80, 96, 128, 256), ("packed", "interleaved", "separate")):
        i = next(cyc)
        lay = ("NHD", "HND")[(i // 3) % 2]
        t = (33, 7, 129, 16, 1)[i % 5]
        bs = (16, 32, 64, 12)[(i // 5) % 4]
        storages = {FP8: ("", "float8"), INT4: ("", "int8")}.get(mode, ("",))
        cases.append(PthCase(
            kv_quant_mode=mode, dtype=dtype, head_size=d, layout=lay, alloc=alloc,
            num_tokens=t, num_heads=(8, 1, 4, 2, 32, 6)[i % 6], block_size=bs,
            num_blocks=max(4, -(-2 * t // bs)), slot_dtype=(torch.int64, torch.int32)[i % 2],
            padding_slots=(0, 2, 3)[i % 3] if t > 4 else 0,
            out_of_range_slots=(0, 0, 1, 2)[i % 4] if t > 4 else 0,
            vllm_rows=alloc != "separate" and i % 3 == 1, fused_qkv=i % 7 == 3,
            extra_rows=3 if i % 5 == 2 else 0, storage=storages[i % len(storages)],
            special_values=i % 6 == 5,
        ))
    for mode in (INT8, FP8, INT4):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cases += [
                PthCase(kv_quant_mode=mode, dtype=dtype, special_values=True, num_tokens=40,
                        num_heads=8, head_size=128, num_blocks=8),
                PthCase(kv_quant_mode=mode, dtype=dtype, special_values=True, num_tokens=40,
                        num_heads=2, head_size=64, alloc="separate", layout="HND",
                        num_blocks=8),
            ]
        cases += [
            PthCase(kv_quant_mode=mode, head_size=128, head_size_v=64, num_tokens=33,
                    num_heads=8, vllm_rows=True, num_blocks=8),
            PthCase(kv_quant_mode=mode, head_size=64, head_size_v=256, num_tokens=33,
                    num_heads=4, alloc="interleaved", layout="HND", num_blocks=8),
            PthCase(kv_quant_mode=mode, head_size=46, head_size_v=80, num_tokens=20,
                    num_heads=3, alloc="separate", block_size=12, num_blocks=3),
            PthCase(kv_quant_mode=mode, head_size=128, head_pad=1, num_tokens=20, num_heads=8,
                    alloc="separate", num_blocks=4),  # rows 2-byte aligned: narrow chunks
            PthCase(kv_quant_mode=mode, head_size=512, num_tokens=9, num_heads=2,
                    num_blocks=2, alloc="separate", padding_slots=2),
            PthCase(kv_quant_mode=mode, head_size=128, num_tokens=1, num_heads=8),
            PthCase(kv_quant_mode=mode, head_size=128, num_tokens=3000, num_heads=8,
                    num_blocks=256, padding_slots=50, out_of_range_slots=50, fused_qkv=True,
                    alloc="packed", vllm_rows=True),
            PthCase(kv_quant_mode=mode, head_size=64, num_tokens=4096, num_heads=32,
                    num_blocks=300, layout="HND", slot_dtype=torch.int32),
        ]
    return cases


PTH_GPU_CASES: list[PthCase] = _gpu_matrix()
