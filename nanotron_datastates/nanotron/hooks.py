"""What the post-import hook does once a Nanotron module has been imported."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("nanotron_datastates")


def on_import(name: str) -> None:
    try:
        from . import compat, config

        if name == "nanotron.config":
            config.register()
        elif name == "nanotron.trainer":
            config.register()
            trainer_module = sys.modules["nanotron.trainer"]
            config.patch_trainer_module(trainer_module)
            from .trainer import install

            install(trainer_module)
    except compat.NanotronUnavailable as e:  # leave Nanotron as it is; say why once
        log.warning("nanotron-datastates is not active: %s", e)
