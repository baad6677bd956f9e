"""Memory checkpoints (`datastates.memory_interval`): checkpoints taken into the memory tier only, between the
checkpoints to storage. Their files are the tier's like any other (each rank's marked held once every rank's
are in memory, replicated with `memory_replicas`); what storage's folder would hold besides them, the manifest
(`datastates.json`) and Nanotron's training metadata (`checkpoint_metadata.json`), every rank writes into its
node's step folder once the ranks agree that the checkpoint is whole, so that any node that survives holds
them. A restart (nanotron/resume/from_memory.py) looks for steps newer than storage's newest here.

Nothing here is trusted that this user did not write: the documents are read as regular files of ours, with
no link followed, and the manifest is checked like storage's (`check_manifest`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from .. import trust
from ..checkpoint.manifest import MAX_MANIFEST, ManifestError, check_manifest
from ..checkpoint.names import MANIFEST, NANOTRON_METADATA
from .memory import MemoryTier

DOCUMENTS = (MANIFEST, NANOTRON_METADATA)


def keep_documents(tier: MemoryTier, step: int, documents: dict[str, str]) -> None:
    """Writes a memory checkpoint's documents (by name: `DOCUMENTS`) into `tier`'s folder of `step`, each
    atomically and with no link followed (ranks of one node write the same text: the last rename wins)."""
    for name, text in documents.items():
        if name not in DOCUMENTS:
            raise ValueError(f"{name}: not a document of a memory checkpoint (expected one of {DOCUMENTS})")
        trust.write_in(tier.folder, f"{step}/{name}", text.encode())


def steps_with_manifest(tier: MemoryTier, newer_than: int | None) -> list[int]:
    """The steps of `tier`'s folder newer than `newer_than` (None: all) holding a manifest, oldest first."""
    out = []
    for step in tier.steps():
        if newer_than is not None and step <= newer_than:
            continue
        try:  # there, a regular file of ours: read (and checked) only for the step a restart tries
            os.close(trust.open_regular(tier.folder / str(step) / MANIFEST, own=True))
        except OSError:
            continue
        out.append(step)
    return out


def read_documents(tier: MemoryTier, step: int) -> dict[str, str]:
    """The documents of the memory checkpoint of `step` in `tier`'s folder, by name: the manifest checked
    (ManifestError naming it, where it is not ours or not of `step`); OSError where one is missing or is not
    a regular file of ours."""
    out = {}
    for name in DOCUMENTS:
        path = tier.folder / str(step) / name
        out[name] = trust.read_regular(path, MAX_MANIFEST, own=True).decode()
    manifest_of(out, step, str(tier.folder / str(step) / MANIFEST))
    return out


def manifest_of(documents: dict[str, str], step: int, where: str) -> Mapping[str, object]:
    """The manifest among `documents`, checked (ManifestError naming `where`), and of `step`."""
    try:
        doc = json.loads(documents[MANIFEST])
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where} is not valid JSON: {e}") from None
    manifest = check_manifest(doc, where)
    if manifest["step"] != step:
        raise ManifestError(f"{where}: step {manifest['step']}, not {step}")
    return manifest
