"""Kernel parts shared by every op: the CUDA headers in ``include/kvw/`` (element kinds and IEEE
arithmetic, fp8 quantization, vector I/O, slot addressing), the NVRTC build/launch module
:mod:`.nvrtc`, and the Triton fp8 helpers :mod:`.triton_fp8`."""
