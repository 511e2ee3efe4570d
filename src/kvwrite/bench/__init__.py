"""kvwrite-bench: vLLM's reshape_and_cache_flash benchmark (flags, defaults, sweep and table) with
device timing, L2 control, a correctness check, several implementations side by side, bandwidth,
JSON/CSV and plots. :func:`run_benchmark` is vLLM's benchmark function; :mod:`.cli` is the
command line."""

from .sweep import run_benchmark

__all__ = ["run_benchmark"]
