"""vLLM's benchmarks/kernels/benchmark_reshape_and_cache_flash.py, run by kvwrite.

Same flags, defaults, sweep and table as vLLM's script (and ``run_benchmark`` with its signature),
plus kvwrite-bench's flags: see ``--help``. Works from a checkout without installing kvwrite.
"""

import sys
from pathlib import Path

try:
    import kvwrite.bench.ops.reshape_and_cache_flash  # noqa: F401
except ImportError:  # a checkout without `pip install` (or an older kvwrite): use its src/
    for name in [m for m in sys.modules if m == "kvwrite" or m.startswith("kvwrite.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvwrite.bench import run_benchmark  # noqa: E402, F401  (vLLM's function, for importers)
from kvwrite.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=f"python {sys.argv[0]}"))
