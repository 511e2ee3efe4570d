"""cp_gather_cache (docs/ops/gather.md): gather cache entries of any dtype and entry shape into
contiguous rows, bit for bit (MLA chunked prefill and context parallelism).

- :mod:`.op`: the public function, its validation and its torch.compile custom op;
- :mod:`.reference`: the plain-PyTorch implementation (the reference oracle);
- :mod:`.triton_impl`: the Triton kernel and its launcher;
- :mod:`.cuda_impl` and ``kernel.cu``: the CUDA kernel (NVRTC) and its launcher;
- :mod:`.sanitize`: bounds-stressing cases for compute-sanitizer.

Importing this package registers the op and its three implementations.
"""

from ... import registry
from .op import OP, cp_gather_cache, validate

__all__ = ["OP", "cp_gather_cache", "validate"]

registry.register_op(registry.OpSpec(
    name=OP,
    run_signature="run(src_cache, dst, block_table, cu_seq_lens, seq_starts) -> None",
    unsupported_signature="unsupported(src_cache, dst) -> str | None",
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
    description="Triton kernel (bytes through the coalesced entry dims, at most 3 outer dims)",
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
