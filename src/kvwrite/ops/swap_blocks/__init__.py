"""swap_blocks (SPEC §9.2): copy whole blocks between two caches of one block shape, bit for bit, through any layout (vLLM's swap_blocks, with its four-argument form)."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the mapping read on the host (out-of-range pairs skipped)",
    run="plan: TransferPlan", unsupported="plan: TransferPlan",
    torch="(index_select / index_copy_ of bit views)",
    triton=", every plan (persistent grid)")
