#!/usr/bin/env bash
# The GPU benchmarks and proofs, one command per figure the README cites: build, then the named steps.
#   OUT=results-folder bash benchmarks/gpu.sh STEP [STEP ...]
# Needs Nanotron importable and NANOTRON_RUN_TRAIN pointing at its run_train.py, or an offline environment in
# .gpu/ (wheels, liburing, a Nanotron tree: its tools/device-env.sh is sourced). NANOTRON_DIR=<folder with
# src/ and run_train.py> runs on another Nanotron tree. Each step's output goes to $OUT/<step>.log, its
# results to $OUT/<step>/; machine paths are scrubbed from them (benchmarks/scrub.py), logs over 100 kB are
# gzipped, and everything is also tarred into $OUT/results.tgz. DATASTATES_REPO_COMMIT=<sha> names the tree's
# commit in the results where the tree was copied without a current .git.
set -uo pipefail
OUT=${OUT:?set OUT to the folder for results}
mkdir -p "$OUT"
connections=${CUDA_DEVICE_MAX_CONNECTIONS:-}  # the caller's, kept: the offline environment sets Nanotron's 1
[ -f .gpu/tools/device-env.sh ] && source .gpu/tools/device-env.sh .gpu
[ -n "$connections" ] && export CUDA_DEVICE_MAX_CONNECTIONS=$connections
if [ -n "${NANOTRON_DIR:-}" ]; then
  NANOTRON_DIR=$(cd "$NANOTRON_DIR" && pwd)
  export PYTHONPATH=$NANOTRON_DIR/src:${PYTHONPATH:-} NANOTRON_RUN_TRAIN=$NANOTRON_DIR/run_train.py
fi
python3 -c "import nanotron; print('nanotron from', nanotron.__file__)" > "$OUT/nanotron.txt" 2>&1
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/ds_bench}
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
{ df -h "$WORK" /dev/shm; nproc; free -g; } > "$OUT/machine.txt" 2>&1
python3 -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1 || {
  tail -30 "$OUT/build.log"
  exit 1
}
B=benchmarks

memory_run() { # model steps work-folder [bench_nanotron flags]: memory-180m's and memory-1b's runs
  local m=checkpoint_interval=1000,memory_tier=true,memory_interval=10
  (cd $B && python3 bench_nanotron.py all --model "$1" --layout dp2 --nodes 2 --steps "$2" --interval 10 \
    --modes none --variant mem:$m,memory_replicas=1 ${MEMORY_TIER_ONLY:+--variant memtier:$m} \
    ${MEMORY_GLOO:+--variant memgloo:$m,memory_replicas=1,memory_replica_transport=gloo} \
    ${MEMORY_NCCL:+--variant memnccl:$m,memory_replicas=1,memory_replica_transport=nccl} \
    ${MEMORY_THREADS:+--variant memthreads:$m,memory_replicas=1,memory_replica_process=never} "${@:4}" \
    ${MEMORY_EXTRA:-} \
    --rounds ${MEMORY_ROUNDS:-2} --work "$WORK/$3" --out "$OUT/memory-$1")
}

run_step() {
  case "$1" in
    tests) python3 -m pytest -q -rs tests/test_gpu.py tests/test_engine.py tests/test_streaming.py \
      tests/test_restore_from_memory.py tests/test_replicas.py ;;
    tier-read) # the memory tier's read into GPU memory: mapped against read(2), 4-16 parser threads
      python3 $B/micro/bench_tier_read.py --out "$OUT/tier-read" ;;
    new-pages) # how fast the machine gives a tmpfs new pages: fresh, just freed, and freed a pause ago
      python3 $B/micro/bench_new_pages.py --out "$OUT/new-pages" ;;
    dd | ddread) bash $B/disk.sh "$1" "$WORK" ;;
    engine) # the engine alone: blocking, device-to-host, persisted and restore against their baselines
      python3 $B/bench_engine.py --repeat 2 --skip-baselines --device both --dir "$WORK/engine" \
        --out "$OUT/engine/engine_gpu.json" ;;
    proof) # Nanotron's run_train.py, 1 GPU: train, resume bit for bit, stock reads ours, ours resumes stock
      python3 $B/nanotron_proof.py all --gpus 1 --out "$OUT/proof" --work "$WORK/proof" ;;
    proof-dp2-zero1) # the same on two GPUs, data-parallel with ZeRO-1 optimizer shards (NO_FP32_GRADS=1 on
      # Nanotron main, which cannot accumulate fp32 gradients with ZeRO-1 on two dp ranks)
      python3 $B/nanotron_proof.py all --gpus 2 --dp 2 --zero 1 --out "$OUT/proof-dp2-zero1" \
        --work "$WORK/proof-dp2" ${NO_FP32_GRADS:+--no-fp32-grads} ${PROOF_PHASES:+--phases $PROOF_PHASES} ;;
    proof-dp2) # the same on two GPUs, data-parallel without ZeRO (fp32 gradients): each replica writes a part of
      # the optimizer state every replica holds (balance_writes), which the resume puts together
      python3 $B/nanotron_proof.py all --gpus 2 --dp 2 --zero 0 --out "$OUT/proof-dp2" --work "$WORK/proof-dp2z0" \
        ${PROOF_PHASES:+--phases $PROOF_PHASES} ;;
    proof-cp2) # the same on two GPUs with context parallelism (Nanotron main): files by rank 0 of dp_cp_pg;
      # the runs start from the weights of one step on one GPU (main starts no cp run from random weights)
      python3 $B/nanotron_proof.py all --gpus 2 --cp 2 --out "$OUT/proof-cp2" --work "$WORK/proof-cp2" ;;
    proof-4gpu) # four GPUs, two parallel dimensions each: PROOF4_LAYOUTS of tp2dp2, pp2dp2, cp2dp2 (all three
      # by default; cp on Nanotron main), each the proof's phases (train, resume bit for bit, stock reads ours,
      # ours resumes stock)
      local r=0 L flags
      for L in ${PROOF4_LAYOUTS:-tp2dp2 pp2dp2 cp2dp2}; do
        flags=$(echo "$L" | sed -E 's/(tp|pp|cp)2dp2/--\1 2 --dp 2/')
        python3 $B/nanotron_proof.py all --gpus 4 $flags --out "$OUT/proof-4gpu/$L" --work "$WORK/proof-$L" \
          ${NO_FP32_GRADS:+--no-fp32-grads} || r=$?
        rm -rf "$WORK/proof-$L"
      done
      return $r ;;
    reshard) # two GPUs: checkpoints of tp=2, dp=2 with ZeRO-1, pp=2 and one GPU, each resumed on another layout;
      # every element of the state compared with the one saved, the losses after, the restore time
      # (NO_FP32_GRADS=1 and RESHARD_CASES=a-to-b,... as for proof-dp2-zero1)
      python3 $B/nanotron_reshard_proof.py all --out "$OUT/reshard" --work "$WORK/reshard" \
        ${NO_FP32_GRADS:+--no-fp32-grads} ${RESHARD_CASES:+--cases $RESHARD_CASES} ;;
    round-180m) # 180M model, every mode: stall, persisted, memory, restore (one each)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 \
        --modes torch,dcp,dcp-zo,datastates,restore-torch,restore-datastates --work "$WORK/r180" \
        --out "$OUT/round-180m") ;;
    round-180m-dcp) # 180M model, a checkpoint every 80 steps (DCP's zero-overhead mode persists one in 3.4 s: at
      # every 40 steps, each save waited for the previous one); datastates with a 2 GiB host cache, smaller
      # than a checkpoint, and with 8 GiB
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 80 --cache-gib 2 \
        --modes torch,dcp,dcp-zo,datastates --variant cache8:host_cache_size=8 --work "$WORK/r180d" \
        --out "$OUT/round-180m-dcp") ;;
    overhead-180m) # what checkpointing costs the whole run: none, DCP zero-overhead, datastates with a 2 GiB
      # host cache (below a checkpoint) and with 8 GiB, in turns, OVERHEAD_ROUNDS rounds (default 2)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 80 --cache-gib 2 \
        --modes dcp-zo,datastates --variant cache8:host_cache_size=8 --rounds "${OVERHEAD_ROUNDS:-2}" \
        --work "$WORK/o180" --out "$OUT/overhead-180m" ${BENCH_ARGS:-}) ;;
    copy-cost-180m) # what the copy to the host alone costs the steps beside it: stock Nanotron with the
      # checkpoint's bytes copied by the benchmark at once or spread over 0.3 s, the other way, or between two
      # host buffers, against datastates (8 GiB); COPY_MODES picks them, COPY_ROUNDS rounds (default 1)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 80 --cache-gib 2 \
        --modes "${COPY_MODES:-copy-only,copy-paced,copy-h2d,copy-host}" --variant cache8:host_cache_size=8 \
        --rounds "${COPY_ROUNDS:-1}" --work "$WORK/cc180" --out "$OUT/copy-cost-180m" ${BENCH_ARGS:-}) ;;
    stall-180m) # one round of none, DCP zero-overhead and datastates with an 8 GiB cache (a whole checkpoint)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 80 --cache-gib 2 \
        --modes dcp-zo --variant cache8:host_cache_size=8 --work "$WORK/s180" --out "$OUT/stall-180m" \
        ${BENCH_ARGS:-}) ;;
    stall-180m-copies) # the same, 720 steps (8 checkpoints a run), and datastates with its chunks copied from
      # the GPU whole (device_copy_size: 0) beside the default 4 MiB copies
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 720 --interval 80 --cache-gib 2 \
        --modes dcp-zo --variant cache8:host_cache_size=8 --variant cache8-whole:host_cache_size=8,device_copy_size=0 \
        --work "$WORK/s180c" --out "$OUT/stall-180m-copies" ${BENCH_ARGS:-}) ;;
    stall-180m-paced) # 720 steps (8 checkpoints a run): DCP zero-overhead, datastates with a 2 GiB and an 8 GiB
      # cache, and the 8 GiB one with its copies from the GPU paced (device_copy_gbps: PACED_GBPS, default 8)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 720 --interval 80 --cache-gib 2 \
        --modes dcp-zo,datastates --variant cache8:host_cache_size=8 \
        --variant "cache8p${PACED_GBPS:-8}:host_cache_size=8,device_copy_gbps=${PACED_GBPS:-8}" \
        --work "$WORK/s180p" --out "$OUT/stall-180m-paced" ${BENCH_ARGS:-}) ;;
    stall-180m-pace-rates) # 720 steps: DCP zero-overhead, datastates with an 8 GiB cache, its copies from the GPU at
      # the link's speed and paced at each of PACE_RATES GB/s (default 4,8,16; device_copy_gbps)
      pace=(); for g in $(echo "${PACE_RATES:-4,8,16}" | tr , ' '); do
        pace+=(--variant "cache8p$g:host_cache_size=8,device_copy_gbps=$g"); done
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 720 --interval 80 --cache-gib 2 \
        --modes dcp-zo --variant cache8:host_cache_size=8 "${pace[@]}" \
        --work "$WORK/s180r" --out "$OUT/stall-180m-pace-rates" ${BENCH_ARGS:-}) ;;
    stall-180m-flush) # 720 steps: DCP zero-overhead, datastates with an 8 GiB cache and the flush's defaults (one
      # worker, 4 writes in flight), two workers 16 deep (the defaults before 64ec518), one worker 2 deep
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 720 --interval 80 --cache-gib 2 \
        --modes dcp-zo --variant cache8:host_cache_size=8 \
        --variant cache8f2q16:host_cache_size=8,flush_threads=2,flush_depth=16 \
        --variant cache8f1q2:host_cache_size=8,flush_threads=1,flush_depth=2 \
        --work "$WORK/s180f" --out "$OUT/stall-180m-flush" ${BENCH_ARGS:-}) ;;
    idle-180m) # the engine set up and never asked for a checkpoint, against stock Nanotron, in turns,
      # OVERHEAD_ROUNDS rounds (default 3)
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 80 --modes datastates-idle \
        --rounds "${OVERHEAD_ROUNDS:-3}" --work "$WORK/i180" --out "$OUT/idle-180m" ${BENCH_ARGS:-}) ;;
    profile-180m) # where a checkpoint's time goes on the training thread: the 180M model, datastates with a
      # 2 GiB host cache, a checkpoint every 80 steps; cProfile of the second save and of the step that queues it
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 250 --interval 80 --cache-gib 2 \
        --modes datastates --profile --work "$WORK/p180" --out "$OUT/profile-180m" ${BENCH_ARGS:-}) ;;
    overhead-1b) # the 1.1B model, a checkpoint every 60 steps: none and datastates (16 GiB cache) in turns,
      # OVERHEAD_ROUNDS rounds (default 2)
      (cd $B && python3 bench_nanotron.py all --model 1b --steps 300 --interval 60 --cache-gib 16 \
        --modes datastates --rounds "${OVERHEAD_ROUNDS:-2}" --work "$WORK/o1b" --out "$OUT/overhead-1b") ;;
    round-1b) # the 1.1B model, every mode once, a checkpoint every 60 steps (above its time to persist)
      (cd $B && python3 bench_nanotron.py all --model 1b --steps 125 --interval 60 --cache-gib 16 \
        --modes torch,dcp,dcp-zo,datastates,restore-torch,restore-datastates --work "$WORK/r1b" \
        --out "$OUT/round-1b") ;;
    multi-1b-dp4-zero1) # four GPUs, the 1.1B model, dp=4 with ZeRO-1 (bf16 gradients: Nanotron main has no fp32
      # accumulation with ZeRO-1 on dp > 1), a 2 GiB host cache a rank (the default): none, native, DCP
      # zero-overhead, datastates with its writes balanced across the replicas and with rank 0 of them writing
      # the weights (onewriter: ONE_WRITER=0 leaves it out), both restores; every figure on the job's clock (the
      # slowest rank's); BENCH_ARGS="--rounds N" for N rounds in turn
      local one=(--variant onewriter:balance_writes=false)
      [ "${ONE_WRITER:-1}" = 0 ] && one=()
      (cd $B && python3 bench_nanotron.py all --model 1b --layout dp4-zero1 --no-fp32-grads --steps 100 \
        --interval 40 --cache-gib 2 --modes torch,dcp-zo,datastates,restore-torch,restore-datastates \
        "${one[@]}" --work "$WORK/m1bz" --out "$OUT/multi-1b-dp4-zero1" ${BENCH_ARGS:-}) ;;
    multi-1b-tp2-dp2) # four GPUs, the 1.1B model, tp=2 x dp=2 (fp32 gradients): none, native, DCP zero-overhead,
      # datastates (2 GiB host cache a rank)
      (cd $B && python3 bench_nanotron.py all --model 1b --layout tp2-dp2 --steps 100 --interval 40 \
        --cache-gib 2 --modes torch,dcp-zo,datastates --work "$WORK/m1bt" --out "$OUT/multi-1b-tp2-dp2") ;;
    multi-1b-dp4) # four GPUs, the 1.1B model, dp=4 without ZeRO (fp32 gradients, each replica holds the whole
      # optimizer): datastates with its writes balanced and with rank 0 of the replicas writing everything
      (cd $B && python3 bench_nanotron.py all --model 1b --layout dp4 --steps 100 --interval 40 --cache-gib 2 \
        --modes datastates --variant onewriter:balance_writes=false --work "$WORK/m1bd" \
        --out "$OUT/multi-1b-dp4") ;;
    multi-1b-dp2) # two GPUs, the 1.1B model, dp=2 without ZeRO (fp32 gradients, each replica holds the whole
      # optimizer): datastates balanced (the optimizer state in parts, one a replica) and with rank 0 of the
      # replicas writing everything (onewriter); BENCH_ARGS="--rounds N" for N rounds in turn
      (cd $B && python3 bench_nanotron.py all --model 1b --layout dp2 --steps 100 --interval 40 --cache-gib 2 \
        --modes datastates --variant onewriter:balance_writes=false --work "$WORK/m1b2" \
        --out "$OUT/multi-1b-dp2" ${BENCH_ARGS:-}) ;;
    multi-3b-tp2-dp2) # four GPUs, a 3.0B model (Llama-3.2-3B's shape), tp=2 x dp=2 with fp32 gradients, default
      # settings (2 GiB host cache a rank), a checkpoint at step 100: none and datastates
      (cd $B && python3 bench_nanotron.py all --model 3b --layout tp2-dp2 --steps 120 --interval 100 \
        --cache-gib 2 --modes datastates --work "$WORK/m3b" --out "$OUT/multi-3b-tp2-dp2") ;;
    restore-pairs) # both restores of the 180M model in turn, side by side, RESTORE_REPEATS times (5): the
      # disk's drift between minutes moves one pair's ratio; the median of the pairs does not
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 80 --interval 40 \
        --restore-repeats "${RESTORE_REPEATS:-5}" \
        --modes torch,datastates,restore-torch,restore-datastates --work "$WORK/rp180" --out "$OUT/restore-pairs") ;;
    restart-180m) # a worker SIGKILLed after a checkpoint and restarted by torchrun: from memory, against
      # native's resume and the engine's from storage; the restored state compared bit for bit
      (cd $B && python3 bench_restart.py all --model 180m --step 20 --work "$WORK/rs180" --out "$OUT/restart-180m" \
        ${RESTART_ONLY:+--only $RESTART_ONLY} ${TIER_COPIES:+--tier-copies $TIER_COPIES} \
        ${RESTART_REPEATS:+--repeats $RESTART_REPEATS}) ;;
    restart-180m-dp2) # the same on two data-parallel GPUs, the job started again (torchrun's in-place restart of
      # several ranks reads the dead workers' addresses): every rank restarts from memory
      (cd $B && python3 bench_restart.py all --model 180m --step 20 --dp 2 --work "$WORK/rs180d" \
        --out "$OUT/restart-180m-dp2" ${RESTART_ONLY:+--only $RESTART_ONLY}) ;;
    restart-180m-lost-node) # two simulated nodes of one GPU each (dp=2) with memory replicas: the second node lost
      # after a checkpoint (its tier wiped), the job started again; also each engine's restore from storage
      (cd $B && python3 bench_restart.py all --model 180m --step 20 --dp 2 --lose-node --work "$WORK/rs180n" \
        --out "$OUT/restart-180m-lost-node" ${RESTART_ONLY:+--only $RESTART_ONLY}) ;;
    replica-link) # memory replicas between two simulated nodes of one GPU each: 14.5 GB a rank, each way at once,
      # over gloo and NCCL (NVLink here)
      (cd $B/micro && python3 bench_replica_link.py --out "$OUT/replica-link" ${BENCH_ARGS:-}) ;;
    restart-180m-lost-node-tp2) # four GPUs: two simulated nodes of two GPUs each (tp=2 inside a node, dp=2
      # across), replicas on, the second node lost after a checkpoint: all four ranks from memory
      (cd $B && python3 bench_restart.py all --model 180m --step 20 --dp 2 --tp 2 --lose-node \
        --work "$WORK/rs180t" --out "$OUT/restart-180m-lost-node-tp2" ${RESTART_ONLY:+--only $RESTART_ONLY}) ;;
    restart-1b-lost-node) # the 1.1B model on two simulated nodes of one GPU each (dp=2), replicas on, the second
      # node lost after the checkpoint at step 10: from the peer's memory, against storage and native; each
      # engine from scratch twice, first and last, the baselines their medians
      (cd $B && python3 bench_restart.py all --model 1b --step 10 --dp 2 --lose-node --cache-gib 16 --scratch-twice \
        --work "$WORK/rs1bn" --out "$OUT/restart-1b-lost-node" ${RESTART_ONLY:+--only $RESTART_ONLY}) ;;
    restart-180m-lost-node-memory) # memory checkpoints every 5 steps on two simulated nodes of one GPU each,
      # replicas on, the second node lost after the memory checkpoint at step 20 (storage holds step 19)
      (cd $B && python3 bench_restart.py all --model 180m --step 20 --dp 2 --lose-node --memory-interval 5 \
        --work "$WORK/rs180m" --out "$OUT/restart-180m-lost-node-memory" ${RESTART_ONLY:+--only $RESTART_ONLY}) ;;
    replicas-180m) # training with memory replicas on against off (the tier alone), two simulated nodes of one GPU
      # each (dp=2), three interleaved rounds: the iterations after each checkpoint, replication beside them
      (cd $B && python3 bench_nanotron.py all --model 180m --layout dp2 --nodes 2 --steps 200 --interval 40 \
        --modes datastates --variant tier:memory_tier=true --variant replicas:memory_tier=true,memory_replicas=1 \
        --rounds 3 --work "$WORK/rp180" --out "$OUT/replicas-180m") ;;
    memory-180m) # memory checkpoints every 10 steps (the tier, a replica on the other node; storage every 1000),
      # two simulated nodes of one GPU each (dp=2), interleaved rounds: the iterations after each, against none;
      # MEMORY_TIER_ONLY=1 adds the same without replicas (what the copies alone cost), MEMORY_NCCL=1 the
      # replicas over NCCL at the optimizer steps beside those over the link `auto` picks while training
      # (gloo), MEMORY_GLOO=1 over gloo named, MEMORY_THREADS=1 sent by the training process's threads
      # (memory_replica_process=never; `mem`'s auto: a process of each rank's own); MEMORY_EXTRA more
      # bench_nanotron flags (--variant NAME:k=v,...)
      memory_run 180m 200 mi180 ;;
    memory-1b) # the same with the 1.1B model (dp=2, 100 steps)
      memory_run 1b 100 mi1b --cache-gib 4 ;;
    memory-copy) # a memory checkpoint's copy into the tier (staged on the GPU, 8 GiB shaped like the 1.1B's
      # state, summed by the checksum threads) against a pinned copy_ in the same process, by setting
      python3 $B/micro/bench_memory_copy.py --out "$OUT/memory-copy" --gib 8 --files 8 --rounds 2 --saves 3 \
        --settings "default:;sum1:checksum_threads=1;sum8:checksum_threads=8;copy2:copy_threads=2" ;;
    memory-often-1b) # one GPU, the 1.1B: memory checkpoints of the tier alone every 4 and every 10 steps against
      # none, MEMORY_ROUNDS rounds in turn (default 1)
      local t=checkpoint_interval=1000,memory_tier=true
      (cd $B && python3 bench_nanotron.py all --model 1b --steps 80 --interval 4 --modes none \
        --variant memtier4:$t,memory_interval=4 --variant memtier10:$t,memory_interval=10 --cache-gib 4 \
        --rounds "${MEMORY_ROUNDS:-1}" --work "$WORK/mo1b" --out "$OUT/memory-often-1b") ;;
    memory-often-180m) # one GPU, the 180M: memory checkpoints every 2 steps and at every step against none
      local t=checkpoint_interval=1000,memory_tier=true
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 200 --interval 2 --modes none \
        --variant memtier2:$t,memory_interval=2 --variant memtier1:$t,memory_interval=1 \
        --rounds "${MEMORY_ROUNDS:-1}" --work "$WORK/mo180" --out "$OUT/memory-often-180m") ;;
    memory-floor-180m) # one GPU, the 180M every 2 steps: none, the engine's copy alone (copy-engine: what the
      # bytes' copy into pinned memory costs the steps beside it) and the memory checkpoints, FLOOR_ROUNDS
      # rounds in turns (default 3); FLOOR_MODES, FLOOR_EXTRA: other modes, more flags (--variant NAME:settings);
      # copy-engine-files, -files-stage, -files-stage-checksums: copy-engine grown toward a memory checkpoint;
      # FLOOR_BLOCKS=N: checkpoints and copies in every other block of N steps only, each run's cost also
      # measured within it (blocks_on_vs_off); FLOOR_STEPS: steps a run (200)
      local t=checkpoint_interval=1000,memory_tier=true,memory_interval=2
      (cd $B && python3 bench_nanotron.py all --model 180m --steps "${FLOOR_STEPS:-200}" --interval 2 \
        ${FLOOR_BLOCKS:+--blocks $FLOOR_BLOCKS} \
        --modes "${FLOOR_MODES:-none,copy-engine}" --variant memtier2:$t \
        --rounds "${FLOOR_ROUNDS:-3}" --work "$WORK/mf180" --out "$OUT/memory-floor-180m" ${FLOOR_EXTRA:-}) ;;
    memory-floor-1b) # one GPU, the 1.1B every FLOOR_INTERVAL steps (default 4): none, the engine's copy alone
      # and the memory checkpoints, within each run (--blocks FLOOR_BLOCKS, default 40); FLOOR_STEPS (320)
      local i=${FLOOR_INTERVAL:-4}
      (cd $B && python3 bench_nanotron.py all --model 1b --steps "${FLOOR_STEPS:-320}" --interval "$i" \
        --blocks "${FLOOR_BLOCKS:-40}" --cache-gib 4 --modes "${FLOOR_MODES:-none,copy-engine}" \
        --variant "memtier$i:checkpoint_interval=1000,memory_tier=true,memory_interval=$i" \
        --rounds "${FLOOR_ROUNDS:-1}" --work "$WORK/mf1b" --out "$OUT/memory-floor-1b-$i" ${FLOOR_EXTRA:-}) ;;
    gil-180m) # who holds the GIL while memory checkpoints every 2 steps run beside the 180M's training: py-spy
      # (its wheel in .gpu/wheels, gpu_prepare_main.sh) over the run, 100 samples a second, summed on this
      # machine (micro/gil_summary.py): the raw samples are tens of MB
      local t=checkpoint_interval=1000,memory_tier=true
      (cd $B && py-spy record --gil --threads --subprocesses -r 100 -f raw -o "$WORK/gil.txt" -- \
        python3 bench_nanotron.py all --model 180m --steps 200 --interval 2 --modes none \
        --variant memtier2:$t,memory_interval=2 --rounds 1 --work "$WORK/gil" --out "$OUT/gil-180m" &&
        python3 micro/gil_summary.py "$WORK/gil.txt" --rate 100 --top 400 --out "$OUT/gil-180m/gil_summary.json") ;;
    restart-1b) (cd $B && python3 bench_restart.py all --model 1b --step 10 --cache-gib 16 --work "$WORK/rs1b" \
      --out "$OUT/restart-1b" ${RESTART_ONLY:+--only $RESTART_ONLY} ${TIER_COPIES:+--tier-copies $TIER_COPIES} \
      ${RESTART_REPEATS:+--repeats $RESTART_REPEATS}) ;;
    tier-stall-180m) # the training stall with the memory tier on and off, one call
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 400 --interval 40 --modes datastates \
        --variant tier:memory_tier=true --work "$WORK/ts180" --out "$OUT/tier-stall-180m") ;;
    stress-180m) # a checkpoint at every step, staged on the GPU: backpressure bounds the stall
      (cd $B && python3 bench_nanotron.py all --model 180m --steps 60 --stress-steps 30 --modes stress \
        --work "$WORK/st180" --out "$OUT/stress-180m") ;;
    crash) # real Nanotron training SIGKILLed mid-checkpoint, then resumed
      (cd $B && python3 nanotron_crash.py --trials 3 --out "$OUT/crash" --work "$WORK/crash") ;;
    staging) (cd $B/micro && python3 bench_staging.py --model 180m --out "$OUT/staging") ;;
    staging-launches) # the kept staging's copy by way of launching: foreach, cat, a copy_ each, the driver's batch
      python3 $B/micro/bench_staging_launches.py --out "$OUT/staging-launches" ;;
    interference) (cd $B/micro && python3 bench_interference.py --dir "$WORK/interf" --out "$OUT/interference") ;;
    side-replicas) # 180M dp2 without checkpoints: alone, beside memory replicas moved over gloo between two
      # processes of their own (micro/side_replicas.py), alone again: what a replica costs from outside the job
      for run in alone beside alone2; do
        if [ $run = beside ]; then
          (cd $B/micro && python3 side_replicas.py --out "$OUT/side-replicas/load" --seconds 600 \
            --stop "$WORK/side.stop") &
          load=$!  # `wait` alone would wait for the results' tar loop too
          sleep 10
        fi
        (cd $B && python3 bench_nanotron.py all --model 180m --layout dp2 --nodes 2 --steps 200 --modes none \
          --work "$WORK/side" --out "$OUT/side-replicas/$run")
        if [ $run = beside ]; then touch "$WORK/side.stop"; wait $load; rm -f "$WORK/side.stop"; fi
      done ;;
    allreduce-copy) # 2 GPUs: the all-reduce of a 1.1B's gradients alone and beside copies to the host, and how
      # the GPUs are linked (NCCL's transport lines from its log)
      NCCL_DEBUG=INFO torchrun --nproc-per-node 2 $B/micro/bench_allreduce_copy.py --out "$OUT/allreduce-copy" \
        ${BENCH_ARGS:-} 2>&1 | awk '!/NCCL INFO/ || / via /' | head -200; true ;;
    d2h-wait) # how long a small read from the GPU (a step's loss.item()) waits while a checkpoint goes to the
      # host: a raw copy each way, the engine's save by device_copy_size and with small chunks (BENCH_ARGS)
      (cd $B/micro && python3 bench_d2h_wait.py --out "$OUT/d2h-wait" ${BENCH_ARGS:-}) ;;
    copy-interference) # a copy to the host beside launch-bound steps, by the way it is issued (BENCH_ARGS)
      (cd $B/micro && python3 bench_copy_interference.py --out "$OUT/copy-interference" ${BENCH_ARGS:-}) ;;
    one-queue) # a copy to the host beside GPU-bound kernels, by the way its pieces are queued, with one hardware
      # queue for every stream (Nanotron's CUDA_DEVICE_MAX_CONNECTIONS=1) and with the driver's default of 8
      # (c1, c8)
      for c in 1 8; do
        (cd $B/micro && CUDA_DEVICE_MAX_CONNECTIONS=$c python3 bench_one_queue.py --out "$OUT/one-queue/c$c" \
          ${BENCH_ARGS:-})
      done ;;
    staging-overlap) # a 1.1B-sized staging on the GPU beside GPU-bound steps: on the training stream, on a side
      # stream (multi-tensor copies, or the driver's memcpy), with Nanotron's one hardware queue
      (cd $B/micro && CUDA_DEVICE_MAX_CONNECTIONS=1 python3 bench_staging_overlap.py --out "$OUT/staging-overlap" \
        ${BENCH_ARGS:-}) ;;
    launch-copy) # the same copies beside a chain bound by its launches, as the 180M's steps are: one copy, the
      # engine's pieces, in 64 MiB copies, staged; LAUNCH_WAYS: others
      (cd $B/micro && python3 bench_one_queue.py --size 256 --n 20000 --repeats 9 \
        --ways "${LAUNCH_WAYS:-none,one,engine,engine-size64,engine-stage}" \
        --out "$OUT/launch-copy" ${BENCH_ARGS:-}) ;;
    map-interference) # moving 7 GiB between tmpfs files beside training steps: mapped, or through a buffer
      (cd $B/micro && python3 bench_map_interference.py --out "$OUT/map-interference") ;;
    pinning) (cd $B/micro && python3 bench_pinning.py --cache-gib 16 --rounds 2 --out "$OUT/pinning") ;;
    restore-stress) python3 $B/micro/restore_stress.py --work "$WORK/rs" --procs 6 --rounds 8 --out "$OUT/restore-stress" ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

# Only a few files come back from a machine that is given back, and none of a call cut short but what is
# there: keep a fresh tarball of everything.
(while sleep 20; do tar -C "$OUT" -czf "$OUT/.partial.tgz" --exclude '*.tgz' . 2>/dev/null && mv "$OUT/.partial.tgz" "$OUT/results.tgz"; done) &
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
python3 $B/scrub.py "$OUT" > /dev/null
find "$OUT" -name '*.log' -size +100k -exec gzip -9 {} +  # the runs' logs: Nanotron's line per step
tar -C "$OUT" -czf "$OUT/results.tgz" --exclude '*.tgz' . 2>/dev/null
exit $rc
