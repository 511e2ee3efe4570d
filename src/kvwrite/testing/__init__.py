"""What the tests and the benchmark checks share: the byte comparison (:mod:`.compare`) and each
op's case model and input builder (:mod:`.cases` for reshape_and_cache_flash)."""

from .cases import (
    CASES,
    Case,
    Inputs,
    clone_caches,
    make_inputs,
    reciprocal_traps,
    special_values,
)
from .compare import assert_caches_equal, differing_bytes, nan_mask, storage_bytes

__all__ = ["CASES", "Case", "Inputs", "assert_caches_equal", "clone_caches", "differing_bytes",
           "make_inputs", "nan_mask", "reciprocal_traps", "special_values", "storage_bytes"]
