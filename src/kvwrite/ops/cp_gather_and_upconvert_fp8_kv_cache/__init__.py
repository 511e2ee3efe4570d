"""cp_gather_and_upconvert_fp8_kv_cache (docs/ops/gather.md): gather fp8_ds_mla cache entries
into 16-bit latent rows of 576 values, dequantized by the fp8 read rule (sparse MLA)."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(OP, __name__, torch_syncs=registry.SYNCS_ROW_COUNT, unsupported="src_cache, dst",
                   run="src_cache, dst, block_table, workspace_starts, num_req, seq_starts",
                   torch="(the row rule by repeat_interleave, index_put_)",
                   triton="(exact e4m3 decode, tile scales read as bytes)")
