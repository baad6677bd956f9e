"""Files kept in memory only (a memory checkpoint's): a save whose mirror is its own path writes no storage
file; the mirror holds the same bytes a stored file would (its checksums only with `memory_checksums`), is
recycled like any mirror, and where it cannot be had the save fails, naming why, and the engine goes on."""

import errno
import os

import pytest
import torch

from nanotron_datastates import ChecksumError, DataStatesEngine

from helpers import injected_fault, small_config


def state(scale: float = 1.0):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(700_000, generator=g) * scale, "b": torch.randn(17, generator=g), "step": 3}


def save_in_memory(engine, st, path, recycle=None):
    h = engine.save_plans([(engine.plan(st), path)], mirrors=[path], recycle=[recycle])[0]
    h.wait_persisted()
    return h


@pytest.mark.parametrize("summed", [True, False])
@pytest.mark.parametrize("direct_io", [True, False])
def test_a_file_kept_in_memory_only_is_the_stored_file_byte_for_byte(tmp_path, direct_io, summed):
    """Summed (`memory_checksums`), it is the file a save to storage writes; unsummed, the file a save to
    storage with `checksums` off writes."""
    config = small_config(direct_io=direct_io, memory_checksums=summed)  # 1 MiB chunks: several pieces
    with DataStatesEngine(config) as engine:
        engine.cache_stats(reset=True)
        h = save_in_memory(engine, state(), tmp_path / "mem" / "f.safetensors")
        assert h.mirrored() and h.stats["file_bytes"] == os.path.getsize(tmp_path / "mem/f.safetensors")
        assert engine.cache_stats()["high_water"] == 0  # the mapping is the staging memory
        back = engine.load(tmp_path / "mem/f.safetensors", checksums=h.checksums() if summed else None)
    with DataStatesEngine(small_config(direct_io=direct_io, checksums=summed)) as engine:
        stored = engine.save(state(), tmp_path / "disk" / "f.safetensors")
        stored.wait_persisted()
    assert (tmp_path / "mem/f.safetensors").read_bytes() == (tmp_path / "disk/f.safetensors").read_bytes()
    assert h.checksums() == stored.checksums()  # summed by the checksum threads, as the flushers sum
    assert bool(h.checksums()) == summed == h.summed
    assert torch.equal(back["w"], state()["w"]) and back["step"] == 3
    assert sorted(os.listdir(tmp_path / "mem")) == ["f.safetensors"]  # no temporary, no second file


@pytest.mark.parametrize("summed", [True, False])
def test_a_memory_only_file_is_summed_by_the_checksum_threads_where_asked_never_by_its_copy_thread(
    tmp_path, summed
):
    """The copy threads only copy (on a GPU host they go on at the link's speed); the ds-sum threads sum,
    and run only with `memory_checksums`: by default none is started and no byte is read back from host
    memory. A file saved to storage beside it, and its copy in memory, are summed either way."""
    from nanotron_datastates import cpu_use

    big = {"w": torch.arange(48 << 20, dtype=torch.float32)}  # 192 MiB
    config = small_config(
        chunk_size=16, host_cache_size=1 / 16, checksum_threads=2, copy_threads=1, memory_checksums=summed
    )
    others = cpu_use.thread_cpu()  # engines other tests left to the garbage collector: not this one's threads
    with DataStatesEngine(config) as engine:
        before = cpu_use.thread_cpu()
        h = save_in_memory(engine, big, tmp_path / "mem" / "f.safetensors")
        after = cpu_use.thread_cpu()
        back = engine.load(tmp_path / "mem/f.safetensors", checksums=h.checksums() if summed else None)
        small = {"w": torch.arange(1000, dtype=torch.float32)}
        stored = engine.save(small, tmp_path / "disk/f.safetensors", mirror=tmp_path / "mem2/f.safetensors")
        stored.wait_persisted()
        assert stored.checksums() and engine.load(tmp_path / "mem2/f.safetensors")["w"].equal(small["w"])
    assert torch.equal(back["w"], big["w"])
    summers = {tid: cpu for tid, (role, cpu) in after.items() if role == "sum" and tid not in others}
    assert len(summers) == (2 if summed else 0)
    summing = sum(summers.values()) - sum(before[t][1] for t in summers)
    assert (summing > 0) == summed and bool(h.checksums()) == summed


def test_a_damaged_byte_of_a_summed_memory_only_file_is_named_on_load(tmp_path):
    path = tmp_path / "mem" / "f.safetensors"
    with DataStatesEngine(small_config(memory_checksums=True)) as engine:
        h = save_in_memory(engine, state(), path)
        with open(path, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(ChecksumError, match="'w'"):
            engine.load(path, checksums=h.checksums())
        assert save_in_memory(engine, state(), tmp_path / "ok" / "f.safetensors").checksums()


def test_no_storage_write_is_made_for_a_file_kept_in_memory(tmp_path):
    """Every storage write fails: a memory-only save does not meet it."""
    with DataStatesEngine(small_config()) as engine:
        with injected_fault("write", errno.EIO, "", count=1 << 30):
            h = save_in_memory(engine, state(), tmp_path / "mem" / "f.safetensors")
        assert h.mirrored()
        assert torch.equal(engine.load(tmp_path / "mem/f.safetensors")["w"], state()["w"])


def test_a_memory_only_file_recycles_an_earlier_one(tmp_path):
    mem = tmp_path / "mem"
    with DataStatesEngine(small_config()) as engine:
        save_in_memory(engine, state(), mem / "1" / "f.safetensors")
        inode = os.stat(mem / "1" / "f.safetensors").st_ino
        h = save_in_memory(
            engine, state(2.0), mem / "2" / "f.safetensors", recycle=mem / "1" / "f.safetensors"
        )
        assert h.mirrored() and not (mem / "1" / "f.safetensors").exists()
        assert os.stat(mem / "2" / "f.safetensors").st_ino == inode
        assert torch.equal(engine.load(mem / "2" / "f.safetensors")["w"], state(2.0)["w"])


def test_without_its_memory_a_memory_only_save_fails_naming_why_and_the_engine_goes_on(tmp_path):
    (tmp_path / "blocker").write_text("a file where the folder should be")
    path = tmp_path / "blocker" / "f.safetensors"
    with DataStatesEngine(small_config()) as engine:
        h = engine.save_plans([(engine.plan(state()), path)], mirrors=[path])[0]
        with pytest.raises(OSError, match="kept in memory only") as e:
            h.wait_persisted()
        assert "f.safetensors" in str(e.value) and e.value.errno == errno.ENOTDIR
        assert not os.path.exists(path)
        save_in_memory(engine, state(), tmp_path / "ok" / "f.safetensors")  # the engine keeps working
