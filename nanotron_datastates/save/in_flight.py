"""The saves an engine has in flight: the engine-wide waits, the errors no wait has reported yet, and the
telemetry line each save writes once done."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from .. import telemetry
from .handle import SaveHandle

log = logging.getLogger("nanotron_datastates")


class InFlight:
    """Handles, oldest first, kept until persisted, reported (if failed) and logged (if telemetry is on).

    `cache_stats(reset)` is the core's: its counters go on the first telemetry line of each batch.
    """

    def __init__(self, telemetry_path: str | None, cache_stats: Callable[[bool], dict[str, int]]) -> None:
        self._telemetry_path = telemetry_path
        self._cache_stats = cache_stats
        self._lock = threading.Lock()
        self._handles: collections.deque[SaveHandle] = collections.deque()

    def add(self, handles: list[SaveHandle]) -> None:
        with self._lock:
            self._log()
            self._prune()
            self._handles.extend(handles)

    def wait(self, what: str, timeout: float | None) -> None:
        """Waits for every handle's `what` ('snapshot' or 'persisted'); raises the first error not yet
        reported (the others stay for the next wait, or :meth:`close`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles = list(self._handles)
        for h in handles:  # one at a time, so that a timeout names the save
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            wait = h._job.wait_snapshot if what == "snapshot" else h._job.wait_persisted
            if not wait(left):
                raise TimeoutError(f"{what} of {h.path} not done within {timeout} s")
            h._keepalive = None
        with self._lock:
            failed = next((h for h in self._handles if h._job.failed() and not h._reported), None)
            self._log()
            self._prune()
        if failed is not None:
            failed._raise()

    def log_remaining(self) -> None:
        """Waits for every save to end and writes their telemetry lines: before the core closes, while the
        cache's statistics are still there."""
        if not self._telemetry_path:
            return
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h._job.wait_persisted(-1.0)
        with self._lock:
            self._log()

    def close(self) -> None:
        """Forgets every handle; raises the first error that no wait has reported (the others are logged),
        so that no failure goes unnoticed."""
        with self._lock:
            pending = [h for h in self._handles if not h._reported and h._job.failed()]
            self._handles.clear()
        if pending:
            for h in pending[1:]:
                log.error("checkpoint save failed: %s", h.exception())
            pending[0]._raise()

    def _prune(self) -> None:
        # Drop handles that are persisted and have nothing left to report (oldest first).
        while (
            self._handles
            and self._handles[0].done()
            and (self._handles[0]._reported or not self._handles[0]._job.failed())
            and (self._handles[0]._logged or not self._telemetry_path)
        ):
            self._handles.popleft()

    def _log(self) -> None:
        """Writes the telemetry lines of the saves done since the last call."""
        if not self._telemetry_path:
            return
        done = [h for h in self._handles if not h._logged and h.done()]
        if not done:
            return
        cache = self._cache_stats(True)
        lines = []
        for h in done:
            h._logged = True
            s, err = h.stats, h.exception()
            persisted = s["persisted_s"] or 0.0
            line = telemetry.record(
                step=None,
                where=h.path,
                committed=err is None,
                errors=[str(err)] if err else [],
                nbytes=s["file_bytes"],
                files=1,
                stall_s=h._stall_s,
                snapshot_s=s["snapshot_s"] or 0.0,
                persisted_s=persisted,
                committed_s=persisted,
                cache=cache,
            )
            lines.append(line)
            cache = {}  # counted on the first line of the batch
        telemetry.append(self._telemetry_path, lines)
