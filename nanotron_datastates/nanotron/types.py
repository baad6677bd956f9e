"""The names the adapter's type hints give Nanotron's objects, and the aliases several of its modules share.

For type checkers only: nothing here is imported at run time (Nanotron is imported only where the adapter
uses it). Each Nanotron class has this import path from commit 2cde8f6 (2024-12) to main. The trainer's
learning-rate scheduler is torch's (Nanotron builds a `LambdaLR`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Callable

    from nanotron.config import Config as Config
    from nanotron.config.models_config import NanotronConfigs as NanotronConfigs
    from nanotron.models import NanotronModel as NanotronModel
    from nanotron.optim import BaseOptimizer as BaseOptimizer
    from nanotron.parallel import ParallelContext as ParallelContext
    from nanotron.random import RandomState as RandomState
    from nanotron.random import RandomStates as RandomStates
    from nanotron.serialize.metadata import TrainingMetadata as TrainingMetadata
    from nanotron.trainer import DistributedTrainer as DistributedTrainer
    from torch.optim.lr_scheduler import LRScheduler as LRScheduler

    # Every rank's files of a checkpoint, as the committer gathers them: each file's manifest entry, by name
    FileEntries = dict[str, dict[str, object]]
    # A checkpoint's manifest and Nanotron's metadata (their texts, by file name), given every rank's files
    Documents = Callable[[FileEntries], dict[str, str]]
