"""Resume, the weights: this rank's weight files into the model's parameters, as read ahead (read_ahead.py),
else read now, each tensor checked against the manifest's checksums; on another layout, each parameter put
together from the saved pieces (reshard.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...checkpoint.checksums import file_checksums
from ...engine import DataStatesEngine
from ...resume.read_ahead import Prefetch, fill
from .. import log as say
from .. import shards
from . import reshard

if TYPE_CHECKING:
    from ..types import NanotronModel, ParallelContext


def load(
    engine: Callable[[], DataStatesEngine],
    manifest: Mapping[str, object],
    src: Path,
    model: NanotronModel,
    pc: ParallelContext,
    prefetch: Prefetch | None,
) -> list[str] | None:
    """Loads the weights of `model` from `src` (`engine()` reads them); returns the names of the parameters
    loaded from their own files, or None where they were resharded. Raises what reading raises."""
    t0 = time.perf_counter()
    if prefetch is not None:  # every rank at once, whatever way it loads its weights (tier/peer_reads.py)
        prefetch.exchange("weights")
    peer = prefetch.peer if prefetch is not None else None
    sources = shards.weight_sources(model, pc, src, peer.receives if peer is not None else None)
    if sources is None:  # another layout: each parameter put together from the saved pieces
        n = reshard.load_weights(engine(), manifest, src, model)
        say.info(f"resharded {n} weights in {time.perf_counter() - t0:.2f} s")
        return None
    ahead = prefetch.weights() if prefetch is not None else {}
    checksums = functools.partial(file_checksums, manifest, src)
    fill([(tensor, path) for _, tensor, path in sources], ahead, engine(), checksums)
    return [name for name, _, _ in sources]
