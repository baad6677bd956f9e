"""The files of a node's first replicas made ahead: on a fresh start, before training's second step, each
replica area (a rank this node keeps replicas of) gets `sets` sets of that rank's files, sized and their
memory reserved (`posix_fallocate`), which its first replicas take over as spares (`MemoryTier.add_warm`)
instead of new pages. New pages are what a replica received while training runs costs most: a tmpfs makes
them one fault at a time, and a VM backs them as first touched (1.1B, dp2 on 2x H200: steps of 170 ms took
0.4-2.9 s while a replica of 7.25 GB was received into new pages). Threads of the trainer make them at its
first step, which pays for them as for the tier's own files (save/memory.py's `prepare_tier`); a replica
process makes them beside training, their faults in its own memory map, not the trainer's."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import trust
from .memory import WARM, MemoryTier
from .replica_reserve import Reservation

THREADS = 8  # files made at once: a tmpfs file's pages are allocated under its own lock


def make_ahead(areas: dict[int, MemoryTier], files: dict[int, list[tuple[str, int]]], sets: int = 2) -> int:
    """Makes `sets` sets of each area's rank's `files` (name in the checkpoint, bytes) as the first spares of
    its area (`areas`: by that rank); returns the bytes made. A set that cannot be made whole is removed and
    the first error raised (an OSError naming the file): its replicas then take new files, as without."""
    for s, fs in files.items():
        for rel, _ in fs:
            trust.relative_name(rel, f"the files of rank {s}'s replicas")
    made, errors = 0, []
    with ThreadPoolExecutor(THREADS, "datastates-replica-ahead") as pool:
        # A set at a time, its files at once (the largest first: they take longest), so that a tier short of
        # room ends with whole sets, never with two halves.
        for s, i in [(s, i) for i in range(sets) for s in areas if files.get(s)]:
            fs = sorted(files[s], key=lambda f: -f[1])
            futures = [
                pool.submit(_make, areas[s].folder, f"{WARM.format(rank=s, i=i)}/{rel}", n) for rel, n in fs
            ]
            failed = [e for f in futures if (e := f.exception()) is not None]
            if failed:
                errors += failed
                areas[s].remove_warm(i)
                continue
            areas[s].add_warm(i, [rel for rel, _ in files[s]])
            made += sum(n for _, n in files[s])
    if errors:
        raise errors[0]
    return made


def _make(root: Path, name: str, nbytes: int) -> None:
    """The new file `root/name` of `nbytes` bytes, its memory reserved as a received file's is (its folders
    made 0700, no link followed); OSError naming it where the memory is not there."""
    parts = trust.name_parts(name, str(root))
    with trust.walk_dir(root, parts[:-1], create=True) as folder:
        fd = os.open(parts[-1], trust.NEW_FILE, 0o600, dir_fd=folder)
    try:
        reservation = Reservation(root / name, nbytes)
        reservation.run(fd, threading.Event())
        reservation.check()
    finally:
        os.close(fd)
