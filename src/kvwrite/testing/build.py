"""What the case builders of kvwrite.testing share (each op's case module uses these, so a
case's tensors come out the same way everywhere): the slot mapping of a call, the flag parts
of a case id, and the random bytes over a whole allocation."""

from __future__ import annotations

import torch

from .compare import storage_bytes

__all__ = ["make_slot_mapping", "flag_parts", "fill_random_bytes"]


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
