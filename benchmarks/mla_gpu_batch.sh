#!/usr/bin/env bash
# The GPU batch of concat_and_cache_mla: its GPU tests, then the benchmark for each mode with
# every implementation, rotated (default) and hot L2. Logs and JSON go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_mla.py -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1; tail -15 "$OUT/tests.log"
for kv in ${MODES:-auto fp8 fp8_e5m2 fp8_ds_mla}; do
  for l2 in default hot; do
    flag=""; [ "$l2" = hot ] && flag="--hot-l2"
    /usr/bin/time -f "wall %e s" timeout 120 python3 benchmarks/kernels/benchmark_concat_and_cache_mla.py \
      --kv-cache-dtype "$kv" --implementation all $flag --json "$OUT/mla_${kv}_${l2}.json" \
      2> "$OUT/mla_${kv}_${l2}.err" | tee -a "$OUT/bench.log"
    grep -h "wall\|Error\|error" "$OUT/mla_${kv}_${l2}.err" | tee -a "$OUT/bench.log"
  done
done
timeout 100 python3 -m tools.probes mla 2>&1 | tee -a "$OUT/bench.log"
# The run returns few files: the JSON files and the progress logs travel as one archive.
(cd "$OUT" && tar -czf runs.tgz mla_*.json mla_*.err && rm -f mla_*.json mla_*.err)
