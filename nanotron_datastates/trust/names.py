"""Names read from files and folders: step numbers and names below a folder, checked before any is used."""

from __future__ import annotations

import errno
import re
from pathlib import PurePosixPath

from ..errors import UntrustedPath

_STEP = re.compile(r"(?:0|[1-9][0-9]{0,18})")  # ASCII only; at most 19 digits: fits 63 bits


def step_number(text: str) -> int | None:
    """The step a folder name or `latest.txt` holds, or None: canonical ASCII decimal only (`10`; not
    `010`, `+10`, `1_0`, ` 10`, `１０`), below 2**63."""
    if not isinstance(text, str) or _STEP.fullmatch(text) is None:
        return None
    n = int(text)
    return n if n < 2**63 else None


def relative_name(name: object, where: str = "") -> PurePosixPath:
    """`name` as a path below a folder, checked as `name_parts` checks it."""
    return PurePosixPath(*name_parts(name, where))


def name_parts(name: object, where: str = "") -> tuple[str, ...]:
    """`name`'s parts; UntrustedPath (naming `where`, e.g. the file that held the name) if it is not a
    non-empty relative POSIX path without `..`, `.`, empty parts, backslashes or NUL."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} is not a file name")
    if {"", ".", ".."}.intersection(parts := tuple(name.split("/"))):  # an absolute name starts with ""
        raise UntrustedPath(errno.EINVAL, f"{where}: {name!r} leaves its folder or is not a plain path")
    return parts
