#!/usr/bin/env bash
# One call on the GPU machine (device tool, carry .gpu): build, then the named steps, results under $OUT.
#   bash benchmarks/gpu_session.sh STEP [STEP ...]
# Steps: tests | dd | engine | proof | proof-all | proof-dp2-zero1 | nanotron-180m | nanotron-1b | nanotron-180m-long | ablation-180m |
#        ddread | nanotron-1b-e2e | nanotron-180m-ds | rounds-180m | round-180m | round-1b | restore-stress |
#        profile-180m | resume-hunt | stress-180m | stress-1b | staging | interference | pinning | restore-pairs |
#        crash (see each case below for its command).
# NANOTRON_DIR=<folder with src/ and run_train.py> runs them on another Nanotron tree than .gpu/nanotron.
# Every step's output is kept in $OUT/<step>.log; results go to $OUT/<step>/ and are tarred at the end,
# since only a few files come back from $OUT.
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
source .gpu/tools/device-env.sh .gpu
if [ -n "${NANOTRON_DIR:-}" ]; then  # another Nanotron tree (its src/ and run_train.py) than .gpu's
  NANOTRON_DIR=$(cd "$NANOTRON_DIR" && pwd)
  export PYTHONPATH=$NANOTRON_DIR/src:$PYTHONPATH NANOTRON_RUN_TRAIN=$NANOTRON_DIR/run_train.py
fi
python3 -c "import nanotron, sys; print('nanotron from', nanotron.__file__)" > "$OUT/nanotron.txt" 2>&1
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/ds_bench}
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
{ df -h "$WORK" /dev/shm; findmnt -T "$WORK"; nproc; free -g; } > "$OUT/machine.txt" 2>&1

python3 -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1 || {
  tail -30 "$OUT/build.log"
  exit 1
}

run_step() {
  case "$1" in
    tests) python3 -m pytest -q -rs tests/test_gpu.py tests/test_engine.py tests/test_streaming.py ;;
    dd) # the O_DIRECT write ceiling of the disk the benchmarks write to, 1 to 8 streams of 1 GiB each
      for n in 1 2 4 8; do
        d0=$(date +%s.%N)
        pids=()
        for i in $(seq "$n"); do
          dd if=/dev/zero of="$WORK/dd$i" bs=64M count=16 oflag=direct 2>/dev/null &
          pids+=($!)
        done
        wait "${pids[@]}"  # not a bare wait: the tarball loop runs in the background
        d1=$(date +%s.%N)
        python3 -c "print(f'dd oflag=direct $n streams: {$n * 2**30 / ($d1 - $d0) / 1e9:.2f} GB/s')"
        rm -f "$WORK"/dd*
      done ;;
    ddread) # the O_DIRECT read ceiling of the same disk, cold: 4 GiB read by 1 to 8 streams
      dd if=/dev/zero of="$WORK/rd" bs=64M count=64 oflag=direct 2>/dev/null
      for n in 1 2 4 8; do
        sync && echo 3 > /proc/sys/vm/drop_caches
        d0=$(date +%s.%N)
        pids=()
        for i in $(seq 0 $((n - 1))); do
          dd if="$WORK/rd" of=/dev/null bs=64M count=$((64 / n)) skip=$((i * 64 / n)) iflag=direct 2>/dev/null &
          pids+=($!)
        done
        wait "${pids[@]}"
        d1=$(date +%s.%N)
        python3 -c "print(f'dd iflag=direct $n streams: {4 * 2**30 / ($d1 - $d0) / 1e9:.2f} GB/s')"
      done
      rm -f "$WORK/rd" ;;
    engine) python3 benchmarks/bench_engine.py --repeat 2 --skip-baselines --device both --dir "$WORK/engine" \
      --out "$OUT/engine/engine_gpu.json" ;;
    proof) python3 benchmarks/nanotron_proof.py all --gpus 1 --phases ds-train,ds-resume --out "$OUT/proof" \
      --work "$WORK/proof" ;;
    proof-all) # every phase of the proof, one GPU: the engine's resume, stock reading ours, ours resuming stock
      python3 benchmarks/nanotron_proof.py all --gpus 1 --out "$OUT/proof-all" --work "$WORK/proof-all" ;;
    proof-dp2-zero1) # every phase on two GPUs, data-parallel with ZeRO-1 optimizer shards
      python3 benchmarks/nanotron_proof.py all --gpus 2 --dp 2 --zero 1 --out "$OUT/proof-dp2-zero1" \
      --work "$WORK/proof-dp2" ;;
    nanotron-180m) (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 130 --interval 40 \
      --work "$WORK/bn180" --out "$OUT/nanotron-180m") ;;
    nanotron-1b) (cd benchmarks && python3 bench_nanotron.py all --model 1b --steps 65 --interval 30 \
      --stress-steps 5 --cache-gib 16 --work "$WORK/bn1b" --out "$OUT/nanotron-1b") ;;
    nanotron-180m-long) (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
      --work "$WORK/bn180l" --out "$OUT/nanotron-180m-long") ;;
    ablation-180m) (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
      --modes none --variant p1:parser_threads=1 --variant c256:chunk_size=256 --variant nocrc:checksums=false \
      --work "$WORK/ab180" --out "$OUT/ablation-180m") ;;
    nanotron-1b-e2e) (cd benchmarks && python3 bench_nanotron.py all --model 1b --steps 200 --interval 60 \
      --cache-gib 30 --modes datastates --work "$WORK/bn1be" --out "$OUT/nanotron-1b-e2e") ;;
    nanotron-180m-ds) (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
      --modes datastates --work "$WORK/bn180d" --out "$OUT/nanotron-180m-ds") ;;
    rounds-180m) (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
      --modes torch,dcp,datastates --rounds 2 --work "$WORK/bn180r" --out "$OUT/rounds-180m") ;;
    round-180m) # every mode but stress, once: a call's worth; rounds from several calls are put together after
      (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
      --modes torch,dcp,datastates,restore-torch,restore-datastates --work "$WORK/bn180o" --out "$OUT/round-180m") ;;
    round-1b) # the 1.1B model, every mode but stress once, a checkpoint every 60 steps (above its time to persist)
      (cd benchmarks && python3 bench_nanotron.py all --model 1b --steps 125 --interval 60 --cache-gib 16 \
      --modes torch,dcp,datastates,restore-torch,restore-datastates --work "$WORK/bn1bo" --out "$OUT/round-1b") ;;
    restore-stress) # resume's read-ahead, 48 times in 6 fresh processes, every byte compared (NOTES step 16)
      python3 benchmarks/restore_stress.py --work "$WORK/rs" --procs 6 --rounds 8 --out "$OUT/restore-stress" ;;
    profile-180m) # where a resume's time goes: cProfile of the trainer's construction (and of the second save)
      (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 80 --interval 40 --profile \
      --modes datastates,restore-datastates --work "$WORK/pr180" --out "$OUT/profile-180m") ;;
    resume-hunt) # three checkpoint-then-resume pairs of the 180M model: the read-ahead's checksum mismatch
      (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 80 --interval 40 --rounds 3 \
      --modes datastates,restore-datastates --work "$WORK/hunt" --out "$OUT/resume-hunt") ;;
    stress-180m) # a checkpoint at every step, staged on the GPU: backpressure bounds the stall
      (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 60 --stress-steps 30 --modes stress \
      --work "$WORK/st180" --out "$OUT/stress-180m") ;;
    stress-1b) (cd benchmarks && python3 bench_nanotron.py all --model 1b --steps 20 --stress-steps 6 \
      --cache-gib 16 --modes stress --work "$WORK/st1b" --out "$OUT/stress-1b") ;;
    staging) # what staging a checkpoint costs the training thread: its files one by one, or all together
      (cd benchmarks && python3 bench_staging.py --model 180m --out "$OUT/staging" && \
      python3 bench_staging.py --model 1b --repeat 3 --cache-gib 20 --out "$OUT/staging") ;;
    interference) # what a checkpoint costs the steps after it, taken apart (staging, saving, checksums, disk)
      (cd benchmarks && python3 bench_interference.py --dir "$WORK/interf" --out "$OUT/interference") ;;
    pinning) # preparing the host cache with 4 KiB and huge pages: time, launches meanwhile, D2H throughput
      (cd benchmarks && python3 bench_pinning.py --cache-gib 16 --rounds 2 --out "$OUT/pinning") ;;
    restore-pairs) # both restores of the 180M model in turn, side by side, RESTORE_REPEATS times (5): the disk's
      # drift between minutes moves one pair's ratio; the median of the pairs does not
      (cd benchmarks && python3 bench_nanotron.py all --model 180m --steps 80 --interval 40 \
      --restore-repeats "${RESTORE_REPEATS:-5}" \
      --modes torch,datastates,restore-torch,restore-datastates --work "$WORK/rp180" --out "$OUT/restore-pairs") ;;
    crash) (cd benchmarks && python3 nanotron_crash.py --trials 3 --out "$OUT/crash" --work "$WORK/crash") ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

# Only a few files come back from $OUT, and none of a call cut short by its time limit but what is there:
# keep a fresh tarball of everything.
(while sleep 20; do tar -C "$OUT" -czf "$OUT/.partial.tgz" --exclude '*.tgz' . && mv "$OUT/.partial.tgz" "$OUT/results.tgz"; done) &
rc=0
for step in "$@"; do
  mkdir -p "$OUT/$step"
  t0=$(date +%s)
  run_step "$step" > "$OUT/$step.log" 2>&1
  r=$?
  echo "$step: rc=$r in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
  tail -25 "$OUT/$step.log"
  [ $r -ne 0 ] && rc=$r
done
kill %1 2>/dev/null
tar -C "$OUT" -czf "$OUT/results.tgz" --exclude '*.tgz' . 2>/dev/null
exit $rc
