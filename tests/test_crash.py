"""Crash consistency: a process saving checkpoints in a loop is killed with SIGKILL at random moments. After
every kill, the checkpoint latest.txt names loads and verifies (every file, every checksum of the manifest,
the values of its step), every folder with a manifest is complete, and every file at a final path is whole;
only temporary files (dot-names) may be left over. Then a new process resumes from latest.txt."""

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine
from nanotron_datastates import format as fmt
from nanotron_datastates.checkpoint.checksums import file_checksums
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST

import crash_child
from helpers import small_config

TRIALS = int(os.environ.get("DATASTATES_CRASH_TRIALS", "100"))
# Kills go on past TRIALS until the events each test counts on have happened (a loaded machine saves less
# between two kills), up to this many.
MAX_TRIALS = 6 * TRIALS
EVENTS = max(1, TRIALS // 10)  # kills that must land on each kind of moment


def _expected(path: Path, step: int) -> dict:
    t = crash_child.tensors(step)
    return {"data": t["w"]} if path.parent.name == "model" else {"step": step, **t}


def _check_folder(engine: DataStatesEngine, folder: Path) -> None:
    doc = read_manifest(folder)
    step = doc["step"]
    assert folder.name == str(step)
    for rel in doc["files"]:
        path = folder / rel
        got = engine.load(path, verify=True, checksums=file_checksums(doc, folder, path))
        want = _expected(path, step)
        assert got.keys() == want.keys(), path
        for k, v in want.items():
            assert (got[k] == v) if not isinstance(v, torch.Tensor) else torch.equal(got[k], v), path


def _check(engine: DataStatesEngine, root: Path) -> tuple[int, int]:
    """Verifies the invariants; returns (latest step or 0, temporary files left over)."""
    latest = 0
    if (root / LATEST).exists():
        latest = int((root / LATEST).read_text())
        _check_folder(engine, root / str(latest))  # the checkpoint latest.txt names is whole
    temporaries = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if name.startswith("."):
                temporaries += 1
                continue
            if name.endswith(".safetensors"):
                header = fmt.read_header(path)  # whole: the header's sizes match the file
                assert header.file_size == path.stat().st_size
                engine.load(path, verify=True)  # embedded checksums, where the file has them
            if name == MANIFEST:
                _check_folder(engine, path.parent)
    return latest, temporaries


def _kill_while_saving(ctx, rng: random.Random, root: str, *tier: str) -> None:
    """Starts `crash_child.save_loop(root, ready, *tier)` in a process and SIGKILLs it at a random moment of
    its saving (0 to 0.3 s after it is ready)."""
    ready = ctx.Event()
    p = ctx.Process(target=crash_child.save_loop, args=(root, ready, *tier), daemon=True)
    p.start()
    assert ready.wait(60), "the saving process did not start"
    p.join(rng.uniform(0.0, 0.3))
    assert p.is_alive(), f"the saving process died on its own (exit code {p.exitcode})"
    p.kill()
    p.join()


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_the_latest_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nanotron_datastates", "crash_child"])
    rng = random.Random(1234)
    root = tmp_path / "ckpt"
    root.mkdir()
    seen_latest, mid_write = [0], 0
    with DataStatesEngine(small_config()) as engine:
        # The kills land everywhere: checkpoints committed between them, and some kills in a write.
        while len(seen_latest) <= TRIALS or (
            (seen_latest[-1] < EVENTS or mid_write < EVENTS) and len(seen_latest) <= MAX_TRIALS
        ):
            _kill_while_saving(ctx, rng, str(root))
            latest, temporaries = _check(engine, root)
            seen_latest.append(latest)
            mid_write += temporaries > 0
    assert seen_latest == sorted(seen_latest), "latest.txt went backwards"
    assert seen_latest[-1] >= EVENTS and mid_write >= EVENTS, (
        len(seen_latest) - 1,
        seen_latest[-1],
        mid_write,
    )
    trials = len(seen_latest) - 1
    print(json.dumps({"trials": trials, "latest": seen_latest[-1], "kills_leaving_temporaries": mid_write}))


@pytest.mark.slow
@pytest.mark.parametrize("copies", [2, 1])
def test_sigkill_with_the_memory_tier_restores_from_memory_only_a_whole_committed_copy(tmp_path, copies):
    """The same loop, each file's copy in a memory tier (a folder standing for /dev/shm) its save's host
    memory, recycled from an earlier step's files, each committed step marked held there. After every kill, a
    restart takes the step latest.txt names from memory where the tier holds it whole (`MemoryTier.holds`),
    else from storage: every file it reads verifies and holds that step's values, and the tier never marks a
    step storage has not committed. With one copy, each save overwrites the held step's files: kills land
    while they are half overwritten, and a restart never reads those."""
    from nanotron_datastates.tier.held_copy import holds
    from nanotron_datastates.tier.memory import MemoryTier

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nanotron_datastates", "crash_child"])
    rng = random.Random(4321)
    root, base = tmp_path / "ckpt", tmp_path / "shm"
    root.mkdir()
    tier = MemoryTier(base, root, 0, copies)
    from_memory = from_disk = mid_overwrite = trials = 0
    # Restarts find the newest checkpoint in memory unless the kill fell between its commit and its mark (a
    # wide window here, where checkpoints follow each other without pause; milliseconds in training). With
    # one copy the held step is withdrawn as soon as the next save starts, which here is at once.
    want_memory = EVENTS if copies == 2 else 0

    def enough() -> bool:
        return from_memory >= want_memory and mid_overwrite >= EVENTS

    with DataStatesEngine(small_config()) as engine:
        while trials < TRIALS or (not enough() and trials < MAX_TRIALS):
            trials += 1
            _kill_while_saving(ctx, rng, str(root), str(base), copies)
            # A file taken over by a save in flight: a temporary in the tier (recycled files are renamed).
            mid_overwrite += any(".dstmp." in p.name for p in tier.folder.rglob("*"))
            if not (root / LATEST).exists():
                continue
            latest = int((root / LATEST).read_text())
            doc = read_manifest(root / str(latest))
            held = [s for s in tier.steps() if list((tier.folder / str(s)).glob(".rank-*.json"))]
            # Never ahead of storage; two only where the kill fell between marking one and dropping the last.
            assert len(held) <= 2 and all(s <= latest for s in held), (held, latest)
            source = tier.folder / str(latest) if holds(tier, latest, doc) else root / str(latest)
            from_memory += source != root / str(latest)
            from_disk += source == root / str(latest)
            for rel in doc["files"]:
                got = engine.load(
                    source / rel, verify=True, checksums=file_checksums(doc, source, source / rel)
                )
                want = _expected(root / str(latest) / rel, latest)
                for k, v in want.items():
                    assert (got[k] == v) if not isinstance(v, torch.Tensor) else torch.equal(got[k], v), rel
    assert enough(), (trials, from_memory, from_disk, mid_overwrite)
    print(json.dumps({"trials": trials, "from_memory": from_memory, "from_disk": from_disk,
                      "mid_overwrite": mid_overwrite}))  # fmt: skip
