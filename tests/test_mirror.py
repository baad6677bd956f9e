"""A save's mirror copy (`save(..., mirror=...)`: the memory tier's files): the save's staging memory in place
of host cache chunks, byte for byte the file, in place only once the file is persisted; recycled by a later
save (renamed, its mapping reused); dropped, never the save, where it cannot be had; never left behind by a
save that fails."""

import errno
import os

import pytest
import torch

from nanotron_datastates import DataStatesEngine

from helpers import injected_fault, small_config


def state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(700_000, generator=g), "b": torch.randn(17, generator=g), "step": 3}


@pytest.mark.parametrize("direct_io", [True, False])
def test_the_mirror_is_the_file_byte_for_byte(tmp_path, direct_io):
    with DataStatesEngine(small_config(direct_io=direct_io)) as engine:  # 1 MiB chunks: several pieces
        h = engine.save(
            state(), tmp_path / "disk" / "f.safetensors", mirror=tmp_path / "mem" / "a" / "f.safetensors"
        )
        h.wait_persisted()
        assert h.mirrored() and h.mirror_error() is None and h.stats["mirrored"]
        assert (tmp_path / "mem/a/f.safetensors").read_bytes() == (
            tmp_path / "disk/f.safetensors"
        ).read_bytes()
        back = engine.load(tmp_path / "mem/a/f.safetensors")
    assert torch.equal(back["w"], state()["w"]) and back["step"] == 3
    assert not [p for p in (tmp_path / "mem/a").iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_mirror_that_cannot_be_written_is_dropped_and_the_save_goes_on(tmp_path):
    (tmp_path / "blocker").write_text("a file where the mirror's folder should be")
    with DataStatesEngine(small_config()) as engine:
        h = engine.save(state(), tmp_path / "f.safetensors", mirror=tmp_path / "blocker" / "f.safetensors")
        h.wait_persisted()
        assert not h.mirrored() and str(tmp_path / "blocker" / "f.safetensors") in h.mirror_error()
        assert engine.load(tmp_path / "f.safetensors")["step"] == 3  # the save itself is whole


def test_a_failed_save_leaves_no_mirror(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        with injected_fault("write", errno.EIO, "bad", count=1 << 30):
            h = engine.save(
                state(), tmp_path / "bad.safetensors", mirror=tmp_path / "mem" / "bad.safetensors"
            )
            with pytest.raises(OSError, match="bad.safetensors"):
                h.wait_persisted()
        assert not (tmp_path / "mem" / "bad.safetensors").exists()
        assert not list((tmp_path / "mem").glob(".*"))  # its temporary removed too
        ok = engine.save(state(), tmp_path / "ok.safetensors", mirror=tmp_path / "mem" / "ok.safetensors")
        assert ok.mirrored()  # the engine keeps working


def test_save_plans_take_one_mirror_per_file_and_check_their_count(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        plans = [(engine.plan({"x": torch.ones(5) * i}), tmp_path / f"{i}.safetensors") for i in range(3)]
        with pytest.raises(ValueError, match="2 mirrors for 3 files"):
            engine.save_plans(plans, mirrors=[None, None])
        hs = engine.save_plans(plans, mirrors=[None, tmp_path / "m1.safetensors", None])
        assert [h.mirrored() for h in hs] == [False, True, False]


def test_the_mirror_is_the_staging_memory_no_cache_chunk_is_used(tmp_path):
    with DataStatesEngine(small_config()) as engine:  # 1 MiB chunks: several pieces
        engine.cache_stats(reset=True)
        h = engine.save(state(), tmp_path / "f.safetensors", mirror=tmp_path / "mem" / "f.safetensors")
        h.wait_persisted()
        assert h.mirrored() and engine.cache_stats()["high_water"] == 0
        plain = engine.save(state(), tmp_path / "g.safetensors")
        plain.wait_persisted()
        assert engine.cache_stats()["high_water"] > 0  # without a mirror, the chunks carry the bytes


def save_recycling(engine, st, path, mirror, recycle):
    """`st` saved to `path` with its mirror at `mirror`, taking over the mirror file `recycle`; persisted."""
    h = engine.save_plans([(engine.plan(st), path)], mirrors=[mirror], recycle=[recycle])[0]
    h.wait_persisted()
    return h


def later_state(n: int = 700_000):
    return {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(17), "step": 4}


@pytest.mark.parametrize("n", [700_000, 900_000])  # the same size (mapping reused) and another (mapped anew)
def test_a_later_save_recycles_the_earlier_mirror_file(tmp_path, n):
    mem = tmp_path / "mem"
    with DataStatesEngine(small_config()) as engine:
        engine.save(state(), tmp_path / "1.safetensors", mirror=mem / "1" / "f.safetensors").wait_persisted()
        inode = os.stat(mem / "1" / "f.safetensors").st_ino
        h = save_recycling(
            engine,
            later_state(n),
            tmp_path / "2.safetensors",
            mem / "2" / "f.safetensors",
            mem / "1" / "f.safetensors",
        )
        assert h.mirrored() and not (mem / "1" / "f.safetensors").exists()
        assert os.stat(mem / "2" / "f.safetensors").st_ino == inode  # the same file, renamed
        assert (mem / "2" / "f.safetensors").read_bytes() == (tmp_path / "2.safetensors").read_bytes()
        assert engine.keep_mirrors([mem / "2" / "f.safetensors"]) == 1
        assert engine.keep_mirrors([]) == 0
        back = engine.load(mem / "2" / "f.safetensors")
    assert torch.equal(back["w"], later_state(n)["w"]) and back["step"] == 4


def test_a_missing_file_to_recycle_gives_a_new_mirror(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        h = save_recycling(
            engine,
            state(),
            tmp_path / "f.safetensors",
            tmp_path / "mem" / "f.safetensors",
            tmp_path / "mem" / "gone.safetensors",
        )
        assert h.mirrored()
        assert (tmp_path / "mem/f.safetensors").read_bytes() == (tmp_path / "f.safetensors").read_bytes()


def test_a_link_planted_as_the_file_to_recycle_is_not_followed(tmp_path):
    """Hostile: the file to recycle is a link to somebody's file. The link is moved, never opened through: the
    file it names keeps its bytes, the mirror is dropped with a reason, and the save is whole."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 1000)
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "old.safetensors").symlink_to(victim)
    with DataStatesEngine(small_config()) as engine:
        h = save_recycling(
            engine,
            state(),
            tmp_path / "f.safetensors",
            tmp_path / "mem" / "f.safetensors",
            tmp_path / "mem" / "old.safetensors",
        )
        assert not h.mirrored() and "f.safetensors" in h.mirror_error()
        assert engine.load(tmp_path / "f.safetensors")["step"] == 3
    assert victim.read_bytes() == b"precious" * 1000
    assert sorted(p.name for p in (tmp_path / "mem").iterdir()) == []  # the link and the temporary gone
