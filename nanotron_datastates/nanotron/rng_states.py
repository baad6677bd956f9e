"""Nanotron states that are not plain tensors, as structures the engine stores without pickle."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .types import RandomState


def random_state_to_plain(state: RandomState, copy: bool = False) -> dict[str, object]:
    """A nanotron.random.RandomState as nested plain values and tensors; `copy`: its torch states cloned (the
    rest is made anew, or immutable), so that nothing done to the RandomState later reaches the result."""
    kind, keys, *rest = state.numpy
    cpu, cuda = state.torch_cpu, state.torch_cuda
    return {  # the engine stores tuples as tuples
        "random": state.random,
        "numpy": (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), *rest),
        "torch_cpu": cpu.clone() if copy else cpu,
        "torch_cuda": cuda.clone() if copy and cuda is not None else cuda,
    }


def random_state_from_plain(d: dict[str, Any]) -> RandomState:
    from nanotron.random import RandomState

    kind, keys, *rest = d["numpy"]
    return RandomState(
        random=d["random"],
        numpy=(kind, keys.numpy().astype(np.uint32), *rest),
        torch_cpu=d["torch_cpu"].clone(),
        torch_cuda=None if d["torch_cuda"] is None else d["torch_cuda"].clone(),
    )


def global_rng_state() -> dict[str, object]:
    """The process-wide generators (Python, NumPy, torch CPU and current CUDA device), every value made anew
    or immutable."""
    state: Any = np.random.get_state()  # the legacy tuple (its stubs also allow a dict)
    kind, keys, *rest = state
    return {
        "random": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), *rest),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_global_rng_state(d: dict[str, Any]) -> None:
    random.setstate(d["random"])
    kind, keys, *rest = d["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(d["torch_cpu"].cpu())
    if d["torch_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(d["torch_cuda"].cpu())
