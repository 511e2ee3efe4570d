"""unpack_kv_pages (SPEC §9.4): unpack transfer pages into the caches of every layer, decoding fp8 or NVFP4 pages."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the mapping read on the host (out-of-range pairs skipped)",
    run="plan: TransferPlan", unsupported="plan: TransferPlan",
    torch="(the page layout by permute; fp8 and NVFP4 decodes)",
    triton=", every plan (persistent grid)")
