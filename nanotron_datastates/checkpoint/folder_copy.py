"""A checkpoint folder's files as converting between Nanotron's stock layout and ours handles them: which
subfolder holds what, and the folder's files listed (each one a regular file), read, copied and made
durable."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import trust
from .file_io import fsync_path

CONFIG = "config.yaml"
MODEL = "model"  # the same files in both layouts
RANDOM = "random"
# Subfolders whose `.pt` pickles (stock) are engine-written safetensors (ours).
PICKLED = ("optimizer", "lr_scheduler")


def regular_files(folder: Path) -> list[str]:
    """The folder's files, relative, without hidden ones (temporaries of a save that died, locks); an error
    naming any that is not a regular file (a FIFO), never skipped."""
    found = [p.relative_to(folder) for p in folder.rglob("*") if not p.is_dir()]
    rels = sorted(str(r) for r in found if not any(part.startswith(".") for part in r.parts))
    for rel in rels:
        os.close(trust.open_to_read(folder / rel))
    return rels


def read_bytes(path: Path) -> bytes:
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        return f.read()


def copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(trust.open_to_read(src), "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out, 16 << 20)
    fsync_path(dst)


def sync_folders(folder: Path) -> None:
    """Makes the new files' names durable before the file that marks the checkpoint whole is written."""
    for d, _, _ in os.walk(folder):
        fsync_path(d)
