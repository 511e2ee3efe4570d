"""cp_gather_indexer_k_quant_cache (docs/ops/gather.md): gather the DeepSeek-V3.2 lightning
indexer's key cache (pages of all fp8 codes, then all float32 scales) of a batch of sequences
into rows of codes and rows of scales, bit for bit.

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for compute-sanitizer.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, cp_gather_indexer_k_quant_cache, scale_groups, validate

__all__ = ["OP", "cp_gather_indexer_k_quant_cache", "scale_groups", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None",
    unsupported_signature="unsupported(kv_cache, dst_k, dst_scale) -> str | None",
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (the row rule by repeat_interleave, page gathers); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # The row count of the rule syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel (codes and scales as bytes, any output strides)",
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
