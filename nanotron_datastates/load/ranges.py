"""Partial reads to the host: elements [start, stop) of named tensors, flattened. Where block checksums are
known, only the block segments over each range are read, each checked; otherwise each tensor is read whole,
once, to be checked."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from .. import format as fmt
from ..errors import ChecksumError
from .checksums import _expected, _given_blocks, _segments
from .host import _typed
from .opening import _opened

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine


def load_ranges(
    core: CoreEngine,
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
    core: CoreEngine,
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
    core: CoreEngine,
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
