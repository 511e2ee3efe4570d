"""Peers of reshape_and_cache_flash as registry entries, so the benchmark checks and times them
beside kvwrite's own (docs/ops/reshape_and_cache_flash.md). Each is offered only where its package
imports and says why it cannot run a case; their priorities are below kvwrite's, so a call that
names no implementation never picks one.

- ``torch-compile``: the torch reference under ``torch.compile`` (:mod:`.torch_compile`);
- ``vllm``: ``vllm._custom_ops.reshape_and_cache_flash`` (:mod:`.vllm_cuda`);
- ``vllm-triton``: vLLM's Triton twin, ``triton_reshape_and_cache_flash`` (:mod:`.vllm_triton`);
- ``flashinfer``: ``flashinfer.page.append_paged_kv_cache`` with the slots converted to its
  (batch indices, positions, page table) once per input set, outside the timed calls
  (:mod:`.flashinfer`).
"""

from .... import registry
from ..op import OP

registry.register(registry.ImplInfo(
    op=OP,
    name="torch-compile",
    description="the torch reference under torch.compile (inductor)",
    module=f"{__name__}.torch_compile",
    priority=-10,
    devices=("cpu", "cuda"),
    # The reference's boolean masks have data-dependent sizes: a graph break and a host sync.
    graph_safe=False,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="vllm",
    description="vLLM's CUDA kernel (vllm._custom_ops.reshape_and_cache_flash)",
    module=f"{__name__}.vllm_cuda",
    priority=-20,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="vllm-triton",
    description="vLLM's Triton kernel (triton_reshape_and_cache_flash)",
    module=f"{__name__}.vllm_triton",
    priority=-21,
))
registry.register(registry.ImplInfo(
    op=OP,
    name="flashinfer",
    description="FlashInfer's append_paged_kv_cache (slots as one request owning every block)",
    module=f"{__name__}.flashinfer",
    priority=-30,
))
