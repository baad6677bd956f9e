"""A datastates checkpoint written as the folder Nanotron's own `save()` writes: weights copied and checked,
the optimizer, LR scheduler and random states loaded (checked against the manifest) and pickled (`.pt`),
config.yaml without our keys; Nanotron's metadata file last, as its own save marks a whole checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from ... import state_parts
from ...checkpoint.checksums import file_checksums
from ...checkpoint.file_io import fsync_path
from ...checkpoint.folder_copy import (
    CONFIG,
    MODEL,
    RANDOM,
    copy_file,
    read_bytes,
    regular_files,
    sync_folders,
)
from ...checkpoint.manifest import member, read_manifest
from ...checkpoint.names import MANIFEST, NANOTRON_METADATA, stock_random_states
from ...checkpoint.reads import optimizer_files
from ...engine import DataStatesEngine
from ...errors import FormatError
from ...store import open_store
from .. import rng_states as states
from .stock_pickles import nanotron_random

METADATA = NANOTRON_METADATA


def to_torch(src: Path, out: Path, engine: DataStatesEngine, allow_pickle: bool) -> None:
    """Writes the datastates checkpoint `src` into the empty folder `out` in Nanotron's stock layout."""
    doc = read_manifest(src)
    # An optimizer file the replicas wrote in parts becomes Nanotron's one file, once its parts are read.
    wholes = {name: ps for name, ps in optimizer_files(doc["files"]).items() if ps != [name]}
    whole_of = {p: name for name, ps in wholes.items() for p in ps}
    parts_read: dict[str, dict[str, object]] = {}
    for rel, entry in doc["files"].items():
        path = member(src, rel)
        size = path.stat().st_size  # FileNotFoundError names a file the manifest lists but the folder lacks
        if size != entry.get("bytes"):
            raise FormatError(f"{path}: {size} bytes, the manifest says {entry.get('bytes')}")
        sums = file_checksums(doc, src, path)
        parts = Path(rel).parts
        if parts[0] == MODEL:
            # Same file in both layouts. The copy is what gets checked: a bad source and a bad copy both fail.
            copy_file(src, rel, out / rel)
            engine.verify(out / rel, sums)
        elif parts[0] == RANDOM:
            stock = stock_random_states(parts[-1])
            if stock is None:
                raise FormatError(f"{path}: not a random-state file name of Nanotron's layout")
            name, kept = stock
            if not kept:  # Nanotron main keeps one file for all context-parallel ranks: rank 0's
                engine.verify(path, sums)
                continue
            saved = engine.load(path, checksums=sums, allow_pickle=allow_pickle)
            if not isinstance(saved, dict) or "nanotron" not in saved:
                raise FormatError(f"{path}: not the random states of a datastates checkpoint")
            # Stock Nanotron keeps Nanotron's generators only; the process-wide ones ("global") have no place.
            random_states = nanotron_random().RandomStates(
                {k: states.random_state_from_plain(v) for k, v in saved["nanotron"].items()}
            )
            _torch_save(random_states, out / RANDOM / name)
        elif rel in whole_of:
            name = whole_of[rel]
            read = parts_read.setdefault(name, {})
            read[rel] = engine.load(path, checksums=sums, allow_pickle=allow_pickle)
            if len(read) == len(wholes[name]):
                state = state_parts.merge([read.pop(p) for p in wholes[name]])
                _torch_save(state, out / _as_pt(name))
        else:
            _torch_save(engine.load(path, checksums=sums, allow_pickle=allow_pickle), out / _as_pt(rel))
    _copy_rest(src, out, listed=set(doc["files"]))
    sync_folders(out)
    # Nanotron's own save is synchronous: its metadata file is what marks a whole stock checkpoint.
    open_store(out).write_atomic(METADATA, read_bytes(src / METADATA))


def _as_pt(rel: str) -> str:
    return rel[: -len(".safetensors")] + ".pt" if rel.endswith(".safetensors") else rel + ".pt"


def _stock_config(text: str) -> str:
    """config.yaml without our keys, which stock Nanotron's strict parser rejects (unparsable: as is)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(doc, dict):
        return text
    dropped = [doc.pop(k) for k in ("datastates", "checkpointing_engine") if k in doc]
    checkpoints = doc.get("checkpoints")
    if isinstance(checkpoints, dict) and "checkpointing_engine" in checkpoints:
        dropped.append(checkpoints.pop("checkpointing_engine"))
    return yaml.dump(doc) if dropped else text  # untouched configs keep their formatting


def _torch_save(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _copy_rest(src: Path, out: Path, listed: set[str]) -> None:
    """Nanotron's json/yaml files and anything else not converted; never the manifest or the metadata file
    (written last), nor safetensors the manifest does not list (resume ignores them: leftovers)."""
    for rel in regular_files(src):
        if rel in listed or rel in (MANIFEST, METADATA) or rel.endswith(".safetensors"):
            continue
        if rel == CONFIG:
            (out / rel).write_text(_stock_config(read_bytes(src / rel).decode()))
            fsync_path(out / rel)
        else:
            copy_file(src, rel, out / rel)
