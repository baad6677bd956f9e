"""A checkpoint on disk: what kind it is (`kind_of`), its step folders, and what it holds (`describe`);
whether it is whole is verify.py's.

Works on every checkpoint the engine writes (`kind_of`): one safetensors file ('file'); a folder of engine
files written by plain `DataStatesEngine.save`, found recursively ('folder'); one Nanotron checkpoint folder,
ours (with the manifest `datastates.json`) or Nanotron's stock one (with `checkpoint_metadata.json`)
('checkpoint'); a checkpoints folder, holding `latest.txt` and step folders ('root'). Imports no Nanotron,
needs no GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from .. import format as fmt
from .. import trust
from ..errors import DataStatesError
from .described import CheckpointInfo, Described, FileInfo, FolderInfo, ListedFile, RootInfo, TensorInfo
from .file_io import read_json, read_yaml, section
from .manifest import Entries, entries, is_datastates_checkpoint, read_manifest
from .names import FOLDERS, LATEST, MANIFEST, NANOTRON_METADATA

NANOTRON_FILES = (NANOTRON_METADATA, "config.yaml", "model_config.json")
KINDS = ("file", "folder", "checkpoint", "root")  # what `kind_of` recognizes; else 'missing' or 'unknown'


class NotACheckpoint(DataStatesError, ValueError):
    """A path that does not exist, or holds nothing `describe` and `verify` read; says what was looked for."""


def kind_of(path: str | os.PathLike) -> str:
    """'file', 'folder' (safetensors files, none of the kinds below), 'checkpoint', 'root' (a checkpoints
    folder), 'missing' (no such path) or 'unknown' (see `explain`)."""
    path = Path(path)
    if path.is_file():
        return "file"
    if not path.is_dir():
        return "missing" if not os.path.lexists(path) else "unknown"
    if (path / LATEST).is_file():
        return "root"
    if marked(path):
        return "checkpoint"
    steps = step_folders(path)
    if any(marked(f) or _nanotron_like(f) for f in steps):
        # A Nanotron checkpoint among them, maybe not committed yet (the first save in progress).
        return "root"
    if next(safetensors_files(path), None) is not None:
        return "folder"
    return "root" if steps else "unknown"  # empty step folders: saves just begun


def explain(path: str | os.PathLike) -> str:
    """Why `kind_of(path)` is 'missing' or 'unknown', naming the path and what was looked for."""
    path = Path(path)
    if not os.path.lexists(path):
        return f"no such file or folder: {path}"
    if not path.is_dir() and not path.is_file():
        what = "a link to nothing" if path.is_symlink() else "neither a file nor a folder"
        return f"{path}: {what}"
    return (
        f"{path}: not a checkpoint: found no safetensors files (searched recursively), no {MANIFEST} "
        f"or {NANOTRON_METADATA} (a Nanotron checkpoint folder), no {LATEST} or step folders "
        "(a checkpoints folder)"
    )


def is_committed(folder: Path) -> bool:
    """A whole checkpoint: ours once its manifest exists; Nanotron's own (synchronous) once its metadata
    file exists."""
    return is_datastates_checkpoint(folder) or (folder / NANOTRON_METADATA).is_file()


def marked(folder: Path) -> bool:
    """Committed, or holding something by a commit marker's name that is not a regular file (a FIFO, a
    folder): a checkpoint to describe and verify, whose reading of it then fails naming it. Rotation and
    fallbacks keep to `is_committed`."""
    return any(os.path.lexists(folder / m) for m in (MANIFEST, NANOTRON_METADATA))


def _nanotron_like(folder: Path) -> bool:
    """Has a file or folder of Nanotron's checkpoint layout (committed or not)."""
    return any((folder / name).exists() for name in (*NANOTRON_FILES, *FOLDERS))


def step_folders(root: Path) -> list[Path]:
    """The checkpoint folders under a checkpoints folder, oldest first: real folders (a link is never taken
    for one) named by a canonical step number (`trust.step_number`)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = [(trust.step_number(n), root / n) for n in names]
    return [p for s, p in sorted((s, p) for s, p in steps if s is not None) if trust.is_real_dir(p)]


def step_of(folder: Path) -> int:
    """The step a folder of `step_folders` is named by."""
    step = trust.step_number(folder.name)
    if step is None:
        raise ValueError(f"{folder}: not named by a step number")
    return step


def safetensors_files(folder: Path) -> Iterator[Path]:
    """The `*.safetensors` files under `folder`, recursively (each folder's files, then its subfolders, by
    name), whatever they are but folders; hidden files and folders (temporaries among them) are skipped, and
    linked folders not followed."""
    for d, dirs, names in os.walk(folder):
        dirs[:] = sorted(n for n in dirs if not n.startswith("."))
        for n in sorted(names):
            p = Path(d) / n
            if n.endswith(".safetensors") and not n.startswith("."):  # a FIFO too: reading it says what it is
                yield p


def latest_step(root: Path) -> int | None:
    """The step `latest.txt` names, or None without one; ValueError, naming it, where it is not a regular
    file (a link is not followed, nor its target quoted) or holds anything but a step number (canonical
    ASCII decimal, a trailing newline allowed)."""
    path = root / LATEST
    try:
        raw = trust.read_regular(path, 64)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path} cannot be read as a step number: {e.strerror or e}") from None
    text = raw.decode("ascii", errors="replace")
    step = trust.step_number(text.removesuffix("\n"))
    if step is None:
        raise ValueError(f"{path} holds {text[:32]!r}, not a step number")
    return step


def is_temporary(name: str) -> bool:
    """A file name a save leaves only if its process died mid-write (`.<name>.dstmp.<pid>.<n>`,
    `.<name>.*.tmp`)."""
    return name.startswith(".") and (".dstmp." in name or name.endswith(".tmp"))


def temporaries(folder: Path) -> list[Path]:
    """The temporaries (`is_temporary`) below `folder`."""
    return sorted(Path(d) / n for d, _, names in os.walk(folder) for n in names if is_temporary(n))


# -- describe -----------------------------------------------------------------------------------------------


def describe(path: str | os.PathLike, tensors: bool = False) -> Described:
    """What `path` holds, whatever its kind (the dict's "kind"); with `tensors`, every file's tensors too
    (a file's are always listed). NotACheckpoint says why a path is none of them."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "file":
        return describe_file(path)
    if kind == "folder":
        return describe_folder(path, tensors)
    if kind == "checkpoint":
        return describe_checkpoint(path, tensors)
    if kind == "root":
        return describe_root(path, tensors)
    raise NotACheckpoint(explain(path))


def describe_file(path: str | os.PathLike) -> FileInfo:
    """A safetensors file's tensors (name, dtype, shape, bytes), metadata, writer and checksums."""
    header = fmt.read_header(path)
    return {
        "kind": "file",
        "path": str(path),
        "bytes": header.file_size,
        "engine": _writer(header),
        "checksums": header.checksums() is not None,
        "metadata": header.user_metadata(),
        "tensors": _tensor_list(header),
    }


def describe_folder(folder: str | os.PathLike, tensors: bool = False) -> FolderInfo:
    """A folder of engine files (no manifest): its safetensors files, found recursively."""
    folder = Path(folder)
    files = [_file_entry(folder, p, tensors) for p in sorted(safetensors_files(folder))]
    return {
        "kind": "folder",
        "path": str(folder),
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "tensors": sum(f.get("tensors", 0) for f in files),
        "temporaries": [str(p.relative_to(folder)) for p in temporaries(folder)],
    }


def describe_checkpoint(folder: str | os.PathLike, tensors: bool = False) -> CheckpointInfo:
    """One checkpoint folder: engine, step, topology, whether it is committed, and its files (with
    `tensors`, each safetensors file's tensors as "tensor_list")."""
    folder = Path(folder)
    engine: str | None = None
    step: object = None
    topology: dict[str, object] = {}
    listed: Entries = {}
    if os.path.lexists(folder / MANIFEST):  # read_manifest names one that is not a regular file
        doc = read_manifest(folder)
        engine, step, topology, listed = "datastates", doc.get("step"), doc.get("topology", {}), entries(doc)
    elif (folder / NANOTRON_METADATA).is_file():
        engine = "nanotron (torch)"
    meta = read_json(folder / NANOTRON_METADATA)
    if meta:
        step = step if step is not None else section(meta, "metas").get("last_train_step")
        for key in ("tp", "dp", "cp"):  # cp: Nanotron main's
            if key in meta:
                topology.setdefault(key, meta[key])
    parallelism = section(read_yaml(folder / "config.yaml"), "parallelism")
    topology.setdefault("pp", parallelism.get("pp"))
    root = folder.parent
    latest = _safe_latest(root)
    committed = is_committed(folder)
    paths = sorted(q for q in folder.rglob("*") if not q.is_dir() and not q.name.startswith("."))
    files = [_file_entry(folder, p, tensors) for p in paths]
    for f in files:  # the engine's weight files keep Nanotron's metadata: their checksums are the manifest's
        if "tensors" in f and isinstance(listed.get(f["file"]), dict) and "crc32c" in listed[f["file"]]:
            f["checksums_in_manifest"] = True
    return {
        "kind": "checkpoint",
        "path": str(folder),
        "engine": engine,
        "step": step,
        "topology": topology,
        "committed": committed,
        "latest": latest is not None and str(latest) == folder.name,
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "tensors": sum(f.get("tensors", 0) for f in files),
        "temporaries": [str(p.relative_to(folder)) for p in temporaries(folder)],
    }


def describe_root(root: str | os.PathLike, tensors: bool = False) -> RootInfo:
    root = Path(root)
    return {
        "kind": "root",
        "path": str(root),
        "latest": _safe_latest(root),
        "checkpoints": [describe_checkpoint(f, tensors) for f in step_folders(root)],
    }


def _writer(header: fmt.Header) -> str:
    return "datastates" if fmt.KEY_VERSION in header.metadata else "safetensors"


def _tensor_list(header: fmt.Header) -> list[TensorInfo]:
    return [
        {"name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "bytes": e.nbytes}
        for e in header.tensors
    ]


def _file_entry(folder: Path, p: Path, tensors: bool) -> ListedFile:
    """One file of a folder: its path in the folder and size; for a safetensors file, its tensors' count,
    dtypes, writer and checksums (with `tensors`, the tensors themselves), or the error reading it."""
    name = str(p.relative_to(folder))
    try:
        size = p.stat().st_size
    except OSError as e:  # gone since it was listed
        return {"file": name, "bytes": 0, "error": str(e)}
    entry: ListedFile = {"file": name, "bytes": size}
    if not p.is_file():  # a FIFO, a socket: never opened here
        entry["error"] = f"{p}: not a regular file"
    elif p.suffix == ".safetensors":
        try:
            header = fmt.read_header(p)
        except (OSError, ValueError) as e:
            entry["error"] = str(e)
            return entry
        entry["tensors"] = len(header.tensors)
        entry["dtypes"] = sorted({e.dtype.name for e in header.tensors})
        entry["engine"] = _writer(header)
        entry["checksums"] = header.checksums() is not None
        if tensors:
            entry["tensor_list"] = _tensor_list(header)
    return entry


# -- verify -------------------------------------------------------------------------------------------------


def _safe_latest(root: Path) -> int | None:
    try:
        return latest_step(root)
    except (OSError, ValueError):
        return None
