"""kvwrite-bench: every op's benchmark on one engine (:mod:`.engine`), each op's definition in
its folder (``kvwrite.ops.<op>.bench``); :mod:`.cli` is the command line, :mod:`.slots` the slot
patterns, :mod:`.timing` the timers. :func:`run_benchmark` is vLLM's reshape_and_cache_flash
benchmark function."""

__all__ = ["run_benchmark"]


def __getattr__(name: str):
    # Lazy, so that kvwrite.testing (whose Case refers to .slots) imports without the engine.
    if name == "run_benchmark":
        from ..ops.reshape_and_cache_flash.bench import run_benchmark
        return run_benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
