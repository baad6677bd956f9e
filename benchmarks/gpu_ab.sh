#!/usr/bin/env bash
# The same gpu.sh steps on an earlier commit of the package and on this tree, in one call on one machine:
#   bash benchmarks/gpu_ab.sh prepare REV      here: REV's tree into the ignored .base/ (no .git on a GPU machine)
#   OUT=DIR bash benchmarks/gpu_ab.sh run "STEPS" ["STEPS AFTER"]
#                                              there (carry .gpu and .base): STEPS with .base's package into
#                                              DIR/before, then STEPS AFTER (default STEPS) with this tree's into
#                                              DIR/after; each folder keeps its results.tgz and run.log only
# gpu.sh installs the package of the tree it runs in, so the two runs reinstall it in turn; name this tree's
# commit in DATASTATES_REPO_COMMIT (the machine's copy has no current .git). Environment
# variables (FLOOR_*, BENCH_ARGS, ...) reach both. BEFORE_LIMIT and AFTER_LIMIT: seconds each (250, 330).
set -uo pipefail
case "${1:-}" in
  prepare)
    rev=${2:?the commit to compare against}
    rm -rf .base && mkdir .base && git archive "$rev" | tar -x -C .base && rm -rf .base/benchmarks/results
    git rev-parse --short "$rev" > .base/.commit
    echo ".base/ holds $(cat .base/.commit); carry .gpu and .base" ;;
  run)
    OUT=${OUT:?set OUT to the folder for results}
    before=${2:?the gpu.sh steps}
    after=${3:-$before}
    mkdir -p "$OUT/before" "$OUT/after"
    ln -sfn ../.gpu .base/.gpu
    t0=$(date +%s)
    (cd .base && DATASTATES_REPO_COMMIT=$(cat .commit) OUT=$OUT/before timeout "${BEFORE_LIMIT:-250}" \
      bash benchmarks/gpu.sh $before > "$OUT/before/run.log" 2>&1)
    echo "before ($(cat .base/.commit)): rc=$? at $(($(date +%s) - t0)) s"
    rm -rf "${WORK:-/tmp/ds_bench}"
    OUT=$OUT/after timeout "${AFTER_LIMIT:-330}" bash benchmarks/gpu.sh $after > "$OUT/after/run.log" 2>&1
    echo "after: rc=$? at $(($(date +%s) - t0)) s"
    rm -rf "${WORK:-/tmp/ds_bench}"
    for d in before after; do  # each side's archive and log kept, the rest of its folder removed
      (cd "$OUT/$d" && cat steps.txt 2>/dev/null; grep -h "within each run" ./*/*.md 2>/dev/null
        find . -mindepth 1 -not -name results.tgz -not -name run.log -delete 2>/dev/null)
    done ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
