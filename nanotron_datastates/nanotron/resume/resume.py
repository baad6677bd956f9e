"""Resume: everything from the trainer's first line to the optimizer state being loaded, for a checkpoint with
a manifest (any other is left to Nanotron). The CheckpointManager (manager.py) calls, in this order:

1. `Resume.start(args, kwargs)`, the trainer's first line, before Nanotron sets up its process groups (0.4 to
   0.7 s on an H100): from the config and the manifest alone it starts reading ahead the files every rank
   reads, and the small files into the page cache (early.py). Never raises: step 2 meets it again.
2. `plan(config, pc, folder)`, in `pre_init`: whether this is ours to resume: a memory checkpoint newer than
   `folder` that the nodes hold whole (from_memory.py), else `folder`; where its files are read (the memory
   tier, where every rank finds it whole there, else storage: fallback.py); the files this rank reads, now
   with its place in the groups; the read-ahead of step 1 adopted if it reads exactly those files onto this
   device, else one started (read_ahead.py). Nanotron's own loaders, which read pickles, are turned off
   (`load_optimizer`, `load_lr_scheduler`) until they are ours to honour.
3. `load_weights(model)`, where Nanotron loads its weights: from the read-ahead, else read now; on another
   layout, resharded (weights.py, reshard.py).
4. `load_rest(optimizer, lr_scheduler, random_states, model)`, once Nanotron has built them: scheduler,
   training metadata, random states; the optimizer state now, or at the first `optimizer.step` where it is
   being read ahead (neither the first forward nor backward pass needs it: optimizer_state.py).
5. `confirm()`, at the end of the trainer's construction: the ranks agree that every one of them read the
   checkpoint whole (every tensor checked against its checksum as it was read), or all fall back together
   to the newest committed checkpoint that reads whole (fallback.py), and the log says which and why.
   Returns the training metadata to resume with.
6. `before_step()`, at each optimizer step: the deferred optimizer load, once (or at any earlier read of
   the optimizer's `state_dict`, so nobody sees the state from before the resume).
7. `finish()`, after the first step: Nanotron's `load_optimizer` flag back as the YAML had it.

Errors reading a checkpoint (missing or damaged files) are collected, not raised, until `confirm`; a model
that changed shape fails every checkpoint alike, and `confirm` then raises with every rank's reasons.
States: idle -> started (reading early) -> planned -> weights -> loaded (optimizer pending) -> done.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ...checkpoint.manifest import entries, read_manifest
from ...checkpoint.names import MANIFEST
from ...checkpoint.reads import ReadSet, files_to_read, needed, optimizer_files, relative
from ...checkpoint.topology import saved_topology, topology_changes
from ...engine import DataStatesEngine
from ...resume.deferred_optimizer import DeferredOptimizer
from ...resume.read_ahead import PageCacheWarmer, Prefetch, warm_for_reshard, warm_page_cache
from ...tier.peer_reads import PeerReads
from .. import groups
from .. import log as say
from ..yaml_config import engine_for, settings_of
from . import fallback as recovery
from . import from_memory, optimizer_state, saved_layout, weights
from . import scheduler_and_rng as rest
from .early import EarlyRead, find, read_ahead
from .fallback import READ_ERRORS
from .source import loads

if TYPE_CHECKING:
    from nanotron.serialize.metadata import TrainingMetadata

    from ..types import BaseOptimizer, Config, LRScheduler, NanotronModel, ParallelContext, RandomStates

__all__ = ["READ_ERRORS", "Resume"]


class Resume:
    """One trainer's resume (see the module's docstring for the order of calls)."""

    def __init__(self) -> None:
        self._state = "idle"
        self.folder: Path | None = None  # the checkpoint resumed from, once planned
        self.source: Path | None = None  # where its files are read: the folder, or the memory tier's copy
        self.memory_of: Path | None = None  # a memory checkpoint's: the checkpoints folder it is newer than
        self.peer: PeerReads | None = None  # at a restart: files from and to other ranks' GPUs (the pull's)
        self.manifest: Mapping[str, object] = {}
        self.engine: DataStatesEngine | None = None  # made early or at plan; the trainer saves with it too
        self.prefetch: Prefetch | None = None
        self.warmer: PageCacheWarmer | None = None  # another layout: the files read into the page cache
        self.early = False  # whether the read-ahead began with the trainer's construction
        self._early: EarlyRead | None = None  # what the trainer's first line read ahead, until plan
        self._config: Config | None = None  # set by plan, with the process groups
        self.pc: ParallelContext | None = None
        self._device: torch.device | None = None
        self._flags = (False, False)  # the YAML's load_optimizer, load_lr_scheduler
        self._hold_optimizer_flag = False
        self._failures: list[str] = []  # what this rank could not read of the checkpoint (see confirm)
        self.metadata: TrainingMetadata | None = None
        self._targets: tuple[BaseOptimizer, LRScheduler, RandomStates, NanotronModel] | None = None
        self._deferred: DeferredOptimizer | None = None  # the optimizer state, loaded at the first step

    @property
    def state(self) -> str:
        """idle, started (reading early), planned, weights, loaded (the optimizer state pending), done."""
        if self._state == "loaded" and (self._deferred is None or not self._deferred.pending):
            return "done"
        return self._state

    @property
    def active(self) -> bool:
        """Whether this trainer resumes a datastates checkpoint."""
        return self.folder is not None

    def _root(self) -> Path:
        if self.folder is None:
            raise RuntimeError("Resume.plan found no datastates checkpoint to resume from")
        return self.folder

    def _src(self) -> Path:
        return self.source or self._root()

    def _planned(self) -> tuple[Config, ParallelContext]:
        if self._config is None or self.pc is None:
            raise RuntimeError("Resume.plan has not taken a config and process groups")
        return self._config, self.pc

    # -- 1. the trainer's first line ------------------------------------------------------------------------

    @classmethod
    def start(cls, args: Sequence[object], kwargs: dict[str, object]) -> Resume:
        """Starts reading ahead what every rank reads, from the config and the manifest alone (early.py)."""
        self = cls()
        self._early = find(args, kwargs)
        if self._early is not None:
            self.engine, self.prefetch, self._state = self._early.engine, self._early.start(), "started"
        return self

    # -- 2. pre_init ----------------------------------------------------------------------------------------

    def plan(
        self,
        config: Config,
        pc: ParallelContext,
        folder: str | os.PathLike | None,
        device: torch.device | None = None,
    ) -> bool:
        """Whether the trainer resumes a datastates checkpoint from `folder` (Nanotron's resolution of the
        path); if so, decides where its files are read, starts or adopts the read-ahead and turns Nanotron's
        own loaders off. The state is read onto `device` (default: this rank's GPU; without one, nothing is
        read ahead). Collective where the memory tier is on (the ranks agree where to read)."""
        from nanotron.s3_checkpoints import check_path_is_local

        early, self._early = self._early, None
        settings = settings_of(config)
        # A manifest that is not a regular file (a FIFO): a checkpoint that cannot be read, which falls back.
        ours = folder is not None and os.path.lexists(Path(folder) / MANIFEST) and check_path_is_local(folder)
        stored = Path(folder) if ours and folder is not None else None
        memory = from_memory.checkpoints_of(config, settings, stored)  # whose memory checkpoints to look for
        if stored is None and memory is None:
            return self._nothing(config, pc, folder)
        groups.check(pc)  # at start-up, not in the middle of loading
        self._config, self.pc = config, pc
        self._device = device or (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        ck = config.checkpoints
        self._flags = (ck.load_optimizer, ck.load_lr_scheduler)
        ck.load_optimizer = ck.load_lr_scheduler = False
        if not from_memory.choose(self, settings, pc, memory, stored):  # none serves, storage has none
            ck.load_optimizer, ck.load_lr_scheduler = self._flags
            return self._nothing(config, pc, folder)
        reads, device = (self.files() if not self._failures else None), self._device
        if reads is None or device is None:
            self._drop_prefetch(report=False)
            if reads is None and device is not None and not self._failures:
                self.warmer = warm_for_reshard(self.manifest, self._src(), self.source is not None)
            return True
        if early is not None and early.adoptable(self._src(), device, reads, self.peer):
            self.early = True  # the read-ahead of step 1 reads exactly these files onto this device
            self.prefetch.peer = self.peer  # type: ignore[union-attr] # sends only: from now on is soon enough
            return True
        self._drop_prefetch(report=False)
        warm_page_cache(reads.small)  # first, while the disk is idle
        if reads.weights or reads.optimizer:
            at = groups.layout_of(pc, int(config.optimizer.zero_stage))
            self.prefetch = read_ahead(
                self.get_engine(), self.manifest, self._src(), reads, device, at, self.peer
            )
        return True

    def _nothing(self, config: Config, pc: ParallelContext, folder: str | os.PathLike | None) -> bool:
        """Nothing of ours to resume (False): a stock checkpoint refused where the engine saves."""
        self.folder = None
        self._drop_prefetch(report=False)  # not adopted: its buffers go back when its reads end
        if folder is not None and getattr(config, "uses_datastates", False):
            saved_layout.refuse_stock(Path(folder), config, pc)
        return False

    def take(self, folder: Path, source: Path | None = None) -> None:
        """Takes `folder` as the checkpoint to resume (its files read from `source`, default the folder)."""
        self.folder, self.source, self._failures, self._state, self.peer = folder, source, [], "planned", None
        if self._deferred is not None:
            self._deferred.cancel()
        self._deferred = None
        try:
            self.manifest = read_manifest(folder)
            optimizer_files(entries(self.manifest))  # every part of a file written in parts listed
        except (OSError, ValueError) as e:
            self.manifest = {"files": {}, "topology": {}}
            self._failures.append(str(e))

    def files(self) -> ReadSet | None:
        """The files this rank reads (None: the layout changed). Tensor- and pipeline-parallel ranks read
        their weight files as the model says (`shards.weight_sources`), not ahead."""
        config, pc = self._planned()
        here, place = groups.layout_of(pc, int(config.optimizer.zero_stage)), groups.place(pc)
        return files_to_read(self.manifest, self._src(), here, place, **loads(config, self._flags))

    def needs(self) -> set[str]:
        """The manifest's files this rank reads (checkpoint/reads.needed)."""
        return needed(entries(self.manifest), None if self._failures else self.files(), self._src())

    def ahead(self) -> dict[str, list[str]]:
        """The files this rank will read ahead onto its GPU, by list (`weights`, `optimizer`); none: {}."""
        gpu = self._device is not None and self._device.type == "cuda"
        reads = self.files() if gpu and not self._failures else None
        return (
            {k: relative(getattr(reads, k), self._src()) for k in ("weights", "optimizer")} if reads else {}
        )

    def get_engine(self) -> DataStatesEngine:
        if self.engine is None:
            self.engine = engine_for(self._config)
        return self.engine

    # -- 3. weights -----------------------------------------------------------------------------------------

    def load_weights(self, model: NanotronModel) -> dict[str, dict[str, object]]:
        """Loads this rank's weights into `model`'s parameters; returns Nanotron's `param_shard_metadata`.
        What cannot be read is collected for `confirm`."""
        t0, pc = time.perf_counter(), self._planned()[1]
        try:
            names = weights.load(self.get_engine, self.manifest, self._src(), model, pc, self.prefetch)
        except READ_ERRORS as e:
            self._failures.append(f"weights: {e}")
            return {}
        if names is None:  # resharded (weights.py)
            return {}
        self._state = "weights"
        say.info(f"loaded {len(names)} weight files in {time.perf_counter() - t0:.2f} s")
        return {name: {} for name in names}

    # -- 4. scheduler, metadata, random states; the optimizer now or at the first step ---------------------

    def load_rest(
        self,
        optimizer: BaseOptimizer,
        lr_scheduler: LRScheduler,
        random_states: RandomStates,
        model: NanotronModel,
    ) -> None:
        """Loads what the YAML asks for, on whatever layout (the optimizer state resharded where it changed:
        reshard.py). What cannot be read is collected for `confirm`."""
        self._targets = (optimizer, lr_scheduler, random_states, model)
        t0 = time.perf_counter()
        try:
            self._load_rest(self._targets)
        except READ_ERRORS as e:
            self._failures.append(str(e))
        if self.warmer is not None:  # what the reshard reads is read
            self.warmer.stop()
        ck = self._planned()[0].checkpoints
        ck.load_optimizer = self._flags[0] and not self._hold_optimizer_flag
        ck.load_lr_scheduler = self._flags[1]
        pending = self._deferred is not None and self._deferred.pending
        self._state = "loaded"
        what = "scheduler" if pending else "optimizer, scheduler"
        say.info(f"resumed {what}, metadata and random states in {time.perf_counter() - t0:.2f} s")

    def _load_rest(self, targets: tuple[BaseOptimizer, LRScheduler, RandomStates, NanotronModel]) -> None:
        optimizer, lr_scheduler, random_states, model = targets
        load_optimizer, load_scheduler = self._flags
        (config, pc), engine, src = self._planned(), self.get_engine(), self._src()
        here = groups.layout_of(pc, int(config.optimizer.zero_stage))
        changed = topology_changes(saved_topology(self.manifest), here)
        # Optimizer state placed straight on the GPU (Nanotron's loader reads onto the CPU, and its first
        # step copies the state over, asserting it is on the CPU): its `load_optimizer` flag stays off until
        # that step has run.
        on_gpu = self._device is not None and self._device.type == "cuda"
        self._hold_optimizer_flag = load_optimizer and on_gpu
        if load_optimizer:  # optimizer_state.py
            ahead = self.prefetch is not None and self.prefetch.reads_optimizer
            state = (engine, self.manifest, src, optimizer, model, pc, changed, self._device)
            self._deferred = optimizer_state.load(*state, self._read_optimizer, ahead)
        if load_scheduler:
            args = (engine, self.manifest, self._root(), src, changed, lr_scheduler, optimizer, model, pc)
            self.metadata = rest.load_scheduler(*args, train_steps=config.tokens.train_steps)
        rest.load_random_states(engine, self.manifest, src, changed, random_states, pc)
        if self._deferred is None or not self._deferred.pending:
            self._drop_prefetch()

    def _read_optimizer(self, path: Path, device: torch.device | None) -> object:
        """The optimizer state: as read ahead, or read now (at the first step: the read-ahead of the time)."""
        return optimizer_state.read_file(self.prefetch, self.get_engine, self.manifest, path, device)

    # -- 5. every rank read it whole, or all fall back ------------------------------------------------------

    def confirm(self) -> TrainingMetadata | None:
        """Waits for the optimizer state read ahead, then has the ranks agree that each read the checkpoint
        whole, or fall back together (fallback.py). Returns the training metadata to resume with (None where
        the scheduler is not loaded). Collective."""
        if self.prefetch is not None:  # every rank at once, before any falls back
            self.prefetch.exchange("optimizer")
        recovery.confirm(self)
        return self.metadata

    def failures(self) -> list[str]:
        """What this rank could not read of the checkpoint, the optimizer state read ahead included."""
        if self._deferred is not None and self._deferred.pending:
            try:
                self._deferred.read()
            except READ_ERRORS as e:
                self._failures.append(f"optimizer: {e}")
        return list(self._failures)

    def reload(self, folder: Path, source: Path | None) -> None:
        """Loads everything again, from another checkpoint (or the same from storage), now."""
        self._drop_prefetch(report=False)
        self.take(folder, source)
        if self._targets is not None:  # what load_rest loaded into (confirm runs after it)
            self.load_weights(self._targets[3])
            self.load_rest(*self._targets)

    # -- 6, 7. the first step -------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Loads the optimizer state if still pending (once: see DeferredOptimizer)."""
        if self._deferred is not None and self._deferred.pending:
            self._deferred.load()
        if self.prefetch is not None:  # also where something read the optimizer's state_dict first
            self._drop_prefetch()

    def finish(self, close_engine: bool) -> None:
        """After the first step: Nanotron's `load_optimizer` flag back as the YAML had it; the engine closed
        where nothing saves with it."""
        if self._hold_optimizer_flag:
            self._hold_optimizer_flag = False
            self._planned()[0].checkpoints.load_optimizer = self._flags[0]
        if self.warmer is not None:
            self.warmer.stop()
            self.warmer = None
        if close_engine and self.engine is not None:
            self.engine.close()
            self.engine = None

    def _drop_prefetch(self, report: bool = True) -> None:
        if self.prefetch is not None and report:
            since = "the trainer's start" if self.early else "the process groups were set up"
            say.info(f"read ahead, since {since}: {self.prefetch.report()}")
        self.prefetch = None  # whatever was read ahead and not used goes back
