"""The NCCL calls of replicas sent while training runs, queued by the training thread at each optimizer step
(`StepOrder`), in the same place of the step's sequence of collectives on every rank.

Kernels of two NCCL communicators on one GPU wait on each other where the ranks queue them in different
orders: a replica's send queued before the step's all-reduce on one rank and after it on its peer holds
both (CUDA_DEVICE_MAX_CONNECTIONS=1, which Nanotron asks for, runs every stream on one queue). So the
replicas' thread prepares each wave of a transfer (its copies) and hands over the call that queues its NCCL
send and receive (`submit`); at each optimizer step, once the step is launched, every rank's training thread
agrees with the others on how many calls all of them have ready (one gloo all-reduce) and makes those, in
order (`at_step`). After the last step (`finish`, every rank at the end of training, before it waits for the
replicas) nothing of training's is queued any more: calls are made by the replicas' thread as they come.
"""

from __future__ import annotations

import collections
import functools
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_T = TypeVar("_T")


class StepOrder:
    """Calls made by the training thread at the optimizer steps, in order, the same on every rank. `group`:
    a gloo group over every rank, used by the training thread only. Collective: every rank calls `at_step`
    at each optimizer step and `finish` once, at the same point."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._ready: collections.deque[Callable[[], None]] = collections.deque()  # each call with its future
        self._lock = threading.Lock()
        # Held while a call is made: a communicator takes one thread's calls at a time, and after the last
        # step the replicas' thread's calls wait for those `finish` makes, which are older.
        self._making = threading.Lock()
        self._direct = False
        self.steps = 0  # optimizer steps seen
        self.made = 0  # calls made

    def submit(self, call: Callable[[], _T]) -> Future[_T]:
        """From the replicas' thread: `call` (it queues NCCL calls) made at the next step at which every rank
        has its own counterpart ready, or now after `finish`; the future holds its result or exception."""
        done: Future[_T] = Future()
        with self._lock:
            if not self._direct:
                self._ready.append(functools.partial(_make, call, done))
                return done
        with self._making:
            _make(call, done)
            self.made += 1
        return done

    def at_step(self) -> int:
        """The training thread, once each optimizer step is launched: makes the calls every rank has ready,
        oldest first; returns how many."""
        self.steps += 1
        with self._lock:
            mine = len(self._ready)
        count = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group)
        n = int(count.item())
        with self._making:
            for _ in range(n):
                with self._lock:
                    make = self._ready.popleft()
                make()
            self.made += n
        return n

    def finish(self) -> None:
        """After the last optimizer step (every rank at once): from now on the replicas' thread makes its
        calls itself; those ready are made now, in order, before any it hands over from now on."""
        with self._making:
            with self._lock:
                self._direct = True
                ready, self._ready = list(self._ready), collections.deque()
            for make in ready:
                make()
            self.made += len(ready)


def _make(call: Callable[[], _T], done: Future[_T]) -> None:
    try:
        done.set_result(call())
    except Exception as e:  # noqa: BLE001 - handed to the replicas' thread, which reports it
        done.set_exception(e)
