"""What one benchmark point runs on: the case (``kvwrite.testing.Case``, the one workload model
of tests, benchmark and probes), the caches, and the input sets calls rotate over.

Input sets follow vLLM's benchmark recipe: after seeding every RNG with 42, ``key`` and ``value``
are ``torch.randn`` rows, the slots are ``random.sample(range(num_blocks * block_size), T)``
(unique), and ``k_scale = key.amax() / 64`` (same for v), a float32 tensor. Set 0 is exactly vLLM's
set; further sets (for L2 rotation) continue the same random streams. Other slot patterns
(``case.slots``: decode, prefill, mixed, padding; :mod:`kvwrite.testing.slots`) replace only the
slots; key and value are drawn as above.

Caches are allocated as vLLM's benchmark does (one allocation per layer, K and V blocks
interleaved) for the NHD and HND layouts, or as one packed allocation
``[num_blocks, block_size, H, 2*D]`` (K = ``[..., :D]``, V = ``[..., D:]``) for "packed" and
``[num_blocks, H, block_size, 2*D]`` for "HND-packed" (vLLM's LBNHC and LBHNC), and
filled with uniform values in ``±head_size**-0.5`` (valid fp8 values for fp8 caches) by
:func:`kvwrite.layouts.fill_uniform`, which needs no full-size temporary.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import numpy as np
import torch

from ..dtypes import CacheDType
from ..layouts import (
    LAYOUT_NAMES,
    allocate_kv_cache,
    create_kv_caches_with_random_flash,
    fill_uniform,
    layout_alloc,
)
from ..testing.cases import Case
from ..testing.compare import storage_bytes
from ..testing.slots import make_slots
from .engine import SlotsBench, compare_with_reference, skip_unless_fits, slots_line

__all__ = ["LAYOUTS", "Case", "InputSet", "layout_alloc", "make_caches", "fill_caches",
           "make_input_sets", "slot_sets", "point_sets", "key_value_rows", "seed_everything", "SEED",
           "check_caches"]

SEED = 42
LAYOUTS = LAYOUT_NAMES
# Largest temporary (bytes) that filling or checking a cache may allocate at once.
CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass
class InputSet:
    key: torch.Tensor            # [T, H, D]
    value: torch.Tensor          # [T, H, D]
    slot_mapping: torch.Tensor   # [T] int64, unique slots (-1 = padding)
    k_scale: torch.Tensor        # float32, [] or [H]
    v_scale: torch.Tensor

    def run_args(self, key_cache, value_cache, cache_dtype: CacheDType) -> tuple:
        """Arguments of an implementation's ``run`` (scales only in fp8 modes, as the op passes)."""
        fp8 = cache_dtype.is_fp8
        return (self.key, self.value, key_cache, value_cache, self.slot_mapping, cache_dtype,
                self.k_scale if fp8 else None, self.v_scale if fp8 else None)


def make_caches(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (key_cache, value_cache) of the case's layout, logical [nb, bs, H, D] each."""
    return allocate_kv_cache(case.num_blocks, case.block_size, case.num_heads, case.head_size,
                             case.cache_tensor_dtype, case.layout, case.alloc, device)


def fill_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, case: Case,
                seed: int = SEED) -> None:
    """Uniform random values in ``±head_size**-0.5`` (valid fp8 values for fp8 caches)."""
    gen = torch.Generator(device=key_cache.device).manual_seed(seed)
    bound = case.head_size**-0.5
    for cache in (key_cache, value_cache):
        fill_uniform(cache, case.cache_dtype, -bound, bound, gen)


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def key_value_rows(p, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal key and value rows ``[num_tokens, num_heads, head_size]`` of point ``p``'s dtype."""
    key = torch.randn(p.num_tokens, p.num_heads, p.head_size, dtype=p.dtype, device=device)
    return key, torch.randn_like(key)


class KeyValueBench(SlotsBench):
    """A write of key and value rows (:func:`key_value_rows` of the point's ``num_tokens``,
    ``num_heads``, ``head_size``, ``dtype``) through a slot pattern: the header (shape, slots and
    the op's ``bytes_formula``) and an input set's bytes."""

    bytes_formula = ""

    def header(self, args, points) -> list[str]:
        model = f" ({args.model}, tp={args.tp})" if getattr(args, "model", None) else ""
        return [f"shape: num_heads={args.num_heads}{model} head_size={args.head_size} "
                f"block_size={args.block_size} num_blocks={args.num_blocks} dtype={args.dtype}",
                slots_line(args.pattern, points, args.num_blocks, args.block_size),
                self.bytes_formula]

    def set_bytes(self, p, kind: str) -> int:
        """The key and value rows and the int64 slots."""
        return p.num_tokens * (2 * p.num_heads * p.head_size * p.dtype.itemsize + 8)


def slot_sets(pattern, num_tokens: int, num_blocks: int, block_size: int, count: int,
              device: torch.device, rows: Callable[[], tuple]) -> list[tuple]:
    """``count`` input sets: every generator seeded (:func:`seed_everything`), then set i =
    ``(*rows(), slots)``, ``slots`` the int64 slots of ``pattern``'s set i on ``device`` (drawn
    after the rows, so that set 0 of the random pattern is vLLM's). Raises ValueError where the
    pattern does not fit the cache."""
    seed_everything()
    sets = []
    for i in range(count):
        tensors = rows()
        batch = make_slots(pattern, num_tokens, num_blocks, block_size, set_index=i)
        sets.append((*tensors, torch.from_numpy(batch.slots).to(device)))
    return sets


def make_input_sets(case: Case, num_tokens: int, count: int, device: torch.device,
                    scales: tuple[float, float] | None = None) -> list[InputSet]:
    """``count`` input sets of ``num_tokens`` tokens with ``case.slots``'s slot pattern; with the
    default pattern (random, no padding) set 0 is vLLM's benchmark input. Raises ValueError where
    the pattern does not fit the cache.

    ``scales`` (k, v): every fp8 k_scale (per tensor, or each head's) is k and every v_scale v,
    instead of amax / 64."""
    if num_tokens > case.num_slots:
        raise ValueError(
            f"num_tokens: expected at most num_blocks * block_size = {case.num_slots}, got {num_tokens}"
        )
    seed_everything()
    sets = []
    for i in range(count):
        key = torch.randn(num_tokens, case.num_heads, case.head_size, dtype=case.dtype,
                          device=device)
        value = torch.randn_like(key)
        batch = make_slots(case.slots, num_tokens, case.num_blocks, case.block_size, set_index=i)
        slots = torch.from_numpy(batch.slots).to(device=device, dtype=case.slot_dtype)
        if scales is not None:
            shape = (case.num_heads,) if case.per_head_scale else ()
            k_scale, v_scale = (torch.full(shape, s, dtype=torch.float32, device=device)
                                for s in scales)
        elif case.per_head_scale:
            k_scale = (key.amax(dim=(0, 2)) / 64.0).to(torch.float32)
            v_scale = (value.amax(dim=(0, 2)) / 64.0).to(torch.float32)
        else:
            k_scale = (key.amax() / 64.0).to(torch.float32)
            v_scale = (value.amax() / 64.0).to(torch.float32)
        sets.append(InputSet(key, value, slots, k_scale, v_scale))
    return sets


def point_sets(p, count: int, device: torch.device, rows: Callable[[], tuple]) -> list[tuple]:
    """:func:`slot_sets` for a point with ``slots`` (its pattern),
    ``num_tokens``, ``num_blocks`` and ``block_size``: Skip where the pattern does not fit."""
    with skip_unless_fits():
        return slot_sets(p.slots, p.num_tokens, p.num_blocks, p.block_size, count, device, rows)


def fp8_beside(p, sets: list[tuple], device: torch.device) -> tuple[tuple, tuple]:
    """The fp8 write of point ``p``'s shape, the series a new format is timed beside: its
    per-tensor scales (the first input set's amax / 448, float32 ``[1]`` each) and vLLM's NHD fp8
    caches of random bytes (``p.num_blocks`` blocks of ``p.block_size``, ``p.num_heads`` heads of
    ``p.head_size``)."""
    key, value, _ = sets[0]
    scales = tuple((x.abs().amax().float() / 448).reshape(1) for x in (key, value))
    (k, ), (v, ) = create_kv_caches_with_random_flash(
        p.num_blocks, p.block_size, 1, p.num_heads, p.head_size, "fp8", seed=SEED,
        device=device, cache_layout="NHD")
    return scales, (k, v)


def fp8_write(key, value, slots, caches: tuple, scales: tuple, impl: str) -> Callable[[], None]:
    """A call of the fp8 write of :func:`fp8_beside` into ``caches`` by ``impl``."""
    from .. import reshape_and_cache_flash  # at call time: a test may replace it

    return lambda: reshape_and_cache_flash(key, value, caches[0], caches[1], slots, "fp8",
                                           *scales, implementation=impl)


def cycling(calls: list[Callable[[], None]]) -> Callable[[int], None]:
    """The engine's ``call(i)`` over prepared calls, one per input set, in turn."""
    def call(i: int) -> None:
        calls[i % len(calls)]()
    return call


def check_caches(run, impl: str, caches: tuple, nan_dtypes: tuple = ()) -> str | None:
    """``run(implementation, caches)`` by ``impl`` and by the torch reference, each into copies
    of the whole allocations behind ``caches`` (uint8 views; the caches that share one allocation
    share its copy): None when every copy holds the same bytes, else the first difference.
    ``nan_dtypes[i]`` (where given and not None): in the allocation of ``caches[i]``, two NaN
    codes of that element dtype count as equal (fp8 elements: SPEC §1.1 leaves which NaN code
    unspecified)."""
    names: dict[int, str] = {}
    base, nan = {}, {}
    for i, c in enumerate(caches):
        name = names.setdefault(c.untyped_storage().data_ptr(), f"allocation {len(names)}")
        base[name] = storage_bytes(c)
        if i < len(nan_dtypes) and nan_dtypes[i] is not None:
            nan[name] = nan_dtypes[i]

    def writer(implementation):
        def write(out):
            views = tuple(out[names[c.untyped_storage().data_ptr()]].as_strided(
                c.shape, c.stride(), c.storage_offset()) for c in caches)
            run(implementation, views)
        return write
    return compare_with_reference(writer(impl), writer("torch"), base, nan)
