"""I/O failures in the middle of a save, for real: EIO (the core's fault hook), EACCES, a read-only
filesystem, the target directory removed. Each is an OSError from the save's wait naming the file, leaves
nothing at the final path, harms no earlier file, and the same engine saves again once the cause is gone."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine

from helpers import BACKENDS, injected_fault, no_temporaries, same, small_config


def _state(n: int = 1 << 20) -> dict:
    return {"a": torch.randn(n), "b": torch.arange(1000)}


def _check_fails_then_recovers(engine, folder, fault, expect_errno) -> list[str]:
    """A good file first; within `fault`, a new file and an overwrite of the good one both fail; then a save
    succeeds. Returns the error messages."""
    good, target = folder / "good.safetensors", folder / "x.safetensors"
    engine.save({"v": torch.arange(100)}, good).wait_persisted()
    before = good.read_bytes()
    messages = []
    with fault:
        for path in (target, good):
            h = engine.save(_state(), path)
            with pytest.raises(OSError) as e:
                h.wait_persisted()
            assert e.value.errno == expect_errno, e.value
            assert e.value.filename == str(path)
            messages.append(str(e.value))
    assert not target.exists() and good.read_bytes() == before
    assert no_temporaries(folder)
    state = _state()
    engine.save(state, target).wait_persisted()
    assert same(engine.load(target)["a"], state["a"])
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["write", "fsync"])
def test_eio_in_the_flush_layer(tmp_path, backend, kind):
    with DataStatesEngine(small_config(io_backend=backend)) as engine:
        # Every matching op fails while armed; for writes, the first (a data piece) passes.
        fault = injected_fault(kind, errno.EIO, "dstmp", skip=1 if kind == "write" else 0, count=1 << 30)
        messages = _check_fails_then_recovers(engine, tmp_path, fault, errno.EIO)
        assert all(("fsync of" in m) == (kind == "fsync") for m in messages), messages


def test_eio_is_reported_by_the_engine_wide_waits_once(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        with injected_fault("write", errno.EIO, "bad", count=1 << 30):
            engine.save(_state(), tmp_path / "ok.safetensors")
            engine.save(_state(), tmp_path / "bad.safetensors")
            with pytest.raises(OSError, match="bad.safetensors"):
                engine.wait_persisted()
        engine.wait_persisted()  # reported once: the next wait is clean
        assert (tmp_path / "ok.safetensors").exists() and not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_eacces(what):
    # Under /tmp itself: pytest's own temporary folders cannot be entered by another user.
    top = Path(tempfile.mkdtemp(prefix="ds_eacces_", dir="/tmp"))
    top.chmod(0o755)
    locked = top / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)
    target = locked / "x.safetensors" if what == "file" else locked / "sub" / "x.safetensors"
    script = textwrap.dedent(
        f"""
        import errno, os, sys, torch
        from nanotron_datastates import DataStatesEngine, DataStatesConfig
        if os.geteuid() == 0:  # root ignores permissions: drop to nobody for the save
            os.setgid(65534); os.setuid(65534)
        with DataStatesEngine(DataStatesConfig(host_cache_size=16 / 1024, chunk_size=1)) as e:
            try:
                e.save({{"a": torch.ones(10)}}, {str(target)!r}).wait_persisted()
            except PermissionError as err:
                print("EACCES" if err.errno == errno.EACCES else err, "|", err)
            ok = "/tmp/ds_eacces_ok_%d.safetensors" % os.getpid()
            e.save({{"a": torch.ones(10)}}, ok).wait_persisted()
            os.unlink(ok)
            print("recovered")
        """
    )
    try:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        first, second = r.stdout.strip().splitlines()
        assert first.startswith("EACCES") and first.endswith(f"'{target}'"), first
        assert second == "recovered"
        assert os.listdir(locked) == []
    finally:
        shutil.rmtree(top)


@pytest.fixture
def remountable_tmpfs(small_tmpfs):
    yield small_tmpfs
    subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_filesystem(remountable_tmpfs, backend):
    mnt = remountable_tmpfs
    with DataStatesEngine(small_config(io_backend=backend)) as engine:
        good = mnt / "good.safetensors"
        engine.save({"v": torch.arange(100)}, good).wait_persisted()
        before = good.read_bytes()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for path in (mnt / "x.safetensors", good):
            with pytest.raises(OSError) as e:
                engine.save({"v": torch.ones(1000)}, path).wait_persisted()
            assert e.value.errno == errno.EROFS and e.value.filename == str(path)
        assert good.read_bytes() == before
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        engine.save({"v": torch.ones(1000)}, mnt / "x.safetensors").wait_persisted()
        assert same(engine.load(mnt / "x.safetensors")["v"], torch.ones(1000))


@pytest.mark.parametrize("backend", BACKENDS)
def test_directory_removed_during_a_save(tmp_path, backend):
    # A 64 MiB state through a 4 MiB cache takes many flushes; the folder goes away in the middle.
    with DataStatesEngine(small_config(host_cache_size=4 / 1024, io_backend=backend)) as engine:
        folder = tmp_path / "gone"
        folder.mkdir()
        h = engine.save({"a": torch.randn(16 << 20)}, folder / "x.safetensors")
        # Once the temporary file exists (before, the engine would just create the folder again).
        deadline = time.monotonic() + 30
        while not any(folder.glob(".*dstmp*")) and time.monotonic() < deadline:
            time.sleep(0.0005)
        shutil.rmtree(folder)
        with pytest.raises(OSError) as e:
            h.wait_persisted()
        assert e.value.errno == errno.ENOENT and e.value.filename == str(folder / "x.safetensors")
        assert not folder.exists()
        folder.mkdir()
        state = {"a": torch.randn(1000)}
        engine.save(state, folder / "x.safetensors").wait_persisted()
        assert same(engine.load(folder / "x.safetensors")["a"], state["a"])
