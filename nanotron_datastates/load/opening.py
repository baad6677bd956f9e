"""Opening a file to read: its header from the descriptor the data is read through, its structure, and the
device and tensors a load reads into."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

import torch

from .. import format as fmt
from .. import skeleton, trust


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[int, fmt.Header]]:
    """The file open once, and its header read from that descriptor: the core reads the data through it
    too, so that a file renamed over `path` meanwhile gives the old file or the new, never a mix."""
    fd = trust.open_to_read(path)  # a FIFO or folder: an error naming it, never a wait
    try:
        yield fd, fmt.read_header_fd(fd, path)
    finally:
        os.close(fd)  # a host mapping made from it stays valid


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
