"""What one rank writes at every checkpoint: its files, planned once with Nanotron's names and tensor
metadata (the same files and weight tensors at every checkpoint), and where each one goes, as the engine
takes them (the checkpoint's folder, and with `memory_tier` the file's copy in node-local shared memory)."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...engine import DataStatesEngine
from ...errors import UntrustedPath
from ...save.commit import PendingCheckpoint
from ...save.plan import SavePlan
from ...tier.memory import MemoryTier
from .. import shards

if TYPE_CHECKING:
    from ..types import BaseOptimizer, NanotronModel, ParallelContext

Targets = tuple[list[tuple[SavePlan, str]], list[str] | None, list[str | None] | None]


@dataclasses.dataclass
class RankFiles:
    """What this rank writes at every checkpoint, relative to the checkpoint's folder."""

    weights: list[tuple[Path, SavePlan]]
    optimizer: Path | None
    lr_scheduler: Path | None
    random: Path
    optimizer_part: tuple[int, int] = (0, 1)  # (part, parts) of the optimizer state in `optimizer`


def plan_files(
    engine: DataStatesEngine,
    model: NanotronModel,
    optimizer: BaseOptimizer,
    pc: ParallelContext,
    balance: bool,
) -> RankFiles:
    """This rank's files, the weights' planned. What the replicas hold alike is shared out among them
    (`balance`: `balance_writes`; the optimizer state without ZeRO in parts, one a replica) or written by
    rank 0's replica."""
    writes = shards.writers(model, optimizer, pc, balance=balance)
    return RankFiles(
        weights=[
            (path, engine.plan({"data": param}, metadata=md, exact_metadata=True))
            for path, param, md in shards.weight_shards(model, pc, Path(), writes)
        ],
        optimizer=shards.optimizer_path(optimizer, pc, Path(), writing=True, writes=writes),
        lr_scheduler=shards.lr_scheduler_path(pc, Path(), writing=True, writes=writes),
        random=shards.random_states_path(pc, Path()),
        optimizer_part=(writes.me, writes.parts)
        if writes.parts > 1 and not shards.is_zero(optimizer)
        else (0, 1),
    )


def cache_bytes(engine: DataStatesEngine, plans: list[SavePlan]) -> int:
    """The host cache one checkpoint of `plans` fills: each file takes whole chunks, and two more hold the
    scheduler's and the random states' files."""
    chunk = engine.cache_stats()["chunk_bytes"]
    chunks = sum(-(-p.nbytes // chunk) for p in plans) + 2
    return chunks * chunk


def targets(
    tier: MemoryTier | None, pending: PendingCheckpoint, files: list[tuple[Path, SavePlan]]
) -> Targets:
    """`files` (path in the checkpoint, plan) of `pending`'s checkpoint as the engine takes them: (plan,
    path) each, with each one's memory tier copy and the earlier copy it recycles. UntrustedPath, naming it,
    where the checkpoint's folder is a link (another run's step, left there): never written through."""
    if os.path.islink(pending.folder):
        raise UntrustedPath(
            errno.ELOOP, f"{pending.folder}: a link where the checkpoint's folder goes; remove it"
        )
    out = [(plan, os.path.join(str(pending.folder), path)) for path, plan in files]
    mirrors = recycle = None
    if tier is not None:  # strings: path objects cost the training thread a few µs a file
        folder = os.path.join(tier.folder, str(pending.step))
        mirrors = [os.path.join(folder, path) for path, _ in files]
        recycle = tier.recycle(pending.step, [str(path) for path, _ in files])
    return out, mirrors, recycle
