"""gather_cache_flash (docs/ops/gather.md): gather the key and value rows of a batch of sequences
out of paged caches of every layout and format: the read side of reshape_and_cache_flash."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs=registry.SYNCS_ROW_COUNT,
    run="key_cache, value_cache, key_out, value_out, block_table, cu_seq_lens, seq_starts, "
        "cache_dtype: CacheDType, k_scale, v_scale", unsupported="key_cache, key_out, cache_dtype: CacheDType",
    torch="(the row rule by repeat_interleave, index_put_)",
    triton=", every layout and format (exact fp8 decode, per-head scales)",
    bench=registry.bench("gather", "reading caches back: the five gathers (dequant, cp, upconvert, "
                         "flash, indexer)"))
