"""A hostile or careless neighbour: removal (rotation, temporaries, the memory tier) never recurses on the
Python stack nor unlinks by path after a walk; the writer lock never truncates or blocks on what is not its
own regular file; the memory tier writes with no link followed, and its root sits only under folders that
no other user can change."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine, trust
from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST
from nanotron_datastates.save import housekeeping
from nanotron_datastates.store import open_store
from nanotron_datastates.store.posix import LOCK as STORE_LOCK
from nanotron_datastates.store.writer_lock import LOCK, WriterLock
from nanotron_datastates.tier.memory import MemoryTier
from nanotron_datastates.tier.replica_check import check_and_place
from nanotron_datastates.tier.replica_transfer import Transfer, _temporary
from nanotron_datastates.tier.replicas import replica_area

from helpers import small_config, within, write_nanotron_checkpoint

OTHER = 12345  # another user's uid (CI runs as root, which may chown)
DEPTH = 1500  # deeper than Python's default recursion limit
SWAPS = 10  # a folder swapped for a link at least this often while removals run


def _committed(root: Path, step: int) -> Path:
    folder = root / str(step)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "w.safetensors").write_bytes(b"x" * 10)
    write_atomic(folder / MANIFEST, json.dumps(make_manifest(step, {}, {})))
    return folder


def _chain(top: Path, depth: int, leaf: str) -> None:
    """`top/d/d/.../d/leaf`, `depth` folders deep (made by descriptor: the path exceeds PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.fixture
def deep_cleanup(tmp_path):
    """What a failed removal leaves, removed without Python's recursion (pytest's own cleanup recurses)."""
    yield
    subprocess.run(["rm", "-rf", str(tmp_path)], check=False)


# -- 1. rotation on a tree deeper than the Python stack ------------------------------------------------------


def test_rotation_removes_a_folder_chain_deeper_than_the_python_stack_and_keeps_working(
    tmp_path, deep_cleanup
):
    root = tmp_path / "ckpt"
    old = _committed(root, 10)
    _chain(old, DEPTH, "w.safetensors")
    for step in (20, 30):
        _committed(root, step)
    (root / LATEST).write_text("30")
    assert sorted(int(p.name) for p in housekeeping.rotate(root, 1, committed_step=30)) == [10, 20]
    assert not old.exists()
    _committed(root, 40)
    (root / LATEST).write_text("40")
    assert [p.name for p in housekeeping.rotate(root, 1, committed_step=40)] == ["30"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["40"]


def test_temporaries_at_the_bottom_of_a_deep_chain_are_removed(tmp_path, deep_cleanup):
    folder = _committed(tmp_path / "ckpt", 10)
    _chain(folder, DEPTH, ".w.safetensors.dstmp.1.0")
    assert housekeeping.remove_temporaries(folder) == 1
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    (tier.folder / "7").mkdir()
    _chain(tier.folder / "7", DEPTH, ".w.safetensors.dstmp.999999999.0")  # no such process
    tier.prune(None)  # what dead processes were writing goes
    assert not _files_below(tier.folder / "7")
    tier.prune(8)  # unmarked, below the step kept: the whole chain goes
    assert tier.steps() == [] and not (tier.folder / "7").exists()


def _files_below(folder: Path) -> list[str]:
    out = subprocess.run(["find", str(folder), "-type", "f"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_a_tree_removal_takes_links_fifos_and_nested_folders_themselves_and_never_a_target(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_bytes(b"keep")
    tree = tmp_path / "ckpt" / "10"
    for i in range(3):
        (tree / f"d{i}" / "inner").mkdir(parents=True)
        (tree / f"d{i}" / "inner" / "w.safetensors").write_bytes(b"w")
    os.symlink(outside, tree / "d0" / "to_folder")
    os.symlink(outside / "sub" / "keep", tree / "d1" / "inner" / "to_file")
    os.mkfifo(tree / "d2" / "fifo")
    assert trust.remove_tree(tmp_path / "ckpt", "10") and not tree.exists()
    assert (outside / "sub" / "keep").read_bytes() == b"keep"
    # The folder itself a link, missing, or a file: not removed, and nothing reached through it.
    os.symlink(outside, tmp_path / "ckpt" / "20")
    (tmp_path / "ckpt" / "30").write_bytes(b"")
    for name in ("20", "30", "40", "20/sub"):
        assert trust.remove_tree(tmp_path / "ckpt", name) is False, name
    assert (outside / "sub" / "keep").read_bytes() == b"keep" and (tmp_path / "ckpt" / "30").is_file()


# -- 2. a folder swapped for a link while it is removed ------------------------------------------------------

NAMES = [f".w{i}.safetensors.dstmp.1.{i}" for i in range(48)]  # temporaries, by their names


def _swapper(tree: Path, park: Path, outside: Path, stop: threading.Event, swaps: list[int]) -> None:
    """Keeps `tree/sub` alternating between a real folder full of files and a link to `outside`."""
    sub, real = tree / "sub", park / "sub"
    while not stop.is_set():
        with contextlib.suppress(OSError):
            real.mkdir(exist_ok=True)
            for n in NAMES:
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(real / n, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.rename(real, sub)  # the real folder in the tree ...
            time.sleep(0.0002)
            os.rename(sub, real)  # ... out again, and a link in its place
            os.symlink(outside, sub)
            swaps[0] += 1
            time.sleep(0.0002)
        with contextlib.suppress(OSError):
            if os.path.islink(sub):
                os.unlink(sub)


@pytest.mark.parametrize("how", ["temporaries", "tree"])
def test_a_subfolder_swapped_for_a_link_mid_removal_never_costs_a_file_outside(tmp_path, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    for n in NAMES:
        (outside / n).write_bytes(b"keep")
    root, park = tmp_path / "ckpt", tmp_path / "park"
    park.mkdir()
    stop, swaps = threading.Event(), [0]
    thread = threading.Thread(target=_swapper, args=(root / "10", park, outside, stop, swaps), daemon=True)
    thread.start()
    removed = rounds = 0
    # Raced for 2 s, and on until enough swaps and removals have met (a loaded machine runs fewer of each in
    # that time); bounded all the same.
    start = time.monotonic()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the two threads interleave finely
    try:
        while time.monotonic() - start < 2.0 or (swaps[0] <= SWAPS or rounds <= 2 * SWAPS):
            if time.monotonic() - start > 300:
                break
            (root / "10").mkdir(parents=True, exist_ok=True)
            rounds += 1
            for _ in range(20):  # the swapper's turn to put the folder in
                if os.path.lexists(root / "10" / "sub"):
                    break
                time.sleep(0.0002)
            if how == "temporaries":
                with contextlib.suppress(OSError):  # a folder moved while searched ends the search
                    removed += housekeeping.remove_temporaries(root / "10")
            else:
                removed += trust.remove_tree(root, "10")
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and swaps[0] > SWAPS and rounds > 2 * SWAPS, (swaps, rounds, removed)
    lost = [n for n in NAMES if not (outside / n).is_file() or (outside / n).read_bytes() != b"keep"]
    assert not lost, f"{len(lost)} files outside deleted through a swapped link, e.g. {lost[:3]}"
    # Nothing racing: the same removal takes what is really there (how much it took while raced is luck).
    calm = root / "20" / "sub"
    calm.mkdir(parents=True)
    for n in NAMES:
        (calm / n).write_bytes(b"")
    if how == "temporaries":
        assert housekeeping.remove_temporaries(root / "20") == len(NAMES)
    else:
        assert trust.remove_tree(root, "20") and not (root / "20").exists()


# -- 3. the writer lock is a regular file of its own, or refused ---------------------------------------------


def _acquire_within(root: Path, seconds: float = 10.0) -> BaseException | None:
    """What WriterLock(root).acquire() raised (None: it took the lock, then released); fails if it blocks."""
    out: dict = {}

    def go() -> None:
        try:
            out["lock"] = WriterLock(root).acquire()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the writer lock of {root} blocked"
    if "lock" in out:
        out["lock"].release()
    return out.get("error")


def test_a_writer_lock_that_is_a_hard_link_to_another_file_is_refused_and_the_file_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("somebody's precious text")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(victim, root / LOCK)
    error = _acquire_within(root)
    assert isinstance(error, trust.UntrustedPath) and str(root / LOCK) in str(error), error
    assert "link" in str(error)
    assert victim.read_text() == "somebody's precious text"


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _device(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("no permission to make a device here")


@pytest.mark.parametrize("make", [_fifo, _device], ids=["fifo", "device"])
def test_a_writer_lock_that_is_not_a_regular_file_is_refused_at_once_naming_it(tmp_path, make):
    make(tmp_path / LOCK)
    error = _acquire_within(tmp_path)
    assert isinstance(error, trust.UntrustedPath), repr(error)
    assert str(tmp_path / LOCK) in str(error) and "not a regular file" in str(error)


def test_a_writer_lock_of_our_own_keeps_working(tmp_path):
    lock = WriterLock(tmp_path).acquire()
    try:
        doc = json.loads((tmp_path / LOCK).read_text())
        assert doc["pid"] == os.getpid()
    finally:
        lock.release()
    (tmp_path / LOCK).write_text('{"host": "a much longer line than the holder writes", "pid": 1, "x": 0}')
    WriterLock(tmp_path).acquire().release()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()  # the old line replaced whole


def _set_latest_within(root: Path) -> BaseException | None:
    """What moving `latest.txt` under the store's lock raised (None: it moved); fails if it blocks."""
    return within(lambda: open_store(root).set_latest(20), 10.0, fifos=(root / STORE_LOCK,)).get("error")


@pytest.mark.parametrize("make", [_fifo, _device], ids=["fifo", "device"])
def test_the_store_lock_that_is_not_a_regular_file_is_refused_at_once_naming_it(tmp_path, make):
    make(tmp_path / STORE_LOCK)
    error = _set_latest_within(tmp_path)
    assert isinstance(error, trust.UntrustedPath), repr(error)
    assert str(tmp_path / STORE_LOCK) in str(error) and "not a regular file" in str(error)
    assert not (tmp_path / LATEST).exists()


def test_the_store_lock_is_never_created_through_a_link(tmp_path):
    target = tmp_path / "elsewhere" / "nologin"
    target.parent.mkdir()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / STORE_LOCK).symlink_to(target)
    error = _set_latest_within(root)
    assert isinstance(error, trust.UntrustedPath) and str(root / STORE_LOCK) in str(error), repr(error)
    assert not target.exists() and not (root / LATEST).exists()


def test_the_store_lock_of_our_own_keeps_working(tmp_path):
    assert _set_latest_within(tmp_path) is None and (tmp_path / LATEST).read_text() == "20"
    assert _set_latest_within(tmp_path) is None  # the file left by the first


# -- 4. the memory tier writes with no link followed ---------------------------------------------------------


@pytest.fixture
def received(tmp_path):
    """A committed checkpoint's file (its name and manifest entry, its bytes), as a peer sends it."""
    with DataStatesEngine(small_config()) as engine:
        folder = write_nanotron_checkpoint(engine, tmp_path / "ckpt", 7)
        doc = read_manifest(folder)
        rel = next(r for r in doc["files"] if r.startswith("model/"))
        yield engine, rel, doc["files"][rel], (folder / rel).read_bytes()


def _receive(engine, into: Path, rel: str, entry: dict, raw: bytes) -> None:
    """What a rank does with a file it receives or pulls: a temporary made under `into`, filled, checked,
    renamed into place."""
    t = Transfer(0, rel, entry["bytes"])
    with _temporary(into, t):
        assert t.buf is not None
        t.buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        check_and_place(engine, [t], lambda _: entry)


def test_a_received_replica_lands_in_place(tmp_path, received):
    engine, rel, entry, raw = received
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    into = replica_area(tier, 1).folder / "7"
    _receive(engine, into, rel, entry, raw)
    assert (into / rel).read_bytes() == raw
    assert not [n for n in os.listdir((into / rel).parent) if ".dstmp." in n]
    trust.link_in(into.parent, tier.folder, f"7/{rel}")  # a replica of this node, linked in at a restart
    assert (tier.folder / "7" / rel).read_bytes() == raw and os.stat(into / rel).st_nlink == 2


@pytest.mark.parametrize("where", ["step", "subfolder"])
def test_a_replica_is_never_received_through_a_linked_folder(tmp_path, received, where):
    engine, rel, entry, raw = received
    outside = tmp_path / "outside"
    outside.mkdir()
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    area = replica_area(tier, 1)
    into = area.folder / "7"
    if where == "step":
        os.symlink(outside, into)
    else:
        into.mkdir()
        os.symlink(outside, into / rel.split("/")[0])
    with pytest.raises(trust.UntrustedPath, match="link"):
        _receive(engine, into, rel, entry, raw)
    if where == "step":
        with pytest.raises(trust.UntrustedPath, match="link"):
            area.commit(7, {rel: entry})  # the marker is never written through it either
    pulled_into = tier.folder / "7"  # a restart's pull into the rank's own tier, and a replica linked in
    os.symlink(outside, pulled_into)
    with pytest.raises(trust.UntrustedPath, match="link"):
        _receive(engine, pulled_into, rel, entry, raw)
    os.unlink(pulled_into)
    (area.folder / "8" / rel).parent.mkdir(parents=True)
    (area.folder / "8" / rel).write_bytes(raw)
    (tier.folder / "8").mkdir()
    os.symlink(outside, tier.folder / "8" / "model")
    with pytest.raises(trust.UntrustedPath, match="link"):
        trust.link_in(area.folder, tier.folder, f"8/{rel}")  # a replica of this node, linked in
    assert list(outside.iterdir()) == []


def test_a_recycled_tier_file_with_another_name_is_never_written_through(tmp_path):
    """A file of the tier with a second (hard) link: a later save taking it over would overwrite that other
    name's bytes too. It is not handed over: the save makes a new file."""
    rel = "model/w.safetensors"
    with DataStatesEngine(small_config()) as engine:
        t = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0, copies=1)
        h = engine.save({"w": torch.zeros(1000)}, tmp_path / "ckpt" / "1.safetensors", mirror=t.path(1, rel))
        h.wait_persisted()
        t.commit(1, {rel: {"bytes": os.stat(t.path(1, rel)).st_size}})
        elsewhere = tmp_path / "elsewhere.bin"
        os.link(t.path(1, rel), elsewhere)
        before = elsewhere.read_bytes()
        recycle = t.recycle(2, [rel])
        plan = engine.plan({"w": torch.ones(1000)})
        target = tmp_path / "ckpt" / "2.safetensors"
        engine.save_plans([(plan, target)], mirrors=[t.path(2, rel)], recycle=recycle)[0].wait_persisted()
        assert t.path(2, rel).read_bytes() == target.read_bytes()
    assert recycle == [None]
    assert elsewhere.read_bytes() == before


def _save_in_memory(engine, value: float, path: Path, recycle: Path | None = None):
    plan = engine.plan({"w": torch.full((300_000,), value)})
    h = engine.save_plans([(plan, path)], mirrors=[path], recycle=[recycle])[0]
    h.wait_persisted()
    return h


@pytest.mark.parametrize("kind", ["memory only", "with storage"])
def test_a_kept_mapping_whose_file_gained_a_second_name_is_never_written_through(tmp_path, caplog, kind):
    """The file of a mapping kept after its save gains a hard link from outside the tier; a later save that
    recycles it checks the file on the mapping's descriptor first: the outside name keeps its bytes, the save
    still succeeds, into a new file, and a warning names the file."""
    mem = tmp_path / "shm"
    with DataStatesEngine(small_config()) as engine:
        first = mem / "1" / "w.safetensors"
        if kind == "memory only":
            _save_in_memory(engine, 1.0, first)
        else:
            engine.save({"w": torch.full((300_000,), 1.0)}, tmp_path / "1.safetensors", mirror=first)
            engine.wait_persisted()
        elsewhere = tmp_path / "elsewhere.bin"
        os.link(first, elsewhere)
        before = elsewhere.read_bytes()
        second = mem / "2" / "w.safetensors"
        with caplog.at_level("WARNING", logger="nanotron_datastates"):
            if kind == "memory only":
                h = _save_in_memory(engine, 2.0, second, recycle=first)
            else:
                plan = engine.plan({"w": torch.full((300_000,), 2.0)})
                h = engine.save_plans(
                    [(plan, tmp_path / "2.safetensors")], mirrors=[second], recycle=[first]
                )[0]
                h.wait_persisted()
        assert elsewhere.read_bytes() == before  # never written through
        assert h.mirrored() and not h.stats["mirror_kept"] and "second name" in h.stats["mirror_refused"]
        assert os.stat(second).st_ino != os.stat(elsewhere).st_ino and os.stat(second).st_nlink == 1
        assert torch.equal(engine.load(second)["w"], torch.full((300_000,), 2.0))
        assert not first.exists()  # its name in the tier went; the outside name holds the file
        third = _save_in_memory(engine, 3.0, mem / "3" / "w.safetensors", recycle=second)
        assert third.stats["mirror_kept"]  # the engine keeps working: the new file's mapping is reused
    said = [r.getMessage() for r in caplog.records if "not written through" in r.getMessage()]
    assert len(said) == 1 and str(first) in said[0]


def test_a_kept_mappings_file_replaced_at_its_path_is_never_taken_for_it(tmp_path, caplog):
    """Another file put where a kept mapping's file was (same name, another inode): a save recycling that
    name must not write into the old mapping and publish the other file as its own. It goes to a new file."""
    mem = tmp_path / "shm"
    with DataStatesEngine(small_config()) as engine:
        first = mem / "1" / "w.safetensors"
        _save_in_memory(engine, 1.0, first)
        os.rename(first, tmp_path / "moved.bin")  # the mapped file, kept elsewhere
        first.write_bytes(b"not the mapped file")
        with caplog.at_level("WARNING", logger="nanotron_datastates"):
            h = _save_in_memory(engine, 2.0, mem / "2" / "w.safetensors", recycle=first)
        assert not h.stats["mirror_kept"] and "not the kept mirror copy" in h.stats["mirror_refused"]
        assert torch.equal(engine.load(mem / "2" / "w.safetensors")["w"], torch.full((300_000,), 2.0))
        assert torch.equal(engine.load(tmp_path / "moved.bin")["w"], torch.full((300_000,), 1.0))
    assert any(str(first) in r.getMessage() for r in caplog.records)


# -- 4. the tier's root sits only under folders no other user can change -------------------------------------


def test_a_tier_root_under_a_folder_others_may_write_is_refused_naming_that_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable, no sticky bit: anyone may rename the tier's root away
    with pytest.raises(trust.UntrustedPath, match=f"{shared}: "):
        MemoryTier(shared / "tier" / "{uid}", tmp_path / "ckpt", 0)
    assert not (shared / "tier").exists()  # nothing made in it
    shared.chmod(0o775)  # group-writable
    with pytest.raises(trust.UntrustedPath, match=f"{shared}: "):
        MemoryTier(shared / "tier", tmp_path / "ckpt", 0)


def test_a_tier_root_under_another_users_folder_or_link_is_refused_naming_it(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(trust.UntrustedPath, match=f"{theirs}: .*uid {OTHER}"):
        MemoryTier(theirs / "tier", tmp_path / "ckpt", 0)
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link)
    MemoryTier(link / "tier", tmp_path / "ckpt", 0)  # a link of this user's (or root's): followed, checked
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(trust.UntrustedPath, match=f"{link}: .*link"):
        MemoryTier(link / "tier", tmp_path / "ckpt", 0)


def test_a_tier_root_under_sticky_shared_folders_is_accepted(tmp_path, shm_dir):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp and /dev/shm are: others cannot rename or remove what is ours
    tier = MemoryTier(sticky / "tier-{uid}" / "job", tmp_path / "ckpt", 0)
    assert tier.folder.is_dir()
    assert stat.S_IMODE(os.stat(sticky / f"tier-{os.geteuid()}").st_mode) & 0o022 == 0
    assert stat.S_IMODE(os.stat("/dev/shm").st_mode) & 0o1002 == 0o1002
    assert MemoryTier(shm_dir / "tier", tmp_path / "ckpt", 0).folder.is_dir()
