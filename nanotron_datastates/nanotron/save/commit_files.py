"""Rank 0's commit of a checkpoint, run by its committer once every rank's files are persisted: Nanotron's
own files (`config.yaml`, `model_config.json`, `optimizer/optimizer_config.json`, `checkpoint_metadata.json`),
the manifest, then `latest.txt`, each written atomically through the checkpoints folder's store (`store/`).

What training changes is captured when the checkpoint's files are queued, on the training thread
(`finalizer`): the training metadata's text and the two counters Nanotron sets in the config at a save
(`general.step`, `general.consumed_train_samples`); training moves on while the files are flushed, and the
counters with it. The rest, which training does not change (the config, the model's and the optimizer's
layout), the committer writes out: the config as it is then, with the counters captured.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import yaml
from nanotron.config.utils_config import serialize
from nanotron.constants import CHECKPOINT_FILE_NAME, MODEL_CONFIG_FILE_NAME

from ...checkpoint.manifest import manifest as make_manifest
from ...checkpoint.manifest import manifest_text
from ...checkpoint.names import MANIFEST
from ...store import open_store
from .. import groups, shards

# libyaml's emitter where PyYAML has it: the same text as yaml.dump's (Nanotron's `save_as_yaml`), written
# in 0.5 ms instead of 10 (a 2-core machine) of the committer's time under the GIL, which training shares.
_DUMPER = getattr(yaml, "CDumper", yaml.Dumper)

if TYPE_CHECKING:
    from ..types import (
        BaseOptimizer,
        Config,
        Documents,
        FileEntries,
        NanotronConfigs,
        ParallelContext,
        TrainingMetadata,
    )


def finalizer(
    *,
    step: int,
    checkpoints: Path,
    pc: ParallelContext,
    config: Config,
    model_config: NanotronConfigs,
    optimizer: BaseOptimizer,
    metadata: TrainingMetadata,
    replicas: dict[str, object] | None = None,
) -> Callable[[FileEntries], None]:
    """The commit of the checkpoint of `step` under `checkpoints`, given every rank's files (the manifest's
    entries, gathered by the committers); `replicas`: the memory replicas' placement, recorded."""
    store = open_store(checkpoints)
    folder = str(step)
    documents = memory_documents(step=step, pc=pc, config=config, metadata=metadata, replicas=replicas)
    counters = {"step": config.general.step, "consumed_train_samples": config.general.consumed_train_samples}

    def finalize(files: FileEntries) -> None:
        config_doc = serialize(config)
        config_doc["general"].update(counters)
        store.write_atomic(f"{folder}/config.yaml", yaml.dump(config_doc, Dumper=_DUMPER))
        store.write_atomic(f"{folder}/{MODEL_CONFIG_FILE_NAME}", model_config_text(model_config))
        store.write_atomic(
            f"{folder}/optimizer/optimizer_config.json", json.dumps(shards.optimizer_config(optimizer, pc))
        )
        texts = documents(files)
        store.write_atomic(f"{folder}/{CHECKPOINT_FILE_NAME}", texts[CHECKPOINT_FILE_NAME])
        store.write_atomic(f"{folder}/{MANIFEST}", texts[MANIFEST])  # the manifest after the files it lists
        # Several jobs (or a pruning tool) may share the folder: latest.txt only moves under its lock.
        store.set_latest(step)

    return finalize


def model_config_text(model_config: NanotronConfigs) -> str:
    """`model_config.json` as Nanotron writes it."""
    if hasattr(model_config, "to_json_string"):
        return model_config.to_json_string()
    return json.dumps(dataclasses.asdict(model_config))


def memory_documents(
    *,
    step: int,
    pc: ParallelContext,
    config: Config,
    metadata: TrainingMetadata,
    replicas: dict[str, object] | None = None,
) -> Documents:
    """The manifest and Nanotron's training metadata of the checkpoint of `step`, given every rank's files
    (the metadata's text captured now): what a memory checkpoint keeps beside its files in the memory tier
    (tier/memory_steps.py), and what `finalizer` writes into storage's folder."""
    meta_text = shards.checkpoint_metadata_text(pc, metadata)
    topology = groups.layout_of(pc, int(config.optimizer.zero_stage))

    def documents(files: FileEntries) -> dict[str, str]:
        manifest = manifest_text(make_manifest(step, topology, files, replicas))
        return {MANIFEST: manifest, CHECKPOINT_FILE_NAME: meta_text}

    return documents
