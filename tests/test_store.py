"""The POSIX store of a checkpoints folder (nanotron_datastates/store/posix.py), on real folders and
processes: atomic writes, `latest.txt` moved only under the folder's lock (held by another process, or
reentered by this one), removal that takes the commit markers first, temporaries, telemetry lines, the
writer lock. Hostile trees (links, deep chains, swapped folders) are tests/test_hostile_neighbour.py's and
test_housekeeping.py's, through the same store."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_datastates import trust
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST, NANOTRON_METADATA
from nanotron_datastates.save import housekeeping
from nanotron_datastates.store import Store, open_store
from nanotron_datastates.store.posix import LOCK, FolderStore
from nanotron_datastates.store.writer_lock import FolderBusy


def _checkpoint(store: Store, step: int, *, stock: bool = False) -> Path:
    """A committed checkpoint of `step`: a weight file, then its marker (ours, or Nanotron's own)."""
    (store.path(f"{step}/model")).mkdir(parents=True)
    store.path(f"{step}/model/w.safetensors").write_bytes(b"x" * 10)
    if stock:
        store.write_atomic(f"{step}/{NANOTRON_METADATA}", "{}")
    else:
        store.write_atomic(f"{step}/{MANIFEST}", json.dumps(make_manifest(step, {}, {})))
    return store.path(str(step))


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


# -- writes --------------------------------------------------------------------------------------------------


def test_open_store_gives_the_posix_store_of_the_folder(tmp_path):
    store = open_store(tmp_path)
    assert isinstance(store, FolderStore) and store.root == tmp_path
    assert store.path("40/datastates.json") == tmp_path / "40" / "datastates.json"
    for bad in ("../elsewhere", "/etc/passwd", "40/../../x", "", "a\\b"):
        with pytest.raises(trust.UntrustedPath):
            store.path(bad)
        with pytest.raises(trust.UntrustedPath):
            store.write_atomic(bad, "x")
    assert not (tmp_path.parent / "elsewhere").exists()


def test_write_atomic_replaces_the_file_whole_makes_its_folders_and_leaves_no_temporary(tmp_path):
    store = open_store(tmp_path / "ckpt")
    store.write_atomic("40/optimizer/optimizer_config.json", '{"a": 1}')
    store.write_atomic("40/optimizer/optimizer_config.json", b'{"b": 2}')
    assert (tmp_path / "ckpt/40/optimizer/optimizer_config.json").read_text() == '{"b": 2}'
    assert _leftovers(tmp_path / "ckpt") == []


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(small_tmpfs):
    store = open_store(small_tmpfs)
    store.write_atomic("40/config.yaml", "old: 1\n")
    with pytest.raises(OSError) as e:
        store.write_atomic("40/config.yaml", b"x" * (8 << 20))  # twice the tmpfs
    assert e.value.errno == errno.ENOSPC
    assert (small_tmpfs / "40" / "config.yaml").read_text() == "old: 1\n"
    assert _leftovers(small_tmpfs) == []


# -- listing and latest.txt ----------------------------------------------------------------------------------


def test_steps_in_step_order_and_what_is_committed(tmp_path):
    store = open_store(tmp_path)
    for step in (100, 9, 20):
        _checkpoint(store, step, stock=step == 9)
    (tmp_path / "30").mkdir()  # a save in flight
    (tmp_path / "030").mkdir()  # not a step's name
    assert store.steps() == [9, 20, 30, 100]
    assert [s for s in store.steps() if store.is_committed(s)] == [9, 20, 100]
    assert store.latest() is None
    with pytest.raises(ValueError, match="not a step number"):
        store.is_committed(-1)


def _python(code: str, *args: str) -> subprocess.Popen:
    """A Python process of its own running `code` (stdin and stdout piped)."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


HOLD = """
import sys
from nanotron_datastates.store import open_store
with open_store(sys.argv[1]).locked():
    print("held", flush=True)
    sys.stdin.readline()
"""

PROBE = """
import fcntl, os, sys
from nanotron_datastates.store.posix import LOCK
fd = os.open(sys.argv[1] + "/" + LOCK, os.O_RDWR | os.O_CREAT)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free", flush=True)
except OSError:
    print("held", flush=True)
"""


def _probe(root: Path) -> str:
    """Whether another process finds the folder's lock free or held."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(root)], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_latest_moves_only_once_another_process_lets_go_of_the_lock(tmp_path):
    store = open_store(tmp_path)
    store.set_latest(10)
    holder = _python(HOLD, str(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "held"
        mover = threading.Thread(target=store.set_latest, args=(20,), daemon=True)
        mover.start()
        time.sleep(1.0)
        assert mover.is_alive() and store.latest() == 10  # waits on the other process's lock
        holder.stdin.write("go\n")
        holder.stdin.flush()
        mover.join(300)
        assert not mover.is_alive() and store.latest() == 20
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LATEST).read_text() == "20" and (tmp_path / LOCK).is_file()


@pytest.mark.slow
def test_the_lock_is_reentrant_and_an_inner_block_never_lets_it_go(tmp_path):
    store = open_store(tmp_path)
    assert _probe(tmp_path) == "free"
    with store.locked():
        store.set_latest(7)  # takes the lock again, inside
        assert _probe(tmp_path) == "held"  # still held: the inner release left the outer one's lock
        with store.locked():
            pass
        assert _probe(tmp_path) == "held"
    assert _probe(tmp_path) == "free" and store.latest() == 7


# -- removal -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _unremovable(folder: Path) -> Iterator[None]:
    """`folder`'s entries cannot be removed: read-only for a user; for root, whom modes do not stop, also
    immutable (`chattr +i`). Skips where neither holds here."""
    folder.chmod(0o500)
    immutable = os.geteuid() == 0 and shutil.which("chattr") is not None
    if immutable:
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        probe = folder / "probe"
        try:
            probe.touch()
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip(f"{folder}: no folder here whose files cannot be removed (root without chattr +i)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o700)


def _walked_first(folder: Path) -> Path:
    """A new subfolder of `folder`, holding a file, that a removal of the tree reaches before anything else
    (`trust.walk_tree` takes a folder's entries from the end of its listing); skips where none can be made."""
    for i in range(500):
        sub = folder / f"sub{i}"
        sub.mkdir()
        if os.listdir(folder)[-1] == sub.name:
            (sub / "f").write_bytes(b"f")
            return sub
        sub.rmdir()
    pytest.skip(f"{folder}: this file system lists new entries first: no subfolder is removed first")


@pytest.mark.parametrize("stock", [False, True], ids=["manifest", "nanotron-metadata"])
def test_a_removal_cut_short_never_leaves_something_that_looks_committed(tmp_path, stock):
    store = open_store(tmp_path)
    folder = _checkpoint(store, 10, stock=stock)
    with _unremovable(_walked_first(folder)):  # the tree's removal fails before it reaches the markers
        assert store.remove_step(10) is False  # the tree could not go ...
        assert folder.is_dir() and (folder / "model" / "w.safetensors").is_file()
        assert not store.is_committed(10)  # ... but its markers went first
    assert store.remove_step(10) and store.steps() == []


def test_rotation_cut_short_uncommits_before_it_removes(tmp_path):
    store = open_store(tmp_path)
    for step in (10, 20, 30):
        _checkpoint(store, step)
    store.set_latest(30)
    with _unremovable(_walked_first(tmp_path / "10")):
        removed = housekeeping.rotate(tmp_path, 1, committed_step=30)
        assert removed == [tmp_path / "20"]  # 10 could not be removed: not reported
        assert store.steps() == [10, 30]
        assert [s for s in store.steps() if store.is_committed(s)] == [30]
    assert housekeeping.rotate(tmp_path, 1, committed_step=30) == [tmp_path / "10"]  # a leftover, uncommitted


def test_remove_takes_files_folders_and_links_never_their_targets(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    store = open_store(tmp_path / "ckpt")
    store.write_atomic("a.txt", "a")
    store.write_atomic("sub/deep/b.txt", "b")
    (tmp_path / "ckpt" / "link").symlink_to(outside)
    assert store.remove("a.txt") and store.remove("sub") and store.remove("link")
    assert store.remove("a.txt") is False  # gone already
    assert sorted(os.listdir(tmp_path / "ckpt")) == [] and (outside / "keep").read_text() == "keep"


def test_remove_temporaries_takes_only_what_dead_saves_left(tmp_path):
    store = open_store(tmp_path)
    folder = _checkpoint(store, 10)
    (folder / "model" / ".w.safetensors.dstmp.123.4").write_bytes(b"half")
    (folder / ".config.yaml.abc.tmp").write_text("half")
    (folder / ".hidden").write_text("not a temporary")
    assert store.remove_temporaries(10) == 2
    assert _leftovers(folder) == [".hidden"] and store.is_committed(10)


# -- telemetry and the writer lock ---------------------------------------------------------------------------


def test_append_line_adds_whole_lines_and_never_waits_on_a_fifo(tmp_path):
    store = open_store(tmp_path / "ckpt")
    store.append_line("t.jsonl", json.dumps({"step": 1}))
    store.append_line("t.jsonl", json.dumps({"step": 2}) + "\n")
    assert (tmp_path / "ckpt" / "t.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    os.mkfifo(tmp_path / "ckpt" / "fifo")
    out: dict = {}

    def append() -> None:
        try:
            store.append_line("fifo", "x")
        except OSError as e:
            out["error"] = e

    thread = threading.Thread(target=append, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "append_line blocked on a FIFO"
    assert str(tmp_path / "ckpt" / "fifo") in str(out["error"])


def test_the_writer_lock_is_the_folders_one(tmp_path):
    first = open_store(tmp_path).writer_lock()
    try:
        with pytest.raises(FolderBusy, match=str(tmp_path)):
            open_store(tmp_path).writer_lock()
    finally:
        first.release()
    open_store(tmp_path).writer_lock().release()
