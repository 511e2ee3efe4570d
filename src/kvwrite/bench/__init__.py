"""kvwrite-bench: every op's benchmark on one engine (:mod:`.engine`), each op's definition in
:mod:`kvwrite.bench.ops` (named by the op's ``registry.BenchCommand``); :mod:`.cli` is the command
line, :mod:`.timing` the timers (the slot patterns are :mod:`kvwrite.testing.slots`).
:func:`run_benchmark` is vLLM's reshape_and_cache_flash benchmark function."""

__all__ = ["run_benchmark"]


def __getattr__(name: str):
    # Lazy, so that importing kvwrite.bench (the CLI's --version) imports no op and no engine.
    if name == "run_benchmark":
        from .ops.reshape_and_cache_flash import run_benchmark
        return run_benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
