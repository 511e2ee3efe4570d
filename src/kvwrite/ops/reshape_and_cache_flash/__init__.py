"""reshape_and_cache_flash (docs/ops/reshape_and_cache_flash.md): write new key and value rows into
a paged KV cache. :mod:`.peers` registers the peer kernels the benchmark compares."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType, k_scale, v_scale",
    unsupported="key, key_cache, cache_dtype: CacheDType, k_scale, v_scale",
    torch="(index_put_ with padding and bounds masked)", triton=", every layout and fp8 mode",
    bench=registry.bench("reshape_and_cache_flash", "the KV cache write: vLLM's benchmark (also the "
                         "default: kvwrite-bench [flags])"))

from . import peers  # noqa: E402, F401  (registers the peers: torch-compile, vllm, vllm-triton, flashinfer)
