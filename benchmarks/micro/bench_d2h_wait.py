"""How long a training step's small reads from the GPU wait while a checkpoint's bytes go to the host (GPU).

Nanotron reads values back from the GPU at every step (`loss.item()`, the gradients' norm for its log). Such
a read is a device-to-host copy, and it queues behind the device-to-host copies already on the copy engine,
whichever stream issued them. This benchmark measures that wait alone: the main thread, every `--gap-ms`,
launches one small kernel and reads its result back (`.item()`), and times the read, while one of these
events copies the 180M model's checkpoint (2.16 GB, `bench_staging.llama_files`) to the host:

* `raw`: one copy from a GPU buffer to pinned host memory on a side stream (`non_blocking`);
* `raw_h2d`: the same bytes the other way;
* `save_copy<N>`: the engine's staged save of the checkpoint's 52 files (an 8 GiB cache of 64 MiB chunks,
  files in /dev/shm), its copies from the GPU of N MiB (`device_copy_size`), for each N of `--copies`; 0 is
  a chunk's bytes in one copy; the copy ends when every file's bytes are in the cache;
* `save_chunk<N>`: the same with chunks of N MiB (`--small-chunk`) copied whole.

    python3 benchmarks/micro/bench_d2h_wait.py --out DIR [--rounds 5 --copies 0,16,4,1 --small-chunk 4]

Per event and round: the copy's duration, the reads during it, their median and largest time, and their
summed *wait*: each read's time over the median read time of the quiet 50 ms before the event. Writes
DIR/bench_d2h_wait.json with every value and the medians over the rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from bench_interference import saving_events, write_result  # noqa: E402
from bench_staging import llama_files  # noqa: E402

QUIET_S = 0.05


def reads(flag: torch.Tensor, gap_s: float, until: Callable[[], bool], least_s: float = 0.0) -> list[float]:
    """Times of `flag.item()` after a kernel that changes it, one every `gap_s`, until `until()` holds and
    `least_s` has passed."""
    times = []
    t_end = time.perf_counter() + least_s
    while not until() or time.perf_counter() < t_end:
        flag.add_(1)
        t0 = time.perf_counter()
        flag.item()
        times.append(time.perf_counter() - t0)
        time.sleep(gap_s)
    return times


def copy_event(nbytes: int, way: str) -> Callable[[], Callable[[], bool]]:
    """A raw copy of `nbytes` (`d2h` or `h2d`) on a side stream; the event returns whether it is done."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def start() -> Callable[[], bool]:
        end = torch.cuda.Event()
        with torch.cuda.stream(stream):
            if way == "d2h":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            end.record(stream)
        return end.query

    return start


def save_event(save: Callable[[], Any]) -> Callable[[], Callable[[], bool]]:
    """An engine's staged save; the event returns whether every file's bytes are in its cache."""

    def start() -> Callable[[], bool]:
        handles = save()
        done = threading.Event()

        def wait() -> None:
            for h in handles:
                h.wait_copied()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.is_set

    return start


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--copies", default="0,16,4,1", help="device_copy_size (MiB), one save event each")
    a.add_argument("--small-chunk", type=int, default=4, help="chunk_size (MiB) of the save_chunk event")
    a.add_argument("--gap-ms", type=float, default=0.5)
    a.add_argument("--cache-gib", type=float, default=8.0)
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    files = llama_files("180m", "cuda")
    shm = Path("/dev/shm/ds_d2h_wait")
    cache = {"host_cache_size": args.cache_gib, "chunk_size": 64}
    settings = {
        f"save_copy{c}": ({**cache, "device_copy_size": int(c)}, shm / f"copy{c}")
        for c in args.copies.split(",")
    }
    small = f"save_chunk{args.small_chunk}"
    settings[small] = ({**cache, "chunk_size": args.small_chunk, "device_copy_size": 0}, shm / small)
    engines, saves, nbytes = saving_events(files, settings)
    events = {"raw": copy_event(nbytes, "d2h"), "raw_h2d": copy_event(nbytes, "h2d")}
    events.update({name: save_event(saves[name]) for name in settings})
    flag = torch.zeros((), dtype=torch.int64, device="cuda")
    gap = args.gap_ms / 1e3
    raw: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in ("copy_s", "reads", "median_read_s", "max_read_s", "wait_s", "quiet_read_s")}
        for n in events
    }
    for r in range(args.rounds + 1):  # round 0 warms every event up (allocations, files): left out
        for name, event in events.items():
            for _, folder in engines.values():
                for sub in ("model", "optimizer"):
                    (folder / sub).mkdir(parents=True, exist_ok=True)
            torch.cuda.synchronize()
            quiet = statistics.median(reads(flag, gap, lambda: True, QUIET_S))
            t0 = time.perf_counter()
            done = event()
            during = reads(flag, gap, done)
            copy_s = time.perf_counter() - t0
            torch.cuda.synchronize()
            for engine, _ in engines.values():
                engine.wait_persisted()
            shutil.rmtree(shm, ignore_errors=True)
            if r:
                d = raw[name]
                d["copy_s"].append(copy_s)
                d["reads"].append(len(during))
                d["median_read_s"].append(statistics.median(during))
                d["max_read_s"].append(max(during))
                d["wait_s"].append(sum(max(t - quiet, 0.0) for t in during))
                d["quiet_read_s"].append(quiet)
    for engine, _ in engines.values():
        engine.close()
    med = write_result(args.out, "bench_d2h_wait.json", raw, nbytes, gap_s=gap)
    print(f"{'event':10s} {'copy ms':>8s} {'reads':>6s} {'median us':>10s} {'max us':>8s} {'wait ms':>8s}")
    for name, m in med.items():
        print(
            f"{name:10s} {1e3 * m['copy_s']:8.1f} {m['reads']:6.0f} {1e6 * m['median_read_s']:10.1f} "
            f"{1e6 * m['max_read_s']:8.1f} {1e3 * m['wait_s']:8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
