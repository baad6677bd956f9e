"""A checkpoint's small files written and read: atomic writes made durable, and JSON or YAML documents read
without trusting them (a missing or malformed one reads as {}; a path that is not a regular file, or one
over MAX_SIDE_FILE bytes, never)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import trust
from ..errors import FormatError

MAX_SIDE_FILE = 16 << 20  # bytes: Nanotron's metadata and config are kilobytes


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
    whatever state they are in); an OSError naming it where it is not a regular file (a FIFO, a folder) or
    holds more than MAX_SIDE_FILE bytes."""
    return _read_doc(path, json.loads, ValueError)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Like `read_json`, for YAML (Nanotron's config.yaml)."""
    import yaml

    return _read_doc(path, yaml.safe_load, yaml.YAMLError)


def section(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`doc[key]` where it is a mapping, else {}: a document read from a file names any type anywhere."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """`read_yaml` for a reader that needs the document: FormatError, naming the file, where it is malformed
    or not a mapping; FileNotFoundError where it is missing."""
    import yaml

    return _read_doc(path, yaml.safe_load, yaml.YAMLError, strict=True)


def _read_doc(
    path: str | os.PathLike, parse: Callable[[bytes], object], bad: type[Exception], strict: bool = False
) -> dict[str, Any]:
    try:
        data = _read_bounded(path)
    except FileNotFoundError:
        if strict:
            raise
        return {}
    except OSError as e:
        if strict or isinstance(e, (trust.UntrustedPath, IsADirectoryError)) or e.errno == errno.EFBIG:
            raise  # not a file at all, or not one of Nanotron's: never taken for a missing one
        return {}
    try:
        doc = parse(data)
    except (ValueError, RecursionError, bad) as e:  # nested deeper than the parser's recursion: malformed
        if strict:
            raise FormatError(f"{path}: malformed ({type(e).__name__})") from None
        return {}
    if strict and not isinstance(doc, dict):
        raise FormatError(f"{path}: not a mapping of keys to values")
    return doc if isinstance(doc, dict) else {}


def _read_bounded(path: str | os.PathLike) -> bytes:
    """The file's bytes, never more than MAX_SIDE_FILE read (its size checked first, its growth after)."""
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        if os.fstat(f.fileno()).st_size <= MAX_SIDE_FILE:
            data = f.read(MAX_SIDE_FILE + 1)
            if len(data) <= MAX_SIDE_FILE:
                return data
    raise OSError(errno.EFBIG, f"{path}: more than the {MAX_SIDE_FILE} bytes a side file may hold")
