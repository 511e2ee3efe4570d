"""vLLM's benchmarks/kernels/benchmark_fused_rope_kvcache.py, run by kvwrite.

vLLM's flags (--num-tokens, --num-blocks, --iters, --warmup), matrix (bfloat16/float16 x
auto/fp8_e4m3 x MHA(32,32,128)/GQA(32,8,128), neox), table and sanity lines, where "unfused" is
kvwrite's rotary_embedding + reshape_and_cache_flash. Works from a checkout without installing.
"""

import sys
from pathlib import Path

try:
    import kvwrite.bench.ops.fused_rope_and_reshape_cache_flash  # noqa: F401
except ImportError:  # a checkout without `pip install` (or an older kvwrite): use its src/
    for name in [m for m in sys.modules if m == "kvwrite" or m.startswith("kvwrite.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvwrite.bench.ops.fused_rope_and_reshape_cache_flash import vllm_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(vllm_main(prog=f"python {sys.argv[0]}"))
