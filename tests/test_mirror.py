"""A save's mirror copy (`save(..., mirror=...)`: the memory tier's files): written from the same host cache
chunks as the file, byte for byte the same, in place only once the file is persisted; dropped, never the
save, where it cannot be written; never left behind by a save that fails."""

import errno

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
