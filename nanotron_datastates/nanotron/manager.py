"""CheckpointManager: one trainer's checkpointing through the engine, from its first line to its last.

It owns the resume (`Resume`: a checkpoint with a manifest, whatever `checkpointing_engine` says; any other
is left to Nanotron), the saves (`Saver`: staging, the optimizer step's gate, queuing, commit, housekeeping,
the memory tier and its replicas) with `checkpointing_engine: datastates`, the memory checkpoints of
`memory_interval`, and Nanotron's post-save hooks once each checkpoint is committed. The trainer mixin
(mixin.py) calls one of its methods from each of Nanotron's hooks, in the order Nanotron calls them:

    before_init          the trainer's first line: Resume.start reads ahead (then Nanotron's __init__:)
      pre_init           Resume.plan: ours to resume? which files; Nanotron's pickle loaders off
      load_weights       Resume.load_weights, where Nanotron loads its weights
    after_init           Resume.load_rest, Resume.confirm; the Saver made and started (the weights' cache
                         chunks pinned while Nanotron builds its data loader); `optimizer.step` wrapped:
                         Resume.before_step, Saver.before_step (the snapshot's gate), Saver.after_step
    after_training_step  after the first: Resume.finish, Saver.after_first_step (plan, pin, warm staging)
    save                 save_checkpoint: Saver.backpressure, Saver.request (captured now, queued now or
                         at the next step), rank 0's commit of Nanotron's files made ready
    memory_checkpoint    each iteration's first call, after the last one's save_checkpoint: a memory
                         checkpoint where `memory_interval` makes one due (memory_pace.skips while two are
                         in flight, on every rank)
    finish               post_training: Saver.drain (every commit, post-save hooks), close
"""

from __future__ import annotations

import atexit
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from . import groups
from . import log as say
from .resume.resume import Resume
from .save import memory_pace
from .save.commit_files import finalizer, memory_documents
from .save.saver import Saver
from .yaml_config import engine_for, settings_of

if TYPE_CHECKING:
    from .types import DistributedTrainer, FileEntries


class CheckpointManager:
    """A trainer's resume and saves (see the module's docstring for the order of calls). `saver` is None where
    checkpoints are Nanotron's own; append to `saver.observers` to be told of each queuing and commit."""

    def __init__(self, trainer: DistributedTrainer, resume: Resume, saver: Saver | None = None) -> None:
        self.trainer = trainer
        self.resume = resume
        self.saver = saver
        self.stepped = False  # the first training step is done: the optimizer state exists

    @classmethod
    def before_init(
        cls, trainer: DistributedTrainer, args: Sequence[object], kwargs: dict[str, object]
    ) -> CheckpointManager:
        """The trainer's first line, before Nanotron sets up its process groups: the read-ahead started."""
        return cls(trainer, Resume.start(args, kwargs))

    # -- the trainer's construction ----------------------------------------------------------------------

    def pre_init(self) -> None:
        """After Nanotron's `pre_init` has resolved the checkpoint to resume from."""
        t = self.trainer
        if getattr(t.config, "uses_datastates", False):
            groups.check(t.parallel_context)  # at start-up, not at the first checkpoint
        found: Path | None = getattr(t, "init_checkpoint_path", None)
        if self.resume.plan(t.config, t.parallel_context, found):
            t.init_checkpoint_path = self.resume.folder  # a memory checkpoint's, where newer

    @property
    def resuming(self) -> bool:
        """Whether the resume is ours (else Nanotron loads its own checkpoint)."""
        return self.resume.active

    def load_weights(self, model: torch.nn.Module) -> None:
        unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.trainer.param_shard_metadata = self.resume.load_weights(unwrapped)

    def after_init(self) -> None:
        """The end of Nanotron's `__init__`: the rest of the resume, then the Saver."""
        t = self.trainer
        if self.resume.active:
            self.resume.load_rest(t.optimizer, t.lr_scheduler, t.random_states, t.unwrapped_model)
            metadata = self.resume.confirm()  # every rank read it whole, or all fell back together
            if metadata is not None:
                t.metadata, t.iteration_step = metadata, metadata.last_train_step
        if getattr(t.config, "uses_datastates", False):
            engine = self.resume.engine or engine_for(t.config)
            checkpoints = Path(t.config.checkpoints.checkpoints_path)
            settings = settings_of(t.config)
            self.saver = Saver(
                engine, settings, t.parallel_context, t.unwrapped_model, t.optimizer, checkpoints
            )
            self.saver.start()  # while Nanotron builds its data loader
            atexit.register(self.close)
        if self.resume.active or self.saver is not None:
            self._wrap_step(t.optimizer)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The one wrapper around `optimizer.step` (on this instance; its class is untouched)."""
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.resume.before_step()
            saver = self.saver
            if saver is not None:
                saver.before_step()
            try:
                return original(*args, **kwargs)
            finally:
                if saver is not None:
                    saver.after_step()

        step.__wrapped__ = original  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]

    # -- training ----------------------------------------------------------------------------------------

    def after_training_step(self) -> None:
        if self.stepped:
            return
        self.stepped = True
        self.resume.finish(close_engine=self.saver is None)
        if self.saver is not None:
            self.saver.after_first_step()  # the optimizer state exists from the first step on

    def save(self, saver: Saver) -> Path:
        """Nanotron's `save_checkpoint`: the checkpoint of the trainer's step asked for; its folder."""
        t = self.trainer
        t0 = time.perf_counter()
        saver.backpressure(self.post_save)
        t.pre_save_checkpoint()
        step = t.iteration_step
        folder = saver.checkpoints / str(step)
        if step == saver.last_step:
            # Nanotron's final save (`save_final_state`, on by default on main) after the interval's save of
            # the same step: the same state, already on its way.
            say.info(f"checkpoint {step} already asked for: not written again")
            return folder
        t.config.general.step = t.metadata.last_train_step
        t.config.general.consumed_train_samples = t.metadata.consumed_train_samples
        say.info(f"saving checkpoint {folder}")
        commit: Callable[[], Callable[[FileEntries], None]] | None = None
        if groups.rank(t.parallel_context.world_pg) == 0:  # made when the files are queued
            commit = functools.partial(
                finalizer,
                step=step,
                checkpoints=saver.checkpoints,
                pc=t.parallel_context,
                config=t.config,
                model_config=t.model_config,
                optimizer=t.optimizer,
                metadata=t.metadata,
                replicas=saver.placement,
            )
        saver.request(step, t.lr_scheduler, t.random_states, commit, since=t0)
        return folder

    def memory_due(self) -> int | None:
        """The step a memory checkpoint is due for now (`memory_interval`): the step the metadata has
        counted, as `save` would have taken it at the end of the last iteration; None: none is due."""
        saver = self.saver
        if saver is None or not self.stepped:  # before the first step: the state resumed, not trained
            return None
        step = self.trainer.metadata.last_train_step
        return step if saver.memory_due(step) else None

    def memory_checkpoint(self) -> None:
        """A checkpoint into node memory only, where one is due (`memory_due`)."""
        t, saver, step = self.trainer, self.saver, self.memory_due()
        if saver is None or step is None:
            return
        t0 = time.perf_counter()
        if memory_pace.skips(saver, step, self.post_save):  # never waited for: the next one is taken
            return
        documents = memory_documents(
            step=step,
            pc=t.parallel_context,
            config=t.config,
            metadata=t.metadata,
            replicas=saver.placement,
        )
        saver.request(step, t.lr_scheduler, t.random_states, None, since=t0, memory=documents)

    def post_save(self, step: int) -> None:
        """Nanotron's post-save hooks (S3 upload; on main, lighteval too) for a checkpoint now committed. They
        read the checkpoint's step from `iteration_step` and `config.general.step`, which have moved on since
        it was asked for: both are set to its step while they run."""
        t = self.trainer
        now = t.iteration_step, t.config.general.step
        t.iteration_step = t.config.general.step = step
        try:
            t.post_save_checkpoint()
        finally:
            t.iteration_step, t.config.general.step = now

    # -- the end -----------------------------------------------------------------------------------------

    def finish(self) -> None:
        """`post_training`: every checkpoint committed (its post-save hooks run), the engine closed."""
        if self.saver is not None:
            self.saver.drain(self.post_save)
            self.close()

    def close(self) -> None:
        saver, self.saver = self.saver, None
        if saver is not None:
            saver.close()
            saver.engine.close()
