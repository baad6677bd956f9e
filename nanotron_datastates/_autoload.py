"""Post-import hook, run at interpreter start by `nanotron_datastates.pth` (installed next to the package).

It only registers a finder: nothing is imported until Nanotron itself is. When `nanotron.config` has been
imported, our config keys are registered; when `nanotron.trainer` has been, its DistributedTrainer becomes
`DataStatesTrainer` (Nanotron's trainer plus our mixin, which behaves exactly like Nanotron's unless the
config says `checkpointing_engine: datastates`). So Nanotron's unmodified `run_train.py` understands the keys.

Every Python start in the environment runs it, so it imports nothing but `os` and `sys` (and this package's
`__init__`, which imports nothing either): `python3 -c pass` costs what it costs without the package. Set
NANOTRON_DATASTATES_AUTOLOAD=0 to turn it off; the `.pth` line reads the variable before importing anything.

This is the one route that needs no change to a training script. The explicit ones: `from
nanotron_datastates.nanotron import DataStatesTrainer` and `python -m nanotron_datastates.nanotron.train`.
"""

from __future__ import annotations

import os
import sys

ENV = "NANOTRON_DATASTATES_AUTOLOAD"
_OFF = ("0", "false", "no", "off")  # the .pth line in the package's root repeats these
_TARGETS = ("nanotron.config", "nanotron.trainer")


class _Finder:
    """A meta path finder (importlib's protocol: `find_spec`); not derived from importlib.abc, whose import
    costs milliseconds at every start."""

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

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader only
        return spec


def _after(name: str) -> None:
    from .nanotron import hooks  # imports torch and nanotron, which are being imported anyway

    hooks.on_import(name)


def install() -> None:
    """Registers the finder once; a no-op when disabled by NANOTRON_DATASTATES_AUTOLOAD=0."""
    if os.environ.get(ENV, "1").strip().lower() in _OFF:
        return
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in _TARGETS:  # already imported before we were
        if name in sys.modules:
            _after(name)


install()
