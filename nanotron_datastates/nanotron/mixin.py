"""DataStatesTrainerMixin: Nanotron's DistributedTrainer, checkpointing through the DataStates engine.

A dispatcher: each of Nanotron's hooks below hands over to the object that owns the mechanism, in the order
Nanotron calls them. `Resume` (resume.py) resumes a checkpoint that has a manifest, whatever
`checkpointing_engine` says (any other checkpoint is left to Nanotron); `Saver` (saver.py) takes every
checkpoint with `checkpointing_engine: torch` replaced by `datastates`. With `torch` and no such checkpoint to
resume, the trainer is Nanotron's, unchanged.

    __init__             Resume.start: read ahead from the first line        (then Nanotron's __init__:)
      pre_init           Resume.plan: ours to resume? which files; Nanotron's pickle loaders off
      _load_model_...    Resume.load_weights
                         Resume.load_rest (scheduler, metadata, random states; optimizer now or deferred)
                         Resume.confirm: every rank read it whole, or all fall back to an older one
                         Saver: made; Saver.start (the weights' cache chunks pinned in the
                         background while Nanotron builds its data loader); `optimizer.step` wrapped, once
    optimizer.step       Resume.before_step (the deferred optimizer load), Saver.before_step (snapshots);
                         once the step is launched, Saver.after_step (what was captured before it, queued)
    training_step        after the first: Resume.finish, Saver.after_first_step (plan, pin, warm staging)
    save_checkpoint      Saver.backpressure, Saver.request (capture now, queue now or at the next step)
    _update_dataloader_based_on_training_stages  (each iteration's first call, after the last one's
                         save_checkpoint) where a memory checkpoint is due: memory_pace.skips (two in
                         flight: skipped, on every rank), else Saver.request(memory=...)
    post_training        Saver.drain (every commit, post-save hooks), close
"""

from __future__ import annotations

import atexit
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import groups
from . import log as say
from .resume.resume import Resume
from .save import memory_pace
from .save.commit_files import finalizer, memory_documents
from .save.saver import Saver
from .yaml_config import engine_for, settings_of

if TYPE_CHECKING:  # for type checkers: the mixin's attributes and hooks are those of Nanotron's trainer
    from nanotron.trainer import DistributedTrainer as _Trainer
else:
    _Trainer = object


class DataStatesTrainerMixin(_Trainer):
    """Mix in before Nanotron's trainer: ``class T(DataStatesTrainerMixin, DistributedTrainer)``.

    `trainer.datastates` is the Saver while checkpoints go through the engine (None otherwise): append to its
    `observers` to be told of each queuing and commit."""

    datastates: Saver | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ds_resume = Resume.start(args, kwargs)  # before Nanotron sets up its process groups
        self._ds_stepped = False
        super().__init__(*args, **kwargs)
        if self._ds_resume.active:
            self._ds_resume.load_rest(
                self.optimizer, self.lr_scheduler, self.random_states, self.unwrapped_model
            )
            metadata = self._ds_resume.confirm()  # every rank read it whole, or all fell back together
            if metadata is not None:
                self.metadata, self.iteration_step = metadata, metadata.last_train_step
        if getattr(self.config, "uses_datastates", False):
            engine = self._ds_resume.engine or engine_for(self.config)
            checkpoints = Path(self.config.checkpoints.checkpoints_path)
            self.datastates = Saver(
                engine,
                settings_of(self.config),
                self.parallel_context,
                self.unwrapped_model,
                self.optimizer,
                checkpoints,
            )
            self.datastates.start()  # while Nanotron builds its data loader
            atexit.register(self._ds_close)
        if self._ds_resume.active or self.datastates is not None:
            self._ds_wrap_step()

    def pre_init(self) -> None:
        super().pre_init()  # Nanotron resolves the checkpoint to resume from
        if getattr(self.config, "uses_datastates", False):
            groups.check(self.parallel_context)  # at start-up, not at the first checkpoint
        found: Path | None = getattr(self, "init_checkpoint_path", None)
        if self._ds_resume.plan(self.config, self.parallel_context, found):
            self.init_checkpoint_path = self._ds_resume.folder  # a memory checkpoint's, where newer

    def _load_model_checkpoint(self, model: Any) -> Any:
        if not self._ds_resume.active:
            return super()._load_model_checkpoint(model)
        unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.param_shard_metadata = self._ds_resume.load_weights(unwrapped)
        return model

    def _ds_wrap_step(self) -> None:
        """The one wrapper around `optimizer.step` (on this instance; its class is untouched)."""
        original = self.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._ds_resume.before_step()
            saver = self.datastates
            if saver is not None:
                saver.before_step()
            try:
                return original(*args, **kwargs)
            finally:
                if saver is not None:
                    saver.after_step()

        step.__wrapped__ = original  # type: ignore[attr-defined]
        self.optimizer.step = step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if not self._ds_stepped:
            self._ds_stepped = True
            self._ds_resume.finish(close_engine=self.datastates is None)
            if self.datastates is not None:
                self.datastates.after_first_step()  # the optimizer state exists from the first step on
        return out

    def save_checkpoint(self) -> Path:
        saver = self.datastates
        if saver is None:
            return super().save_checkpoint()
        t0 = time.perf_counter()
        saver.backpressure(self._ds_post_save)
        self.pre_save_checkpoint()
        step = self.iteration_step
        folder = saver.checkpoints / str(step)
        if step == saver.last_step:
            # Nanotron's final save (`save_final_state`, on by default on main) after the interval's save of
            # the same step: the same state, already on its way.
            say.info(f"checkpoint {step} already asked for: not written again")
            return folder
        self.config.general.step = self.metadata.last_train_step
        self.config.general.consumed_train_samples = self.metadata.consumed_train_samples
        say.info(f"saving checkpoint {folder}")
        commit = None
        if groups.rank(self.parallel_context.world_pg) == 0:  # made when the files are queued
            commit = functools.partial(
                finalizer,
                step=step,
                checkpoints=saver.checkpoints,
                pc=self.parallel_context,
                config=self.config,
                model_config=self.model_config,
                optimizer=self.optimizer,
                metadata=self.metadata,
                replicas=saver.placement,
            )
        saver.request(step, self.lr_scheduler, self.random_states, commit, since=t0)
        return folder

    def _update_dataloader_based_on_training_stages(self, *args: Any, **kwargs: Any) -> Any:
        if self.datastates is not None and self._ds_stepped:  # the state after the last iteration
            self._ds_memory_checkpoint(self.datastates)
        return super()._update_dataloader_based_on_training_stages(*args, **kwargs)

    def _ds_memory_checkpoint(self, saver: Saver) -> None:
        """A checkpoint into node memory only, where `memory_interval` makes one due: the step the metadata
        has counted, as `save_checkpoint` would have taken it at the end of the last iteration."""
        step = self.metadata.last_train_step
        if not saver.memory_due(step):
            return
        t0 = time.perf_counter()
        if memory_pace.skips(saver, step, self._ds_post_save):  # never waited for: the next one is taken
            return
        documents = memory_documents(
            step=step,
            pc=self.parallel_context,
            config=self.config,
            metadata=self.metadata,
            replicas=saver.placement,
        )
        saver.request(step, self.lr_scheduler, self.random_states, None, since=t0, memory=documents)

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
        if self.datastates is not None:
            self.datastates.drain(self._ds_post_save)
            self._ds_close()
        super().post_training()

    def _ds_close(self) -> None:
        saver, self.datastates = self.datastates, None
        if saver is not None:
            saver.close()
            saver.engine.close()
