"""vLLM's benchmarks/kernels/benchmark_concat_and_cache_mla.py, run by kvwrite.

Same flags, defaults, sweep (num_tokens 2^0..2^16) and table as vLLM's script (and
``run_benchmark``), with fp8_e4m3, fp8_e5m2 and fp8_ds_mla added to --kv-cache-dtype, plus the
benchmark engine's flags: see ``--help``. Works from a checkout without installing kvwrite.
"""

import sys
from pathlib import Path

try:
    import kvwrite.bench.ops.concat_and_cache_mla  # noqa: F401
except ImportError:  # a checkout without `pip install` (or an older kvwrite): use its src/
    for name in [m for m in sys.modules if m == "kvwrite" or m.startswith("kvwrite.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvwrite.bench.cli import main  # noqa: E402
from kvwrite.bench.ops.concat_and_cache_mla import run_benchmark  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main(["concat_and_cache_mla", *sys.argv[1:]], prog=f"python {sys.argv[0]}"))
