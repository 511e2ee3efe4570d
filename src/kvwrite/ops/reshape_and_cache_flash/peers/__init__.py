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


def _peer(name: str, module: str, priority: int, description: str, **kw) -> None:
    registry.register(registry.ImplInfo(op=OP, name=name, description=description,
                                        module=f"{__name__}.{module}", priority=priority, **kw))


# The reference's boolean masks have data-dependent sizes: a graph break and a host sync.
_peer("torch-compile", "torch_compile", -10, "the torch reference under torch.compile (inductor)",
      devices=("cpu", "cuda"), graph_safe=False)
_peer("vllm", "vllm_cuda", -20, "vLLM's CUDA kernel (vllm._custom_ops.reshape_and_cache_flash)")
_peer("vllm-triton", "vllm_triton", -21, "vLLM's Triton kernel (triton_reshape_and_cache_flash)")
_peer("flashinfer", "flashinfer", -30,
      "FlashInfer's append_paged_kv_cache (slots as one request owning every block)")
