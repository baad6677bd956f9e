"""Load: read -> parse -> scatter.

The header is read and validated here (it is small). The core then reads the data section in parallel with
large requests: for the CPU, into a private mapping of the file (each tensor a separate storage over its
bytes; the mapping goes with the last of them); for a GPU, with O_DIRECT through pinned cache chunks into
tensors allocated there, or into the caller's own tensors (`load_into`). It returns one CRC-32C per tensor,
checked against the header or against checksums kept elsewhere. The skeleton then puts the tensors back into
the saved structure.

This module holds the whole-file loads and the check of a file end to end; the pieces are beside it:
`read_open` (the file and its header, the structure, allocation), `read_host` and `read_device` (the core's
reads to the host and to GPUs), `read_ranges` (parts of tensors), `read_checksums` (what a read is checked
against). Their names stay importable from here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch

from . import format as fmt
from . import skeleton
from .errors import ChecksumError
from .read_checksums import _expected, _given_blocks, _segments, _verify
from .read_device import DeviceRead, _last_device_read, _read_to_device, last_device_read
from .read_host import _read_to_host, _typed, load_tensors
from .read_open import TensorRef, _check_structure, _device, _opened, empty, read_structure
from .read_ranges import _merged, _range_list, _span, load_range_list, load_ranges

__all__ = [
    "DeviceRead",
    "TensorRef",
    "_check_structure",
    "_device",
    "_expected",
    "_given_blocks",
    "_last_device_read",
    "_load_into",
    "_merged",
    "_opened",
    "_range_list",
    "_read_to_device",
    "_read_to_host",
    "_segments",
    "_span",
    "_typed",
    "_verify",
    "empty",
    "last_device_read",
    "load_file",
    "load_into_tensors",
    "load_range_list",
    "load_ranges",
    "load_tensors",
    "read_structure",
    "verify_file",
]


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
    callers: int = 1,
) -> fmt.Header:
    """Reads every byte of the file and checks each tensor against its checksum (stored in the file or
    given), and that its block checksums (likewise) combine to it; FormatError, ChecksumError or OSError
    name the file. Returns the header; a file with no checksums, and none given, is only checked for
    structure. `callers`: the tensors split into that many runs of about equal bytes, read at once (each
    over the core's parser threads too): a large file checked by more threads than the core has."""
    path = os.fspath(path)
    with _opened(path) as (fd, header):
        _check_structure(header, path)
        if checksums is not None or header.checksums() is not None:
            runs = _runs(header.tensors, callers)
            if len(runs) == 1:
                _read_to_host(core, path, fd, header, True, checksums)
            else:
                with ThreadPoolExecutor(len(runs), "datastates-verify") as pool:
                    for done in [pool.submit(_read_to_host, core, path, fd, header, True, checksums, run)
                                 for run in runs]:  # fmt: skip
                        done.result()
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


def _runs(entries: Sequence[fmt.TensorEntry], n: int) -> list[list[fmt.TensorEntry]]:
    """`entries` (in file order) cut into at most `n` runs of about equal bytes, none empty (one at least)."""
    total, runs, size = sum(e.nbytes for e in entries), [[]], 0  # type: ignore[var-annotated]
    for e in entries:
        if runs[-1] and size >= total * len(runs) / max(1, n):
            runs.append([])
        runs[-1].append(e)
        size += e.nbytes
    return runs


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
