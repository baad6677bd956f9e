"""Save, stage 0 at each save (caller's thread): what a save of planned files hands the core now. Each plan
renewed where its tensors changed since planned (`current`); each CUDA device's current stream noted (the core
records an event there); CUDA views made contiguous on that stream, or, when staging, every tensor copied
where it is (stage.py), with an event after the copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import _core
from .plan import SavePlan, export_view
from .stage import Stager


def current(plans: Sequence[SavePlan], paths: Sequence[str]) -> list[SavePlan]:
    """What a save of `plans` (to `paths`) writes: each plan renewed where its tensors changed since planned
    (`SavePlan.renew`: the check `holds` makes, then nothing more for a plan that still describes them),
    then copied, so that a later renewal of the plan leaves this save's alone (a staged save)."""
    out = []
    for plan, path in zip(plans, paths):
        plan.renew(path)
        out.append(plan.copy())
    return out


def prepare(plan: SavePlan, *, stage: bool = False) -> SavePlan:
    """What a save of `plan` hands the core now: each device's current stream, and fresh contiguous copies
    of the CUDA views that need one. With `stage`, every tensor is copied (on its own device, in the
    caller's stream order): the save then reads those copies, and the caller may change the originals at
    once."""
    return prepare_many([plan], stage=stage)[0]


@dataclass
class Prepared:
    """What a save of several plans hands the core now, per file: the arrays to read (staged copies, or
    the tensors with their non-contiguous CUDA views made contiguous), their places in the staged buffers,
    and each CUDA device's current stream; and the staged buffers."""

    arrays: list[list[torch.Tensor]]
    views: list[list[_core.StagedView]]
    streams: list[list[tuple[int, int]]]
    bases: list[torch.Tensor]
    # Per CUDA device, an event recorded right after the staging copies (where asked for): the core's
    # copies then follow those, not what the caller launches between the staging and the queuing.
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)


def prepare_all(
    plans: Sequence[SavePlan],
    *,
    stage: bool = False,
    stager: Stager | None = None,
    events: bool = False,
    keep: bool = False,
) -> Prepared:
    """:func:`prepare_many`'s work without a copy of each plan (what a save of a checkpoint's many files
    does on the caller's thread). `events`: staged, an event recorded on each device's stream after the
    copies (`Prepared.events`). `keep`: the staging's buffers kept by `stager` (`Stager.stage`)."""
    arrays = [list(p.arrays) for p in plans]
    views: list[list[_core.StagedView]] = [[] for _ in plans]
    bases: list[torch.Tensor] = []
    if stage:  # every tensor copied, the non-contiguous ones too (the plans' entries: checked by `current`)
        bases = (stager or Stager()).stage(arrays, views, [p.keys for p in plans], keep=keep)
    else:
        for k, p in enumerate(plans):
            for i, t in p.gathered:  # queued on the caller's stream, before the event the core records
                arrays[k][i] = export_view(t.contiguous())
    current: dict[int, tuple[int, int]] = {}  # each device's current stream, asked for once
    streams = []
    for p in plans:
        for d in p.devices:
            if d not in current:
                current[d] = (d, torch.cuda.current_stream(d).cuda_stream)
        streams.append([current[d] for d in p.devices])
    recorded = {}
    if stage and events:
        for base in bases:
            if base.is_cuda:
                recorded[base.device.index] = torch.cuda.Event()
                recorded[base.device.index].record(torch.cuda.current_stream(base.device))
    return Prepared(arrays, views, streams, bases, recorded)


def prepare_many(
    plans: Sequence[SavePlan], *, stage: bool = False, stager: Stager | None = None
) -> list[SavePlan]:
    """:func:`prepare` for several plans saved together (a checkpoint's files). Staged, their copies share one
    allocation per device, filled by one multi-tensor copy per dtype: a few kernel launches on the caller's
    thread instead of an allocation and a copy per tensor (stage.py; `stager` keeps the layout for the next
    call that stages the same tensors)."""
    plans = current(plans, [""] * len(plans))
    prep = prepare_all(plans, stage=stage, stager=stager)
    return [
        dataclasses.replace(p, arrays=a, views=v, bases=prep.bases, streams=s)
        for p, a, v, s in zip(plans, prep.arrays, prep.views, prep.streams)
    ]
