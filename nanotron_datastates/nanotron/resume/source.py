"""What a trainer resumes from, known before its process groups exist: the config as Nanotron's trainer will
parse it, the checkpoint folder its resume path leads to, the layout it asks for and what it loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from ...checkpoint.manifest import is_datastates_checkpoint
from ...checkpoint.topology import topology as make_topology
from ...store import open_store

if TYPE_CHECKING:
    from ..types import Config


def parse_config(args: Sequence[object], kwargs: Mapping[str, object]) -> Config:
    """The config as Nanotron's trainer parses it from the same arguments (a YAML file takes ms to parse)."""
    from nanotron.config import Config, get_config_from_file

    path = args[0] if args else kwargs["config_or_config_file"]
    if not isinstance(path, (str, os.PathLike)):
        return path  # a Config object
    config_class = args[1] if len(args) > 1 else kwargs.get("config_class", Config)
    model_config_class = args[2] if len(args) > 2 else kwargs.get("model_config_class")
    return get_config_from_file(str(path), config_class=config_class, model_config_class=model_config_class)


def resume_folder(config: Config) -> Path | None:
    """The local datastates checkpoint the config resumes from, else None: Nanotron's resolution of a local
    path (`parse_ckpt_path`, which logs through the process groups, so it cannot run yet), the step named
    by latest.txt or the folder itself. `Resume.plan` compares it with Nanotron's own before adopting it."""
    from nanotron.s3_checkpoints import check_path_is_local

    path = config.checkpoints.resume_checkpoint_path
    if path is None or not check_path_is_local(path):
        return None
    path = Path(path)
    store = open_store(path)
    step = store.latest()  # ValueError, naming latest.txt, where it is not a step number
    if step is not None:
        folder = store.path(str(step))
    elif (path / "model_config.json").exists():
        folder = path
    else:
        return None
    return folder if is_datastates_checkpoint(folder) else None


def asked_layout(config: Config) -> dict[str, int]:
    """The manifest's topology for the layout a config asks for (what `groups.layout_of` finds later)."""
    par = config.parallelism
    return make_topology(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=getattr(par, "context_parallel_size", 1),  # Nanotron main's; 1 before
        expert=par.expert_parallel_size,
        zero_stage=int(config.optimizer.zero_stage),
    )


def loads(config: Config, flags: tuple[bool, bool] | None = None) -> dict[str, bool]:
    """What is loaded besides the weights: the config's flags, or `flags` (the flags as the YAML had them,
    once they are turned off for Nanotron's own loaders)."""
    load_optimizer, load_scheduler = flags or (
        config.checkpoints.load_optimizer,
        config.checkpoints.load_lr_scheduler,
    )
    return {"optimizer": bool(load_optimizer), "scheduler": bool(load_scheduler)}
