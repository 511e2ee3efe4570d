"""reshape_and_cache_flash_per_token_head_quant (docs/ops/reshape_and_cache_flash_per_token_head_quant.md):
quantize each (token, KV head) row with its own scale into a paged cache; :mod:`.caches` allocates and reads."""

from ... import registry
from . import caches, op
from .caches import *  # noqa: F403  (the package exports op.__all__ and caches.__all__)
from .op import *  # noqa: F403

__all__ = [*op.__all__, *caches.__all__]
registry.define_op(
    op.OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, "
        "mode: PerTokenHeadMode", unsupported="key, value, key_cache, value_cache, mode: PerTokenHeadMode",
    torch="(row reductions, exact roundings, index_put_)", cuda=", a lane group per row",
    triton=", the three modes (row reductions in the tile)",
    bench=registry.bench("reshape_and_cache_flash_per_token_head_quant", "the per-(token, head) "
                         "quantized cache write: int8, fp8, int4", module="per_token_head",
                         aliases=("per-token-head",)))
