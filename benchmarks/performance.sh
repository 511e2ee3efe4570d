#!/usr/bin/env bash
# The runs behind docs/performance.md and the README's tables: every op's benchmark, cold and hot
# L2, the cuda and Triton implementations, each point checked before it is timed. One JSON file
# per command in OUT_DIR; then, in a checkout:
#   cp OUT_DIR/*.json docs/data/ && kvwrite-bench report --into docs/performance.md docs/data/*.json
# Usage (GPU machine, repository root, PYTHONPATH=src):
#   benchmarks/performance.sh [--l2 cold|hot|both] [--skip NAME]... OUT_DIR [NAME...]
# NAME (run only these) and --skip take a run's name (05_pth-h128) or its prefix (05_pth: both
# per-token-head runs). benchmarks/regression.sh runs this list too (one list of commands).
# The transfer sweeps (10_transfer-*) run once, with the cold condition (their timer rotates
# inputs; there is no hot file), into OUT_DIR/NAME.json; the two p2p ones only where two GPUs
# are visible (else a line says they were left out). On H200s 10_transfer-gpu took 3.2 minutes
# and 10_transfer-p2p 5.5.
# Exit status: 0; 1 when a command failed (its stderr is OUT_DIR/NAME-L2.err or NAME.err); 2 for
# bad usage.
set -u
usage="usage: benchmarks/performance.sh [--l2 cold|hot|both] [--skip NAME]... OUT_DIR [NAME...]"
l2s=(cold hot); skip=" "
while [ $# -gt 0 ]; do
    case $1 in
        --l2) case ${2:-} in cold|hot) l2s=("$2") ;; both) ;;
                  *) echo "$usage (--l2: expected cold, hot or both, got '${2:-}')" >&2; exit 2 ;;
              esac; shift 2 ;;
        --skip) [ -n "${2:-}" ] || { echo "$usage (--skip: expected a name)" >&2; exit 2; }
                skip+="$2 "; shift 2 ;;
        -*) echo "$usage (unknown flag '$1')" >&2; exit 2 ;;
        *) break ;;
    esac
done
out=${1:?$usage}; shift
mkdir -p "$out"
only=" $* "
failed=()
gpus=  # GPUs visible, probed by the first p2p run
common=(--implementation cuda,triton --iters 50 --time-budget 0.15)
picked() {  # is run $1 named (by its name or its prefix) in the list $2?
    [[ "$2" == *" $1 "* || "$2" == *" ${1%%-*} "* ]]
}
selected() {  # is run $1 asked for (named, or no names given) and not skipped?
    { [ "$only" = "  " ] || picked "$1" "$only"; } && ! picked "$1" "$skip"
}
bench() {  # timeout, output stem, subcommand and flags...: one command into $out/STEM.json
    local limit=$1 stem=$2; shift 2
    echo "== kvwrite-bench $*"
    timeout "$limit" python3 -m kvwrite.bench "$@" --json "$out/$stem.json" 2>"$out/$stem.err" \
        | tail -n +2 | grep -v "^#"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { failed+=("$stem (exit $rc)"); echo "!! $stem: exit $rc"; }
}
run() {  # name, subcommand and flags...: each L2 condition, the common flags
    local name=$1; shift
    selected "$name" || return
    for l2 in "${l2s[@]}"; do
        local flag=(); [ "$l2" = hot ] && flag=(--hot-l2)
        bench 300 "$name-$l2" "$@" "${common[@]}" "${flag[@]}"
    done
}
run_once() {  # name, subcommand and flags...: one run under its own timer flags (cold only); a
    # p2p run only where two GPUs are visible
    local name=$1; shift
    selected "$name" || return
    [[ " ${l2s[*]} " == *" cold "* ]] || return
    if [[ " $* " == *" --direction p2p "* ]]; then
        [ -n "$gpus" ] ||
            gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
        [ "$gpus" -ge 2 ] ||
            { echo "-- $name left out: it needs two GPUs (this machine shows $gpus)"; return; }
    fi
    bench 600 "$name" "$@"
}
# all = NHD, HND, packed (vLLM's LBNHC), HND-packed (LBHNC)
run 01_write-auto --layouts all --num-tokens 2,32,1024,16384,65536
run 01_write-fp8 --layouts all --num-tokens 2,32,1024,16384,65536 --kv-cache-dtype fp8
run 01_write-h8 --num-heads 8 --layouts all --num-tokens 2,32,1024,16384,65536 \
    --kv-cache-dtype fp8
# vLLM's scales where none are calibrated (1.0): a power of two, every fp8 midpoint exact
run 01_write-unit --num-heads 8 --layouts NHD,packed --num-tokens 2,32,1024,2048,4096,16384,65536 \
    --kv-cache-dtype fp8 --fp8-scales 1,1
run 02_rope rope --layouts NHD --dtypes bfloat16 --kv-cache-dtypes auto,fp8_e4m3 --num-tokens 1,16,1024,4096,16384
run 03_mla-auto mla --num-tokens 1,16,1024,4096,16384,65536
run 03_mla-fp8 mla --kv-cache-dtype fp8 --num-tokens 1,16,1024,4096,16384,65536
run 03_mla-ds mla --kv-cache-dtype fp8_ds_mla \
    --num-tokens 1,16,1024,4096,16384,65536
run 04_qknorm qk-norm-rope --layouts NHD --num-tokens 1,16,256,1024,2048,4096,16384
run 04_qknorm-unit qk-norm-rope --layouts NHD --kv-cache-dtypes fp8 --fp8-scales 1,1 \
    --num-tokens 1,16,256,1024,2048,4096,16384
run 05_pth-h8 per-token-head --layouts NHD --num-tokens 1,16,256,1024,4096,16384,65536
run 05_pth-h128 per-token-head --layouts NHD --num-heads 128 --num-tokens 1,16,256,1024,4096,16384 \
    --modes int8,fp8
run 06_nvfp4 nvfp4 --num-tokens 1,16,512,1024,2048,4096,16384,65536
run 07_gather-auto gather --num-tokens 1024,8192,16384,65536
run 07_gather-fp8 gather --kinds dequant,cp,flash --kv-cache-dtypes fp8 \
    --num-tokens 1024,8192,16384,65536
run 08_indexer indexer --scale-fmts ue8m0,mxfp8,float32 --num-tokens 1,1024,16384,65536
run 09_legacy legacy --num-heads 8 --num-tokens 2,1024,16384 --kv-cache-dtype fp8
run_once 10_transfer-gpu transfer --time-budget 0.1 --iters 20 --model llama3-8b,deepseek-v3 \
    --direction d2d,relayout --op swap,relayout,pack,unpack --blocks 16,128 --max-ctas 4,all \
    --engine sm --peers torch --no-overlap --implementation cuda,triton
run_once 10_transfer-swap transfer --time-budget 0.1 --iters 20 --model llama3-8b \
    --direction d2h,h2d --op swap --blocks 16,128 --max-ctas 1,2,4,8,all --implementation cuda,triton
run_once 10_transfer-p2p transfer --direction p2p --model llama3-8b \
    --op swap,relayout,handoff --blocks 16,128,1024 --engine sm --max-ctas 1,2,4,8,all \
    --time-budget 0.1 --iters 20 --no-overlap
run_once 10_transfer-p2p-ce transfer --direction p2p --model llama3-8b --op swap \
    --blocks 16,128,1024 --engine ce --peers vllm-loop,batch,torch --time-budget 0.1 \
    --iters 10 --no-overlap
run 11_turboquant turboquant --num-tokens 1,16,1024,16384,65536
run 12_mx mx --scale-rules ceil,floor --num-tokens 1,16,1024,16384,65536

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]} (see $out/*.err)" >&2
    exit 1
fi
