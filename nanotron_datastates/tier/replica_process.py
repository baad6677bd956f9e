"""Memory replicas moved by a process of their own, one a rank (`memory_replica_process`).

A replica moved over gloo by threads of the training process costs the steps beside it far more than the
same replicas moved by other processes (180M dp2: +32% far from any checkpoint, against +7.5% beside two
processes replicating without pause; benchmarks/NOTES.md). Here each rank spawns a process (not a fork of
the trainer) that runs the rank's `Replicator`: the ranks' processes make a gloo world of their own through
the job's store (torchrun's MASTER_ADDR and MASTER_PORT, under a prefix of their own), open the node's tier
by its folder, and check what they receive with an engine of their own on the CPU. The trainer hands each
committed step over a queue and hears back which step is being sent (kept busy in its own tier meanwhile,
never handed to a save to overwrite) and each step replicated, skipped or failed (`on_done`). A process
that dies ends replication, never training: storage and the local tier still hold every checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import multiprocessing
import os
import queue
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union

from ..checkpoint.manifest import Entries
from .memory import MemoryTier
from .replica_transfer import ReplicaError
from .replicas import Ahead, Replicated, keep_for_sending

if TYPE_CHECKING:
    from multiprocessing.queues import Queue as ProcessQueue

START_S = 300.0  # seconds the processes have to meet through the store
ENDED = "the replica process ended"

# The trainer's messages to its replica process (None: the last): a committed step's files to send, or the
# files to make ahead (`make_ahead`)
ToProcess = Union[
    tuple[Literal["submit"], int, Entries],
    tuple[Literal["ahead"], dict[int, list[tuple[str, int]]]],
]
# The process's messages to the trainer: the step being sent, each step replicated (or not), the outcome of
# each `make_ahead`, and its last (why it ended, None: as asked); "died" (its exit code) is the listener's
# own, where the process is gone without a word
FromProcess = Union[
    tuple[Literal["sending"], int],
    tuple[Literal["done"], Replicated],
    tuple[Literal["ahead"], tuple[int, Optional[BaseException]]],
    tuple[Literal["ended"], Optional[str]],
    tuple[Literal["died"], Optional[int]],
]


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What a rank's replica process needs, all of it plain values (it is spawned, not forked)."""

    store: tuple[str, int]  # the job's store (host, port)
    prefix: str  # the processes' keys in it: unique to the job and its restarts
    rank: int
    world: int
    holders: list[list[int]]
    tier: tuple[str, str, int, int]  # the tier's base, checkpoints folder, copies, spares
    gbps: float
    parser_threads: int
    nice: int = 0  # steps below the trainer's priority it runs at: where both want a core, training gets it


class ReplicaProcess:
    """This rank's replicator, in a process of its own: `submit`, `make_ahead` and `close` as `Replicator`'s
    (collective alike: every rank makes one and submits every committed step, in order)."""

    def __init__(self, tier: MemoryTier, spec: ProcessSpec, on_done: Callable[[Replicated], None]) -> None:
        self.tier, self.on_done = tier, on_done
        self.sources = [s for s, hs in enumerate(spec.holders) if spec.rank in hs]
        context = multiprocessing.get_context("spawn")
        self._inbox: ProcessQueue[ToProcess | None] = context.Queue()
        self._outbox: ProcessQueue[FromProcess] = context.Queue()
        self._sending: int | None = None
        # the answers make_ahead waits for
        self._answers: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()
        self._ahead: collections.deque[Ahead | None] = collections.deque()  # each one asked: its `then`
        self._ended = False  # the listener's last message heard: nothing more is answered
        self._lock = threading.Lock()  # over `_ahead` and `_ended`
        self._process = context.Process(
            target=_serve, args=(spec, self._inbox, self._outbox), name="datastates-replicas", daemon=True
        )
        try:
            with _main_hidden():
                self._process.start()
        except AssertionError as e:  # a daemonic multiprocessing child may start none
            raise ReplicaError(
                f"datastates.memory_replica_process=always: this rank cannot start it ({e})"
            ) from None
        self._listener = threading.Thread(target=self._listen, name="datastates-replica-process", daemon=True)
        self._listener.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(self, step: int, files: Entries) -> None:
        """As `Replicator.submit`: `step` kept busy in the tier until sent or skipped."""
        keep_for_sending(self.tier, self._sending, step)
        self._inbox.put(("submit", step, files))

    def make_ahead(
        self, files: dict[int, list[tuple[str, int]]], timeout: float = 600.0, then: Ahead | None = None
    ) -> int:
        """As `Replicator.make_ahead`, by the process (its replica areas are its own). With `then`, returns 0
        at once: the process makes them beside training and before it sends any replica (it takes the
        trainer's messages in order), their pages faulted in its own memory, not the trainer's; `then(bytes
        made, error or None)` is called from another thread once it has."""
        with self._lock:  # asked before the listener's end, or told at once that nothing will answer
            ended = self._ended
            if not ended:
                self._ahead.append(then)
                self._inbox.put(("ahead", files))
        if ended:
            if then is None:
                raise ReplicaError(ENDED)
            then(0, ReplicaError(ENDED))
        if then is not None:
            return 0
        try:
            made, error = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise ReplicaError(f"the replica process made no files ahead in {timeout:.0f} s") from None
        if error is not None:
            raise error
        return made

    def close(self, timeout: float = 600.0) -> None:
        """Waits for the replications queued (bounded), then for the process to end."""
        if self._process.is_alive():
            self._inbox.put(None)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._listener.join(10)

    def _listen(self) -> None:
        while True:
            message: FromProcess
            try:
                message = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                try:  # its last words may have come in meanwhile
                    message = self._outbox.get(timeout=1.0)
                except queue.Empty:
                    message = ("died", self._process.exitcode)
            if message[0] == "sending":
                self._sending = message[1]
            elif message[0] == "ahead":
                with self._lock:
                    self._answered(message[1])
            elif message[0] == "done":
                done = message[1]
                self.tier.busy.discard(done.step)
                if self._sending == done.step:
                    self._sending = None
                self._tell(done)
            else:  # "ended", or "died" with its exit code: nothing is kept busy any more
                kind, value = message
                self._sending = None
                self.tier.busy.clear()
                if kind == "died" or value is not None:
                    why = value if kind == "ended" else f"the replica process ended with code {value}"
                    self._tell(Replicated(-1, 0, 0, 0.0, [], self.sources, f"replication stopped: {why}"))
                with self._lock:
                    self._ended = True
                    while self._ahead:
                        self._answered((0, ReplicaError(ENDED)))
                return

    def _answered(self, value: tuple[int, BaseException | None]) -> None:
        """The answer to the oldest `make_ahead` not answered yet: to its `then`, or to the caller waiting."""
        then = self._ahead.popleft() if self._ahead else None
        if then is None:
            self._answers.put(value)
        else:
            with contextlib.suppress(Exception):
                then(*value)

    def _tell(self, r: Replicated) -> None:
        with contextlib.suppress(Exception):  # the listener goes on whatever the callback does
            self.on_done(r)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """The trainer's main module hidden from a process spawned meanwhile: spawning runs the parent's main
    script again in the child (as `__mp_main__`), which for a training script without a main guard would
    train again; the replica process needs nothing of it."""
    main = sys.modules["__main__"]
    saved: dict[str, object] = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _next(inbox: ProcessQueue[ToProcess | None]) -> ToProcess | None:
    """The trainer's next message; the process ends (within a second) where the trainer is gone: a trainer
    killed by SIGKILL leaves no replica process behind, its received files temporaries, never read. Not
    prctl's parent-death signal: that comes when the thread that started the process ends, not its process."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                os._exit(1)


def _serve(
    spec: ProcessSpec, inbox: ProcessQueue[ToProcess | None], outbox: ProcessQueue[FromProcess]
) -> None:
    """The replica process: the gloo world of the ranks' processes, the rank's replicator, then each message
    of the trainer in turn until None (or the trainer gone)."""
    ended: str | None = None
    try:
        if spec.nice:
            os.nice(spec.nice)
        import torch.distributed as dist

        from ..engine import DataStatesEngine
        from ..engine_settings import DataStatesConfig
        from .links import gloo_link
        from .replicas import Replicator

        host, port = spec.store
        timeout = datetime.timedelta(seconds=START_S)
        store = dist.PrefixStore(spec.prefix, dist.TCPStore(host, port, is_master=False, timeout=timeout))
        dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world, timeout=timeout)
        base, checkpoints, copies, spares = spec.tier
        tier = MemoryTier(base, checkpoints, spec.rank, copies, max_spares=spares)
        threads = spec.parser_threads
        engine = DataStatesEngine(
            DataStatesConfig(host_cache_size=1 / 64, parser_threads=threads, pin_host_cache=False)
        )
        group = dist.new_group(backend="gloo")
        link = gloo_link(group)
        link.name = "gloo-process"  # as the telemetry and the log name it
        replicator = Replicator(
            tier,
            spec.holders,
            group,
            engine,
            spec.gbps,
            on_done=lambda r: outbox.put(("done", r)),
            link=link,
            on_send=lambda step: outbox.put(("sending", step)),
        )
        while (message := _next(inbox)) is not None:
            if message[0] == "submit":
                replicator.submit(*message[1:])
            else:  # "ahead": its outcome told to the trainer, the error included
                replicator.make_ahead(
                    message[1], then=lambda made, error: outbox.put(("ahead", (made, error)))
                )
        replicator.close()
        engine.close()
    except Exception as e:  # noqa: BLE001 - told to the trainer, which logs it
        ended = f"{type(e).__name__}: {e}"
    outbox.put(("ended", ended))
