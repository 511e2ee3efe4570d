"""reshape_and_cache_turboquant (SPEC §10): vLLM's TurboQuant cache write, K and V of one
(token, head) in one slot; :mod:`.readers` reads it back, :mod:`.tables` makes vLLM's tables."""

from ... import registry
from . import op, readers, tables
from .op import *  # noqa: F403
from .readers import *  # noqa: F403
from .tables import *  # noqa: F403

__all__ = [*op.__all__, *readers.__all__, *tables.__all__]
registry.define_op(
    op.OP, __name__, torch_syncs=registry.SYNCS_MASKING,
    run="key, value, kv_cache, slot_mapping, preset: TurboQuantSlot, PiT, midpoints",
    unsupported="key, kv_cache, preset: TurboQuantSlot",
    torch="(§7.1's trees, exact roundings, index_put_)", cuda=", a lane group per (token, head)",
    triton=", a program per (token, head) tile",
    bench=registry.bench("turboquant", "TurboQuant cache writes (vLLM's four presets) beside the "
                         "fp8 write", module="turboquant"))
