"""Memory replicas at a restart (`restart_source`): every rank says which files of the checkpoint its node
holds whole in memory (its own tier's and the replicas', `node_copies`) and which it reads; each file a rank
reads and its node lacks is pulled from a rank whose node holds it, into the rank's own tier, checked against
the manifest, then renamed; a replica on the rank's own node is linked in. Every rank reads from memory, or,
where any file a rank needs is in no node's memory, every rank reads storage, and the log says which file
was missing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import trust
from ..checkpoint.manifest import Entries, entries, entry_bytes, manifest_step
from . import peer_reads
from .held_copy import held
from .links import GlooLink, Link
from .memory import MemoryTier
from .peer_reads import Holding, PeerReads
from .replica_check import Checks
from .replica_reserve import reserved_within
from .replica_transfer import Transfer, gather, open_all
from .replicas import node_key, replica_area

if TYPE_CHECKING:
    from ..engine import DataStatesEngine


def node_copies(tier: MemoryTier, manifest: Mapping[str, object]) -> dict[str, Path]:
    """Every file of the manifest's checkpoint this node holds whole in memory, with the folder it is in:
    its ranks' own copies (the tier's step folder) and the replicas it keeps for other nodes' ranks."""
    step = manifest_step(manifest)
    area = replica_area(tier, tier.rank)
    out = {rel: area.folder / str(step) for rel in held(area, step, manifest)}
    out.update({rel: tier.folder / str(step) for rel in held(tier, step, manifest)})
    return out


def restart_source(
    tier: MemoryTier,
    manifest: Mapping[str, object],
    needs: set[str],
    group: ProcessGroup,
    engine: DataStatesEngine,
    link: Link | None = None,
    ahead: dict[str, list[str]] | None = None,
    peer_group: ProcessGroup | None = None,
) -> tuple[Path | None, str, PeerReads | None]:
    """Where this rank reads the checkpoint `manifest` describes, why, and the files it sends to or receives
    from other ranks' GPUs: its node's tier folder of that step once every file each rank `needs` is there
    (pulled from another node's memory, or linked in from this node's replicas, as needed) or comes from the
    GPU of a rank of another node that reads it ahead from its node's memory (peer_reads.py: where this rank
    reads it ahead too, `ahead` by kind, and `peer_group` is given, the NCCL group it goes over), or None
    (storage) for every rank where any rank needs a file that is in no node's memory. Collective over
    `group` (gloo, every rank); the pulled bytes go over `link` (default: over `group`), unpaced: at a
    restart nothing else runs, and every rank waits for the slowest pull."""
    link = link if link is not None else GlooLink(group)
    step = manifest_step(manifest)
    have = node_copies(tier, manifest)
    mine_ahead = ahead if peer_group is not None and ahead else {}
    holding: Holding = {"node": node_key(), "have": sorted(have), "needs": sorted(needs), "ahead": mine_ahead}
    everyone = gather(group, holding)
    me = dist.get_rank(group)
    lacking: dict[tuple[int, str], str] = {}  # (rank, file) it lacks and reads ahead -> the read-ahead list
    for r, mine in enumerate(everyone):
        for kind, rels in mine["ahead"].items():
            lacking.update({(r, rel): kind for rel in set(rels) & set(mine["needs"]) - set(mine["have"])})
    served = peer_reads.plan(everyone, lacking)
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
                return None, f"rank {r} reads {rel}, which no node holds in memory", None
            if (r, rel) not in served:
                pulls.setdefault((mine["node"], rel), (r, servers[(r + len(pulls)) % len(servers)]))
    listed = entries(manifest)
    sends = [
        Transfer(r, rel, entry_bytes(listed[rel])) for (_, rel), (r, q) in sorted(pulls.items()) if q == me
    ]
    recvs = [
        Transfer(q, rel, entry_bytes(listed[rel])) for (_, rel), (r, q) in sorted(pulls.items()) if r == me
    ]
    here = tier.folder / str(step)
    problem, parts, t0 = None, [0.0] * 5, time.monotonic()
    with contextlib.ExitStack() as stack:
        problems = open_all(stack, group, sends, lambda t: have[t.rel], recvs, here)
        if problems:
            return None, "; ".join(problems[:3]), None
        parts[0] = time.monotonic() - t0
        try:  # each file checked as its bytes land, beside the rest of the transfer
            checks = stack.enter_context(Checks(engine, recvs, lambda t: listed[t.rel]))
            moving = time.monotonic()
            parts[1] = link.move(sends, recvs, landed=checks.landed, arriving=checks.arrived)
            parts[3:] = reserved_within(recvs, moving)
            placing = time.monotonic()
            checks.place()
            parts[2] = time.monotonic() - placing
            for rel in links:
                with contextlib.suppress(FileExistsError):  # another rank of this node linked it first
                    trust.link_in(have[rel].parent, here.parent, f"{step}/{rel}")  # no link followed
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            problem = f"rank {me}: {e}"
    t2 = time.monotonic()
    answers = gather(group, (problem, parts))
    problems = [p for p, _ in answers if p]
    if problems:
        return None, "; ".join(problems[:3]), None
    pulled, waited = sum(t.nbytes for t in recvs), time.monotonic() - t2
    limits = {rel: entry_bytes(listed[rel]) for (_, rel) in served}
    peer = peer_reads.reads_of(served, lacking, me, peer_group, here, limits)
    unmarked, received = "", {rel for (r, rel) in served if r == me}
    try:
        mark_held(tier, step, {rel: listed[rel] for rel in needs - received})
    except (OSError, ValueError) as e:  # the files serve this restart still; a second one reads storage
        unmarked = f"; not marked held ({e})"
    slowest = [max(a[1][i] for a in answers) for i in range(5)]
    sent, (opened, moved, checked, reserved, held) = sum(t.nbytes for t in sends), slowest
    gpu = sum(limits[rel] for (_, rel) in served) / 1e9
    why = (
        f"{len(recvs)} file(s), {pulled / 1e9:.3f} GB, pulled from other nodes' memory and {sent / 1e9:.3f} "
        f"GB sent to them in {parts[1]:.2f} s over {link.name}; the slowest rank opened its files in "
        f"{opened:.2f} s, moved them in {moved:.2f} s (their memory reserved {reserved:.2f} s into the move, "
        f"the copies waiting {held:.2f} s for it, all threads), had them checked {checked:.2f} s after; "
        f"this rank waited {waited:.2f} s for the others{unmarked}"
    )
    if served:
        why += f"; {len(served)} file(s), {gpu:.3f} GB, to go from the GPU of a rank reading them to "
        why += "ranks lacking them"
    return here, why, (peer if peer.out or peer.into else None)


def mark_held(tier: MemoryTier, step: int, files: Entries) -> None:
    """This rank's files of `step`, now whole in its node's tier (pulled, linked in, or its own), marked held
    by it, as its save would have: a second restart finds them, and the rank's first step does not make new
    files ahead as on a fresh start (save/memory.prepare_tier). After every rank's pull: a node-mate may have
    pulled some of them."""
    mine = tier.marked(step, tier.rank) or {}
    if not files.keys() <= mine.keys():
        tier.commit(step, {**mine, **files})
