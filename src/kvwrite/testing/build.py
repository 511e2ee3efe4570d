"""What the case builders of kvwrite.testing share (each op's case module uses these, so a
case's tensors come out the same way everywhere): the fields of a cache write's case, the slot
mapping of a call, the flag parts of a case id, and the random bytes over a whole allocation."""

from __future__ import annotations

import dataclasses

import torch

from ..dtypes import CacheDType, parse_kv_cache_dtype
from ..layouts import KVAlloc, Layout
from .compare import storage_bytes

__all__ = ["WriteCase", "Fp8WriteCase", "FlashWriteCase", "make_slot_mapping", "flag_parts",
           "fill_random_bytes"]


@dataclasses.dataclass(frozen=True)
class WriteCase:
    """The fields of every cache write's case: the call's tokens and input dtype, the cache's
    blocks, and the slot mapping (its dtype, its padding and out-of-range slots). Each op's case
    adds its own fields (after these) and may change a default."""
    num_tokens: int = 7
    block_size: int = 16
    num_blocks: int = 4
    dtype: torch.dtype = torch.bfloat16
    slot_dtype: torch.dtype = torch.int64
    # Input rows past num_tokens (CUDA-graph padding); never read.
    extra_rows: int = 0
    padding_slots: int = 0
    out_of_range_slots: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclasses.dataclass(frozen=True)
class Fp8WriteCase(WriteCase):
    """A write whose cache is 16-bit or fp8 by ``kv_cache_dtype`` (vLLM's), with k_scale and
    v_scale per tensor or per head."""
    kv_cache_dtype: str = "auto"
    per_head_scale: bool = False
    # fp8 caches: "uint8" (vLLM's storage) or "float8" (torch's float8 dtype).
    fp8_storage: str = "uint8"

    @property
    def cache_dtype(self) -> CacheDType:
        return parse_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def cache_tensor_dtype(self) -> torch.dtype:
        cdt = self.cache_dtype
        if cdt.is_fp8:
            return torch.uint8 if self.fp8_storage == "uint8" else cdt.fp8_dtype
        return cdt.element_dtype(self.dtype)

    def scale_id_parts(self) -> list[str]:
        """The case id's parts of the scales and the fp8 storage (none for a 16-bit cache)."""
        if not self.cache_dtype.is_fp8:
            return []
        return ["perhead" if self.per_head_scale else "pertensor", self.fp8_storage]


@dataclasses.dataclass(frozen=True)
class FlashWriteCase(Fp8WriteCase):
    """reshape_and_cache_flash's cache write (its case, and the write of the fused ops that end
    in it): the caches' layout and allocation too."""
    layout: Layout = Layout.NHD
    alloc: KVAlloc = KVAlloc.SEPARATE

    def cache_id_parts(self) -> list[str]:
        """The case id's parts of the cache: its dtype, layout, allocation and scales."""
        return [self.kv_cache_dtype, self.layout.value, self.alloc.value, *self.scale_id_parts()]


def make_slot_mapping(case_id: str, num_tokens: int, num_slots: int, padding_slots: int,
                      out_of_range_slots: int, dtype: torch.dtype, gen: torch.Generator,
                      distinct_padding: bool = True) -> torch.Tensor:
    """``num_tokens`` slots in a random order: distinct random slots of ``[0, num_slots)``,
    ``padding_slots`` negative ones (``-1, -2, ...`` with ``distinct_padding``, else all -1)
    and ``out_of_range_slots`` at or past ``num_slots`` (7 apart). Two draws from ``gen``."""
    n_valid = num_tokens - padding_slots - out_of_range_slots
    if n_valid < 0 or n_valid > num_slots:
        raise ValueError(f"case {case_id}: cannot place {n_valid} tokens in {num_slots} slots")
    slots = torch.randperm(num_slots, generator=gen)[:n_valid].tolist()
    slots += [-1 - i if distinct_padding else -1 for i in range(padding_slots)]
    slots += [num_slots + i * 7 for i in range(out_of_range_slots)]
    order = torch.randperm(num_tokens, generator=gen).tolist()
    return torch.tensor([slots[i] for i in order], dtype=dtype)


def flag_parts(parts: list[str], flags) -> list[str]:
    """``parts`` with the name of each ``(value, name)`` in ``flags`` whose value is set."""
    parts.extend(name for flag, name in flags if flag)
    return parts


def fill_random_bytes(tensors, gen: torch.Generator) -> None:
    """Random bytes over the whole allocation behind each tensor (a stray or a missing write
    then shows)."""
    for t in tensors:
        b = storage_bytes(t)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
