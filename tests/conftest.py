"""Shared fixtures: engines on both flush backends, a small tmpfs for ENOSPC, byte-exact tensor comparison."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_datastates import DataStatesEngine

from helpers import BACKENDS, small_config

# The adapter's tests need one Nanotron importable: test_nanotron_trees.py runs them once per tree.
collect_ignore = [] if os.environ.get("NANOTRON_SRC") else ["adapter"]


@pytest.fixture(params=BACKENDS)
def engine(request) -> Iterator[DataStatesEngine]:
    with DataStatesEngine(small_config(io_backend=request.param)) as e:
        yield e


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh folder in /dev/shm (tmpfs, where the memory tier lives), removed after the test."""
    if not os.path.isdir("/dev/shm"):
        pytest.fail("/dev/shm (tmpfs) is missing: this test needs a file in memory")
    d = Path(tempfile.mkdtemp(prefix="ds-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only): writes past it fail with ENOSPC."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
