"""Resume, the optimizer state loaded last: the first forward and backward passes need the weights only, so
the optimizer shard read ahead (prefetch.py) goes on reading while they run, and is loaded just before the
first optimizer step, the save mirrored (DataStates-LLM's observation: neither pass touches the optimizer).

Anything else that reads the optimizer's state first (`state_dict`: a checkpoint, a user's inspection) loads
it too, so no caller sees the state before the resume.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

WRAPPED = ("step", "state_dict")


class DeferredLoad:
    """Runs `load` once, before the first call of `optimizer.step` or `optimizer.state_dict` (wrapped on this
    instance; its class is untouched). A load that raises stays pending: the next call tries again, and no
    step ever runs on the state from before the resume."""

    def __init__(self, optimizer: Any, load: Callable[[], None]) -> None:
        self._load: Callable[[], None] | None = load
        self._lock = threading.RLock()
        self._loading = False  # the load itself may call state_dict (reentrant: it must not recurse)
        for name in WRAPPED:
            setattr(optimizer, name, self._before(getattr(optimizer, name)))

    @property
    def pending(self) -> bool:
        return self._load is not None

    def complete(self) -> None:
        """Loads now if not yet done (waiting for the read); raises what the load raises."""
        with self._lock:
            if self._load is None or self._loading:
                return
            self._loading = True
            try:
                self._load()
                self._load = None
            finally:
                self._loading = False

    def _before(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._load is not None:
                self.complete()
            return original(*args, **kwargs)

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call
