"""A checkpoint from its capture to the committer, in three parts the Saver calls in order:

1. the capture: the optimizer's containers copied (`optimizer_plan.py`) and the state's tensors staged on the
   GPU, nothing more; or, unstaged (or where staging runs out of GPU memory), every file planned and queued
   now, and the next step gated on their snapshot. A checkpoint deferred to the next step is captured on
   the queuer's thread from its request on, beside the forward and backward passes, and the training thread
   only makes sure of it before the optimizer step (`capture_beside`); any other, on the training thread at
   its request (`capture`);
2. `hand_over(job)`, on the training thread once that step is launched: rank 0's commit made (it reads
   Nanotron's counters, which move on after the step), then the rest handed to the queuer's thread;
3. `queue(job)`, on the queuer's thread (`save/queuer.py`): where the files go (the memory tier's checks of
   the files recycled), the optimizer's plan from the values captured, the host values' files, the core's
   call, and the checkpoint handed to the committer, which is told of any failure here: every rank's
   committer then agrees that the checkpoint failed.

What the training thread spends on a staged checkpoint is the request's host values, the check before the
step and the hand-over; the rest runs while it trains (on a GPU-bound step, while it waits on the GPU with
the GIL released).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Callable

import torch

from ...engine import DataStatesEngine
from ...save.commit import Committer
from ...save.gate import SnapshotGate
from ...save.optimizer_plan import OptimizerPlans
from ...save.plan import SavePlan
from ...save.queuer import Queuer
from ...tier.memory import MemoryTier
from .. import log as say
from .rank_files import RankFiles, targets
from .request import Request, add_stall, queuing_failed


class Queuing:
    """The capture, hand-over and queuing of one trainer's checkpoints (see the module's docstring)."""

    def __init__(
        self,
        engine: DataStatesEngine,
        tier: MemoryTier | None,
        optimizer_plans: OptimizerPlans,
        gate: SnapshotGate,
        committer: Committer,
        files: Callable[[], RankFiles],
        notify: Callable[..., None],
    ) -> None:
        self.engine, self.tier, self.optimizer_plans = engine, tier, optimizer_plans
        self.gate, self.committer, self.files, self.notify = gate, committer, files, notify
        self.queuer = Queuer()
        self.out_of_memory = False  # staging ran out of GPU memory (the Saver decides again)
        # Seconds the optimizer step waits at most for a capture on the queuer's thread (milliseconds of
        # work): past them the checkpoint fails, named, and training goes on (a stuck thread, say)
        self.capture_timeout = 600.0
        self.keep_staging = False  # the staging's GPU memory kept for the next checkpoint (staging.keep)

    def capture(self, job: Request, stage: bool) -> None:
        """Part 1, on the training thread."""
        t0 = time.perf_counter()
        if self._stage(job, stage, None) and job.staged is None:
            self._queue_now(job)
        job.captured = time.perf_counter() - t0
        job.seconds += job.captured

    def capture_beside(self, job: Request, stage: bool) -> Callable[[], None]:
        """Part 1 of a checkpoint deferred to the next step, on the queuer's thread from now on, beside the
        next forward and backward passes (which change neither the weights nor the optimizer's state); the
        staging copies go to the training thread's current stream, in order after the step just taken.
        Returns what the training thread runs before the optimizer step: the wait for it (done long before,
        as a rule), then, where staging found no room on the GPU, the files queued now, as `capture` does."""
        done = threading.Event()
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        staged = [False]

        def work() -> None:
            t0 = time.perf_counter()
            try:
                staged[0] = self._stage(job, stage, stream)
            finally:
                job.background += time.perf_counter() - t0
                done.set()

        def before_step() -> None:
            t0 = time.perf_counter()
            if not done.wait(self.capture_timeout):
                waited = f"{self.capture_timeout:g} s"
                why = f"its state was not captured within {waited} (the queuer's thread is busy)"
                queuing_failed(job.pending, TimeoutError(why))
            elif staged[0] and job.staged is None:
                self._queue_now(job)
            job.captured = time.perf_counter() - t0
            job.seconds += job.captured

        self.queuer.submit(work)
        return before_step

    def _stage(self, job: Request, stage: bool, stream: torch.cuda.Stream | None) -> bool:
        """The optimizer's containers copied and, where `stage`, the state's tensors staged (on `stream`, if
        given); False where this failed (reported as the checkpoint's error)."""
        self.notify("queue_start", step=job.pending.step, deferred=job.deferred)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                files = self.files()
                job.files = list(files.weights)
                if files.optimizer is not None:  # the same tensors each time, the learning rate of the time
                    plan, frozen = self.optimizer_plans.for_checkpoint(stage and job.deferred)
                    if frozen is not None:  # planned once the step is launched (`queue`)
                        job.replan = (len(job.files), frozen)
                    job.files.append((files.optimizer, plan))
                if stage:
                    try:
                        plans = [plan for _, plan in job.files]
                        job.staged = self.engine.stage(plans, keep=self.keep_staging)
                    except torch.cuda.OutOfMemoryError:
                        self.out_of_memory = True
                        self.engine.release_staging()
                        say.info(
                            "out of GPU memory copying a checkpoint on the GPU: copied from the state itself"
                        )
        except Exception as e:
            queuing_failed(job.pending, e)
            return False
        return True

    def _queue_now(self, job: Request) -> None:
        """An unstaged checkpoint queued on the training thread, the request's files first; the next step
        waits for their snapshots."""
        pending = job.pending
        try:
            self.queuer.drain()  # the tier's files to recycle are drawn on one thread at a time
            if job.replan is not None:  # planned now, before the step
                index, plan = self._plan_left(job)
                job.files[index] = (job.files[index][0], plan)
            self._queue_later(job)
            paths, mirrors, recycle = targets(self.tier, pending, job.files)
            state = self.engine.save_plans(paths, mirrors=mirrors, recycle=recycle)
            job.handles += state
            self.gate.add(state, on_wait=functools.partial(add_stall, pending))
        except Exception as e:
            queuing_failed(pending, e)

    def hand_over(self, job: Request) -> None:
        """Part 2, on the training thread once the step is launched; a checkpoint not staged, or one not
        deferred to the step, is queued here and now."""
        t0 = time.perf_counter()
        try:
            if job.finalizer is not None:
                job.pending.finalize, job.finalizer = job.finalizer(), None
        except Exception as e:
            queuing_failed(job.pending, e)
        job.seconds += time.perf_counter() - t0
        if job.staged is not None and job.deferred:
            self.queuer.submit(functools.partial(self.queue, job))
        else:
            self.queue(job)

    def queue(self, job: Request) -> None:
        """Part 3: queues what the capture left, then hands the checkpoint to the committer."""
        t0 = time.perf_counter()
        pending = job.pending
        background = job.staged is not None and job.deferred
        try:
            self._queue_later(job)
            if job.staged is not None:
                staged, job.staged = job.staged, None
                paths, mirrors, recycle = targets(self.tier, pending, job.files)
                staged.target([path for _, path in paths], mirrors=mirrors, recycle=recycle)
                if job.replan is not None:  # the optimizer's plan, from its state as it was before the step
                    staged.replan(*self._plan_left(job))
                # Staged: its handles' snapshots are there already, no step waits for them
                job.handles += staged.queue()
        except Exception as e:
            queuing_failed(pending, e)
        pending.handles = job.handles
        if background:
            job.background += time.perf_counter() - t0
        else:
            job.seconds += time.perf_counter() - t0
        if job.deferred:  # the next step's share of the checkpoint's time on the training thread
            pending.queued_s = job.seconds
        self.notify(
            "queued",
            step=pending.step,
            deferred=job.deferred,
            seconds=job.seconds,
            captured=job.captured,
            background=job.background,
        )
        self.committer.submit(pending)

    def _plan_left(self, job: Request) -> tuple[int, SavePlan]:
        """The optimizer's plan that the capture left for later, made now from the copy taken before the
        step: (its index among the checkpoint's state files, the plan)."""
        assert job.replan is not None
        index, frozen = job.replan
        job.replan = None
        return index, self.optimizer_plans.replan_held(frozen)

    def _queue_later(self, job: Request) -> None:
        """The request's host values (scheduler, random states), once: read as they are and never waited for
        by a step; queued before the state's files, so that a cache smaller than the checkpoint takes them
        before the state's pieces."""
        later, job.later = job.later, []
        if later:
            plans = [(path, self.engine.plan(value)) for path, value in later]
            paths, mirrors, recycle = targets(self.tier, job.pending, plans)
            job.handles += self.engine.save_plans(paths, mirrors=mirrors, recycle=recycle)

    def drain(self, timeout: float | None = None) -> None:
        """Waits until every checkpoint handed over is with the committer."""
        self.queuer.drain(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.queuer.close(timeout)
