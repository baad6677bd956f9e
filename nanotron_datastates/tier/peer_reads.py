"""A restart's files served from another rank's GPU: where a rank's node lacks a file that a rank of another
node reads ahead from its own node's memory (the same file: data-parallel replicas without ZeRO read every
file alike, with ZeRO-1 the weights), the reader sends what it read, already on its GPU and checked against
the manifest's checksums, to the rank that lacks it, over the restart's NCCL group (NVLink inside a node,
the network NCCL finds between nodes), instead of the file being pulled into the lacking node's memory and
read from there: the bytes cross host memory once, on the reader's node, rather than about eight times.

`plan` decides which files go that way (replica_restore.restart_source, the same on every rank);
`PeerReads.exchange` moves them, called by the read-ahead (resume/read_ahead.Prefetch.exchange) at two
points every rank's resume passes alike: where it loads its weights, and `Resume.confirm` (or the first use
of the optimizer state, where that comes first on every rank). Each pair of ranks first sends a JSON
description of each file's state (its skeleton, each tensor's dtype and shape, or why it could not be read);
the receiver answers whether it takes the bytes as described (not where the description does not fit its
plan or the manifest's sizes: then none follow, and nobody waits); then the tensors' bytes move, in the order
described. A file not handed over is read the ordinary way, which fails where the node lacks it, and every
rank falls back together (nanotron/resume/fallback.py). Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, TypedDict, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import skeleton
from ..checkpoint.reads import relative
from ..errors import FormatError

Spec = tuple[torch.dtype, list[int]]  # a tensor's dtype and shape, as a description gives them
# A send or a receive (dist.isend, dist.irecv) of a tensor's bytes, with the peer: `_run` makes it
Op = tuple[Callable[..., object], torch.Tensor, int]


class Holding(TypedDict):
    """What a rank tells the others at a restart (replica_restore.restart_source): its node, the files of the
    checkpoint its node holds whole in memory (`have`), those it reads (`needs`), and those it reads ahead,
    by kind (`ahead`)."""

    node: str
    have: list[str]
    needs: list[str]
    ahead: dict[str, list[str]]


@dataclasses.dataclass
class PeerReads:
    """This rank's files served between GPUs at a restart: `out[kind][peer]` the files (relative to the
    checkpoint) it sends to `peer` once read, `into[kind][peer]` those it receives from `peer` instead of
    reading them; `folder` the folder its read-ahead reads them in; `limits` each file's bytes in the
    manifest (a description of more is refused)."""

    group: ProcessGroup | None  # the restart's NCCL group
    folder: Path
    out: dict[str, dict[int, list[str]]]
    into: dict[str, dict[int, list[str]]]
    limits: dict[str, int]
    done: set[str] = dataclasses.field(default_factory=set)  # the kinds exchanged (each once)
    problems: list[str] = dataclasses.field(default_factory=list)  # files not handed over, and why
    received_bytes: int = 0

    def receives(self, path: Path) -> bool:
        """Whether the file `path` (in `folder`) comes from another rank's GPU rather than from a read."""
        (rel,) = relative([path], self.folder)
        return any(rel in rels for peers in self.into.values() for rels in peers.values())

    def exchange(self, kind: str, read: Mapping[Path, object], device: torch.device) -> dict[Path, object]:
        """Sends the states of `kind`'s files this rank serves (from `read`, by path; absent: could not be
        read) and returns those it receives, by path, on `device`. Once per kind; every rank that serves or
        receives files of `kind` calls it at the same point."""
        outs, ins = self.out.get(kind, {}), self.into.get(kind, {})
        if kind in self.done:
            return {}
        self.done.add(kind)
        if not (outs or ins):
            return {}
        # 1. each pair's description of the files, its length first; 2. the receiver's answer (1: the
        # bytes as described, 0: none, where the description does not fit); 3. the tensors' bytes.
        docs, sent = {}, {}
        for peer, rels in outs.items():
            states = {rel: read.get(self.folder / rel) for rel in rels}
            docs[peer], sent[peer] = _describe(states, self.limits)
        up = {p: torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device) for p, d in docs.items()}
        sizes = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in ins}
        lengths = {p: torch.tensor([d.numel()], dtype=torch.int64, device=device) for p, d in up.items()}
        _run(_ops(dist.isend, lengths) + _ops(dist.irecv, sizes), self.group)
        down = {p: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for p, t in sizes.items()}
        _run(_ops(dist.isend, up) + _ops(dist.irecv, down), self.group)
        # by peer: (file, skeleton or None where not handed over, its tensors)
        landing: dict[int, list[tuple[str, str | None, list[torch.Tensor]]]] = {}
        for p, doc in down.items():
            try:
                files = self._expect(p, ins[p], bytes(doc.cpu().numpy()))
            except FormatError as e:  # answered 0: the peer sends nothing more, and nobody waits
                self.problems.append(str(e))
                continue
            landing[p] = [(rel, skel, [torch.empty(s, dtype=d, device=device) for d, s in specs])
                          for rel, skel, specs in files]  # fmt: skip
        answers = {p: torch.tensor([int(p in landing)], dtype=torch.int64, device=device) for p in ins}
        heard = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in outs}
        _run(_ops(dist.isend, answers) + _ops(dist.irecv, heard), self.group)
        sent = {p: ts for p, ts in sent.items() if heard[p].item() == 1}
        into = {p: [t for _, _, ts in files for t in ts] for p, files in landing.items()}
        _run(_ops(dist.isend, sent) + _ops(dist.irecv, into), self.group)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        got: dict[Path, object] = {}
        for landed in landing.values():
            for rel, skel, tensors in landed:
                named = {str(i): t for i, t in enumerate(tensors)}
                try:
                    if skel is not None:
                        got[self.folder / rel] = skeleton.decode(skel, named)
                        self.received_bytes += sum(t.numel() * t.element_size() for t in tensors)
                except FormatError as e:
                    self.problems.append(f"{rel}: {e}")
        return got

    def _expect(self, peer: int, rels: list[str], doc: bytes) -> list[tuple[str, str | None, list[Spec]]]:
        """The files `peer` describes, checked: (name, skeleton or None where not handed over, specs)."""
        try:
            files = json.loads(doc)["files"]
            if not isinstance(files, dict) or sorted(files) != sorted(rels):
                raise ValueError(f"describes {sorted(files)[:3]}, not the files planned")
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"rank {peer}'s description of the files it serves: {e}") from None
        out: list[tuple[str, str | None, list[Spec]]] = []
        for rel in rels:
            entry = files[rel]
            if not isinstance(entry, dict) or "error" in entry:  # nothing of it follows
                why = entry.get("error") if isinstance(entry, dict) else "not described"
                self.problems.append(f"{rel} from rank {peer}: {why}")
                out.append((rel, None, []))
                continue
            specs = _specs(entry, rel, peer)
            if _nbytes(specs) > self.limits.get(rel, 0):  # its server refuses the same (`_describe`)
                raise FormatError(f"rank {peer} describes more of {rel} than the manifest's bytes")
            out.append((rel, str(entry.get("skeleton")), specs))
        return out


def plan(everyone: list[Holding], kinds: dict[tuple[int, str], str]) -> dict[tuple[int, str], int]:
    """Which files each rank receives from another rank's GPU: {(rank, file): server} for every (rank, file)
    of `kinds` (the read-ahead list, by kind, of a file its rank lacks and would pull) that a rank of another
    node reads ahead in the same list from its own node's memory; servers taken in turn. `everyone[r]`:
    rank r's `node`, `have` (its node's files), `ahead` ({kind: files it reads ahead})."""
    served: dict[tuple[int, str], int] = {}
    for (r, rel), kind in sorted(kinds.items()):
        servers = [
            q for q, o in enumerate(everyone)
            if o["node"] != everyone[r]["node"] and rel in o["have"] and rel in o["ahead"].get(kind, ())
        ]  # fmt: skip
        if servers:
            served[(r, rel)] = servers[len(served) % len(servers)]
    return served


def reads_of(
    served: dict[tuple[int, str], int], kinds: dict[tuple[int, str], str], me: int,
    group: ProcessGroup | None, folder: Path, limits: dict[str, int],
) -> PeerReads:  # fmt: skip
    """This rank's part of the plan `served`."""
    out: dict[str, dict[int, list[str]]] = {}
    into: dict[str, dict[int, list[str]]] = {}
    for (r, rel), q in sorted(served.items()):
        kind = kinds[(r, rel)]
        if q == me:
            out.setdefault(kind, {}).setdefault(r, []).append(rel)
        if r == me:
            into.setdefault(kind, {}).setdefault(q, []).append(rel)
    return PeerReads(group, folder, out, into, limits)


def _describe(states: dict[str, object], limits: dict[str, int]) -> tuple[bytes, list[torch.Tensor]]:
    """The JSON description of each file's state (None: could not be read) and its tensors, in order; a
    state of more bytes than its file's in the manifest (`limits`) is described as an error, not sent."""
    files: dict[str, object] = {}
    tensors: list[torch.Tensor] = []
    for rel, state in states.items():
        if state is None:
            files[rel] = {"error": "its server could not read it"}
            continue
        mine: list[torch.Tensor] = []
        names: dict[int, str] = {}

        def name(
            t: torch.Tensor, _: str, mine: list[torch.Tensor] = mine, names: dict[int, str] = names
        ) -> str:
            if id(t) not in names:  # a tensor met twice is sent once
                names[id(t)] = str(len(mine))
                mine.append(t.detach().contiguous())
            return names[id(t)]

        skel = skeleton.encode(state, name)
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in mine]
        nbytes = sum(t.numel() * t.element_size() for t in mine)
        if nbytes > limits.get(rel, 0):
            files[rel] = {"error": f"{nbytes} bytes read, {limits.get(rel, 0)} in the manifest"}
            continue
        files[rel] = {"skeleton": skel, "tensors": specs}
        tensors += mine
    return json.dumps({"files": files}).encode(), tensors


def _specs(entry: dict[str, object], rel: str, peer: int) -> list[Spec]:
    try:
        out = []
        described = entry.get("tensors", [])
        if not isinstance(described, list):
            raise TypeError(f"{described!r}")  # not a list of tensors
        for name, shape in described:
            dtype = getattr(torch, name) if isinstance(name, str) else None
            if not isinstance(dtype, torch.dtype) or not all(type(n) is int and n >= 0 for n in shape):
                raise ValueError(f"{name!r} {shape!r}")
            out.append((dtype, list(shape)))
        return out
    except (ValueError, TypeError, AttributeError) as e:
        raise FormatError(f"rank {peer}'s description of {rel}: a tensor of {e}") from None


def _nbytes(specs: list[Spec]) -> int:
    total = 0
    for dtype, shape in specs:
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += n
    return total


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, a view: every transfer is of bytes, whatever the dtype NCCL or gloo support."""
    return t.reshape(-1).view(torch.uint8)


def _ops(
    op: Callable[..., object], tensors: Mapping[int, Union[torch.Tensor, list[torch.Tensor]]]
) -> list[Op]:
    """`op` (send or receive) of each peer's tensor or tensors, as bytes, in order; none of no bytes."""
    out = []
    for peer, ts in tensors.items():
        out += [(op, _bytes_of(t), peer) for t in (ts if isinstance(ts, list) else [ts]) if t.numel()]
    return out


def _run(ops: list[Op], group: ProcessGroup | None) -> None:
    """Every send and receive of one exchange at once (a pair's in the order both list them); waits."""
    if ops:
        for work in dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in ops]):
            work.wait()
