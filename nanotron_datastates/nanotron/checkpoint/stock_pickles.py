"""Nanotron's stock `.pt` files read without unpickling: `torch.load(weights_only=True)` builds tensors and
plain containers only, and for the random states the few classes they hold (Nanotron's RandomStates and
RandomState, NumPy's uint32 array); a file that needs anything else is refused (UnpicklingRefused, naming
it). `allow_pickle=True` unpickles, which runs whatever code the file names: only for a trusted checkpoint.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Union

import torch
from torch.torch_version import TorchVersion

from ... import trust
from ...errors import DataStatesError
from .. import rng_states as states

if TYPE_CHECKING:
    from types import ModuleType

# What torch's weights_only load may build besides tensors and plain containers: a class or function, or
# (a function, the name by which a file names it: torch >= 2.6)
Allowed = Union[Callable[..., object], tuple[Callable[..., object], str]]


class UnpicklingRefused(DataStatesError, pickle.UnpicklingError, ValueError):
    """A stock `.pt` file holds objects that loading without unpickling does not build; `allow_pickle=True`
    (`--allow-pickle`) unpickles it, which runs whatever code it names: only for a trusted checkpoint."""


def load_stock(path: Path, allow_pickle: bool, allowed: Sequence[Allowed] = ()) -> object:
    """One of Nanotron's `.pt` files. Without `allow_pickle`, torch builds only tensors, plain containers and
    the `allowed` classes and functions (exactly those): anything else raises UnpicklingRefused, unrun."""
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        if allow_pickle:
            return torch.load(f, map_location="cpu", weights_only=False)
        return _load_weights_only(path, f, allowed)


def _load_weights_only(path: Path, f: IO[bytes], allowed: Sequence[Allowed]) -> object:
    try:
        with _safe_globals(path, allowed):
            return torch.load(f, map_location="cpu", weights_only=True)
    except UnpicklingRefused:  # this torch cannot allow them: already says so
        raise
    except pickle.UnpicklingError as e:
        what = (
            "tensors, plain containers and Nanotron's random states"
            if allowed
            else "tensors and plain containers"
        )
        raise UnpicklingRefused(
            f"{path}: refused by torch.load(weights_only=True), which builds only {what} ({_why(e)}). The "
            "file is damaged or holds other objects, and unpickling those runs any code they name: only if "
            "the checkpoint is trusted, pass --allow-pickle (convert(..., allow_pickle=True))"
        ) from None


@contextlib.contextmanager
def _safe_globals(path: Path, allowed: Sequence[Allowed]) -> Iterator[None]:
    """Lets weights_only build `allowed` for the duration of one load, where this torch can."""
    serialization = torch.serialization
    if not allowed:
        yield
    elif hasattr(serialization, "safe_globals"):  # torch >= 2.5
        with serialization.safe_globals(list(allowed)):
            yield
    elif hasattr(serialization, "add_safe_globals"):  # torch 2.4: process-wide, so undone after the load
        before = serialization.get_safe_globals() if hasattr(serialization, "get_safe_globals") else None
        serialization.add_safe_globals(list(allowed))
        try:
            yield
        finally:
            if before is not None and hasattr(serialization, "clear_safe_globals"):
                serialization.clear_safe_globals()
                serialization.add_safe_globals(before)
    else:
        raise UnpicklingRefused(
            f"{path}: Nanotron's random states hold classes that torch {torch.__version__} cannot allow "
            "without unpickling (torch.serialization.add_safe_globals needs torch >= 2.4): upgrade torch, "
            "or, only if the checkpoint is trusted, pass --allow-pickle (convert(..., allow_pickle=True))"
        )


def _why(e: pickle.UnpicklingError) -> str:
    """torch's reason for refusing a file, without its advice to unpickle it (worded differently by each
    torch: the paragraph after "WeightsUnpickler error:", else the first that is not advice)."""
    text = str(e)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|$)", text, re.S)
    if found:
        reason = found.group(1)
    else:
        advice = ("Weights only load failed", "Check the documentation")
        kept = [p for p in re.split(r"\n\s*\n", text) if p.strip() and not p.strip().startswith(advice)]
        reason = kept[0] if kept else text
    reason = reason.split(" Please use `torch.serialization")[0]  # allow-listing: not what we advise
    return " ".join(reason.split())[:300].rstrip(".") or type(e).__name__


def random_state_globals(nanotron_random: ModuleType) -> list[Allowed]:
    """What Nanotron's random-state pickle holds beyond tensors and plain containers (nanotron/random.py),
    exactly: RandomStates of RandomState, whose `numpy` field is NumPy's legacy generator state, a uint32
    array, and how that array unpickles."""
    import numpy as np

    # The array's rebuilder, from NumPy itself: `numpy.core.multiarray._reconstruct`, `numpy._core` from 2.0.
    reduced = np.zeros(0).__reduce__()
    assert isinstance(reduced, tuple)  # (rebuilder, its arguments, state), as every array reduces
    reconstruct = reduced[0]
    allowed: list[Allowed] = [
        nanotron_random.RandomStates,
        nanotron_random.RandomState,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy.dtypes.UInt32DType (`numpy.dtype[uint32]` before NumPy 1.25)
        codecs.encode,  # `_codecs.encode`: how pickle protocol 2 spells the array's bytes
    ]
    if TorchVersion(torch.__version__) >= "2.6":  # compared as versions, not as text
        # torch allows a function by its module's name: a file written under the other NumPy major version
        # names the other module; torch >= 2.6 takes (function, name) pairs.
        allowed += [(reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy.core", "numpy._core")]
    else:
        allowed.append(reconstruct)
    return allowed


def random_states_to_plain(
    path: Path, loaded: object, nanotron_random: ModuleType
) -> dict[str, dict[str, object]]:
    """The loaded RandomStates as plain values; ValueError naming `path` for anything else, as a crafted
    file can hold (the allowed classes are built without their checks)."""
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path}: {type(loaded).__name__}, not Nanotron's RandomStates")
    plain = {}
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, nanotron_random.RandomState):
            raise ValueError(f"{path}: entry {key!r} is {type(value).__name__}, not Nanotron's RandomState")
        try:
            plain[key] = states.random_state_to_plain(value)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: entry {key!r} is not a random state Nanotron writes ({e})") from None
    return plain


def nanotron_random() -> ModuleType:
    """Nanotron's `random` module, whose RandomStates the stock random-state pickle holds; RuntimeError
    saying so where Nanotron is not importable."""
    try:
        import nanotron.random
    except ImportError as e:
        raise RuntimeError(
            "converting random states needs Nanotron importable (install it from source): its RandomStates "
            f"is what the stock checkpoint pickles ({e})"
        ) from e
    return nanotron.random
