"""What the post-import hook does once a Nanotron module has been imported."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("nanotron_datastates")


def on_import(name: str) -> None:
    try:
        from . import compat
        from . import yaml_config as config

        if name == "nanotron.config":
            config.register()
        elif name == "nanotron.trainer":
            config.register()
            trainer_module = sys.modules["nanotron.trainer"]
            config.patch_trainer_module(trainer_module)
            ours: Any = sys.modules.get(f"{__package__}.trainer")
            if ours is not None and not hasattr(ours, "install"):
                # Our trainer module is what imports Nanotron's (the explicit route, first): it installs
                # itself once its class is defined.
                ours.INSTALL_WHEN_DEFINED = True
                return
            from .trainer import install

            install(trainer_module)
    except compat.NanotronUnavailable as e:  # leave Nanotron as it is; say why once
        log.warning("nanotron-datastates is not active: %s", e)
