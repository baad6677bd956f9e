"""Post-import hook, run at interpreter start by `nanotron_datastates.pth` (installed next to the package).

It only registers a finder: nothing is imported until Nanotron itself is. When `nanotron.config` has been
imported, our config keys are registered; when `nanotron.trainer` has been, its DistributedTrainer becomes
`DataStatesTrainer` (Nanotron's trainer plus our mixin, which behaves exactly like Nanotron's unless the
config says `checkpointing_engine: datastates`). So Nanotron's unmodified `run_train.py` understands the keys.

Set NANOTRON_DATASTATES_AUTOLOAD=0 to turn this off.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

ENV = "NANOTRON_DATASTATES_AUTOLOAD"
_TARGETS = ("nanotron.config", "nanotron.trainer")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib's signature)
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:  # the spec as the other finders would give it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):  # noqa: ANN001
            run(module)
            _after(name)

        loader.exec_module = exec_module
        return spec


def _after(name: str) -> None:
    from .nanotron import hooks  # imports torch and nanotron, which are being imported anyway

    hooks.on_import(name)


def install() -> None:
    """Registers the finder once; a no-op when disabled by NANOTRON_DATASTATES_AUTOLOAD=0."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in _TARGETS:  # already imported before we were
        if name in sys.modules:
            _after(name)


install()
