"""Weight files that several ranks of a node read (data- or context-parallel replicas) are read through the
page cache, so that the disk reads each once; elsewhere reads take O_DIRECT. Residency is read from the
kernel (mincore) after the file's pages were dropped, on the disk of the test's folder (not tmpfs, which has
no O_DIRECT)."""

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine
from nanotron_datastates import format as fmt
from nanotron_datastates.resume.read_ahead import Prefetch, shared_weight_reads

from helpers import random_tensor, same, small_config

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_int = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _int, _int, _int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache."""
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(v & 1 for v in vec) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cached(path: Path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_share(path) < 0.05, f"{path}: the kernel kept its pages cached"


def read_as_a_gpu_restore(engine: DataStatesEngine, path: Path, page_cache: bool) -> dict[str, torch.Tensor]:
    """The core's read to GPUs (through pinned chunks), into host tensors: it runs without a GPU."""
    with open(path, "rb") as f:
        header = fmt.read_header_fd(f.fileno(), str(path))
    entries = [e for e in header.tensors if e.nbytes]
    out = {e.name: torch.zeros(e.nbytes, dtype=torch.uint8) for e in entries}
    engine._core.restore_device(
        str(path),
        header.data_start,
        header.file_size - header.data_start,
        [e.begin for e in entries],
        [out[e.name] for e in entries],
        True,
        page_cache=page_cache,
    )
    return out


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {f"w{i}": random_tensor(torch.float32, (1 << 20,), seed=i) for i in range(4)}  # 16 MiB
    path = tmp_path / "model_weight.safetensors"
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
    return path, state


def test_a_read_through_the_page_cache_leaves_the_file_cached_and_an_o_direct_read_does_not(saved):
    path, state = saved
    with DataStatesEngine(small_config()) as engine:
        assert engine.config.direct_io
        drop_cached(path)
        direct = read_as_a_gpu_restore(engine, path, page_cache=False)
        assert resident_share(path) < 0.05  # the data came past the page cache
        drop_cached(path)
        cached = read_as_a_gpu_restore(engine, path, page_cache=True)
        assert resident_share(path) > 0.95  # the next rank of the node reads it from memory
    for name, t in state.items():
        raw = t.reshape(-1).view(torch.uint8)
        assert same(direct[name], raw) and same(cached[name], raw), name


def test_read_direct_io_governs_the_reads_and_direct_io_the_writes_alone(saved, tmp_path):
    """Each setting means one thing: reads through the page cache with `read_direct_io` off, O_DIRECT writes
    still (`direct_io`); O_DIRECT reads with buffered writes."""
    path, state = saved
    with DataStatesEngine(small_config(read_direct_io=False)) as engine:
        drop_cached(path)
        read_as_a_gpu_restore(engine, path, page_cache=False)
        assert resident_share(path) > 0.95
        written = engine.save(state, tmp_path / "again.safetensors")
        written.wait_persisted()
        assert written.stats["direct_io"]
    with DataStatesEngine(small_config(direct_io=False)) as engine:
        drop_cached(path)
        read_as_a_gpu_restore(engine, path, page_cache=False)
        assert resident_share(path) < 0.05
        written = engine.save(state, tmp_path / "buffered.safetensors")
        written.wait_persisted()
        assert not written.stats["direct_io"]


def test_replicas_of_one_node_share_their_weight_reads(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert shared_weight_reads({"dp": 4, "cp": 1, "tp": 1, "pp": 1}) == (2, 4)
    assert shared_weight_reads({"dp": 2, "cp": 2, "tp": 1, "pp": 1}) == (2, 4)
    assert shared_weight_reads({"dp": 1, "cp": 1, "tp": 4, "pp": 1}) is None  # each rank its own files
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank a node: nobody to share with
    assert shared_weight_reads({"dp": 4, "cp": 1, "tp": 1, "pp": 1}) is None


def test_a_shared_read_ahead_reads_every_file_whole_starting_at_its_own_part(tmp_path: Path):
    files = {}
    with DataStatesEngine(small_config()) as engine:
        for i in range(5):
            path = tmp_path / f"w{i}.safetensors"
            files[path] = {"w": random_tensor(torch.bfloat16, (1000 + i,), seed=i)}
            engine.save(files[path], path).wait_persisted()
        ahead = Prefetch(engine, torch.device("cpu"), list(files), [], lambda p: None, shared=(3, 4))
        got = ahead.weights()
        assert "through the page cache, shared with the node's 4 ranks" in ahead.report()
    assert list(got) == list(files)[3:] + list(files)[:3]  # rank 3 of 4 starts at the fourth of five files
    for path, state in files.items():
        assert same(got[path]["w"], state["w"]), path
