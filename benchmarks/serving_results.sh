#!/usr/bin/env bash
# The runs behind docs/results.md: every slot pattern for a few models, every implementation
# available (FlashInfer too where FLASHINFER_DIR holds it), each point checked before timing.
# Usage: benchmarks/serving_results.sh OUT_DIR   (from the repository root, PYTHONPATH=src)
set -u
out=${1:?usage: benchmarks/serving_results.sh OUT_DIR}
mkdir -p "$out"
# --model without --num-tokens: the preset's serving shape (decode T = 1..256 running sequences,
# prefill and mixed T = 512..8192 tokens a step; kvwrite.bench.models.ServingShape).
common=(--implementation all --iters 50 --time-budget 0.1)
bench() {  # name, flags...
    local name=$1; shift
    echo "== kvwrite-bench $* ${common[*]}"
    timeout 150 python3 -m kvwrite.bench.cli "$@" "${common[@]}" --json "$out/$name.json" \
        --plot "$out/$name.png" 2>"$out/$name.err" | tee "$out/$name.txt"
}
for slots in decode prefill mixed; do
    bench "llama-3.1-8b-$slots" --model llama-3.1-8b --slots "$slots"
done
bench llama-3.1-8b-random --model llama-3.1-8b --slots random --num-tokens 1:4096
bench llama-3.1-8b-decode-pad25 --model llama-3.1-8b --slots decode --pad-fraction 0.25
bench llama-3.1-70b-tp8-decode --model llama-3.1-70b --tp 8 --slots decode
bench gpt-oss-120b-decode --model gpt-oss-120b --slots decode
bench qwen3-8b-mixed --model qwen3-8b --slots mixed
# torch.compile is not graph-safe: timed without graphs, beside kvwrite's kernels.
echo "== no_graph with torch-compile"
timeout 120 python3 -m kvwrite.bench.cli --model llama-3.1-8b --slots decode --mode no_graph \
    --implementation cuda,triton,torch,torch-compile --num-tokens 16,256 --iters 30 \
    --time-budget 0.1 --json "$out/llama-3.1-8b-decode-no_graph.json" 2>"$out/no_graph.err" \
    | tee "$out/llama-3.1-8b-decode-no_graph.txt"
