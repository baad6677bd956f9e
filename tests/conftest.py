"""Shared fixtures: engines on both flush backends, a small tmpfs for ENOSPC, byte-exact tensor comparison."""

from __future__ import annotations

import os
import subprocess
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
