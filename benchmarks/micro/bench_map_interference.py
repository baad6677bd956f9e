"""What moving a checkpoint's bytes between node-memory files costs the training steps beside it, by the way
the training process touches them (GPU): mapped, as the memory replicas' gloo transfers and checks do, or
through a small buffer with pread/pwrite, the pages never in the process's own page tables.

A training loop bound by its kernel launches (bench_interference.make_step) runs on one GPU; between its
steps, in turn, one of these events starts on a background thread of the same process, and the steps after
it run beside it until it ends:

* `nothing`: the reference;
* `mapped_new`: `--gib` GiB copied from a mapped tmpfs file into a new tmpfs file, mapped (each page faulted
  in by the copy: a new file whose memory was not reserved), both mappings then closed (munmap);
* `mapped_donor`: the same into an existing file whose pages exist (a replica received into an older one's);
* `buffered_new`: the same bytes read with pread into a 64 MiB buffer and written with pwrite to a new file;
* `buffered_donor`: the same into an existing file.

    python3 benchmarks/micro/bench_map_interference.py --out DIR [--gib 7] [--rounds 3]

Per event and round: the event's seconds, the steps that ran beside it, their excess over the median of the
BEFORE steps just before it, and the longest of them. Writes DIR/bench_map_interference.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402
from bench_interference import make_step  # noqa: E402

BEFORE = 8
PIECE = 64 << 20


def _mapped(src: Path, dst: Path, nbytes: int) -> None:
    with open(src, "rb") as fs, open(dst, "r+b" if dst.exists() else "w+b") as fd:
        fd.truncate(nbytes)
        ms, md = mmap.mmap(fs.fileno(), nbytes, prot=mmap.PROT_READ), mmap.mmap(fd.fileno(), nbytes)
        s, d = torch.frombuffer(ms, dtype=torch.uint8), torch.frombuffer(md, dtype=torch.uint8)
        for lo in range(0, nbytes, PIECE):
            d[lo : lo + PIECE].copy_(s[lo : lo + PIECE])
        del s, d
        ms.close()
        md.close()


def _buffered(src: Path, dst: Path, nbytes: int) -> None:
    buf = bytearray(PIECE)
    fs = os.open(src, os.O_RDONLY)
    fd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        for lo in range(0, nbytes, PIECE):
            n = os.preadv(fs, [buf], lo)
            os.pwrite(fd, memoryview(buf)[:n], lo)
    finally:
        os.close(fs)
        os.close(fd)


def events(folder: Path, nbytes: int) -> dict[str, Callable[[], None]]:
    src, new, donor = folder / "src", folder / "new", folder / "donor"
    for path in (src, donor):
        _buffered_fill(path, nbytes)

    def fresh(move: Callable[[Path, Path, int], None]) -> Callable[[], None]:
        def run() -> None:
            new.unlink(missing_ok=True)
            move(src, new, nbytes)

        return run

    return {
        "nothing": lambda: time.sleep(1.0),
        "mapped_new": fresh(_mapped),
        "mapped_donor": lambda: _mapped(src, donor, nbytes),
        "buffered_new": fresh(_buffered),
        "buffered_donor": lambda: _buffered(src, donor, nbytes),
    }


def _buffered_fill(path: Path, nbytes: int) -> None:
    buf = bytes(range(256)) * (PIECE // 256)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        for lo in range(0, nbytes, PIECE):
            os.pwrite(fd, buf[: min(PIECE, nbytes - lo)], lo)
    finally:
        os.close(fd)


def measure(step: Callable[[], float], event: Callable[[], None]) -> dict[str, float]:
    before = [step() for _ in range(BEFORE)]
    done = threading.Event()
    t0 = time.perf_counter()

    def run() -> None:
        event()
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    beside = [step()]
    while not done.is_set():
        beside.append(step())
    thread.join()
    seconds = time.perf_counter() - t0
    base = statistics.median(before)
    return {
        "seconds": seconds,
        "steps": len(beside),
        "excess_s": sum(beside) - base * len(beside),
        "longest_s": max(beside),
        "median_before_s": base,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=7.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/ds_map_interference")
    a = ap.parse_args()
    folder = Path(a.dir)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(a.gib * (1 << 30)) // PIECE * PIECE
    step = make_step(micro=4)
    for _ in range(20):
        step()
    todo = events(folder, nbytes)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in todo}
    for r in range(a.rounds):
        for name, event in todo.items():
            results[name].append(measure(step, event))
            print(r, name, json.dumps(results[name][-1]), flush=True)
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    summary = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in results.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": command_info(), "gpu": torch.cuda.get_device_name(), "gib": a.gib, "rounds": results,
           "median": summary}  # fmt: skip
    (out / "bench_map_interference.json").write_text(json.dumps(doc, indent=1))
    for name, s in summary.items():
        print(
            f"{name:15s} {s['seconds']:6.2f} s, {s['steps']:4.0f} steps beside, "
            f"excess {1e3 * s['excess_s']:8.1f} ms, longest {1e3 * s['longest_s']:7.1f} ms "
            f"(median step {1e3 * s['median_before_s']:.1f})"
        )


if __name__ == "__main__":
    main()
