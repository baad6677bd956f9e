"""The check of a file end to end (`verify_file`): its structure, every tensor's bytes against its checksum,
and its block checksums against the tensors'. `FileCheck` is that check in parts: the tensors cut into runs
that can be read and checked at once, or one by one as a file's bytes arrive in order (a replica received:
tier/replica_check.py), then `finish`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Mapping, Sequence

from .. import format as fmt
from .. import trust
from ..errors import ChecksumError
from .checksums import _given_blocks, _segments
from .host import _read_to_host
from .opening import _check_structure

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine


class FileCheck:
    """The check of the file `path` (its header read now, from the descriptor its runs read through), its
    tensors cut into `runs` runs of about equal bytes; `check(run)` reads and checks one (from any thread),
    `finish()` checks the block checksums once every run passed; `close()` (or the context) closes it."""

    def __init__(
        self,
        core: CoreEngine,
        path: str | os.PathLike,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
        runs: int = 1,
    ) -> None:
        self.core, self.path, self.checksums = core, os.fspath(path), checksums
        self.block_checksums = block_checksums
        self.fd = trust.open_to_read(self.path)  # a FIFO or folder: an error naming it, never a wait
        try:
            self.header = fmt.read_header_fd(self.fd, self.path)
            _check_structure(self.header, self.path)
        except BaseException:
            self.close()
            raise
        summed = checksums is not None or self.header.checksums() is not None
        self.runs = _runs(self.header.tensors, runs) if summed else []

    def end(self, run: Sequence[fmt.TensorEntry]) -> int:
        """The file offset just past the run's bytes."""
        return self.header.data_start + max((e.end for e in run), default=0)

    def check(self, run: Sequence[fmt.TensorEntry]) -> None:
        """Reads the run's tensors and checks each against its checksum (ChecksumError naming the file)."""
        _read_to_host(self.core, self.path, self.fd, self.header, True, self.checksums, run)

    def finish(self) -> None:
        """Once every run passed: each tensor's block checksums combine to its checksum."""
        if self.checksums is None:
            blocks, whole = self.header.block_checksums(), self.header.checksums()
        else:
            blocks = _given_blocks(self.path, self.header, self.block_checksums)
            whole = dict(self.checksums)
        if blocks is None or whole is None:
            return
        for e in self.header.tensors:
            if e.nbytes and _segments(e, e.begin, e.end, *blocks)[2] != whole[e.name]:
                raise ChecksumError(
                    f"{self.path}: the block checksums of tensor {e.name!r} do not combine to its checksum; "
                    "the header is corrupt"
                )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # a host mapping made from it stays valid
            self.fd = -1

    def __enter__(self) -> FileCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_file(
    core: CoreEngine,
    path: str | os.PathLike,
    checksums: Mapping[str, int] | None = None,
    block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    callers: int = 1,
) -> fmt.Header:
    """Reads every byte of the file and checks each tensor against its checksum (stored in the file or
    given), and that its block checksums (likewise) combine to it; FormatError, ChecksumError or OSError
    name the file. Returns the header; a file with no checksums, and none given, is only checked for
    structure. `callers`: the tensors split into that many runs of about equal bytes, read at once (each
    over the core's parser threads too): a large file checked by more threads than the core has."""
    with FileCheck(core, path, checksums, block_checksums, callers) as check:
        if len(check.runs) == 1:
            check.check(check.runs[0])
        elif check.runs:
            with ThreadPoolExecutor(len(check.runs), "datastates-verify") as pool:
                for done in [pool.submit(check.check, run) for run in check.runs]:
                    done.result()
        check.finish()
    return check.header


def _runs(entries: Sequence[fmt.TensorEntry], n: int) -> list[list[fmt.TensorEntry]]:
    """`entries` (in file order) cut into at most `n` runs of about equal bytes, none empty (one at least)."""
    total, runs, size = sum(e.nbytes for e in entries), [[]], 0  # type: ignore[var-annotated]
    for e in entries:
        if runs[-1] and size >= total * len(runs) / max(1, n):
            runs.append([])
        runs[-1].append(e)
        size += e.nbytes
    return runs
