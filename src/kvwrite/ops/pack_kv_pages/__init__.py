"""pack_kv_pages (SPEC §9.4): pack one block of every layer into a transfer page, heads outermost, raw, fp8 or NVFP4."""

from ... import registry
from .op import *  # noqa: F403  (the package exports op.__all__)
from .op import OP
from .op import __all__ as __all__

registry.define_op(
    OP, __name__, torch_syncs="the mapping read on the host (out-of-range pairs skipped)",
    run="plan: TransferPlan", unsupported="plan: TransferPlan",
    torch="(the page layout by permute and cat; dtypes.quantize and the NVFP4 group rule)",
    triton=", every plan (persistent grid)")
