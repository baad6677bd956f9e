"""A Saver's copies of its checkpoints in memory: with `memory_tier`, each file's copy in node-local shared
memory (memory_tier.py), opened with the Saver (what a killed process left pruned); with `memory_replicas`,
the committed steps sent to ranks of other nodes too (tier/replicas.py). Released when training ends."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...engine import DataStatesEngine
from ...engine_settings import MIN_PARSER_THREADS, node_ranks
from ...save.plan import SavePlan
from ...store import open_store
from ...tier.links import open_link
from ...tier.memory import REPLICAS, MemoryTier
from ...tier.memory_steps import steps_with_manifest
from ...tier.replica_process import ProcessSpec, ReplicaProcess
from ...tier.replica_transfer import ReplicaError
from ...tier.replicas import Replicated, Replicator, node_key, placement, prune, replica_area
from ...tier.room import check_room
from ...tier.step_order import StepOrder
from ...trainer_settings import TrainerSettings
from .. import groups
from .. import log as say

if TYPE_CHECKING:
    from ..types import ParallelContext


@dataclasses.dataclass
class Replication:
    """The memory replicas of a Saver: its replicator, the placement recorded in each manifest, the ranks
    whose replicas this rank keeps, and the calls its training thread makes at each step (NCCL's)."""

    replicator: Replicator | ReplicaProcess | None = None
    placement: dict[str, object] | None = None  # {"nodes": each rank's node, "holders": of each rank's}
    sources: list[int] = dataclasses.field(default_factory=list)
    order: StepOrder | None = None  # the NCCL calls the training thread makes at each optimizer step


def open_tier(settings: TrainerSettings, checkpoints: Path) -> tuple[MemoryTier | None, int | None]:
    """(this rank's memory tier, or None without `memory_tier`; the newest committed step, kept in it:
    storage's latest, or a newer memory checkpoint)."""
    import torch.distributed as tdist

    if not settings.memory_tier:
        return None, None
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    # With replicas, a second spare: a checkpoint asked for while one is sent takes the other's files over.
    spares = 2 if settings.memory_replicas else 1
    tier = MemoryTier(
        settings.memory_tier_path, checkpoints, rank, settings.memory_tier_copies, max_spares=spares
    )
    try:
        keep = open_store(checkpoints).latest()
    except (OSError, ValueError):
        keep = None
    newer = steps_with_manifest(tier, keep)  # memory checkpoints: the newest may be what training resumed
    keep = newer[-1] if newer else keep

    def pruned(error: BaseException | None, seconds: float) -> None:
        if error is not None:
            say.error(f"memory tier: what an earlier process left could not all be removed ({error!r})")
        elif seconds > 0.1:
            say.info(
                f"memory tier: what an earlier process left besides step {keep} removed in {seconds:.2f} s"
            )

    # What a killed process left besides the newest committed step, removed beside the start of training;
    # the tier's saves wait for it.
    tier.prune_behind(keep, pruned)
    return tier, keep


def prepare_tier(
    tier: MemoryTier, engine: DataStatesEngine, settings: TrainerSettings, files: list[tuple[str, SavePlan]]
) -> None:
    """After the first step, `files` (this rank's state files: path in the checkpoint, plan): the tier's room
    checked (this rank's checkpoint, as many times as the node has ranks), then, on a fresh start, the files
    of the checkpoints it keeps (`tier.sets()`: `memory_tier_copies`, a second spare with replicas) made,
    mapped and pinned before the second step, so that no checkpoint pins new pages while training runs. A
    restart (the tier holds a step of this rank) leaves them to its saves: pinning holds the driver's locks,
    and its 14-22 GB (1.1B) would double the restart's time to its first step. A set that cannot be made is
    left to a save to make, as without it."""
    nbytes = sum(plan.nbytes for _, plan in files)
    tier.pruned()  # an earlier process's files gone: their room counted, their names free
    check_room(tier, nbytes * node_ranks(), settings.memory_replicas)
    if tier.held_steps():
        return
    t0 = time.perf_counter()
    for i in range(tier.sets()):
        try:
            engine.prepare_mirrors([(plan, tier.warm(i, rel)) for rel, plan in files])
        except OSError as e:
            with contextlib.suppress(OSError):
                tier.remove_warm(i)
                engine.keep_mirrors()
            say.error(f"memory tier: the files of a checkpoint could not be made ahead ({e}); its save will")
            return
        tier.add_warm(i, [rel for rel, _ in files])
    gb, s = tier.sets() * nbytes / 1e9, time.perf_counter() - t0
    say.info(
        f"memory tier: the files of {tier.sets()} checkpoint(s) made and pinned ahead: {gb:.2f} GB, {s:.2f} s"
    )


def prepare_replicas(
    replication: Replication, tier: MemoryTier | None, files: list[tuple[str, SavePlan]], pc: ParallelContext
) -> None:
    """After the first step, with memory replicas (collective: every rank learns the sizes of the others'
    `files`, as `prepare_tier`'s): on a fresh start, the files of the first two replicas of each rank this
    rank keeps replicas of made ahead (tier/replica_ahead.py), so that none is received into new pages while
    training runs: by the replica process beside training where there is one (this step does not wait; the
    process makes them before it sends any replica), else here. A restart leaves them to its replicas, as it
    leaves the tier's files to its saves."""
    replicator = replication.replicator
    if replicator is None or tier is None:
        return
    everyone = groups.gather([(rel, plan.nbytes) for rel, plan in files], pc)
    if tier.held_steps() or not replicator.sources:
        return
    t0, wanted = time.perf_counter(), {s: everyone[s] for s in replicator.sources}

    def said(made: int, error: BaseException | None) -> None:
        if error is not None:  # never fatal: the replicas then take new files
            say.error(f"memory replicas: the files of the first replicas could not be made ahead ({error})")
            return
        say.info(
            f"memory replicas: the files of 2 replicas of rank(s) {', '.join(map(str, replicator.sources))} "
            f"made ahead: {made / 1e9:.2f} GB, {time.perf_counter() - t0:.2f} s"
        )

    replicator.make_ahead(wanted, then=said)  # a replica process's beside training, faulted in its memory


def open_replicas(
    tier: MemoryTier | None,
    settings: TrainerSettings,
    pc: ParallelContext,
    engine: DataStatesEngine,
    keep: int | None,
    on_done: Callable[[Replicated], None],
) -> Replication:
    """The replicas' placement over the nodes and the replicator, with `memory_replicas` (collective: the
    ranks gather their nodes, and the replicator's gloo groups and link are made here, its buffers too); the
    replicas this rank keeps pruned like its own tier."""
    import torch.distributed as tdist

    if tier is None or not settings.memory_replicas or not tdist.is_initialized():
        return Replication()
    t0 = time.perf_counter()
    nodes = groups.gather(node_key(), pc)
    holders = placement(nodes, settings.memory_replicas)
    me = groups.rank(pc.world_pg)
    sources = [s for s, hs in enumerate(holders) if me in hs]
    aside: list[str] = []  # an earlier process's spare set (1.1B: 7 GB), freed beside the start
    prune(tier, sources, keep, aside)
    if aside:
        tier.remove_behind(tier.folder / REPLICAS, aside, _said_removed)
    token = process_token(settings, pc)
    if token is not None:  # gloo, from a process of this rank's own
        spec = process_spec(tier, holders, settings, engine, token, me)
        process = ReplicaProcess(tier, spec, on_done)
        seconds = time.perf_counter() - t0
        say.info(f"memory replicas go over gloo, from a process of their own (started in {seconds:.2f} s)")
        return Replication(process, {"nodes": nodes, "holders": holders}, sources)
    group = tdist.new_group(backend="gloo")
    # Over NCCL (`nccl`; `auto` takes gloo while training runs), each wave's calls are made by the training
    # thread at an optimizer step: queued among the training's kernels in another order on another rank,
    # they deadlock them (a 180M dp2 job hung so).
    link = open_link(group, settings.memory_replica_transport, at_steps=True)
    link.reserve(len(holders[me]), len(sources))  # buffers pinned before training, not during
    at_steps = ", at the optimizer steps" if link.order else ""
    say.info(f"memory replicas go over {link.name}{at_steps} (ready in {time.perf_counter() - t0:.2f} s)")
    replicator = Replicator(
        tier, holders, group, engine, settings.memory_replica_gbps, on_done=on_done, link=link
    )
    return Replication(replicator, {"nodes": nodes, "holders": holders}, sources, link.order)


def _said_removed(error: BaseException | None, seconds: float) -> None:
    if error is not None:
        say.error(f"memory replicas: what an earlier process made ahead could not all be removed ({error!r})")
    else:
        say.info(f"memory replicas: the files an earlier process made ahead removed in {seconds:.2f} s")


def process_token(settings: TrainerSettings, pc: ParallelContext) -> str | None:
    """The key prefix's token of the replica processes where the replicas go from a process of each rank's
    own, None where they go from the training process's threads (collective: each rank gathers every rank's
    answer, so that all take the same way); `auto` takes the process where every rank can start one."""
    if settings.memory_replica_process == "never":
        return None
    auto = settings.memory_replica_process == "auto"
    answers = groups.gather((uuid.uuid4().hex, process_unable(settings) if auto else None), pc)
    unable = [f"rank {r}: {why}" for r, (_, why) in enumerate(answers) if why]
    if unable:
        say.info(
            f"memory replicas sent by the training process's threads (memory_replica_process=auto; "
            f"{unable[0]})"
        )
        return None
    return answers[0][0]


def process_unable(settings: TrainerSettings) -> str | None:
    """Why this rank cannot start a replica process (None: it can)."""
    if settings.memory_replica_transport == "nccl":
        return "memory_replica_transport=nccl"
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT", "").isdigit():
        return "torchrun's store is not in MASTER_ADDR and MASTER_PORT"
    if multiprocessing.current_process().daemon:
        return "a daemonic process starts none"
    return None


def process_spec(
    tier: MemoryTier,
    holders: list[list[int]],
    settings: TrainerSettings,
    engine: DataStatesEngine,
    token: str,
    rank: int,
) -> ProcessSpec:
    """What this rank's replica process needs: the job's store from torchrun's environment (ReplicaError
    naming the setting where it is not there), its keys under the job's `token` and restart count."""
    try:
        store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError):
        raise ReplicaError(
            "datastates.memory_replica_process=always needs the job's store in MASTER_ADDR and MASTER_PORT, "
            "as torchrun sets them"
        ) from None
    prefix = f"datastates-replicas/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{token}/"
    opened = (str(tier.base), str(tier.checkpoints), tier.copies, tier.max_spares)
    # Its checks run beside training: the fewest parsers where the count is automatic (a restore's is larger).
    threads = engine.config.parser_threads or MIN_PARSER_THREADS
    gbps, nice = settings.memory_replica_gbps, engine.config.flush_nice
    return ProcessSpec(store, prefix, rank, len(holders), holders, opened, gbps, threads, nice)


def stop_replicas(replication: Replication, timeout: float = 600.0) -> None:
    """After the last step (every rank at once): the replicas' NCCL calls made by their own thread from now
    on (training's collectives are over), then the replications queued waited for (bounded)."""
    if replication.order is not None:
        replication.order.finish()
    if replication.replicator is not None:
        replication.replicator.close(timeout)


def release(tier: MemoryTier | None, sources: list[int]) -> None:
    """At the end of training: this rank's memory tier files, and the replicas it keeps, dropped."""
    if tier is not None:
        for source in sources:
            replica_area(tier, source).release()
        tier.release()
