"""Files moved between ranks for the memory replicas (replicas.py, replica_restore.py): each file sent is
mapped read-only from the tier, each file received goes into a new temporary beside its name (or an older
copy's file taken over), mapped, its memory reserved beside the transfer (replica_reserve.py); the ranks
agree that every rank could open all of its files before a byte moves (`open_all`); then a link (links.py)
moves them, gloo's by `move` here: every transfer at once, in waves of one chunk of each split over several
gloo groups, paced to a rate, each received file reported as its last byte lands (`landed`). A received
file is checked against its manifest entry before it is renamed into place (replica_check.py); a file
killed half received stays a temporary, never read, removed at the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import trust
from ..errors import DataStatesError
from .replica_reserve import Reservation, reserving, room

CHUNK = 64 << 20  # bytes a message carries
_temporaries = itertools.count()
_T = TypeVar("_T")


class ReplicaError(DataStatesError, RuntimeError):
    """A checkpoint could not be replicated (the message names the rank and the file)."""


@dataclasses.dataclass
class Transfer:
    """One file between two ranks: `peer` sends or receives it; `buf` its bytes, mapped."""

    peer: int
    rel: str
    nbytes: int
    buf: torch.Tensor | None = None
    temporary: Path | None = None  # a receive's, renamed to `into/rel` once checked
    into: Path | None = None
    donor: Path | None = None  # a receive's: an older copy's file to take over (its pages exist already)
    fd: int | None = None  # a receive's temporary, open while it is received into
    reservation: Reservation | None = None  # a receive's: how far its temporary's memory is reserved

    def writable(self, end: int) -> bool:
        """Whether bytes [0, end) of a receive's mapping may be written (waits for their reservation): False
        where its memory could not be reserved (the bytes are dropped; its check fails naming it)."""
        return self.reservation is None or self.reservation.wait(end)


# Called, from any thread, with each file received whole, as soon as it is (its check can start).
Landed = Callable[[Transfer], None]
# Called, from any thread, with a file being received and how many of its first bytes are in.
Arriving = Callable[[Transfer, int], None]


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
    parts = trust.name_parts(t.rel, str(folder))
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
    followed (trust.UntrustedPath). With `t.donor` (a file of an older copy in the same tier), that file is
    renamed to the temporary and overwritten instead: receiving into pages that exist runs at memory speed,
    where new pages of a tmpfs are allocated one fault at a time; a new file where the donor cannot be."""
    parts = (folder.name, *trust.name_parts(t.rel, str(folder)))  # from the private folder above
    tmp = Path(*parts[:-1], f".{parts[-1]}.dstmp.{os.getpid()}.{next(_temporaries)}")
    with trust.walk_dir(folder.parent, parts[:-1], create=True) as dir_fd:
        fd = _take_over(folder.parent, t.donor, tmp, dir_fd) if t.donor is not None else None
        if fd is None:
            fd = os.open(tmp.name, trust.NEW_FILE, 0o600, dir_fd=dir_fd)
    mapping = None
    try:
        os.ftruncate(fd, t.nbytes)
        mapping = mmap.mmap(fd, t.nbytes) if t.nbytes else None
    except BaseException:
        os.close(fd)
        trust.unlink_in(folder.parent, str(tmp))
        raise
    t.buf, t.temporary, t.into, t.fd = _as_tensor(mapping), folder.parent / tmp, folder, fd
    try:
        yield
    finally:
        t.buf, t.fd = None, None
        os.close(fd)
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        if t.temporary is not None:
            with contextlib.suppress(OSError):
                trust.unlink_in(folder.parent, str(tmp))


def _take_over(top: Path, donor: Path, tmp: Path, dir_fd: int) -> int | None:
    """The donor file (under `top`) renamed to `top/tmp` and opened (`dir_fd`: tmp's folder), or None where
    it cannot be: gone, not under `top`, or not a regular file of this user's once there (then removed)."""
    try:
        trust.rename_in(top, str(donor.relative_to(top)), str(tmp))
        fd = os.open(tmp.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(tmp.name, dir_fd=dir_fd)
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
        return fd
    os.close(fd)
    os.unlink(tmp.name, dir_fd=dir_fd)
    return None


def move(
    groups: Sequence[ProcessGroup],
    sends: list[Transfer],
    recvs: list[Transfer],
    gbps: float = 0.0,
    chunk: int = CHUNK,
    landed: Landed | None = None,
    arriving: Arriving | None = None,
) -> float:
    """Sends and receives every transfer's bytes at once, in waves of one chunk of each, each chunk split
    over `groups` (gloo groups over the same ranks: each has its own connections and I/O thread, so the
    pieces travel side by side); both ends list a pair's files in the same order and split alike, so gloo
    matches them in order. After each wave, calls `landed(t)` for each file received whole by then and
    `arriving(t, n)` for the others, and waits as long as keeps the bytes sent under `gbps` GB/s (0: no
    limit). Returns the seconds it took."""
    t0 = time.monotonic()
    sent = 0
    waves = max([-(-t.nbytes // chunk) for t in sends + recvs] or [0])
    ends = Landing([(t.nbytes, t) for t in recvs], landed, arriving)  # every file's chunk i in wave i
    ends.upto(0)
    dropped: list[torch.Tensor] = []  # received into where a file's memory could not be reserved
    for i in range(waves):
        lo, requests = i * chunk, []
        for ts, post in ((sends, dist.isend), (recvs, dist.irecv)):
            for t in ts:
                assert t.buf is not None
                for group, a, b in pieces(groups, lo, min(chunk, t.nbytes - lo)):
                    buf = t.buf[a:b]
                    if post is dist.irecv and not t.writable(b):
                        dropped = dropped or [torch.empty(chunk, dtype=torch.uint8)]
                        buf = dropped[0][: b - a]
                    requests.append(post(buf, t.peer, group=group))
                    sent += (b - a) if post is dist.isend else 0
        for r in requests:
            if r is not None:  # None: this rank is not in `group` (never here)
                r.wait()
        ends.upto(lo + chunk)
        pace(sent, gbps, t0)
    return time.monotonic() - t0


class Landing:
    """Calls `landed(t)` once for each transfer of `ends` ((offset of its last byte + 1, transfer)) once
    every byte before `upto`'s offset is in: the files received, as their bytes arrive in order; and
    `arriving(t, n)` for each transfer not landed yet whose first n > 0 bytes are in."""

    def __init__(
        self, ends: Sequence[tuple[int, Transfer]], landed: Landed | None, arriving: Arriving | None = None
    ):
        self.todo = sorted(ends, key=lambda e: e[0]) if landed or arriving else []
        self.landed, self.arriving = landed, arriving

    def upto(self, offset: int) -> None:
        while self.todo and self.todo[0][0] <= offset:
            t = self.todo.pop(0)[1]
            if self.landed is not None:
                self.landed(t)
        if self.arriving is not None:
            for end, t in self.todo:
                if end - t.nbytes < offset:
                    self.arriving(t, offset - (end - t.nbytes))


def pieces(groups: Sequence[_T], lo: int, n: int, align: int = 1 << 16) -> list[tuple[_T, int, int]]:
    """The bytes [lo, lo + n) split over `groups` as (group, start, end), in pieces of a multiple of `align`
    bytes but the last (fewer pieces than groups where `n` is small; none where n <= 0)."""
    if n <= 0:
        return []
    size = -(-n // len(groups))
    size = -(-size // align) * align
    return [(g, lo + a, lo + min(n, a + size)) for g, a in zip(groups, range(0, n, size))]


def pace(sent: int, gbps: float, t0: float) -> None:
    """Waits as long as keeps `sent` bytes since `t0` (time.monotonic) under `gbps` GB/s (0: no limit)."""
    if gbps > 0:
        ahead = sent / (gbps * 1e9) - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)


def open_all(
    stack: contextlib.ExitStack,
    group: ProcessGroup,
    sends: list[Transfer],
    folder_of: Callable[[Transfer], Path],
    recvs: list[Transfer],
    into: Path,
) -> list[str]:
    """Maps every file sent (from `folder_of(t)`) and creates every temporary received into (under `into`),
    held open by `stack`, their memory checked for (`room`) and reserved from now on, beside the transfer
    (replica_reserve.py); then the ranks agree: every rank's problems, the same list on all (empty: go).
    Everything is opened before any byte moves: a rank that could not would leave the others waiting."""
    problem = None
    try:
        for t in sends:
            stack.enter_context(_mapped_file(folder_of(t), t))
        for t in recvs:
            stack.enter_context(_temporary(into, t))
        room(recvs, into)
        stack.enter_context(reserving(recvs))
    except (OSError, ValueError, ReplicaError) as e:
        problem = f"rank {dist.get_rank(group)}: {e}"
    return [p for p in gather(group, problem) if p]


def gather(group: ProcessGroup, obj: _T) -> list[_T]:
    """Every rank's `obj`, by rank (collective over `group`)."""
    out = [obj] * dist.get_world_size(group)  # each replaced by its rank's
    dist.all_gather_object(out, obj, group=group)
    return out
