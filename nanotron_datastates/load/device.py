"""Reads to GPUs: the core reads with O_DIRECT (or through the page cache) into pinned cache chunks and
uploads into the destination tensors, summing each as it goes; what the last such read cost is kept per
thread for the resume's telemetry."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Mapping

import torch

from .. import format as fmt
from .checksums import _expected, _verify

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine

_last_device_read = threading.local()


@dataclasses.dataclass(frozen=True)
class DeviceRead:
    """The last read to GPUs on this thread: its bytes, the seconds spent waiting for work already queued on
    the destinations' streams (memory the allocator handed out may still be in use there), then reading."""

    nbytes: int
    stream_wait_s: float
    read_s: float


def last_device_read() -> DeviceRead | None:
    """What the last read to GPUs on the calling thread cost (None: none yet)."""
    return getattr(_last_device_read, "value", None)


def _read_to_device(
    core: CoreEngine,
    path: str,
    fd: int,
    header: fmt.Header,
    targets: Mapping[str, torch.Tensor],
    verify: bool,
    checksums: Mapping[str, int] | None,
    page_cache: bool = False,
) -> None:
    expected = _expected(path, header, checksums) if verify else None
    entries = [e for e in header.tensors if e.name in targets and e.nbytes]
    dests = [targets[e.name].reshape(-1).view(torch.uint8) for e in entries]
    t0 = time.perf_counter()
    for d in {t.device for t in dests}:
        # The core copies on its own stream: memory just handed out by the caching allocator may still be in
        # use by work queued on the current stream.
        torch.cuda.current_stream(d).synchronize()
    t1 = time.perf_counter()
    data_len = header.file_size - header.data_start
    begins = [e.begin for e in entries]
    sums = core.restore_device(
        path, header.data_start, data_len, begins, dests, expected is not None, fd=fd, page_cache=page_cache
    )
    _last_device_read.value = DeviceRead(sum(e.nbytes for e in entries), t1 - t0, time.perf_counter() - t1)
    if expected is not None:
        _verify(path, entries, expected, sums, dests)
        zero = [e for e in header.tensors if e.name in targets and not e.nbytes]
        _verify(path, zero, expected, [0] * len(zero))
