"""Received replica files checked, then placed (replica_transfer.py moves them): each temporary against its
manifest entry (size and every tensor's checksum), several files at once (the engine's checks run without
the GIL), and renamed to its name only once every file passed. `Checks` starts each file's check as soon as
its last byte has landed (a link's `landed` callback), beside the rest of the transfer; `check_and_place`
checks them all after it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .. import trust
from ..checkpoint.checksums import file_block_checksums, file_checksums
from .replica_transfer import Transfer

THREADS = 8  # files checked at once (each check also spreads over the engine's parser threads)
RUN = 256 << 20  # bytes: a larger file is checked in runs of about this many bytes, up to CALLERS at once
CALLERS = 8  # (an optimizer state's file is most of a rank's bytes, and lands last)


class Checks:
    """The checks of `recvs`, started as their files land (`landed`, from any thread) or, for those that did
    not, at `place`. A context manager: on the way out no check is left running on the temporaries."""

    def __init__(self, engine: Any, recvs: list[Transfer], entry_of: Callable[[Transfer], dict[str, Any]]):
        self.engine, self.recvs, self.entry_of = engine, recvs, entry_of
        self._pool = ThreadPoolExecutor(max(1, min(THREADS, len(recvs))), "datastates-replica-check")
        self._started: dict[int, Future] = {}  # by id(transfer)
        self._lock = threading.Lock()

    def landed(self, t: Transfer) -> None:
        """Every byte of `t` is in its temporary: its check starts now."""
        with self._lock:
            if id(t) not in self._started:
                self._started[id(t)] = self._pool.submit(_check, self.engine, t, self.entry_of(t))

    def place(self) -> None:
        """Waits for every file's check (those not started, started now), then renames each temporary to its
        name (no link followed); ChecksumError, FormatError or OSError naming the first file (in `recvs`'
        order) that fails, and none renamed then."""
        for t in self.recvs:
            self.landed(t)
        for t in self.recvs:
            self._started[id(t)].result()
        for t in self.recvs:
            assert t.temporary is not None and t.into is not None
            top = t.into.parent  # as the temporary was made: the folder received into is no link either
            trust.rename_in(top, str(t.temporary.relative_to(top)), f"{t.into.name}/{t.rel}")
            t.temporary = None

    def __enter__(self) -> Checks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def check_and_place(
    engine: Any, recvs: list[Transfer], entry_of: Callable[[Transfer], dict[str, Any]]
) -> None:
    """Checks each received temporary against its manifest entry (`entry_of(t)`), several files at once,
    then renames each to its name (see `Checks.place`)."""
    with Checks(engine, recvs, entry_of) as checks:
        checks.place()


def _check(engine: Any, t: Transfer, entry: dict[str, Any]) -> None:
    assert t.temporary is not None
    if t.reservation is not None:  # a file whose memory could not be reserved was dropped: named here
        t.reservation.check()
    doc, top = {"files": {t.rel: entry}}, Path("/")  # the entry's checksums, looked up by its name
    sums = file_checksums(doc, top, top / t.rel)
    callers = max(1, min(CALLERS, t.nbytes // RUN))
    engine.verify(t.temporary, sums, file_block_checksums(doc, top, top / t.rel), callers=callers)
