"""Resume, read ahead: this rank's weight files and optimizer shard are read onto its GPU on a thread of their
own, started before Nanotron builds the model, so that the disk works while the model is built. On another
layout, the checkpoint's files are read into the page cache instead (PageCacheWarmer).

A prefetch is only an optimization: whatever it could not read (no memory, a damaged file, another file than
the one wanted) the trainer reads again the ordinary way, which raises the error where there is one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import torch

from .. import state_parts, trust
from ..checkpoint.manifest import ManifestError, entries, entry_bytes, member
from ..engine import DataStatesEngine
from ..load import restore
from ..tier.peer_reads import PeerReads

log = logging.getLogger("nanotron_datastates")
_T = TypeVar("_T")


def warm_page_cache(paths: Iterable[Path]) -> int:
    """Reads these (small) files through the page cache now; returns the bytes read. Read after the read-ahead
    has filled the disk's queue, as the trainer reads the scheduler's, the random states' and the metadata
    files, each waits behind it (0 to 0.6 s in all on an H100); read before, they come from memory then. A
    file that cannot be read is skipped: it is read again where it is used, which raises its error."""
    buf = bytearray(1 << 20)
    return sum(_read_through(Path(p), buf) for p in paths)


def _read_through(path: Path, buf: bytearray, stop: threading.Event | None = None) -> int:
    """Reads `path` through the page cache into `buf`, chunk after chunk, until its end or `stop`; returns the
    bytes read (a file that cannot be read: those read before the error)."""
    total = 0
    with contextlib.suppress(OSError), os.fdopen(trust.open_to_read(path), "rb", buffering=0) as f:
        while stop is None or not stop.is_set():
            n = f.readinto(buf)
            if not n:
                break
            total += n
    return total


class PageCacheWarmer:
    """Reads files into the page cache on a thread of its own, for a resume on another layout: which saved
    tensors a rank needs depends on its model, built after the files could be read; every file is read, the
    node's ranks sharing them out (`share`: this process's index and the count), so that the node reads the
    checkpoint once while the model is built and the ranks' reads then come from memory. `stop` ends it early
    (the reads done by then stay cached). Unreadable files are skipped: they are read again where they are
    used, which raises the error."""

    CHUNK = 8 << 20

    def __init__(self, paths: list[Path], share: tuple[int, int] = (0, 1)) -> None:
        index, count = share
        self.paths = [p for i, p in enumerate(paths) if i % count == index]
        self.nbytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="datastates-warm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(self.CHUNK)
        for path in self.paths:
            self.nbytes += _read_through(path, buf, self._stop)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the reads to end; whether they did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def fits_in_memory(nbytes: int) -> bool:
    """Whether `nbytes` take at most half the memory the kernel reports available (`MemAvailable`)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return nbytes <= int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return False


def _local_place() -> tuple[int, int]:
    """This process's place among the node's ranks, as torchrun sets it: (local rank, local world size)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return int(os.environ.get("LOCAL_RANK", "0")) % local, local


def node_share() -> tuple[int, int] | None:
    """This process's share of the node's reads (local rank, local world size), where the job runs on one
    node only; None for a job of several nodes (each would read the whole checkpoint for a part of it)."""
    place = _local_place()
    return place if place[1] == int(os.environ.get("WORLD_SIZE", "1")) else None


def shared_weight_reads(topology: dict[str, int]) -> tuple[int, int] | None:
    """Where other ranks of the node read this rank's weight files too (data- or context-parallel replicas,
    more than one rank a node): this rank's place among the node's ranks (local rank, local world size), so
    that each reads them through the page cache starting at a file of its own and the disk reads each once
    (with O_DIRECT, every replica read every byte from the disk: four on one node, 2.2 GB each, at a quarter
    of its speed). None: none does."""
    place = _local_place()
    if topology.get("dp", 1) * topology.get("cp", 1) < 2 or place[1] < 2:
        return None
    return place


def warm_for_reshard(manifest: Mapping[str, object], folder: Path, in_memory: bool) -> PageCacheWarmer | None:
    """The checkpoint's weight and optimizer files read into the page cache while the model is built, shared
    out among the node's ranks, where the job runs on one node and they take at most half its available
    memory (from the memory tier they are in memory already)."""
    share, listed = node_share(), entries(manifest)
    names = [f for f in sorted(listed) if f.startswith(("model/", "optimizer/"))]
    try:
        nbytes = sum(entry_bytes(listed[f]) for f in names)
        if in_memory or share is None or not names or not fits_in_memory(nbytes):
            return None
        paths = [member(folder, f) for f in names]
    except ManifestError:
        return None  # the reads that follow report it
    return PageCacheWarmer(paths, share)


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:  # read again where it is used, which raises the error
        return 0


class Prefetch:
    """Reads `weights` (files, each a flat dict of tensors), then `optimizer` (its file, or its parts put
    together), onto `device`;
    `checksums(path)` gives the CRC-32C a weight file is checked against (None: those in the file). `shared`
    (this rank's index among the node's ranks, their count): other ranks of the node read the same weight
    files, so they are read through the page cache, starting at this rank's part of the list. `peer`: at a
    restart, the files other ranks' GPUs send this rank instead of its reading them, and those it sends
    them once read (tier/peer_reads.py), exchanged by `exchange`."""

    def __init__(
        self,
        engine: DataStatesEngine,
        device: torch.device,
        weights: list[Path],
        optimizer: Sequence[Path],
        checksums: Callable[[Path], dict[str, int] | None],
        shared: tuple[int, int] | None = None,
        peer: PeerReads | None = None,
    ) -> None:
        self._engine, self._device, self._checksums = engine, device, checksums
        self.shared, self.peer = shared, peer
        # by kind, what other ranks' GPUs sent (`exchange`)
        self._received: dict[str, dict[Path, object]] = {}
        weights = self._ours(weights)
        self._t0 = time.perf_counter()
        self.timings: dict[str, float] = {}  # seconds after the start: each read's end, each wait
        self._optimizer_rate = 0.0  # bytes per second of the optimizer file's own read
        self._optimizer_read: restore.DeviceRead | None = None  # its read to the GPU, within that
        self.nbytes = sum(_size(p) for p in [*weights, *self._ours(optimizer)])
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datastates-prefetch")
        # One thread, so the weights (needed first, once the model is built) are read before the optimizer.
        self._weights = pool.submit(self._read_weights, weights) if weights else None
        self._optimizer = pool.submit(self._read_optimizer, list(optimizer)) if optimizer else None
        pool.shutdown(wait=False)

    @property
    def reads_optimizer(self) -> bool:
        """Whether the optimizer state is being read (and not yet handed over)."""
        return self._optimizer is not None

    def weights(self) -> dict[Path, dict[str, torch.Tensor]]:
        """The weight files read, by path (empty where they could not be read), and those other ranks' GPUs
        sent (`exchange`); waits for them. Once only: the prefetch lets go of them, so that their memory goes
        back once the caller is done with them."""
        self.exchange("weights")
        future, self._weights = self._weights, None
        t = time.perf_counter()
        out = self._result(future, "weights") or {}
        self.timings["weights_waited"] = time.perf_counter() - t
        sent = self._received.pop("weights", {})  # each a weight file's state: a dict of tensors
        return {**out, **{path: state for path, state in sent.items() if isinstance(state, dict)}}

    def optimizer(self, paths: Sequence[Path]) -> object | None:
        """The optimizer state, if the files read are `paths`; waits for it. Once only, as :meth:`weights`."""
        self.exchange("optimizer")
        future, self._optimizer = self._optimizer, None
        t = time.perf_counter()
        got = self._result(future, "optimizer state")
        self.timings["optimizer_waited"] = time.perf_counter() - t
        read = {**(got[1] if got is not None else {}), **self._received.pop("optimizer", {})}
        if got is None or got[0] != list(paths) or not all(p in read for p in paths):
            return None
        return state_parts.merge([read[p] for p in paths])

    def exchange(self, kind: str) -> None:
        """Sends the files of `kind` (`weights`, `optimizer`) this rank serves other ranks' GPUs (`peer`)
        once it has read them, and receives those it is served. Every rank of the plan calls it at the same
        point of its resume, once per kind (where it loads its weights, and `Resume.confirm`; `weights` and
        `optimizer` call it too, so that it is done before they hand the state over). An error leaves the
        files out: the ordinary read that follows fails where they are not on this node, and the ranks fall
        back together."""
        if self.peer is None or self._device is None or kind in self.peer.done:
            return
        # waits for the read; an error is reported at its use
        read: Mapping[Path, object] = {}
        if kind == "weights":
            if self._weights is not None and self._weights.exception() is None:
                read = self._weights.result()
        elif self._optimizer is not None and self._optimizer.exception() is None:
            read = self._optimizer.result()[1]
        t = time.perf_counter()
        try:
            self._received[kind] = self.peer.exchange(kind, read, self._device)
        except Exception as e:  # noqa: BLE001 - read again the ordinary way, which reports the error
            log.warning("the %s other ranks' GPUs send could not be received (%s)", kind, e)
            self.peer.problems.append(f"the {kind}: {type(e).__name__}: {e}")
        self.timings[f"{kind}_exchanged"] = time.perf_counter() - t

    def _ours(self, paths: Sequence[Path]) -> list[Path]:
        """`paths` but those another rank's GPU sends (`peer`)."""
        return [p for p in paths if self.peer is None or not self.peer.receives(p)]

    def _result(self, future: concurrent.futures.Future[_T] | None, what: str) -> _T | None:
        if future is None:
            return None
        try:
            return future.result()
        except Exception as e:  # read again the ordinary way, which reports the error if there is one
            log.warning("reading the %s ahead failed (%s); reading it again", what, e)
            return None

    def _read_weights(self, paths: list[Path]) -> dict[Path, dict[str, torch.Tensor]]:
        shared = self.shared is not None

        def read(path: Path) -> dict[str, torch.Tensor]:
            self._on_device()
            checksums = self._checksums(path)
            return self._engine.load(path, self._device, checksums=checksums, page_cache=shared)

        if self.shared is not None:  # the node's ranks start apart: each file comes from the disk once
            index, count = self.shared
            first = index * len(paths) // count
            paths = paths[first:] + paths[:first]
        workers = self._engine.config.parser_thread_count
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="datastates-prefetch") as pool:
            out = dict(zip(paths, pool.map(read, paths)))
        self._synchronize()
        self.timings["weights_read"] = time.perf_counter() - self._t0
        return out

    def _read_optimizer(self, paths: list[Path]) -> tuple[list[Path], dict[Path, object]]:
        """(every part's path, the state of each this rank reads, by path: the others come from `peer`)."""
        self._on_device()
        t = time.perf_counter()
        state = {p: self._engine.load(p, self._device) for p in self._ours(paths)}
        self._optimizer_rate = sum(map(_size, state)) / max(time.perf_counter() - t, 1e-9)
        self._optimizer_read = restore.last_device_read()
        self._synchronize()
        self.timings["optimizer_read"] = time.perf_counter() - self._t0
        return paths, state

    def report(self) -> str:
        """When each read ended and how long the trainer waited for it, in seconds after the start, and the
        rate of the reads (bytes of all the files over the time until the last read ended): where that rate is
        the disk's, a resume cannot start sooner."""
        text = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in self.timings.items())
        ends = [v for k, v in self.timings.items() if k.endswith("_read")]
        if ends and max(ends) > 0:
            text += f"; {self.nbytes / 1e9:.2f} GB at {self.nbytes / max(ends) / 1e9:.2f} GB/s"
        if self._optimizer_rate:  # the one large file, read alone: the engine's own rate
            text += f" (the optimizer state's file at {self._optimizer_rate / 1e9:.2f} GB/s"
            r = self._optimizer_read
            if r is not None and r.read_s > 0:
                text += (
                    f"; its tensors' {r.nbytes / 1e9:.2f} GB read into GPU memory in {r.read_s:.2f} s, "
                    f"{r.nbytes / r.read_s / 1e9:.2f} GB/s, after {r.stream_wait_s:.2f} s waiting for the "
                    "GPU's queued work"
                )
            text += ")"
        if self.shared is not None:
            text += f"; weights through the page cache, shared with the node's {self.shared[1]} ranks"
        if self.peer is not None and (self.peer.received_bytes or self.peer.problems):
            text += f"; {self.peer.received_bytes / 1e9:.2f} GB from other ranks' GPUs"
            text += f" (not handed over: {'; '.join(self.peer.problems[:3])})" if self.peer.problems else ""
        return text

    def _on_device(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def _synchronize(self) -> None:
        if self._device.type == "cuda":  # the main thread's stream uses them next
            torch.cuda.current_stream(self._device).synchronize()


def fill(
    targets: list[tuple[torch.Tensor, Path]],
    ahead: dict[Path, dict[str, torch.Tensor]],
    engine: DataStatesEngine,
    checksums: Callable[[Path], dict[str, int] | None],
) -> None:
    """Fills each tensor with the `data` of its file: from what was read ahead (a copy on the device), else
    read now, several files at once. `ahead` is emptied (its memory goes back once the copies are done)."""

    def read(target: tuple[torch.Tensor, Path]) -> None:
        tensor, path = target
        got = ahead.get(path, {}).get("data")
        with torch.no_grad():
            if got is not None and got.shape == tensor.shape and got.dtype == tensor.dtype:
                tensor.copy_(got)
                return
            engine.load_into(path, {"data": tensor}, checksums=checksums(path))

    workers = engine.config.parser_thread_count
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="datastates-load") as pool:
        list(pool.map(read, targets))
    ahead.clear()
