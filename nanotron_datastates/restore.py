"""Load: read -> parse -> scatter.

The header is read and validated here (it is small). The core then reads the data section in parallel with
large requests: for the CPU, into a private mapping of the file (each tensor a separate storage over its
bytes; the mapping goes with the last of them); for a GPU, with O_DIRECT through pinned cache chunks into
tensors allocated there, or into the caller's own tensors (`load_into`). It returns one CRC-32C per tensor,
checked against the header or against checksums kept elsewhere. The skeleton then puts the tensors back into
the saved structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from . import format as fmt
from . import skeleton, trust
from .errors import ChecksumError

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


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[int, fmt.Header]]:
    """The file open once, and its header read from that descriptor: the core reads the data through it
    too, so that a file renamed over `path` meanwhile gives the old file or the new, never a mix."""
    fd = trust.open_to_read(path)  # a FIFO or folder: an error naming it, never a wait
    try:
        yield fd, fmt.read_header_fd(fd, path)
    finally:
        os.close(fd)  # a host mapping made from it stays valid


def load_file(
    core: Any,
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    checksums: Mapping[str, int] | None = None,
    page_cache: bool = False,
) -> tuple[Any, fmt.Header]:
    """The saved structure (a flat dict for plain safetensors files) and the file's header (`page_cache`:
    a read onto a GPU never with O_DIRECT)."""
    path = os.fspath(path)
    device = _device(device, path)
    with _opened(path) as (fd, header):
        if device.type == "cpu":
            tensors = _read_to_host(core, path, fd, header, verify, checksums)
        else:
            tensors = {e.name: empty(e.shape, e.dtype.torch, device) for e in header.tensors}
            _read_to_device(core, path, fd, header, tensors, verify, checksums, page_cache)
    skel = header.metadata.get(fmt.KEY_SKELETON)
    if skel is None:
        return tensors, header
    return skeleton.decode(skel, tensors, allow_pickle=allow_pickle, path=path), header


def verify_file(
    core: Any,
    path: str | os.PathLike,
    checksums: Mapping[str, int] | None = None,
    block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
) -> fmt.Header:
    """Reads every byte of the file and checks each tensor against its checksum (stored in the file or
    given), and that its block checksums (likewise) combine to it; FormatError, ChecksumError or OSError
    name the file. Returns the header; a file with no checksums, and none given, is only checked for
    structure."""
    path = os.fspath(path)
    with _opened(path) as (fd, header):
        _check_structure(header, path)
        if checksums is not None or header.checksums() is not None:
            _read_to_host(core, path, fd, header, True, checksums)
    if checksums is None:
        blocks, whole = header.block_checksums(), header.checksums()
    else:
        blocks, whole = _given_blocks(path, header, block_checksums), dict(checksums)
    if blocks is None or whole is None:
        return header
    for e in header.tensors:
        if e.nbytes and _segments(e, e.begin, e.end, *blocks)[2] != whole[e.name]:
            raise ChecksumError(
                f"{path}: the block checksums of tensor {e.name!r} do not combine to its checksum; the "
                "header is corrupt"
            )
    return header


def _check_structure(header: fmt.Header, path: str) -> None:
    """What `load` checks of the skeleton beyond the header (JSON, tags, base64, every tensor named held),
    without unpickling: `verify` says OK only for a file `load` reads."""
    skel = header.metadata.get(fmt.KEY_SKELETON)
    if skel is not None:
        skeleton.decode(skel, {e.name: None for e in header.tensors}, path=path, unpickle=False)


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor of a file, not read: its name in the file, dtype and shape (see :func:`read_structure`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_structure(path: str | os.PathLike) -> Any:
    """The saved structure with a TensorRef in place of each tensor; reads the header only."""
    path = os.fspath(path)
    header = fmt.read_header(path)
    refs = {e.name: TensorRef(e.name, e.dtype.torch, e.shape) for e in header.tensors}
    skel = header.metadata.get(fmt.KEY_SKELETON)
    return refs if skel is None else skeleton.decode(skel, refs, path=path)


def load_tensors(
    core: Any,
    path: str | os.PathLike,
    names: Iterable[str],
    *,
    verify: bool = True,
    checksums: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of these names only, on the CPU: only their bytes are read, each whole, so each is checked
    against its checksum. KeyError names a tensor the file does not hold."""
    path = os.fspath(path)
    with _opened(path) as (fd, header):
        by_name = {e.name: e for e in header.tensors}
        wanted = set(names)
        missing = sorted(wanted - set(by_name))
        if missing:
            raise KeyError(f"{path} holds no tensor {missing[0]!r}")
        entries = [e for e in header.tensors if e.name in wanted]
        return _read_to_host(core, path, fd, header, verify, checksums, entries)


def load_ranges(
    core: Any,
    path: str | os.PathLike,
    ranges: Mapping[str, tuple[int, int]],
    *,
    verify: bool = True,
    checksums: Mapping[str, int] | None = None,
    block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
) -> dict[str, torch.Tensor]:
    """Elements [start, stop) of each named tensor, flattened, on the CPU. Where the file holds block
    checksums (or `block_checksums` are given with `checksums`, for a file that keeps them elsewhere), only
    the block segments over the range are read, and each is checked; otherwise the whole tensor is read and
    checked. KeyError names a tensor the file does not hold, ValueError a range outside it."""
    items = [(name, start, stop) for name, (start, stop) in ranges.items()]
    got = load_range_list(
        core, path, items, verify=verify, checksums=checksums, block_checksums=block_checksums
    )
    return dict(zip(ranges, got))


def load_range_list(
    core: Any,
    path: str | os.PathLike,
    items: Sequence[tuple[str, int, int]],
    *,
    verify: bool = True,
    checksums: Mapping[str, int] | None = None,
    block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
) -> list[torch.Tensor]:
    """As `load_ranges`, for any number of (tensor name, start, stop), several of one tensor included,
    returned in order. A tensor's ranges that overlap or touch are read as one."""
    path = os.fspath(path)
    with _opened(path) as (fd, header):
        return _range_list(core, path, fd, header, items, verify, checksums, block_checksums)


def _range_list(
    core: Any,
    path: str,
    fd: int,
    header: fmt.Header,
    items: Sequence[tuple[str, int, int]],
    verify: bool,
    checksums: Mapping[str, int] | None,
    block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None,
) -> list[torch.Tensor]:
    by_name = {e.name: e for e in header.tensors}
    for name, start, stop in items:
        e = by_name.get(name)
        if e is None:
            raise KeyError(f"{path} holds no tensor {name!r}")
        if not 0 <= start <= stop <= e.numel:
            raise ValueError(f"{path}: elements [{start}, {stop}) are outside tensor {name!r} of {e.numel}")
    expected = _expected(path, header, checksums) if verify else None
    blocks = None
    if expected is not None and checksums is None:
        blocks = header.block_checksums()
    elif expected is not None:
        blocks = _given_blocks(path, header, block_checksums)
    if expected is not None and blocks is None:  # each tensor read whole to be checked: once
        wanted = [(by_name[n], 0, by_name[n].numel) for n in dict.fromkeys(n for n, a, b in items if b > a)]
    else:
        wanted = [(by_name[n], a, b) for n, a, b in _merged(items)]
    spans = [_span(e, start, stop, expected, blocks) for e, start, stop in wanted]
    data_len = header.file_size - header.data_start
    begins, ends = [b for b, _, _ in spans], [x for _, x, _ in spans]
    raws, sums = core.restore_host(
        path, header.data_start, data_len, begins, ends, expected is not None, fd=fd
    )
    sums = sums if expected is not None else [0] * len(spans)
    read: dict[str, list[tuple[int, torch.Tensor]]] = {}  # name -> [(first element, elements)]
    for (e, start, stop), (begin, end, crc), raw, got in zip(wanted, spans, raws, sums):
        if crc is not None and got != crc:
            raise ChecksumError(
                f"{path}: tensor {e.name!r} fails its checksum over bytes [{begin}, {end}) of the data "
                f"section (stored {crc:08x}, read {got:08x}); the file is corrupt"
            )
        lo = e.begin + start * e.dtype.itemsize - begin
        part = raw[lo : lo + (stop - start) * e.dtype.itemsize]
        read.setdefault(e.name, []).append(
            (start, _typed(part, header.data_start + begin + lo, e, (stop - start,)))
        )
    out = []
    for name, start, stop in items:
        if stop == start:
            out.append(torch.empty(0, dtype=by_name[name].dtype.torch))
            continue
        first, t = next((a, t) for a, t in read[name] if a <= start and stop <= a + t.numel())
        out.append(t[start - first : stop - first])
    return out


def _merged(items: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Each tensor's non-empty ranges, those that overlap or touch merged: disjoint, so that the spans read
    for them rise in both begin and end."""
    out: list[tuple[str, int, int]] = []
    for name, start, stop in sorted((n, a, b) for n, a, b in items if b > a):
        if out and out[-1][0] == name and start <= out[-1][2]:
            out[-1] = (name, out[-1][1], max(out[-1][2], stop))
        else:
            out.append((name, start, stop))
    return out


def _given_blocks(
    path: str, header: fmt.Header, given: tuple[int, Mapping[str, Sequence[int]]] | None
) -> tuple[int, dict[str, list[int]]] | None:
    if given is None:
        return None
    size, sums = given
    fits = size >= 4096 and not size & (size - 1) and set(sums) == {e.name for e in header.tensors}
    if not fits or any(len(sums[e.name]) != fmt.segments(e.begin, e.nbytes, size) for e in header.tensors):
        raise ChecksumError(f"{path}: the block checksums given do not fit the file's tensors")
    return size, {name: list(v) for name, v in sums.items()}


def _span(
    e: fmt.TensorEntry,
    start: int,
    stop: int,
    expected: Mapping[str, int] | None,
    blocks: tuple[int, dict[str, list[int]]] | None,
) -> tuple[int, int, int | None]:
    """The bytes [begin, end) of the data section to read for elements [start, stop) of `e`, and the CRC
    they must have (None: not verified): the whole tensor, or with block checksums the segments over it."""
    lo, hi = e.begin + start * e.dtype.itemsize, e.begin + stop * e.dtype.itemsize
    if expected is None:
        return lo, hi, None
    if blocks is None:
        return e.begin, e.end, expected[e.name]
    return _segments(e, lo, hi, *blocks)


def _segments(
    e: fmt.TensorEntry, lo: int, hi: int, size: int, sums: dict[str, list[int]]
) -> tuple[int, int, int]:
    """The block segments of `e` over bytes [lo, hi) of the data section: [begin, end) and their CRC."""
    from . import _core

    first, last = lo // size, (hi - 1) // size
    skip = e.begin // size  # the tensor's first segment
    begin, end = max(e.begin, first * size), min(e.end, (last + 1) * size)
    crc = sums[e.name][first - skip]
    for k in range(first + 1, last + 1):
        crc = _core.crc32c_combine(crc, sums[e.name][k - skip], min(end, (k + 1) * size) - k * size)
    return begin, end, crc


def load_into_tensors(
    core: Any,
    path: str | os.PathLike,
    targets: Mapping[str, torch.Tensor],
    *,
    verify: bool = True,
    checksums: Mapping[str, int] | None = None,
) -> None:
    """Fills `targets` (tensor name in the file -> destination of the same dtype and shape)."""
    path = os.fspath(path)
    with _opened(path) as (fd, header):
        _load_into(core, path, fd, header, targets, verify, checksums)


def _load_into(
    core: Any,
    path: str,
    fd: int,
    header: fmt.Header,
    targets: Mapping[str, torch.Tensor],
    verify: bool,
    checksums: Mapping[str, int] | None,
) -> None:
    by_name = {e.name: e for e in header.tensors}
    for name, t in targets.items():
        e = by_name.get(name)
        if e is None:
            raise KeyError(f"{path} holds no tensor {name!r}")
        if t.dtype != e.dtype.torch or tuple(t.shape) != e.shape or not t.is_contiguous():
            raise ValueError(
                f"{path}: tensor {name!r} is {e.dtype.name}{list(e.shape)}; the destination is "
                f"{t.dtype}{list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )
    if targets and all(t.device.type == "cuda" for t in targets.values()):
        _read_to_device(core, path, fd, header, targets, verify, checksums)
        return
    loaded = _read_to_host(core, path, fd, header, verify, checksums)
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(loaded[name])


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous tensor of exactly this dtype and device. Not `torch.empty`: Nanotron replaces it,
    process-wide, while it builds a model (forcing the model's dtype: a resume reading ahead on another thread
    meanwhile got bf16 tensors for fp32 state), and other libraries patch it likewise."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    t = torch.empty_strided(tuple(shape), tuple(reversed(strides)), dtype=dtype, device=device)
    if t.dtype != dtype or t.device != device or tuple(t.shape) != tuple(shape):
        raise RuntimeError(
            f"allocating {dtype}{list(shape)} on {device} gave {t.dtype}{list(t.shape)} on {t.device}: "
            "torch.empty_strided is patched by another library"
        )
    return t


def _device(device: str | torch.device, path: str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot load {path} to {device}: CPU and CUDA only")
    return device


def _expected(path: str, header: fmt.Header, checksums: Mapping[str, int] | None) -> dict[str, int] | None:
    expected = dict(checksums) if checksums is not None else header.checksums()
    if expected is not None and set(expected) != {e.name for e in header.tensors}:
        raise ChecksumError(f"{path}: the checksums given do not name the file's tensors")
    return expected


def _verify(
    path: str,
    entries: list[fmt.TensorEntry],
    expected: Mapping[str, int],
    sums: list[int],
    read: list[torch.Tensor] | None = None,
) -> None:
    """`read`: the bytes as read (uint8, one tensor per entry), quoted in the error to tell a damaged file
    from a damaged read."""
    for i, (e, got) in enumerate(zip(entries, sums)):
        if got != expected[e.name]:
            head = ""
            if read is not None:
                data = read[i].reshape(-1)[:16].cpu().tolist()
                head = f", {read[i].numel()} bytes read beginning {bytes(data).hex(' ')}"
            raise ChecksumError(
                f"{path}: tensor {e.name!r} fails its checksum (stored {expected[e.name]:08x}, read "
                f"{got:08x}{head}); the file is corrupt"
            )


def _read_to_host(
    core: Any,
    path: str,
    fd: int,
    header: fmt.Header,
    verify: bool,
    checksums: Mapping[str, int] | None,
    entries: Sequence[fmt.TensorEntry] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, or `entries` only (in file order)."""
    expected = _expected(path, header, checksums) if verify else None
    entries = list(header.tensors if entries is None else entries)
    data_len = header.file_size - header.data_start
    begins, ends = [e.begin for e in entries], [e.end for e in entries]
    raws, sums = core.restore_host(
        path, header.data_start, data_len, begins, ends, expected is not None, fd=fd
    )
    if expected is not None:
        _verify(path, entries, expected, sums, raws)
    return {e.name: _typed(raw, header.data_start + e.begin, e) for e, raw in zip(entries, raws)}


def _read_to_device(
    core: Any,
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


def _typed(
    raw: torch.Tensor, file_offset: int, e: fmt.TensorEntry, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The tensor (of `shape`, default the entry's) over its bytes in the file mapping, or a copy where they
    are not naturally aligned (never for files written by the engine or by safetensors: only when the file
    offset is misaligned)."""
    shape = e.shape if shape is None else shape
    if file_offset % e.dtype.itemsize == 0:
        return raw.view(e.dtype.torch).view(shape)
    out = empty(shape, e.dtype.torch, torch.device("cpu"))
    out.reshape(-1).view(torch.uint8).copy_(raw)
    return out
