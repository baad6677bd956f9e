"""A checkpoint's small files written and read: atomic writes made durable, and JSON or YAML documents read
without trusting them (a missing or malformed one reads as {}; a path that is not a regular file, never)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .. import trust


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Temporary file in the same folder, fsync, rename, fsync of the folder: readers see all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync of a file, or of a folder (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from `path`; {} if it is missing, unreadable or not an object (for describing folders
    whatever state they are in); an OSError naming it where it is not a regular file (a FIFO, a folder)."""
    return _read_doc(path, json.loads, ValueError)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Like `read_json`, for YAML (Nanotron's config.yaml)."""
    import yaml

    return _read_doc(path, yaml.safe_load, yaml.YAMLError)


def _read_doc(
    path: str | os.PathLike, parse: Callable[[bytes], object], bad: type[Exception]
) -> dict[str, object]:
    try:
        with os.fdopen(trust.open_to_read(path), "rb") as f:
            doc = parse(f.read())
    except (trust.UntrustedPath, IsADirectoryError):
        raise  # not a file at all: never taken for a missing one
    except (OSError, ValueError, bad):
        return {}
    return doc if isinstance(doc, dict) else {}
