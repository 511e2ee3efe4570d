"""rotary_embedding (docs/ops/rotary_embedding.md): rotate query and key rows by their positions
(RoPE), in place.

- :mod:`.op`: the public function, its validation (shared with the fused op), its torch.compile
  custom op, and ``check_positions``;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, check_positions, rotary_embedding, validate

__all__ = ["OP", "rotary_embedding", "check_positions", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(positions, query [T_pad, Hq, D], key [T_pad, H, D] | None, cos_sin_cache, "
                  "is_neox) -> None",
    unsupported_signature="unsupported(query, key, cos_sin_cache, is_neox) -> str | None",
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (float32 tensor ops, each rounded); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel, neox and GPT-J, partial rotary",
    module=f"{__name__}.triton_impl",
    priority=10,
    requires=("triton",),
))
registry.register(registry.ImplInfo(
    op=OP,
    name="cuda",
    description="CUDA C++ kernel compiled at run time with NVRTC (cuda.core)",
    module=f"{__name__}.cuda_impl",
    priority=20,
))
