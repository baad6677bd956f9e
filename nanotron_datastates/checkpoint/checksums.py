"""What a manifest holds for each file: its size and its tensors' CRC-32C, written from a persisted save
(`file_entry`) and read back for a file being loaded (`file_checksums`, `file_block_checksums`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .manifest import ManifestError, entries
from .names import MANIFEST, name_in

if TYPE_CHECKING:
    from ..save.handle import SaveHandle


def file_checksums(
    doc: Mapping[str, object], folder: str | os.PathLike, path: str | os.PathLike
) -> dict[str, int] | None:
    """The checksums the manifest holds for `path` (a file of the checkpoint in `folder`), if any."""
    entry = entries(doc).get(name_in(path, folder))
    sums = entry.get("crc32c") if entry else None
    if not isinstance(sums, dict):
        return None
    return {name: int(v, 16) for name, v in sums.items()}


def file_entry(nbytes: int, handle: SaveHandle) -> dict[str, object]:
    """The manifest's entry for a persisted file (a SaveHandle's): its size and its tensors' CRCs; for a
    file whose header holds none (`exact_metadata`: Nanotron's weight files), its block segments' CRCs too,
    spelled as in a header (`B:` and 8 hex digits per segment), so that a part of it can be read and
    checked. A file saved unsummed (a memory checkpoint's, `memory_checksums` off) has neither: a read of it
    checks its structure and sizes."""
    from .. import format as fmt  # here: this module stays free of torch

    entry: dict[str, object] = {"bytes": nbytes}
    if not handle.summed:
        return entry
    entry["crc32c"] = {n: f"{c:08x}" for n, c in handle.checksums().items()}
    if handle.exact_metadata:
        size, blocks = handle.block_checksums()
        if size:
            entry["crc32c_blocks"] = {n: fmt.spell_blocks(size, v) for n, v in blocks.items()}
    return entry


def file_block_checksums(
    doc: Mapping[str, object], folder: str | os.PathLike, path: str | os.PathLike
) -> tuple[int, dict[str, list[int]]] | None:
    """The block checksums the manifest holds for `path`, if any (see `file_entry`)."""
    from .. import format as fmt  # here: this module stays free of torch

    rel = name_in(path, folder)
    raw = (entries(doc).get(rel) or {}).get("crc32c_blocks")
    if raw is None:
        return None
    bad = ManifestError(f"{folder}/{MANIFEST}: the block checksums of {rel} are malformed")
    if not isinstance(raw, dict):
        raise bad
    sizes, out = set(), {}
    for name, text in raw.items():
        parsed = fmt.parse_blocks(text) if isinstance(text, str) else None
        if parsed is None:
            raise bad
        sizes.add(parsed[0])
        out[str(name)] = parsed[1]
    if len(sizes) != 1:
        raise bad
    return sizes.pop(), out
