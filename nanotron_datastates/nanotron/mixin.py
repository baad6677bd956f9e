"""DataStatesTrainerMixin: Nanotron's DistributedTrainer, checkpointing through the DataStates engine.

Hooks alone: each of Nanotron's hooks below hands over to the trainer's `CheckpointManager` (manager.py),
which owns the resume, the saves, the memory checkpoints and Nanotron's post-save hooks. A checkpoint with
a manifest is resumed by it whatever `checkpointing_engine` says (any other is left to Nanotron); every
checkpoint is taken by it with `checkpointing_engine: datastates`. With `torch` and no such checkpoint to
resume, the trainer is Nanotron's, unchanged.

    __init__             manager.before_init ... Nanotron's __init__ ... manager.after_init
    pre_init             manager.pre_init (after Nanotron's)
    _load_model_...      manager.load_weights, where the resume is ours
    training_step        manager.after_training_step
    save_checkpoint      manager.save, with `checkpointing_engine: datastates`
    _update_dataloader_based_on_training_stages  (each iteration's first call) manager.memory_checkpoint
    post_training        manager.finish
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .manager import CheckpointManager

if TYPE_CHECKING:  # for type checkers: the mixin's attributes and hooks are those of Nanotron's trainer
    from nanotron.trainer import DistributedTrainer as _Trainer

    from .types import NanotronModel
else:
    _Trainer = object


class DataStatesTrainerMixin(_Trainer):
    """Mix in before Nanotron's trainer: ``class T(DataStatesTrainerMixin, DistributedTrainer)``.

    `trainer.datastates` is its `CheckpointManager`; `trainer.datastates.saver` the Saver while checkpoints
    go through the engine (None otherwise): append to its `observers` to be told of each queuing and
    commit."""

    datastates: CheckpointManager

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.datastates = CheckpointManager.before_init(self, args, kwargs)  # before the process groups
        super().__init__(*args, **kwargs)
        self.datastates.after_init()

    def pre_init(self) -> None:
        super().pre_init()  # Nanotron resolves the checkpoint to resume from
        self.datastates.pre_init()

    def _load_model_checkpoint(self, model: NanotronModel) -> NanotronModel:
        if not self.datastates.resuming:
            return super()._load_model_checkpoint(model)
        self.datastates.load_weights(model)
        return model

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self.datastates.after_training_step()
        return out

    def save_checkpoint(self) -> Path:
        saver = self.datastates.saver
        return super().save_checkpoint() if saver is None else self.datastates.save(saver)

    def _update_dataloader_based_on_training_stages(self, *args: Any, **kwargs: Any) -> Any:
        self.datastates.memory_checkpoint()  # the state after the last iteration
        return super()._update_dataloader_based_on_training_stages(*args, **kwargs)

    def post_training(self) -> None:
        self.datastates.finish()
        super().post_training()
