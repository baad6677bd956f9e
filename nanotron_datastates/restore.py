"""Load: read -> parse -> scatter.

The header is read and validated here (it is small). The core then reads the data section in parallel with
large O_DIRECT requests: for the CPU, into one new page-aligned buffer, each tensor a separate storage over
its slice (the buffer is freed with the last of them); for a GPU, through pinned cache chunks into
tensors allocated there. It returns one CRC-32C per tensor, checked against the header. The skeleton then
puts the tensors back into the saved structure.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

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
    checksums: Mapping[str, int] | None = None,
) -> tuple[Any, fmt.Header]:
    path = os.fspath(path)
    header = fmt.read_header(path)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot load {path} to {device}: CPU and CUDA only")

    data_len = header.file_size - header.data_start
    begins = [e.begin for e in header.tensors]
    expected = dict(checksums) if checksums is not None else header.checksums()
    if expected is not None and set(expected) != {e.name for e in header.tensors}:
        raise ChecksumError(f"{path}: the checksums given do not name the file's tensors")
    verify = verify and expected is not None
    if device.type == "cpu":
        raws, sums = core.restore_host(
            path, header.data_start, data_len, begins, [e.end for e in header.tensors], verify
        )
        tensors = {
            e.name: _typed(raw, header.data_start + e.begin, e) for e, raw in zip(header.tensors, raws)
        }
    else:
        tensors = {e.name: torch.empty(e.shape, dtype=e.dtype.torch, device=device) for e in header.tensors}
        # The core copies on its own stream: memory just handed out by the caching allocator may still be in
        # use by work queued on the current stream.
        torch.cuda.current_stream(device).synchronize()
        dests = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
        sums = core.restore_device(path, header.data_start, data_len, begins, dests, verify)

    if verify:
        for e, got in zip(header.tensors, sums):
            if got != expected[e.name]:
                raise ChecksumError(
                    f"{path}: tensor {e.name!r} fails its checksum (stored {expected[e.name]:08x}, read "
                    f"{got:08x}); the file is corrupt"
                )

    skel = header.metadata.get(fmt.KEY_SKELETON)
    if skel is None:  # a plain safetensors file: a flat dict, in file order
        return tensors, header
    return skeleton.decode(skel, tensors, allow_pickle=allow_pickle, path=path), header


def _typed(raw: torch.Tensor, file_offset: int, e: fmt.TensorEntry) -> torch.Tensor:
    """The tensor over its bytes in the restore buffer, or a copy where they are not naturally aligned (never
    for files written by the engine or by safetensors: only when the file offset is misaligned)."""
    if file_offset % e.dtype.itemsize == 0:
        return raw.view(e.dtype.torch).view(e.shape)
    out = torch.empty(e.shape, dtype=e.dtype.torch)
    out.reshape(-1).view(torch.uint8).copy_(raw)
    return out
