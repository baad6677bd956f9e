"""Nanotron states that are not plain tensors, as structures the engine stores without pickle."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def random_state_to_plain(state: Any) -> dict[str, Any]:
    """A nanotron.random.RandomState as nested plain values and tensors."""
    np_state = state.numpy
    return {
        "random": _tuples_to_lists(state.random),
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).astype(np.int64)), *np_state[2:]],
        "torch_cpu": state.torch_cpu,
        "torch_cuda": state.torch_cuda,
    }


def random_state_from_plain(d: dict[str, Any]) -> Any:
    from nanotron.random import RandomState

    kind, keys, *rest = d["numpy"]
    return RandomState(
        random=_lists_to_tuples(d["random"]),
        numpy=(kind, keys.numpy().astype(np.uint32), *rest),
        torch_cpu=d["torch_cpu"].clone(),
        torch_cuda=None if d["torch_cuda"] is None else d["torch_cuda"].clone(),
    )


def global_rng_state() -> dict[str, Any]:
    """The process-wide generators (Python, NumPy, torch CPU and current CUDA device)."""
    npk, nps, *nprest = np.random.get_state()
    return {
        "random": _tuples_to_lists(random.getstate()),
        "numpy": [npk, torch.from_numpy(nps.astype(np.int64)), *nprest],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_global_rng_state(d: dict[str, Any]) -> None:
    random.setstate(_lists_to_tuples(d["random"]))
    kind, keys, *rest = d["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(d["torch_cpu"].cpu())
    if d["torch_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(d["torch_cuda"].cpu())


def _tuples_to_lists(x: Any) -> Any:
    return [_tuples_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _lists_to_tuples(x: Any) -> Any:
    return tuple(_lists_to_tuples(v) for v in x) if isinstance(x, (tuple, list)) else x
