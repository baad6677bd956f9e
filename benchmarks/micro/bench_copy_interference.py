"""What a copy to the host costs the training steps it runs beside, by the way it is issued (GPU).

A training loop bound by its kernel launches (a Transformer of the 180M checkpoint's width on a few short
sequences, several micro-batches a step, like Nanotron's 180M step) runs on one GPU; between its steps, in
turn, one of these events starts, and the steps after it run beside it:

* `nothing`: the reference;
* `dma_one`: the checkpoint's bytes (already on the GPU, in one buffer) copied to pinned host memory in one
  copy on a side stream; nothing waits for it;
* `dma_queued`: the same in pieces of `--piece-mib`, all queued at once on the side stream;
* `dma_waited`: the same pieces copied one after the other by a background thread that waits for each with a
  blocking-sync event (the engine's copy thread's way);
* `dma_polled`: the same, the thread polling each piece's event every 0.5 ms instead;
* `dma_paced`: the pieces queued at once with a GPU sleep between them, so that the copy takes about
  `--pace` times as long;
* `h2d_one`: the same bytes from the host to the GPU in one copy;
* `stage_only`: the checkpoint staged on the GPU as a save stages it (engine), then dropped;
* `save`: the engine's save of the checkpoint (staged, an 8 GiB cache, files in /dev/shm);
* `save_256`: the same with 256 MiB chunks.

    python3 benchmarks/micro/bench_copy_interference.py --out DIR [--rounds 10]

Per event and round: the call's time; its *excess*: the call plus the AFTER steps after it over AFTER times
the median of the BEFORE steps just before it; the copy's own duration where it is timed on the GPU; and
the GPU's interrupts during the event (`/proc/interrupts`, lines naming nvidia), with how many landed on the
CPU that ran the training thread. Writes DIR/bench_copy_interference.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402
from bench_interference import make_step, saving_events  # noqa: E402
from bench_staging import llama_files  # noqa: E402

BEFORE, AFTER = 8, 8


def gpu_interrupts() -> list[int]:
    """Per CPU, the interrupts of the lines of /proc/interrupts that name nvidia."""
    rows = Path("/proc/interrupts").read_text().splitlines()
    ncpu = len(rows[0].split())
    total = [0] * ncpu
    for row in rows[1:]:
        if "nvidia" in row:
            cells = row.split()[1 : 1 + ncpu]
            for i, c in enumerate(cells):
                if c.isdigit():
                    total[i] += int(c)
    return total


def this_cpu() -> int:
    """The CPU the calling thread last ran on (/proc/thread-self/stat, field 39)."""
    stat = Path("/proc/thread-self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


class Copies:
    """The raw copies: a device buffer of the checkpoint's size, pinned host memory, a side stream."""

    def __init__(self, nbytes: int, piece: int, pace: float) -> None:
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host.fill_(1)
        self.stream = torch.cuda.Stream()
        self.pieces = [(lo, min(lo + piece, nbytes)) for lo in range(0, nbytes, piece)]
        self.pace = pace
        self.sleep_cycles = 0
        self.thread: threading.Thread | None = None
        self.timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def _start_timing(self) -> None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.timed = (begin, end)
        begin.record(self.stream)

    def one(self, to_host: bool = True) -> None:
        with torch.cuda.stream(self.stream):
            self._start_timing()
            if to_host:
                self.host.copy_(self.dev, non_blocking=True)
            else:
                self.dev.copy_(self.host, non_blocking=True)
            assert self.timed is not None
            self.timed[1].record(self.stream)

    def queued(self, paced: bool = False) -> None:
        with torch.cuda.stream(self.stream):
            self._start_timing()
            for lo, hi in self.pieces:
                self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                if paced and self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
            assert self.timed is not None
            self.timed[1].record(self.stream)

    def calibrate(self) -> float:
        """Sets the GPU sleep between pieces so that the paced copy takes about `pace` times the plain one."""
        self.queued()
        torch.cuda.synchronize()
        assert self.timed is not None
        plain_ms = self.timed[0].elapsed_time(self.timed[1])
        gap_ms = plain_ms * (self.pace - 1) / len(self.pieces)
        probe = 1_000_000
        with torch.cuda.stream(self.stream):
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record(self.stream)
            torch.cuda._sleep(probe)
            e.record(self.stream)
        torch.cuda.synchronize()
        self.sleep_cycles = int(probe * gap_ms / b.elapsed_time(e))
        return plain_ms

    def threaded(self, poll: bool) -> None:
        def run() -> None:
            with torch.cuda.stream(self.stream):
                for lo, hi in self.pieces:
                    self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                    ev = torch.cuda.Event(blocking=not poll)
                    ev.record(self.stream)
                    if poll:
                        while not ev.query():
                            time.sleep(0.0005)
                    else:
                        ev.synchronize()

        self.timed = None
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finish(self) -> float | None:
        """Waits for the copies; their GPU time in seconds where it was timed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.stream.synchronize()
        if self.timed is None:
            return None
        ms = self.timed[0].elapsed_time(self.timed[1])
        self.timed = None
        return ms / 1e3


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--dir", default="/dev/shm/ds_copy_interf")
    a.add_argument("--rounds", type=int, default=10)
    a.add_argument("--micro", type=int, default=4, help="micro-batches a step")
    a.add_argument("--tokens", type=int, default=256, help="tokens a micro-batch")
    a.add_argument("--piece-mib", type=int, default=64)
    a.add_argument("--pace", type=float, default=4.0)
    a.add_argument("--events", default="", help="a comma-separated subset of the events (default: all)")
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    files = llama_files("180m", "cuda")
    folder = Path(args.dir)
    settings = {
        "save": ({"host_cache_size": 8.0}, folder / "save"),
        "save_256": ({"host_cache_size": 8.0, "chunk_size": 256}, folder / "save_256"),
    }
    engine_folders, saves, nbytes = saving_events(files, settings)
    engines = {name: engine for name, (engine, _) in engine_folders.items()}
    copies = Copies(nbytes, args.piece_mib << 20, args.pace)
    plain_ms = copies.calibrate()
    events: dict[str, Callable[[], Any]] = {
        "nothing": lambda: None,
        "dma_one": copies.one,
        "dma_queued": copies.queued,
        "dma_waited": lambda: copies.threaded(poll=False),
        "dma_polled": lambda: copies.threaded(poll=True),
        "dma_paced": lambda: copies.queued(paced=True),
        "h2d_one": lambda: copies.one(to_host=False),
        **saves,
    }
    if args.events:
        events = {n: events[n] for n in args.events.split(",")}

    step = make_step(batch=1, tokens=args.tokens, micro=args.micro, fused=False)
    for _ in range(30):  # warm-up: kernels chosen, allocator filled
        step()
    raw: dict[str, dict[str, list[Any]]] = {
        n: {"call_s": [], "excess_s": [], "after_s": [], "copy_s": [], "irqs": [], "irqs_here": []}
        for n in events
    }
    quiet: list[float] = []
    cpus: dict[int, int] = {}
    for r in range(args.rounds + 1):  # round 0 warms the events up (first allocations, files): left out
        for name, event in events.items():
            for _, place in engine_folders.values():
                for sub in ("model", "optimizer"):
                    (place / sub).mkdir(parents=True, exist_ok=True)
            before = [step() for _ in range(BEFORE)]
            irq0 = gpu_interrupts()
            t0 = time.perf_counter()
            event()
            call = time.perf_counter() - t0
            after, here = [], []
            for _ in range(AFTER):
                after.append(step())
                here.append(this_cpu())
            irq1 = gpu_interrupts()
            copy_s = copies.finish() if name.startswith(("dma", "h2d")) else None
            for engine in engines.values():
                engine.wait_persisted()
            shutil.rmtree(folder, ignore_errors=True)
            if not r:
                continue
            ref = statistics.median(before)
            quiet += before
            for c in here:
                cpus[c] = cpus.get(c, 0) + 1
            d = [y - x for x, y in zip(irq0, irq1)]
            rec = raw[name]
            rec["call_s"].append(call)
            rec["excess_s"].append(call + sum(after) - AFTER * ref)
            rec["after_s"].append([t - ref for t in after])
            rec["copy_s"].append(copy_s)
            rec["irqs"].append(sum(d))
            rec["irqs_here"].append(sum(d[c] for c in set(here) if c < len(d)))
    for engine in engines.values():
        engine.close()
    med: dict[str, dict[str, Any]] = {
        n: {
            "call_s": statistics.median(d["call_s"]),
            "excess_s": statistics.median(d["excess_s"]),
            "excess_mean_s": statistics.fmean(d["excess_s"]),
            "after_mean_s": [statistics.fmean(col) for col in zip(*d["after_s"])],
            "copy_s": statistics.median(xs) if (xs := [x for x in d["copy_s"] if x is not None]) else None,
            "irqs": statistics.median(d["irqs"]),
            "irqs_here": statistics.median(d["irqs_here"]),
        }
        for n, d in raw.items()
    }
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": nbytes,
        "piece_bytes": args.piece_mib << 20,
        "plain_queued_copy_ms": plain_ms,
        "paced_sleep_cycles": copies.sleep_cycles,
        "median_step_s": statistics.median(quiet),
        "training_thread_cpus": cpus,
        "affinity": sorted(os.sched_getaffinity(0)),
        "median": med,
        "raw": raw,
        "nvidia_smi_topo": topo,
        "lscpu": lscpu,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_copy_interference.json").write_text(json.dumps(result, indent=1))
    print(f"median step {1e3 * result['median_step_s']:.2f} ms; plain queued copy {plain_ms:.1f} ms")
    for name, m in med.items():
        copy = "" if m["copy_s"] is None else f"  copy {1e3 * m['copy_s']:6.1f} ms"
        lands = " ".join(f"{1e3 * x:+5.1f}" for x in m["after_mean_s"])
        print(
            f"{name:11s} call {1e3 * m['call_s']:6.2f}  excess {1e3 * m['excess_s']:6.2f} "
            f"(mean {1e3 * m['excess_mean_s']:6.2f}) ms  irqs {m['irqs']:5.0f} ({m['irqs_here']:4.0f} here)"
            f"{copy}  after: {lands}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
