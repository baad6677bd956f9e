"""Mirror files made ahead (`prepare_mirrors`: a memory tier's first checkpoints): laid out as the save of the
plan lays out its file, so that the save recycling one takes its mapping as it is (same address: nothing
mapped or pinned again while training runs) and writes the same bytes; a file that cannot be made is named,
and a link planted where one goes is replaced, never followed."""

import os

import pytest
import torch

from nanotron_datastates import DataStatesEngine

from helpers import mapped_at, small_config


def state(step: int, n: int = 700_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(17, generator=g).half(), "step": step}


@pytest.mark.parametrize("n", [700_000, 5])  # several chunks (pinned blocks), and under one page
def test_a_file_made_ahead_is_the_mapping_the_save_takes_over_and_holds_its_bytes(tmp_path, n):
    ahead = tmp_path / "mem" / ".warm" / "f.safetensors"
    with DataStatesEngine(small_config()) as engine:
        assert engine.prepare_mirrors([(engine.plan(state(1, n)), ahead)]) == 1
        (where,) = mapped_at(ahead)
        assert ahead.stat().st_size % 4096 == 0 and oct(ahead.stat().st_mode & 0o777) == "0o600"
        # Another step's values (its header's plain values differ), the same tensors' shapes and dtypes.
        plan = engine.plan(state(2, n))
        mirror = tmp_path / "mem" / "2" / "f.safetensors"
        h = engine.save_plans([(plan, tmp_path / "2.safetensors")], mirrors=[mirror], recycle=[ahead])[0]
        h.wait_persisted()
        assert h.mirrored() and not ahead.exists()
        assert mapped_at(mirror) == [where] and h.stats["mirror_kept"]  # taken over: nothing mapped anew
        assert mirror.read_bytes() == (tmp_path / "2.safetensors").read_bytes()
        back = engine.load(mirror)
    assert torch.equal(back["w"], state(2, n)["w"]) and back["step"] == 2


def test_a_file_that_cannot_be_made_is_named_and_those_before_it_stay_mapped(tmp_path):
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "blocked").write_text("a file where a folder goes")
    with DataStatesEngine(small_config()) as engine:
        plan = engine.plan(state(1))
        first, second = (
            tmp_path / "mem" / "a" / "f.safetensors",
            tmp_path / "mem" / "blocked" / "f.safetensors",
        )
        with pytest.raises(OSError, match="blocked"):
            engine.prepare_mirrors([(plan, first), (plan, second)])
        assert mapped_at(first) and engine.keep_mirrors([first]) == 1
        first.unlink()
        assert engine.keep_mirrors([]) == 0 and not mapped_at(first)  # its memory given back
        assert engine.save(state(3), tmp_path / "3.safetensors").wait_persisted() is None  # works on


def test_a_link_planted_where_a_file_made_ahead_goes_is_replaced_not_followed(tmp_path):
    """Hostile: a link stands where the file goes. The file is made under a private temporary name and renamed
    onto the link, which it replaces: the file the link named keeps its bytes."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 1000)
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "f.safetensors").symlink_to(victim)
    with DataStatesEngine(small_config()) as engine:
        engine.prepare_mirrors([(engine.plan(state(1)), tmp_path / "mem" / "f.safetensors")])
    assert victim.read_bytes() == b"precious" * 1000
    made = tmp_path / "mem" / "f.safetensors"
    assert not made.is_symlink() and made.is_file() and os.listdir(tmp_path / "mem") == ["f.safetensors"]


@pytest.mark.parametrize("grows", [False, True])
def test_a_save_whose_header_changed_length_takes_the_kept_mapping_where_its_header_fits(tmp_path, grows):
    """Headers vary with their plain values (an optimizer's learning rate). A shorter one than the recycled
    file's is padded to it and the mapping taken as it is; one that no longer fits maps the file anew. Either
    way the file is whole and the mirror is the file, byte for byte."""
    long, short = {"note": "x" * 6000}, {"note": "x"}
    first, later = (short, long) if grows else (long, short)
    mem = tmp_path / "mem"
    with DataStatesEngine(small_config()) as engine:
        engine.save({**state(1), **first}, tmp_path / "1.st", mirror=mem / "1" / "f").wait_persisted()
        (where,) = mapped_at(mem / "1" / "f")
        files = [(engine.plan({**state(2), **later}), tmp_path / "2.safetensors")]
        h = engine.save_plans(files, mirrors=[mem / "2" / "f"], recycle=[mem / "1" / "f"])[0]
        h.wait_persisted()
        assert h.stats["mirror_kept"] is not grows
        assert grows or mapped_at(mem / "2" / "f") == [where]
        assert (mem / "2" / "f").read_bytes() == (tmp_path / "2.safetensors").read_bytes()
        back = engine.load(tmp_path / "2.safetensors")
    assert torch.equal(back["w"], state(2)["w"]) and back["note"] == later["note"]


def test_files_made_ahead_stay_the_saves_mappings_when_the_kept_set_is_cut_as_the_saves_start(tmp_path):
    """The committer of the previous checkpoint cuts the kept mappings to the tier's files (`keep_mirrors`)
    while the next save starts on the training thread: a file that save recycles is its own from the moment
    `save_plans` returns, whether or not a copy thread has renamed it yet, so nothing is mapped (and pinned,
    holding the driver's locks) anew while training runs."""
    files = 48
    with DataStatesEngine(small_config()) as engine:
        plan = engine.plan(state(1, 4096))
        ahead = [tmp_path / "mem" / ".warm" / f"f{i}.safetensors" for i in range(files)]
        assert engine.prepare_mirrors([(plan, a) for a in ahead]) == files
        mirrors = [tmp_path / "mem" / "2" / f"f{i}.safetensors" for i in range(files)]
        handles = engine.save_plans([(plan, str(m)) for m in mirrors], mirrors=mirrors, recycle=ahead)
        engine.keep_mirrors([])  # as the committer would, listing none of them (renamed, or not the tier's)
        for h in handles:
            h.wait_persisted()
        assert [h.stats["mirror_kept"] for h in handles] == [True] * files
        assert torch.equal(engine.load(mirrors[-1])["w"], state(1, 4096)["w"])


def test_keep_mirrors_without_paths_keeps_exactly_the_files_still_named_so(tmp_path):
    """`keep_mirrors()` (what the committer calls after a tier drops files): a mapping whose file was removed,
    replaced by another file, or by a link (to the very file, even) is unmapped; the others stay mapped."""
    mem = tmp_path / "mem"
    names = ["kept", "removed", "replaced", "linked"]
    paths = {n: mem / n / "f.safetensors" for n in names}
    with DataStatesEngine(small_config()) as engine:
        plan = engine.plan(state(1, 5))
        assert engine.prepare_mirrors([(plan, p) for p in paths.values()]) == len(names)
        paths["removed"].unlink()
        paths["replaced"].rename(mem / "replaced" / "old")
        paths["replaced"].write_bytes((mem / "replaced" / "old").read_bytes())  # same bytes, another file
        paths["linked"].rename(mem / "linked" / "target")
        paths["linked"].symlink_to(mem / "linked" / "target")
        assert engine.keep_mirrors() == 1
        assert mapped_at(paths["kept"]) and not any(mapped_at(mem / n / "old") for n in names)
        assert not mapped_at(mem / "linked" / "target") and not mapped_at(mem / "replaced" / "old")
        assert engine.keep_mirrors() == 1  # idempotent
