"""A state written as parts by several ranks, and put back together when read.

The data- and context-parallel replicas of a model shard hold the same optimizer state where it is not
sharded (no ZeRO). With balanced writes each replica writes one part of it, so that each copies and writes
about 1/n of the bytes. `split` keeps of a state the leaves of one part: its tensors cut into `count` runs of
about equal bytes, in the state's own order, the same on every replica (they hold the same structure and
shapes); every other value (a learning rate, a name, an empty container) goes to part 0. `merge` puts the
parts' trees back together: every dict holds the keys of all parts (part 0's first, then each next part's
new ones), which is the saved order where only tensors were cut apart.

A leaf is a tensor, a plain value, or a list or tuple (kept whole: its items are positional).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .errors import FormatError

Path = tuple[Hashable, ...]  # the keys from the root to a leaf


def _leaves(state: object, path: Path = ()) -> list[tuple[Path, object]]:
    """(path, leaf) of every leaf, in the state's order. A list filled by plain recursion, not nested
    generators: an optimizer's state is walked at every checkpoint on the training thread."""
    out: list[tuple[Path, object]] = []
    _collect(state, path, out)
    return out


def _collect(state: object, path: Path, out: list[tuple[Path, object]]) -> None:
    if isinstance(state, dict) and state:
        for key, value in state.items():
            _collect(value, (*path, key), out)
    else:
        out.append((path, state))


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def owners(state: object, count: int) -> dict[Path, int]:
    """The part (0 to `count` - 1) each leaf of `state` belongs to: leaves holding tensors in runs of about
    equal bytes, each at the run its middle byte falls in; the others to part 0."""
    if count < 1:
        raise ValueError(f"a state is split into 1 part or more, not {count}")
    leaves = [(path, _nbytes(value)) for path, value in _leaves(state)]
    total = sum(n for _, n in leaves)
    out, before = {}, 0
    for path, n in leaves:
        out[path] = min(count - 1, (2 * before + n) * count // (2 * total)) if n and total else 0
        before += n
    return out


def split(state: object, part: int, count: int) -> object:
    """The leaves of `state` that belong to `part` of `count` (see `owners`), in `state`'s own containers'
    types and order. `count` 1: `state` itself."""
    if count == 1:
        return state
    if not isinstance(state, dict):
        raise TypeError(f"only a dict is split into parts, not a {type(state).__name__}")
    mine = {path for path, owner in owners(state, count).items() if owner == part}
    on_the_way = {path[:i] for path in mine for i in range(len(path) + 1)}

    def keep(node: object, path: Path) -> object:
        if path in mine or not isinstance(node, dict):  # a leaf (the others are dicts on the way to one)
            return node
        out = type(node)()
        for key, value in node.items():
            if (*path, key) in on_the_way:
                out[key] = keep(value, (*path, key))
        return out

    return keep(state, ())


def merge(parts: Sequence[object]) -> Any:  # Any: a state as loaded, which its callers take apart
    """The state whose parts `parts` are (in part order). Raises FormatError where two parts hold the same
    leaf, which no split makes."""
    if not parts:
        raise FormatError("no part of the state to put together")
    out = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        out = _merge(out, part, (), i)
    return out


def _merge(a: object, b: object, path: Path, index: int) -> object:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        where = "/".join(map(str, path)) or "the root"
        raise FormatError(f"part {index} of the state holds {where} again")
    out = a.copy()
    for key, value in b.items():
        out[key] = _merge(out[key], value, (*path, key), index) if key in out else value
    return out
