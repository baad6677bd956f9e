"""DataStatesTrainerMixin: Nanotron's DistributedTrainer, checkpointing through the DataStates engine.

With `checkpointing_engine: datastates`:

* `save_checkpoint` queues every file of this rank (weights with Nanotron's names and metadata; optimizer with
  its fp32 master weights, LR scheduler and random states as safetensors) and returns as soon as the copies
  are queued; the forward and backward passes of the next step run while they proceed. Checkpoints copied
  on the GPU first are queued at the start of the next optimizer step instead (`queue_at_step`): only the
  random states and plain values, which those passes change, are captured in `save_checkpoint`;
* the optimizer's `step` waits for the snapshot of the previous checkpoint (every tensor captured), and
  nothing else waits;
* a background committer waits for persistence and lets rank 0 write the checkpoint's metadata, its manifest
  and `latest.txt` once every rank's files are durable (see commit.py); post-save hooks (S3 upload) then run,
  at the next checkpoint or at the end of training, which drains everything;
* at most MAX_IN_FLIGHT checkpoints are in flight: a new one first waits for the oldest (backpressure).

Resuming from a checkpoint that has a manifest reads it with the engine (weights straight into the
parameters, in parallel), whatever `checkpointing_engine` says; any other checkpoint is left to Nanotron. On a
GPU the files are read ahead while Nanotron sets up its process groups and builds the model (early.py,
prefetch.py), and the optimizer state is loaded at the first optimizer step, its read overlapping the first
forward and backward passes (deferred.py).
With `checkpointing_engine: torch` and such a checkpoint, the trainer is Nanotron's, unchanged.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import copy
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import fasteners
import torch
import torch.distributed as tdist
import yaml
from nanotron import distributed as dist
from nanotron import logging
from nanotron.config.utils_config import serialize
from nanotron.constants import CHECKPOINT_FILE_NAME, MODEL_CONFIG_FILE_NAME
from nanotron.logging import log_rank
from nanotron.s3_checkpoints import check_path_is_local
from nanotron.serialize.metadata import load_meta

from ..config import DataStatesConfig
from ..engine import DataStatesEngine
from ..plan import SavePlan, copy_many, staged_nbytes
from . import early, groups, housekeeping, layout, shards, staging, states
from .commit import CheckpointError, CommitResult, Committer, PendingCheckpoint
from .deferred import DeferredLoad
from .gate import SnapshotGate
from .prefetch import Prefetch, warm_page_cache

logger = logging.get_logger(__name__)

MAX_IN_FLIGHT = 2  # checkpoints being flushed at once; a third waits for the oldest


@dataclasses.dataclass
class _Files:
    """What this rank writes at every checkpoint, relative to the checkpoint's folder."""

    weights: list[tuple[Path, SavePlan]]
    optimizer: Path | None
    lr_scheduler: Path | None
    random: Path


class DataStatesTrainerMixin:
    """Mix in before Nanotron's trainer: ``class T(DataStatesTrainerMixin, DistributedTrainer)``."""

    # -- construction and resume ----------------------------------------------------------------------------

    def pre_init(self) -> None:
        super().pre_init()  # Nanotron resolves the checkpoint to resume from
        ahead = getattr(self, "_ds_early", None)
        self._ds_engine: DataStatesEngine | None = ahead.engine if ahead is not None else None
        self._ds_committer: Committer | None = None
        self._ds_gate = SnapshotGate()
        self._ds_outstanding = 0
        self._ds_optimizer_flag_held = False  # checkpoints.load_optimizer, off until the first step is done
        self._ds_files: _Files | None = None
        self._ds_staged: bool | None = None  # whether the last checkpoint was copied on the GPU first
        self._ds_checkpoint_bytes: int | None = None  # this rank's weight and optimizer files, once known
        self._ds_prefetch: Prefetch | None = None
        self._ds_read_early = False  # whether the read-ahead began with the trainer's construction (early.py)
        self._ds_pinning = False  # whether the host cache is being pinned (from the first step on)
        self._ds_deferred: DeferredLoad | None = None  # the optimizer state read ahead, until the first step
        path = self.init_checkpoint_path
        self._ds_resume = (
            Path(path)
            if path is not None and check_path_is_local(path) and layout.is_datastates_checkpoint(path)
            else None
        )
        if self._ds_active or self._ds_resume is not None:
            groups.check(self.parallel_context)  # at start-up, not at the first checkpoint
        self._ds_last_step: int | None = None  # the step of the last checkpoint asked for
        if self._ds_resume is not None:
            self._ds_manifest = layout.read_manifest(self._ds_resume)
            ck = self.config.checkpoints
            # Nanotron's loaders read pickles: ours run once Nanotron has built the optimizer and scheduler.
            self._ds_load_flags = (ck.load_optimizer, ck.load_lr_scheduler)
            ck.load_optimizer = ck.load_lr_scheduler = False
            self._ds_prefetch = self._ds_start_prefetch()

    def _ds_start_prefetch(self) -> Prefetch | None:
        """Starts reading this rank's files onto its GPU while Nanotron builds the model: the optimizer shard,
        and the weight files where this rank reads them all (no tensor or pipeline parallelism: before the
        model exists, which files another layout needs is not known). None where nothing is read ahead."""
        if not torch.cuda.is_available() or self._ds_topology_changes():
            return None
        pc, root = self.parallel_context, self._ds_resume
        optimizer = None
        if self._ds_load_flags[0]:
            zero = int(self.config.optimizer.zero_stage) > 0  # Nanotron builds a ZeRO optimizer for stage > 0
            optimizer = shards.optimizer_file(pc, root, zero=zero)
        weights = []
        if pc.tp_pg.size() == 1 and pc.pp_pg.size() == 1 and pc.expert_parallel_size == 1:
            weights = layout.weight_files(self._ds_manifest, root)
        if optimizer is None and not weights:
            return None
        device = torch.device("cuda", torch.cuda.current_device())
        ahead, self._ds_early = self._ds_early, None
        if ahead is not None and ahead.matches(root, weights, optimizer, device):
            self._ds_read_early = True
            return ahead.prefetch
        small = [shards.random_states_path(pc, root), root / CHECKPOINT_FILE_NAME]
        if self._ds_load_flags[1]:
            small.append(shards.lr_scheduler_path(self.config.optimizer.zero_stage, pc, root, writing=False))
        warm_page_cache(small)  # first, while the disk is idle
        return Prefetch(
            self._ds_get_engine(),
            device,
            weights,
            optimizer,
            lambda path: layout.file_checksums(self._ds_manifest, root, path),
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ds_early = early.start(args, kwargs)  # before Nanotron sets up its process groups
        super().__init__(*args, **kwargs)
        self._ds_early = None  # not adopted (nothing to resume here after all): its buffers go back
        if self._ds_resume is not None:
            t0 = time.perf_counter()
            self._ds_restore_rest()
            elapsed = time.perf_counter() - t0
            what = "scheduler" if self._ds_deferred is not None else "optimizer, scheduler"
            self._ds_log(f"resumed {what}, metadata and random states in {elapsed:.2f} s")
        if self._ds_active:
            self._ds_start()
        elif self._ds_engine is not None:  # used only to resume
            self._ds_engine.close()
            self._ds_engine = None

    @property
    def _ds_active(self) -> bool:
        return bool(getattr(self.config, "uses_datastates", False))

    @property
    def _ds_config(self) -> DataStatesConfig:
        """The `datastates:` section, or the defaults where the YAML has none."""
        cfg = getattr(self.config, "datastates", None)
        return cfg if isinstance(cfg, DataStatesConfig) else DataStatesConfig()

    def _ds_get_engine(self) -> DataStatesEngine:
        if self._ds_engine is None:
            self._ds_engine = DataStatesEngine(self._ds_config)
        return self._ds_engine

    def _load_model_checkpoint(self, model: Any) -> Any:
        if self._ds_resume is None:
            return super()._load_model_checkpoint(model)
        unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        t0 = time.perf_counter()
        sources = shards.weight_sources(unwrapped, self.parallel_context, self._ds_resume)
        if sources is None:  # another topology: Nanotron merges and reshards (the files are its own format)
            from nanotron.serialize import load_weights

            self.param_shard_metadata = load_weights(unwrapped, self.parallel_context, self._ds_resume)
            self._ds_log("topology changed: weights loaded by Nanotron's load_weights")
            return model
        engine = self._ds_get_engine()
        ahead = self._ds_prefetch.weights() if self._ds_prefetch is not None else {}

        def read(source: tuple[str, torch.Tensor, Path]) -> None:
            _, tensor, path = source
            got = ahead.get(path, {}).get("data")
            with torch.no_grad():
                if got is not None and got.shape == tensor.shape and got.dtype == tensor.dtype:
                    tensor.copy_(got)  # read ahead onto the GPU: a device-to-device copy
                    return
                sums = layout.file_checksums(self._ds_manifest, self._ds_resume, path)
                engine.load_into(path, {"data": tensor}, checksums=sums)

        workers = max(1, engine.config.parser_threads)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="datastates-load") as pool:
            list(pool.map(read, sources))
        ahead.clear()  # their memory goes back (the caching allocator keeps it until the copies are done)
        self.param_shard_metadata = {name: {} for name, _, _ in sources}
        self._ds_log(f"loaded {len(sources)} weight files in {time.perf_counter() - t0:.2f} s")
        return model

    def _ds_restore_rest(self) -> None:
        root, pc, engine = self._ds_resume, self.parallel_context, self._ds_get_engine()
        load_optimizer, load_lr_scheduler = self._ds_load_flags
        if load_optimizer or load_lr_scheduler:
            changed = self._ds_topology_changes()
            if changed:
                raise NotImplementedError(
                    f"{root} was written with another parallel layout ({changed}); datastates optimizer "
                    "and scheduler shards resume on the same layout only (the weights reshard): set "
                    "checkpoints.load_optimizer and checkpoints.load_lr_scheduler to false to resume the "
                    "weights"
                )
        if load_optimizer:
            path = shards.optimizer_path(self.optimizer, pc, root, writing=False)
            # Straight onto the GPU through the pinned cache (Nanotron's loader reads them onto the CPU and
            # its first step copies them over from pageable memory). Nanotron's `load_optimizer` flag stays
            # off until the first step has run, so that step does not try to move them again.
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self._ds_optimizer_flag_held = device is not None
            if self._ds_prefetch is not None and self._ds_prefetch.reads_optimizer:
                # Read ahead: loaded at the first optimizer step, so that the read overlaps the rest of the
                # set-up and the first forward and backward passes too.
                load = functools.partial(self._ds_load_optimizer, path, device)  # `path` is reused below
                self._ds_deferred = DeferredLoad(self.optimizer, load)
            else:
                self._ds_load_optimizer(path, device)
        if load_lr_scheduler:
            path = shards.lr_scheduler_path(self.config.optimizer.zero_stage, pc, root, writing=False)
            # Unlike Nanotron's loader, no `_initial_step()` after this: it steps the schedule once more, so
            # the resumed run would use the next step's learning rate. The optimizer's param groups, restored
            # above, already hold the rate the original run would use now.
            self.lr_scheduler.load_state_dict(engine.load(path))
            self.metadata = load_meta(parallel_context=pc, root_folder=root).metas
            if self.config.tokens.train_steps <= self.metadata.last_train_step:
                raise ValueError(
                    f"the checkpoint has already trained {self.metadata.last_train_step} steps; set "
                    "tokens.train_steps higher"
                )
            self.iteration_step = self.metadata.last_train_step
        path = shards.random_states_path(pc, root)
        if path.exists():
            saved = engine.load(path)
            for key, value in saved["nanotron"].items():
                self.random_states[key] = states.random_state_from_plain(
                    value
                )  # in place: the model holds them
            if "global" in saved:  # absent from checkpoints converted from Nanotron's layout
                states.set_global_rng_state(saved["global"])
        if self._ds_deferred is None:
            self._ds_drop_prefetch()
        ck = self.config.checkpoints
        ck.load_optimizer = load_optimizer and not self._ds_optimizer_flag_held
        ck.load_lr_scheduler = load_lr_scheduler

    def _ds_load_optimizer(self, path: Path, device: torch.device | None) -> None:
        """Loads this rank's optimizer shard: the one read ahead if it is there, else read now."""
        t0 = time.perf_counter()
        state = self._ds_prefetch.optimizer(path) if self._ds_prefetch is not None else None
        if state is None:  # not read ahead, or (were Nanotron to change) not the optimizer's file
            state = self._ds_get_engine().load(path, device or "cpu")
        self.optimizer.load_state_dict(state, map_location=device or "cpu")
        if self._ds_deferred is not None:
            waited = time.perf_counter() - t0
            self._ds_log(f"optimizer state loaded at its first use ({waited:.2f} s waiting for the read)")
        self._ds_drop_prefetch()

    def _ds_drop_prefetch(self) -> None:
        if self._ds_prefetch is not None:
            since = "the trainer's start" if self._ds_read_early else "the process groups were set up"
            self._ds_log(f"read ahead, since {since}: {self._ds_prefetch.report()}")
        self._ds_prefetch = None  # whatever was read ahead and not used goes back

    def _ds_topology_changes(self) -> dict[str, tuple[Any, int]]:
        return layout.topology_changes(self._ds_manifest.get("topology", {}), self._ds_topology())

    def _ds_topology(self) -> dict[str, int]:
        return groups.layout_of(self.parallel_context, int(self.config.optimizer.zero_stage))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self._ds_optimizer_flag_held:
            self._ds_optimizer_flag_held = False
            self.config.checkpoints.load_optimizer = self._ds_load_flags[0]
        if not self._ds_pinning and self._ds_active and self._ds_engine is not None:
            self._ds_pinning = True
            plans = self._ds_file_plans()  # the optimizer state exists from the first step on
            self._ds_checkpoint_bytes = sum(plan.nbytes for plan in plans)
            self._ds_pin_ahead([plan.nbytes for plan in plans])
            self._ds_prepare_staging(plans)
        return out

    def _ds_pin_ahead(self, sizes: list[int]) -> None:
        """Pins, in the background, the host cache chunks a checkpoint of this rank will use: after the first
        step (pinning stalls other CUDA calls: 8 GiB pinned at start took the first step from 0.97 to 2.99 s
        on an H100), and no more than a checkpoint fills (each file takes whole chunks), so that the first
        checkpoint finds them ready. Chunks beyond are pinned by their first use."""
        engine = self._ds_engine
        chunk = engine.cache_stats()["chunk_bytes"]
        chunks = sum(-(-size // chunk) for size in sizes) + 2  # + the scheduler's and random states' files
        engine.prepare_cache(wait=False, nbytes=chunks * chunk)

    def _ds_prepare_staging(self, plans: list[SavePlan]) -> None:
        """Where checkpoints will be staged on the GPU, what the first staging would pay for once is paid
        after the first step instead: a buffer of the checkpoint's size is allocated and freed, so that
        torch's allocator holds it (a 2.2 GB cudaMalloc took 20 ms on an H100; the allocator hands it back
        to training should training run short), and the staging copy runs once per dtype, so that its
        kernels are loaded (CUDA loads them lazily, at their first launch)."""
        if not self._ds_expect_staged():
            return
        nbytes = staged_nbytes(plans) + (2 << 20)  # + the scheduler's and random states' files, planned later
        torch.empty_strided((nbytes,), (1,), dtype=torch.uint8, device="cuda")
        for dtype in {a.dtype for p in plans for a in p.arrays if a.is_cuda}:
            src = torch.zeros(2, dtype=dtype, device="cuda")
            copy_many([torch.empty_like(src)], [src])

    def _ds_file_plans(self) -> list[SavePlan]:
        """Plans of this rank's weight files and optimizer file, as of now."""
        plans = [plan for _, plan in self._ds_planned_files().weights]  # planned once, used at saves
        plans.append(self._ds_engine.plan(self.optimizer.state_dict()))
        return plans

    def _ds_expect_staged(self) -> bool:
        """Whether the checkpoint asked for now will be copied on the GPU first (decided where it is queued):
        as the last one was; the first, as the staging rule says of its size now. Staged checkpoints are
        queued at the next step; the others now."""
        if self._ds_staged is None:
            nbytes = self._ds_checkpoint_bytes
            if nbytes is None:  # asked for before the first step ended
                nbytes = sum(plan.nbytes for plan in self._ds_file_plans())
            stage, _ = staging.decide(self._ds_config.device_snapshot, nbytes)
            return stage
        return self._ds_staged

    # -- saving ---------------------------------------------------------------------------------------------

    def _ds_start(self) -> None:
        engine = self._ds_get_engine()
        # A gloo group of its own: the committer's collectives run on a background thread, off the GPU.
        group = tdist.new_group(backend="gloo") if tdist.is_initialized() else None
        self._ds_committer = Committer(group, on_result=self._ds_report)
        self._ds_gate.guard(self.optimizer)
        atexit.register(self._ds_close)
        self._ds_log(
            f"checkpointing with the datastates engine: {engine.config.host_cache_size} GiB host cache "
            f"({'pinned' if engine.pinned else 'not pinned'}), io {engine.io_backend}"
        )

    def save_checkpoint(self) -> Path:
        if not self._ds_active:
            return super().save_checkpoint()
        t0 = time.perf_counter()
        # Backpressure, identical on every rank: the oldest checkpoint in flight must be done first (and one
        # still waiting for a step, none having run since it was asked for, is queued before this one).
        self._ds_take(self._ds_outstanding - (MAX_IN_FLIGHT - 1))
        self.pre_save_checkpoint()
        step = self.iteration_step
        folder = Path(self.config.checkpoints.checkpoints_path) / str(step)
        if step == self._ds_last_step:
            # Nanotron's final save (`save_final_state`, on by default on main) after the interval's save of
            # the same step: the same state, already on its way.
            self._ds_log(f"checkpoint {step} already asked for: not written again")
            return folder
        self._ds_last_step = step
        self.config.general.step = self.metadata.last_train_step
        self.config.general.consumed_train_samples = self.metadata.consumed_train_samples
        pc, engine = self.parallel_context, self._ds_engine
        log_rank(f"Saving checkpoint at {folder} (datastates)", logger=logger, level=logging.INFO, rank=0)

        # What the next forward and backward passes change (the random states, the schedule's and the
        # metadata's plain values) is captured now; the weights and the optimizer state may wait for the step.
        files = self._ds_planned_files()
        random_state = {
            "nanotron": {k: states.random_state_to_plain(v) for k, v in self.random_states.items()},
            "global": states.global_rng_state(),
        }
        later: list[tuple[Path, SavePlan]] = []
        if files.lr_scheduler is not None:
            later.append((files.lr_scheduler, engine.plan(self.lr_scheduler.state_dict())))
        later.append((files.random, engine.plan(random_state)))
        finalize = self._ds_finalizer(folder, step) if dist.get_rank(pc.world_pg) == 0 else None
        pending = PendingCheckpoint(step, folder, [], finalize)
        self._ds_outstanding += 1
        if self._ds_config.queue_at_step and self._ds_expect_staged():
            self._ds_gate.defer(functools.partial(self._ds_queue, pending, files, later, deferred=True))
        else:  # unstaged copies must start now, to overlap the forward and backward passes
            self._ds_queue(pending, files, later, deferred=False)
        pending.stall_s += time.perf_counter() - t0
        return folder

    def _ds_queue(
        self, pending: PendingCheckpoint, files: _Files, later: list[tuple[Path, SavePlan]], *, deferred: bool
    ) -> None:
        """Plans the optimizer state, queues every file of the checkpoint and hands it to the committer, which
        is told of any failure here: every rank's committer then agrees that the checkpoint failed."""
        t0 = time.perf_counter()
        try:
            todo = list(files.weights)
            if files.optimizer is not None:
                todo.append((files.optimizer, self._ds_engine.plan(self.optimizer.state_dict())))
            pending.handles = self._ds_submit(pending.folder, todo + later)
            on_wait = functools.partial(self._ds_add_stall, pending)
            self._ds_gate.add(pending.handles, on_wait=on_wait)
        except Exception as e:  # reported at the next checkpoint or the end, as a failed write would be
            pending.errors.append(f"queuing its files failed: {e!r}")
            log_rank(f"[datastates] checkpoint {pending.step}: {pending.errors[-1]}", logger=logger,
                     level=logging.ERROR)  # fmt: skip
        if deferred:
            pending.queued_s = time.perf_counter() - t0
        self._ds_committer.submit(pending)

    @staticmethod
    def _ds_add_stall(pending: PendingCheckpoint, seconds: float) -> None:
        pending.stall_s += seconds

    def _ds_planned_files(self) -> _Files:
        """This rank's files: the same files and weight tensors at every checkpoint, so planned once."""
        if self._ds_files is None:
            pc, engine = self.parallel_context, self._ds_engine
            weights = shards.weight_shards(self.unwrapped_model, pc, Path())
            self._ds_files = _Files(
                weights=[
                    (path, engine.plan({"data": param}, metadata=md, exact_metadata=True))
                    for path, param, md in weights
                ],  # fmt: skip
                optimizer=shards.optimizer_path(self.optimizer, pc, Path(), writing=True),
                lr_scheduler=shards.lr_scheduler_path(
                    self.config.optimizer.zero_stage, pc, Path(), writing=True
                ),
                random=shards.random_states_path(pc, Path()),
            )
        return self._ds_files

    def _ds_submit(self, folder: Path, todo: list[tuple[Path, SavePlan]]) -> list[Any]:
        """Queues every file; staged on the GPU (all of them together, so the optimizer step waits for none)
        where `device_snapshot` says so, else, or if staging runs out of memory, straight from the state."""
        engine = self._ds_engine
        stage, why = staging.decide(self._ds_config.device_snapshot, sum(p.nbytes for _, p in todo))
        if stage != self._ds_staged:
            self._ds_staged = stage
            self._ds_log(f"checkpoints {'' if stage else 'not '}copied on the GPU first ({why})")
        files = [(plan, folder / path) for path, plan in todo]
        if stage:
            try:
                return engine.save_plans(files, stage=True)
            except torch.cuda.OutOfMemoryError:
                self._ds_staged = False
                self._ds_log("out of GPU memory copying a checkpoint on the GPU: it is copied from the state "
                             "itself")  # fmt: skip
        return engine.save_plans(files)

    def _ds_finalizer(self, folder: Path, step: int) -> Any:
        """Rank 0's commit, with every text captured now (training moves on while the files are flushed)."""
        pc = self.parallel_context
        # Now: its data stages keep counting while the files are flushed.
        meta_text = shards.checkpoint_metadata_text(pc, self.metadata)
        config_doc = copy.deepcopy(serialize(self.config))  # dumping it (ms) is left to the committer
        if hasattr(self.model_config, "to_json_string"):
            model_config_text = self.model_config.to_json_string()
        else:
            model_config_text = json.dumps(dataclasses.asdict(self.model_config))
        optimizer_text = json.dumps(shards.optimizer_config(self.optimizer, pc))
        topology = self._ds_topology()
        checkpoints = Path(self.config.checkpoints.checkpoints_path)

        def finalize(files: dict[str, Any]) -> None:
            layout.write_atomic(folder / "config.yaml", yaml.dump(config_doc))
            layout.write_atomic(folder / MODEL_CONFIG_FILE_NAME, model_config_text)
            layout.write_atomic(folder / "optimizer" / "optimizer_config.json", optimizer_text)
            layout.write_atomic(folder / CHECKPOINT_FILE_NAME, meta_text)
            layout.write_atomic(
                folder / layout.MANIFEST, json.dumps(layout.manifest(step, topology, files), indent=1)
            )
            # Several jobs (or a pruning tool) may share the folder: latest.txt only moves under the lock.
            with fasteners.InterProcessLock(str(checkpoints / housekeeping.LOCK)):
                layout.write_atomic(checkpoints / layout.LATEST, str(step))

        return finalize

    # -- synchronization points -----------------------------------------------------------------------------

    def _ds_take(self, count: int) -> None:
        """Waits for the outcome of the `count` oldest checkpoints in flight (the same ones on every rank),
        runs the post-save hooks of those committed, and raises CheckpointError for one that failed. First
        queues any checkpoint still waiting for a step, even when nothing is waited for."""
        self._ds_gate.run_deferred()
        if count <= 0 or self._ds_committer is None:
            return
        results = self._ds_committer.take(count)
        self._ds_outstanding -= len(results)
        failed = [r for r in results if not r.committed]
        for r in results:
            if r.committed:
                self._ds_post_save(r.step)
        if failed:
            r = failed[0]
            raise CheckpointError(
                f"checkpoint {r.step} at {r.folder} was not committed (latest.txt still names the previous "
                "one): " + "; ".join(r.errors)
            )

    def _ds_post_save(self, step: int) -> None:
        """Nanotron's post-save hooks (S3 upload; on main, lighteval too) for a checkpoint now committed. They
        read the checkpoint's step from `iteration_step` and `config.general.step`, which have moved on since
        it was asked for: both are set to its step while they run."""
        now = self.iteration_step, self.config.general.step
        self.iteration_step = self.config.general.step = step
        try:
            self.post_save_checkpoint()
        finally:
            self.iteration_step, self.config.general.step = now

    def post_training(self) -> None:
        if self._ds_active and self._ds_committer is not None:
            t0 = time.perf_counter()
            self._ds_take(self._ds_outstanding)
            self._ds_log(f"all checkpoints committed ({time.perf_counter() - t0:.2f} s waiting at the end)")
            self._ds_close()
        super().post_training()

    def _ds_close(self) -> None:
        if self._ds_committer is not None:
            self._ds_gate.run_deferred()  # a checkpoint asked for after the last step
            try:  # bounded: at exit after a crash, other ranks may be gone
                self._ds_committer.take(self._ds_outstanding, timeout=600)
            except TimeoutError as e:
                log_rank(f"[datastates] {e}; exiting anyway", logger=logger, level=logging.ERROR, rank=0)
            self._ds_outstanding = 0
            self._ds_committer.close()
            self._ds_committer = None
        if self._ds_engine is not None:
            self._ds_engine.close()
            self._ds_engine = None

    def _ds_report(self, r: CommitResult) -> None:
        """On the committer thread, for every checkpoint: the log line; on rank 0, rotation, removal of stale
        temporaries and the telemetry line."""
        if dist.get_rank(self.parallel_context.world_pg) == 0:
            try:
                self._ds_housekeeping(r)
            except Exception as e:  # never fatal: the checkpoint itself is committed (or reported failed)
                log_rank(f"[datastates] after checkpoint {r.step}: {e!r}", logger=logger, level=logging.ERROR,
                         rank=0)  # fmt: skip
        if r.committed:
            queued = f" (queued at the next step in {1e3 * r.queued_s:.1f} ms)" if r.queued_s else ""
            msg = (
                f"[datastates] checkpoint {r.step}: {r.bytes / 1e9:.2f} GB in {r.files} files, training "
                f"stall {1e3 * r.stall_s:.1f} ms{queued}, snapshot {1e3 * r.snapshot_s:.1f} ms, persisted "
                f"{r.persisted_s:.2f} s, committed {r.committed_s:.2f} s ({r.gbps:.2f} GB/s)"
            )
            log_rank(msg, logger=logger, level=logging.INFO, rank=0)
        else:
            log_rank(
                f"[datastates] checkpoint {r.step} NOT committed: {'; '.join(r.errors)}",
                logger=logger,
                level=logging.ERROR,
                rank=0,
            )

    def _ds_housekeeping(self, r: CommitResult) -> None:
        cfg, engine = self._ds_config, self._ds_engine
        root = Path(self.config.checkpoints.checkpoints_path)
        removed: list[Path] = []
        if r.committed:
            housekeeping.remove_temporaries(r.folder)
            # With an S3 upload hook, keep at least 2: a hook runs at the next checkpoint, after this one.
            removed = housekeeping.rotate(root, cfg.keep_last_n, r.step)
        if cfg.telemetry:
            cache = engine.cache_stats(reset=True) if engine is not None else {}
            housekeeping.append_telemetry(root, housekeeping.telemetry_record(r, cache, removed))

    def _ds_log(self, msg: str) -> None:
        log_rank(f"[datastates] {msg}", logger=logger, level=logging.INFO, rank=0)
