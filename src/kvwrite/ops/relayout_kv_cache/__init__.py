"""relayout_kv_cache (SPEC §9.3): copy blocks between two layouts of one logical (num_blocks, H, N, C) cache, a head range of it if asked."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the mapping read on the host (out-of-range pairs skipped)",
    run="plan: TransferPlan", unsupported="plan: TransferPlan",
    torch="(index_select / index_copy_ of bit views over the head slices)",
    triton=", every plan (persistent grid)")
