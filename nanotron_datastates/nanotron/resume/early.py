"""Resume, read early: from the trainer's first line, before Nanotron sets up its process groups (0.4 to 0.7 s
on an H100: NCCL's first communicator and a barrier per group), the files every rank reads are read ahead,
found from the config and the manifest alone (`files_to_read` without a place: all the weights where
no rank holds part of the model only; the one optimizer file), from the memory tier where it holds the
checkpoint, and the small files into the page cache first. With memory replicas, a rank whose node's tier
lacks the checkpoint reads nothing ahead: `Resume.plan` pulls it from other nodes' memory at network speed,
and a read of storage under way would only take the memory's and the disk's bandwidth from it; nor does a
rank whose tier holds a memory checkpoint newer than storage's (`memory_interval`).
`Resume.plan` adopts that read-ahead where it reads exactly the files planned with the rank's place, onto the
same device; else it starts one here too."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ...checkpoint.checksums import file_checksums
from ...checkpoint.manifest import read_manifest
from ...checkpoint.reads import ReadSet, files_to_read
from ...engine import DataStatesEngine
from ...resume.read_ahead import Prefetch, shared_weight_reads, warm_page_cache
from ...tier.held_copy import tier_copy
from ...tier.memory import MemoryTier
from ...tier.memory_steps import steps_with_manifest
from ...tier.peer_reads import PeerReads
from ..yaml_config import engine_for, settings_of
from .source import asked_layout, loads, parse_config, resume_folder

if TYPE_CHECKING:
    from ...trainer_settings import TrainerSettings


@dataclasses.dataclass
class EarlyRead:
    """What the trainer's first line found to read ahead: where from, which files, onto which device, and
    the engine made to read them (the trainer saves with it too)."""

    manifest: Mapping[str, object]
    source: Path  # the checkpoint's folder, or the memory tier's copy
    reads: ReadSet
    device: torch.device
    topology: dict[str, int]  # the layout the config asks for
    engine: DataStatesEngine

    def adoptable(
        self, source: Path, device: torch.device | None, reads: ReadSet, peer: PeerReads | None = None
    ) -> bool:
        """Whether this read-ahead reads exactly `reads`, from `source` onto `device`, and no file of them
        comes from another rank's GPU (`peer`: it may send them, from what it reads)."""
        mine = self.source == source and self.device == device and same_large(self.reads, reads)
        return mine and not (peer is not None and peer.into)

    def start(self) -> Prefetch:
        """Starts its read-ahead (`read_ahead`)."""
        return read_ahead(self.engine, self.manifest, self.source, self.reads, self.device, self.topology)


def find(args: Sequence[object], kwargs: Mapping[str, object]) -> EarlyRead | None:
    """What to read ahead for the trainer built with `args, kwargs` (None: nothing, or it cannot be known
    yet); this rank's GPU set and the small files warmed in the page cache. Never raises: whatever fails
    here, `Resume.plan` meets again and reports."""
    if not torch.cuda.is_available():  # a CPU trainer reads nothing ahead
        return None
    try:
        config = parse_config(args, kwargs)
        folder = resume_folder(config)
        if folder is None:
            return None
        manifest = read_manifest(folder)
        settings = settings_of(config)
        if settings.memory_interval and newer_in_memory(settings, folder):
            return None  # a memory checkpoint newer than storage's is resumed instead (from_memory.py)
        source = tier_copy(settings, folder, manifest, int(os.environ.get("RANK", "0")))
        if source is None and settings.memory_replicas:
            return None  # other nodes' memory may hold it (`Resume.plan` pulls it): storage read now is lost
        source = source or folder
        reads = files_to_read(manifest, source, asked_layout(config), None, **loads(config))
        if reads is None or not (reads.weights or reads.optimizer):
            return None
        # Nanotron's ParallelContext sets this same device first thing; set now, the engine pins its cache
        # and the read-ahead allocates on this rank's GPU, not on GPU 0.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        warm_page_cache(reads.small)  # before the disk's queue fills
        engine = engine_for(config)
    except Exception:  # noqa: BLE001 - plan() meets the same problem and reports it
        return None
    return EarlyRead(manifest, source, reads, device, asked_layout(config), engine)


def newer_in_memory(settings: TrainerSettings, folder: Path) -> bool:
    """Whether this rank's memory tier holds a memory checkpoint newer than the checkpoint in `folder`."""
    rank = int(os.environ.get("RANK", "0"))
    tier = MemoryTier(settings.memory_tier_path, folder.parent, rank, settings.memory_tier_copies)
    return bool(steps_with_manifest(tier, int(folder.name)))


def read_ahead(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    folder: Path,
    reads: ReadSet,
    device: torch.device,
    topology: dict[str, int],
    peer: PeerReads | None = None,
) -> Prefetch:
    """The read-ahead of `reads` (weights, optimizer) from `folder` onto `device`, each file checked against
    the manifest's checksums; weight files that several ranks of a node read (replicas on `topology`) go
    through the page cache; at a restart, `peer`'s files from and to other ranks' GPUs."""
    checksums = functools.partial(file_checksums, manifest, folder)
    shared = shared_weight_reads(topology)
    return Prefetch(engine, device, reads.weights, reads.optimizer, checksums, shared, peer)


def same_large(a: ReadSet, b: ReadSet) -> bool:
    """Whether both read the same weight and optimizer files (the small files may differ: before the process
    groups, every rank warms them all)."""
    return (a.weights, a.optimizer) == (b.weights, b.optimizer)
