"""Restores through pinned chunks from a file in memory (tmpfs, where the memory tier lives): the file is
mapped and each byte copied once into a chunk, summed there and uploaded from there. Host destinations take
the chunked path that CUDA restores take (the upload is a memcpy), so it runs without a GPU."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine
from nanotron_datastates import format as fmt

from helpers import random_tensor, same, small_config

# Sizes around the piece (half a 1 MiB chunk): inside one, across one and several boundaries, empty.
SIZES = [0, 1, 7, 4096, (1 << 19) - 3, (1 << 19) + 5, 3 << 20, 123457]


def state() -> dict[str, torch.Tensor]:
    return {f"t{i}": random_tensor(torch.uint8, (n,), seed=i) for i, n in enumerate(SIZES)}


def read_through_chunks(engine: DataStatesEngine, path: Path, verify: bool = True):
    """What a restore to GPUs does, into host tensors: (tensors, sums per tensor, the header)."""
    with open(path, "rb") as f:
        header = fmt.read_header_fd(f.fileno(), str(path))
    entries = [e for e in header.tensors if e.nbytes]
    out = {e.name: torch.full((e.nbytes,), 0xAB, dtype=torch.uint8) for e in entries}
    sums = engine._core.restore_device(
        str(path),
        header.data_start,
        header.file_size - header.data_start,
        [e.begin for e in entries],
        [out[e.name] for e in entries],
        verify,
    )
    return out, dict(zip([e.name for e in entries], sums)), header


def bytes_read() -> int:
    """Bytes this process has read with read(2) and pread(2) so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_in_memory_restores_every_byte_and_its_sums(shm_dir, tmp_path, mapped):
    s = state()
    # pwrite: reads go through pread, which /proc/self/io counts (io_uring's do not).
    with DataStatesEngine(small_config(map_memory_files=mapped, io_backend="pwrite")) as engine:
        for folder in (shm_dir, tmp_path):
            engine.save(s, folder / "f.safetensors").wait_persisted()
        before = bytes_read()
        got, sums, header = read_through_chunks(engine, shm_dir / "f.safetensors")
        read = bytes_read() - before
        from_disk, disk_sums, _ = read_through_chunks(engine, tmp_path / "f.safetensors")
    for name, t in s.items():
        if t.numel():
            assert same(got[name], t), name
            assert same(from_disk[name], t), name
    expected = header.checksums()
    assert sums == {n: expected[n] for n in sums}
    assert disk_sums == sums
    data = header.file_size - header.data_start
    if mapped:
        assert read < data // 4, f"{read} bytes read(2) for a mapped file of {data}"
    else:
        assert read >= data


def test_sums_off_still_delivers_every_byte(shm_dir):
    s = state()
    with DataStatesEngine(small_config()) as engine:
        engine.save(s, shm_dir / "f.safetensors").wait_persisted()
        got, _, _ = read_through_chunks(engine, shm_dir / "f.safetensors", verify=False)
    for name, t in s.items():
        if t.numel():
            assert same(got[name], t), name


def test_a_damaged_byte_in_memory_changes_its_tensors_sum_only(shm_dir):
    s = state()
    with DataStatesEngine(small_config()) as engine:
        path = shm_dir / "f.safetensors"
        engine.save(s, path).wait_persisted()
        with open(path, "rb") as f:
            header = fmt.read_header_fd(f.fileno(), str(path))
        victim = next(e for e in header.tensors if e.nbytes == (3 << 20))
        with open(path, "r+b") as f:
            f.seek(header.data_start + victim.begin + (1 << 20) + 11)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        _, sums, _ = read_through_chunks(engine, path)
    expected = header.checksums()
    assert [n for n in sums if sums[n] != expected[n]] == [victim.name]


def test_a_truncated_file_in_memory_is_an_error_naming_it_and_the_engine_goes_on(shm_dir):
    s = state()
    with DataStatesEngine(small_config()) as engine:
        good, short = shm_dir / "good.safetensors", shm_dir / "short.safetensors"
        engine.save(s, good).wait_persisted()
        shutil.copyfile(good, short)
        with open(short, "rb") as f:
            header = fmt.read_header_fd(f.fileno(), str(short))
        entries = [e for e in header.tensors if e.nbytes]
        os.truncate(short, header.file_size - 4096)  # a mapping touched past its end would be SIGBUS
        with pytest.raises(ValueError, match="truncated") as err:
            engine._core.restore_device(
                str(short),
                header.data_start,
                header.file_size - header.data_start,
                [e.begin for e in entries],
                [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries],
                True,
            )
        assert str(short) in str(err.value) and "truncated" in str(err.value)
        got, sums, _ = read_through_chunks(engine, good)
    assert sums == {n: header.checksums()[n] for n in sums}
    assert all(same(got[n], s[n]) for n in got)
