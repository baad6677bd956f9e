"""A Nanotron checkpoint on disk: what it holds (`describe`) and whether it is whole (`verify`).

Works on a checkpoints folder (the one holding `latest.txt`), one checkpoint folder, or one safetensors file;
datastates checkpoints (with a manifest) and Nanotron's stock ones. Imports no Nanotron, needs no GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Any

from .. import format as fmt
from ..engine import DataStatesEngine
from . import layout

NANOTRON_FILES = (layout.NANOTRON_METADATA, "config.yaml", "model_config.json")


@dataclasses.dataclass
class Report:
    """Outcome of `verify`: `problems` make it fail; `notes` are facts worth knowing (nothing is wrong)."""

    path: Path
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    files_checked: int = 0
    tensors_checksummed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def kind_of(path: str | os.PathLike) -> str:
    """'file', 'root' (a checkpoints folder), 'checkpoint', or 'unknown'."""
    path = Path(path)
    if path.is_file():
        return "file"
    if not path.is_dir():
        return "unknown"
    if (path / layout.LATEST).is_file() or (any(step_folders(path)) and not is_committed(path)):
        return "root"
    return "checkpoint" if is_committed(path) else "unknown"


def is_committed(folder: Path) -> bool:
    """A whole checkpoint: ours once its manifest exists; Nanotron's own (synchronous) once its metadata
    file exists."""
    return layout.is_datastates_checkpoint(folder) or (folder / layout.NANOTRON_METADATA).is_file()


def step_folders(root: Path) -> list[Path]:
    """The checkpoint folders under a checkpoints folder (named by their step), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


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


def describe_file(path: str | os.PathLike) -> dict[str, Any]:
    """A safetensors file's tensors (name, dtype, shape, bytes), metadata, writer and checksums."""
    header = fmt.read_header(path)
    return {
        "path": str(path),
        "bytes": header.file_size,
        "engine": "datastates" if fmt.KEY_VERSION in header.metadata else "safetensors",
        "checksums": header.checksums() is not None,
        "metadata": header.user_metadata(),
        "tensors": [
            {"name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "bytes": e.nbytes}
            for e in header.tensors
        ],
    }


def describe_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """One checkpoint folder: engine, step, topology, whether it is committed, and its files."""
    folder = Path(folder)
    out: dict[str, Any] = {"path": str(folder), "engine": None, "step": None, "topology": {}}
    if layout.is_datastates_checkpoint(folder):
        doc = layout.read_manifest(folder)
        out.update(engine="datastates", step=doc.get("step"), topology=doc.get("topology", {}))
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
    files = []
    for p in sorted(q for q in folder.rglob("*") if q.is_file() and not q.name.startswith(".")):
        entry: dict[str, Any] = {"file": str(p.relative_to(folder)), "bytes": p.stat().st_size}
        if p.suffix == ".safetensors":
            try:
                header = fmt.read_header(p)
                entry["tensors"] = len(header.tensors)
                entry["dtypes"] = sorted({e.dtype.name for e in header.tensors})
            except (OSError, ValueError) as e:
                entry["error"] = str(e)
        files.append(entry)
    out["files"] = files
    out["bytes"] = sum(f["bytes"] for f in files)
    out["tensors"] = sum(f.get("tensors", 0) for f in files)
    out["temporaries"] = [str(p.relative_to(folder)) for p in temporaries(folder)]
    return out


def describe_root(root: str | os.PathLike) -> dict[str, Any]:
    root = Path(root)
    return {
        "path": str(root),
        "latest": _safe_latest(root),
        "checkpoints": [describe_checkpoint(f) for f in step_folders(root)],
    }


# -- verify -------------------------------------------------------------------------------------------------


def verify(path: str | os.PathLike, engine: DataStatesEngine | None = None) -> Report:
    """Verifies a file, a checkpoint folder or a checkpoints folder (every committed checkpoint in it, and
    that `latest.txt` names one of them)."""
    path = Path(path)
    own = engine is None
    engine = engine or DataStatesEngine(host_cache_size=1 / 64, pin_host_cache=False)
    try:
        report = Report(path)
        kind = kind_of(path)
        if kind == "file":
            _verify_file(engine, path, None, report)
        elif kind == "checkpoint":
            _verify_checkpoint(engine, path, report)
        elif kind == "root":
            _verify_root(engine, path, report)
        else:
            report.problems.append(f"{path}: neither a safetensors file nor a checkpoint folder")
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
    engine: DataStatesEngine, path: Path, checksums: dict[str, int] | None, report: Report
) -> None:
    report.files_checked += 1
    try:
        if engine.verify(path, checksums):
            report.tensors_checksummed += len(fmt.read_header(path).tensors)
        else:
            report.notes.append(f"{path}: no checksums (structure checked)")
    except (OSError, ValueError) as e:
        report.problems.append(str(e))


def _safe_latest(root: Path) -> int | None:
    try:
        return latest_step(root)
    except (OSError, ValueError):
        return None
