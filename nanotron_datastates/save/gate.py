"""The snapshot gate: an optimizer's `step` waits until every tensor of the checkpoints just queued has been
captured (the engine's first future), and nothing else waits. Forward and backward passes never mutate the
parameters or the optimizer state, so the copies overlap them (DataStates-LLM's observation).

For the same reason, a checkpoint's state may be captured as late as the start of the next step (`defer`):
work deferred there runs before the wait (the Saver's: making sure that the capture its queuer ran beside
the forward and backward passes is done). What needs no capture (queuing copies already made) waits until
the step is launched (`defer(..., after=...)`, run by `run_after`), beside the step's own work on the
GPU."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from .handle import SaveHandle


class SnapshotGate:
    def __init__(self) -> None:
        self._pending: list[tuple[list[SaveHandle], Callable[[float], None] | None]] = []
        self._deferred: list[Callable[[], None]] = []
        self._after: list[Callable[[], None]] = []

    def defer(self, work: Callable[[], None], after: Callable[[], None] | None = None) -> None:
        """`work` runs at the start of the next step (or at :meth:`run_deferred`), before the wait: it may
        `add` handles, which that step then waits for. `after` runs once that step is launched
        (:meth:`run_after`), or right after `work` where :meth:`run_deferred` runs it."""
        self._deferred.append(work)
        if after is not None:
            self._after.append(after)

    @property
    def deferred(self) -> int:
        """How many pieces of work wait for the next step (before it, and once it is launched)."""
        return len(self._deferred) + len(self._after)

    def run_deferred(self) -> None:
        """Runs the deferred work now, oldest first, then the work for after the step; each piece once, even
        if it raises."""
        self._run_before()
        self.run_after()

    def run_after(self) -> None:
        """Runs the work deferred to after the step, oldest first; each piece once, even if it raises."""
        while self._after:
            self._after.pop(0)()

    def _run_before(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def add(self, handles: Iterable[SaveHandle], on_wait: Callable[[float], None] | None = None) -> None:
        """Handles of a checkpoint just queued; `on_wait(seconds)` is told how long the next step waited for
        it (and for any older one still pending)."""
        self._pending.append((list(handles), on_wait))

    def wait(self) -> float:
        """Runs the deferred work, then waits for every snapshot added since the last wait; returns the
        seconds spent waiting."""
        self._run_before()
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        for handles, _ in self._pending:
            for h in handles:
                # A failed save no longer reads its tensors either; its error is reported when persisted.
                with contextlib.suppress(Exception):
                    h.wait_snapshot()
        waited = time.perf_counter() - t0
        on_wait = self._pending[-1][1]  # the wait is the newest checkpoint's stall
        if on_wait is not None:
            on_wait(waited)
        self._pending.clear()
        return waited
