"""Load: read -> parse -> scatter.

The header is read and validated here (it is small); the tensors are allocated on the target device and the
core fills them in parallel (io_uring reads straight into host tensors, through pinned cache chunks into CUDA
ones), returning one CRC-32C per tensor, which is checked against the header. The skeleton then puts the
tensors back into the saved structure.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import format as fmt
from . import skeleton
from .errors import ChecksumError


def load_file(
    core: Any,
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    verify: bool = True,
    allow_pickle: bool = False,
) -> tuple[Any, fmt.Header]:
    path = os.fspath(path)
    header = fmt.read_header(path)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot load {path} to {device}: CPU and CUDA only")

    tensors: dict[str, torch.Tensor] = {}
    offsets: list[int] = []
    dests: list[torch.Tensor] = []
    index: list[fmt.TensorEntry] = []
    for e in header.tensors:
        t = torch.empty(e.shape, dtype=e.dtype.torch, device=device)
        tensors[e.name] = t
        if e.nbytes:
            offsets.append(header.data_start + e.begin)
            dests.append(t.reshape(-1).view(torch.uint8))
            index.append(e)
    if device.type == "cuda":
        # The core copies on its own stream: memory just handed out by the caching allocator may still be
        # in use by work queued on the current stream.
        torch.cuda.current_stream(device).synchronize()

    expected = header.checksums() if verify else None
    sums = core.restore(path, offsets, dests, expected is not None)
    if expected is not None:
        for e, got in zip(index, sums):
            want = expected[e.name]
            if got != want:
                raise ChecksumError(
                    f"{path}: tensor {e.name!r} fails its checksum (stored {want:08x}, read {got:08x}); "
                    "the file is corrupt"
                )
        for e in header.tensors:  # empty tensors sum to 0
            if not e.nbytes and expected[e.name] != 0:
                raise ChecksumError(f"{path}: tensor {e.name!r} fails its checksum; the file is corrupt")

    skel = header.metadata.get(fmt.KEY_SKELETON)
    if skel is None:  # a plain safetensors file: a flat dict, in file order
        return tensors, header
    return skeleton.decode(skel, tensors, allow_pickle=allow_pickle, path=path), header
