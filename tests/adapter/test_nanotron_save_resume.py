"""The adapter's Saver and Resume with the real engine, on Nanotron's real Llama, optimizer, scheduler and
random states (cpu_ranks.py): a checkpoint saved by every rank of a layout resumes bit for bit into a state
built afresh; commits rotate and write telemetry; a failed checkpoint raises and the next one commits; the
optimizer state read ahead waits for the first step. Runs against each Nanotron tree (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from cpu_ranks import config, launch, parallel_context, step, training_metadata, training_state
from nanotron.serialize.metadata import CheckpointMetadata

from nanotron_datastates import ChecksumError, DataStatesEngine
from nanotron_datastates.nanotron import housekeeping, layout, shards
from nanotron_datastates.nanotron.commit import CheckpointError
from nanotron_datastates.nanotron.finalize import finalizer
from nanotron_datastates.nanotron.resume import Resume
from nanotron_datastates.nanotron.saver import Saver
from nanotron_datastates.nanotron.settings import TrainerSettings

HAS_CP = "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}
LAYOUTS = [  # (world size, tp, dp, pp, cp, ZeRO stage)
    pytest.param((1, 1, 1, 1, 1, 0), id="single"),
    pytest.param((4, 2, 2, 1, 1, 1), id="tp2-dp2-zero1"),
]
if HAS_CP:
    LAYOUTS.append(pytest.param((2, 1, 1, 1, 2, 0), id="cp2"))


@pytest.mark.parametrize("key", LAYOUTS)
def test_every_rank_resumes_the_state_it_saved_bit_for_bit(key, tmp_path):
    world, tp, dp, pp, cp, zero = key
    for r in launch(tmp_path, world, tp, dp, pp, cp, zero, roundtrip=True):
        assert r["differences"] == [] and r["tensors"] > 20
        assert r["events"] == ["queue_start", "queued", "committed"]
        assert r["last_train_step"] == 7 and r["flags"] == [True, True]  # Nanotron's loaders' flags back
    assert layout.read_manifest(tmp_path / "ckpt" / "7")["topology"]["tp"] == tp


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """A gloo world of one, Nanotron's ParallelContext, config and trained state; an engine."""
    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    pc = parallel_context()
    c = config()
    engine = DataStatesEngine(host_cache_size=1 / 64, chunk_size=1)
    yield pc, c, training_state(pc, c), engine
    engine.close()
    tdist.destroy_process_group()


def saver_of(rank0, root: Path, **settings) -> Saver:
    pc, c, (model, optimizer, _, _), engine = rank0
    return Saver(engine, TrainerSettings(**settings), pc, model, optimizer, root)


def ask(saver: Saver, rank0, at: int) -> None:
    pc, c, (_, optimizer, lr_scheduler, random_states), _ = rank0
    finalize = finalizer(
        step=at,
        checkpoints=saver.checkpoints,
        pc=pc,
        config=c,
        model_config=c.model.model_config,
        optimizer=optimizer,
        metadata=training_metadata(at),
    )
    saver.request(at, lr_scheduler, random_states, finalize)


def test_commits_rotate_and_write_one_telemetry_line_each(rank0, tmp_path):
    root = tmp_path / "ckpt"
    saver = saver_of(rank0, root, keep_last_n=1)
    committed: list[int] = []
    for at in (10, 20, 30):
        saver.backpressure(committed.append)
        ask(saver, rank0, at)
        saver.before_step()
        step(*rank0[2][:2])
    saver.drain(committed.append)
    saver.close()
    assert committed == [10, 20, 30]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["30"]
    assert (root / layout.LATEST).read_text() == "30"
    lines = housekeeping.read_telemetry(root)
    assert [r["step"] for r in lines] == [10, 20, 30] and all(r["committed"] for r in lines)
    assert lines[-1]["removed"] == [str(root / "20")] and lines[-1]["cache_bytes"] > 0
    assert lines[-1]["bytes"] == sum(e["bytes"] for e in layout.read_manifest(root / "30")["files"].values())


def test_a_failed_checkpoint_raises_at_the_next_request_and_the_next_one_commits(rank0, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "10").write_text("not a folder")  # nothing can be written under it
    saver = saver_of(rank0, root)
    ask(saver, rank0, 10)
    saver.before_step()
    with pytest.raises(CheckpointError, match=r"checkpoint 10 at .*10 was not committed"):
        saver.take(1, lambda s: None)
    ask(saver, rank0, 20)  # the engine and the committer keep working
    saver.drain(lambda s: None)
    saver.close()
    assert (root / layout.LATEST).read_text() == "20"
    first, second = housekeeping.read_telemetry(root)
    assert not first["committed"] and first["errors"] and second["committed"]


def test_the_snapshot_holds_the_state_asked_for_and_the_step_waits_for_it(rank0, tmp_path):
    """Unstaged (no GPU), the files are queued in `request`; the step waits in `before_step` until every
    tensor is captured, then changes them."""
    pc, _, (model, optimizer, _, _), engine = rank0
    saver = saver_of(rank0, tmp_path / "ckpt")
    before = {
        path: p.detach().clone() for path, p, _ in shards.weight_shards(model, pc, tmp_path / "ckpt" / "5")
    }
    ask(saver, rank0, 5)
    saver.before_step()
    step(model, optimizer)
    saver.drain(lambda s: None)
    saver.close()
    assert len(before) > 5
    for path, want in before.items():
        assert torch.equal(engine.load(path)["data"], want), path


def saved_checkpoint(rank0, root: Path) -> Path:
    saver = saver_of(rank0, root)
    ask(saver, rank0, 7)
    saver.drain(lambda s: None)
    saver.close()
    return root / "7"


def test_the_optimizer_state_read_ahead_is_loaded_at_the_first_step_or_state_dict(rank0, tmp_path):
    pc, c, (_, optimizer, _, _), _ = rank0
    folder = saved_checkpoint(rank0, tmp_path / "ckpt")
    want = optimizer.state_dict()
    model, fresh, lr_scheduler, random_states = training_state(pc, c, seed=1)
    resume = Resume()
    assert resume.plan(c, pc, folder, device=torch.device("cpu")) and resume.prefetch is not None
    assert (c.checkpoints.load_optimizer, c.checkpoints.load_lr_scheduler) == (False, False)  # Nanotron's off
    resume.load_weights(model)
    resume.load_rest(fresh, lr_scheduler, random_states, model)
    assert resume.state == "loaded"  # the optimizer's load waits for its first use
    got = fresh.state_dict()  # a first use: loads it
    assert resume.state == "done" and torch.equal(got["state"][0]["exp_avg"], want["state"][0]["exp_avg"])


def test_a_failed_optimizer_load_stays_pending_and_no_step_runs_on_the_old_state(rank0, tmp_path):
    pc, c, _, _ = rank0
    folder = saved_checkpoint(rank0, tmp_path / "ckpt")
    (opt_file,) = (folder / "optimizer").glob("*.safetensors")
    good = opt_file.read_bytes()
    opt_file.write_bytes(good[:-12] + bytes([good[-12] ^ 0xFF]) + good[-11:])  # one byte of its data
    model, fresh, lr_scheduler, random_states = training_state(pc, c, seed=1)
    resume = Resume()
    resume.plan(c, pc, folder, device=torch.device("cpu"))
    resume.load_weights(model)
    resume.load_rest(fresh, lr_scheduler, random_states, model)
    with pytest.raises(ChecksumError, match=opt_file.name):
        resume.before_step()
    assert resume.state == "loaded"  # still pending
    opt_file.write_bytes(good)  # repaired: the next call loads it
    resume.before_step()
    assert resume.state == "done"


def test_a_checkpoint_without_a_manifest_is_left_to_nanotron(rank0, tmp_path):
    pc, c, _, _ = rank0
    (tmp_path / "stock" / "3").mkdir(parents=True)
    resume = Resume()
    assert not resume.plan(c, pc, tmp_path / "stock" / "3") and not resume.active
    assert not resume.plan(c, pc, None)
    assert (c.checkpoints.load_optimizer, c.checkpoints.load_lr_scheduler) == (True, True)  # untouched


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused_at_plan(rank0, tmp_path):
    pc, c, _, _ = rank0
    folder = saved_checkpoint(rank0, tmp_path / "ckpt")
    doc = json.loads((folder / layout.MANIFEST).read_text())
    doc["files"]["model/../../outside.safetensors"] = {"bytes": 1}
    (folder / layout.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(layout.ManifestError, match=r"model/\.\./\.\./outside\.safetensors"):
        Resume().plan(c, pc, folder)
