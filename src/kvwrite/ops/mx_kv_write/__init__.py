"""MXFP8/MXFP4 KV cache writes and the reader (SPEC §10.3): one internal op, :data:`OP`, behind
``reshape_and_cache_flash(..., "mxfp8" | "mxfp4")``; :mod:`.readers` reads back."""

from ... import registry
from . import op, readers
from .op import *  # noqa: F403  (the package exports op.__all__ and readers.__all__)
from .readers import *  # noqa: F403

__all__ = [*op.__all__, *readers.__all__]
registry.define_op(
    op.OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, "
        "mode: Format, scale_rule: str, scale_layout: str",
    unsupported="key, key_cache, mode: Format, scale_layout: str",
    torch="(the group rule on float32 tensors, index_put_)", triton=", both elements and rules, "
    "both scale layouts",
    bench=registry.bench("mx", "MXFP8/MXFP4 cache writes (SGLang's) beside the fp8 write",
                         module="mx"))
