"""The memory tier's bookkeeping on real folders: what a rank marks, drops and prunes."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch

from nanotron_datastates import format as fmt
from nanotron_datastates import trust
from nanotron_datastates.checkpoint.checksums import file_checksums
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.tier.folders import tree_size
from nanotron_datastates.tier.held_copy import holds, step_why_not, tier_copy, why_not
from nanotron_datastates.tier.jobs import jobs
from nanotron_datastates.tier.memory import MemoryTier, job_folder
from nanotron_datastates.tier.memory import root as tier_root
from nanotron_datastates.tier.room import check_room
from nanotron_datastates.trainer_settings import TrainerSettings

from helpers import forge_crc32c, write_nanotron_checkpoint


def _hold(tier: MemoryTier, step: int, *, mark: bool = True) -> None:
    rel = f"model/w_{tier.rank}.safetensors"
    tier.path(step, rel).parent.mkdir(parents=True, exist_ok=True)
    tier.path(step, rel).write_bytes(b"x" * 10)
    if mark:
        (tier.folder / str(step) / f".rank-{tier.rank}.json").write_text(
            f'{{"step": {step}, "files": {{"{rel}": {{"bytes": 10}}}}}}'
        )


def test_prune_keeps_the_latest_step_and_what_other_ranks_hold(tmp_path):
    """A process killed between marking a step and dropping the older ones leaves several marked steps;
    the next start keeps only the step latest.txt names (and drops unmarked leftovers below it), and never
    touches another rank's marked files or an unmarked step above it (a save in flight)."""
    r0, r1 = (MemoryTier(tmp_path / "shm", tmp_path / "ckpt", rank) for rank in (0, 1))
    for step in (10, 20, 30):
        _hold(r0, step)
    _hold(r1, 20)
    _hold(r0, 5, mark=False)  # a save killed before it was committed
    _hold(r0, 40, mark=False)  # one in flight
    r0.prune(30)
    assert r0.steps() == [20, 30, 40]
    assert not r0.path(20, "model/w_0.safetensors").exists()  # rank 0's copy of 20 dropped ...
    assert r1.path(20, "model/w_1.safetensors").exists()  # ... rank 1's kept
    assert r0.path(30, "model/w_0.safetensors").exists() and r0.path(40, "model/w_0.safetensors").exists()


def test_a_prune_behind_the_start_of_training_is_waited_for_by_the_first_commit(tmp_path):
    """`prune_behind` removes a killed process's steps on a thread of its own; a commit made at once waits
    for it: the step it marks survives, and the steps it would drop are gone, as with a prune in line.
    A prune that fails is reported to `on_done`, not raised into training."""
    r0 = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2)
    for step in (10, 20, 30):
        _hold(r0, step)
    for i in range(200):  # files enough that the removal is still running at the commit
        (r0.folder / "20" / f"f{i}").write_bytes(b"x")
    done: list = []
    r0.prune_behind(30, lambda error, seconds: done.append((error, seconds)))
    rel = "model/w_0.safetensors"
    r0.path(40, rel).parent.mkdir(parents=True)
    r0.path(40, rel).write_bytes(b"y" * 10)
    r0.commit(40, {rel: {"bytes": 10}})  # 30 becomes the spare
    assert r0.steps() == [30, 40] and r0.held_steps() == [40]
    assert len(done) == 1 and done[0][0] is None and done[0][1] >= 0
    shutil.rmtree(r0.folder)  # the job's folder gone from under it (the tier wiped): nothing to list
    failed: list = []
    r0.prune_behind(40, lambda error, seconds: failed.append(error))
    r0.pruned()
    assert len(failed) == 1 and isinstance(failed[0], OSError), failed


def test_prune_removes_what_dead_processes_were_writing_and_keeps_a_live_ones(tmp_path):
    import subprocess

    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tier.folder / "7").mkdir()
    (tier.folder / "7" / f".w.safetensors.dstmp.{dead.pid}.0").write_bytes(b"x")
    (tier.folder / "7" / f".w.safetensors.dstmp.{os.getpid()}.1").write_bytes(b"x")
    tier.prune(None)
    assert [p.name for p in (tier.folder / "7").iterdir()] == [f".w.safetensors.dstmp.{os.getpid()}.1"]


def test_prune_without_a_latest_step_drops_every_step_this_rank_marked(tmp_path):
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    _hold(tier, 1)
    _hold(tier, 2)
    tier.prune(None)
    assert tier.steps() == []


def _files(tier: MemoryTier, step: int) -> dict:
    return {f"model/w_{tier.rank}.safetensors": {"bytes": 10}}


def test_with_two_copies_the_held_step_becomes_the_spare_the_next_save_takes_over(tmp_path):
    """Two copies: committing a step turns the step held before into this rank's spare (marker withdrawn,
    files kept); the next save is handed the spare's files to take over, never the held step's."""
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2)
    rel = "model/w_0.safetensors"
    _hold(t, 1, mark=False)
    t.commit(1, _files(t, 1))
    assert t.recycle(2, [rel]) == [None]  # nothing spare yet: the held step is never handed out
    _hold(t, 2, mark=False)
    t.commit(2, _files(t, 2))
    assert t.path(1, rel).exists() and not (t.folder / "1" / ".rank-0.json").exists()
    assert t.recycle(3, [rel, "model/other.safetensors"]) == [str(t.path(1, rel)), None]
    assert t.recycle(4, [rel]) == [None]  # handed out once
    t.path(1, rel).rename(t.path(2, rel).with_name("taken"))  # what the engine does with it
    _hold(t, 3, mark=False)
    t.commit(3, _files(t, 3))
    assert t.steps() == [2, 3] and (t.folder / "3" / ".rank-0.json").exists()


def test_with_one_copy_the_next_save_withdraws_the_held_step_before_taking_it_over(tmp_path):
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=1)
    rel = "model/w_0.safetensors"
    _hold(t, 1, mark=False)
    t.commit(1, _files(t, 1))
    doc = {"step": 1, "files": _files(t, 1)}
    assert holds(t, 1, doc)
    assert t.recycle(2, [rel]) == [str(t.path(1, rel))]
    # a restart now reads storage
    assert not holds(t, 1, doc) and "not marked held" in step_why_not(t, 1, doc)


def _made_ahead(tier: MemoryTier, i: int, rel: str) -> None:
    tier.warm(i, rel).parent.mkdir(parents=True)
    tier.warm(i, rel).write_bytes(b"w" * 10)
    tier.add_warm(i, [rel])


def _taken(tier: MemoryTier, donor: str, step: int, rel: str) -> None:
    """What the engine does with a file handed to a save of `step`: renamed into the step's folder."""
    tier.path(step, rel).parent.mkdir(parents=True, exist_ok=True)
    os.rename(donor, tier.path(step, rel))


@pytest.mark.parametrize("copies", [2, 1])
def test_the_sets_made_ahead_are_taken_over_first_then_the_steps_as_before(tmp_path, copies):
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=copies)
    rel = "model/w_0.safetensors"
    for i in range(copies):
        _made_ahead(t, i, rel)
    for step in range(1, copies + 1):  # each first checkpoint takes a set made ahead, in order
        (donor,) = t.recycle(step, [rel])
        assert donor == str(t.warm(step - 1, rel))
        _taken(t, donor, step, rel)
        t.commit(step, _files(t, step))
        assert holds(t, step, {"step": step, "files": _files(t, step)})
        assert not t.warm(step - 1, rel).parent.exists()  # its folder, emptied, removed
    (donor,) = t.recycle(copies + 1, [rel])
    assert donor == str(t.path(1, rel))  # then as without them: the spare (2 copies), the held step (1)
    t.release()
    assert not t.folder.exists()  # the emptied sets' folders too


def test_after_a_restart_the_set_made_ahead_goes_first_and_the_step_held_before_then_is_the_spare(tmp_path):
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2)
    rel = "model/w_0.safetensors"
    _hold(t, 5)  # what the process before held
    assert t.held_steps() == [5]
    _made_ahead(t, 0, rel)  # copies less the steps held: one set
    (donor,) = t.recycle(6, [rel])
    assert donor == str(t.warm(0, rel))
    _taken(t, donor, 6, rel)
    t.commit(6, _files(t, 6))
    assert t.held_steps() == [6] and t.recycle(7, [rel]) == [str(t.path(5, rel))]


def _committed(tier: MemoryTier, *steps: int) -> None:
    for step in steps:
        _hold(tier, step, mark=False)
        tier.commit(step, _files(tier, step))


def test_a_step_being_sent_is_never_dropped_nor_taken_over_until_sent(tmp_path):
    """The replicas' sender reads the newest held step while training goes on: the commits after it make it a
    spare and would drop it (the sender then finds no folder), and a save would take its files over."""
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2)
    rel = "model/w_0.safetensors"
    _committed(t, 1, 2)
    t.busy.add(2)  # being sent
    _committed(t, 3)
    assert t.recycle(4, [rel]) == [None]  # the only spare is being sent: new files
    _committed(t, 4)
    assert t.path(2, rel).read_bytes() == b"x" * 10  # kept, though neither held nor the newest spare
    t.busy.discard(2)
    (donor,) = t.recycle(5, [rel])
    assert donor == str(t.path(2, rel))  # sent: the first spare again
    _taken(t, donor, 5, rel)
    _committed(t, 5)
    assert t.steps() == [4, 5]


@pytest.mark.parametrize("spares", [1, 2])
def test_with_a_second_spare_a_save_takes_files_over_while_the_other_is_sent(tmp_path, spares):
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2, max_spares=spares)
    assert t.sets() == 1 + spares
    rel = "model/w_0.safetensors"
    _committed(t, 1, 2, 3)
    t.busy.add(3)  # the newest, sent while the next checkpoints are taken
    (donor,) = t.recycle(4, [rel])
    assert donor == str(t.path(1, rel) if spares == 2 else t.path(2, rel))
    _taken(t, donor, 4, rel)
    _committed(t, 4)  # 3 is a spare now, and being sent
    assert t.recycle(5, [rel]) == ([str(t.path(2, rel))] if spares == 2 else [None])


def test_prune_removes_the_sets_an_earlier_process_of_this_rank_made_ahead_not_other_ranks(tmp_path):
    r0, r1 = (MemoryTier(tmp_path / "shm", tmp_path / "ckpt", rank) for rank in (0, 1))
    _made_ahead(r0, 0, "w_0.safetensors")
    _made_ahead(r1, 0, "w_1.safetensors")
    again = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)  # rank 0's next process
    again.prune(None)
    assert not r0.warm(0, "w_0.safetensors").exists() and r1.warm(0, "w_1.safetensors").exists()
    assert again.recycle(1, ["w_0.safetensors"]) == [None]


def test_the_sets_an_earlier_process_made_ahead_are_set_aside_at_once_and_removed_behind(tmp_path):
    """`prune(keep, aside)`: a set made ahead by an earlier process of this rank is renamed at once (its name
    free for the sets this process makes) and its memory freed by `remove_behind`, which `pruned` waits for;
    a set aside that a killed process left is removed by the next start's prune."""
    import subprocess

    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 1)
    _made_ahead(tier, 0, "w.safetensors")
    _made_ahead(tier, 1, "w.safetensors")
    again = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 1)  # rank 1's next process
    aside: list[str] = []
    again.prune(None, aside)
    assert sorted(n.split(".dstmp.")[0] for n in aside) == [".warm-1-0", ".warm-1-1"]
    assert not tier.warm(0, "w.safetensors").exists() and not tier.warm(1, "w.safetensors").exists()
    assert all((again.folder / n / "w.safetensors").read_bytes() == b"w" * 10 for n in aside)
    _made_ahead(again, 0, "w.safetensors")  # the name is free at once
    done: list[tuple[BaseException | None, float]] = []
    again.remove_behind(again.folder, aside, lambda e, s: done.append((e, s)))
    again.pruned()
    assert done and done[0][0] is None and not any((again.folder / n).exists() for n in aside)
    assert again.warm(0, "w.safetensors").read_bytes() == b"w" * 10  # this process's own set stays
    # A set aside by a process killed before it removed it: the next start's prune removes it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = again.folder / f".warm-1-1.dstmp.{dead.pid}.0"
    left.mkdir()
    (left / "w.safetensors").write_bytes(b"w")
    MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 1).prune(None)
    assert not left.exists()


def test_a_link_planted_in_place_of_a_set_made_ahead_is_set_aside_never_followed(tmp_path):
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    victim = _victim(tmp_path, "keep.txt")
    (tier.folder / ".warm-0-0").symlink_to(victim.parent, target_is_directory=True)

    aside: list[str] = []
    tier.prune(None, aside)
    done: list[BaseException | None] = []
    tier.remove_behind(tier.folder, aside, lambda e, s: done.append(e))
    tier.pruned()
    assert victim.read_text() == "not the tier's"
    assert isinstance(done[0], OSError) and ".warm-0-0.dstmp." in str(done[0])


# -- a hostile or careless neighbour ------------------------------------------------------------------------

NOBODY = 65534  # another user's uid (CI runs as root, which may chown)


def _victim(tmp_path: Path, name: str) -> Path:
    p = tmp_path / "elsewhere" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text("not the tier's")
    return p


def _folder_opens(top: Path, work: Callable[[], object]) -> collections.Counter[str]:
    """How many times `work()` opened each folder below `top` (and `top`, as "."), as inotify reports it."""
    libc = ctypes.CDLL(None, use_errno=True)
    in_open, in_isdir, in_nonblock = 0x20, 0x40000000, 0o4000
    fd = libc.inotify_init1(in_nonblock)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        watched = {}
        for folder, _, _ in os.walk(top):
            watched[libc.inotify_add_watch(fd, os.fsencode(folder), in_open)] = os.path.relpath(folder, top)
        work()
        events = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(fd, 1 << 16):
                events += chunk
    finally:
        os.close(fd)
    opens: collections.Counter[str] = collections.Counter()
    at = 0
    while at < len(events):
        wd, mask, _, size = struct.unpack_from("iIII", events, at)
        if mask & in_isdir and not events[at + 16 : at + 16 + size].strip(b"\0"):  # the watched folder itself
            opens[watched[wd]] += 1
        at += 16 + size
    return opens


def test_the_check_of_the_files_taken_over_opens_each_folder_once(tmp_path):
    """`ours` walks the folders of the names asked, in any order, opening each folder on the way once for all
    the names below it: a 1.1B rank's 270 weight files lie eight folders deep, and the check runs at every
    checkpoint."""
    from nanotron_datastates.tier.folders import ours

    top = tmp_path / "donor"
    names = [f"model/decoder/{i}/pp_block/{part}/w" for i in range(3) for part in ("attn", "mlp")]
    names += ["model/final/w", "optimizer/o", "w"]
    for rel in names:
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(b"x")
    folders = {os.path.relpath(f, top) for f, _, _ in os.walk(top)}
    asked = list(reversed(names)) + ["model/decoder/9/gone", "model/decoder/0/pp_block/attn/w/not-a-folder"]
    opens = _folder_opens(top, lambda: ours(top, asked))
    assert opens == dict.fromkeys(folders, 1)
    assert ours(top, asked) == set(names)


def test_only_regular_single_named_files_of_this_user_are_taken_over(tmp_path):
    """`ours`: of the names asked, those a save may overwrite: no link (to a file or on the way), no second
    name, no other user's file, nothing missing, no name that leaves the folder; found at any depth, in
    any order asked (a 1.1B rank's 270 weight files lie eight folders deep)."""
    from nanotron_datastates.tier.folders import ours

    top = tmp_path / "donor"
    deep = "m/model/decoder/0/pp_block/attn/qkv_proj/w0"
    for rel in ("a/b/w1", "a/b/w2", "a/c/w3", "d/w4", "a/b/shared", "a/b/theirs", deep, "w7"):
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(b"x")
    os.link(top / "a/b/shared", tmp_path / "second-name")  # a replica linked in: never overwritten
    os.chown(top / "a/b/theirs", NOBODY, NOBODY)
    victim = _victim(tmp_path, "w5")
    (top / "a/b/w5").symlink_to(victim)
    (top / "e").symlink_to(victim.parent, target_is_directory=True)  # a folder on the way is a link
    (top / "a/fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(top / "a/fifo")
    outside = ["../elsewhere/w5", str(victim), "a/../a/b/w1", "a//b/w2", "./d/w4", ""]
    asked = ["a/b/w1", "a/b/w2", "a/c/w3", "d/w4", "a/b/shared", "a/b/theirs", "a/b/w5", "e/w5", "gone/w6"]
    asked += [deep, "w7", "a/fifo", "a", *outside]
    want = {"a/b/w1", "a/b/w2", "a/c/w3", "d/w4", deep, "w7"}
    assert ours(top, asked) == want
    assert ours(top, list(reversed(asked))) == want
    assert ours(top, []) == set()
    assert ours(tmp_path / "nowhere", asked) == set()


def test_a_planted_marker_never_removes_anything_outside_the_step_folder(tmp_path):
    """A marker in the tier lists names; one listing an absolute path, a `..` path or a name under a linked
    folder is not followed: prune and drop remove only files inside the step's own folder."""
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    victims = [_victim(tmp_path, n) for n in ("absolute", "dotdot", "linked")]
    _hold(tier, 3)
    folder = tier.folder / "3"
    os.symlink(victims[2].parent, folder / "optimizer")
    hostile = {
        str(victims[0]): {"bytes": 1},
        os.path.relpath(victims[1], folder): {"bytes": 1},
        "optimizer/linked": {"bytes": 1},
        "model/w_0.safetensors": {"bytes": 10},
    }
    (folder / ".rank-0.json").write_text(json.dumps({"step": 3, "files": hostile}))
    _hold(tier, 4)  # a linked step folder holding a marker of rank 0
    os.symlink(victims[0].parent, tier.folder / "2")
    (victims[0].parent / ".rank-0.json").write_text(json.dumps({"step": 2, "files": {"absolute": {}}}))
    tier.prune(4)
    tier.drop(3)
    assert all(v.read_text() == "not the tier's" for v in victims)
    assert (victims[0].parent / ".rank-0.json").exists() and (tier.folder / "2").is_symlink()
    assert tier.steps() == [4]


@pytest.mark.parametrize("how", ["owner", "mode", "link"])
def test_a_tier_folder_not_private_to_this_user_is_refused(tmp_path, how):
    """The tier's root and each job's folder must be this user's, 0700, and no link: one that another user
    created (or made writable to others) is refused, naming it."""
    base = tmp_path / "shm"
    if how == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        os.symlink(tmp_path / "real", base)
    else:
        base.mkdir(mode=0o700)
        os.chown(base, NOBODY, NOBODY) if how == "owner" else os.chmod(base, 0o777)
    with pytest.raises(trust.UntrustedPath, match=str(base)):
        MemoryTier(base, tmp_path / "ckpt", 0)
    with pytest.raises(trust.UntrustedPath, match=str(base)):
        jobs(base)


def test_the_default_tier_path_is_per_user():
    assert str(os.geteuid()) in str(tier_root(TrainerSettings().memory_tier_path))


def _planted(tmp_path: Path, engine, *, how: str) -> tuple[Path, dict, Path]:
    """A committed checkpoint in storage, and a copy of it in the tier whose first tensor's bytes are
    changed with its CRC-32C forged to match the manifest's: a copy another user planted (`how`: the tier's
    root is theirs, or the file is)."""
    root = tmp_path / "ckpt"
    folder = write_nanotron_checkpoint(engine, root, 7)
    doc = read_manifest(folder)
    base = tmp_path / "shm"
    planted = job_folder(base, root) / "7"
    for rel in doc["files"]:
        (planted / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / rel, planted / rel)
    rel = next(r for r in doc["files"] if r.startswith("model/"))
    raw = (planted / rel).read_bytes()
    header = fmt.read_header(planted / rel)
    begin = header.data_start
    forged = forge_crc32c(raw[begin:], {0: raw[begin] ^ 0x40, 1: raw[begin + 1] ^ 0x01}, 8)
    (planted / rel).write_bytes(raw[:begin] + forged)
    (planted / ".rank-0.json").write_text(json.dumps({"step": 7, "files": doc["files"]}))
    if how == "root":
        for d, dirs, names in os.walk(base):
            for n in [d, *(os.path.join(d, x) for x in dirs + names)]:
                os.chown(n, NOBODY, NOBODY)
    else:
        base.chmod(0o700)
        job_folder(base, root).chmod(0o700)
        os.chown(planted / rel, NOBODY, NOBODY)
    return folder, doc, planted / rel


@pytest.mark.parametrize("how", ["root", "file"])
def test_a_planted_copy_with_forged_checksums_is_never_used(tmp_path, engine, how):
    """Checksums cannot tell a planted copy from ours (its CRCs are forged to match the manifest's, which the
    engine confirms by loading it): the tier serves a copy only from a private folder of this user's, every
    file a regular file of ours; else the resume reads storage, saying why."""
    folder, doc, rel_path = _planted(tmp_path, engine, how=how)
    rel = rel_path.relative_to(job_folder(tmp_path / "shm", folder.parent) / "7").as_posix()
    sums = file_checksums(doc, folder, folder / rel)
    planted = engine.load(rel_path, checksums=sums)["data"]  # passes every checksum ...
    assert not torch.equal(planted, engine.load(folder / rel, checksums=sums)["data"])  # ... yet differs
    settings = TrainerSettings(memory_tier=True, memory_tier_path=str(tmp_path / "shm"))
    assert tier_copy(settings, folder, doc, 0) is None
    why = why_not(settings, folder, doc, 0)
    assert why and ("uid" in why), why


def test_a_marked_name_under_a_linked_folder_is_not_followed(tmp_path):
    """A valid marker whose file lies under a folder that became a link: the drop removes the link, never
    what it points to."""
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    victim = _victim(tmp_path, "w_0.safetensors")
    _hold(tier, 3)
    shutil.rmtree(tier.folder / "3" / "model")
    os.symlink(victim.parent, tier.folder / "3" / "model")
    tier.drop(3)
    assert victim.read_text() == "not the tier's" and tier.steps() == []


def test_the_room_check_counts_what_the_tier_holds_while_other_ranks_rename_into_it(tmp_path, monkeypatch):
    """The node's ranks check the room at once, each writing job.json through a temporary renamed into
    place: a file listed and gone before it is measured counts for nothing, and the check goes on."""
    t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    _hold(t, 10)
    walk = trust.walk_tree

    def with_a_vanished_file(root, name=""):
        for fd, rel, entry, is_dir in walk(root, name):
            if not rel and not is_dir and entry == "job.json":
                yield fd, rel, ".job.json.123.0.tmp", False  # listed, then renamed by another rank
            yield fd, rel, entry, is_dir

    check_room(t, 1)
    monkeypatch.setattr(trust, "walk_tree", with_a_vanished_file)
    assert tree_size(t.folder) == 10 + (t.folder / "job.json").stat().st_size + len(
        (t.folder / "10" / ".rank-0.json").read_bytes()
    )
    check_room(t, 1)


def test_a_pulled_step_is_marked_held_with_the_files_the_rank_marked_before(tmp_path):
    """`mark_held` (a restart's pull): the rank's marker of the step lists its files, those it marked before
    kept, and is not written again where it lists them all already."""
    from nanotron_datastates.tier.replica_restore import mark_held

    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=2)
    _hold(tier, 7)  # model/w_0.safetensors marked by its save
    mark_held(tier, 7, {"optimizer/o_0.safetensors": {"bytes": 4}})
    assert tier.marked(7, 0) == {
        "model/w_0.safetensors": {"bytes": 10},
        "optimizer/o_0.safetensors": {"bytes": 4},
    }
    marker = tier.folder / "7" / ".rank-0.json"
    before = marker.stat().st_ino
    mark_held(tier, 7, {"model/w_0.safetensors": {"bytes": 10}})
    assert marker.stat().st_ino == before and tier.held_steps() == [7]
