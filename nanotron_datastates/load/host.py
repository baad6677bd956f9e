"""Reads to the host: the core reads the data section into a private mapping of the file, each tensor a
separate storage over its bytes (the mapping goes with the last of them), checked against its checksum."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import torch

from .. import format as fmt
from .checksums import _expected, _verify
from .opening import _opened, empty

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine


def load_tensors(
    core: CoreEngine,
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


def _read_to_host(
    core: CoreEngine,
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
