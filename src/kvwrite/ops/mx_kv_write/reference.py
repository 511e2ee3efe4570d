"""The plain-PyTorch implementation of the MX writes: the reference oracle and the baseline a
user would write (the group rule is :mod:`.rule`'s).

Works on CPU and CUDA tensors and on any view strides (bytes are indexed logically by block,
offset, head and group). Not graph-safe: masking out padding and out-of-range slots syncs with
the host.
"""

from __future__ import annotations

import torch

from ...formats import Format
from ...layouts import written_slots
from .rule import GROUP, encode_groups, scale_positions

__all__ = ["available", "unsupported", "run"]


def available(device: torch.device) -> str | None:
    return None


def unsupported(key, key_cache, mode: Format, scale_layout: str) -> str | None:
    return None


def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        value_cache: torch.Tensor, k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor, mode: Format, scale_rule: str, scale_layout: str) -> None:
    num_blocks, block_size, num_heads, f = key_cache.shape
    head_size = key.shape[2]
    groups = head_size // GROUP
    tokens, blocks, offsets = written_slots(slot_mapping, num_blocks, block_size)
    n = tokens.numel()
    for src, data, sc in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        x = src[tokens].reshape(n * num_heads * groups, GROUP)
        codes, s = encode_groups(x, mode.element, scale_rule)
        data[blocks, offsets] = codes.reshape(n, num_heads, f)
        s = s.reshape(n, num_heads, groups)
        if scale_layout == "linear":
            sc[blocks, offsets] = s
        else:
            sc[(blocks[:, None, None], *scale_positions(offsets, num_heads, groups))] = s
