"""A checkpoint of Nanotron's stock layout written as ours: the weight files rewritten by the engine (to get
their checksums), the optimizer and LR scheduler pickles as engine-written safetensors, the random states as
plain values (one file per context-parallel rank); the metadata, then the manifest, written last, as the
trainer commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import trust
from ...checkpoint.checksums import file_entry
from ...checkpoint.file_io import read_json, read_yaml
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
from ...checkpoint.manifest import manifest as make_manifest
from ...checkpoint.manifest import manifest_text
from ...checkpoint.names import MANIFEST, NANOTRON_METADATA, as_safetensors
from ...checkpoint.topology import topology as make_topology
from ...engine import DataStatesEngine
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
    config = read_yaml(src / CONFIG)
    parallelism = config.get("parallelism") or {}
    topology = make_topology(
        tp=meta["tp"],
        pp=int(parallelism.get("pp") or 1),
        dp=meta["dp"],
        cp=int(meta.get("cp") or parallelism.get("context_parallel_size") or 1),  # Nanotron main's
        expert=int(parallelism.get("expert_parallel_size") or 1),
        zero_stage=int((config.get("optimizer") or {}).get("zero_stage") or 0),
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


def _step(src: Path, meta: dict[str, Any]) -> int:
    step = (meta.get("metas") or {}).get("last_train_step")
    if isinstance(step, int):
        return step
    named = trust.step_number(src.resolve().name)
    if named is not None:
        return named
    raise ValueError(f"{src}: no metas.last_train_step in {METADATA} and the folder is not named by its step")
