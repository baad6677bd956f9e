"""Saving: each checkpoint the trainer asks for, from the request to its outcome. The CheckpointManager
(manager.py) calls:

0. `start()`, once, when the trainer is built: the weights' files are planned (once, with Nanotron's names and
   tensor metadata) and the host cache chunks they fill are pinned in the background, while Nanotron builds
   its data loader: pinning holds the CUDA driver's locks, and a training step would wait on them.
1. `after_first_step()`, once: the optimizer's file is planned (its state exists from the first step on;
   each checkpoint then plans it like the last, checking its tensors once), the rest of the chunks one
   checkpoint fills are pinned in the background, and where checkpoints will be staged on the GPU, what the
   first staging would pay once is paid now (`staging.warm`).
2. `request(step, lr_scheduler, random_states, finalizer)` in `save_checkpoint`: backpressure first (at
   most MAX_IN_FLIGHT checkpoints in flight: a new one waits for the oldest), then what the next forward and
   backward passes change (random states, the schedule's state) is copied now; staging is decided once for
   the whole checkpoint (`staging.decide`). A staged checkpoint's state is staged by a thread of the saver's
   own, beside the next forward and backward passes (`queue_at_step`), made sure of at the start of the
   next optimizer step, and queued on that thread once that step is launched (where the optimizer's plan
   is made, from a copy of its state's containers taken before the step); any other is planned and queued
   now (its copies must overlap the forward and backward passes). queuing.py has the three parts: capture,
   hand-over, queuing.
3. `before_step()` at every optimizer step: the capture left for it, then the wait for the snapshots of the
   checkpoints just queued (gate.py). Nothing else ever waits. `after_step()` once the step is launched:
   what was captured before it handed over, queued and given to the committer.
4. `take(count)` at the next request and `drain()` at the end: the outcomes (commit.py), in order, the same
   on every rank; post-save hooks run for those committed; a failed one raises CheckpointError.

With `memory_tier`, each file's copy in node-local shared memory is the save's host memory (in place of host
cache chunks), marked held once committed (tier/memory.py), and with `memory_replicas` sent to ranks of other
nodes (replicas.py); a memory checkpoint (`memory_due`) goes there only (tier/memory_steps.py).

`observers` are told of each queuing and commit (`observer(event, fields)`), for benchmarks and logs.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...engine import DataStatesEngine
from ...save import staging
from ...save.commit import CheckpointError, CommitResult, Committer, PendingCheckpoint
from ...save.gate import SnapshotGate
from ...save.optimizer_plan import OptimizerPlans
from ...save.plan import SavePlan
from ...store import open_store
from ...trainer_settings import TrainerSettings
from .. import groups
from .. import log as say
from . import memory
from .queuing import Queuing
from .rank_files import RankFiles, cache_bytes, plan_files
from .report import Reporter
from .request import Request, host_values

if TYPE_CHECKING:
    from ..types import (
        BaseOptimizer,
        Documents,
        FileEntries,
        LRScheduler,
        NanotronModel,
        ParallelContext,
        RandomStates,
    )

__all__ = [
    "MAX_IN_FLIGHT",
    "CheckpointError",
    "CommitResult",
    "Observer",
    "PendingCheckpoint",
    "RankFiles",
    "Saver",
]

MAX_IN_FLIGHT = 2  # checkpoints being flushed at once; a third waits for the oldest
Observer = Callable[[str, dict[str, object]], None]


class Saver:
    """One trainer's checkpoints into `checkpoints` (Nanotron's `checkpoints_path`). Collective: every rank
    constructs its Saver at the same point (its committer's gloo group is made here)."""

    def __init__(
        self,
        engine: DataStatesEngine,
        settings: TrainerSettings,
        pc: ParallelContext,
        model: NanotronModel,
        optimizer: BaseOptimizer,
        checkpoints: Path,
    ) -> None:
        import torch.distributed as tdist

        self.engine, self.settings, self.pc = engine, settings, pc
        self.model, self.optimizer, self.checkpoints = model, optimizer, Path(checkpoints)
        self.store = open_store(self.checkpoints)  # the checkpoints folder's storage (store/)
        # The rank that commits holds the folder's writer lock for the job's life: a second job fails here.
        self.writer = self.store.writer_lock() if groups.rank(pc.world_pg) == 0 else None
        # A gloo group of its own: the committer's collectives run on a background thread, off the GPU.
        group = tdist.new_group(backend="gloo") if tdist.is_initialized() else None
        # Another where memory checkpoints are on: which ones all ranks skip is agreed there (memory_pace.py);
        # a world of one agrees with nobody (no all-reduce at each memory checkpoint)
        paced = group is not None and settings.memory_interval > 0 and tdist.get_world_size() > 1
        self.pace_group = tdist.new_group(backend="gloo") if paced else None
        self.gate = SnapshotGate()
        self.observers: list[Observer] = []
        self.outstanding = 0  # checkpoints asked for and not taken yet
        self.last_step: int | None = None  # the step of the last checkpoint to storage asked for
        self.memory_step: int | None = None  # the step of the last memory checkpoint asked for
        self.memory_skipped: list[int] = []  # memory checkpoints due while two were in flight (memory_pace)
        self._files: RankFiles | None = None
        self._nbytes: int | None = None  # this rank's weight and optimizer files, known from the first step
        self.optimizer_plans = OptimizerPlans(engine, optimizer)
        self._staged: bool | None = None  # the last checkpoint's decision, logged when it changes
        self.tier, keep = memory.open_tier(settings, self.checkpoints)
        self.reporter = Reporter(engine, settings, pc, self.checkpoints, self.tier, self._notify)
        replication = memory.open_replicas(self.tier, settings, pc, engine, keep, self.reporter.replicated)
        self.reporter.replicator = replication.replicator  # sends each committed step
        self.replication = replication  # its NCCL calls made at each optimizer step (step_order.py), if any
        self.placement = replication.placement  # recorded in each manifest
        self.committer = Committer(group, on_result=self.reporter.committed)
        self.queuing = Queuing(
            engine, self.tier, self.optimizer_plans, self.gate, self.committer, self.files, self._notify
        )
        self.queuing.keep_staging = staging.keep(settings.memory_interval)

    # -- 0. when the trainer is built ------------------------------------------------------------------------

    def start(self) -> None:
        """Plans the weights' files and pins the cache chunks they fill, in the background."""
        self._prepare_cache([plan for _, plan in self.files().weights])

    def _prepare_cache(self, plans: list[SavePlan]) -> None:
        # Pinning stalls other CUDA calls (H100: 8 GiB pinned at start, the first step 0.97 -> 2.99 s): only
        # the chunks one checkpoint fills. With the memory tier, its files take the bytes instead.
        if self.tier is None:
            self.engine.prepare_cache(wait=False, nbytes=cache_bytes(self.engine, plans))

    # -- 1. after the first step ----------------------------------------------------------------------------

    def after_first_step(self) -> None:
        """Plans the optimizer's file and prepares the cache (and the staging) for the first checkpoint."""
        files = self.files()  # first: which part of the optimizer's state this rank writes
        optimizer = self.optimizer_plans.first()
        plans = [plan for _, plan in files.weights] + ([optimizer] if files.optimizer else [])
        self._nbytes = sum(p.nbytes for p in plans)
        self._prepare_cache(plans)
        if self.tier is not None:  # its room; the files of its first checkpoints and replicas made ahead
            state = files.weights + ([(files.optimizer, optimizer)] if files.optimizer else [])
            named = [(str(p), plan) for p, plan in state]
            memory.prepare_tier(self.tier, self.engine, self.settings, named)
            memory.prepare_replicas(self.replication, self.tier, named, self.pc)  # collective
        if self._decide()[0]:
            staging.warm(plans)

    def files(self) -> RankFiles:
        """This rank's files: the same files and weight tensors at every checkpoint, so planned once."""
        if self._files is None:
            balance = self.settings.balance_writes
            self._files = plan_files(self.engine, self.model, self.optimizer, self.pc, balance)
            self.optimizer_plans.part = self._files.optimizer_part
        return self._files

    # -- 2. a checkpoint asked for --------------------------------------------------------------------------

    def request(
        self,
        step: int,
        lr_scheduler: LRScheduler,
        random_states: RandomStates,
        finalizer: Callable[[], Callable[[FileEntries], None]] | None,
        since: float | None = None,
        memory: Documents | None = None,
    ) -> None:
        """Captures and queues (now or at the next step) the checkpoint of `step`. `finalizer`, rank 0's,
        makes the commit that runs once every rank's files are persisted: it is called when the files are
        queued, at the latest just after the next optimizer step is launched (Nanotron moves its counters
        and its learning rate on only after that). The training stall counted for it starts at `since`
        (`time.perf_counter()`; default: now), and includes the next step's wait for its snapshot.
        `memory`: a memory checkpoint (`memory_due`), into the memory tier only; this makes its manifest
        and metadata from every rank's files (commit_files.memory_documents)."""
        t0 = time.perf_counter() if since is None else since
        if memory is not None and self.tier is not None:
            folder, self.memory_step = self.tier.folder / str(step), step
            self.reporter.documents[step] = memory
        else:
            folder, self.last_step = self.store.path(str(step)), step
        later = host_values(self.files(), lr_scheduler, random_states)
        self.outstanding += 1
        stage = self._decide()[0]
        pending = PendingCheckpoint(step, folder, [], memory=memory is not None)
        job = Request(pending, later, finalizer, stage and self.settings.queue_at_step)
        queuing = self.queuing
        if job.deferred:
            before_step = queuing.capture_beside(job, stage)
            self.gate.defer(before_step, after=functools.partial(queuing.hand_over, job))
        else:  # unstaged copies must start now, to overlap the forward and backward passes
            queuing.capture(job, stage)
            queuing.hand_over(job)
        job.pending.stall_s += time.perf_counter() - t0

    def memory_due(self, step: int) -> bool:
        """Whether a memory checkpoint of `step` is due (`memory_interval`), not asked for yet in any form."""
        every, asked = self.settings.memory_interval, (self.last_step, self.memory_step)
        return bool(every) and step > 0 and step % every == 0 and step not in asked

    def _decide(self) -> tuple[bool, str]:
        nbytes = self._nbytes
        if nbytes is None:  # asked for before the first step ended
            nbytes = sum(p.nbytes for _, p in self.files().weights)
            if self.files().optimizer is not None:
                nbytes += self.engine.plan(self.optimizer_plans.state()).nbytes
        stage, why = staging.decide(self.settings.device_snapshot, nbytes, held=self.engine.staging_nbytes)
        if not stage:
            self.engine.release_staging()
        if self.queuing.out_of_memory:  # the last staging found no room: this decision is new
            self.queuing.out_of_memory, self._staged = False, False
        if stage != self._staged:
            self._staged = stage
            say.info(f"checkpoints {'' if stage else 'not '}copied on the GPU first ({why})")
        return stage, why

    # -- 3. every optimizer step ----------------------------------------------------------------------------

    def before_step(self) -> float:
        """Captures what waits for this step, then waits for the snapshots; returns the seconds waited."""
        return self.gate.wait()

    def after_step(self) -> None:
        """Once the step is launched: queues what was captured before it; the replicas' NCCL calls ready."""
        self.gate.run_after()
        if self.replication.order is not None:
            self.replication.order.at_step()

    # -- 4. outcomes ----------------------------------------------------------------------------------------

    def take(self, count: int, on_committed: Callable[[int], None]) -> None:
        """Waits for the outcome of the `count` oldest checkpoints in flight (the same ones on every rank),
        runs `on_committed(step)` for those committed, and raises CheckpointError for one that failed. First
        queues any checkpoint still waiting for a step, even when nothing is waited for."""
        self.gate.run_deferred()
        if count <= 0:
            return
        if count > self.committer.held():  # some are still with the queuer
            self.queuing.drain()
        results = self.committer.take(count)
        self.outstanding -= len(results)
        for r in results:
            if r.committed and not r.memory:  # a memory checkpoint has no post-save hooks (S3 upload)
                on_committed(r.step)
        failed = [r for r in results if not r.committed and not r.memory]  # a memory one is only logged
        if failed:
            r = failed[0]
            raise CheckpointError(
                f"checkpoint {r.step} at {r.folder} was not committed (latest.txt still names the previous "
                "one): " + r.why()
            )

    def backpressure(self, on_committed: Callable[[int], None]) -> None:
        """Before a new checkpoint: the oldest in flight must be done first (identical on every rank)."""
        self.take(self.outstanding - (MAX_IN_FLIGHT - 1), on_committed)

    def drain(self, on_committed: Callable[[int], None]) -> None:
        """At the end of training: every checkpoint committed; this rank's memory tier files dropped."""
        t0 = time.perf_counter()
        self.take(self.outstanding, on_committed)
        say.info(f"all checkpoints committed ({time.perf_counter() - t0:.2f} s waiting at the end)")
        memory.stop_replicas(self.replication)
        memory.release(self.tier, self.replication.sources)

    def close(self) -> None:
        """Bounded (at exit after a crash, other ranks may be gone); idempotent."""
        self.gate.run_deferred()  # a checkpoint asked for after the last step
        try:
            self.queuing.drain(timeout=60)  # milliseconds of work a checkpoint
            self.committer.take(self.outstanding, timeout=600)
        except TimeoutError as e:
            say.error(f"{e}; exiting anyway")
        self.queuing.close(timeout=60)
        self.outstanding = 0
        self.engine.release_staging()  # no checkpoint stages after this
        self.committer.close()
        memory.stop_replicas(self.replication, timeout=60)
        if self.writer is not None:
            self.writer.release()

    def _notify(self, event: str, **fields: object) -> None:
        """Tells the observers of a queuing or an outcome (report.py)."""
        for observe in self.observers:
            observe(event, fields)
