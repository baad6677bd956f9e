"""The queuer: a thread that finishes queuing checkpoints the training thread has captured.

A checkpoint staged on the GPU needs the training thread only for its request (the host values of that
moment) and a check before the next optimizer step. Its capture (the staging copies and the values the step
changes, beside the forward and backward passes), where its files go (the memory tier's checks of the files
it recycles), the optimizer's plan from the values captured, the host values' plans and the core's call run
here, in the order they were handed over, while the training thread goes on with its steps: on a GPU-bound
step its Python runs while the training thread waits on the GPU with the GIL released.

Each piece of work reports its own failures (the checkpoint's errors); an exception that escapes is logged
and the next piece runs. `drain` waits until everything handed over has run: before the training thread
counts the checkpoints the committer holds, and at the end.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("nanotron_datastates")


class Queuer:
    """One thread, started with the first piece of work, running them in order."""

    def __init__(self, name: str = "datastates-queuer") -> None:
        self._name = name
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._left = 0  # handed over and not finished
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Runs `work` on the queuer's thread, after everything handed over before it."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._left += 1
        self._work.put(work)

    @property
    def idle(self) -> bool:
        """Whether everything handed over has run."""
        with self._cv:
            return self._left == 0

    def drain(self, timeout: float | None = None) -> None:
        """Waits until everything handed over has run; TimeoutError after `timeout` seconds."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._left == 0, timeout):
                raise TimeoutError(f"checkpoints handed to the queuer not queued within {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Runs what is left, then stops the thread. Idempotent."""
        with self._cv:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._work.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            try:
                work()
            except Exception:  # the work reports its checkpoint's failure; this is a last line of defence
                log.exception("queuing a checkpoint failed")
            finally:
                with self._cv:
                    self._left -= 1
                    self._cv.notify_all()
