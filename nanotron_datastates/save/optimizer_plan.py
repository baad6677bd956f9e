"""The optimizer's file, planned at each checkpoint like the last: its tensors are checked once, not at every
checkpoint (part of 2-4 ms of the stall on an H100), and its plain values (a learning rate, a step count)
are read at each checkpoint."""

from __future__ import annotations

import torch

from .. import skeleton, state_parts
from ..engine import DataStatesEngine
from .plan import SavePlan


class OptimizerPlans:
    """The plans of `optimizer`'s state, each made like `kept`, the last one."""

    def __init__(self, engine: DataStatesEngine, optimizer: torch.optim.Optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer
        self.kept: SavePlan | None = None  # the last plan, to plan the next checkpoint's like it
        self.part = (0, 1)  # (part, parts): the part of the state this rank writes (state_parts.py)

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
            if kept.holds(tensors):
                return kept, frozen
        return self.replan(state), None

    def replan(self, state: object) -> SavePlan:
        """`state` planned like the last checkpoint's optimizer plan, kept for the next one where it is."""
        plan = self.engine.plan(state, like=self.kept)
        if self.kept is not None:
            self.kept = plan
        return plan
