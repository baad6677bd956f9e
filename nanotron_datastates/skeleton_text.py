"""The skeleton's text of a state planned again, made from what the last plan wrote (`plan.plan_again`).

An optimizer's state planned at every checkpoint differs from the last one's in a few plain values: the
learning rate of each param group (Nanotron makes a group a parameter: 50 for a 180M, 200 for a 1.1B). Its
top-level values whose encoding the caller reuses (the per-parameter state) are kept as text, and each param
group (a flat dict) as a template with its numbers (ints, finite floats) left out, written in with `%r` (the
spelling JSON gives them). A group whose keys, other values or their types changed is encoded afresh, and so
is any other value; a group that fits no template three calls in a row is not given one again. The text is
the very one `skeleton.encode` writes; the tests compare them.
"""

from __future__ import annotations

import json
import math
import operator
import uuid
from typing import Any, Callable, Mapping

import torch

from . import skeleton
from .skeleton import (
    _PLAIN_TYPES as _PLAIN,  # what the skeleton writes as itself: the same sets as its walk's
)
from .skeleton import _SCALAR_TYPES as _ITEMS  # and what a list or tuple in a template may hold

_SEP = (",", ":")
_MAX_MISSES = 3  # calls in a row a group fits no template before none is made for it again


class Texts:
    """What `encode` keeps from one call to the next, for one state: each reused value's text (with the node
    it was made from), and each list of param groups' templates, by key."""

    def __init__(self) -> None:
        self.reused: dict[object, tuple[object, str]] = {}
        # (the template or None, the calls in a row it did not fit) of each group
        self.groups: dict[object, list[tuple[_Group | None, int]]] = {}


def encode(
    state: object,
    reuse: Mapping[object, object],
    texts: Texts,
) -> str | None:
    """`skeleton.encode(state, ..., reuse=reuse)`'s text for a dict `state` whose tensors are all in the
    values `reuse` gives nodes for; None where another value holds a tensor, or `state` is not such a dict.
    TypeError as `skeleton.encode` raises it for a value it cannot store."""
    if type(state) is not dict or not set(map(type, state)) <= _PLAIN:
        return None
    met: list[str] = []  # the tensors met outside the reused values
    parts = []
    for key, value in state.items():
        kind = type(value)
        if value is None or kind in _PLAIN or (kind is float and math.isfinite(value)):
            text = json.dumps(value)  # as `skeleton.encode` writes a plain value: itself, reused or not
        elif key in reuse:
            text = _reused(texts, key, reuse[key])
        elif type(value) is list and value and set(map(type, value)) == {dict}:
            text = '{"l":[' + ",".join(_groups(texts, key, value, met)) + "]}"
        else:
            text = _fresh(value, met)
        if met:
            return None
        parts.append(f"[{json.dumps(key)},{text}]")
    return '{"d":[' + ",".join(parts) + "]}"


def _reused(texts: Texts, key: object, node: object) -> str:
    have = texts.reused.get(key)
    if have is None or have[0] is not node:
        have = texts.reused[key] = (node, json.dumps(node, separators=_SEP, allow_nan=False))
    return have[1]


def _fresh(value: object, met: list[str]) -> str:
    """`value`'s text, as `skeleton.encode` writes it; the paths of the tensors it holds added to `met`."""

    def on_tensor(t: torch.Tensor, path: str) -> str:
        met.append(path)
        return path

    return skeleton.encode(value, on_tensor)


def _groups(texts: Texts, key: object, groups: list[dict[Any, Any]], met: list[str]) -> list[str]:
    """Each group's text, from its template where it still fits one; the templates kept for the next call."""
    old = texts.groups.get(key) or []
    out: list[str] = []
    kept: list[tuple[_Group | None, int]] = []
    for i, group in enumerate(groups):
        template, misses = old[i] if i < len(old) else (None, 0)
        text = template.text_of(group) if template is not None else None
        if text is None:
            text = _fresh(group, met)
            if met:  # a tensor: the caller walks the state itself
                return []
            if misses < _MAX_MISSES:  # else a group whose other values change at every call: walked only
                template = _Group.of(group, text)
            misses += 1
        else:
            misses = 0
        out.append(text)
        kept.append((template, misses))
    texts.groups[key] = kept
    return out


def _getter(keys: list[object]) -> Callable[[dict[Any, Any]], tuple[Any, ...]]:
    """`operator.itemgetter(*keys)`, always giving a tuple."""
    if len(keys) == 1:
        only = keys[0]
        return lambda d: (d[only],)
    if not keys:
        return lambda d: ()
    return operator.itemgetter(*keys)


_Items = tuple[int, tuple[type, ...], "str | None"]  # a list's or tuple's place among the others, its items


class _Group:
    """A flat dict's text with its numbers left out (`%r` in their places): it stands for a dict with these
    keys in this order, other values equal to these and of the same types (a list's or tuple's items too,
    and their spelling where they hold floats: -0.0 equals 0.0), and numbers of the same types where these
    were (a float finite)."""

    __slots__ = ("get_numbers", "get_others", "items", "keys", "numbers", "others", "text", "types")

    def __init__(
        self,
        group: dict[Any, Any],
        numbers: list[object],
        others: list[object],
        items: list[_Items],
        text: str,
    ) -> None:
        self.keys = tuple(group)
        self.get_others, self.get_numbers = _getter(others), _getter(numbers)
        self.others = tuple(list(v) if type(v) is list else v for v in self.get_others(group))
        self.types = tuple(map(type, self.others))
        self.items = tuple(items)
        self.numbers = tuple(type(group[k]) for k in numbers)
        self.text = text

    @classmethod
    def of(cls, group: dict[Any, Any], text: str) -> _Group | None:
        """The template of `group`, whose text is `text`; None where it holds anything but plain values and
        flat lists or tuples of them."""
        if not set(map(type, group)) <= _PLAIN:
            return None
        numbers = [k for k, v in group.items() if type(v) is int or (type(v) is float and math.isfinite(v))]
        left_out = set(numbers)
        others = [k for k in group if k not in left_out]
        items: list[_Items] = []
        for i, k in enumerate(others):
            v = group[k]
            if type(v) in (list, tuple):
                if not set(map(type, v)) <= _ITEMS:
                    return None
                has_float = any(type(x) is float for x in v)
                items.append((i, tuple(map(type, v)), repr(v) if has_float else None))
            elif type(v) not in _PLAIN and type(v) is not float:  # a non-finite float stays: compared by ==
                return None
        mark = f"ds-number-{uuid.uuid4().hex}-"
        marked = {k: (f"{mark}{numbers.index(k)}" if k in left_out else v) for k, v in group.items()}
        pieces = _fresh(marked, []).replace("%", "%%")
        for i in range(len(numbers)):
            pieces = pieces.replace(json.dumps(f"{mark}{i}"), "%r", 1)
        template = cls(group, numbers, others, items, pieces)
        return template if template.text_of(group) == text else None

    def text_of(self, group: dict[Any, Any]) -> str | None:
        """`group`'s text where it fits this template, else None."""
        if type(group) is not dict or tuple(group) != self.keys:
            return None
        others = self.get_others(group)
        if others != self.others or tuple(map(type, others)) != self.types:
            return None
        for i, types, spelled in self.items:
            if tuple(map(type, others[i])) != types or (spelled is not None and repr(others[i]) != spelled):
                return None
        numbers = self.get_numbers(group)
        if tuple(map(type, numbers)) != self.numbers:
            return None
        if float in self.numbers and not all(math.isfinite(x) for x in numbers if type(x) is float):
            return None
        return self.text % numbers
