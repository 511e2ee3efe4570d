"""cp_gather_indexer_k_quant_cache (docs/ops/gather.md): gather the DeepSeek-V3.2 indexer's key
cache of a batch of sequences into rows of codes and rows of scales, bit for bit."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(OP, __name__, torch_syncs=registry.SYNCS_ROW_COUNT,
                   run="kv_cache, dst_k, dst_scale, block_table, cu_seq_lens",
                   unsupported="kv_cache, dst_k, dst_scale", triton="(codes and scales as bytes, any output strides)",
                   torch="(the row rule by repeat_interleave, page gathers)")
