"""nanotron-datastates: lazy asynchronous checkpointing for Nanotron, into valid safetensors files.

>>> from nanotron_datastates import DataStatesEngine, DataStatesConfig
>>> with DataStatesEngine(DataStatesConfig(host_cache_size=1)) as engine:
...     h = engine.save(state, "ckpt/model.safetensors")
...     h.wait_snapshot()     # before mutating `state`
...     h.wait_persisted()    # durable

The public names are imported on first use: the post-import hook that every Python start runs (see
`_autoload.py`) imports this package, and must not import torch.
"""

TYPE_CHECKING = False  # not typing's: importing typing costs milliseconds at every start
if TYPE_CHECKING:
    from .engine import DataStatesEngine
    from .engine_settings import DataStatesConfig
    from .errors import CheckpointError, ChecksumError, DataStatesError, FormatError
    from .save.handle import SaveHandle
    from .save.plan import SavePlan
    from .save.staged_save import StagedSave

_WHERE = {
    "DataStatesConfig": "engine_settings",
    "DataStatesEngine": "engine",
    "SaveHandle": "save.handle",
    "CheckpointError": "errors",
    "ChecksumError": "errors",
    "DataStatesError": "errors",
    "FormatError": "errors",
    "SavePlan": "save.plan",
    "StagedSave": "save.staged_save",
}
__all__ = [
    "CheckpointError",
    "ChecksumError",
    "DataStatesConfig",
    "DataStatesEngine",
    "DataStatesError",
    "FormatError",
    "SaveHandle",
    "SavePlan",
    "StagedSave",
]
__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - any of the public names
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = __import__(f"{__name__}.{_WHERE[name]}", fromlist=[name])
    value = getattr(module, name)
    globals()[name] = value  # once
    return value


def __dir__() -> "list[str]":
    return sorted({*globals(), *_WHERE})
