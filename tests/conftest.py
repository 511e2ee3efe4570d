import importlib
import os

import pytest
import torch

# Without a GPU, run Triton kernels in Triton's interpreter so CI exercises their indexing. This
# must happen before anything imports triton (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Define every Triton function now, under the interpreter: a test that unsets
    # TRITON_INTERPRET (to see what `--implementation all` reports without it) must not be the
    # first to import one, or the interpreter tests after it would call a compiled-mode function.
    for _module in ("kvwrite.kernels.triton_fp8", "kvwrite.kernels.triton_rope",
                    "kvwrite.ops.reshape_and_cache_flash.triton_impl",
                    "kvwrite.ops.rotary_embedding.triton_impl",
                    "kvwrite.ops.fused_rope_and_reshape_cache_flash.triton_impl",
                    "kvwrite.ops.concat_and_cache_mla.triton_impl",
                    "kvwrite.ops.indexer_k_quant_and_cache.triton_impl",
                    "kvwrite.ops.reshape_and_cache.triton_impl",
                    "kvwrite.ops.nvfp4.triton_impl",
                    "kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.triton_impl",
                    "kvwrite.kernels.triton_gather",
                    "kvwrite.ops.gather_and_maybe_dequant_cache.triton_impl",
                    "kvwrite.ops.cp_gather_cache.triton_impl",
                    "kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache.triton_impl",
                    "kvwrite.ops.gather_cache_flash.triton_impl",
                    "kvwrite.ops.cp_gather_indexer_k_quant_cache.triton_impl",
                    "kvwrite.kernels.triton_qk_norm",
                    "kvwrite.ops.fused_qk_norm_rope.triton_impl",
                    "kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash.triton_impl"):
        importlib.import_module(_module)

HAS_CUDA = torch.cuda.is_available()
NO_GPU_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)

_deselected_gpu: list = []


def pytest_collection_modifyitems(config, items):
    """Without a GPU, `gpu` tests are deselected unless a -m expression picks tests by marker
    (`-m gpu` selects them; they then skip, each with the reason)."""
    if HAS_CUDA:
        return
    if config.getoption("markexpr"):
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))
        return
    keep = [item for item in items if "gpu" not in item.keywords]
    gone = [item for item in items if "gpu" in item.keywords]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep
        _deselected_gpu.extend(gone)


def pytest_terminal_summary(terminalreporter):
    if _deselected_gpu:
        terminalreporter.write_line(
            f"{len(_deselected_gpu)} gpu tests deselected: no CUDA GPU here "
            f"(torch.cuda.is_available() is False); on a GPU machine `python -m pytest -m gpu` "
            f"runs them")


@pytest.fixture
def record_builds(monkeypatch):
    """``record_builds(source)``: from then on, the fixed arguments (a tuple; None for a generic
    build) of every kernel that ``source`` (a ``KernelSource``) builds, in a list it returns."""
    from kvwrite.kernels import nvrtc

    def start(source) -> list:
        seen = []
        real = source.kernel

        def kernel(arch, name, macros=()):
            fixed = [m[1] for m in macros
                     if isinstance(m, tuple) and m[0] == nvrtc.FIXED_ARGS_MACRO]
            seen.append(tuple(int(v) for v in fixed[0].split(",")) if fixed else None)
            return real(arch, name, macros)

        monkeypatch.setattr(source, "kernel", kernel)
        return seen

    return start
