"""gather_and_maybe_dequant_cache (docs/ops/gather.md): gather the MLA cache entries of a batch of
sequences into contiguous rows (MLA chunked prefill), copied ("auto") or dequantized by the fp8
read rule.

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for compute-sanitizer.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, gather_and_maybe_dequant_cache, validate

__all__ = ["OP", "gather_and_maybe_dequant_cache", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature=("run(src_cache, dst, block_table, cu_seq_lens, seq_starts, num_tokens, "
                   "mode: MlaMode, scale) -> None"),
    unsupported_signature="unsupported(src_cache, dst, mode: MlaMode) -> str | None",
))
registry.register(registry.ImplInfo(
    op=OP,
    name="torch",
    description="plain PyTorch (the row rule by repeat_interleave, index_put_); the reference",
    module=f"{__name__}.reference",
    priority=0,
    devices=("cpu", "cuda"),
    # The row count of the rule syncs with the host.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="triton",
    description="Triton kernel (owners by comparison with every request, exact fp8 decode)",
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
