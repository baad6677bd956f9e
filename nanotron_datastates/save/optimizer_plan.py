"""The optimizer's file, planned at each checkpoint like the last: its tensors are checked once, not at every
checkpoint (part of 2-4 ms of the stall on an H100), and its plain values (a learning rate, a step count)
are read at each checkpoint. Where a staged checkpoint's tensors were found held before the step, the
per-parameter state (dicts of tensors only) and the fp32 weights that Nanotron's gradient accumulator adds
to it are not even walked again: their encoding is the last plan's."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from .. import skeleton, state_parts
from ..engine import DataStatesEngine
from ..skeleton_text import Texts
from .plan import SavePlan, plan_again, plan_save


class OptimizerPlans:
    """The plans of `optimizer`'s state, each made like `kept`, the last one."""

    def __init__(self, engine: DataStatesEngine, optimizer: torch.optim.Optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer
        self.kept: SavePlan | None = None  # the last plan, to plan the next checkpoint's like it
        self.part = (0, 1)  # (part, parts): the part of the state this rank writes (state_parts.py)
        # What `replan_held` reuses, replaced whole (never changed: the queuer's thread and the training
        # thread may plan at once): the kept plan's state's top-level keys in order, and its values made of
        # dicts of tensors only, encoded, with their keys (`_tensor_dicts`)
        self._reuse = _Reuse([], {}, {}, Texts())

    def state(self) -> object:
        """The optimizer's state this rank writes: all of it, or its part."""
        return state_parts.split(self.optimizer.state_dict(), *self.part)

    def first(self) -> SavePlan:
        """After the first step (the state exists from then on): the state planned, then planned like that
        first plan, as each checkpoint will plan it."""
        first = self.engine.plan(self.state())
        again = self.engine.plan(self.state(), like=first)
        # Kept to plan the next checkpoint like it only where the optimizer hands out its own tensors: a
        # kept plan of copies would hold on to a copy of the whole state.
        if any(a is b for a, b in zip(again.arrays, first.arrays)):
            self.kept = again
        return again

    def for_checkpoint(self, staged_before_step: bool) -> tuple[SavePlan, object | None]:
        """(the plan for a checkpoint, the copy of the state's containers to plan it from once the step is
        launched, or None). Where the checkpoint is staged before the step and queued after it, and the
        optimizer still holds the tensors of the kept plan, that kept plan is staged now and the plan itself
        is made once the step is launched (`replan`), beside the step's GPU work, from a copy of the state's
        containers (`skeleton.freeze`, under half a plan's cost): the step may change plain values in the
        optimizer's own containers (a step count), never in the copy."""
        kept = self.kept
        state = self.state()
        if staged_before_step and kept is not None:
            frozen, tensors = skeleton.freeze(state)
            # The same tensor objects, in order: the staging's `prepare.current` then checks (and renews)
            # what the kept plan says of them, as it does for every file, so that is not done twice here.
            if len(tensors) == len(kept.sources) and all(map(operator.is_, tensors, kept.sources)):
                return kept, frozen
        return self.replan(state), None

    def replan(self, state: object) -> SavePlan:
        """`state` planned like the last checkpoint's optimizer plan, kept for the next one where it is."""
        encoded: dict[object, object] = {}
        plan = plan_save(state, like=self.kept, keep=encoded)
        if self.kept is not None:
            reuse = _Reuse(list(state) if type(state) is dict else [], {}, {}, Texts())
            for key, value in state.items() if type(state) is dict else ():
                layout = _tensor_dicts(value)
                if layout is not None and key in encoded:
                    reuse.encoded[key], reuse.layouts[key] = encoded[key], layout[0]
            self.kept, self._reuse = plan, reuse
        return plan

    def replan_held(self, frozen: object) -> SavePlan:
        """`replan` of a copy of the state's containers whose tensors the kept plan held (`for_checkpoint`):
        where its dicts of tensors only are laid out as the kept plan's were, over the same tensors in the
        same order, their encoding is reused and only the rest (the param groups) walked."""
        kept, reuse = self.kept, self._reuse
        if kept is None or not reuse.encoded or type(frozen) is not dict or list(frozen) != reuse.keys:
            return self.replan(frozen)
        tensors: list[torch.Tensor] = []
        for key, layout in reuse.layouts.items():
            found = _tensor_dicts(frozen.get(key))
            if found is None or found[0] != layout:
                return self.replan(frozen)
            tensors += found[1]
        if len(tensors) != len(kept.sources) or not all(map(operator.is_, tensors, kept.sources)):
            return self.replan(frozen)
        plan = plan_again(frozen, kept, reuse.encoded, reuse.texts)
        if plan is None:
            return self.replan(frozen)
        self.kept = plan
        return plan


# A dict of dicts' keys, (key, the inner dict's keys) each; or a dict of tensors' keys, (key, None) each
Layout = list[tuple[object, "tuple[object, ...] | None"]]


class _Reuse(NamedTuple):
    keys: list[object]
    encoded: dict[object, object]
    layouts: dict[object, Layout]
    texts: Texts  # the skeleton's text kept from one plan to the next (skeleton_text.py)


def _tensor_dicts(value: object) -> tuple[Layout, list[torch.Tensor]] | None:
    """(the keys, the tensors in order) of a dict of dicts of tensors only (an optimizer's per-parameter
    state), or of a dict of tensors only (Nanotron's fp32 gradient accumulator's weights, by name, which its
    optimizer's state holds beside), else None."""
    if type(value) is not dict or not value:
        return None
    if set(map(type, value.values())) <= skeleton.TENSOR_TYPES:
        return [(k, None) for k in value], list(value.values())
    layout: Layout = []
    tensors: list[torch.Tensor] = []
    for k, inner in value.items():
        if type(inner) is not dict or not set(map(type, inner.values())) <= skeleton.TENSOR_TYPES:
            return None
        layout.append((k, tuple(inner)))
        tensors += inner.values()
    return layout, tensors
