"""Finding a usable Nanotron: by its API, never by its version string (every build calls itself 0.4)."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import DataStatesError

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
    "install Nanotron from source (pip install -e . in a checkout of huggingface/nanotron; supported from "
    "commit 2cde8f6, 2024-12-05, to main), with its extras dacite and datasets"
)
# Modules Nanotron imports, and where they come from: main imports several its pyproject does not declare.
PROVIDERS = {
    "dacite": "pip install dacite (Nanotron's extra)",
    "datasets": "pip install datasets (Nanotron's extra)",
    "transformers": "pip install transformers (Nanotron main imports it without declaring it)",
    "psutil": "pip install psutil (Nanotron main imports it without declaring it)",
    "einops": "pip install einops (Nanotron main imports it without declaring it)",
    "torchtyping": "pip install torchtyping (Nanotron main imports it without declaring it)",
    "flash_attn": "the flash-attn package, a CUDA build (pip install flash-attn --no-build-isolation)",
    "triton": "triton, which CUDA builds of torch install",
    "grouped_gemm": "the grouped_gemm package, a CUDA build (Nanotron main imports it for its experts)",
}


class NanotronUnavailable(DataStatesError, ImportError):
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
        missing = (getattr(e, "name", None) or "").split(".")[0]
        if missing and missing != "nanotron":
            provider = PROVIDERS.get(missing, f"pip install {missing}")
            raise NanotronUnavailable(
                f"cannot import {module}: Nanotron imports {missing!r}, which is not installed; {provider}"
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
