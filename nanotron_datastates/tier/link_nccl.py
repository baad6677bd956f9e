"""Replicas' bytes through the GPUs (`NcclLink`): NCCL send and receive on a group and CUDA streams of their
own, through a bounded set of buffers (`slots` of `chunk` bytes per peer and direction, pinned on the host and
on the GPU), so that peers of one node go over NVLink and peers of other nodes over the network NCCL finds
(RDMA where the cluster has it).

Each peer's files, in the order both ends list them, are one stream of bytes cut into chunks; a wave moves
one chunk of each stream at once (one NCCL group call). A chunk sent: copied from the tier's mapping into a
pinned slot (in pieces, by a pool of threads, with stores that bypass the caches: copies in host memory are
the slowest hop), copied to the GPU on the `up` stream, sent. A chunk received: received on the GPU, copied
to a pinned slot on the `down` stream, copied into the mapping of its temporary by the pool. The GPU runs up
to `slots` waves ahead of the host copies; a slot is filled again only once the GPU has read it, and written
again only once the pool has emptied it (CUDA events, and the pool's futures).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import _core
from ..engine_settings import rank_share
from .replica_transfer import Arriving, Landed, Landing, Transfer, pace
from .step_order import StepOrder

CHUNK = 32 << 20  # bytes of a slot: NCCL moves 32 MiB messages near the link's peak
SLOTS = 4  # waves the stream runs ahead of the host copies
TRAINING_SLOTS = 8  # while training runs, waves ready for one optimizer step to make (256 MiB a peer)
PIECE = 8 << 20  # bytes of a chunk one host thread copies: a wave's chunks spread over the threads


def default_threads() -> int:
    """Host copies at once: one thread copies about 5 GB/s between pinned and mapped memory, an NVLink or a
    400 Gb/s NIC carries tens; up to 12 a rank, from the CPUs the node's ranks (torchrun's LOCAL_WORLD_SIZE)
    share, 2 of each rank's left to training."""
    return max(2, min(12, rank_share() - 2))


@dataclasses.dataclass
class _Stream:
    """One peer's files in one direction, laid end to end."""

    peer: int
    files: list[Transfer]
    starts: list[int]  # each file's offset in the stream
    total: int

    @classmethod
    def of(cls, transfers: list[Transfer]) -> list[_Stream]:
        out: dict[int, _Stream] = {}
        for t in transfers:
            s = out.setdefault(t.peer, cls(t.peer, [], [], 0))
            s.files.append(t)
            s.starts.append(s.total)
            s.total += t.nbytes
        return list(out.values())

    def size(self, wave: int, chunk: int) -> int:
        return max(0, min(chunk, self.total - wave * chunk))

    def copy(self, wave: int, chunk: int, slot: torch.Tensor, into_slot: bool, part: tuple[int, int]) -> None:
        """The bytes [a, b) of the wave's chunk between the files' mappings and `slot` (into it, or out)."""
        base = wave * chunk
        lo, hi = base + part[0], base + min(part[1], self.size(wave, chunk))
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while lo < hi:
            t, start = self.files[i], self.starts[i]
            n = min(hi, start + t.nbytes) - lo
            if n > 0:
                assert t.buf is not None
                mapped, at = t.buf[lo - start : lo - start + n], lo - base
                if into_slot:
                    streamed(slot[at : at + n], mapped)
                elif t.writable(lo - start + n):  # else dropped: its memory could not be reserved
                    streamed(mapped, slot[at : at + n])
                lo += n
            i += 1

    def parts(self, wave: int, chunk: int) -> list[tuple[int, int]]:
        """The wave's chunk in pieces a thread each (PIECE bytes)."""
        return [(a, a + PIECE) for a in range(0, self.size(wave, chunk), PIECE)]


class NcclLink:
    """Moves files between ranks over `group` (an NCCL group over every rank, made for this link only) on
    `device`. One transfer at a time (the replicator's thread, or the restart). `order`: while training
    runs, each wave's NCCL calls are made by the training thread at an optimizer step (step_order.py)."""

    name = "nccl"

    def __init__(
        self,
        group: ProcessGroup,
        device: torch.device,
        chunk: int = CHUNK,
        slots: int = SLOTS,
        threads: int | None = None,
        order: StepOrder | None = None,
    ) -> None:
        if device.index is None:  # `cuda`: the current device, named (threads other than this one use it)
            device = torch.device("cuda", torch.cuda.current_device())
        self.group, self.device, self.chunk, self.slots = group, device, chunk, slots
        self.order = order  # while training runs: the NCCL calls made by the training thread at its steps
        # Copies to the GPU (and NCCL's calls after them) on one stream, copies back on another: a wave's
        # copy back overlaps the next one's copy in, each on a copy engine of its own.
        self.up, self.down = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
        # Its threads wait on CUDA events: on this device, where a thread's default would open device 0.
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(
            self.threads, "datastates-replica-copy", initializer=torch.cuda.set_device, initargs=(device,)
        )
        self._buffers: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {"out": [], "in": []}

    def reserve(self, outs: int, ins: int) -> None:
        """Buffers for `outs` peers sent to and `ins` received from, made now: pinning memory holds the CUDA
        driver's locks, which a training step would wait on, so it is done before training where it can."""
        for way, n in (("out", outs), ("in", ins)):
            while len(self._buffers[way]) < n:
                self._buffers[way].append(
                    [
                        (
                            torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True),
                            torch.empty(self.chunk, dtype=torch.uint8, device=self.device),
                        )
                        for _ in range(self.slots)
                    ]
                )

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def move(
        self,
        sends: list[Transfer],
        recvs: list[Transfer],
        gbps: float = 0.0,
        waves: int = 0,
        landed: Landed | None = None,
        arriving: Arriving | None = None,
    ) -> float:
        """Sends and receives every transfer's bytes at once (both ends list a pair's files in the same
        order); keeps the bytes sent under `gbps` GB/s (0: no limit). With `order`, each wave's NCCL calls
        are made at an optimizer step (step_order.py), and `waves` (at least this rank's own) is the count
        every rank agreed on, so that the k-th call of every rank is the same wave. `landed(t)` is called
        (from a copying thread) for each file received whole, as soon as it is, `arriving(t, n)` as its
        first n bytes are. Returns the seconds."""
        t0 = time.monotonic()
        torch.cuda.set_device(self.device)  # this thread's device: NCCL calls need it
        outs, ins = _Stream.of(sends), _Stream.of(recvs)
        self.reserve(len(outs), len(ins))
        c, slots = self.chunk, self.slots
        out_bufs, in_bufs = self._buffers["out"], self._buffers["in"]
        waves = max([waves] + [-(-s.total // c) for s in outs + ins])
        # Blocking events: a copying thread that waits on one sleeps where CUDA's default would spin a core
        # beside training.
        read = [torch.cuda.Event(blocking=True) for _ in range(slots)]  # the GPU has read the wave's slots
        written = [torch.cuda.Event(blocking=True) for _ in range(slots)]  # the GPU has written them
        fills: dict[int, list[Future]] = {}
        drains: dict[int, list[Future]] = {}
        made: dict[int, Future[list[dist.Work]]] = {}  # each wave's NCCL calls: their works, once made
        drained = _Drained(
            [Landing([(a + t.nbytes, t) for t, a in zip(s.files, s.starts)], landed, arriving) for s in ins],
            c,
        )

        def fill(wave: int) -> None:  # the wave's chunks sent, into their slots, once the GPU has read them
            if wave < waves:
                k = wave % slots
                fills[wave] = [
                    self._pool.submit(_after, read[k], s.copy, wave, c, out_bufs[j][k][0], True, part)
                    for j, s in enumerate(outs)
                    for part in s.parts(wave, c)
                ]

        def land(wave: int) -> None:  # the wave's chunks received, back to the host, once its calls are made
            k = wave % slots
            works = made.pop(wave).result()
            with torch.cuda.stream(self.down):
                for work in works:
                    work.wait()  # `down` waits for NCCL's stream; the host does not
                for f in drains.pop(wave - slots, []):  # the pinned slots this wave receives into
                    f.result()
                for j, s in enumerate(ins):
                    if n := s.size(wave, c):
                        host, gpu = in_bufs[j][k]
                        host[:n].copy_(gpu[:n], non_blocking=True)
                written[k].record(self.down)
            drains[wave] = [
                self._pool.submit(_after, written[k], s.copy, wave, c, in_bufs[j][k][0], False, part)
                for j, s in enumerate(ins)
                for part in s.parts(wave, c)
            ]
            drained.watch(wave, drains[wave])

        sent = 0
        try:
            for wave in range(min(slots, waves)):
                fill(wave)
            for wave in range(waves):
                k = wave % slots
                if wave >= slots:
                    land(wave - slots)  # the slot's last wave: its copy back queued (`written`)
                for f in fills.pop(wave):
                    f.result()
                ops = []
                with torch.cuda.stream(self.up):
                    self.up.wait_event(written[k])  # wave - slots: its NCCL calls and copies to the host done
                    for j, s in enumerate(outs):
                        if n := s.size(wave, c):
                            host, gpu = out_bufs[j][k]
                            gpu[:n].copy_(host[:n], non_blocking=True)
                            ops.append(dist.P2POp(dist.isend, gpu[:n], s.peer, self.group))
                            sent += n
                    read[k].record(self.up)
                    fill(wave + slots)
                    for j, s in enumerate(ins):
                        if n := s.size(wave, c):
                            ops.append(dist.P2POp(dist.irecv, in_bufs[j][k][1][:n], s.peer, self.group))
                made[wave] = self._make(ops)
                pace(sent, gbps, t0)
            for wave in sorted(made):
                land(wave)
            for futures in list(drains.values()):
                for f in futures:
                    f.result()
        finally:  # nothing of this move left running on the buffers
            for futures in (*fills.values(), *drains.values()):
                for f in futures:
                    f.cancel()
                    if not f.cancelled():
                        f.exception()
            self.up.synchronize()
            self.down.synchronize()
        return time.monotonic() - t0

    def _make(self, ops: list[dist.P2POp]) -> Future[list[dist.Work]]:
        """A wave's NCCL calls (after `up`'s copies, on NCCL's stream): made now, or by the training thread
        at an optimizer step (`order`); the future holds their works."""

        def call() -> list[dist.Work]:
            with torch.cuda.device(self.device), torch.cuda.stream(self.up):
                return dist.batch_isend_irecv(ops) if ops else []

        if self.order is not None:
            return self.order.submit(call)
        done: Future[list[dist.Work]] = Future()
        done.set_result(call())
        return done


class _Drained:
    """The waves whose received chunks are in the files' mappings: once waves 0..n-1 all are, each stream's
    files that end within its first n chunks are reported landed (`Landing`)."""

    def __init__(self, ends: list[Landing], chunk: int) -> None:
        self.ends, self.chunk, self.done, self.prefix = ends, chunk, set[int](), 0
        self._lock = threading.Lock()
        self._advance(-1)  # files of no bytes at the start of a stream

    def watch(self, wave: int, copies: list[Future]) -> None:
        """`copies`: the wave's copies into the mappings (none: it received nothing)."""
        left = [len(copies)]

        def one(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                with self._lock:
                    left[0] -= 1
                    if left[0] == 0:
                        self._advance(wave)

        if not copies:
            with self._lock:
                self._advance(wave)
        for f in copies:
            f.add_done_callback(one)

    def _advance(self, wave: int) -> None:  # holding the lock
        if wave >= 0:
            self.done.add(wave)
        while self.prefix in self.done:
            self.done.remove(self.prefix)
            self.prefix += 1
        for e in self.ends:
            e.upto(self.prefix * self.chunk)


def streamed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` (host memory, contiguous, of one dtype and size) with non-temporal stores: a slot or a
    mapping written once and read next by the DMA or another process costs no read of its lines first, one
    pass of host memory fewer than a plain copy (`copy_streaming`)."""
    host = dst.device.type == src.device.type == "cpu"
    same = host and dst.dtype == src.dtype and dst.numel() == src.numel()
    if not (same and dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"a streamed copy needs contiguous host runs of one size: {dst.shape}, {src.shape}")
    if dst.numel():
        _core.copy_streaming(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


def _after(event: torch.cuda.Event, copy: Callable[..., None], *args: object) -> None:
    event.synchronize()
    copy(*args)
