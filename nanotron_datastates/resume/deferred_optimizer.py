"""The optimizer state of a resume, loaded last: the first forward and backward passes need the weights only,
so the optimizer shard read ahead (read_ahead.py) goes on reading while they run, and is loaded just before
the first optimizer step, the save mirrored (DataStates-LLM's observation: neither pass touches the
optimizer).

Anything else that reads the optimizer's state first (`state_dict`: a checkpoint, a user's inspection) loads
it too, so no caller sees the state from before the resume. Imports no Nanotron: the caller passes the log
function (the adapter's, which logs through Nanotron's logger).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


class DeferredOptimizer:
    """Loads into `optimizer` the state `read()` returns (read once: `read` may be called early, to know the
    state is whole), at `load()`: before the first `step`, or before the first `state_dict` (wrapped on this
    instance; its class is untouched). A load that raises stays pending: the next call tries again, and no
    step ever runs on the state from before the resume. `say` logs the line that reports the load."""

    def __init__(
        self,
        optimizer: Any,  # Nanotron's (untyped; its `state_dict` is wrapped on the instance)
        read: Callable[[], object],
        map_location: str | torch.device,
        say: Callable[[str], None],
    ) -> None:
        self._optimizer, self._read, self._map_location, self._say = optimizer, read, map_location, say
        self._state: object = None
        self.pending = True
        self._lock = threading.RLock()
        original = optimizer.state_dict

        @functools.wraps(original)
        def state_dict(*args: object, **kwargs: object) -> object:
            self.load()
            return original(*args, **kwargs)

        optimizer.state_dict = state_dict

    def read(self) -> object:
        """The state (waits for the read; raises what reading raises)."""
        if self._state is None:
            self._state = self._read()
        return self._state

    def cancel(self) -> None:
        """Never loads (the resume fell back to another checkpoint); its state goes back."""
        with self._lock:
            self.pending, self._state = False, None

    def load(self) -> None:
        with self._lock:
            if not self.pending:
                return
            self.pending = False  # loading calls state_dict, which comes back here
            t0 = time.perf_counter()
            try:
                self._optimizer.load_state_dict(self.read(), map_location=self._map_location)
            except BaseException:
                self.pending = True
                raise
            self._state = None
            self._say(f"optimizer state loaded at its first use ({time.perf_counter() - t0:.2f} s)")
