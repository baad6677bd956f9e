"""A checkpoint folder's files as converting between Nanotron's stock layout and ours handles them: which
subfolder holds what, and the folder's files listed (each one a regular file), read, copied and made
durable."""

from __future__ import annotations

import errno
import os
import shutil
import stat
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
    naming any that is a link (a file or folder of somebody's copied into the output, else) or not a regular
    file (a FIFO), never skipped or followed. The folder is walked by descriptors (`trust.walk_tree`)."""
    rels = []
    for fd, where, name, is_dir in trust.walk_tree(folder):
        rel = os.path.join(where, name) if where else name
        if is_dir or any(part.startswith(".") for part in Path(rel).parts):
            continue
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise trust.UntrustedPath(
                errno.ELOOP, f"{folder / rel}: a link; convert follows none (copy the file in its place)"
            )
        rels.append(rel)
    rels.sort()
    for rel in rels:
        os.close(trust.open_to_read(folder / rel))  # a FIFO, a socket, a device: the error naming it
    return rels


def read_bytes(path: Path) -> bytes:
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        return f.read()


def copy_file(folder: Path, rel: str, dst: Path) -> None:
    """Copies `folder/rel`, reached with no link followed below `folder`, into the new file `dst`."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(trust.open_regular(rel, within=folder), "rb") as f:
        os.set_blocking(f.fileno(), True)
        with os.fdopen(os.open(dst, flags, 0o644), "wb") as out:
            shutil.copyfileobj(f, out, 16 << 20)
    fsync_path(dst)


def sync_folders(folder: Path) -> None:
    """Makes the new files' names durable before the file that marks the checkpoint whole is written."""
    for d, _, _ in os.walk(folder):
        fsync_path(d)
