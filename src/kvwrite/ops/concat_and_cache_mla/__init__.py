"""concat_and_cache_mla (docs/ops/concat_and_cache_mla.md): write one MLA latent row (kv_c then
k_pe) per token into a paged cache, plainly, as per-tensor fp8, or in DeepSeek's fp8_ds_mla format."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="kv_c, k_pe, kv_cache, slot_mapping, mode: MlaMode, scale, *, ds_scale: DsMlaScale",
    unsupported="kv_c, kv_cache, mode: MlaMode", torch="(index_put_ with padding and bounds masked)",
    triton=", every mode (fp8_ds_mla tile scales in the kernel)",
    cuda="CUDA C++ kernels compiled at run time with NVRTC (cuda.core)",
    bench=registry.bench("concat_and_cache_mla", "the MLA latent cache write (auto, fp8, "
                         "fp8_ds_mla): vLLM's benchmark", aliases=("mla",)))
