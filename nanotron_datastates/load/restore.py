"""Load: read -> parse -> scatter.

The header is read and validated here (it is small). The core then reads the data section in parallel with
large requests: for the CPU, into a private mapping of the file (each tensor a separate storage over its
bytes; the mapping goes with the last of them); for a GPU, with O_DIRECT through pinned cache chunks into
tensors allocated there, or into the caller's own tensors (`load_into`). It returns one CRC-32C per tensor,
checked against the header or against checksums kept elsewhere. The skeleton then puts the tensors back into
the saved structure.

This module holds the whole-file loads; the pieces are beside it:
`opening` (the file and its header, the structure, allocation), `host` and `device` (the core's reads to
the host and to GPUs), `ranges` (parts of tensors), `checksums` (what a read is checked against), `verify`
(the check of a file end to end). Their names stay importable from here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .. import format as fmt
from .. import skeleton
from .checksums import _expected, _given_blocks, _segments, _verify
from .device import DeviceRead, _last_device_read, _read_to_device, last_device_read
from .host import _read_to_host, _typed, load_tensors
from .opening import TensorRef, _check_structure, _device, _opened, empty, read_structure
from .ranges import _merged, _range_list, _span, load_range_list, load_ranges
from .verify import verify_file

if TYPE_CHECKING:
    from .._core import Engine as CoreEngine

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
    core: CoreEngine,
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


def load_into_tensors(
    core: CoreEngine,
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
    core: CoreEngine,
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
