"""swap_blocks_multi_layer (SPEC §9.2): every layer's block copies in one call (vLLM's offload unit)."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the mapping read on the host (out-of-range pairs skipped)",
    run="plan: TransferPlan", unsupported="plan: TransferPlan",
    torch="(index_select / index_copy_ of bit views, layer by layer)",
    triton=", every plan (persistent grid)",
    bench=registry.bench("transfer", "moving caches: swap, relayout, pack, unpack (d2h, h2d, d2d)",
                         module="transfer"))
