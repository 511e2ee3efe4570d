"""rotary_embedding (docs/ops/rotary_embedding.md): rotate query and key rows by their positions
(RoPE), in place."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(OP, __name__, unsupported="query, key, cos_sin_cache, is_neox",
                   run="positions, query [T_pad, Hq, D], key [T_pad, H, D] | None, cos_sin_cache, is_neox",
                   torch="(float32 tensor ops, each rounded)", triton=", neox and GPT-J, partial rotary")
