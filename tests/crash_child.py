"""The process that test_crash.py kills: saves checkpoints in a loop, committed as the Nanotron trainer
commits them (engine files, then the manifest, then latest.txt), keeping the newest three with the trainer's
rotation; with a memory tier, each file's copy there is its save's host memory (recycled from the spare, or
with one copy from the held step, as the trainer's Saver does) and each committed step marked held. Not a
test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIZE = 16 << 10  # elements per tensor


def tensors(step: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((SIZE,), float(step)), "b": torch.full((SIZE // 4,), float(-step))}


FILES = ("model/w0.safetensors", "model/w1.safetensors", "optimizer/optimizer.safetensors")


def save_loop(root_dir: str, ready: Any, tier_base: str | None = None, copies: int = 2) -> None:
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    from nanotron_datastates.checkpoint.file_io import write_atomic
    from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
    from nanotron_datastates.checkpoint.names import LATEST, MANIFEST
    from nanotron_datastates.save import housekeeping
    from nanotron_datastates.save.commit import Committer, PendingCheckpoint
    from nanotron_datastates.tier.memory import MemoryTier

    root = Path(root_dir)
    latest = root / LATEST
    step = int(latest.read_text()) + 1 if latest.exists() else 1
    engine = DataStatesEngine(
        DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1, parser_threads=2, flush_threads=2)
    )
    tier = MemoryTier(tier_base, root, 0, copies) if tier_base else None
    if tier:
        tier.prune(step - 1 if step > 1 else None)  # as the trainer's Saver does at its start

    def mark(result: Any) -> None:  # on the committer's thread, once committed (as the Saver's report)
        if tier and result.committed:
            tier.commit(result.step, result.mirrored)
            engine.keep_mirrors()

    committer = Committer(None, on_result=mark)
    ready.set()
    outstanding = 0
    while True:
        folder = root / str(step)
        mirrors = [tier.path(step, rel) if tier else None for rel in FILES]
        recycle = tier.recycle(step, list(FILES)) if tier else None
        plans = [
            # Like Nanotron's weight files: exact metadata, checksums in the manifest only.
            engine.plan({"data": tensors(step)["w"]}, metadata={"step": str(step)}, exact_metadata=True)
            for _ in range(2)
        ]
        plans.append(engine.plan({"step": step, **tensors(step)}))
        files = [(plan, folder / rel) for plan, rel in zip(plans, FILES)]
        handles = engine.save_plans(files, mirrors=mirrors, recycle=recycle)

        def finalize(files: dict[str, Any], folder: Path = folder, step: int = step) -> None:
            write_atomic(folder / MANIFEST, json.dumps(make_manifest(step, {}, files)))
            write_atomic(latest, str(step))

        committer.submit(PendingCheckpoint(step, folder, handles, finalize))
        outstanding += 1
        if outstanding == 2:  # the trainer's backpressure: at most two in flight
            (result,) = committer.take(1)
            outstanding -= 1
            housekeeping.remove_temporaries(result.folder)
            housekeeping.rotate(root, 3, result.step)
        step += 1
