#!/usr/bin/env bash
# The disk's O_DIRECT ceilings, the reference for "time to persisted" and for restores:
#   bash benchmarks/disk.sh dd WORKDIR       writes: 1 to 8 streams of 1 GiB each
#   bash benchmarks/disk.sh ddread WORKDIR   cold reads of 4 GiB by 1 to 8 streams (drops the page cache: root)
set -uo pipefail
what=${1:?dd or ddread} WORK=${2:?work folder}
mkdir -p "$WORK"
rate() { python3 -c "print(f'$1 $2 streams: {$3 / ($5 - $4) / 1e9:.2f} GB/s')"; }
if [ "$what" = dd ]; then
  for n in 1 2 4 8; do
    d0=$(date +%s.%N)
    pids=()
    for i in $(seq "$n"); do
      dd if=/dev/zero of="$WORK/dd$i" bs=64M count=16 oflag=direct 2>/dev/null &
      pids+=($!)
    done
    wait "${pids[@]}"
    rate "dd oflag=direct" "$n" $((n << 30)) "$d0" "$(date +%s.%N)"
    rm -f "$WORK"/dd*
  done
else
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
    rate "dd iflag=direct" "$n" $((4 << 30)) "$d0" "$(date +%s.%N)"
  done
  rm -f "$WORK/rd"
fi
