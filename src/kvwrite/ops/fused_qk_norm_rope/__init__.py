"""fused_qk_norm_rope (docs/ops/fused_qk_norm_rope.md): QK-norm (RMS-normalize every query and
key head with its weight) and RoPE, in place on the packed qkv."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, run="qkv [T_pad, Hq+Hk+Hv, D], num_heads_q, num_heads_k, eps: float, q_weight, "
                      "k_weight, cos_sin_cache, is_neox, position_ids, weight_offset: float",
    unsupported="qkv, q_weight, k_weight, cos_sin_cache, is_neox",
    torch="(float32 tensor ops, each rounded; float64 root)", cuda=", a lane group per head",
    triton=": norm and rotation of a tile of heads, neox and GPT-J")
