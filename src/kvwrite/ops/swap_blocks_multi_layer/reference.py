"""swap_blocks_multi_layer in plain PyTorch: swap_blocks' reference, layer by layer (its plan
lists every layer's tensors)."""

from __future__ import annotations

from ..swap_blocks.reference import available, run, unsupported

__all__ = ["available", "unsupported", "run"]
