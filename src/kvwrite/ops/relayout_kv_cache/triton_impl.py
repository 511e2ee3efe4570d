"""relayout_kv_cache's Triton implementation: the shared transfer kernels (kernels/triton_transfer.py) run
the plan."""

from ...kernels.triton_transfer import available, run, unsupported

__all__ = ["available", "unsupported", "run"]
