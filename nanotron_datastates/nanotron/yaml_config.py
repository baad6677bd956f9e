"""`checkpointing_engine: datastates` and the `datastates:` section in Nanotron's YAML.

Nanotron builds its Config with dacite in strict mode, so unknown keys are errors. :func:`register`
therefore swaps in subclasses of Nanotron's own `Config` and `CheckpointsArgs` that add our keys, everywhere
Nanotron looks them up (the `nanotron.config` namespaces, the default arguments of `get_config_from_file`
and of `DistributedTrainer`). After parsing, `config.checkpoints.checkpointing_engine` is "torch" (Nanotron's
own behaviour, the default) or "datastates"; `config.datastates` is the section parsed and validated, a
`TrainerSettings` with every key's value in effect (environment overrides applied: what `config.yaml` then
records), read by attribute like Nanotron's own sections (`config.datastates.keep_last_n`) or by key; the
same object is the engine's config and the Saver's settings.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import TYPE_CHECKING, Any, Optional

from ..trainer_settings import TrainerSettings
from . import compat

if TYPE_CHECKING:
    from types import FunctionType

    from ..engine import DataStatesEngine

ENGINES = ("torch", "datastates")


def _check_engine(value: object, key: str) -> None:
    if value not in ENGINES:
        raise ValueError(f"{key}={value!r} is invalid: expected one of {', '.join(ENGINES)}")


def make_classes(ncc: Any) -> tuple[type, type]:
    """Our Config and CheckpointsArgs, derived from those of the Nanotron config module `ncc`."""

    @dataclasses.dataclass
    class CheckpointsArgs(ncc.CheckpointsArgs):
        checkpointing_engine: Optional[str] = "torch"

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.checkpointing_engine is None:
                self.checkpointing_engine = "torch"
            _check_engine(self.checkpointing_engine, "checkpoints.checkpointing_engine")

    @dataclasses.dataclass
    class Config(ncc.Config):
        checkpoints: Optional[CheckpointsArgs] = None
        # DataStates' own Nanotron docs put the key at the top level; it is moved into `checkpoints`.
        checkpointing_engine: Optional[str] = None
        # Parsed by TrainerSettings.from_dict, not by dacite: its messages name the key, and YAML ints are
        # accepted where floats are expected. After __post_init__: a TrainerSettings, every key in effect
        # (the annotation is what dacite checks the YAML against: resolved in Nanotron's module, a mapping).
        datastates: Optional[dict] = None

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.checkpointing_engine is not None:
                _check_engine(self.checkpointing_engine, "checkpointing_engine")
                if self.checkpoints is None:
                    raise ValueError("checkpointing_engine is set but the config has no checkpoints section")
                inner = self.checkpoints.checkpointing_engine
                if inner not in (None, "torch") and inner != self.checkpointing_engine:
                    raise ValueError(
                        f"checkpointing_engine={self.checkpointing_engine!r} contradicts "
                        f"checkpoints.checkpointing_engine={inner!r}"
                    )
                self.checkpoints.checkpointing_engine = self.checkpointing_engine
                self.checkpointing_engine = None
            given: dict | TrainerSettings | None = self.datastates
            if not isinstance(given, TrainerSettings):  # a parsed config's is kept as it is
                self.datastates = TrainerSettings.from_dict(given)  # type: ignore[assignment]
            if not self.uses_datastates:
                _warn_unused(self.datastates)  # type: ignore[arg-type]

        @property
        def uses_datastates(self) -> bool:
            return self.checkpoints is not None and self.checkpoints.checkpointing_engine == "datastates"

    Config.__module__ = CheckpointsArgs.__module__ = ncc.__name__
    Config.__qualname__ = Config.__name__ = "Config"
    CheckpointsArgs.__qualname__ = CheckpointsArgs.__name__ = "CheckpointsArgs"
    Config.__datastates__ = True
    return Config, CheckpointsArgs


def _warn_unused(settings: TrainerSettings) -> None:
    """A warning naming the `datastates:` keys set away from their defaults while Nanotron's own engine
    saves: they would take no effect. A config.yaml that Nanotron saved holds every key at its value."""
    default = TrainerSettings.from_dict({})
    changed = [
        f.name for f in dataclasses.fields(settings) if getattr(settings, f.name) != getattr(default, f.name)
    ]
    if changed:
        warnings.warn(
            f"datastates: {', '.join(changed)} set, but Nanotron's own engine saves the checkpoints, so they "
            "take no effect: set `checkpointing_engine: datastates` in `checkpoints:` to use them",
            stacklevel=2,
        )


def settings_of(config: object) -> TrainerSettings:
    """The `datastates:` section of a config, parsed (the defaults where it has none)."""
    parsed = getattr(config, "datastates", None)
    return parsed if isinstance(parsed, TrainerSettings) else TrainerSettings()


def engine_for(config: object) -> DataStatesEngine:
    """The trainer's one engine, from its config's `datastates:` section: built here only, by the read-ahead
    of the trainer's first line or by the resume, and handed on to the Saver (manager.py)."""
    from ..engine import DataStatesEngine  # here: this module is imported when Nanotron is, torch or not

    return DataStatesEngine(settings_of(config))


def _swap_default(fn: FunctionType, old: type, new: type) -> None:
    if fn.__defaults__:
        fn.__defaults__ = tuple(new if d is old else d for d in fn.__defaults__)


def register() -> type:
    """Makes Nanotron's config parsing understand our keys. Idempotent; returns the Config class in use."""
    ncc = compat.load("nanotron.config.config")
    if getattr(ncc.Config, "__datastates__", False):
        return ncc.Config
    old_config = ncc.Config
    config, ckpt = make_classes(ncc)
    for name in ("nanotron.config.config", "nanotron.config"):
        mod: Any = sys.modules.get(name)
        if mod is not None:
            mod.Config, mod.CheckpointsArgs = config, ckpt
    _swap_default(ncc.get_config_from_file, old_config, config)
    _swap_default(ncc.get_config_from_dict, old_config, config)
    trainer = sys.modules.get("nanotron.trainer")
    if trainer is not None and hasattr(trainer, "DistributedTrainer"):  # not while it is being imported
        patch_trainer_module(trainer, old_config, config)
    return config


def patch_trainer_module(trainer: Any, old: type | None = None, new: type | None = None) -> None:
    """Points nanotron.trainer at our Config (its name and DistributedTrainer's default argument)."""
    import nanotron.config.config as ncc

    new = new or ncc.Config
    old = old or getattr(trainer, "Config", None)
    if old is None or old is new:
        return
    trainer.Config = new
    _swap_default(trainer.DistributedTrainer.__init__, old, new)
