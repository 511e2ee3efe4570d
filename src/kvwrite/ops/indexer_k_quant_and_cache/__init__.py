"""indexer_k_quant_and_cache (docs/ops/indexer_k_quant_and_cache.md): quantize DeepSeek-V3.2's
indexer keys into e4m3 codes with per-group scales, into a paged cache (codes, then scales)."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs=registry.SYNCS_MASKING, unsupported="k, kv_cache, fmt: ScaleFormat",
    run="k, kv_cache, slot_mapping, quant_block_size: int, fmt: ScaleFormat",
    torch="(index_put_ with padding and bounds masked)", triton="(group amax, scales and codes in the kernel)",
    bench=registry.bench("indexer_k_quant_and_cache", "DeepSeek-V3.2's indexer key write (e4m3 codes + "
                         "group scales)", module="indexer", aliases=("indexer",)))
