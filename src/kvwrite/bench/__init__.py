"""kvwrite-bench: vLLM's reshape_and_cache_flash benchmark (flags, defaults, sweep and table) with
device timing, L2 control, a correctness check, several implementations side by side, bandwidth,
JSON/CSV and plots. :func:`run_benchmark` is vLLM's benchmark function; :mod:`.cli` is the
command line; :mod:`.slots` the slot patterns every op's benchmark can use."""

__all__ = ["run_benchmark"]


def __getattr__(name: str):
    # Lazy, so that kvwrite.testing (whose Case refers to .slots) imports without the sweep.
    if name == "run_benchmark":
        from .sweep import run_benchmark
        return run_benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
