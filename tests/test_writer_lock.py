"""One writer per checkpoints folder: a second job on the same folder fails at its start, naming the folder
and the holder; the lock goes with the holder's process."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_datastates import trust
from nanotron_datastates.store.writer_lock import LOCK, FolderBusy, WriterLock


def _hold(root: str, held, done) -> None:
    lock = WriterLock(root).acquire()
    held.set()
    done.wait(30)
    lock.release()


@contextlib.contextmanager
def _held_elsewhere(root: Path) -> Iterator[multiprocessing.process.BaseProcess]:
    """Another process holding the folder's writer lock, until the block ends."""
    ctx = multiprocessing.get_context("spawn")
    held, done = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(str(root), held, done))
    other.start()
    try:
        assert held.wait(60)
        yield other
    finally:
        done.set()
        other.join(30)


def test_a_second_job_on_the_same_folder_fails_at_start_naming_the_holder(tmp_path):
    with _held_elsewhere(tmp_path) as other:
        with pytest.raises(FolderBusy) as e:
            WriterLock(tmp_path).acquire()
        message = str(e.value)
        assert str(tmp_path) in message and f"pid {other.pid}" in message and socket.gethostname() in message
    WriterLock(tmp_path).acquire().release()  # free once the holder is gone


def test_a_killed_holder_leaves_the_folder_free(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    held, done = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(str(tmp_path), held, done))
    other.start()
    assert held.wait(60)
    other.kill()
    other.join(30)
    WriterLock(tmp_path).acquire().release()


def test_two_trainers_of_one_process_on_one_folder_are_refused(tmp_path):
    first = WriterLock(tmp_path).acquire()
    with pytest.raises(FolderBusy, match="this process"):
        WriterLock(tmp_path / ".." / tmp_path.name).acquire()
    first.release()
    WriterLock(tmp_path).acquire().release()


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(target, root / LOCK)
    with pytest.raises(trust.UntrustedPath, match="link"):
        WriterLock(root).acquire()
    assert target.read_text() == "keep"


def test_a_holder_line_nested_too_deeply_still_names_the_folder(tmp_path):
    """The holder's line is read back for the message only: whatever is there, the error is FolderBusy."""
    with _held_elsewhere(tmp_path):
        with open(tmp_path / LOCK, "r+b") as f:  # the same file: the other process keeps its lock
            f.write(b"[" * 4096)
        with pytest.raises(FolderBusy, match="holder unknown") as e:
            WriterLock(tmp_path).acquire()
        assert str(tmp_path) in str(e.value)
