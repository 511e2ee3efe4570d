"""NVFP4 KV cache writes and readers (docs/ops/nvfp4.md): one internal op, :data:`OP`, behind
``reshape_and_cache_flash(..., "nvfp4")`` and FlashInfer's append; :mod:`.readers` reads back."""

from ... import registry
from . import op, readers
from .op import *  # noqa: F403  (the package exports op.__all__ and readers.__all__)
from .readers import *  # noqa: F403

__all__ = [*op.__all__, *readers.__all__]
registry.define_op(
    op.OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="key, value, k_data, k_sf, v_data, v_sf, slot_mapping, cache_dtype: CacheDType, k_scale, "
        "v_scale, v_scale_layout: ScaleLayout",
    unsupported="key, k_data, cache_dtype: CacheDType, v_scale_layout: ScaleLayout",
    torch="(the group rule on float32 tensors, index_put_)", triton=", both rules, every layout",
    bench=registry.bench("nvfp4", "the NVFP4 cache write (vLLM's page layout), beside the fp8 write "
                         "of the same shape"))
