"""Where a resume reads from, and what it falls back to.

A restart reads the memory tier's copy of the checkpoint where every rank finds it whole there
(`memory_copy`), else storage, and says why; with memory replicas, where every file each rank reads is in
some node's memory, what its node lacks pulled from another's (tier/replica_restore.py).

It never dies on a damaged newest checkpoint while an older one is whole: after a Resume has loaded
everything (reading every tensor against its checksum), the ranks agree that each read it whole
(`confirm`); where any could not (a file missing, truncated, a flipped byte; the memory tier's copy as much
as storage's), every rank falls back together to the next candidate: the same step from storage where it
came from memory, then each older committed checkpoint of the folder, newest first. The log says which,
and why.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...checkpoint import folder as checkpoint
from ...checkpoint.manifest import ManifestError, is_datastates_checkpoint
from ...engine import DataStatesEngine
from ...errors import CheckpointError, FormatError
from ...resume.reshard_plan import ReshardError
from ...store import open_store
from ...tier.held_copy import tier_copy, why_not
from ...tier.links import open_link
from ...tier.memory import MemoryTier
from ...tier.replica_restore import restart_source
from .. import groups
from .. import log as say

if TYPE_CHECKING:
    from ...tier.peer_reads import PeerReads
    from ...trainer_settings import TrainerSettings
    from ..types import ParallelContext

# What reading a checkpoint raises where a file is missing, damaged (FormatError, ChecksumError) or not of
# the layout, or does not fit the model (ReshardError): collected on each rank, so that every rank decides.
READ_ERRORS = (OSError, FormatError, ManifestError, ReshardError, KeyError)


class Pulling(Protocol):
    """What a pull from other nodes' memory reads of a resume (`Resume` is one): the checkpoint's manifest,
    the files this rank reads and reads ahead, its engine; it sets the files served between GPUs (`peer`)."""

    peer: PeerReads | None

    @property
    def manifest(self) -> Mapping[str, object]: ...

    def needs(self) -> set[str]: ...

    def ahead(self) -> dict[str, list[str]] | None: ...  # the files read ahead onto a GPU, by kind

    def get_engine(self) -> DataStatesEngine: ...


class Reading(Pulling, Protocol):
    """What the fallback reads of a resume (`Resume` is one): the checkpoint it reads, where from, what it
    needs (Pulling's too) and what failed. It never reads anything again itself: the resume does (`confirm`
    has it `reload` each checkpoint of a Plan)."""

    @property
    def folder(self) -> Path | None: ...  # None only before a checkpoint is planned

    @property
    def source(self) -> Path | None: ...  # None: read from `folder` itself

    @property
    def pc(self) -> ParallelContext | None: ...  # None only before a checkpoint is planned

    def failures(self) -> list[str]: ...


def _planned(resume: Reading) -> Path:
    """The checkpoint `resume` reads (the fallback acts only on a planned one)."""
    if resume.folder is None:
        raise RuntimeError("no checkpoint planned to resume from, nothing to fall back from")
    return resume.folder


def _parallel_context(resume: Reading) -> ParallelContext:
    """The process groups of `resume`, planned with its checkpoint."""
    if resume.pc is None:
        raise RuntimeError("no checkpoint planned to resume from, nothing to fall back from")
    return resume.pc


def memory_copy(resume: Reading, settings: TrainerSettings) -> Path | None:
    """The memory tier's copy of `resume`'s checkpoint where every rank finds it whole there, else None (the
    log says which rank lacks it, and why). Collective."""
    if settings.memory_replicas:
        return _memory_of_any_node(resume, settings)
    rank = groups.rank(_parallel_context(resume).world_pg)
    reason = why_not(settings, _planned(resume), resume.manifest, rank)
    reasons = groups.gather(reason, _parallel_context(resume))
    step = resume.manifest.get("step")
    if not any(reasons):
        copy = tier_copy(settings, _planned(resume), resume.manifest, rank)
        say.note(f"resuming step {step} from the memory tier ({copy})")
        return copy
    r, why = next((r, why) for r, why in enumerate(reasons) if why)
    say.note(f"resuming step {step} from storage: the memory tier cannot serve it (rank {r}: {why})")
    return None


def _memory_of_any_node(resume: Reading, settings: TrainerSettings) -> Path | None:
    """`memory_copy` with memory replicas: this rank's node's tier folder of the step once every file each
    rank reads is there (`restart_source` pulls what a node lacks), else None. Collective."""
    import torch.distributed as tdist

    step = resume.manifest.get("step")
    problem, own = None, None
    try:
        rank = groups.rank(_parallel_context(resume).world_pg)
        copies = settings.memory_tier_copies
        own = MemoryTier(settings.memory_tier_path, _planned(resume).parent, rank, copies)
    except OSError as e:
        problem = str(e)
    if not isinstance(step, int) or not tdist.is_initialized():
        problem = problem or "no process group, or the manifest names no step"
    problems = [p for p in groups.gather(problem, _parallel_context(resume)) if p]
    if problems or own is None:
        say.note(f"resuming step {step} from storage: the memory tier cannot serve it ({problems[0]})")
        return None
    source, why = pull(own, resume, settings)
    where = f"memory ({source}; {why})" if source else f"storage: no memory copy serves it ({why})"
    say.note(f"resuming step {step} from {where}")
    return source


def pull(own: MemoryTier, resume: Pulling, settings: TrainerSettings) -> tuple[Path | None, str]:
    """`restart_source` for `resume` over a link of its own (`memory_replica_transport`), closed once pulled:
    (this rank's tier folder of the checkpoint, or None for storage; why). Where the link is NCCL, the files
    it reads ahead and its node lacks come from the GPU of a rank reading them (`resume.peer`, over the
    link's group: tier/peer_reads.py). Collective."""
    import torch.distributed as tdist

    t0 = time.monotonic()
    group = tdist.new_group(backend="gloo")  # the ranks' agreements; the bytes go over the link
    link = open_link(group, settings.memory_replica_transport)
    opened = time.monotonic() - t0
    gpus = getattr(link, "group", None) if link.name == "nccl" else None
    try:
        needs, engine = resume.needs(), resume.get_engine()
        source, why, resume.peer = restart_source(
            own, resume.manifest, needs, group, engine, link, resume.ahead(), gpus
        )
        return source, f"{why}; the link opened in {opened:.2f} s"
    finally:
        link.close()


class Plan:
    """What a resume tries once some rank could not read its checkpoint whole, in order (`fallbacks`): the
    caller (`confirm`) reads each again until every rank reads one whole. `next(reasons)` records
    why the one read last failed and gives the next (folder, source: None for the folder itself); where
    none is left it raises CheckpointError naming every one tried and why."""

    def __init__(self, folder: Path | None, source: Path | None, checkpoints: Path | None = None) -> None:
        if folder is None:
            raise CheckpointError("no checkpoint was planned to resume from (Resume.plan first)")
        self.first, self.current, self.source = folder, folder, source
        self._left = fallbacks(folder, source, checkpoints)
        self._tried: list[str] = []

    def next(self, reasons: list[str]) -> tuple[Path, Path | None]:
        where = "memory" if self.source is not None else "storage"
        self._tried.append(f"step {self.current.name} from {where}: {reasons[0]}")
        if not self._left:
            raise CheckpointError("no committed checkpoint could be read whole: " + "; ".join(self._tried))
        folder, source = self._left.pop(0)
        also = " (from storage)" if folder == self.current else ""
        say.error(
            f"checkpoint {self.current} could not be read whole ({'; '.join(reasons[:3])}); every rank "
            f"falls back to {folder}{also}"
        )
        self.current, self.source = folder, (None if source == folder else source)
        return self.current, self.source

    def done(self) -> None:
        """Every rank read `current` whole: said where it is not the checkpoint planned first."""
        if self.current != self.first or self._tried:
            say.info(f"resumed from {self.current} instead of the newest checkpoint")


class Confirming(Reading, Protocol):
    """A resume whose checkpoint `confirm` checks (`Resume` is one): also where a memory checkpoint's
    fallbacks are (`memory_of`: the checkpoints folder it is newer than), and how it loads another one."""

    @property
    def memory_of(self) -> Path | None: ...

    def reload(self, folder: Path, source: Path | None) -> None: ...


def confirm(resume: Confirming) -> None:
    """Has the ranks agree that each read `resume`'s checkpoint whole; where any could not, every rank loads
    the next of its fallbacks (`Plan`: CheckpointError where none is left), until one is read whole by all.
    Collective."""
    plan = Plan(resume.folder, resume.source, resume.memory_of)
    while reasons := everyone(resume):
        resume.reload(*plan.next(reasons))
    plan.done()


def everyone(resume: Reading) -> list[str]:
    """Every rank's reasons for not having read its checkpoint whole (each prefixed by its rank), the same
    list on every rank; empty: all read it whole. Collective."""
    return [
        f"rank {r}: {why}"
        for r, mine in enumerate(groups.gather(resume.failures(), _parallel_context(resume)))
        for why in mine
    ]


def fallbacks(folder: Path, source: Path | None, checkpoints: Path | None = None) -> list[tuple[Path, Path]]:
    """The checkpoints to try after `folder` (read from `source`), newest first, as (folder, source): this one
    from storage where it came from memory, then every older committed one of its checkpoints folder (for a
    memory checkpoint, `checkpoints`: storage's, which lacks it)."""
    out = [(folder, folder)] if source is not None and source != folder else []
    store = open_store(checkpoints if checkpoints is not None else folder.parent)
    older = [store.path(str(s)) for s in store.steps() if s < checkpoint.step_of(folder)]
    older = [p for p in older if is_datastates_checkpoint(p)]
    return out + [(p, p) for p in reversed(older)]
