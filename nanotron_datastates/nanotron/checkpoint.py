"""A checkpoint on disk: what it holds (`describe`) and whether it is whole (`verify`).

Works on every checkpoint the engine writes (`kind_of`): one safetensors file ('file'); a folder of engine
files written by plain `DataStatesEngine.save`, found recursively ('folder'); one Nanotron checkpoint folder,
ours (with the manifest `datastates.json`) or Nanotron's stock one (with `checkpoint_metadata.json`)
('checkpoint'); a checkpoints folder, holding `latest.txt` and step folders ('root'). Imports no Nanotron,
needs no GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from .. import format as fmt
from ..engine import DataStatesEngine
from ..errors import ChecksumError
from . import layout

NANOTRON_FILES = (layout.NANOTRON_METADATA, "config.yaml", "model_config.json")
KINDS = ("file", "folder", "checkpoint", "root")  # what `kind_of` recognizes; else 'missing' or 'unknown'


class NotACheckpoint(ValueError):
    """A path that does not exist, or holds nothing `describe` and `verify` read; says what was looked for."""


@dataclasses.dataclass
class Report:
    """Outcome of `verify`: `problems` make it fail; `notes` are facts worth knowing (nothing is wrong).

    `files_checked` counts the files read (whole or in part), `files_failed` those of them with a problem;
    `tensors_checksummed` the tensors whose CRC-32C was computed and compared, `tensors_failed` those of them
    that did not match; `files_without_checksums` the files whose structure alone could be checked."""

    path: Path
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    files_checked: int = 0
    files_failed: int = 0
    tensors_checksummed: int = 0
    tensors_failed: int = 0
    files_without_checksums: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "problems": self.problems,
            "notes": self.notes,
            "files_checked": self.files_checked,
            "files_failed": self.files_failed,
            "tensors_checksummed": self.tensors_checksummed,
            "tensors_failed": self.tensors_failed,
            "files_without_checksums": self.files_without_checksums,
        }


def kind_of(path: str | os.PathLike) -> str:
    """'file', 'folder' (safetensors files, none of the kinds below), 'checkpoint', 'root' (a checkpoints
    folder), 'missing' (no such path) or 'unknown' (see `explain`)."""
    path = Path(path)
    if path.is_file():
        return "file"
    if not path.is_dir():
        return "missing" if not os.path.lexists(path) else "unknown"
    if (path / layout.LATEST).is_file():
        return "root"
    if is_committed(path):
        return "checkpoint"
    steps = step_folders(path)
    if any(is_committed(f) or _nanotron_like(f) for f in steps):
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
        f"{path}: not a checkpoint: found no safetensors files (searched recursively), no {layout.MANIFEST} "
        f"or {layout.NANOTRON_METADATA} (a Nanotron checkpoint folder), no {layout.LATEST} or step folders "
        "(a checkpoints folder)"
    )


def is_committed(folder: Path) -> bool:
    """A whole checkpoint: ours once its manifest exists; Nanotron's own (synchronous) once its metadata
    file exists."""
    return layout.is_datastates_checkpoint(folder) or (folder / layout.NANOTRON_METADATA).is_file()


def _nanotron_like(folder: Path) -> bool:
    """Has a file or folder of Nanotron's checkpoint layout (committed or not)."""
    return any((folder / name).exists() for name in (*NANOTRON_FILES, *layout.FOLDERS))


def step_folders(root: Path) -> list[Path]:
    """The checkpoint folders under a checkpoints folder (named by their step), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def safetensors_files(folder: Path) -> Iterator[Path]:
    """The `*.safetensors` files under `folder`, recursively (each folder's files, then its subfolders, by
    name); hidden files and folders (temporaries among them) are skipped, and linked folders not followed."""
    for d, dirs, names in os.walk(folder):
        dirs[:] = sorted(n for n in dirs if not n.startswith("."))
        for n in sorted(names):
            p = Path(d) / n
            if n.endswith(".safetensors") and not n.startswith(".") and p.is_file():
                yield p


def latest_step(root: Path) -> int | None:
    """The step `latest.txt` names, or None without one."""
    try:
        text = (root / layout.LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{root / layout.LATEST} holds {text!r}, not a step number")
    return int(text)


def temporaries(folder: Path) -> list[Path]:
    """Files a save leaves only if its process died mid-write (`.<name>.dstmp.<pid>.<n>`, `.<name>.*.tmp`)."""
    return sorted(
        Path(d) / n
        for d, _, names in os.walk(folder)
        for n in names
        if n.startswith(".") and (".dstmp." in n or n.endswith(".tmp"))
    )


# -- describe -----------------------------------------------------------------------------------------------


def describe(path: str | os.PathLike, tensors: bool = False) -> dict[str, Any]:
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


def describe_file(path: str | os.PathLike) -> dict[str, Any]:
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


def describe_folder(folder: str | os.PathLike, tensors: bool = False) -> dict[str, Any]:
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


def describe_checkpoint(folder: str | os.PathLike, tensors: bool = False) -> dict[str, Any]:
    """One checkpoint folder: engine, step, topology, whether it is committed, and its files (with
    `tensors`, each safetensors file's tensors as "tensor_list")."""
    folder = Path(folder)
    out: dict[str, Any] = {"kind": "checkpoint", "path": str(folder), "engine": None, "step": None}
    out["topology"] = {}
    listed: dict[str, Any] = {}
    if layout.is_datastates_checkpoint(folder):
        doc = layout.read_manifest(folder)
        out.update(engine="datastates", step=doc.get("step"), topology=doc.get("topology", {}))
        listed = doc["files"]
    elif (folder / layout.NANOTRON_METADATA).is_file():
        out["engine"] = "nanotron (torch)"
    meta = layout.read_json(folder / layout.NANOTRON_METADATA)
    if meta:
        out["step"] = out["step"] if out["step"] is not None else meta.get("metas", {}).get("last_train_step")
        for key in ("tp", "dp", "cp"):  # cp: Nanotron main's
            if key in meta:
                out["topology"].setdefault(key, meta[key])
    parallelism = layout.read_yaml(folder / "config.yaml").get("parallelism") or {}
    out["topology"].setdefault("pp", parallelism.get("pp"))
    root = folder.parent
    latest = _safe_latest(root)
    out["committed"] = is_committed(folder)
    out["latest"] = latest is not None and str(latest) == folder.name
    paths = sorted(q for q in folder.rglob("*") if q.is_file() and not q.name.startswith("."))
    files = [_file_entry(folder, p, tensors) for p in paths]
    for f in files:  # the engine's weight files keep Nanotron's metadata: their checksums are the manifest's
        if "tensors" in f and isinstance(listed.get(f["file"]), dict) and "crc32c" in listed[f["file"]]:
            f["checksums_in_manifest"] = True
    out["files"] = files
    out["bytes"] = sum(f["bytes"] for f in files)
    out["tensors"] = sum(f.get("tensors", 0) for f in files)
    out["temporaries"] = [str(p.relative_to(folder)) for p in temporaries(folder)]
    return out


def describe_root(root: str | os.PathLike, tensors: bool = False) -> dict[str, Any]:
    root = Path(root)
    return {
        "kind": "root",
        "path": str(root),
        "latest": _safe_latest(root),
        "checkpoints": [describe_checkpoint(f, tensors) for f in step_folders(root)],
    }


def _writer(header: fmt.Header) -> str:
    return "datastates" if fmt.KEY_VERSION in header.metadata else "safetensors"


def _tensor_list(header: fmt.Header) -> list[dict[str, Any]]:
    return [
        {"name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "bytes": e.nbytes}
        for e in header.tensors
    ]


def _file_entry(folder: Path, p: Path, tensors: bool) -> dict[str, Any]:
    """One file of a folder: its path in the folder and size; for a safetensors file, its tensors' count,
    dtypes, writer and checksums (with `tensors`, the tensors themselves), or the error reading it."""
    entry: dict[str, Any] = {"file": str(p.relative_to(folder))}
    try:
        entry["bytes"] = p.stat().st_size
    except OSError as e:  # gone since it was listed
        entry.update(bytes=0, error=str(e))
        return entry
    if p.suffix == ".safetensors":
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


def verify(path: str | os.PathLike, engine: DataStatesEngine | None = None) -> Report:
    """Verifies a file, a folder of engine files (each of them), a checkpoint folder or a checkpoints folder
    (every committed checkpoint in it, and that `latest.txt` names one of them)."""
    path = Path(path)
    report = Report(path)
    kind = kind_of(path)
    if kind not in KINDS:
        report.problems.append(explain(path))
        return report
    own = engine is None
    engine = engine or DataStatesEngine(host_cache_size=1 / 64, pin_host_cache=False)
    try:
        if kind == "file":
            _verify_file(engine, path, None, report)
        elif kind == "folder":
            _verify_folder(engine, path, report)
        elif kind == "checkpoint":
            _verify_checkpoint(engine, path, report)
        else:
            _verify_root(engine, path, report)
        return report
    finally:
        if own:
            engine.close()


def _verify_root(engine: DataStatesEngine, root: Path, report: Report) -> None:
    try:
        latest = latest_step(root)
    except ValueError as e:
        report.problems.append(str(e))
        latest = None
    folders = step_folders(root)
    if latest is None:
        report.notes.append(f"{root}: no {layout.LATEST}")
    elif not is_committed(root / str(latest)):
        report.problems.append(f"{root / layout.LATEST} names step {latest}, which is not a checkpoint")
    for folder in folders:
        if is_committed(folder):
            _verify_checkpoint(engine, folder, report)
        else:
            report.notes.append(f"{folder}: not committed (a save in progress or cut short); not used")
    if not folders:
        report.problems.append(f"{root}: no checkpoint folders")


def _verify_folder(engine: DataStatesEngine, folder: Path, report: Report) -> None:
    present = [name for name in NANOTRON_FILES[1:] if (folder / name).is_file()]
    if present:
        report.notes.append(
            f"{folder}: holds {' and '.join(present)} but neither {layout.MANIFEST} nor "
            f"{layout.NANOTRON_METADATA}: a Nanotron checkpoint not committed (a save in progress or cut "
            "short); its safetensors files checked one by one"
        )
    for p in sorted(safetensors_files(folder)):
        _verify_file(engine, p, None, report)
    for p in temporaries(folder):
        report.notes.append(f"{p}: temporary left by a process that died mid-save")


def _verify_checkpoint(engine: DataStatesEngine, folder: Path, report: Report) -> None:
    for name in NANOTRON_FILES:
        if not (folder / name).is_file():
            report.problems.append(f"{folder / name}: missing")
    if not layout.is_datastates_checkpoint(folder):
        report.notes.append(f"{folder}: Nanotron's own layout; safetensors headers checked, pickles not")
        for p in sorted(folder.rglob("*.safetensors")):
            _verify_file(engine, p, None, report)
        return
    try:
        doc = layout.read_manifest(folder)
    except (OSError, ValueError) as e:
        report.problems.append(f"{folder / layout.MANIFEST}: {e}")
        return
    if folder.name.isdigit() and doc.get("step") != int(folder.name):
        report.problems.append(f"{folder / layout.MANIFEST}: step {doc.get('step')} in folder {folder.name}")
    for rel, entry in doc["files"].items():
        try:
            path = layout.member(folder, rel)
        except layout.ManifestError as e:
            report.problems.append(str(e))
            continue
        if not path.is_file():
            report.problems.append(f"{path}: listed in the manifest, missing")
            continue
        if path.stat().st_size != entry.get("bytes"):
            size = path.stat().st_size
            report.files_checked += 1
            report.files_failed += 1
            report.problems.append(f"{path}: {size} bytes, the manifest says {entry.get('bytes')}")
            continue
        _verify_file(engine, path, layout.file_checksums(doc, folder, path), report)
    _verify_random_states(folder, doc, report)
    listed = {folder / rel for rel in doc["files"]}
    for p in sorted(folder.rglob("*.safetensors")):
        if p not in listed and not p.name.startswith("."):
            report.notes.append(f"{p}: not in the manifest (ignored on resume)")
    for p in temporaries(folder):
        report.notes.append(f"{p}: temporary left by a process that died mid-save")


def _verify_random_states(folder: Path, doc: dict[str, Any], report: Report) -> None:
    """Every rank writes its random states: one file per tp × dp × pp × cp rank of the saved layout."""
    topo = doc.get("topology", {})
    dims = ("tp", "dp", "pp", "cp")
    sizes = [topo.get(k, layout.TOPOLOGY_DEFAULTS.get(k)) for k in dims]
    if not all(isinstance(s, int) and s > 0 for s in sizes):
        return
    for ranks in itertools.product(*(range(s) for s in sizes)):
        rel = f"random/{layout.random_states_name(*zip(ranks, sizes))}"
        if rel not in doc["files"]:
            where = " ".join(f"{k}={r}" for k, r in zip(dims, ranks) if k != "cp" or sizes[3] > 1)
            report.problems.append(f"{folder / rel}: no file from rank {where}")


def _verify_file(
    engine: DataStatesEngine, path: Path, checksums: Mapping[str, int] | None, report: Report
) -> None:
    """The file's header, size and every tensor's CRC-32C (`checksums`, else those stored in the file).
    Where one fails, each tensor is checked on its own, so that every tensor that fails is named."""
    report.files_checked += 1
    try:
        header = fmt.read_header(path)
        if engine.verify(path, checksums):
            report.tensors_checksummed += len(header.tensors)
        else:
            report.files_without_checksums += 1
            report.notes.append(f"{path}: no checksums (structure checked)")
        return
    except ChecksumError as e:
        first: Exception = e
    except (OSError, ValueError) as e:
        report.files_failed += 1
        report.problems.append(str(e))
        return
    report.files_failed += 1
    expected = dict(checksums) if checksums is not None else header.checksums()
    if expected is None or set(expected) != {e.name for e in header.tensors}:
        report.problems.append(str(first))  # the checksums do not name the file's tensors: none compared
        return
    failed_before = report.tensors_failed
    for entry in header.tensors:
        try:
            engine.load_tensors(path, [entry.name], checksums=checksums)
        except ChecksumError as e:
            report.tensors_failed += 1
            report.problems.append(str(e))
        except (OSError, ValueError) as e:  # the file changed or became unreadable since
            report.problems.append(str(e))
            return
        report.tensors_checksummed += 1
    if report.tensors_failed == failed_before:  # each passed on its own: the first read was damaged
        report.tensors_failed += 1
        report.problems.append(f"{first} (read again tensor by tensor, each matched its checksum)")


def _safe_latest(root: Path) -> int | None:
    try:
        return latest_step(root)
    except (OSError, ValueError):
        return None
