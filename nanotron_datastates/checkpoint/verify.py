"""Whether a checkpoint is whole (`verify`): every file's header and size, every tensor's CRC-32C (from the
manifest, or stored in the file), every rank's random-state file, Nanotron's metadata files, and that
`latest.txt` names a committed checkpoint. Works on every kind `folder.kind_of` recognizes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Mapping

from .. import format as fmt
from .. import trust
from ..engine import DataStatesEngine
from ..errors import ChecksumError
from .checksums import file_block_checksums, file_checksums
from .folder import (
    KINDS,
    NANOTRON_FILES,
    explain,
    is_committed,
    kind_of,
    latest_step,
    marked,
    safetensors_files,
    step_folders,
    temporaries,
)
from .manifest import ManifestError, entries, member, read_manifest
from .names import LATEST, MANIFEST, NANOTRON_METADATA, random_states_name
from .topology import TOPOLOGY_DEFAULTS, saved_topology


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

    def as_dict(self) -> dict[str, object]:
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
        report.notes.append(f"{root}: no {LATEST}")
    elif not is_committed(root / str(latest)):
        report.problems.append(f"{root / LATEST} names step {latest}, which is not a checkpoint")
    for folder in folders:
        if marked(folder):
            try:  # one checkpoint's problem, whatever it is, never stops the others' verification
                _verify_checkpoint(engine, folder, report)
            except Exception as e:  # noqa: BLE001 - reported as this checkpoint's problem
                report.problems.append(f"{folder}: cannot be verified: {e!r}")
        else:
            report.notes.append(f"{folder}: not committed (a save in progress or cut short); not used")
    if not folders:
        report.problems.append(f"{root}: no checkpoint folders")


def _verify_folder(engine: DataStatesEngine, folder: Path, report: Report) -> None:
    present = [name for name in NANOTRON_FILES[1:] if (folder / name).is_file()]
    if present:
        report.notes.append(
            f"{folder}: holds {' and '.join(present)} but neither {MANIFEST} nor "
            f"{NANOTRON_METADATA}: a Nanotron checkpoint not committed (a save in progress or cut "
            "short); its safetensors files checked one by one"
        )
    for p in sorted(safetensors_files(folder)):
        _verify_file(engine, p, None, report)
    for p in temporaries(folder):
        report.notes.append(f"{p}: temporary left by a process that died mid-save")


def _verify_checkpoint(engine: DataStatesEngine, folder: Path, report: Report) -> None:
    for name in NANOTRON_FILES:
        if not (folder / name).is_file():
            report.problems.append(f"{folder / name}: {_not_a_file(folder / name)}")
    if not os.path.lexists(folder / MANIFEST):  # read_manifest names one that is not a regular file
        report.notes.append(f"{folder}: Nanotron's own layout; safetensors headers checked, pickles not")
        for p in sorted(folder.rglob("*.safetensors")):
            _verify_file(engine, p, None, report)
        return
    try:
        doc = read_manifest(folder)
    except (OSError, ValueError) as e:
        report.problems.append(f"{folder / MANIFEST}: {e}")
        return
    named = trust.step_number(folder.name)
    if named is not None and doc["step"] != named:
        report.problems.append(f"{folder / MANIFEST}: step {doc.get('step')} in folder {folder.name}")
    for rel, entry in doc["files"].items():
        try:
            path = member(folder, rel)
        except ManifestError as e:
            report.problems.append(str(e))
            continue
        if not path.is_file():
            report.problems.append(f"{path}: listed in the manifest, {_not_a_file(path)}")
            continue
        if path.stat().st_size != entry.get("bytes"):
            size = path.stat().st_size
            report.files_checked += 1
            report.files_failed += 1
            report.problems.append(f"{path}: {size} bytes, the manifest says {entry.get('bytes')}")
            continue
        try:
            blocks = file_block_checksums(doc, folder, path)
        except ManifestError as e:
            report.problems.append(str(e))
            continue
        _verify_file(engine, path, file_checksums(doc, folder, path), report, blocks)
    _verify_random_states(folder, doc, report)
    listed = {folder / rel for rel in doc["files"]}
    for p in sorted(folder.rglob("*.safetensors")):
        if p not in listed and not p.name.startswith("."):
            report.notes.append(f"{p}: not in the manifest (ignored on resume)")
    for p in temporaries(folder):
        report.notes.append(f"{p}: temporary left by a process that died mid-save")


def _not_a_file(path: Path) -> str:
    return "not a regular file" if os.path.exists(path) else "missing"


def _verify_random_states(folder: Path, doc: Mapping[str, object], report: Report) -> None:
    """Every rank writes its random states: one file per tp × dp × pp × cp rank of the saved layout."""
    topo, listed = saved_topology(doc), entries(doc)
    dims = ("tp", "dp", "pp", "cp")
    sizes = [s for s in (topo.get(k, TOPOLOGY_DEFAULTS.get(k)) for k in dims) if isinstance(s, int) and s > 0]
    if len(sizes) < len(dims):
        return
    for ranks in itertools.product(*(range(s) for s in sizes)):
        rel = f"random/{random_states_name(*zip(ranks, sizes))}"
        if rel not in listed:
            where = " ".join(f"{k}={r}" for k, r in zip(dims, ranks) if k != "cp" or sizes[3] > 1)
            report.problems.append(f"{folder / rel}: no file from rank {where}")


def _verify_file(
    engine: DataStatesEngine,
    path: Path,
    checksums: Mapping[str, int] | None,
    report: Report,
    blocks: tuple[int, dict[str, list[int]]] | None = None,
) -> None:
    """The file's header, size and every tensor's CRC-32C (`checksums`, else those stored in the file), and
    that its block checksums (`blocks`, else the file's) combine to them. Where one fails, each tensor is
    checked on its own, so that every tensor that fails is named."""
    report.files_checked += 1
    try:
        header = fmt.read_header(path)
        if engine.verify(path, checksums, blocks):
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
