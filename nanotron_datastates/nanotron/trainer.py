"""DataStatesTrainer: Nanotron's DistributedTrainer with the datastates mixin, and its installation into
`nanotron.trainer` (done by the post-import hook, so Nanotron's own run_train.py gets it)."""

from __future__ import annotations

from typing import Any

from . import compat
from . import yaml_config as config

INSTALL_WHEN_DEFINED = False  # set by the post-import hook when this module imports Nanotron's trainer
compat.check()
config.register()

import nanotron.trainer as _nanotron_trainer  # noqa: E402

from .mixin import DataStatesTrainerMixin  # noqa: E402

config.patch_trainer_module(_nanotron_trainer)
# Nanotron's own class, also when the hook has already put ours in its place.
_NanotronTrainer: Any = getattr(
    _nanotron_trainer, "NanotronDistributedTrainer", _nanotron_trainer.DistributedTrainer
)


class DataStatesTrainer(DataStatesTrainerMixin, _NanotronTrainer):
    """Nanotron's trainer; with `checkpointing_engine: datastates`, checkpoints go through the engine."""


def install(trainer_module: Any) -> None:
    """Makes `nanotron.trainer.DistributedTrainer` our trainer (once)."""
    if trainer_module.DistributedTrainer is DataStatesTrainer:
        return
    trainer_module.NanotronDistributedTrainer = _NanotronTrainer
    trainer_module.DistributedTrainer = DataStatesTrainer


if INSTALL_WHEN_DEFINED:
    install(_nanotron_trainer)
