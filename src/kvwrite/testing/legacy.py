"""reshape_and_cache's case model (the legacy layout): one :class:`LegacyCase` describes a call
(shape, dtypes, cache mode and storage, x, cache strides, scales, slots, special values);
:func:`make_legacy_inputs` builds its tensors; :func:`assert_legacy_caches_equal` compares the
whole allocations byte for byte (two fp8 NaN codes count as equal, as the fp8 rule allows);
``LEGACY_CASES`` is the matrix every implementation is tested on (small enough for the CPU),
``LEGACY_GPU_CASES`` the larger one for the GPU."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from .build import Fp8WriteCase, fill_random_bytes, flag_parts, make_slot_mapping
from .cases import (
    Inputs,
    key_value_rows,
    plant_special_values,
    random_scales,
    special_scales,
    spread_fp8_magnitudes,
)
from .compare import copy_allocations, differing_bytes, storage_bytes

__all__ = ["LegacyCase", "LegacyInputs", "LEGACY_CASES", "LEGACY_GPU_CASES", "CACHE_STRIDES",
           "make_legacy_inputs", "clone_caches", "assert_legacy_caches_equal"]

# How the caches are laid out: "contiguous" (vLLM's allocation), "padded" (every dim's stride
# larger than dense: each cache a slice of a bigger allocation), "slot-major" (the slot dim
# outermost in memory after the block: key [nb, bs, H, D/x, x] and value [nb, bs, H, D]
# permuted to the legacy shapes, so the value cache's d stride is 1), "x-strided" (the key
# cache's x dim of stride 2: every key element stored alone), "interleaved" (K and V blocks
# alternating in one allocation of bytes).
CACHE_STRIDES = ("contiguous", "padded", "slot-major", "x-strided", "interleaved")


@dataclasses.dataclass(frozen=True)
class LegacyCase(Fp8WriteCase):
    num_heads: int = 8
    head_size: int = 64
    num_blocks: int = 8
    # key_cache.size(4); None: 16 bytes / the cache element size (vLLM's).
    x: int | None = None
    cache_strides: str = "contiguous"
    # key/value as slices of one fused [T, Hq + 2H, D] qkv tensor.
    fused_qkv: bool = False
    # fp8: NaN, ±inf, ±0, subnormals, past the maximum, and the reciprocal traps of each head's
    # scale; the value input's key-cache counterpart too.
    special_values: bool = False

    @property
    def xx(self) -> int:
        """key_cache.size(4)."""
        if self.x is not None:
            return self.x
        return max(1, 16 // self.cache_tensor_dtype.itemsize)

    @property
    def id(self) -> str:
        parts = [f"T{self.num_tokens}", f"H{self.num_heads}", f"D{self.head_size}",
                 f"bs{self.block_size}", f"x{self.xx}", str(self.dtype).removeprefix("torch."),
                 self.kv_cache_dtype, self.cache_strides, *self.scale_id_parts()]
        if self.slot_dtype == torch.int32:
            parts.append("i32")
        flags = ((self.extra_rows, "extra"), (self.fused_qkv, "qkv"),
                 (self.padding_slots, "pad"), (self.out_of_range_slots, "oob"),
                 (self.special_values, "special"))
        return "-".join(flag_parts(parts, flags))


@dataclasses.dataclass
class LegacyInputs(Inputs):
    """reshape_and_cache's arguments: reshape_and_cache_flash's, in the legacy layout's caches."""


def _allocate(case: LegacyCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    nb, bs, h, d, x = case.num_blocks, case.block_size, case.num_heads, case.head_size, case.xx
    dt = case.cache_tensor_dtype
    kshape, vshape = (nb, h, d // x, bs, x), (nb, h, d, bs)
    layout = case.cache_strides
    if layout == "contiguous":
        kc, vc = torch.empty(kshape, dtype=dt), torch.empty(vshape, dtype=dt)
    elif layout == "padded":
        kc = torch.empty(nb + 1, h + 1, d // x + 1, bs + 2, x + 3, dtype=dt)[1:, :h, 1:, 1:bs + 1, :x]
        vc = torch.empty(nb, h + 2, d + 1, bs + 3, dtype=dt)[:, 2:, :d, 3:]
    elif layout == "slot-major":
        kc = torch.empty(nb, bs, h, d // x, x, dtype=dt).permute(0, 2, 3, 1, 4)
        vc = torch.empty(nb, bs, h, d, dtype=dt).permute(0, 2, 3, 1)
    elif layout == "x-strided":
        kc = torch.empty(nb, h, d // x, bs, x, 2, dtype=dt)[..., 1]
        vc = torch.empty(vshape, dtype=dt)
    elif layout == "interleaved":
        n_k, n_v = h * d * bs, h * d * bs
        both = torch.empty(nb, n_k + n_v, dtype=dt)
        kc = both[:, :n_k].view(kshape)
        vc = both[:, n_k:].view(vshape)
    else:
        raise ValueError(f"cache_strides: expected one of {CACHE_STRIDES}, got {layout!r}")
    # Random bits over the whole allocations, so that a stray or a missing write shows.
    fill_random_bytes((kc, vc), gen)
    return kc, vc


def make_legacy_inputs(case: LegacyCase, device: str | torch.device = "cpu",
                       seed: int = 0) -> LegacyInputs:
    """Build the tensors of ``case`` on ``device``; the caches' allocations hold random bits."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, H, D = case.num_tokens, case.num_heads, case.head_size
    key, value = key_value_rows(T, case.extra_rows, H, D, case.dtype, case.fused_qkv, gen)
    cdt = case.cache_dtype
    if cdt.is_fp8:
        spread_fp8_magnitudes((key, value), case.dtype, gen)
    n = H if case.per_head_scale else 1
    if cdt.is_fp8 and case.special_values:
        k_scale, v_scale = special_scales(n)
        plant_special_values(cdt, key, value, (k_scale, v_scale), T)
    elif cdt.is_fp8:
        k_scale, v_scale = random_scales(n, gen)
    else:
        k_scale = v_scale = torch.ones(1)

    slot_mapping = make_slot_mapping(case.id, T, case.num_blocks * case.block_size,
                                     case.padding_slots, case.out_of_range_slots,
                                     case.slot_dtype, gen)
    key_cache, value_cache = _allocate(case, gen)

    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale = copy_allocations(
        (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale), device, copy=False)
    return LegacyInputs(key, value, key_cache, value_cache, slot_mapping, case.kv_cache_dtype,
                        k_scale, v_scale)


def clone_caches(inp: LegacyInputs, device: str | torch.device | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of both caches (on ``device``, default theirs) with their whole allocations (one
    copy where K and V share one)."""
    key_cache, value_cache = copy_allocations((inp.key_cache, inp.value_cache), device)
    return key_cache, value_cache


def _where(cache: torch.Tensor, elem: int) -> str:
    """The index of an element offset of the allocation in ``cache``'s shape, if it is in it."""
    rel = elem - cache.storage_offset()
    dims = sorted(((s, i) for i, s in enumerate(cache.stride()) if cache.shape[i] > 1),
                  reverse=True)
    idx = [0] * cache.dim()
    for s, i in dims:
        idx[i], rel = divmod(rel, s) if s else (0, rel)
        if not 0 <= idx[i] < cache.shape[i]:
            return "outside the cache's elements"
    return f"element {tuple(idx)}" if rel == 0 else "outside the cache's elements"


def assert_legacy_caches_equal(actual: torch.Tensor, expected: torch.Tensor, name: str,
                               fp8_dtype: torch.dtype | None = None) -> None:
    """Every byte of the allocation behind ``actual`` equals ``expected``'s; with ``fp8_dtype``
    (fp8 caches) two elements that both decode to NaN count as equal. The message names the first
    differing elements by their index in the cache's shape."""
    a, e = storage_bytes(actual).cpu(), storage_bytes(expected).cpu()
    if a.numel() != e.numel():
        raise AssertionError(f"{name}: storage sizes differ ({a.numel()} vs {e.numel()} bytes)")
    decode = fp8_dtype if fp8_dtype is not None and expected.dtype == torch.uint8 else \
        expected.dtype
    diff = differing_bytes(a, e, decode if fp8_dtype is not None else None)
    if bool(diff.any()):
        idx = torch.nonzero(diff).flatten()
        es = expected.element_size()
        first = idx[:8].tolist()
        where = [_where(expected, i // es) for i in first[:4]]
        raise AssertionError(f"{name}: {idx.numel()} bytes differ; first at byte offsets {first} "
                             f"({'; '.join(where)}): got {a[idx[:8]].tolist()}, expected "
                             f"{e[idx[:8]].tolist()}")


def _matrix() -> list[LegacyCase]:
    cases: list[LegacyCase] = []
    modes = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2")
    for dtype, kv in itertools.product((torch.bfloat16, torch.float16, torch.float32), modes):
        cases.append(LegacyCase(dtype=dtype, kv_cache_dtype=kv))
    for layout, kv in itertools.product(CACHE_STRIDES, ("auto", "fp8")):
        cases.append(LegacyCase(cache_strides=layout, kv_cache_dtype=kv, num_tokens=9,
                                padding_slots=2, out_of_range_slots=1))
    for x, kv in itertools.product((1, 2, 4), ("auto", "fp8", "float32")):
        cases.append(LegacyCase(x=x, kv_cache_dtype=kv, head_size=32, num_heads=3))
    for (h, d), kv in itertools.product(((1, 80), (13, 96), (13, 80), (3, 46), (2, 6)),
                                        ("auto", "fp8")):
        cases.append(LegacyCase(num_heads=h, head_size=d, kv_cache_dtype=kv, num_tokens=17,
                                x=2 if d % 4 else None, block_size=7, num_blocks=4))
    for kv, storage in itertools.product(("fp8", "fp8_e5m2"), ("uint8", "float8")):
        cases.append(LegacyCase(kv_cache_dtype=kv, fp8_storage=storage, per_head_scale=True,
                                special_values=True, num_tokens=9, num_heads=4, head_size=32,
                                dtype=torch.float32))
    cases += [
        LegacyCase(num_tokens=1),
        LegacyCase(num_tokens=0, extra_rows=3),
        LegacyCase(num_tokens=9, padding_slots=9),
        LegacyCase(num_tokens=9, padding_slots=3, out_of_range_slots=2, slot_dtype=torch.int32),
        LegacyCase(num_tokens=7, extra_rows=5, fused_qkv=True, kv_cache_dtype="fp8",
                   per_head_scale=True, cache_strides="padded"),
        LegacyCase(num_tokens=6, kv_cache_dtype="fp8_e5m2", per_head_scale=True,
                   special_values=True, num_heads=2, head_size=32, block_size=1, num_blocks=8),
        LegacyCase(num_tokens=64, num_heads=64, head_size=128, block_size=16, num_blocks=4,
                   kv_cache_dtype="bfloat16", dtype=torch.float32),  # vLLM drops half the heads
        LegacyCase(num_tokens=48, num_heads=2, head_size=16, block_size=16, num_blocks=3),  # all
    ]
    return cases


LEGACY_CASES: list[LegacyCase] = _matrix()


def _gpu_matrix() -> list[LegacyCase]:
    cases: list[LegacyCase] = []
    modes = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e5m2")
    # Every input dtype and cache mode, two cache layouts each in turn (every layout with every
    # mode); per-head scales on the fp8 ones every other case.
    for i, (dtype, kv) in enumerate(itertools.product(
            (torch.bfloat16, torch.float16, torch.float32), modes)):
        for j in (0, 1):
            cases.append(LegacyCase(dtype=dtype, kv_cache_dtype=kv,
                                    cache_strides=CACHE_STRIDES[(2 * i + j) % 5], num_tokens=200,
                                    num_heads=8, head_size=128, num_blocks=16, padding_slots=5,
                                    out_of_range_slots=3, per_head_scale=j == 1))
    for i, (x, kv) in enumerate(itertools.product((1, 2, 4, 8, 16), ("auto", "fp8", "float32"))):
        bs = (1, 16, 64)[i % 3]
        cases.append(LegacyCase(x=x, kv_cache_dtype=kv, num_tokens=100, num_heads=4,
                                head_size=128, block_size=bs, num_blocks=max(2, 256 // bs),
                                slot_dtype=torch.int32))
    for h, kv in itertools.product((32, 64), ("auto", "bfloat16", "fp8", "fp8_e5m2")):
        # H = 64, D = 128: vLLM's 512 threads leave half the heads of 16-bit caches unwritten.
        cases.append(LegacyCase(num_heads=h, head_size=128, kv_cache_dtype=kv, num_tokens=70,
                                num_blocks=8, per_head_scale=True, dtype=torch.float16))
    for i, (h, d) in enumerate(((1, 80), (13, 96), (13, 80), (1, 96), (5, 46), (3, 6))):
        for kv in (("auto", "fp8"), ("float32", "fp8_e5m2"))[i % 2]:
            cases.append(LegacyCase(num_heads=h, head_size=d, kv_cache_dtype=kv, num_tokens=129,
                                    x=2 if d % 4 else None, block_size=7, num_blocks=24,
                                    padding_slots=4, out_of_range_slots=4, extra_rows=3))
    for i, (kv, storage, per_head) in enumerate(itertools.product(
            ("fp8", "fp8_e5m2"), ("uint8", "float8"), (False, True))):
        cases.append(LegacyCase(kv_cache_dtype=kv, fp8_storage=storage, per_head_scale=per_head,
                                special_values=True, num_tokens=33, num_heads=4, head_size=64,
                                dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3],
                                cache_strides=CACHE_STRIDES[i % 5]))
    # Small calls (CTAs of one warp, lane pairs on fp8 caches).
    for t, kv in ((1, "fp8"), (2, "fp8_e5m2"), (16, "fp8"), (5, "auto")):
        cases.append(LegacyCase(num_tokens=t, num_heads=8, head_size=128, kv_cache_dtype=kv,
                                num_blocks=16, padding_slots=int(t > 2), per_head_scale=t == 16))
    cases += [
        LegacyCase(num_tokens=4096, num_heads=8, head_size=128, block_size=16, num_blocks=256,
                   kv_cache_dtype="fp8", fused_qkv=True),  # every slot, consecutive runs
        LegacyCase(num_tokens=3000, num_heads=2, head_size=64, block_size=64, num_blocks=64,
                   slot_dtype=torch.int32, extra_rows=7, padding_slots=100,
                   out_of_range_slots=50),
    ]
    return cases


LEGACY_GPU_CASES: list[LegacyCase] = _gpu_matrix()
