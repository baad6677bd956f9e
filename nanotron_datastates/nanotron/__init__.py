"""The Nanotron adapter: `checkpointing_engine: datastates` in Nanotron's YAML.

Installed with the package, a post-import hook makes Nanotron's own `run_train.py` understand the keys (set
NANOTRON_DATASTATES_AUTOLOAD=0 to turn it off). The explicit routes::

    from nanotron_datastates.nanotron import DataStatesTrainer      # Nanotron's trainer plus the mixin
    python -m nanotron_datastates.nanotron.train --config-file config.yaml

Only this subpackage imports Nanotron, and only when one of the names below is used.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "DataStatesTrainer",
    "DataStatesTrainerMixin",
    "NanotronUnavailable",
    "register",
]


def __getattr__(name: str) -> Any:
    if name == "DataStatesTrainer":
        from .trainer import DataStatesTrainer

        return DataStatesTrainer
    if name == "DataStatesTrainerMixin":
        from .mixin import DataStatesTrainerMixin

        return DataStatesTrainerMixin
    if name == "register":
        from .yaml_config import register

        return register
    if name == "CheckpointError":
        from ..errors import CheckpointError

        return CheckpointError
    if name == "NanotronUnavailable":
        from .compat import NanotronUnavailable

        return NanotronUnavailable
    raise AttributeError(name)
