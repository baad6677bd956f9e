"""The manifest, `datastates.json`, that marks a datastates checkpoint: made, read and checked.

Written by rank 0 once every rank's files are persisted and before `latest.txt` names the checkpoint, it
lists each file with its size and per-tensor CRC-32C. A checkpoint folder without it is either Nanotron's own
or incomplete. A manifest is trusted for nothing: every file it names must be a file of this layout inside
the checkpoint's folder (`member`), or reading it is a ManifestError naming the entry.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from .. import trust
from ..errors import DataStatesError
from .names import FOLDERS, MANIFEST

MANIFEST_FORMAT = "nanotron-datastates"
MANIFEST_VERSION = 1

MAX_MANIFEST = 256 << 20  # bytes a manifest may hold (about 1 KB per file; a million files)
MAX_FILES = 1 << 20
_MAX_DIM = 1 << 20  # ranks per dimension of a topology
_HEX8 = re.compile(r"[0-9a-f]{8}")

# Files with their manifest entries (size, checksums), by name: a manifest's `files`, or a rank's of them
Entries = Mapping[str, Mapping[str, object]]


class ManifestError(DataStatesError, ValueError):
    """A manifest that is not ours, or names a file outside the checkpoint's layout."""


def is_datastates_checkpoint(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def manifest(
    step: int,
    topology: Mapping[str, int],
    files: Entries,
    replicas: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """A manifest; `replicas`: where each rank's memory copy is replicated (`nodes`: each rank's node;
    `holders`: the ranks keeping each rank's replicas), where it is."""
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "topology": topology,
        "files": dict(sorted(files.items())),
    }
    return {**doc, "replicas": replicas} if replicas else doc


def entries(doc: Mapping[str, object]) -> Entries:
    """The files a manifest lists, by name, each with its entry (size, checksums): as `check_manifest` passed
    them ({} where it lists none)."""
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def manifest_step(doc: Mapping[str, object]) -> int:
    """The step of the checkpoint a manifest describes; ManifestError where it names none."""
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ManifestError(f"the manifest names no step (step: {step!r})")
    return step


def entry_bytes(entry: Mapping[str, object]) -> int:
    """The size of a file, as its manifest entry gives it; ManifestError where the entry gives none."""
    size = entry.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int):
        raise ManifestError(f"a file's entry gives no size (bytes: {size!r})")
    return size


def manifest_text(doc: Mapping[str, object]) -> str:
    """A manifest as written: JSON, each top-level key on a line of its own and each file's entry on one line
    (a person reads it file by file). Made by the JSON module's C encoder, not its indenting one: this runs
    on the committer thread after every checkpoint, whose Python holds the GIL the training thread needs."""
    lines = []
    for key, value in doc.items():
        if key == "files" and isinstance(value, Mapping) and value:
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f' "files": {{\n{body}\n }}')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked against its schema (`check_manifest`): ManifestError,
    naming the file and the key, if it is not ours, is newer than this package, or holds anything of the
    wrong type or out of range; never followed through a link (OSError)."""
    path = Path(folder) / MANIFEST
    raw = trust.read_regular(path, MAX_MANIFEST)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    return check_manifest(doc, path)


def check_manifest(doc: object, path: str | os.PathLike) -> dict[str, Any]:
    """`doc` if it is a manifest this package reads, else ManifestError naming `path` and the key at fault.
    Checked: the format and version; the step, a step number; every file a file of the layout (`member`)
    with its size in 63 bits and its checksums spelled as written (8 lowercase hex digits per tensor; block
    checksums as text); the topology, positive integers (ZeRO stage 0-3) whose ranks fit the files listed
    (each tp x dp x pp x cp rank writes one)."""

    def bad(key: str, what: str) -> ManifestError:
        return ManifestError(f"{path}: {key} {what}")

    if (
        not isinstance(doc, dict)
        or doc.get("format") != MANIFEST_FORMAT
        or not isinstance(doc.get("files"), dict)
    ):
        raise ManifestError(f"{path} is not a nanotron-datastates manifest")
    version = doc.get("version", 0)
    if not _is_int(version) or version < 0:
        raise bad("'version'", f"is {version!r}, not a version number")
    if version > MANIFEST_VERSION:
        raise ManifestError(f"{path} was written by a newer nanotron-datastates (version {version})")
    step = doc.get("step")
    if not (isinstance(step, int) and _is_int(step) and 0 <= step < 2**63):
        raise bad("'step'", f"is {step!r}, not a step number")
    files = doc["files"]
    if len(files) > MAX_FILES:
        raise bad("'files'", f"lists {len(files)} files, more than {MAX_FILES}")
    for rel, entry in files.items():
        why = _not_a_member(rel)
        if why:
            raise bad(f"entry {rel!r}", why)
        _check_entry(entry, f"files[{rel!r}]", bad)
    topo = doc.get("topology", {})
    if not isinstance(topo, dict):
        raise bad("'topology'", "is not an object")
    for key, value in topo.items():
        low = 0 if key == "zero_stage" else 1
        high = 3 if key == "zero_stage" else _MAX_DIM
        if not _is_int(value) or not low <= value <= high:
            raise bad(f"topology.{key}", f"is {value!r}, not an integer from {low} to {high}")
    ranks = 1
    for key in ("tp", "dp", "pp", "cp"):
        ranks *= topo.get(key, 1)
    if ranks > max(len(files), 1):
        raise bad(
            "'topology'", f"has {ranks} tp x dp x pp x cp ranks, more than the {len(files)} files listed"
        )
    return doc


def _check_entry(entry: object, where: str, bad: Callable[[str, str], ManifestError]) -> None:
    """A manifest's entry of one file (see `checksums.file_entry`), at `where` in it: `bad(key, what)` raised
    for a key of the wrong type or out of range."""
    if not isinstance(entry, dict):
        raise bad(f"{where}.", "is not an object")
    size = entry.get("bytes")
    if not (isinstance(size, int) and _is_int(size) and 0 <= size < 2**63):
        raise bad(f"{where}.bytes", f"is {size!r}, not a size")
    sums = entry.get("crc32c", {})
    if not isinstance(sums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _HEX8.fullmatch(v) for k, v in sums.items()
    ):
        raise bad(f"{where}.crc32c", "must map tensor names to 8 lowercase hex digits")
    blocks = entry.get("crc32c_blocks", {})
    if not isinstance(blocks, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in blocks.items()
    ):
        raise bad(f"{where}.crc32c_blocks", "must map tensor names to text")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _not_a_member(rel: object) -> str | None:
    """Why `rel` cannot name a file of a checkpoint's layout, or None."""
    try:
        p = trust.relative_name(rel)
    except trust.UntrustedPath:
        return "leaves the checkpoint's folder or is not a plain path"
    if len(p.parts) < 2 or p.parts[0] not in FOLDERS or p.suffix != ".safetensors":
        return f"is not a safetensors file under {', '.join(f + '/' for f in FOLDERS)}"
    return None


def member(folder: str | os.PathLike, rel: str) -> Path:
    """`folder / rel`, for a file a manifest names; ManifestError if `rel` is not a file of the layout or
    resolves (through a link) outside `folder`."""
    why = _not_a_member(rel)
    if why:
        raise ManifestError(f"{Path(folder) / MANIFEST}: entry {rel!r} {why}")
    path = Path(folder) / rel
    real, top = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, top]) != top:
        raise ManifestError(f"{path} is a link out of the checkpoint's folder (to {real})")
    return path
