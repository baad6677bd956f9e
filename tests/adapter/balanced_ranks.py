"""The ranks of cpu_ranks.py (its modes "balanced" and "tier-switch") saving with `balance_writes` on and off.

"balanced": each rank saves the same state twice, into `work/on/7` with the files its replicas hold alike
shared out among them and into `work/off/7` with rank 0 of them writing those, then Nanotron's own
`load_weights` reads `work/on/7` into a state built afresh. "tier-switch": one phase of a job whose setting
changes between restarts, the memory tier on (`BALANCED_PHASE`; see `tier_switch`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from cpu_ranks import differences, snapshot, step, training_metadata, training_state


def _finalizer(pc: Any, c: Any, optimizer: Any, checkpoints: Path, at: int) -> Any:
    from nanotron_datastates.nanotron.save.commit_files import finalizer

    if torch.distributed.get_rank() != 0:
        return None
    return functools.partial(finalizer, step=at, checkpoints=checkpoints, pc=pc, config=c,
                             model_config=c.model.model_config, optimizer=optimizer,
                             metadata=training_metadata(at))  # fmt: skip


def _written(saver: Any) -> list[str]:
    """The files this rank's Saver writes at every checkpoint, relative to the checkpoint's folder."""
    files = saver.files()
    listed = [*(p for p, _ in files.weights), files.optimizer, files.lr_scheduler, files.random]
    return sorted(Path(p).as_posix() for p in listed if p is not None)


def _save(pc: Any, c: Any, state: tuple[Any, ...], checkpoints: Path, at: int, settings: Any) -> Any:
    """The checkpoint of `at` saved and committed by a Saver with `settings`; the memory tier, where on, is
    left as a killed job leaves it (not released). Returns the Saver."""
    from nanotron_datastates import DataStatesEngine
    from nanotron_datastates.nanotron.save.saver import Saver

    model, optimizer, lr_scheduler, random_states = state
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
        saver = Saver(engine, settings, pc, model, optimizer, checkpoints)
        saver.start()
        saver.after_first_step()
        saver.request(at, lr_scheduler, random_states, _finalizer(pc, c, optimizer, checkpoints, at))
        saver.take(saver.outstanding, lambda s: None)
        saver.close()
    return saver


def balanced(pc: Any, c: Any, work: Path) -> dict[str, Any]:
    from nanotron.serialize.weights import load_weights

    from nanotron_datastates.nanotron import groups
    from nanotron_datastates.trainer_settings import TrainerSettings

    state = training_state(pc, c)
    saved = snapshot(*state)
    out: dict[str, Any] = {
        "replica": groups.rank(groups.dp_cp(pc)),
        "position": [groups.rank(pc.tp_pg), groups.rank(pc.pp_pg)],
    }
    for name, balance in (("on", True), ("off", False)):
        saver = _save(pc, c, state, work / name, 7, TrainerSettings(balance_writes=balance))
        out[name] = _written(saver)
    fresh = training_state(pc, c, seed=1)
    load_weights(model=fresh[0], parallel_context=pc, root_folder=work / "on" / "7")  # Nanotron's own
    out["stock_differences"] = differences(saved["model"], snapshot(*fresh)["model"])
    out["tensors"] = len(saved["model"])
    return out


def tier_switch(pc: Any, c: Any, work: Path) -> dict[str, Any]:
    """One phase of a job on one node, the memory tier on (BALANCED_COPIES copies), `balance_writes` as
    BALANCED_WRITES ("1" or "0") says. "save": checkpoint 7 saved, the job then killed. "switch": a restart
    resumes 7 (from the tier, where every rank finds it whole) into a state built afresh, steps and saves
    checkpoint 9, then is killed. "final": checkpoint 9 resumed from storage (the tier off), then from the
    tier. Each state saved is kept in `work/state-<step>-<rank>.pt`; each resume reports what differs."""
    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.trainer_settings import TrainerSettings

    phase, rank = os.environ["BALANCED_PHASE"], torch.distributed.get_rank()
    keys = {"memory_tier": True, "memory_tier_path": str(work / "shm"),
            "memory_tier_copies": int(os.environ["BALANCED_COPIES"]),
            "balance_writes": os.environ["BALANCED_WRITES"] == "1"}  # fmt: skip
    checkpoints = work / "ckpt"

    def keep(state: tuple[Any, ...], at: int) -> None:
        torch.save(snapshot(*state), work / f"state-{at}-{rank}.pt")

    def resume(at: int, tier: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        c.datastates = TrainerSettings.from_dict({**keys, "memory_tier": tier}, env=False)
        fresh = training_state(pc, c, seed=1)
        r = Resume()
        assert r.plan(c, pc, checkpoints / str(at), device=torch.device("cpu"))
        r.load_weights(fresh[0])
        r.load_rest(*fresh[1:], fresh[0])
        metadata = r.confirm()
        r.before_step()
        r.finish(close_engine=True)
        want = torch.load(work / f"state-{at}-{rank}.pt", weights_only=False)
        report = {
            "source": str(r.source) if r.source else None,
            "resumed_from": r.folder.name if r.folder else None,
            "last_train_step": metadata.last_train_step,
            "differences": differences(want, snapshot(*fresh)),
        }
        return fresh, report

    c.datastates = TrainerSettings.from_dict(keys, env=False)
    if phase == "save":
        state = training_state(pc, c)
        keep(state, 7)
        return {"writes": _written(_save(pc, c, state, checkpoints, 7, c.datastates))}
    if phase == "switch":
        state, report = resume(7, tier=True)
        step(*state[:2], 3)
        keep(state, 9)
        saver = _save(pc, c, state, checkpoints, 9, TrainerSettings.from_dict(keys, env=False))
        return {**report, "writes": _written(saver)}
    return {"storage": resume(9, tier=False)[1], "tier": resume(9, tier=True)[1]}


MODES = {"balanced": balanced, "tier-switch": tier_switch}
