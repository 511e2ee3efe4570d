"""fused_qk_norm_rope (docs/ops/fused_qk_norm_rope.md): QK-norm (RMS-normalize every query and
key head with its weight) and RoPE, in place on the packed qkv.

- :mod:`.op`: the public function, its validation (shared with
  fused_qk_norm_rope_and_reshape_cache_flash) and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for the memory checker.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, fused_qk_norm_rope, validate

__all__ = ["OP", "fused_qk_norm_rope", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(qkv [T_pad, Hq+Hk+Hv, D], num_heads_q, num_heads_k, eps: float, q_weight, "
                  "k_weight, cos_sin_cache, is_neox, position_ids, weight_offset: float) -> None",
    unsupported_signature="unsupported(qkv, q_weight, k_weight, cos_sin_cache, is_neox) "
                          "-> str | None",
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (float32 tensor ops, each rounded; float64 root); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel: norm and rotation of a tile of heads, neox and GPT-J",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core), a lane group per "
                "head",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
