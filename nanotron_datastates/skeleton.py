"""The skeleton: a JSON description of a saved state with its tensors replaced by their names.

Plain JSON values stand for themselves (None, bool, int, str, finite float). Everything else is an object with
exactly one tag key, so decoding is unambiguous:

=====  =====================================================
``t``  tensor, by name in the file
``d``  dict, as ``[[key, value], ...]`` (keys may be any non-tensor node)
``o``  collections.OrderedDict, same form
``l``  list          ``u``  tuple          ``s``  torch.Size
``f``  float that JSON cannot spell: ``"nan"``, ``"inf"``, ``"-inf"``
``b``  bytes, base64
``y``  torch.dtype, by name (``"float32"``)
``p``  pickled object, base64 (only with ``allow_pickle``)
=====  =====================================================
"""

from __future__ import annotations

import base64
import collections
import json
import math
import pickle
from typing import Any, Callable, Mapping

import torch

from .errors import FormatError

_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_PLAIN = (type(None), bool, int, str)  # JSON stands for them as they are
_PLAIN_TYPES = frozenset(_PLAIN)
_SCALAR_TYPES = _PLAIN_TYPES | {float}  # immutable leaves: a container of only these is copied flat
TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})  # exactly these: a subclass may encode otherwise


def encode(
    state: object,
    on_tensor: Callable[[torch.Tensor, str], str],
    *,
    allow_pickle: bool = False,
    reuse: Mapping[object, object] | None = None,
    keep: dict[object, object] | None = None,
) -> str:
    """JSON skeleton of `state`. `on_tensor(tensor, path)` returns the name the tensor is stored under.

    Where `state` is a dict: `keep` is given the encoded node of each of its values that is not plain, by
    key; `reuse` gives such nodes, from an earlier encoding, for the values not to walk again (the caller
    vouches that they encode alike: the same keys, the same tensors under the same names)."""
    reuse = reuse or {}

    # `x` dispatched on its exact type, without isinstance's cost: Any, as no narrowing follows.
    def node(x: Any, path: str, in_key: bool = False) -> object:
        tx = type(x)
        if x is None or tx in (bool, int, str):
            return x
        if tx is float:
            if math.isfinite(x):
                return x
            return {"f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if (tx is torch.Tensor or tx is torch.nn.Parameter) and not in_key:  # without isinstance's cost
            return {"t": on_tensor(x, path)}
        if tx in (dict, collections.OrderedDict):
            items = []
            for k, v in x.items():
                key = k if type(k) in _PLAIN else node(k, f"{path}[key]", True)
                tv = type(v)
                # Plain values stand for themselves: no call, no path (an optimizer's param groups are mostly
                # these, and its state dict is planned at every checkpoint).
                if v is None or tv in _PLAIN or (tv is float and math.isfinite(v)):
                    items.append([key, v])
                elif x is state and type(k) in _PLAIN and k in reuse:
                    items.append([key, reuse[k]])
                else:
                    encoded = node(v, _join(path, k))
                    if x is state and keep is not None and type(k) in _PLAIN:
                        keep[k] = encoded
                    items.append([key, encoded])
            return {"d" if tx is dict else "o": items}
        if tx is list or tx is tuple:
            # Fast path, e.g. the parameter names of an optimizer's param groups, or its betas (finite floats
            # stand for themselves too): no per-item paths.
            types = set(map(type, x))  # at C speed: a generator's state holds 625 ints
            seq: list[object] = (
                list(x)
                if types <= _PLAIN_TYPES
                or (types <= _SCALAR_TYPES and all(math.isfinite(v) for v in x if type(v) is float))
                else [node(v, _join(path, i), in_key) for i, v in enumerate(x)]
            )
            return {"l" if tx is list else "u": seq}
        if isinstance(x, torch.Tensor) and not in_key:  # a subclass
            return {"t": on_tensor(x, path)}
        if tx is torch.Size:
            return {"s": list(x)}
        if tx is bytes:
            return {"b": base64.b64encode(x).decode("ascii")}
        if tx is torch.dtype:
            return {"y": str(x).removeprefix("torch.")}
        if allow_pickle:
            try:
                return {"p": base64.b64encode(pickle.dumps(x)).decode("ascii")}
            except Exception as e:
                raise TypeError(f"cannot pickle {tx.__name__} at {path or '<root>'!r}: {e}") from e
        raise TypeError(
            f"cannot save a {tx.__module__}.{tx.__qualname__} at {path or '<root>'!r}: only tensors, "
            "dicts, lists, tuples, int, float, str, bool, None and bytes are stored as data; pass "
            "allow_pickle=True to pickle other objects"
        )

    return json.dumps(node(state, ""), separators=(",", ":"), allow_nan=False)


def freeze(state: object) -> tuple[object, list[torch.Tensor]]:
    """`state` with every container copied (dicts, lists, tuples; tensors and other leaves as they are), and
    its tensors in the order `encode` meets them, each once. Plain values may be replaced in the state's own
    containers later (an optimizer's step count); the copy keeps those of now, at a fraction of a plan's
    cost, for a plan made later (`plan_save(copy, like=...)`)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()

    def node(x: Any) -> object:  # dispatched on its exact type, as `encode`'s
        tx = type(x)
        if tx in (dict, collections.OrderedDict):
            types = set(map(type, x.values()))  # at C speed: an optimizer's state is dicts of tensors
            if types <= TENSOR_TYPES:
                ids = set(map(id, x.values()))
                if len(ids) == len(x) and seen.isdisjoint(ids):  # each met for the first time
                    seen.update(ids)
                    tensors.extend(x.values())
                    return tx(x)
            elif types <= _SCALAR_TYPES:
                return tx(x)
            # leaves (floats too) as they are; a comprehension, not a generator: a param group a parameter
            copied = {k: v if type(v) in _SCALAR_TYPES else node(v) for k, v in x.items()}
            return copied if tx is dict else tx(copied)
        if tx is list or tx is tuple:
            if set(map(type, x)) <= _SCALAR_TYPES:
                return x if tx is tuple else list(x)
            return tx(node(v) for v in x)
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            tensors.append(x)
        return x

    return node(state), tensors


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def uses_pickle(skeleton: str) -> bool:
    return '"p":' in skeleton


def decode(
    skeleton: str,
    tensors: Mapping[str, object],
    *,
    allow_pickle: bool = False,
    path: str = "",
    unpickle: bool = True,
) -> object:
    """Rebuilds the state from its skeleton and the loaded tensors. FormatError on anything malformed.
    `unpickle=False` checks the skeleton only (what `verify` does): a pickled leaf's base64 is checked and
    None stands for it, whether or not `allow_pickle`; nothing is unpickled."""
    try:
        doc = json.loads(skeleton)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{path}: skeleton is not valid JSON ({e})") from None

    def bad(msg: str) -> FormatError:
        return FormatError(f"{path}: malformed skeleton: {msg}")

    def node(x: object) -> object:
        if x is None or type(x) in (bool, int, str, float):
            return x
        if type(x) is not dict or len(x) != 1:
            raise bad(f"unexpected {type(x).__name__}")
        ((tag, v),) = x.items()
        if tag == "t":
            if type(v) is not str or v not in tensors:
                raise bad(f"names tensor {v!r}, which the file does not hold")
            return tensors[v]
        if tag in ("d", "o"):
            if type(v) is not list or not all(type(p) is list and len(p) == 2 for p in v):
                raise bad("a dict must be a list of [key, value] pairs")
            out = {} if tag == "d" else collections.OrderedDict()
            for k, val in v:
                key = node(k)
                try:
                    out[key] = node(val)
                except TypeError:
                    raise bad(f"unhashable key {key!r}") from None
            return out
        if tag in ("l", "u", "s"):
            if type(v) is not list:
                raise bad(f"'{tag}' must hold a list")
            items = [node(i) for i in v]
            if tag == "s":
                sizes = [i for i in items if type(i) is int and -(2**63) <= i < 2**63]
                if len(sizes) != len(items):
                    raise bad("torch.Size must hold integers of 64 bits")
                return torch.Size(sizes)
            return items if tag == "l" else tuple(items)
        if tag == "f":
            if type(v) is not str or v not in _SPECIAL_FLOATS:  # a list would not even hash
                raise bad(f"unknown float {v!r}")
            return _SPECIAL_FLOATS[v]
        if tag in ("b", "p"):
            if type(v) is not str:
                raise bad(f"'{tag}' must hold base64 text")
            try:
                raw = base64.b64decode(v, validate=True)
            except ValueError:
                raise bad("invalid base64") from None
            if tag == "b":
                return raw
            if not unpickle:
                return None
            if not allow_pickle:
                raise FormatError(
                    f"{path}: holds pickled objects; pass allow_pickle=True to load it (only if you trust it)"
                )
            return pickle.loads(raw)
        if tag == "y":
            dt = getattr(torch, v, None) if type(v) is str else None
            if not isinstance(dt, torch.dtype):
                raise bad(f"unknown dtype {v!r}")
            return dt
        raise bad(f"unknown tag {tag!r}")

    try:
        return node(doc)
    except RecursionError:
        raise bad("nested too deeply") from None
