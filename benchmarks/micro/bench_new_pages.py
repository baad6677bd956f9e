"""How fast this machine gives a tmpfs new pages (no GPU): a lost node's restart receives its whole tier into
new pages, and the replica link into new pages ran at half its rate into an older copy's files in a cold
round. Files of `--gib` GiB in /dev/shm are reserved with posix_fallocate (pages allocated and zeroed, as
`replica_reserve.py` reserves a received file) and then removed, in this order:

* `fresh`: the first reservation of the process;
* `again`: at once after the last one's removal (pages the kernel just freed);
* `after_pause`: after `--pause` seconds idle (a VM that reports freed pages to its host backs them again);
* `again_2`: at once once more.

The memory's host-side backing shows as a slower `fresh` and `after_pause` than `again`. Also recorded: the
removals' rates and whether the kernel has a virtio balloon driver (free page reporting).

    python3 benchmarks/micro/bench_new_pages.py --out DIR [--gib 16 --pause 10]

Writes DIR/bench_new_pages.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info, write_json  # noqa: E402


def reserve_and_remove(folder: Path, nbytes: int) -> dict[str, float]:
    path = folder / f"bench-new-pages.{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        t = time.perf_counter()
        os.posix_fallocate(fd, 0, nbytes)
        reserved = time.perf_counter() - t
    finally:
        os.close(fd)
        t = time.perf_counter()
        path.unlink()
        removed = time.perf_counter() - t
    return {"reserve_gbps": nbytes / reserved / 1e9, "remove_gbps": nbytes / removed / 1e9}


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--out", required=True)
    a.add_argument("--gib", type=float, default=16.0)
    a.add_argument("--pause", type=float, default=10.0)
    a.add_argument("--folder", default="/dev/shm")
    args = a.parse_args()
    nbytes = int(args.gib * (1 << 30))
    runs: dict[str, dict[str, float]] = {}
    for name, pause in (("fresh", 0.0), ("again", 0.0), ("after_pause", args.pause), ("again_2", 0.0)):
        time.sleep(pause)
        runs[name] = reserve_and_remove(Path(args.folder), nbytes)
        r = runs[name]
        print(f"{name:12s} reserved {r['reserve_gbps']:6.2f} GB/s, removed {r['remove_gbps']:6.2f} GB/s")
    drivers = Path("/sys/bus/virtio/drivers")
    result = {
        "command": command_info(),
        "bytes": nbytes,
        "pause_s": args.pause,
        "kernel": os.uname().release,
        "virtio_drivers": sorted(p.name for p in drivers.iterdir()) if drivers.is_dir() else [],
        "runs": runs,
    }
    write_json(Path(args.out) / "bench_new_pages.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
