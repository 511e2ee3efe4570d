#!/usr/bin/env bash
# Before landing a kernel change: the sweeps behind docs/data run again on the GPU machine and
# compared, point by point, with the committed rows (kvwrite-bench compare).
# Usage (GPU machine, repository root, PYTHONPATH=src):
#   benchmarks/regression.sh [--l2 cold|hot|both] [--threshold PCT] [--all] OUT_DIR [NAME...]
# It runs benchmarks/performance.sh's commands (the same list and flags as docs/data) into
# OUT_DIR/new, copies the committed files of the same runs into OUT_DIR/old, then
#   kvwrite-bench compare OUT_DIR/old OUT_DIR/new --threshold PCT --json OUT_DIR/compare.json
# which prints every point's new/old, each op and configuration's geometric mean and the worst
# points. Defaults: cold L2 only (docs/performance.md's first condition) and --threshold 10: a
# point near the launch floor (1-2 us) moves a few % from run to run, so rerun a flagged sweep
# (NAME) before believing one point; a group's geometric mean is steadier. Without --all or a
# NAME the slowest sweeps are left out: 05_pth-h128 (per-token-head stays covered by 05_pth-h8)
# and the transfer sweeps (10_transfer: 3-6 minutes each; name them for a change to the transfer
# kernels). NAME runs exactly those sweeps (a name, e.g. 01_write-h8, or a prefix, e.g.
# 01_write), --all or not.
# Time on an H200, from the committed run (each file's meta.created is written as its command
# ends): the default is about 5 minutes (cold commands 4.7 min, 05_pth-h128 cold another 2),
# --all about 7, --l2 both --all about 11.
# Exit status: 0; 1 when a point or group is over the threshold or a benchmark command failed;
# 2 for bad usage or input (compare's one-line message).
set -u
usage="usage: benchmarks/regression.sh [--l2 cold|hot|both] [--threshold PCT] [--all] OUT_DIR [NAME...]"
l2=cold; threshold=10; skip=(--skip 05_pth-h128 --skip 10_transfer)
while [ $# -gt 0 ]; do
    case $1 in
        --l2) l2=${2:-}; shift 2 || { echo "$usage" >&2; exit 2; } ;;
        --threshold) threshold=${2:-}; shift 2 || { echo "$usage" >&2; exit 2; } ;;
        --all) skip=(); shift ;;
        -*) echo "$usage (unknown flag '$1')" >&2; exit 2 ;;
        *) break ;;
    esac
done
case $l2 in cold|hot|both) ;; *) echo "$usage (--l2: expected cold, hot or both, got '$l2')" >&2; exit 2 ;; esac
[[ $threshold =~ ^[0-9]+([.][0-9]*)?$ ]] ||
    { echo "$usage (--threshold: expected a percentage >= 0, got '$threshold')" >&2; exit 2; }
out=${1:?$usage}; shift
[ $# -gt 0 ] && skip=()  # named sweeps run whatever the default leaves out
here=$(dirname "$0")
data="$here/../docs/data"
rm -rf "$out/new" "$out/old"
mkdir -p "$out/new" "$out/old"
"$here/performance.sh" --l2 "$l2" "${skip[@]}" "$out/new" "$@"
bench=$?
[ "$bench" = 2 ] && exit 2
for f in "$out"/new/*.json; do
    [ -e "$f" ] || continue
    if [ -e "$data/$(basename "$f")" ]; then
        cp "$data/$(basename "$f")" "$out/old/"
    else
        echo "!! $(basename "$f"): no committed file in docs/data to compare with"
    fi
done
echo "== kvwrite-bench compare $out/old $out/new --threshold $threshold"
python3 -m kvwrite.bench compare "$out/old" "$out/new" --threshold "$threshold" \
    --json "$out/compare.json"
cmp=$?
[ "$cmp" = 0 ] && [ "$bench" != 0 ] && { echo "a benchmark command failed (above)" >&2; exit 1; }
exit $cmp
