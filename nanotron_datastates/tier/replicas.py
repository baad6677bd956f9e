"""Memory replicas (`datastates.memory_replicas`): each rank's memory tier copy of every committed checkpoint
kept in the memory of ranks on other nodes too, so that a job that loses a whole node restarts from memory.

Placement (`placement`): a ring over the nodes (in the order of their first rank); a rank's replicas go to the
ranks of the same local index on the `memory_replicas` nodes after its own. Nodes are told apart by
torchrun's `GROUP_RANK` (else the host name); the placement is recorded in the manifest.

After a checkpoint is committed (`Replicator`, a thread of its own on a gloo group of its own): every rank
learns the others' files (their manifest entries), maps its tier files and creates the temporaries it
receives into, and the ranks agree that all could before a byte moves; then each file goes in chunks, every
rank sending to its holders and receiving from the ranks it holds for at once, a chunk of each per wave,
paced to `memory_replica_gbps`, over the job's link (links.py: gloo while training runs); where checkpoints
come faster than they are replicated, the ranks agree on the newest all have queued and skip the older. A
received file is checked against its manifest entry (size and every tensor's checksum), as its bytes land,
before it is renamed into place and marked held for its rank (`.rank-<r>.json` in `<job>/replicas/<step>/`,
as the tier marks its own copies); the older replica of that rank then becomes a spare (its marker
withdrawn), whose files the next replica is received into. A file killed half received is a temporary,
never marked, never read, removed at the next start.

The restart, which pulls what a node lacks from other nodes' memory: replica_restore.py; the files moved
between ranks: replica_transfer.py, over a link (links.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..checkpoint.manifest import Entries, entry_bytes
from ..telemetry import ReplicaFigures
from .links import GlooLink, Link
from .memory import REPLICAS, MemoryTier
from .replica_ahead import make_ahead
from .replica_check import Checks
from .replica_transfer import CHUNK, ReplicaError, Transfer, gather, open_all

if TYPE_CHECKING:
    from ..engine import DataStatesEngine


def node_key() -> str:
    """This process's node: torchrun's GROUP_RANK (the node's rank in the job) where set, else the host."""
    group_rank = os.environ.get("GROUP_RANK", "")
    return f"node {group_rank}" if group_rank else socket.gethostname()


def placement(nodes: list[str], replicas: int) -> list[list[int]]:
    """The ranks holding each rank's replicas (`nodes[r]`: rank r's node): for rank r, the rank of the same
    local index (modulo that node's ranks) on each of the `replicas` nodes after r's around the ring of
    nodes. ValueError, naming the setting, where the job has fewer than `replicas` + 1 nodes."""
    order = list(dict.fromkeys(nodes))
    if replicas >= len(order):
        raise ValueError(
            f"datastates.memory_replicas={replicas} needs {replicas + 1} nodes, and this job runs on "
            f"{len(order)}: each replica goes to another node"
        )
    ranks = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out = []
    for r, n in enumerate(nodes):
        i, local = order.index(n), ranks[n].index(r)
        peers = [ranks[order[(i + k) % len(order)]] for k in range(1, replicas + 1)]
        out.append([p[local % len(p)] for p in peers])
    return out


def replica_area(tier: MemoryTier, source: int, copies: int = 1) -> MemoryTier:
    """The replicas this node keeps in `tier`'s job folder, as seen by the rank they belong to; with 2
    `copies`, the replica held before the newest stays as a spare whose files the next one takes over."""
    return MemoryTier(tier.base, tier.checkpoints, source, copies=copies, area=REPLICAS)


def prune(tier: MemoryTier, sources: list[int], keep: int | None, aside: list[str] | None = None) -> None:
    """At the start of training: the replicas of `sources` other than of step `keep` dropped, and what dead
    processes were receiving; with `aside`, the sets made ahead by an earlier process set aside in the
    replicas' folder (`tier.folder / REPLICAS`), named there for the caller to remove (MemoryTier.prune)."""
    for source in sources:
        replica_area(tier, source).prune(keep, aside)


def keep_for_sending(tier: MemoryTier, sending: int | None, step: int) -> None:
    """`step`, just submitted, kept from the saves (`tier.busy`) until it is sent; of the steps before it only
    `sending`, the one being sent, stays kept: the others, which it goes in place of, are the saves' again."""
    tier.busy.intersection_update({sending})
    tier.busy.add(step)


# Told the bytes of the first replicas' files made ahead, or the error (`make_ahead`'s `then`).
Ahead = Callable[[int, "BaseException | None"], None]


# -- after each commit --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Replicated:
    """One checkpoint's replication, as this rank saw it; `job`: every rank's figures (`figures`), by rank,
    where the ranks could still agree on them."""

    step: int
    sent_bytes: int
    received_bytes: int
    seconds: float
    to: list[int]
    sources: list[int]
    error: str | None = None
    job: list[ReplicaFigures] | None = None
    transport: str = ""  # the link's name: nccl or gloo
    skipped_for: int | None = None  # not sent: the newer checkpoint of this step was, in its place

    def figures(self) -> ReplicaFigures:
        return {
            "transport": self.transport,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "seconds": self.seconds,
            "to": self.to,
            "error": self.error,
        }


class Replicator:
    """Sends this rank's tier copy of each committed checkpoint to its holders and keeps those of the ranks
    it holds for (see the module's docstring). Collective: every rank makes one, with the same `holders`,
    and submits every committed checkpoint, in order. `group`: a gloo group over every rank, used by this
    object only; `link`: how the bytes travel (default: over `group`, in messages of `chunk` bytes)."""

    def __init__(
        self,
        tier: MemoryTier,
        holders: list[list[int]],
        group: ProcessGroup,
        engine: DataStatesEngine,
        gbps: float = 0.0,
        chunk: int = CHUNK,
        on_done: Callable[[Replicated], None] | None = None,
        link: Link | None = None,
        on_send: Callable[[int], None] | None = None,
    ) -> None:
        self.tier, self.holders, self.group, self.engine = tier, holders, group, engine
        self.rank = dist.get_rank(group)
        self.gbps, self.on_done, self.on_send = gbps, on_done, on_send  # on_send(step): being sent now
        self.link = link if link is not None else GlooLink(group, chunk)
        self.sources = [s for s, hs in enumerate(holders) if self.rank in hs]
        # The older replica of each rank stays as a spare that the next one is received into (in place of
        # new pages, which a tmpfs allocates one fault at a time): the memory `check_room` counts anyway.
        self.areas = {s: replica_area(tier, s, copies=2) for s in self.sources}
        self._queue: queue.Queue[tuple[int, Entries] | None] = queue.Queue()
        self._sending: int | None = None  # the step being sent
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="datastates-replicator", daemon=True)
        self._thread.start()

    def submit(self, step: int, files: Entries) -> None:
        """After `step` is committed and marked held in the tier: its files (this rank's manifest entries)
        go to the holders. The tier keeps them from being overwritten until they are sent; the older steps
        still queued, which this one will be sent in place of, are left to the saves to recycle (where the
        ranks send one of them after all, its taken-over files fail the receivers' checks: never placed)."""
        keep_for_sending(self.tier, self._sending, step)
        self._queue.put((step, files))

    def make_ahead(self, files: dict[int, list[tuple[str, int]]], then: Ahead | None = None) -> int:
        """The files of the first two replicas of each rank of `files` (its files: name, bytes) that this
        one keeps replicas of, made ahead as its areas' first spares (replica_ahead.py); the bytes made.
        With `then`, the outcome goes to `then(bytes made, error or None)`, here before this returns 0,
        as a replica process tells it (replica_process.py) from another thread."""
        if then is None:
            return make_ahead(self.areas, files)
        try:
            made, error = make_ahead(self.areas, files), None
        except (OSError, ValueError) as e:
            made, error = 0, e
        then(made, error)
        return 0

    def close(self, timeout: float = 600.0) -> None:
        """Waits for the replications queued (bounded: a peer may be gone)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.link.close()

    def _newest(self, step: int, backlog: list[tuple[int, Entries] | None]) -> int:
        """The newest step every rank has queued by now (`step` is the oldest; the others wait in `backlog`,
        to which what is queued now is added): the one all replicate next, the same on every rank, so that
        replication slower than the checkpoints come sends the newest and skips the rest."""
        while backlog[-1:] != [None]:
            try:
                backlog.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if self._broken is not None:
            return step
        try:
            mine = [step] + [b[0] for b in backlog if b is not None]
            return min(max(steps) for steps in gather(self.group, mine))
        except RuntimeError as e:
            self._broken = str(e)
            return step

    def _run(self) -> None:
        backlog: list[tuple[int, Entries] | None] = []
        while (item := backlog.pop(0) if backlog else self._queue.get()) is not None:
            step, files = item
            newest = self._newest(step, backlog)
            if newest > step:  # a newer checkpoint goes in its place
                self.tier.busy.discard(step)
                to = self.holders[self.rank]
                skipped = Replicated(step, 0, 0, 0.0, to, self.sources, skipped_for=newest)
                if self.on_done is not None:
                    with contextlib.suppress(Exception):
                        self.on_done(skipped)
                continue
            self._sending = step
            self.tier.busy.add(step)
            if self.on_send is not None:
                with contextlib.suppress(Exception):
                    self.on_send(step)
            try:
                if self._broken is not None:
                    raise ReplicaError(f"not replicated: an earlier replication broke ({self._broken})")
                done = self._replicate(step, files)
            except Exception as e:  # never fatal to training: storage and the local copy still hold it
                to = self.holders[self.rank]
                done = Replicated(step, 0, 0, 0.0, to, self.sources, str(e), transport=self.link.name)
                if isinstance(e, RuntimeError) and not isinstance(e, ReplicaError):
                    self._broken = str(e)  # the group failed mid-transfer: it cannot be trusted again
            finally:
                self._sending = None
                self.tier.busy.discard(step)
            if self._broken is None:  # every rank is here, whether its part succeeded or not
                try:
                    done.job = gather(self.group, done.figures())
                except RuntimeError as e:
                    self._broken = str(e)
            if self.on_done is not None:
                with contextlib.suppress(Exception):
                    self.on_done(done)

    def _waves(self, everyone: list[Entries]) -> int:
        """The chunks of the longest stream any rank sends or receives: the waves every rank makes (an NCCL
        link's calls at the steps pair up wave by wave)."""
        chunk = self.link.chunk
        sizes = [sum(entry_bytes(e) for e in fs.values()) for r, fs in enumerate(everyone) if self.holders[r]]
        return max((-(-n // chunk) for n in sizes), default=0)

    def _replicate(self, step: int, files: Entries) -> Replicated:
        everyone = gather(self.group, files)
        to = self.holders[self.rank]
        sends = [Transfer(h, rel, entry_bytes(e)) for h in to for rel, e in sorted(files.items())]
        recvs = []
        for s in self.sources:
            rels = sorted(everyone[s])
            donors = self.areas[s].recycle(step, rels)
            recvs += [
                Transfer(s, rel, entry_bytes(everyone[s][rel]), donor=Path(d) if d else None)
                for rel, d in zip(rels, donors)
            ]
        area = replica_area(self.tier, self.rank).folder / str(step)
        with contextlib.ExitStack() as stack:
            own = self.tier.folder / str(step)
            problems = open_all(stack, self.group, sends, lambda t: own, recvs, area)
            if problems:
                raise ReplicaError(f"step {step} not replicated: {'; '.join(problems[:3])}")
            # each file checked as its bytes land, beside the rest of the transfer: whole sooner
            checks = stack.enter_context(Checks(self.engine, recvs, lambda t: everyone[t.peer][t.rel]))
            waves = self._waves(everyone)
            seconds = self.link.move(sends, recvs, self.gbps, waves, checks.landed, checks.arrived)
            checks.place()
        for s in self.sources:
            self.areas[s].commit(step, everyone[s])
        return Replicated(
            step,
            sum(t.nbytes for t in sends),
            sum(t.nbytes for t in recvs),
            seconds,
            to,
            self.sources,
            transport=self.link.name,
        )


def describe(r: Replicated) -> str:
    """The log line of one checkpoint's replication (a negative step: of replication as a whole)."""
    if r.error and r.step < 0:
        return f"memory replicas: {r.error}"
    if r.error:
        return f"memory replicas of checkpoint {r.step}: {r.error}"
    if r.skipped_for is not None:
        return f"memory replicas of checkpoint {r.step}: not sent, checkpoint {r.skipped_for} goes instead"
    return (
        f"memory replicas of checkpoint {r.step}: {r.sent_bytes / 1e9:.3f} GB sent to rank(s) "
        f"{', '.join(map(str, r.to))}, {r.received_bytes / 1e9:.3f} GB received from rank(s) "
        f"{', '.join(map(str, r.sources)) or '-'}, in {r.seconds:.2f} s over {r.transport}"
    )
