"""The engine's reading methods: loads of whole files, into existing tensors, of named tensors or parts of
them, the check of a file end to end (whole, or in runs as its bytes arrive), and the header alone.
`DataStatesEngine` inherits them; each is the public face of a function of `restore` (which reads through
the engine's core).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from .. import format as fmt
from ..engine_settings import DataStatesConfig
from .restore import (
    load_file,
    load_into_tensors,
    load_range_list,
    load_ranges,
    load_tensors,
    read_structure,
    verify_file,
)
from .verify import FileCheck

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine

__all__ = ["EngineReads"]


class EngineReads:
    """The reading half of :class:`DataStatesEngine`, over its core, settings and closed flag."""

    config: DataStatesConfig
    _core: CoreEngine
    _closed: bool

    def load(
        self,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        *,
        verify: bool | None = None,
        allow_pickle: bool = False,
        checksums: Mapping[str, int] | None = None,
        page_cache: bool = False,
    ) -> Any:
        """Reads a file written by :meth:`save` (or any safetensors file) onto `device`, in parallel.

        Returns the saved structure (a dict of tensors for a plain safetensors file). Checksums are verified
        when the file holds them, or against `checksums` (name to CRC-32C, e.g. kept from a save with
        ``exact_metadata``); `verify` defaults to ``config.verify_checksums``. ChecksumError names the tensor.
        `page_cache`: read onto a GPU through the page cache even where the engine reads with O_DIRECT, for a
        file other processes of the node read too (the disk then reads it once).
        """
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums if verify is None else verify
        state, _ = load_file(
            self._core,
            path,
            device,
            verify=verify,
            allow_pickle=allow_pickle,
            checksums=checksums,
            page_cache=page_cache,
        )
        return state

    def load_into(
        self,
        path: str | os.PathLike,
        tensors: Mapping[str, torch.Tensor],
        *,
        verify: bool | None = None,
        checksums: Mapping[str, int] | None = None,
    ) -> None:
        """Reads the named tensors of a file into existing ones (same dtype and shape, contiguous): CUDA
        destinations are filled straight from the pinned cache, without a second allocation."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums if verify is None else verify
        load_into_tensors(self._core, path, tensors, verify=verify, checksums=checksums)

    def verify(
        self,
        path: str | os.PathLike,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
        *,
        callers: int = 1,
    ) -> bool:
        """Checks a file end to end: its header, its size, and every tensor's CRC-32C (stored in the file, or
        `checksums`, with their `block_checksums`). Raises FormatError, ChecksumError or OSError naming the
        file; returns whether any checksum was checked (False: a file without checksums, whose structure
        alone is sound). `callers` > 1: the tensors read in that many runs at once, for a large file when
        more CPUs are free than the engine's parser threads."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        header = verify_file(self._core, path, checksums, block_checksums, callers)
        return checksums is not None or header.checksums() is not None

    def check_in_runs(
        self,
        path: str | os.PathLike,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
        runs: int = 1,
    ) -> FileCheck:
        """:meth:`verify` in parts, for a file whose bytes arrive in order: the header read and the structure
        checked now, the tensors cut into `runs` runs, each read and checked by `check(run)` (from any thread)
        once the bytes up to `end(run)` are in, then `finish()`; close it (a context manager)."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        return FileCheck(self._core, path, checksums, block_checksums, runs)

    def load_tensors(
        self, path: str | os.PathLike, names: Iterable[str], *, checksums: Mapping[str, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Reads only the named tensors of a file onto the CPU (names as in the file: see
        :meth:`read_structure`), each checked against its checksum as :meth:`load` does."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        return load_tensors(self._core, path, names, verify=self.config.verify_checksums, checksums=checksums)

    def load_ranges(
        self,
        path: str | os.PathLike,
        ranges: Mapping[str, tuple[int, int]],
        *,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Elements [start, stop) of each named tensor, flattened, onto the CPU: a rank's part of a larger
        state. Files the engine writes hold a checksum per block (1 MiB at most), so only the blocks over
        each range are read and each is checked; for other files the whole tensor is read and checked. A file
        saved with `exact_metadata` is read in part with the `checksums` and `block_checksums` of its
        :class:`SaveHandle`."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums
        return load_ranges(
            self._core, path, ranges, verify=verify, checksums=checksums, block_checksums=block_checksums
        )

    def load_range_list(
        self,
        path: str | os.PathLike,
        items: Sequence[tuple[str, int, int]],
        *,
        checksums: Mapping[str, int] | None = None,
        block_checksums: tuple[int, Mapping[str, Sequence[int]]] | None = None,
    ) -> list[torch.Tensor]:
        """As :meth:`load_ranges`, for a list of (tensor name, start, stop) that may hold several ranges of
        one tensor; the tensors come back in the same order. One read of the file serves them all."""
        if self._closed:
            raise ValueError("the engine is closed; create a new DataStatesEngine")
        verify = self.config.verify_checksums
        return load_range_list(
            self._core, path, items, verify=verify, checksums=checksums, block_checksums=block_checksums
        )

    def read_structure(self, path: str | os.PathLike) -> Any:
        """The saved structure with a `TensorRef` (name in the file, dtype, shape) in place of each tensor:
        the header alone is read. With :meth:`load_tensors`, a part of a large state can be read."""
        return read_structure(path)

    def read_metadata(self, path: str | os.PathLike) -> dict[str, str]:
        """The file's ``__metadata__`` without the engine's own keys (no tensor is read)."""
        return fmt.read_header(path).user_metadata()
