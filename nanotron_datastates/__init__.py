"""nanotron-datastates: lazy asynchronous checkpointing for Nanotron, into valid safetensors files.

>>> from nanotron_datastates import DataStatesEngine, DataStatesConfig
>>> with DataStatesEngine(DataStatesConfig(host_cache_size=1)) as engine:
...     h = engine.save(state, "ckpt/model.safetensors")
...     h.wait_snapshot()     # before mutating `state`
...     h.wait_persisted()    # durable
"""

from .config import DataStatesConfig
from .engine import DataStatesEngine, SaveHandle
from .errors import ChecksumError, FormatError
from .plan import SavePlan

__all__ = ["ChecksumError", "DataStatesConfig", "DataStatesEngine", "FormatError", "SaveHandle", "SavePlan"]
__version__ = "0.1.0"
