"""Memory replicas (`datastates.memory_replicas`): each rank's memory tier copy of every committed checkpoint
kept in the memory of ranks on other nodes too, so that a job that loses a whole node restarts from memory.

Placement (`placement`): a ring over the nodes (in the order of their first rank); a rank's replicas go to the
ranks of the same local index on the `memory_replicas` nodes after its own. Nodes are told apart by
torchrun's `GROUP_RANK` (else the host name); the placement is recorded in the manifest.

After a checkpoint is committed (`Replicator`, a thread of its own on a gloo group of its own): every rank
learns the others' files (their manifest entries), maps its tier files and creates the temporaries it
receives into, and the ranks agree that all could before a byte moves; then each file goes in chunks, every
rank sending to its holders and receiving from the ranks it holds for at once, a chunk of each per wave,
paced to `memory_replica_gbps`. A received file is checked against its manifest entry (size and every
tensor's checksum) before it is renamed into place and marked held for its rank (`.rank-<r>.json` in
`<job>/replicas/<step>/`, as the tier marks its own copies); the older replica of that rank then goes. A
file killed half received is a temporary, never marked, never read, removed at the next start.

Restart (`restart_source`): every rank says which files of the checkpoint its node holds whole in memory
(its own tier's and the replicas') and which it reads; each file a rank reads and its node lacks is pulled
from a rank whose node holds it, into the rank's own tier, checked against the manifest, then renamed; a
replica on the rank's own node is linked in. Every rank reads from memory, or, where any file a rank needs
is in no node's memory, every rank reads storage, and the log says which file was missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
import queue
import socket
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import trust
from .checkpoint import layout
from .memory_tier import REPLICAS, MemoryTier

CHUNK = 64 << 20  # bytes a message carries
_temporaries = itertools.count()


class ReplicaError(RuntimeError):
    """A checkpoint could not be replicated (the message names the rank and the file)."""


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


def replica_area(tier: MemoryTier, source: int) -> MemoryTier:
    """The replicas this node keeps in `tier`'s job folder, as seen by the rank they belong to."""
    return MemoryTier(tier.base, tier.checkpoints, source, copies=1, area=REPLICAS)


def prune(tier: MemoryTier, sources: list[int], keep: int | None) -> None:
    """At the start of training: the replicas of `sources` other than of step `keep` dropped, and what dead
    processes were receiving."""
    for source in sources:
        replica_area(tier, source).prune(keep)


# -- moving files between ranks -----------------------------------------------------------------------------


@dataclasses.dataclass
class Transfer:
    """One file between two ranks: `peer` sends or receives it; `buf` its bytes, mapped."""

    peer: int
    rel: str
    nbytes: int
    buf: torch.Tensor | None = None
    temporary: Path | None = None  # a receive's, renamed to `into/rel` once checked
    into: Path | None = None


def _as_tensor(mapping: mmap.mmap | None) -> torch.Tensor:
    """The mapping's bytes as a tensor (an empty one for an empty file)."""
    if mapping is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping warns: gloo only reads what it sends
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapping, dtype=torch.uint8)


@contextlib.contextmanager
def _mapped_file(folder: Path, t: Transfer) -> Iterator[None]:
    """`t.buf`: the file `folder/t.rel` (a regular file of ours, no link), mapped read-only."""
    parts = trust.relative_name(t.rel, str(folder)).parts
    with trust.walk_dir(folder, parts[:-1]) as dir_fd:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(parts[-1], flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)  # the file opened is the one checked: no second walk to it
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise trust.UntrustedPath(0, f"{folder / t.rel}: not a regular file of this user's")
        if st.st_size != t.nbytes:
            raise ReplicaError(f"{folder / t.rel} is not of the {t.nbytes} bytes its manifest entry says")
        mapping = mmap.mmap(fd, t.nbytes, prot=mmap.PROT_READ) if t.nbytes else None
    finally:
        os.close(fd)
    t.buf = _as_tensor(mapping)
    try:
        yield
    finally:
        t.buf = None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
                mapping.close()


@contextlib.contextmanager
def _temporary(folder: Path, t: Transfer) -> Iterator[None]:
    """`t.buf`: a new temporary beside `folder/t.rel`, of its size, mapped to receive it; removed on the way
    out unless renamed to `t.rel` by then. Its folders are made and opened, and it is created, with no link
    followed (trust.UntrustedPath)."""
    parts = (folder.name, *trust.relative_name(t.rel, str(folder)).parts)  # from the private folder above
    tmp = Path(*parts[:-1], f".{parts[-1]}.dstmp.{os.getpid()}.{next(_temporaries)}")
    with trust.walk_dir(folder.parent, parts[:-1], create=True) as dir_fd:
        fd = os.open(tmp.name, trust.NEW_FILE, 0o600, dir_fd=dir_fd)
    mapping = None
    try:
        os.ftruncate(fd, t.nbytes)
        mapping = mmap.mmap(fd, t.nbytes) if t.nbytes else None
    except BaseException:
        os.close(fd)
        trust.unlink_in(folder.parent, str(tmp))
        raise
    os.close(fd)
    t.buf, t.temporary, t.into = _as_tensor(mapping), folder.parent / tmp, folder
    try:
        yield
    finally:
        t.buf = None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        if t.temporary is not None:
            with contextlib.suppress(OSError):
                trust.unlink_in(folder.parent, str(tmp))


def move(
    group: Any, sends: list[Transfer], recvs: list[Transfer], gbps: float = 0.0, chunk: int = CHUNK
) -> float:
    """Sends and receives every transfer's bytes at once, in waves of one chunk of each (both ends list a
    pair's files in the same order, so gloo matches them in order); after each wave, waits as long as
    keeps the bytes sent under `gbps` GB/s (0: no limit). Returns the seconds it took."""
    t0 = time.monotonic()
    sent = 0
    waves = max([-(-t.nbytes // chunk) for t in sends + recvs] or [0])
    for i in range(waves):
        lo, requests = i * chunk, []
        for t in sends:
            if lo < t.nbytes:
                assert t.buf is not None
                requests.append(dist.isend(t.buf[lo : lo + chunk], dst=t.peer, group=group))
                sent += min(chunk, t.nbytes - lo)
        for t in recvs:
            if lo < t.nbytes:
                assert t.buf is not None
                requests.append(dist.irecv(t.buf[lo : lo + chunk], src=t.peer, group=group))
        for r in requests:
            if r is not None:  # None: this rank is not in `group` (never here)
                r.wait()
        if gbps > 0:
            ahead = sent / (gbps * 1e9) - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    return time.monotonic() - t0


def check_and_place(engine: Any, t: Transfer, entry: dict[str, Any]) -> None:
    """Checks a received temporary against its manifest entry (size, every tensor's checksum), then renames
    it to its name (no link followed); ChecksumError, FormatError or OSError naming it otherwise."""
    assert t.temporary is not None and t.into is not None
    doc, top = {"files": {t.rel: entry}}, Path("/")  # the entry's checksums, looked up by its name
    sums = layout.file_checksums(doc, top, top / t.rel)
    engine.verify(t.temporary, sums, layout.file_block_checksums(doc, top, top / t.rel))
    top = t.into.parent  # as `_temporary` walked: the folder received into is no link either
    trust.rename_in(top, str(t.temporary.relative_to(top)), f"{t.into.name}/{t.rel}")
    t.temporary = None


def _open_all(
    stack: contextlib.ExitStack,
    group: Any,
    sends: list[Transfer],
    folder_of: Callable[[Transfer], Path],
    recvs: list[Transfer],
    into: Path,
) -> list[str]:
    """Maps every file sent (from `folder_of(t)`) and creates every temporary received into (under `into`),
    held open by `stack`; then the ranks agree: every rank's problems, the same list on all (empty: go).
    Everything is opened before any byte moves: a rank that could not would leave the others waiting."""
    problem = None
    try:
        for t in sends:
            stack.enter_context(_mapped_file(folder_of(t), t))
        for t in recvs:
            stack.enter_context(_temporary(into, t))
    except (OSError, ValueError, ReplicaError) as e:
        problem = f"rank {dist.get_rank(group)}: {e}"
    return [p for p in _gather(group, problem) if p]


def _gather(group: Any, obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


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
    job: list[dict[str, Any]] | None = None

    def figures(self) -> dict[str, Any]:
        return {
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
    object only."""

    def __init__(
        self,
        tier: MemoryTier,
        holders: list[list[int]],
        group: Any,
        engine: Any,
        gbps: float = 0.0,
        chunk: int = CHUNK,
        on_done: Callable[[Replicated], None] | None = None,
    ) -> None:
        self.tier, self.holders, self.group, self.engine = tier, holders, group, engine
        self.rank = dist.get_rank(group)
        self.gbps, self.chunk, self.on_done = gbps, chunk, on_done
        self.sources = [s for s, hs in enumerate(holders) if self.rank in hs]
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="datastates-replicator", daemon=True)
        self._thread.start()

    def submit(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        """After `step` is committed and marked held in the tier: its files (this rank's manifest entries)
        go to the holders. The tier keeps them from being overwritten until they are sent."""
        self.tier.busy.add(step)
        self._queue.put((step, files))

    def close(self, timeout: float = 600.0) -> None:
        """Waits for the replications queued (bounded: a peer may be gone)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, files = item
            try:
                if self._broken is not None:
                    raise ReplicaError(f"not replicated: an earlier replication broke ({self._broken})")
                done = self._replicate(step, files)
            except Exception as e:  # never fatal to training: storage and the local copy still hold it
                done = Replicated(step, 0, 0, 0.0, self.holders[self.rank], self.sources, error=str(e))
                if isinstance(e, RuntimeError) and not isinstance(e, ReplicaError):
                    self._broken = str(e)  # the group failed mid-transfer: it cannot be trusted again
            finally:
                self.tier.busy.discard(step)
            if self._broken is None:  # every rank is here, whether its part succeeded or not
                try:
                    done.job = _gather(self.group, done.figures())
                except RuntimeError as e:
                    self._broken = str(e)
            if self.on_done is not None:
                with contextlib.suppress(Exception):
                    self.on_done(done)

    def _replicate(self, step: int, files: dict[str, dict[str, Any]]) -> Replicated:
        everyone: list[dict[str, dict[str, Any]]] = _gather(self.group, files)
        to = self.holders[self.rank]
        sends = [Transfer(h, rel, e["bytes"]) for h in to for rel, e in sorted(files.items())]
        recvs = [Transfer(s, rel, e["bytes"]) for s in self.sources for rel, e in sorted(everyone[s].items())]
        area = replica_area(self.tier, self.rank).folder / str(step)
        with contextlib.ExitStack() as stack:
            own = self.tier.folder / str(step)
            problems = _open_all(stack, self.group, sends, lambda t: own, recvs, area)
            if problems:
                raise ReplicaError(f"step {step} not replicated: {'; '.join(problems[:3])}")
            seconds = move(self.group, sends, recvs, self.gbps, self.chunk)
            for t in recvs:
                check_and_place(self.engine, t, everyone[t.peer][t.rel])
        for s in self.sources:
            replica_area(self.tier, s).commit(step, everyone[s])
        return Replicated(
            step,
            sum(t.nbytes for t in sends),
            sum(t.nbytes for t in recvs),
            seconds,
            to,
            self.sources,
        )


def describe(r: Replicated) -> str:
    """The log line of one checkpoint's replication."""
    if r.error:
        return f"memory replicas of checkpoint {r.step}: {r.error}"
    return (
        f"memory replicas of checkpoint {r.step}: {r.sent_bytes / 1e9:.3f} GB sent to rank(s) "
        f"{', '.join(map(str, r.to))}, {r.received_bytes / 1e9:.3f} GB received from rank(s) "
        f"{', '.join(map(str, r.sources)) or '-'}, in {r.seconds:.2f} s"
    )


# -- at a restart -------------------------------------------------------------------------------------------


def node_copies(tier: MemoryTier, manifest: dict[str, Any]) -> dict[str, Path]:
    """Every file of the manifest's checkpoint this node holds whole in memory, with the folder it is in:
    its ranks' own copies (the tier's step folder) and the replicas it keeps for other nodes' ranks."""
    step = int(manifest["step"])
    area = replica_area(tier, tier.rank)
    out = {rel: area.folder / str(step) for rel in area.held(step, manifest)}
    out.update({rel: tier.folder / str(step) for rel in tier.held(step, manifest)})
    return out


def restart_source(
    tier: MemoryTier, manifest: dict[str, Any], needs: set[str], group: Any, engine: Any, gbps: float = 0.0
) -> tuple[Path | None, str]:
    """Where this rank reads the checkpoint `manifest` describes, and why: its node's tier folder of that
    step once every file each rank `needs` is there (pulled from another node's memory, or linked in from
    this node's replicas, as needed), or None (storage) for every rank where any rank needs a file that is
    in no node's memory. Collective over `group` (gloo, every rank)."""
    step = int(manifest["step"])
    have = node_copies(tier, manifest)
    everyone = _gather(group, {"node": node_key(), "have": sorted(have), "needs": sorted(needs)})
    me = dist.get_rank(group)
    pulls: dict[tuple[str, str], tuple[int, int]] = {}  # (node, file) -> (the rank pulling it, from)
    links: list[str] = []
    for r, mine in enumerate(everyone):
        for rel in mine["needs"]:
            if rel in mine["have"]:
                if r == me and have[rel] != tier.folder / str(step):
                    links.append(rel)  # a replica on this node
                continue
            servers = [q for q, other in enumerate(everyone) if rel in other["have"]]
            if not servers:
                return None, f"rank {r} reads {rel}, which no node holds in memory"
            pulls.setdefault((mine["node"], rel), (r, servers[(r + len(pulls)) % len(servers)]))
    entries = manifest["files"]
    sends = [Transfer(r, rel, entries[rel]["bytes"]) for (_, rel), (r, q) in sorted(pulls.items()) if q == me]
    recvs = [Transfer(q, rel, entries[rel]["bytes"]) for (_, rel), (r, q) in sorted(pulls.items()) if r == me]
    here = tier.folder / str(step)
    problem = None
    with contextlib.ExitStack() as stack:
        problems = _open_all(stack, group, sends, lambda t: have[t.rel], recvs, here)
        if problems:
            return None, "; ".join(problems[:3])
        try:
            move(group, sends, recvs, gbps)
            for t in recvs:
                check_and_place(engine, t, entries[t.rel])
            for rel in links:
                with contextlib.suppress(FileExistsError):  # another rank of this node linked it first
                    trust.link_in(have[rel].parent, here.parent, f"{step}/{rel}")  # no link followed
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            problem = f"rank {me}: {e}"
    problems = [p for p in _gather(group, problem) if p]
    if problems:
        return None, "; ".join(problems[:3])
    pulled = sum(t.nbytes for t in recvs)
    return here, f"{len(recvs)} file(s), {pulled / 1e9:.3f} GB, pulled from other nodes' memory"
