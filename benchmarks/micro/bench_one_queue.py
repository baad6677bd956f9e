"""What a copy to the host costs GPU-bound kernels queued beside it, by the way its pieces are queued (GPU).

Nanotron runs with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream's work goes into one hardware queue, in the
order it was queued. A command that must wait for an earlier one of its own stream (the next copy, an event
recorded after a copy) holds every command queued after it, the training's kernels included, until that
earlier one ends. This benchmark measures that alone, on the GPU's side: the main thread queues a chain of
matrix products (about 0.1 s of GPU work) and keeps it a few milliseconds ahead of the GPU, as a training
loop does, while a thread copies a 2.16 GB GPU buffer (the 180M checkpoint's size) to pinned host memory
over and over in one of these ways:

* `none`: the reference;
* `one`: the whole buffer in one copy on a side stream, waited for with a blocking-sync event: one driver
  call a copy, one interrupt;
* `pair`: pieces of `--piece-mib`, two in flight on one stream, an event after each; the thread waits for
  piece k-2's event before it queues piece k (the engine core's way);
* `alone`: each piece on a stream of its own (a pool of two), nothing queued after it; the thread polls the
  stream (`query`, no command queued) and queues piece k once piece k-2's stream is idle;
* `engine`: the engine's own save of the buffer into a file in /dev/shm (`device_copy_size` pieces), one
  after the other; `engine-size64`: copies of 64 MiB (`device_copy_size`), 16 times fewer driver calls;
  `engine-stage`: staged on the GPU first (kept buffers), as a memory checkpoint is.

`--size 256 --n 20000` makes the chain bound by its launches instead: what the copies cost the thread that
launches the kernels, as in the 180M's training.

    CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/micro/bench_one_queue.py --out DIR [--repeats 7]

Per way: the chain's time (median of the repeats) and its excess over `none`, and the copy's rate meanwhile.
Writes DIR/bench_one_queue.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _bench_baselines import RawCopy  # noqa: E402
from _common import command_info  # noqa: E402

NBYTES = 2_160_000_000


class Copier:
    """Copies the buffer to the host in a loop on a thread of its own until `stop()`; counts the bytes."""

    def __init__(self, way: str, piece: int) -> None:
        self.way, self.piece = way, piece
        self.copied = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if way in ("one", "pair", "alone"):
            self.dev = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
            self.host = torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True)
            self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            self.pieces = [(lo, min(lo + piece, NBYTES)) for lo in range(0, NBYTES, piece)]
        elif way.startswith("engine"):
            self.raw = RawCopy(NBYTES, "engine", parts=way.split("-")[1:])

    def start(self) -> None:
        self._stop.clear()
        run: Callable[[], None] = {"one": self._one, "pair": self._pair, "alone": self._alone}.get(
            self.way, self._engine
        )
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        torch.cuda.synchronize()

    def _one(self) -> None:
        s = self.streams[0]
        while not self._stop.is_set():
            with torch.cuda.stream(s):
                self.host.copy_(self.dev, non_blocking=True)
                end = torch.cuda.Event(blocking=True)
                end.record(s)
            end.synchronize()
            self.copied += NBYTES

    def _pair(self) -> None:
        s = self.streams[0]
        while not self._stop.is_set():
            ends: list[torch.cuda.Event] = []
            for k, (lo, hi) in enumerate(self.pieces):
                if k >= 2:
                    ends[k - 2].synchronize()
                    self.copied += self.piece
                with torch.cuda.stream(s):
                    self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                    ends.append(torch.cuda.Event(blocking=True))
                    ends[-1].record(s)
                if self._stop.is_set():
                    break
            for ev in ends[-2:]:
                ev.synchronize()

    def _alone(self) -> None:
        while not self._stop.is_set():
            for k, (lo, hi) in enumerate(self.pieces):
                s = self.streams[k % 2]
                if k >= 2:
                    while not s.query():
                        time.sleep(20e-6)
                    self.copied += self.piece
                with torch.cuda.stream(s):
                    self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                if self._stop.is_set():
                    break
            for s in self.streams:
                s.synchronize()

    def _engine(self) -> None:
        while not self._stop.is_set():
            self.raw.issue()
            handles = self.raw.saves[-1]
            while not all(h.done() for h in handles):
                time.sleep(0.001)
            self.copied += NBYTES


def chain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, ahead: int) -> float:
    """Queues `n` products (`products`); seconds to the last one's end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    products(a, b, c, n, ahead)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, ahead: int) -> None:
    """Queues `n` products, never more than about `ahead` batches of 20 ahead of the GPU, as a training loop
    keeps its kernels queued."""
    marks: list[torch.cuda.Event] = []
    for i in range(n):
        torch.mm(a, b, out=c)
        if i % 20 == 19:
            ev = torch.cuda.Event()
            ev.record()
            marks.append(ev)
            if len(marks) > ahead:
                marks[-1 - ahead].synchronize()


def header(args: argparse.Namespace) -> dict[str, object]:
    """What a result of a run beside the GPU's work starts with: its command, hardware queues, GPU, torch and
    settings."""
    return {
        "command": command_info(),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "settings": vars(args),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--piece-mib", type=int, default=4)
    ap.add_argument("--size", type=int, default=2048, help="the products' square size")
    ap.add_argument("--n", type=int, default=3000, help="products in a chain")
    ap.add_argument("--ahead", type=int, default=3, help="batches of 20 products queued ahead of the GPU")
    ap.add_argument("--ways", default="none,pair,alone,engine")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    a, b, c = (torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        chain(a, b, c, args.n, args.ahead)
    ways = args.ways.split(",")
    copiers = {w: Copier(w, args.piece_mib << 20) for w in ways if w != "none"}
    times: dict[str, list[float]] = {w: [] for w in ways}
    rates: dict[str, list[float]] = {w: [] for w in ways if w != "none"}
    for r in range(args.repeats + 1):  # repeat 0 warms each way up: left out
        for w in ways:
            cp = copiers.get(w)
            if cp is not None:
                cp.copied = 0
                cp.start()
                time.sleep(0.02)  # the copies under way
                copied0 = cp.copied
            s = chain(a, b, c, args.n, args.ahead)
            if cp is not None:
                rate = (cp.copied - copied0) / s
                cp.stop()
            if r:
                times[w].append(s)
                if cp is not None:
                    rates[w].append(rate)
    base = statistics.median(times["none"]) if "none" in times else None
    med = {
        w: {
            "chain_s": statistics.median(t),
            "excess": statistics.median(t) / base - 1 if base else None,
            "copy_gbps": statistics.median(rates[w]) / 1e9 if w in rates else None,
        }
        for w, t in times.items()
    }
    result = {
        **header(args),
        "median": med,
        "raw": {"chain_s": times, "copy_bps": rates},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_one_queue.json").write_text(json.dumps(result, indent=1))
    conn = result["cuda_device_max_connections"]
    for w, m in med.items():
        extra = "" if m["copy_gbps"] is None else f"  copy {m['copy_gbps']:5.1f} GB/s"
        excess = "" if m["excess"] is None else f"  {100 * m['excess']:+6.1f}%"
        chain_ms = 1e3 * m["chain_s"]
        print(f"connections={conn} size={args.size} {w:11s} chain {chain_ms:7.1f} ms{excess}{extra}")
    for cp in copiers.values():
        if cp.way.startswith("engine"):
            cp.raw.seconds()  # closes the engine, removes its files
    return 0


if __name__ == "__main__":
    sys.exit(main())
