"""The checkpoint folders on the disk: evicted from the page cache before a restore (`make_cold`), and the
older ones removed once a newer checkpoint is durable (`prune_before`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from _common import evict, resident_bytes


def make_cold(folder: Path, scope: str) -> dict[str, Any]:
    """Evicts `folder`'s files from the page cache and returns how many of their bytes stay resident.

    `scope` "checkpoint" (the default) evicts those files only (fadvise, after a sync): the restore then reads
    the checkpoint from the disk, while the libraries stay as warm as for the scratch runs its cost is taken
    over. "system" empties the whole page cache (drop_caches, root): the restore then also reloads CUDA's and
    torch's libraries from the disk, a cost the warm scratch runs do not pay (what earlier results measured).
    """
    os.sync()
    method = "fadvise"
    if scope == "system":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            method = "drop_caches+fadvise"
        except OSError:
            pass
    files = [p for p in folder.rglob("*") if p.is_file()]
    evict(files)
    return {
        "method": method,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "resident_bytes": resident_bytes(files),
    }


def prune_before(folder: Path, step: int) -> None:
    """Removes the checkpoints under `folder` older than the durable one of `step` (the disk holds few
    checkpoints of the 1B model: 15 GB each)."""
    for p in folder.iterdir() if folder.is_dir() else ():
        name = p.name.removeprefix("dcp_")
        if p.is_dir() and name.isdigit() and int(name) < step:
            shutil.rmtree(p, ignore_errors=True)
