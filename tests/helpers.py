"""Helpers shared by the tests (import as `from helpers import ...`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

from nanotron_datastates import DataStatesConfig, _core

BACKENDS = ("io_uring", "pwrite")


def small_config(**kw) -> DataStatesConfig:
    """A 16 MiB cache of 1 MiB chunks: most test states stream through it with backpressure."""
    base = dict(host_cache_size=16 / 1024, chunk_size=1, parser_threads=2, flush_threads=2, queue_depth=4)
    base.update(kw)
    return DataStatesConfig(**base)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes of every dtype (NaN and denormal patterns included); bools stay 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def no_temporaries(directory: Path) -> bool:
    return not [n for n in os.listdir(directory) if ".dstmp." in n]


@contextlib.contextmanager
def injected_fault(kind: str, err: int, path_contains: str, skip: int = 0, count: int = 1) -> Iterator[None]:
    """The core's flush layer fails matching ops with `err` (see ext/fault.hpp) within the block."""
    _core._arm_fault(kind, err, path_contains, skip, count)
    try:
        yield
    finally:
        _core._disarm_fault()
