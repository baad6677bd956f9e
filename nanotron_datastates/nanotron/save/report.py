"""What follows each checkpoint's outcome, on the committer's thread: the step marked held in the memory tier
(a memory checkpoint's manifest and training metadata written beside its files first) and handed to the
replicator, rank 0's housekeeping and telemetry (housekeeping.py), the log line, and the observers
(`observer(event, fields)`, for benchmarks and logs); then each replication's, on the replicator's
thread."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ... import telemetry
from ...engine import DataStatesEngine
from ...save import housekeeping
from ...save.commit import CommitResult
from ...tier.memory import MemoryTier
from ...tier.memory_steps import keep_documents
from ...tier.replica_process import ReplicaProcess
from ...tier.replicas import Replicated, Replicator, describe
from ...trainer_settings import TrainerSettings
from .. import groups
from .. import log as say

if TYPE_CHECKING:
    from ..types import Documents, ParallelContext

Notify = Callable[..., None]  # notify(event, **fields): tells a Saver's observers


class Reporter:
    """Reports a Saver's outcomes. `tier` and `replicator` (set once made: it reports here too) are the
    Saver's, None without them."""

    def __init__(
        self,
        engine: DataStatesEngine,
        settings: TrainerSettings,
        pc: ParallelContext,
        checkpoints: Path,
        tier: MemoryTier | None,
        notify: Notify,
    ) -> None:
        self.engine, self.settings, self.pc, self.checkpoints = engine, settings, pc, checkpoints
        self.tier, self.notify = tier, notify
        self.replicator: Replicator | ReplicaProcess | None = None
        # A memory checkpoint's documents (manifest, metadata) by step, made from every rank's files
        self.documents: dict[int, Documents] = {}

    def committed(self, r: CommitResult) -> None:
        """On the committer thread, for every checkpoint: the memory tier's mark, rank 0's housekeeping and
        telemetry, the log line, the observers."""
        documents = self.documents.pop(r.step, None) if r.memory else None
        if self.tier is not None and r.committed:
            held = r.mirrored
            try:
                if documents is not None:  # before the mark: a step marked held has them
                    keep_documents(self.tier, r.step, documents(r.entries))
                self.tier.commit(r.step, r.mirrored)
                self.engine.keep_mirrors()  # the dropped files' memory goes back
            except OSError as e:  # a restart then reads storage
                held = {}
                say.error(f"memory tier, after checkpoint {r.step}: {e!r}", every_rank=True)
            if self.replicator is not None:  # every rank, every committed step: the replication is collective
                self.replicator.submit(r.step, held)
        if groups.rank(self.pc.world_pg) == 0:
            try:
                cache = self.engine.cache_stats(reset=True) if self.settings.telemetry else {}
                housekeeping.after_commit(r, self.checkpoints, self.settings, cache)
            except Exception as e:  # never fatal: the checkpoint itself is committed (or reported failed)
                say.error(f"after checkpoint {r.step}: {e!r}")
        if r.committed:
            say.info(("in memory only: " if r.memory else "") + housekeeping.describe(r))
        else:
            listed = "".join(f"\n  {e}" for e in r.errors)
            say.error(f"checkpoint {r.step} NOT committed, {len(r.errors)} error(s):{listed}")
        self.notify("committed", result=r)

    def replicated(self, r: Replicated) -> None:
        """On the replicator's thread, per checkpoint replicated (or not): the log line, the observers."""
        if r.error:
            say.error(describe(r), every_rank=True)
        else:
            say.info(describe(r))
        if r.job is not None and self.settings.telemetry and groups.rank(self.pc.world_pg) == 0:
            try:
                housekeeping.append_telemetry(self.checkpoints, telemetry.replication(r.step, r.job))
            except OSError as e:
                say.error(f"telemetry of checkpoint {r.step}'s memory replicas: {e!r}")
        self.notify("replicated", result=r)
