"""Finding a usable Nanotron: by its API, never by its version string (every build calls itself 0.4)."""

from __future__ import annotations

import importlib
from types import ModuleType

# What the adapter relies on, module by module.
REQUIRED = {
    "nanotron.config.config": ("Config", "CheckpointsArgs", "get_config_from_file", "get_config_from_dict"),
    "nanotron.serialize.utils": ("get_path", "ObjectType", "get_exp_tp_pp_rank_and_size_from"),
    "nanotron.serialize.metadata": ("TensorMetadata", "TrainingMetadata", "CheckpointMetadata", "save_meta"),
    "nanotron.serialize.optimizer": ("optimizer_filename", "lr_scheduler_filename"),
    "nanotron.serialize.weights": ("load_weights",),
    "nanotron.random": ("RandomState", "RandomStates"),
}
INSTALL_HINT = (
    "install Nanotron from source (pip install -e . in a checkout of huggingface/nanotron; tested at commit "
    "2cde8f6), with its extras dacite and datasets"
)


class NanotronUnavailable(ImportError):
    """Nanotron is missing, broken (the PyPI 0.4 wheel), or lacks an API the adapter needs."""


def load(module: str) -> ModuleType:
    """Imports a Nanotron module, turning the known failures into NanotronUnavailable."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        text = str(e)
        if "circular import" in text or "partially initialized module" in text:
            raise NanotronUnavailable(
                f"this Nanotron cannot be imported ({text}): PyPI's nanotron 0.4 wheel is broken; "
                + INSTALL_HINT
            ) from e
        raise NanotronUnavailable(f"cannot import {module} ({text}); {INSTALL_HINT}") from e
    missing = [name for name in REQUIRED.get(module, ()) if not hasattr(mod, name)]
    if missing:
        raise NanotronUnavailable(
            f"this Nanotron's {module} lacks {', '.join(missing)}, which nanotron-datastates needs; "
            + INSTALL_HINT
        )
    return mod


def check() -> None:
    """Raises NanotronUnavailable unless every API the adapter uses is there."""
    for module in REQUIRED:
        load(module)
