"""A checkpoint of Nanotron's stock layout written as ours: the weight files rewritten by the engine (to get
their checksums), the optimizer and LR scheduler pickles as engine-written safetensors, the random states as
plain values (one file per context-parallel rank); the metadata, then the manifest, written last, as the
trainer commits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ... import trust
from ...checkpoint.checksums import file_entry
from ...checkpoint.file_io import load_yaml, read_json, section
from ...checkpoint.folder_copy import (
    CONFIG,
    MODEL,
    PICKLED,
    RANDOM,
    copy_file,
    read_bytes,
    regular_files,
    sync_folders,
)
from ...checkpoint.manifest import MAX_FILES, manifest_text
from ...checkpoint.manifest import manifest as make_manifest
from ...checkpoint.names import MANIFEST, NANOTRON_METADATA, as_safetensors
from ...checkpoint.topology import topology as make_topology
from ...engine import DataStatesEngine
from ...errors import FormatError
from ...save.handle import SaveHandle
from ...store import open_store
from .stock_pickles import load_stock, nanotron_random, random_state_globals, random_states_to_plain

METADATA = NANOTRON_METADATA


def to_datastates(
    src: Path, out: Path, engine: DataStatesEngine, handles: list[SaveHandle], allow_pickle: bool
) -> None:
    """Writes the stock checkpoint `src` into the empty folder `out` in our layout; every save started is
    appended to `handles` (for the caller to wait on if this fails)."""
    meta = read_json(src / METADATA)
    step = _step(src, meta)
    config = load_yaml(src / CONFIG) if os.path.lexists(src / CONFIG) else {}
    parallelism, optimizer = _section(config, "parallelism", src), _section(config, "optimizer", src)
    if meta.get("cp"):  # Nanotron main's
        cp = _size(meta, "cp", src / METADATA)
    else:
        cp = _size(parallelism, "context_parallel_size", src / CONFIG)
    topology = make_topology(
        tp=_size(meta, "tp", src / METADATA),
        pp=_size(parallelism, "pp", src / CONFIG),
        dp=_size(meta, "dp", src / METADATA),
        cp=cp,
        expert=_size(parallelism, "expert_parallel_size", src / CONFIG),
        zero_stage=_size(optimizer, "zero_stage", src / CONFIG, least=0),
    )
    saved: list[tuple[str, SaveHandle]] = []  # (file in `out`, its save)
    for rel in regular_files(src):
        parts = Path(rel).parts
        if parts[0] == MODEL and rel.endswith(".safetensors"):
            tensors = engine.load(src / rel)
            metadata = engine.read_metadata(src / rel)
            # Rewritten rather than copied: the engine computes the checksums the manifest keeps. The file
            # stays Nanotron's (its metadata verbatim, nothing of ours), as the trainer writes weights.
            made = [(rel, engine.save(tensors, out / rel, metadata=metadata, exact_metadata=True))]
        elif parts[0] in PICKLED and rel.endswith(".pt"):
            obj = load_stock(src / rel, allow_pickle)
            target = as_safetensors(rel)
            made = [(target, engine.save(obj, out / target))]
        elif parts[0] == RANDOM and rel.endswith(".pt"):
            random_module = nanotron_random()  # unpickling needs it: fail with a clear message
            loaded = load_stock(src / rel, allow_pickle, random_state_globals(random_module))
            # No "global" entry: the stock layout never kept the process-wide generators (resume allows it).
            plain = {"nanotron": random_states_to_plain(src / rel, loaded, random_module)}
            # Nanotron main's context-parallel ranks all read this one file: each of ours gets a copy.
            made = [(t, engine.save(plain, out / t)) for t in _random_targets(rel, topology["cp"])]
        else:
            if rel != METADATA:  # written last
                copy_file(src, rel, out / rel)
            continue
        for target, h in made:
            handles.append(h)
            saved.append((target, h))
            # One file in memory at a time: the next is read while this one is flushed.
            h.wait_snapshot()
    entries = {}
    for target, h in saved:
        h.wait_persisted()  # raises the save's error
        entries[target] = file_entry((out / target).stat().st_size, h)
    sync_folders(out)
    # As the trainer commits: the metadata, then the manifest, which makes the folder a datastates checkpoint.
    store = open_store(out)
    store.write_atomic(METADATA, read_bytes(src / METADATA))
    store.write_atomic(MANIFEST, manifest_text(make_manifest(step, topology, entries)))


def _random_targets(rel: str, cp: int) -> list[str]:
    """Our names for Nanotron's random-state file `rel`, one per context-parallel rank."""
    base = as_safetensors(rel)
    if cp == 1:
        return [base]
    stem = base.removesuffix(".safetensors")
    return [f"{stem}_cp-{r}-of-{cp}.safetensors" for r in range(cp)]


def _section(config: dict[str, Any], key: str, src: Path) -> dict[str, Any]:
    """The config's section `key` ({} where absent); FormatError, naming the file, where not a mapping."""
    value = config.get(key)
    if value is not None and not isinstance(value, dict):
        raise FormatError(f"{src / CONFIG}: {key} is a {type(value).__name__}, not a mapping")
    return value or {}


def _size(doc: dict[str, Any], key: str, path: Path, least: int = 1) -> int:
    """A parallel size (or the ZeRO stage, from 0) as Nanotron reads it (absent or 0: the default, `least`);
    FormatError naming the file and the key where it is anything but an integer in range (a manifest lists
    at most MAX_FILES files: one per context-parallel rank at least)."""
    value = doc.get(key) or least
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_FILES:
        raise FormatError(f"{path}: {key} is {value!r:.40}, not an integer from {least}")
    return value


def _step(src: Path, meta: dict[str, Any]) -> int:
    if not isinstance(meta.get("metas", {}), dict):
        raise FormatError(f"{src / METADATA}: metas is a {type(meta['metas']).__name__}, not a mapping")
    step = section(meta, "metas").get("last_train_step")
    if isinstance(step, int):
        return step
    named = trust.step_number(src.resolve().name)
    if named is not None:
        return named
    raise ValueError(f"{src}: no metas.last_train_step in {METADATA} and the folder is not named by its step")
