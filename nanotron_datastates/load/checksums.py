"""The checksums a read is checked against: a tensor's CRC-32C (stored in the header or given), the block
checksums that let a part of a tensor be checked alone, and the error that names a tensor that fails."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .. import format as fmt
from ..errors import ChecksumError


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


def _segments(
    e: fmt.TensorEntry, lo: int, hi: int, size: int, sums: dict[str, list[int]]
) -> tuple[int, int, int]:
    """The block segments of `e` over bytes [lo, hi) of the data section: [begin, end) and their CRC."""
    from .. import _core

    first, last = lo // size, (hi - 1) // size
    skip = e.begin // size  # the tensor's first segment
    begin, end = max(e.begin, first * size), min(e.end, (last + 1) * size)
    crc = sums[e.name][first - skip]
    for k in range(first + 1, last + 1):
        crc = _core.crc32c_combine(crc, sums[e.name][k - skip], min(end, (k + 1) * size) - k * size)
    return begin, end, crc
