"""reshape_and_cache (docs/ops/reshape_and_cache.md): write new key and value rows into the
legacy paged-attention layout, with reshape_and_cache_flash's inputs, modes and slot rules."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs=registry.SYNCS_MASKING, unsupported="key, key_cache, cache_dtype: CacheDType, k_scale",
    run="key, value, key_cache, value_cache, slot_mapping, cache_dtype: CacheDType, k_scale, v_scale",
    torch="(index_put_ through permuted views, padding and bounds masked)",
    triton=", every cache dtype, per-head scales, any cache strides",
    bench=registry.bench("reshape_and_cache", "the legacy paged-attention cache write (x-packed key "
                         "layout)", aliases=("legacy",)))
