"""reshape_and_cache_turboquant's case model: one :class:`TqCase` describes a call (preset,
shapes, dtype, the cache's layout and row width, slots, tables, special values);
:func:`make_tq_inputs` builds its tensors; :func:`assert_tq_caches_equal` is the byte comparison
of whole allocations (NaN-aware only where the contract leaves the NaN open: k8v4's key codes and
the MSE norm); :func:`check_roundtrip` reads the written slots back and checks SPEC §10.2's
value bound."""

from __future__ import annotations

import dataclasses

import torch

from ..formats import TurboQuantSlot, turboquant_preset
from ..ops.reshape_and_cache_turboquant.readers import turboquant_gather_cache
from ..ops.reshape_and_cache_turboquant.tables import lloyd_max_centroids, turboquant_tables
from .build import WriteCase, fill_random_bytes, flag_parts, make_slot_mapping
from .compare import assert_caches_equal, copy_allocations

__all__ = ["TqCase", "TqInputs", "PRESETS", "K8V4", "NC4", "K3V4", "NC3", "make_tq_inputs",
           "make_tables", "special_rows", "assert_tq_caches_equal", "check_roundtrip",
           "canonical_nans", "written_rows"]

K8V4, NC4, K3V4, NC3 = PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                  "turboquant_3bit_nc")


@dataclasses.dataclass(frozen=True)
class TqCase(WriteCase):
    kv_cache_dtype: str = NC4
    num_heads: int = 2
    head_size: int = 64
    # "HND": vLLM's (num_blocks, H, block_size, S) allocation transposed to the logical order;
    # "NHD": (num_blocks, block_size, H, S).
    layout: str = "HND"
    # Bytes past slot_size_aligned in each row (S = slot_size_aligned + row_pad).
    row_pad: int = 0
    # key/value heads spaced head_size + head_pad elements apart (head stride free).
    head_pad: int = 0
    special_values: bool = False
    # PiT passed as the transpose of a contiguous matrix (its strides free); tables of another
    # rotation than vLLM's Hadamard (always for a head size that is no power of two).
    pit_strided: bool = False
    own_tables: bool = False
    # Input rows scaled by this (large values: k8v4's saturation, fp16 scale and zero overflow).
    magnitude: float = 1.0

    @property
    def slot(self) -> TurboQuantSlot:
        return turboquant_preset(self.kv_cache_dtype).at(self.head_size)

    @property
    def id(self) -> str:
        parts = [self.kv_cache_dtype.removeprefix("turboquant_"), f"T{self.num_tokens}",
                 f"H{self.num_heads}", f"D{self.head_size}", f"bs{self.block_size}",
                 str(self.dtype).removeprefix("torch."), self.layout]
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.row_pad, f"rpad{self.row_pad}"), (self.head_pad, f"hpad{self.head_pad}"),
                 (self.extra_rows, "extra"), (self.padding_slots, "pad"),
                 (self.out_of_range_slots, "oob"), (self.special_values, "special"),
                 (self.pit_strided, "pitT"), (self.own_tables, "owntables"),
                 (self.magnitude != 1.0, f"x{self.magnitude:g}"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class TqInputs:
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache_dtype: str
    PiT: torch.Tensor | None
    midpoints: torch.Tensor | None
    centroids: torch.Tensor | None

    def args(self) -> tuple:
        """The op's positional arguments."""
        return (self.key, self.value, self.kv_cache, self.slot_mapping, self.kv_cache_dtype,
                self.PiT, self.midpoints)


def special_rows(d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows of ``d`` elements (float32, exact in ``dtype``) for SPEC §10.2's special cases, for
    keys and values alike: zero (with -0), NaN (one, all), +inf, -inf, +inf only, +inf and -inf,
    a row whose sum of squares overflows (float32 and bfloat16), constant rows of both signs,
    e4m3 halfway values and saturation, ties of the value codes (a range of 15 and 7 at scale 1),
    far from zero (fp16 zero rounding), a range past fp16 (scale +inf), subnormal and tiny."""
    nan, inf = float("nan"), float("inf")
    finfo = torch.finfo(dtype)
    ar = torch.arange(d, dtype=torch.float32)
    rows = []

    def row(vals) -> None:
        r = torch.zeros(d)  # the rest of a short row: zeros
        v = torch.as_tensor(vals, dtype=torch.float32).flatten()[:d]
        r[:v.numel()] = v
        rows.append(r)

    def rep(t) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=torch.float32)
        return t.repeat(-(-d // t.numel()))

    row(torch.where(ar % 3 == 0, -0.0, 0.0))                               # zero, some -0
    row(torch.full((d,), -0.0))                                            # all -0
    row(torch.cat([torch.tensor([nan]), torch.linspace(-3, 5, d - 1)]))   # one NaN
    row(torch.full((d,), nan))                                             # all NaN
    row(torch.cat([torch.tensor([1.0, inf]), torch.linspace(-2, 2, d - 2)]))  # +inf
    row(torch.cat([torch.tensor([-inf, 0.5]), torch.linspace(-2, 2, d - 2)]))  # -inf
    row(torch.where(ar % 2 == 0, inf, nan))                                # +inf only, NaNs
    row(torch.full((d,), inf))                                             # +inf only
    row(torch.where(ar % 2 == 0, inf, -inf))                               # +inf and -inf
    row(torch.full((d,), 3.0))                                             # constant
    row(torch.full((d,), -0.375))                                          # constant, negative
    # e4m3 halfway values (nearest even), 448 and past it (saturation).
    row(rep([1.0625, 1.1875, 17.0, 19.0, -2.125, 0.0009765625, 0.0029296875, -0.0048828125,
             464.0, 480.0, -500.0, 448.0]))
    # values: a range of 15 from 0 (s = 1, zero 0): every k + 1/2.
    row(rep([0.0, 15.0, 0.5, 1.5, 2.5, 7.5, 14.5, 3.5, 12.5, 6.5, 9.5, 13.5]))
    row(rep([0.0, 7.0, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 6.0]))         # range 7
    # A rotated coordinate that cancels: only the tree's order leaves -2^-29 (a sum in order
    # gives 0, the upper side of the 4-bit codebook's midpoint 0).
    row([-2.0**-30, -2.0**-30, 1.0, -1.0])
    if dtype == torch.float32:
        row(_reciprocal_trap_row(15))                      # values: x / s, not x * (1 / s)
    row(1000.0 + torch.linspace(0, 1, d))                                  # far from zero
    row(-3000.0 - torch.linspace(0, 3, d))
    row(torch.linspace(-3, 3, d) * finfo.tiny)                             # subnormal / tiny
    row(torch.linspace(-1, 1, d) * 2.0**-20)                               # s below the floor
    if finfo.max > 1e30:                                                   # bf16, float32
        row(torch.linspace(-1, 1, d) * 2.0**64)                           # ss overflows
        row(torch.where(ar % 2 == 0, finfo.max, -finfo.max))               # range overflows
    else:
        row(torch.where(ar % 2 == 0, 65504.0, -65504.0))                   # fp16 scale: inf
    return [r.to(dtype).float() for r in rows]


def _reciprocal_trap_row(levels: int) -> torch.Tensor:
    """A float32 value row of range 45 from 0 (s = RN(45 / levels)), then values beside the
    code ties whose code from RN(x / s) differs from that of RN(x * RN(1 / s))."""
    s = torch.tensor(45.0) / torch.tensor(float(levels))
    r = torch.tensor(1.0) / s
    ties = ((torch.arange(levels, dtype=torch.float64) + 0.5) * s.double()).float()
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)),
                      torch.nextafter(ties, torch.tensor(64.0))])
    exact = near / s
    approx = near * r

    def code(q):
        f = q.floor()
        return torch.where(q - f >= 0.5, f + 1, f)

    traps = near[code(exact) != code(approx)]
    return torch.cat([torch.tensor([0.0, 45.0]), traps])


def _random_rows(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal rows with a magnitude per row (keys of very different norms)."""
    x = torch.randn(shape, generator=gen)
    mag = torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=gen).float())
    return (x * mag).to(dtype)


def _plant_specials(x: torch.Tensor, n_tokens: int, first: int) -> None:
    """Put the special rows into the real tokens' heads, from head ``first`` on."""
    rows = special_rows(x.shape[-1], x.dtype)
    flat = x[:n_tokens].flatten(0, 1)
    for i, r in enumerate(rows):
        flat[(first + i) % flat.shape[0]] = r.to(x.dtype)


def make_tables(case: TqCase, gen: torch.Generator | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(PiT, centroids, midpoints)`` of ``case`` on the CPU: vLLM's (turboquant_tables) at a
    power-of-two head size, else (or ``own_tables``) a random orthogonal rotation with the
    Lloyd-Max codebook of that head size."""
    slot = case.slot
    if not slot.mse:
        return None, None, None
    d = case.head_size
    if d & (d - 1) == 0 and not case.own_tables:
        pit, centroids, midpoints = turboquant_tables(d, case.kv_cache_dtype)
    else:
        gen = gen or torch.Generator().manual_seed(d)
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        pit = q.float()
        centroids = torch.tensor(lloyd_max_centroids(d, slot.key_bits), dtype=torch.float32)
        # Another codebook for each seed (a graph replay must read the new one), still sorted.
        jitter = 1 + 0.05 * (torch.rand(centroids.shape, generator=gen) - 0.5)
        centroids = (centroids * jitter).sort().values
        pair = centroids[:-1] + centroids[1:]
        midpoints = pair / torch.full_like(pair, 2.0)
    if case.pit_strided:
        pit = pit.t().contiguous().t()
    return pit, centroids, midpoints


def _allocate(case: TqCase) -> torch.Tensor:
    nb, bs, h = case.num_blocks, case.block_size, case.num_heads
    s = case.slot.slot_size_aligned + case.row_pad
    if case.layout == "HND":
        return torch.empty(nb, h, bs, s, dtype=torch.uint8).transpose(1, 2)
    return torch.empty(nb, bs, h, s, dtype=torch.uint8)


def make_tq_inputs(case: TqCase, device: str | torch.device = "cpu", seed: int = 0) -> TqInputs:
    """Build the tensors of ``case`` on ``device`` (deterministic by ``seed``); the cache's
    allocation holds random bytes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = case.num_tokens + case.extra_rows
    h, d = case.num_heads, case.head_size
    key = _random_rows((rows, h, d + case.head_pad), case.dtype, gen)[..., :d]
    value = _random_rows((rows, h, d + case.head_pad), case.dtype, gen)[..., :d]
    if case.magnitude != 1.0:
        key.mul_(case.magnitude)
        value.mul_(case.magnitude)
    if case.special_values:
        n = min(case.num_tokens, rows)
        _plant_specials(key, n, 0)
        _plant_specials(value, n, 3)
    cache = _allocate(case)
    fill_random_bytes((cache,), gen)
    slot_mapping = make_slot_mapping(case.id, case.num_tokens, case.num_slots,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen)
    pit, centroids, midpoints = make_tables(case, gen)
    moved = copy_allocations((key, value, cache, slot_mapping, pit, midpoints, centroids), device,
                             copy=False)
    k, v, c, sm, pit, midpoints, centroids = moved
    return TqInputs(k, v, c, sm, case.kv_cache_dtype, pit, midpoints, centroids)


# --- comparison ------------------------------------------------------------------------------------

def canonical_nans(kv_cache: torch.Tensor, slot: TurboQuantSlot) -> None:
    """In place: every NaN where the contract leaves its bits open (k8v4's e4m3fn key codes, the
    MSE presets' fp16 norm) made 0x7F / 0x7E00, in every slot of the logical view."""
    rows = kv_cache[..., :slot.slot_size]
    if not slot.mse:
        codes = rows[..., :slot.head_size]
        codes[(codes & 0x7F) == 0x7F] = 0x7F
    else:
        norm = rows[..., slot.norm_offset:slot.norm_offset + 2]
        bits = norm[..., 0].to(torch.int32) | (norm[..., 1].to(torch.int32) << 8)
        nan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0)
        norm[..., 0][nan] = 0x00
        norm[..., 1][nan] = 0x7E


def assert_tq_caches_equal(got: torch.Tensor, want: torch.Tensor, slot: TurboQuantSlot,
                           name: str = "kv_cache") -> None:
    """The whole allocations of two caches hold the same bytes (NaNs of open bits aside)."""
    g, w = copy_allocations((got, want), "cpu")
    canonical_nans(g, slot)
    canonical_nans(w, slot)
    assert_caches_equal(g, w, name)


# --- round trip ------------------------------------------------------------------------------------

def written_rows(slot_mapping: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, slots) of the tokens written last to each in-range slot."""
    sm = slot_mapping.long().cpu()
    last = {}
    for t, s in enumerate(sm.tolist()):
        if 0 <= s < num_slots:
            last[s] = t
    tokens = torch.tensor(sorted(last.values()), dtype=torch.long)
    return tokens, sm[tokens]


def check_roundtrip(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT=None, midpoints=None,
                    centroids=None) -> str | None:
    """Read the written slots back (turboquant_gather_cache) and check them: values of finite
    rows whose scale and zero are in fp16 range within SPEC §10.2's bound; k8v4 keys within
    e4m3fn's half step (finite |x| <= 448); MSE keys of finite rows, rotated, within the norm
    times the codebook's largest gap plus its renormalization. None if they are, else why not."""
    slot = turboquant_preset(kv_cache_dtype).at(key.shape[-1])
    nb, bs = kv_cache.shape[:2]
    tokens, slots = written_rows(slot_mapping, nb * bs)
    if tokens.numel() == 0:
        return None
    k_hat, v_hat = turboquant_gather_cache(kv_cache, slots.to(kv_cache.device), kv_cache_dtype,
                                           key.shape[-1], centroids, PiT, unrotate=False)
    k_hat, v_hat = k_hat.cpu().double(), v_hat.cpu().double()
    x, v = key[tokens.to(key.device)].cpu().double(), value[tokens.to(key.device)].cpu().double()
    # values
    finite = torch.isfinite(v).all(-1)
    mn, mx = v.amin(-1), v.amax(-1)
    levels = slot.value_levels
    s = ((mx - mn).float() / levels).double().clamp_min(1e-8)
    rows = kv_cache[..., :slot.slot_size][slots // bs, slots % bs].cpu()
    scale = rows[..., slot.scale_offset:slot.scale_offset + 2].contiguous().view(
        torch.float16)[..., 0].double()
    zero = rows[..., slot.zero_offset:slot.zero_offset + 2].contiguous().view(
        torch.float16)[..., 0].double()
    ok = finite & torch.isfinite(scale) & torch.isfinite(zero) & (mn.abs() < 65504) \
        & (s < 65504)
    bound = s / 2 + levels * (scale - s).abs() + (zero - mn).abs()
    bound = bound + (mx.abs() + bound) * 2.0**-23 * 4
    err = (v_hat - v).abs().amax(-1)
    bad = ok & (err > bound)
    if bool(bad.any()):
        i = torch.nonzero(bad)[0].tolist()
        return f"value row {i}: error {err[tuple(i)].item()} > bound {bound[tuple(i)].item()}"
    if not slot.mse:
        fin = torch.isfinite(x) & (x.abs() <= 448)
        half = torch.where(x.abs() < 2.0**-6, 2.0**-10, x.abs() * 2.0**-4)
        bad = fin & ((k_hat - x).abs() > half)
        if bool(bad.any()):
            return f"k8v4 key element {torch.nonzero(bad)[0].tolist()}: off by more than half a step"
        return None
    # MSE keys: each index names a nearest centroid of the rotated unit row y (SPEC §10.2, with
    # vLLM's midpoints), and the read-back rotated key is fp16(norm) times that centroid
    # (renormalized over the row for the _nc presets).
    from ..ops.reshape_and_cache_turboquant.reference import unpack_codes
    finite = torch.isfinite(x).all(-1)
    n = x.norm(dim=-1)
    ok = finite & (n < 6e4) & (n > 1e-3)
    y = (x / n[..., None]) @ PiT.cpu().double()
    c = centroids.cpu().double()
    idx = unpack_codes(rows[..., :slot.key_index_bytes], slot.key_bits, key.shape[-1])
    dist = (y[..., None] - c).abs()
    slack = 1e-5 * (1 + y.abs())
    bad = ok[..., None] & (dist.gather(-1, idx[..., None])[..., 0] > dist.amin(-1) + slack)
    if bool(bad.any()):
        return f"MSE key element {torch.nonzero(bad)[0].tolist()}: index not a nearest centroid"
    ci = c[idx]
    if slot.norm_correction:
        ci = ci / ci.norm(dim=-1, keepdim=True)
    norm = rows[..., slot.norm_offset:slot.norm_offset + 2].contiguous().view(
        torch.float16)[..., 0].double()
    want = norm[..., None] * ci
    bad = ok[..., None] & ((k_hat - want).abs() > 1e-5 * (want.abs() + norm[..., None] * 1e-3))
    if bool(bad.any()):
        return f"MSE key element {torch.nonzero(bad)[0].tolist()}: read back off norm * centroid"
    return None
