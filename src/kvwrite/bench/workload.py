"""What one benchmark point runs on: the shape, the caches, and the input sets calls rotate over.

Input sets follow vLLM's benchmark recipe: after seeding every RNG with 42, ``key`` and ``value``
are ``torch.randn`` rows, the slots are ``random.sample(range(num_blocks * block_size), T)``
(unique), and ``k_scale = key.amax() / 64`` (same for v), a float32 tensor. Set 0 is exactly vLLM's
set; further sets (for L2 rotation) continue the same random streams.

Caches are allocated as vLLM's benchmark does (one allocation per layer, K and V blocks
interleaved) for the NHD and HND layouts, or as one packed allocation
``[num_blocks, block_size, H, 2*D]`` (K = ``[..., :D]``, V = ``[..., D:]``) for "packed", and
filled with uniform values in ``±head_size**-0.5`` (valid fp8 values for fp8 caches) by
:func:`kvwrite.layouts.fill_uniform`, which needs no full-size temporary.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from ..dtypes import CacheDType
from ..layouts import KVAlloc, Layout, allocate_kv_cache, fill_uniform

__all__ = ["LAYOUTS", "Shape", "InputSet", "layout_alloc", "make_caches", "fill_caches",
           "make_input_sets", "SEED"]

SEED = 42
LAYOUTS = ("NHD", "HND", "packed")
# Largest temporary (bytes) that filling or checking a cache may allocate at once.
CHUNK_BYTES = 256 * 2**20
SLOT_DTYPE = torch.int64


@dataclasses.dataclass(frozen=True)
class Shape:
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype           # key/value dtype
    cache_dtype: CacheDType
    kv_cache_dtype: str          # as the user spelled it (passed to the op)
    layout: str                  # "NHD", "HND" or "packed"
    per_head_scale: bool = False

    @property
    def in_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def cache_elem_bytes(self) -> int:
        return self.cache_dtype.element_size(self.dtype)

    @property
    def cache_tensor_dtype(self) -> torch.dtype:
        return torch.uint8 if self.cache_dtype.is_fp8 else self.cache_dtype.element_dtype(self.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K plus one block of V."""
        return 2 * self.block_size * self.num_heads * self.head_size * self.cache_elem_bytes

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def set_bytes(self, num_tokens: int) -> int:
        """Bytes of one input set: key, value and the slot mapping."""
        return (2 * num_tokens * self.num_heads * self.head_size * self.in_bytes
                + num_tokens * SLOT_DTYPE.itemsize)

    def bytes_moved(self, num_tokens: int) -> int:
        """Bytes one call reads and writes: ``2*T*H*D*(in_bytes + cache_bytes) + T*slot_bytes``."""
        return (2 * num_tokens * self.num_heads * self.head_size
                * (self.in_bytes + self.cache_elem_bytes) + num_tokens * SLOT_DTYPE.itemsize)


@dataclasses.dataclass
class InputSet:
    key: torch.Tensor            # [T, H, D]
    value: torch.Tensor          # [T, H, D]
    slot_mapping: torch.Tensor   # [T] int64, unique slots
    k_scale: torch.Tensor        # float32, [] or [H]
    v_scale: torch.Tensor

    def run_args(self, key_cache, value_cache, cache_dtype: CacheDType) -> tuple:
        """Arguments of an implementation's ``run`` (scales only in fp8 modes, as the op passes)."""
        fp8 = cache_dtype.is_fp8
        return (self.key, self.value, key_cache, value_cache, self.slot_mapping, cache_dtype,
                self.k_scale if fp8 else None, self.v_scale if fp8 else None)


def layout_alloc(name: str) -> tuple[Layout, KVAlloc]:
    """The cache layout and allocation of a benchmark layout name (one of ``LAYOUTS``)."""
    if name == "packed":
        return Layout.NHD, KVAlloc.PACKED
    return Layout(name), KVAlloc.INTERLEAVED


def make_caches(shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (key_cache, value_cache) of ``shape.layout``, logical [nb, bs, H, D] each."""
    layout, alloc = layout_alloc(shape.layout)
    return allocate_kv_cache(shape.num_blocks, shape.block_size, shape.num_heads, shape.head_size,
                             shape.cache_tensor_dtype, layout, alloc, device)


def fill_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, shape: Shape,
                seed: int = SEED) -> None:
    """Uniform random values in ``±head_size**-0.5`` (valid fp8 values for fp8 caches)."""
    gen = torch.Generator(device=key_cache.device).manual_seed(seed)
    bound = shape.head_size**-0.5
    for cache in (key_cache, value_cache):
        fill_uniform(cache, shape.cache_dtype, -bound, bound, gen)


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_input_sets(shape: Shape, num_tokens: int, count: int, device: torch.device,
                    scale: float | None = None) -> list[InputSet]:
    """``count`` input sets of ``num_tokens`` tokens; set 0 is vLLM's benchmark input.

    ``scale``: every fp8 scale (per tensor, or each head's) is this value instead of amax / 64."""
    if num_tokens > shape.num_slots:
        raise ValueError(
            f"num_tokens: expected at most num_blocks * block_size = {shape.num_slots}, got {num_tokens}"
        )
    seed_everything()
    sets = []
    for _ in range(count):
        key = torch.randn(num_tokens, shape.num_heads, shape.head_size, dtype=shape.dtype,
                          device=device)
        value = torch.randn_like(key)
        slots = torch.tensor(random.sample(range(shape.num_slots), num_tokens), dtype=SLOT_DTYPE,
                             device=device)
        if scale is not None:
            k_scale = torch.full((shape.num_heads,) if shape.per_head_scale else (), scale,
                                 dtype=torch.float32, device=device)
            v_scale = k_scale.clone()
        elif shape.per_head_scale:
            k_scale = (key.amax(dim=(0, 2)) / 64.0).to(torch.float32)
            v_scale = (value.amax(dim=(0, 2)) / 64.0).to(torch.float32)
        else:
            k_scale = (key.amax() / 64.0).to(torch.float32)
            v_scale = (value.amax() / 64.0).to(torch.float32)
        sets.append(InputSet(key, value, slots, k_scale, v_scale))
    return sets
