"""gather_and_maybe_dequant_cache (docs/ops/gather.md): gather the MLA cache entries of a batch of
sequences into contiguous rows, copied ("auto") or dequantized by the fp8 read rule."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, run="src_cache, dst, block_table, cu_seq_lens, seq_starts, num_tokens, mode: MlaMode, "
                      "scale", unsupported="src_cache, dst, mode: MlaMode",
    torch_syncs=registry.SYNCS_ROW_COUNT, torch="(the row rule by repeat_interleave, index_put_)",
    triton="(owners by comparison with every request, exact fp8 decode)")
