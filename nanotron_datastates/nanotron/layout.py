"""Where each piece of a Nanotron checkpoint goes, and the manifest that marks a datastates checkpoint.

The folder is Nanotron's: `model/` holds its own file names, tensor key ("data") and tensor metadata, so that
Nanotron's `load_weights` and its scripts read it unchanged. Optimizer, LR scheduler and random states, which
Nanotron writes with pickle (`.pt`), are written by the engine as safetensors under the same names with
`.safetensors`. `checkpoint_metadata.json`, `config.yaml` and `model_config.json` are Nanotron's.

`datastates.json`, written by rank 0 once every rank's files are persisted and before `latest.txt` names the
checkpoint, lists each file with its size and per-tensor CRC-32C. A checkpoint folder without it is either
Nanotron's own or incomplete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

MANIFEST = "datastates.json"
MANIFEST_FORMAT = "nanotron-datastates"
MANIFEST_VERSION = 1
LATEST = "latest.txt"
NANOTRON_METADATA = "checkpoint_metadata.json"  # Nanotron's CHECKPOINT_FILE_NAME, without importing Nanotron


def is_datastates_checkpoint(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def as_safetensors(pt_name: str) -> str:
    """Nanotron's pickle file name for optimizer and scheduler shards, as our safetensors file name."""
    return pt_name[: -len(".pt")] + ".safetensors" if pt_name.endswith(".pt") else pt_name + ".safetensors"


def random_states_name(
    tp: tuple[int, int], dp: tuple[int, int], pp: tuple[int, int], cp: tuple[int, int] = (0, 1)
) -> str:
    """Nanotron's `random/` file name (rank, size per dimension), as safetensors. With context parallelism,
    `_cp-<rank>-of-<size>` follows: Nanotron main names the file without it, so that its context-parallel
    ranks all write one file and all read it back; each of ours keeps its own generators."""
    name = f"tp-{tp[0]}-of-{tp[1]}_dp-{dp[0]}-of-{dp[1]}_pp-{pp[0]}-of-{pp[1]}"
    if cp[1] > 1:
        name += f"_cp-{cp[0]}-of-{cp[1]}"
    return name + ".safetensors"


_RANDOM_NAME = re.compile(r"tp-(\d+)-of-(\d+)_dp-(\d+)-of-(\d+)_pp-(\d+)-of-(\d+)(?:_cp-(\d+)-of-(\d+))?")


def stock_random_states(name: str) -> tuple[str, bool] | None:
    """For one of our `random/` file names: Nanotron's name for it (`.pt`, without the context-parallel part)
    and whether this file is the one Nanotron keeps there (context-parallel rank 0's); None for another
    name."""
    m = _RANDOM_NAME.fullmatch(name.removesuffix(".safetensors"))
    if m is None:
        return None
    return m.group(0).split("_cp-")[0] + ".pt", m.group(7) in (None, "0")


TOPOLOGY_KEYS = ("tp", "pp", "dp", "cp", "expert", "zero_stage")
# What a manifest without the key was written with (cp: before Nanotron had context parallelism).
TOPOLOGY_DEFAULTS = {"cp": 1}


def topology(*, tp: int, pp: int, dp: int, cp: int, expert: int, zero_stage: int) -> dict[str, int]:
    """The parallel layout a checkpoint was written with, as its manifest records it."""
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "expert": expert, "zero_stage": zero_stage}


def topology_changes(saved: dict[str, Any], here: dict[str, int]) -> dict[str, tuple[Any, int]]:
    """{key: (saved, here)} for every dimension that differs; a key the manifest lacks has its default."""
    return {
        k: (saved.get(k, TOPOLOGY_DEFAULTS.get(k)), v)
        for k, v in here.items()
        if saved.get(k, TOPOLOGY_DEFAULTS.get(k)) != v
    }


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
    whatever state they are in)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Like `read_json`, for YAML (Nanotron's config.yaml)."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def manifest(step: int, topology: dict[str, int], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "topology": topology,
        "files": dict(sorted(files.items())),
    }


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), dict):
        raise ValueError(f"{path} is not a nanotron-datastates manifest")
    if doc.get("version", 0) > MANIFEST_VERSION:
        raise ValueError(f"{path} was written by a newer nanotron-datastates (version {doc['version']})")
    return doc


def weight_files(doc: dict[str, Any], folder: Path) -> list[Path]:
    """Every weight file a manifest names, under `folder`, in name order: what a rank of a layout without
    tensor, pipeline or expert parallelism reads."""
    return [folder / f for f in sorted(doc["files"]) if f.startswith("model/")]


def file_checksums(
    doc: dict[str, Any], folder: str | os.PathLike, path: str | os.PathLike
) -> dict[str, int] | None:
    """The checksums the manifest holds for `path` (a file of the checkpoint in `folder`), if any."""
    entry = doc["files"].get(os.path.relpath(path, folder))
    if not entry or "crc32c" not in entry:
        return None
    return {name: int(v, 16) for name, v in entry["crc32c"].items()}
