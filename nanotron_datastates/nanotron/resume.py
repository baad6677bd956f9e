"""Resume: everything from the trainer's first line to the optimizer state being loaded, for a checkpoint with
a manifest (any other is left to Nanotron). The trainer mixin calls, in this order:

1. `Resume.start(args, kwargs)`, the trainer's first line, before Nanotron sets up its process groups (0.4 to
   0.7 s on an H100: NCCL's first communicator and a barrier per group). From the config and the manifest
   alone it starts reading ahead the files every rank reads (`layout.files_to_read` without a place: all the
   weights where no rank holds part of the model only; the one optimizer file), and the small files into
   the page cache first. Never raises: whatever fails here, step 2 meets again and reports.
2. `plan(config, pc, folder)`, in `pre_init`: whether this is ours to resume; the files this rank reads, now
   with its place in the groups; the read-ahead of step 1 adopted if it reads exactly those files onto this
   device, else one started for them (prefetch.py). Nanotron's own loaders, which read pickles, are turned
   off (`load_optimizer`, `load_lr_scheduler`) until they are ours to honour.
3. `load_weights(model)`, where Nanotron loads its weights: from the read-ahead, else read now.
4. `load_rest(optimizer, lr_scheduler, random_states)`, once Nanotron has built them: scheduler, training
   metadata, random states. The optimizer state waits for the first `optimizer.step` where it is being read
   ahead (neither the first forward nor backward pass needs it), else it is loaded now.
5. `before_step()`, at each optimizer step: the deferred optimizer load, once. Anything else reading the
   optimizer's state first (`state_dict`) loads it too, so nobody sees the state from before the resume.
6. `finish()`, after the first step: Nanotron's `load_optimizer` flag back as the YAML had it.

States: idle -> started (reading early) -> planned -> weights -> loaded (optimizer pending) -> done.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..engine import DataStatesEngine
from . import groups, layout, reshard, saved_layout, say, shards, states
from .config import section
from .prefetch import Prefetch, fill, warm_page_cache
from .target import asked_layout, loads, parse_config, resume_folder


def _device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


class Resume:
    """One trainer's resume (see the module's docstring for the order of calls)."""

    def __init__(self) -> None:
        self.state = "idle"
        self.folder: Path | None = None  # the checkpoint resumed from, once planned
        self.manifest: dict[str, Any] = {}
        self.engine: DataStatesEngine | None = None  # made early or at plan; the trainer saves with it too
        self.prefetch: Prefetch | None = None
        self.early = False  # whether the read-ahead began with the trainer's construction
        self._early: tuple[Path, layout.ReadSet, torch.device] | None = None
        self._config: Any = None
        self._pc: Any = None
        self._device: torch.device | None = None
        self._flags = (False, False)  # the YAML's load_optimizer, load_lr_scheduler
        self._hold_optimizer_flag = False
        self._pending: Callable[[], None] | None = None  # the deferred optimizer load
        self._lock = threading.RLock()

    @property
    def active(self) -> bool:
        """Whether this trainer resumes a datastates checkpoint."""
        return self.folder is not None

    def _root(self) -> Path:
        if self.folder is None:
            raise RuntimeError("Resume.plan found no datastates checkpoint to resume from")
        return self.folder

    # -- 1. the trainer's first line ------------------------------------------------------------------------

    @classmethod
    def start(cls, args: Sequence[Any], kwargs: dict[str, Any]) -> Resume:
        self = cls()
        if not torch.cuda.is_available():  # a CPU trainer reads nothing ahead
            return self
        try:
            config = parse_config(args, kwargs)
            folder = resume_folder(config)
            if folder is None:
                return self
            manifest = layout.read_manifest(folder)
            reads = layout.files_to_read(manifest, folder, asked_layout(config), None, **loads(config))
            if reads is None or (not reads.weights and reads.optimizer is None):
                return self
            # Nanotron's ParallelContext sets this same device first thing; set now, the engine pins its cache
            # and the read-ahead allocates on this rank's GPU, not on GPU 0.
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            warm_page_cache(reads.small)  # before the disk's queue fills
            self.engine = DataStatesEngine(section(config).engine)
        except Exception:  # noqa: BLE001 - plan() meets the same problem and reports it
            return self
        self.prefetch = self._read_ahead(manifest, folder, reads, device)
        self._early, self.state = (folder, reads, device), "started"
        return self

    # -- 2. pre_init ----------------------------------------------------------------------------------------

    def plan(
        self, config: Any, pc: Any, folder: str | os.PathLike | None, device: torch.device | None = None
    ) -> bool:
        """Whether the trainer resumes a datastates checkpoint from `folder` (Nanotron's resolution of the
        path); if so, starts or adopts the read-ahead and turns Nanotron's own loaders off. The state is read
        onto `device` (default: this rank's GPU; without one, nothing is read ahead)."""
        from nanotron.s3_checkpoints import check_path_is_local

        early, self._early = self._early, None
        if folder is None or not check_path_is_local(folder) or not layout.is_datastates_checkpoint(folder):
            self._drop_prefetch(report=False)  # not adopted: its buffers go back when its reads end
            if folder is not None and getattr(config, "uses_datastates", False):
                saved_layout.refuse_stock(Path(folder), config, pc)
            return False
        groups.check(pc)  # at start-up, not in the middle of loading
        self.folder, self._config, self._pc = Path(folder), config, pc
        self._device = device or _device()
        self.manifest = layout.read_manifest(folder)
        ck = config.checkpoints
        self._flags = (ck.load_optimizer, ck.load_lr_scheduler)
        ck.load_optimizer = ck.load_lr_scheduler = False
        self.state = "planned"
        reads, device = self.files(), self._device
        if reads is None or device is None:
            self._drop_prefetch(report=False)
            return True
        if (
            early is not None
            and early[0] == self._root()
            and early[2] == device
            and _same_large(early[1], reads)
        ):
            self.early = True  # the read-ahead of step 1 reads exactly these files onto this device
            return True
        self._drop_prefetch(report=False)
        warm_page_cache(reads.small)  # first, while the disk is idle
        if reads.weights or reads.optimizer is not None:
            self.prefetch = self._read_ahead(self.manifest, self._root(), reads, device)
        return True

    def files(self) -> layout.ReadSet | None:
        """The files this rank reads (None: the layout changed). Tensor- and pipeline-parallel ranks read
        their weight files as the model says (`shards.weight_sources`), not ahead."""
        here = groups.layout_of(self._pc, int(self._config.optimizer.zero_stage))
        place = groups.place(self._pc)
        return layout.files_to_read(
            self.manifest, self._root(), here, place, **loads(self._config, self._flags)
        )

    def topology_changes(self) -> dict[str, tuple[Any, int]]:
        here = groups.layout_of(self._pc, int(self._config.optimizer.zero_stage))
        return layout.topology_changes(self.manifest.get("topology", {}), here)

    def get_engine(self) -> DataStatesEngine:
        if self.engine is None:
            self.engine = DataStatesEngine(section(self._config).engine)
        return self.engine

    def _read_ahead(
        self, manifest: dict[str, Any], folder: Path, reads: layout.ReadSet, device: torch.device
    ) -> Prefetch:
        checksums = functools.partial(layout.file_checksums, manifest, folder)
        return Prefetch(self.get_engine(), device, reads.weights, reads.optimizer, checksums)

    # -- 3. weights -----------------------------------------------------------------------------------------

    def load_weights(self, model: torch.nn.Module) -> dict[str, Any]:
        """Loads this rank's weights into `model`'s parameters; returns Nanotron's `param_shard_metadata`.
        Where the layout changed, Nanotron's own loader merges and reshards the weight files."""
        t0 = time.perf_counter()
        sources = shards.weight_sources(model, self._pc, self._root())
        if sources is None:  # another layout: each parameter put together from the saved pieces
            n = reshard.load_weights(self.get_engine(), self.manifest, self._root(), model)
            say.info(f"resharded {n} weights in {time.perf_counter() - t0:.2f} s")
            return {}
        ahead = self.prefetch.weights() if self.prefetch is not None else {}
        checksums = functools.partial(layout.file_checksums, self.manifest, self._root())
        fill([(tensor, path) for _, tensor, path in sources], ahead, self.get_engine(), checksums)
        self.state = "weights"
        say.info(f"loaded {len(sources)} weight files in {time.perf_counter() - t0:.2f} s")
        return {name: {} for name, _, _ in sources}

    # -- 4. scheduler, metadata, random states; the optimizer now or at the first step ---------------------

    def load_rest(self, optimizer: Any, lr_scheduler: Any, random_states: Any, model: Any) -> Any | None:
        """Loads what the YAML asks for, on whatever layout (the optimizer state resharded where it changed:
        reshard.py); returns the training metadata (None where the scheduler is not loaded: Nanotron's fresh
        metadata stays)."""
        t0 = time.perf_counter()
        load_optimizer, load_scheduler = self._flags
        engine, pc, metadata = self.get_engine(), self._pc, None
        changed = self.topology_changes()
        if load_optimizer and changed:
            state = reshard.optimizer_state(engine, self.manifest, self._root(), optimizer, model, pc)
            optimizer.load_state_dict(state, map_location=self._device or "cpu")
            moved = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            say.info(f"optimizer state resharded ({moved})")
        elif load_optimizer:
            path = shards.optimizer_file(pc, self._root(), zero=shards.is_zero(optimizer))
            # Straight onto the GPU (Nanotron's loader reads onto the CPU, and its first step copies the state
            # over from pageable memory); its `load_optimizer` flag stays off until that step has run.
            device = self._device
            self._hold_optimizer_flag = device is not None and device.type == "cuda"
            self._pending = functools.partial(self._load_optimizer, optimizer, path, device)
            if self.prefetch is not None and self.prefetch.reads_optimizer:
                _wrap_state_dict(optimizer, self.before_step)  # read ahead: loaded at the first step
            else:
                self.before_step()
        if load_scheduler:
            from nanotron.serialize.metadata import load_meta

            # Unlike Nanotron's loader, no `_initial_step()` after this: it steps the schedule once more, so
            # the resumed run would use the next step's learning rate. The optimizer's param groups, restored
            # above, already hold the rate the original run would use now.
            if changed:
                args = (engine, self.manifest, self._root(), optimizer, model, pc)
                lr_scheduler.load_state_dict(reshard.scheduler_state(*args))
            else:
                lr_scheduler.load_state_dict(engine.load(shards.lr_scheduler_file(pc, self._root())))
            metadata = load_meta(parallel_context=pc, root_folder=self._root()).metas
            if self._config.tokens.train_steps <= metadata.last_train_step:
                raise ValueError(
                    f"the checkpoint has already trained {metadata.last_train_step} steps; set "
                    "tokens.train_steps higher"
                )
        path = shards.random_states_path(pc, self._root())
        if not path.exists() and changed:
            path = self._root() / "random" / layout.random_states_at(self.manifest, groups.place(pc))
            say.info(
                f"random states: this layout's ranks take those of the saved ranks at the same places, "
                f"modulo the saved sizes (rank 0: {path.name})"
            )
        if path.exists():
            saved = engine.load(path)
            for key, value in saved["nanotron"].items():
                random_states[key] = states.random_state_from_plain(value)  # in place: the model holds them
            if "global" in saved:  # absent from checkpoints converted from Nanotron's layout
                states.set_global_rng_state(saved["global"])
        if self._pending is None:
            self._drop_prefetch()
        ck = self._config.checkpoints
        ck.load_optimizer = load_optimizer and not self._hold_optimizer_flag
        ck.load_lr_scheduler = load_scheduler
        self.state = "loaded" if self._pending is not None else "done"
        what = "scheduler" if self._pending is not None else "optimizer, scheduler"
        say.info(f"resumed {what}, metadata and random states in {time.perf_counter() - t0:.2f} s")
        return metadata

    def _load_optimizer(self, optimizer: Any, path: Path, device: torch.device | None) -> None:
        t0 = time.perf_counter()
        state = self.prefetch.optimizer(path) if self.prefetch is not None else None
        if state is None:  # not read ahead, or (were Nanotron to change) not the optimizer's file
            state = self.get_engine().load(path, device or "cpu")
        optimizer.load_state_dict(state, map_location=device or "cpu")
        if self.state == "loaded":
            say.info(
                f"optimizer state loaded at its first use "
                f"({time.perf_counter() - t0:.2f} s waiting for the read)"
            )
        self._drop_prefetch()

    # -- 5, 6. the first step -------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Loads the optimizer state if still pending (once; one that raises stays pending and raises again at
        the next call: no step ever runs on the state from before the resume)."""
        with self._lock:
            load = self._pending
            if load is None:
                return
            self._pending = None  # the load itself calls state_dict, which comes back here
            try:
                load()
            except BaseException:
                self._pending = load
                raise
            self.state = "done"

    def finish(self, close_engine: bool) -> None:
        """After the first step: Nanotron's `load_optimizer` flag back as the YAML had it; the engine closed
        where nothing saves with it."""
        if self._hold_optimizer_flag:
            self._hold_optimizer_flag = False
            self._config.checkpoints.load_optimizer = self._flags[0]
        if close_engine and self.engine is not None:
            self.engine.close()
            self.engine = None

    def _drop_prefetch(self, report: bool = True) -> None:
        if self.prefetch is not None and report:
            since = "the trainer's start" if self.early else "the process groups were set up"
            say.info(f"read ahead, since {since}: {self.prefetch.report()}")
        self.prefetch = None  # whatever was read ahead and not used goes back


def _wrap_state_dict(optimizer: Any, first: Callable[[], None]) -> None:
    """`optimizer.state_dict` runs `first` before it (on this instance; its class is untouched)."""
    original = optimizer.state_dict

    @functools.wraps(original)
    def state_dict(*args: Any, **kwargs: Any) -> Any:
        first()
        return original(*args, **kwargs)

    optimizer.state_dict = state_dict


def _same_large(a: layout.ReadSet, b: layout.ReadSet) -> bool:
    """Whether both read the same weight and optimizer files (the small files may differ: before the process
    groups, every rank warms them all)."""
    return (a.weights, a.optimizer) == (b.weights, b.optimizer)
