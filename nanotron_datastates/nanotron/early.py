"""Resume, read ahead from the trainer's first line: before Nanotron sets up its process groups (0.4 to 0.7 s
on an H100, NCCL's first communicator and a barrier per group), which files this rank will read is guessed
from the config and the checkpoint's manifest, and the read-ahead (prefetch.py) starts on them at once.

The guess is only taken where it cannot be wrong in practice: the layout saved is the configured one, with no
tensor, pipeline or expert parallelism (every rank reads every weight file; data- and context-parallel ranks
hold the whole model), and the checkpoint holds one optimizer file (every rank reads it). Once the process
groups exist, the trainer computes the files itself and adopts this read-ahead only if they are the same
(`matches`); otherwise it reads its own, and this one's buffers are let go when its reads end.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from nanotron.constants import CHECKPOINT_FILE_NAME

from ..config import DataStatesConfig
from ..engine import DataStatesEngine
from . import layout
from .prefetch import Prefetch, warm_page_cache

MAX_SMALL_FILES = 16  # the scheduler's and random states' files read into the page cache first, at most


@dataclasses.dataclass
class EarlyRead:
    """A read-ahead started before the process groups: its engine, and what it reads where."""

    root: Path
    engine: DataStatesEngine
    prefetch: Prefetch
    weights: list[Path]
    optimizer: Path | None
    device: torch.device

    def matches(self, root: Path, weights: list[Path], optimizer: Path | None, device: torch.device) -> bool:
        """Whether it reads exactly the files the trainer wants, onto its device."""
        return (root, weights, optimizer, device) == (self.root, self.weights, self.optimizer, self.device)


def start(args: Sequence[Any], kwargs: dict[str, Any]) -> EarlyRead | None:
    """Starts reading the checkpoint the trainer constructed with these arguments will resume from, where the
    files are known without the process groups; None otherwise (nothing started: the trainer reads ahead
    once it has them). Never raises: whatever fails here, the trainer meets again and reports."""
    if not torch.cuda.is_available():
        return None
    try:
        config = _config(args, kwargs)
        root = _resume_folder(config)
        if root is None:
            return None
        manifest = layout.read_manifest(root)
        weights, optimizer = _files(config, manifest, root)
        if not weights and optimizer is None:
            return None
        # Nanotron's ParallelContext sets this same device first thing; set now, the engine pins its cache
        # and the read-ahead allocates on this rank's GPU, not on GPU 0.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        small = [root / f for f in manifest["files"] if f.startswith(("lr_scheduler/", "random/"))]
        if len(small) <= MAX_SMALL_FILES:
            warm_page_cache([root / CHECKPOINT_FILE_NAME, *small])  # before the disk's queue fills
        ds = getattr(config, "datastates", None)
        engine = DataStatesEngine(ds if isinstance(ds, DataStatesConfig) else DataStatesConfig())
    except Exception:  # noqa: BLE001 - the trainer meets the same problem and reports it
        return None
    checksums = lambda p: layout.file_checksums(manifest, root, p)  # noqa: E731
    prefetch = Prefetch(engine, device, weights, optimizer, checksums)
    return EarlyRead(root, engine, prefetch, weights, optimizer, device)


def _config(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The config as Nanotron's trainer parses it from the same arguments (a YAML file takes ms to parse)."""
    from nanotron.config import Config, get_config_from_file

    path = args[0] if args else kwargs["config_or_config_file"]
    config_class = args[1] if len(args) > 1 else kwargs.get("config_class", Config)
    model_config_class = args[2] if len(args) > 2 else kwargs.get("model_config_class")
    return get_config_from_file(path, config_class=config_class, model_config_class=model_config_class)


def _resume_folder(config: Any) -> Path | None:
    """The local datastates checkpoint the config resumes from, else None: Nanotron's resolution of a local
    path (`parse_ckpt_path`, which logs through the process groups, so it cannot run yet), the step named
    by latest.txt or the folder itself. The trainer compares it with Nanotron's own before adopting it."""
    from nanotron.s3_checkpoints import check_path_is_local

    path = config.checkpoints.resume_checkpoint_path
    if path is None or not check_path_is_local(path):
        return None
    path = Path(path)
    if (path / "latest.txt").exists():
        folder = path / str(int((path / "latest.txt").read_text()))
    elif (path / "model_config.json").exists():
        folder = path
    else:
        return None
    return folder if layout.is_datastates_checkpoint(folder) else None


def _files(config: Any, manifest: dict[str, Any], root: Path) -> tuple[list[Path], Path | None]:
    """The weight files and the optimizer file every rank of this layout reads; none if the layout differs
    from the saved one or spreads the model over ranks."""
    par = config.parallelism
    here = layout.topology(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=getattr(par, "context_parallel_size", 1),  # Nanotron main's; 1 before
        expert=par.expert_parallel_size,
        zero_stage=int(config.optimizer.zero_stage),
    )
    changed = layout.topology_changes(manifest.get("topology", {}), here)
    if changed or (par.tp, par.pp, par.expert_parallel_size) != (1, 1, 1):
        return [], None
    optimizers = [f for f in manifest["files"] if f.startswith("optimizer/") and f.endswith(".safetensors")]
    optimizer = root / optimizers[0] if len(optimizers) == 1 and config.checkpoints.load_optimizer else None
    return layout.weight_files(manifest, root), optimizer
