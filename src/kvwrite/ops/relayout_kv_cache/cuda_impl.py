"""relayout_kv_cache's CUDA implementation: the shared transfer kernels (kernels/transfer_cuda.py, NVRTC)
run the plan."""

from ...kernels.transfer_cuda import LAUNCHES, available, run, unsupported

__all__ = ["available", "unsupported", "run", "LAUNCHES"]
