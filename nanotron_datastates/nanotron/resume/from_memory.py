"""A restart from a memory checkpoint (`datastates.memory_interval`: tier/memory_steps.py): the newest step,
newer than storage's, whose files the nodes' memory holds whole.

Every rank lists the steps its node's tier holds with their documents (manifest, Nanotron's metadata), newer
than the storage checkpoint Nanotron found; the ranks gather the lists and try the steps newest first. For
each, the documents of a rank that holds them go to every rank, which writes them into its own tier's step
folder where they are missing (a node that lost its memory), and reads the manifest from there. Then, as for
a storage checkpoint in memory (fallback.py): with memory replicas, what a node lacks is pulled from another
node's memory (`restart_source`); without, every rank's tier must hold the step whole. The first step that
serves every rank is resumed, with storage's checkpoints as its fallbacks; none: storage's, as without
memory checkpoints. Collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...checkpoint import folder as checkpoint
from ...checkpoint.manifest import ManifestError
from ...tier.held_copy import step_why_not
from ...tier.memory import MemoryTier
from ...tier.memory_steps import keep_documents, manifest_of, read_documents, steps_with_manifest
from .. import groups
from .. import log as say
from . import fallback as recovery

if TYPE_CHECKING:
    from ...trainer_settings import TrainerSettings
    from ..types import Config, ParallelContext


class Taking(recovery.Pulling, Protocol):
    """What this module needs of a Resume: to take a checkpoint folder (its manifest read there), and then
    what a pull reads of it (fallback.Pulling); where it reads them, and a memory checkpoint's fallbacks
    (`memory_of`: the checkpoints folder it is newer than), set here."""

    source: Path | None
    memory_of: Path | None

    def take(self, folder: Path, source: Path | None = None) -> None: ...


def checkpoints_of(config: Config, settings: TrainerSettings, folder: Path | None) -> Path | None:
    """The checkpoints folder whose memory checkpoints a resume may take: that of the storage checkpoint
    Nanotron found, else the config's resume path; None without the memory tier, or where the config resumes
    nothing local."""
    from nanotron.s3_checkpoints import check_path_is_local

    path = Path(folder).parent if folder is not None else config.checkpoints.resume_checkpoint_path
    if not settings.memory_tier or path is None or not check_path_is_local(path):
        return None
    return Path(path)


def choose(
    resume: Taking, settings: TrainerSettings, pc: ParallelContext, memory: Path | None, stored: Path | None
) -> bool:
    """Takes what a restart resumes: the newest memory checkpoint of `memory` (the checkpoints folder; None:
    none looked for) newer than `stored` that serves every rank, else `stored` (read from the memory tier
    where every rank finds it whole there: fallback.py). False: neither (nothing taken). Collective."""
    if memory is not None and newest(resume, settings, pc, memory, stored) is not None:
        resume.memory_of = memory  # storage's checkpoints are its fallbacks
        return True
    if stored is None:
        return False
    resume.take(stored)
    if settings.memory_tier:
        resume.source = recovery.memory_copy(resume, settings)  # type: ignore[arg-type]
    return True


def newest(
    resume: Taking, settings: TrainerSettings, pc: ParallelContext, checkpoints: Path, storage: Path | None
) -> Path | None:
    """Takes the newest memory checkpoint of `checkpoints` newer than `storage` (the storage checkpoint to
    resume otherwise, or None) that serves every rank, and returns its folder in this rank's tier (which the
    resume reads); None: none does (nothing taken). Collective over the world."""
    rank = groups.rank(pc.world_pg)
    after = checkpoint.step_of(storage) if storage is not None else None
    try:
        tier = MemoryTier(settings.memory_tier_path, checkpoints, rank, settings.memory_tier_copies)
        mine = steps_with_manifest(tier, after)
    except OSError as e:
        tier, mine = None, []
        say.error(f"memory checkpoints: the memory tier cannot be read ({e})", every_rank=True)
    everyone = groups.gather(mine, pc)
    for step in sorted({s for steps in everyone for s in steps}, reverse=True):
        found = _serves(resume, settings, pc, tier, step, step in mine)
        if found is not None:
            return found
    return None


def _serves(
    resume: Taking,
    settings: TrainerSettings,
    pc: ParallelContext,
    tier: MemoryTier | None,
    step: int,
    have: bool,
) -> Path | None:
    """The memory checkpoint of `step`, taken where it serves every rank (its tier folder), else None."""
    problem, documents = None, None
    if tier is not None and have:
        try:
            documents = read_documents(tier, step)
        except (OSError, ManifestError) as e:
            problem = str(e)
    shared = next((d for d in groups.gather(documents, pc) if d is not None), None)
    here = tier.folder / str(step) if tier is not None else None
    try:
        if shared is None:
            raise ValueError(problem or "no rank could read its manifest")
        if tier is None or here is None:
            raise ValueError("this rank's memory tier cannot be read")
        manifest_of(shared, step, f"the manifest of memory checkpoint {step}")
        if documents is None:  # this node lost them (or never held the step): written into its tier
            keep_documents(tier, step, shared)
        resume.take(here, here)
    except (OSError, ValueError) as e:
        problem = f"rank {groups.rank(pc.world_pg)}: {e}"
    problems = [p for p in groups.gather(problem, pc) if p]
    if problems:
        say.note(f"memory checkpoint {step} not resumed: {problems[0]}")
        return None
    assert tier is not None and here is not None
    source, why = _pull(resume, settings, pc, tier, step)
    say.note(f"memory checkpoint {step}: {why}")
    return source


def _pull(
    resume: Taking, settings: TrainerSettings, pc: ParallelContext, tier: MemoryTier, step: int
) -> tuple[Path | None, str]:
    """(this rank's tier folder of `step` once every rank's files are in its node's memory, or None; why)."""
    if not settings.memory_replicas:
        reason = step_why_not(tier, step, resume.manifest)
        reasons = groups.gather(reason, pc)
        bad = next(((r, why) for r, why in enumerate(reasons) if why), None)
        if bad is not None:
            return None, f"not whole in memory (rank {bad[0]}: {bad[1]})"
        return tier.folder / str(step), f"resumed from the memory tier ({tier.folder / str(step)})"
    source, why = recovery.pull(tier, resume, settings)
    return source, (f"resumed from memory ({why})" if source else f"not whole in any node's memory ({why})")
