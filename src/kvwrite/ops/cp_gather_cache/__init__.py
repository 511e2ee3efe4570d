"""cp_gather_cache (docs/ops/gather.md): gather cache entries of any dtype and entry shape into
contiguous rows, bit for bit (MLA chunked prefill and context parallelism)."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(OP, __name__, torch_syncs=registry.SYNCS_ROW_COUNT,
                   run="src_cache, dst, block_table, cu_seq_lens, seq_starts", unsupported="src_cache, dst",
                   torch="(the row rule by repeat_interleave, index_put_)",
                   triton="(bytes through the coalesced entry dims, at most 3 outer dims)")
