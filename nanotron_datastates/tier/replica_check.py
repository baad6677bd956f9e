"""Received replica files checked, then placed (replica_transfer.py moves them): each temporary against its
manifest entry (size and every tensor's checksum), several files at once (the engine's checks run without
the GIL), and renamed to its name only once every file passed. `Checks` starts each file's check as soon as
its last byte has landed (a link's `landed` callback), and a large file's runs of tensors as soon as their
bytes have (`arrived`), beside the rest of the transfer; `check_and_place` checks them all after it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import trust
from ..checkpoint.checksums import file_block_checksums, file_checksums
from ..format import header_end
from ..load.verify import FileCheck
from .replica_transfer import Transfer

if TYPE_CHECKING:
    from ..engine import DataStatesEngine

# The manifest entry a received file is checked against
EntryOf = Callable[[Transfer], Mapping[str, object]]

THREADS = 8  # files, or runs of a large file's tensors, checked at once (each over the engine's parsers too)
RUN = 256 << 20  # bytes: a larger file is checked in runs of about this many bytes (an optimizer state's
CALLERS = 8  # file is most of a rank's bytes, and lands last), as they arrive, or up to CALLERS at once


class Checks:
    """The checks of `recvs`, started as their files land (`landed`, from any thread) or, for those that did
    not, at `place`; a large file's runs as their bytes arrive (`arrived`). A context manager: on the way out
    no check is left running on the temporaries."""

    def __init__(self, engine: DataStatesEngine, recvs: list[Transfer], entry_of: EntryOf):
        self.engine, self.recvs, self.entry_of = engine, recvs, entry_of
        self._pool = ThreadPoolExecutor(max(1, min(THREADS, len(recvs))), "datastates-replica-check")
        self._started: dict[int, Future] = {}  # by id(transfer): the file's whole check
        self._arriving: dict[int, _Arriving] = {}  # by id(transfer): a large file's runs started so far
        self._lock = threading.Lock()

    def arrived(self, t: Transfer, n: int) -> None:
        """Bytes [0, n) of `t` are in its temporary: a large file's runs of tensors within them start now."""
        if t.nbytes < 2 * RUN or t.fd is None:
            return
        with self._lock:
            if id(t) not in self._started:
                if id(t) not in self._arriving:
                    self._arriving[id(t)] = _Arriving(self.engine, t, self.entry_of(t), self._pool)
                self._arriving[id(t)].upto(n)

    def landed(self, t: Transfer) -> None:
        """Every byte of `t` is in its temporary: its check (what is left of it) starts now."""
        with self._lock:
            if id(t) not in self._started:
                arriving = self._arriving.pop(id(t), None)
                if arriving is not None:
                    self._started[id(t)] = arriving.landed()
                else:
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

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for arriving in self._arriving.values():  # never landed: the transfer failed
            arriving.close()


def check_and_place(engine: DataStatesEngine, recvs: list[Transfer], entry_of: EntryOf) -> None:
    """Checks each received temporary against its manifest entry (`entry_of(t)`), several files at once,
    then renames each to its name (see `Checks.place`)."""
    with Checks(engine, recvs, entry_of) as checks:
        checks.place()


def _check(engine: DataStatesEngine, t: Transfer, entry: Mapping[str, object]) -> None:
    assert t.temporary is not None
    if t.reservation is not None:  # a file whose memory could not be reserved was dropped: named here
        t.reservation.check()
    sums, blocks = _sums(t, entry)
    engine.verify(t.temporary, sums, blocks, callers=max(1, min(CALLERS, t.nbytes // RUN)))


def _sums(
    t: Transfer, entry: Mapping[str, object]
) -> tuple[dict[str, int] | None, tuple[int, dict[str, list[int]]] | None]:
    """The checksums and block checksums of `t`'s manifest entry."""
    doc, top = {"files": {t.rel: entry}}, Path("/")  # looked up by the file's name
    return file_checksums(doc, top, top / t.rel), file_block_checksums(doc, top, top / t.rel)


class _Arriving:
    """A large file's check while its bytes arrive in order: once its header is in, its tensors cut into
    runs of about RUN bytes (the engine's `check_in_runs`), each checked on `pool` as soon as its bytes are
    in; `landed` starts the rest and gives the future of the whole check."""

    def __init__(
        self, engine: DataStatesEngine, t: Transfer, entry: Mapping[str, object], pool: ThreadPoolExecutor
    ) -> None:
        self.engine, self.t, self.entry, self.pool = engine, t, entry, pool
        self.check: FileCheck | None = None
        self.runs: list[Future] = []

    def upto(self, n: int) -> None:
        t = self.t
        if self.check is None:
            if t.fd is None or t.temporary is None or n < 8 or not t.writable(8):
                return
            end = header_end(t.fd)
            if end is None or n < end or not t.writable(end):
                return  # not in yet, or never readable here: checked whole at `landed`, which names why
            sums, blocks = _sums(t, self.entry)
            self.check = self.engine.check_in_runs(t.temporary, sums, blocks, runs=-(-t.nbytes // RUN))
        check = self.check
        while len(self.runs) < len(check.runs) and check.end(check.runs[len(self.runs)]) <= n:
            self.runs.append(self.pool.submit(check.check, check.runs[len(self.runs)]))

    def landed(self) -> Future:
        """The future of the whole check: every run's, then the block checksums (`finish`)."""
        done: Future = Future()
        try:
            if self.t.reservation is not None:
                self.t.reservation.check()
            self.upto(self.t.nbytes)
        except Exception as e:  # noqa: BLE001 - the file's check fails, naming it
            self.close()
            done.set_exception(e)
            return done
        if self.check is None:  # its header never readable: checked whole, which names why
            return self.pool.submit(_check, self.engine, self.t, self.entry)
        left, lock = [len(self.runs)], threading.Lock()

        def one(_: Future | None = None) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            try:
                for r in self.runs:
                    r.result()
                assert self.check is not None
                self.check.finish()
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - cancelled runs included
                done.set_exception(e)
            finally:
                self.close()

        if not self.runs:
            left[0] = 1
            one()  # no tensors: the block checksums only
        for r in self.runs:
            r.add_done_callback(one)
        return done

    def close(self) -> None:
        if self.check is not None:
            self.check.close()
