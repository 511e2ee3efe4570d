import importlib
import os
import sys

import pytest
import torch

# The repository's tools (tools/: the probes and the memcheck cases) are not installed with
# kvwrite; the tests import them from the checkout's root.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

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
                    "kvwrite.kernels.triton_mx",
                    "kvwrite.ops.mx_kv_write.triton_impl",
                    "kvwrite.ops.reshape_and_cache_flash_per_token_head_quant.triton_impl",
                    "kvwrite.kernels.triton_gather",
                    "kvwrite.ops.gather_and_maybe_dequant_cache.triton_impl",
                    "kvwrite.ops.cp_gather_cache.triton_impl",
                    "kvwrite.ops.cp_gather_and_upconvert_fp8_kv_cache.triton_impl",
                    "kvwrite.ops.gather_cache_flash.triton_impl",
                    "kvwrite.ops.cp_gather_indexer_k_quant_cache.triton_impl",
                    "kvwrite.kernels.triton_qk_norm",
                    "kvwrite.ops.fused_qk_norm_rope.triton_impl",
                    "kvwrite.ops.fused_qk_norm_rope_and_reshape_cache_flash.triton_impl",
                    "kvwrite.kernels.triton_transfer"):
        importlib.import_module(_module)

HAS_CUDA = torch.cuda.is_available()

# A CUDA graph left in a reference cycle (an earlier test's frame, held by the traceback that a
# pytest.raises keeps) is destroyed whenever Python's cyclic collector next runs. Inside another
# test's capture that cudaGraphDestroy is refused and invalidates the capture, which then fails
# with "operation failed due to a previous error during capture" although it captured nothing
# wrong (seen under pytest-xdist on two GPUs). With this set, torch.cuda.graph collects the
# garbage before each capture begins.
torch.compiler.config.force_cudagraph_gc = True
NO_GPU_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)

_deselected_gpu: list = []
# Under pytest-xdist the workers collect and deselect; each reports its count here (the controller's
# summary prints it; every worker collects the whole suite, so they agree).
_worker_counts: list[int] = []


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's test command): one pytest-xdist worker per CPU this process may
    use, none (the tests run in this process) on a single CPU or where PyTorch sees a GPU, so the
    gpu tests do not share it. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it (xdist's rule)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if HAS_CUDA:
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus if cpus > 1 else 0


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


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker
    if workeroutput is not None:
        workeroutput["kvwrite_gpu_deselected"] = len(_deselected_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _worker_counts.append(getattr(node, "workeroutput", {}).get("kvwrite_gpu_deselected", 0))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """Skips as counts by reason (the short summary, `-rfE` in pyproject's addopts, lists
    failures and errors only), and how many gpu tests were deselected."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if skipped:
        counts: dict[str, int] = {}
        for report in skipped:
            reason = _skip_reason(report)
            counts[reason] = counts.get(reason, 0) + 1
        terminalreporter.write_sep("=", f"{len(skipped)} skipped, by reason")
        for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            terminalreporter.write_line(f"{n:5d}  {reason}")
    deselected = max([len(_deselected_gpu), *_worker_counts])
    if deselected:
        terminalreporter.write_line(
            f"{deselected} gpu tests deselected: no CUDA GPU here "
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


@pytest.fixture
def no_bench_work(monkeypatch):
    """The benchmark engine's sweep and environment probe raise if called: a CLI refusal must come
    before any work."""
    from kvwrite.bench import engine

    def worked(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(engine, "sweep", worked)
    monkeypatch.setattr(engine, "measure_env", worked)


@pytest.fixture
def ctrl_c_at_third_measurement(monkeypatch) -> list:
    """The benchmark engine's measurements, with a KeyboardInterrupt (as Ctrl-C) in place of the
    third; returns the list that counts those started (extend it to bring the interrupt nearer)."""
    from kvwrite.bench import engine

    real = engine._measure
    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_measure", measure)
    return calls
