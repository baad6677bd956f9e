"""The adapter's Saver and Resume with the real engine, on Nanotron's real Llama, optimizer, scheduler and
random states (cpu_ranks.py): a checkpoint saved by every rank of a layout resumes bit for bit into a state
built afresh; commits rotate and write telemetry; a failed checkpoint raises and the next one commits; the
optimizer state read ahead waits for the first step. Runs against each Nanotron tree (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import yaml
from cpu_ranks import (
    differences,
    launch,
    snapshot,
    step,
    training_metadata,
    training_state,
)
from nanotron.serialize.metadata import CheckpointMetadata

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST
from nanotron_datastates.nanotron import shards
from nanotron_datastates.nanotron.resume.resume import Resume
from nanotron_datastates.nanotron.save.commit_files import finalizer
from nanotron_datastates.nanotron.save.saver import Saver
from nanotron_datastates.save import housekeeping
from nanotron_datastates.save.commit import CheckpointError
from nanotron_datastates.tier.held_copy import why_not
from nanotron_datastates.tier.memory import TierError
from nanotron_datastates.tier.room import check_room
from nanotron_datastates.trainer_settings import TrainerSettings

from helpers import mapped_at, wait_until

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
    assert read_manifest(tmp_path / "ckpt" / "7")["topology"]["tp"] == tp


@pytest.mark.parametrize("process", ["never", "auto"])
def test_a_lost_node_resumes_every_rank_from_memory_through_its_peers_replicas(
    tmp_path, monkeypatch, process
):
    """tp=2 x dp=2 with ZeRO-1 on two simulated nodes: each node's ranks write part of the weights (shared out
    among the replicas, `balance_writes`); the second node loses its memory tier, and the resume pulls its
    ranks' files from the replicas the first node keeps and the rest of the weights from that node's own
    copies, and every tensor is the one saved. `process`: `memory_replica_process`; `auto`, with the job's
    store in the environment as under torchrun, has the replicas sent by a process of each rank's own."""
    monkeypatch.setenv("CPU_RANKS_REPLICAS", "1")
    monkeypatch.setenv("CPU_RANKS_REPLICA_PROCESS", process)
    if process == "auto":
        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
    out = launch(tmp_path, 4, 2, 2, 1, 1, 1, roundtrip=True)
    for r in out:
        assert r["differences"] == [] and r["tensors"] > 20
        assert r["events"] == ["queue_start", "queued", "committed", "replicated"], r["events"]
        assert r["source"] and r["source"].startswith(str(tmp_path / f"node{r['node']}-shm")), r
        assert r["held"] == [7], r  # the lost node's ranks mark what they pulled, as their saves did
    doc = read_manifest(tmp_path / "ckpt" / "7")
    assert doc["replicas"]["holders"] == [[2], [3], [0], [1]]
    # the bytes the checkpoint sent over the network, and the time, in rank 0's telemetry: every file once
    (line,) = [r for r in housekeeping.read_telemetry(tmp_path / "ckpt") if r.get("event") == "replicated"]
    assert line["step"] == 7 and line["errors"] == [] and line["seconds"] > 0, line
    assert line["sent_bytes"] == sum(e["bytes"] for e in doc["files"].values()), line
    assert [r["to"] for r in line["ranks"]] == [[2], [3], [0], [1]]
    assert {r["transport"] for r in line["ranks"]} == {"gloo-process" if process == "auto" else "gloo"}
    assert sum(r["received_bytes"] for r in line["ranks"]) == line["sent_bytes"]
    pulled = [p for p in (tmp_path / "node1-shm").rglob("*.safetensors") if "replicas" not in p.parts]
    assert any("model" in p.parts for p in pulled) and any("optimizer" in p.parts for p in pulled), pulled


@pytest.mark.parametrize(("replicas", "summed"), [(0, False), (1, True)])
def test_a_restart_resumes_the_newest_memory_checkpoint_the_nodes_hold_whole(
    tmp_path, monkeypatch, replicas, summed
):
    """Storage holds step 7; a memory checkpoint of step 9 (memory_interval 3) is in node memory only. The job
    crashes (with replicas: the second node is lost too) and every rank resumes step 9, bit for bit, from
    its node's tier (what a lost node lacks pulled from its peers'); the metadata is step 9's. Its files are
    summed only with `memory_checksums` (the manifest's entries then hold their checksums)."""
    monkeypatch.setenv("CPU_RANKS_MEMORY", "1")
    monkeypatch.setenv("CPU_RANKS_REPLICAS", str(replicas))
    monkeypatch.setenv("CPU_RANKS_MEMORY_CHECKSUMS", str(int(summed)))
    out = launch(tmp_path, 4 if replicas else 2, 1, 4 if replicas else 2, 1, 1, 1, roundtrip=True)
    for r in out:
        assert r["differences"] == [] and r["tensors"] > 20, r["differences"]
        assert r["summed"] == [summed], r["unsummed"]
        assert r["last_train_step"] == 9
        here = tmp_path / f"node{r['node']}-shm"
        assert r["folder"].startswith(str(here)) and r["folder"].endswith("/9"), r
        assert r["source"] == r["folder"] and 9 in r["held"], r
        done = ["queue_start", "queued", "committed"] + (["replicated"] if replicas else [])
        assert sorted(r["events"]) == sorted(done * 2), r["events"]
    assert not (tmp_path / "ckpt" / "9").exists()  # nothing of it in storage
    assert (tmp_path / "ckpt" / "latest.txt").read_text().strip() == "7"
    lines = housekeeping.read_telemetry(tmp_path / "ckpt")
    assert [(x["step"], x.get("memory", False)) for x in lines if "event" not in x] == [(7, False), (9, True)]


def saver_of(rank0, root: Path, **settings) -> Saver:
    pc, c, (model, optimizer, _, _), engine = rank0
    return Saver(engine, TrainerSettings(**settings), pc, model, optimizer, root)


def ask(saver: Saver, rank0, at: int) -> None:
    pc, c, (_, optimizer, lr_scheduler, random_states), _ = rank0
    finalize = functools.partial(
        finalizer,
        step=at,
        checkpoints=saver.checkpoints,
        pc=pc,
        config=c,
        model_config=c.model.model_config,
        optimizer=optimizer,
        metadata=training_metadata(at),
    )
    saver.request(at, lr_scheduler, random_states, finalize)


def test_the_weights_chunks_are_pinned_when_the_trainer_is_built_the_optimizers_after_the_first_step(
    rank0, tmp_path
):
    # Pinning holds the CUDA driver's locks: what is known at start-up is prepared while Nanotron builds its
    # data loader, the optimizer's part (its state exists from the first step on) after the first step.
    pc, c, (model, optimizer, _, _), _ = rank0
    with DataStatesEngine(host_cache_size=1 / 16, chunk_size=1) as engine:  # 64 chunks of 1 MiB
        saver = Saver(engine, TrainerSettings(), pc, model, optimizer, tmp_path / "ckpt")
        chunk, chunks = engine.cache_stats()["chunk_bytes"], engine.cache_stats()["chunks"]
        weights = sum(-(-p.nbytes // chunk) for _, p in saver.files().weights) + 2
        whole = weights + -(-engine.plan(optimizer.state_dict()).nbytes // chunk)
        assert 1 < weights < whole < chunks
        assert engine.cache_stats()["prepared"] == 1  # the first chunk, which decides whether pinning works
        saver.start()
        assert wait_until(lambda: engine.cache_stats()["prepared"] == weights), engine.cache_stats()
        saver.after_first_step()
        assert wait_until(lambda: engine.cache_stats()["prepared"] == whole), engine.cache_stats()
        saver.close()


def test_commits_rotate_and_write_one_telemetry_line_each(rank0, tmp_path):
    root = tmp_path / "ckpt"
    saver = saver_of(rank0, root, keep_last_n=1)  # kept: 2, the least that leaves one to fall back to
    committed: list[int] = []
    for at in (10, 20, 30):
        saver.backpressure(committed.append)
        ask(saver, rank0, at)
        saver.before_step()
        step(*rank0[2][:2])
    saver.drain(committed.append)
    saver.close()
    assert committed == [10, 20, 30]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["20", "30"]
    assert (root / LATEST).read_text() == "30"
    lines = housekeeping.read_telemetry(root)
    assert [r["step"] for r in lines] == [10, 20, 30] and all(r["committed"] for r in lines)
    assert lines[-1]["removed"] == [str(root / "10")] and lines[-1]["cache_bytes"] > 0
    assert lines[-1]["bytes"] == sum(e["bytes"] for e in read_manifest(root / "30")["files"].values())
    from nanotron.config.utils_config import serialize

    # config.yaml as Nanotron's own save_as_yaml writes it (yaml.dump of the serialized config)
    assert (root / "30" / "config.yaml").read_text() == yaml.dump(serialize(rank0[1]))


def test_config_yaml_holds_the_counters_of_the_request_though_the_committer_writes_it_later(rank0, tmp_path):
    """The committer serializes the config when it commits; the two counters Nanotron sets at a save are
    the ones the checkpoint was asked with, though the next save has moved them on since."""
    from nanotron.config.utils_config import serialize

    _, c, state, _ = rank0
    root = tmp_path / "ckpt"
    saver = saver_of(rank0, root)
    c.general.step, c.general.consumed_train_samples = 10, 80
    ask(saver, rank0, 10)
    saver.before_step()  # the files queued: what training changes is captured
    expected = yaml.dump(serialize(c))
    c.general.step, c.general.consumed_train_samples = 11, 88  # as the next save sets them
    step(*state[:2])
    saver.drain(lambda s: None)
    saver.close()
    assert (root / "10" / "config.yaml").read_text() == expected
    assert yaml.safe_load(expected)["general"]["step"] == 10


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
    assert (root / LATEST).read_text() == "20"
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


def test_a_step_waits_for_the_states_files_only_and_the_request_files_are_queued_first(rank0, tmp_path):
    """The scheduler's and random states' files hold copies of the host values of the request, which nothing
    changes: queued first (a cache smaller than the checkpoint takes them before the state's pieces) and
    never waited for by a step; so the state's files alone are staged, with the kept layout, on a GPU."""
    random_states = rank0[2][3]
    saver = saver_of(rank0, tmp_path / "ckpt")
    folder = (tmp_path / "ckpt" / "5").resolve()
    calls, save_plans = [], saver.engine.save_plans

    def recorded(files, **kw):  # the engine's own call, each call's files noted
        calls.append({Path(path).relative_to(folder).parts[0]: plan for plan, path in files})
        return save_plans(files, **kw)

    saver.engine.save_plans = recorded
    try:
        ask(saver, rank0, 5)
        gated = {Path(h.path).relative_to(folder).parts[0] for hs, _ in saver.gate._pending for h in hs}
        saver.before_step()
        saver.drain(lambda s: None)
        saver.close()
    finally:
        del saver.engine.save_plans
    assert [sorted(c) for c in calls] == [["lr_scheduler", "random"], ["model", "optimizer"]]
    assert gated == {"model", "optimizer"}
    theirs = {s.torch_cpu.data_ptr() for s in random_states.values()}
    assert theirs and not theirs & {a.data_ptr() for a in calls[0]["random"].arrays}  # copies


def saved_checkpoint(rank0, root: Path, at: int = 7, **settings) -> Path:
    saver = saver_of(rank0, root, **settings)
    ask(saver, rank0, at)
    saver.drain(lambda s: None)
    saver.close()
    return root / str(at)


def two_checkpoints(rank0, root: Path, **settings) -> tuple[dict, dict]:
    """Checkpoints 5 and 7 of the trained state (a step taken between them), both committed, and training
    then cut short (no end of training: the memory tier keeps its copy); their snapshots."""
    pc, c, state, _ = rank0
    saver = saver_of(rank0, root, **settings)
    ask(saver, rank0, 5)
    saver.before_step()
    first = snapshot(*state)
    step(*state[:2], 2)
    ask(saver, rank0, 7)
    saver.take(saver.outstanding, lambda s: None)
    saver.close()
    return first, snapshot(*state)


def resumed(rank0, folder: Path, **settings) -> tuple[Resume, dict, Any]:
    """A state built afresh, resumed from `folder`: (the Resume, the state's snapshot, the metadata)."""
    pc, c, _, _ = rank0
    if settings:
        c.datastates = TrainerSettings.from_dict({**c.datastates.to_dict(), **settings})
    model, optimizer, lr_scheduler, random_states = training_state(pc, c, seed=1)
    resume = Resume()
    assert resume.plan(c, pc, folder, device=torch.device("cpu"))
    resume.load_weights(model)
    resume.load_rest(optimizer, lr_scheduler, random_states, model)
    metadata = resume.confirm()
    resume.before_step()
    return resume, snapshot(model, optimizer, lr_scheduler, random_states), metadata


def test_each_checkpoint_plans_the_optimizer_like_the_last_and_saves_the_values_of_its_time(rank0, tmp_path):
    # The optimizer's tensors are checked once, not at every checkpoint (part of 2-4 ms of the stall on the
    # H100); its learning rate, a plain value, is read at each checkpoint.
    pc, c, state, _ = rank0
    optimizer = state[1]
    saver = saver_of(rank0, tmp_path / "ckpt")
    saver.start()
    saver.after_first_step()
    kept = saver.optimizer_plans.kept
    assert kept is not None  # Nanotron's optimizer hands out its own tensors, not copies
    ask(saver, rank0, 5)
    saver.before_step()
    step(*state[:2], 1)
    for group in optimizer.param_groups:
        group["lr"] = 0.123
    ask(saver, rank0, 7)
    saver.take(saver.outstanding, lambda s: None)
    saver.close()
    assert saver.optimizer_plans.kept is not kept and saver.optimizer_plans.kept.arrays[0] is kept.arrays[0]
    _, got, _ = resumed(rank0, tmp_path / "ckpt" / "7")
    assert {g["lr"] for g in got["optimizer"]["param_groups"]} == {0.123}
    want = snapshot(*state)
    got.pop("random"), want.pop("random")
    assert differences(want, got) == []


def test_a_staged_checkpoint_is_captured_beside_the_passes_and_queued_by_the_queuer_once_the_step_is_launched(
    rank0, tmp_path
):
    """`queue_at_step` with the state staged (`device_snapshot: always`; without a GPU, in host memory): the
    request copies the random states and hands the capture to the saver's queuer thread, which stages the
    state beside the next passes; the step's start makes sure of it; rank 0's commit is made once the step
    is launched (`after_step`, from the trainer's wrapper), on the training thread, and the files are
    queued on the queuer thread. The checkpoint holds the state of the request all the same."""
    pc, c, state, _ = rank0
    model, optimizer, lr_scheduler, random_states = state
    saver = saver_of(rank0, tmp_path / "ckpt", device_snapshot="always")
    saver.start()
    saver.after_first_step()
    made, events = [], []
    threads = {}
    saver.observers.append(lambda event, fields: events.append(event))
    saver.observers.append(lambda event, _: threads.setdefault(event, threading.current_thread().name))

    def commit():
        made.append(len(events))
        return finalizer(step=5, checkpoints=saver.checkpoints, pc=pc, config=c,
                         model_config=c.model.model_config, optimizer=optimizer,
                         metadata=training_metadata(5))  # fmt: skip

    asked = snapshot(*state)
    saver.request(5, lr_scheduler, random_states, commit)
    assert saver.gate.deferred == 2 and made == []
    torch.rand(3)  # the next forward pass draws random numbers
    saver.before_step()
    assert saver.gate.deferred == 1 and events == ["queue_start"] and made == []
    assert not (tmp_path / "ckpt" / "5").exists()  # nothing handed to the engine yet
    step(model, optimizer)  # the step changes the state staged before it
    saver.after_step()
    assert saver.gate.deferred == 0 and made == [1]
    saver.queuing.drain()
    assert events == ["queue_start", "queued"]
    assert threads == {"queue_start": "datastates-queuer", "queued": "datastates-queuer"}
    saver.drain(lambda s: None)
    saver.close()
    assert events[-1] == "committed"
    _, got, metadata = resumed(rank0, tmp_path / "ckpt" / "5")
    assert metadata.last_train_step == 5
    assert differences(asked, got) == []


def test_the_step_waits_for_a_capture_that_the_busy_queuer_has_not_run_yet(rank0, tmp_path):
    """The queuer's thread still busy (with an older checkpoint's queuing, say) when a staged checkpoint is
    asked for: the next optimizer step's start waits until the queuer has staged the state, and the
    checkpoint holds the state of the request, not the step's."""
    _, _, state, _ = rank0
    model, optimizer, _, _ = state
    saver = saver_of(rank0, tmp_path / "ckpt", device_snapshot="always")
    saver.start()
    saver.after_first_step()
    busy, waited = threading.Event(), []
    saver.queuing.queuer.submit(busy.wait)
    asked = snapshot(*state)
    ask(saver, rank0, 5)
    before = threading.Thread(target=lambda: waited.append(saver.before_step()))
    before.start()
    before.join(0.5)
    assert before.is_alive()  # a step now would change the state before it is staged
    busy.set()
    before.join(30)
    assert not before.is_alive() and waited == [0.0]  # staged: no snapshot to wait for
    step(model, optimizer)
    saver.after_step()
    saver.drain(lambda s: None)
    saver.close()
    _, got, _ = resumed(rank0, tmp_path / "ckpt" / "5")
    assert differences(asked, got) == []


def test_a_capture_the_stuck_queuer_never_runs_fails_its_checkpoint_by_name_and_training_goes_on(
    rank0, tmp_path
):
    """The queuer's thread stuck past `capture_timeout`: the step waits no longer, the checkpoint is
    reported failed with the reason (never committed half-captured), and the next one is taken."""
    _, _, state, _ = rank0
    model, optimizer, _, _ = state
    saver = saver_of(rank0, tmp_path / "ckpt", device_snapshot="always")
    saver.start()
    saver.after_first_step()
    saver.queuing.capture_timeout = 0.2
    stuck = threading.Event()
    saver.queuing.queuer.submit(stuck.wait)
    ask(saver, rank0, 5)
    assert saver.before_step() == 0.0
    step(model, optimizer)
    saver.after_step()
    stuck.set()
    with pytest.raises(CheckpointError, match="checkpoint 5 .*not captured within 0.2 s"):
        saver.take(saver.outstanding, lambda s: None)
    ask(saver, rank0, 6)
    saver.before_step()
    saver.after_step()
    saver.drain(lambda s: None)
    saver.close()
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == "6"


def test_the_random_states_a_request_keeps_are_copies_that_later_draws_and_changes_do_not_reach():
    """The request's random states are made of copies: the generators' draws after it (the next forward
    pass) and a change in place to Nanotron's RandomState tensors leave them as they were."""
    import copy
    import random

    import numpy as np
    from nanotron.random import RandomStates, get_current_random_state

    from nanotron_datastates.nanotron.save.request import random_state

    ours = RandomStates({"tp_synced": get_current_random_state()})
    kept = random_state(ours)
    want = copy.deepcopy(kept)
    torch.rand(3), np.random.rand(), random.random()
    ours["tp_synced"].torch_cpu.zero_()
    assert differences(want, kept) == []
    assert differences(want, random_state(ours)) != []


def counting_steps(optimizer) -> None:
    """Each parameter's optimizer state gets a plain value that every optimizer step changes in place (as an
    optimizer that keeps its step count as a Python number does)."""
    base = optimizer.get_base_optimizer()
    for s in base.state.values():
        s["calls"] = 0
    plain_step = base.step

    def step_and_count(*a, **k):
        out = plain_step(*a, **k)
        for s in base.state.values():
            s["calls"] += 1
        return out

    base.step = step_and_count


def staged_saver(rank0, root: Path) -> Saver:
    """A Saver whose checkpoints are staged (in host memory without a GPU), past the first step."""
    saver = saver_of(rank0, root, device_snapshot="always")
    saver.start()
    saver.after_first_step()
    return saver


def step_and_drain(saver: Saver, model, optimizer) -> None:
    """The optimizer step after a checkpoint's capture, its queuing once launched, then every commit."""
    step(model, optimizer)
    saver.after_step()
    saver.drain(lambda s: None)
    saver.close()


def test_a_staged_checkpoints_optimizer_plan_is_made_after_the_step_from_the_state_before_it(rank0, tmp_path):
    """The optimizer still holds the tensors of the plan kept from the last checkpoint: that plan is staged at
    the step's start, and the plan itself made once the step is launched, from a copy of the state's
    containers taken before the step. A plain value the step changes in the optimizer's own containers is
    saved as it was at the request."""
    pc, c, state, _ = rank0
    model, optimizer, lr_scheduler, random_states = state
    counting_steps(optimizer)
    saver = staged_saver(rank0, tmp_path / "ckpt")
    kept = saver.optimizer_plans.kept
    assert kept is not None
    asked = snapshot(*state)
    ask(saver, rank0, 5)
    saver.before_step()
    assert saver.optimizer_plans.kept is kept  # staged as planned at the last checkpoint; not planned yet
    step(model, optimizer)
    assert all(s["calls"] == 1 for s in optimizer.get_base_optimizer().state.values())
    saver.after_step()
    saver.queuing.drain()  # planned on the queuer's thread
    assert saver.optimizer_plans.kept is not kept  # planned now, for the next checkpoint to plan like it
    saver.drain(lambda s: None)
    saver.close()
    _, got, _ = resumed(rank0, tmp_path / "ckpt" / "5")
    assert differences(asked, got) == []


def test_an_optimizer_that_replaced_a_tensor_since_the_last_checkpoint_is_planned_before_the_step(
    rank0, tmp_path
):
    """One moment of the optimizer's state is a new tensor since the plan kept (a careless neighbour's
    `load_state_dict`, say): the kept plan would stage the old one, so the state is planned afresh before
    the step, and the checkpoint holds the new tensor's values of the request."""
    pc, c, state, _ = rank0
    model, optimizer, lr_scheduler, random_states = state
    saver = staged_saver(rank0, tmp_path / "ckpt")
    kept = saver.optimizer_plans.kept
    base = optimizer.get_base_optimizer()
    first = next(iter(base.state.values()))
    first["exp_avg"] = first["exp_avg"] * 2  # a new tensor, other values
    asked = snapshot(*state)
    ask(saver, rank0, 5)
    saver.before_step()
    planned = saver.optimizer_plans.kept
    assert planned is not kept and any(t is first["exp_avg"] for t in planned.sources)  # before the step
    step_and_drain(saver, model, optimizer)
    _, got, _ = resumed(rank0, tmp_path / "ckpt" / "5")
    assert differences(asked, got) == []


def test_a_tensor_whose_memory_was_swapped_since_the_last_checkpoint_is_planned_before_the_step(
    rank0, tmp_path
):
    """The same tensor object over new memory (`t.data = ...`): a dtype DLPack lacks (float8) is planned as an
    integer view of the memory it had, which the kept plan would stage. The state is planned afresh before
    the step, and the file holds the new memory's values."""
    pc, c, state, engine = rank0
    model, optimizer, lr_scheduler, random_states = state
    first = next(iter(optimizer.get_base_optimizer().state.values()))
    first["scale"] = torch.ones(4).to(torch.float8_e4m3fn)
    saver = staged_saver(rank0, tmp_path / "ckpt")
    first["scale"].data = torch.full((4,), 2.0).to(torch.float8_e4m3fn)
    ask(saver, rank0, 5)
    saver.before_step()
    step_and_drain(saver, model, optimizer)
    (path,) = (tmp_path / "ckpt" / "5" / "optimizer").glob("*.safetensors")
    saved = engine.load(path)["state"][0]["scale"]
    assert saved.dtype == torch.float8_e4m3fn and saved.float().tolist() == [2.0] * 4


def flip_a_byte(path: Path, from_end: int = 12) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0xFF
    path.write_bytes(bytes(data))


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
    assert resume.confirm().last_train_step == 7  # read (and checked) by now, not loaded
    assert resume.state == "loaded"
    got = fresh.state_dict()  # a first use: loads it
    assert resume.state == "done" and torch.equal(got["state"][0]["exp_avg"], want["state"][0]["exp_avg"])


@pytest.mark.parametrize("damage", ["flipped byte in a weight file", "truncated optimizer file",
                                    "missing random states", "manifest naming a file outside"])  # fmt: skip
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(rank0, tmp_path, damage):
    first, _ = two_checkpoints(rank0, tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "7"
    if damage.startswith("flipped"):
        flip_a_byte(next((newest / "model").rglob("*.safetensors")))
    elif damage.startswith("truncated"):
        (opt,) = (newest / "optimizer").glob("*.safetensors")
        opt.write_bytes(opt.read_bytes()[:-100])
    elif damage.startswith("missing"):
        next((newest / "random").glob("*.safetensors")).unlink()
    else:
        doc = json.loads((newest / MANIFEST).read_text())
        doc["files"]["model/../../outside.safetensors"] = {"bytes": 1}
        (newest / MANIFEST).write_text(json.dumps(doc))
    resume, got, metadata = resumed(rank0, newest)
    assert resume.folder == tmp_path / "ckpt" / "5" and metadata.last_train_step == 5
    got.pop("random"), first.pop("random")
    assert differences(first, got) == []


def test_with_no_older_checkpoint_a_damaged_one_is_an_error_naming_the_file(rank0, tmp_path):
    folder = saved_checkpoint(rank0, tmp_path / "ckpt")
    (opt_file,) = (folder / "optimizer").glob("*.safetensors")
    flip_a_byte(opt_file)
    with pytest.raises(
        CheckpointError, match=rf"no committed checkpoint could be read whole.*{opt_file.name}"
    ):
        resumed(rank0, folder)


@pytest.mark.parametrize("copies", [2, 1])
def test_the_memory_tier_holds_the_newest_checkpoint_and_a_restart_reads_it(rank0, tmp_path, copies):
    shm = tmp_path / "shm"
    tier = {"memory_tier": True, "memory_tier_path": str(shm), "memory_tier_copies": copies}
    _, newest = two_checkpoints(rank0, tmp_path / "ckpt", **tier)
    (job,) = shm.iterdir()  # one job
    held = sorted(p.name for p in job.iterdir() if p.is_dir())
    if copies == 2:  # step 5 held, then the spare (marker withdrawn) once 7 was committed
        assert held == ["5", "7"] and not (job / "5" / ".rank-0.json").exists()
    else:  # the save of 7 took step 5's files over, and 5's folder went
        assert held == ["7"]
    assert (job / "7" / ".rank-0.json").exists()
    for rel in read_manifest(tmp_path / "ckpt" / "7")["files"]:
        assert (job / "7" / rel).read_bytes() == (tmp_path / "ckpt" / "7" / rel).read_bytes()
    resume, got, metadata = resumed(rank0, tmp_path / "ckpt" / "7", **tier)
    assert resume.source == job / "7" and metadata.last_train_step == 7
    got.pop("random"), newest.pop("random")
    assert differences(newest, got) == []


@pytest.mark.parametrize("copies", [2, 1])
def test_the_first_checkpoints_take_over_the_tier_files_made_and_mapped_after_the_first_step(
    rank0, tmp_path, copies
):
    """After the first step the tier's files of the first `copies` checkpoints are made and mapped (pinned
    on a GPU), each laid out as its checkpoint's save lays it out: the saves take those mappings over as they
    are, weights and optimizer, so that nothing is mapped or pinned anew while training runs."""
    pc, c, state, _ = rank0
    tier = {"memory_tier": True, "memory_tier_path": str(tmp_path / "shm"), "memory_tier_copies": copies}
    saver = saver_of(rank0, tmp_path / "ckpt", **tier)
    anew: dict[int, int] = {}
    saver.observers.append(
        lambda e, f: anew.update({f["result"].step: f["result"].mapped_anew}) if e == "committed" else None
    )
    saver.after_first_step()
    job = saver.tier.folder
    sets = sorted(p for p in job.iterdir() if p.name.startswith(".warm-"))
    assert [p.name for p in sets] == [f".warm-0-{i}" for i in range(copies)]
    rels = sorted(str(p.relative_to(sets[0])) for p in sets[0].rglob("*.safetensors"))
    assert any(r.startswith("optimizer/") for r in rels) and any(r.startswith("model/") for r in rels)
    ahead = [{rel: mapped_at(s / rel) for rel in rels} for s in sets]
    assert all(len(where) == 1 for where in ahead[0].values())
    ask(saver, rank0, 5)
    saver.take(saver.outstanding, lambda s: None)
    assert {rel: mapped_at(job / "5" / rel) for rel in rels} == ahead[0]
    saver.before_step()
    step(*state[:2], 2)
    ask(saver, rank0, 7)
    saver.take(saver.outstanding, lambda s: None)
    assert {rel: mapped_at(job / "7" / rel) for rel in rels} == ahead[-1]  # with 1 copy: 5's, taken over
    # Mapped anew: only the scheduler's and random states' files, unless 5's were taken over (1 copy)
    assert anew == {5: 2, 7: 2 if copies == 2 else 0}
    assert not any(p.name.startswith(".warm-") for p in job.iterdir())
    for rel in read_manifest(tmp_path / "ckpt" / "7")["files"]:
        assert (job / "7" / rel).read_bytes() == (tmp_path / "ckpt" / "7" / rel).read_bytes()
    saver.close()


def test_a_restart_leaves_the_tiers_files_to_its_saves_and_its_first_step_pins_nothing(rank0, tmp_path):
    """A restart holding step 7 in the tier: its first step makes and pins no files (a restart is timed to
    its first step, and pinning holds the driver's locks); its checkpoints then map what they take over."""
    pc, c, state, _ = rank0
    tier = {"memory_tier": True, "memory_tier_path": str(tmp_path / "shm")}
    two_checkpoints(rank0, tmp_path / "ckpt", **tier)
    engine = DataStatesEngine(host_cache_size=1 / 64, chunk_size=1)  # the next process's: nothing mapped
    model, optimizer = state[:2]
    saver = Saver(engine, TrainerSettings(**tier), pc, model, optimizer, tmp_path / "ckpt")
    anew: dict[int, int] = {}
    saver.observers.append(
        lambda e, f: anew.update({f["result"].step: f["result"].mapped_anew}) if e == "committed" else None
    )
    saver.after_first_step()
    job = saver.tier.folder
    assert not [p for p in job.iterdir() if p.name.startswith(".warm-")] and engine.keep_mirrors([]) == 0
    saver.before_step()
    step(*state[:2], 2)
    ask(saver, rank0, 9)
    saver.take(saver.outstanding, lambda s: None)
    files = len(read_manifest(tmp_path / "ckpt" / "9")["files"])
    assert anew == {9: files}  # every file mapped by its save, as before the tier's files were made ahead
    saver.close()
    engine.close()


def test_a_checkpoint_saved_with_checksums_off_lists_none_and_resumes_bit_for_bit(rank0, tmp_path):
    """`checksums: false`: the manifest's entries give sizes only (an empty list of checksums would not name
    the files' tensors, and the resume would refuse them), and the resume reads the state back whole."""
    pc, c, state, _ = rank0
    model, optimizer = state[:2]
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1, checksums=False) as engine:
        saver = Saver(engine, TrainerSettings(), pc, model, optimizer, tmp_path / "ckpt")
        ask(saver, rank0, 7)
        saver.take(saver.outstanding, lambda s: None)
        saver.close()
    saved = snapshot(*state)
    files = read_manifest(tmp_path / "ckpt" / "7")["files"]
    assert files and all(set(entry) == {"bytes"} for entry in files.values()), files
    _, got, metadata = resumed(rank0, tmp_path / "ckpt" / "7")
    assert metadata.last_train_step == 7
    got.pop("random"), saved.pop("random")
    assert differences(saved, got) == []


def test_a_damaged_memory_copy_falls_back_to_storage_and_a_partial_one_is_not_used(rank0, tmp_path):
    shm = tmp_path / "shm"
    tier = {"memory_tier": True, "memory_tier_path": str(shm)}
    _, newest = two_checkpoints(rank0, tmp_path / "ckpt", **tier)
    (job,) = shm.iterdir()
    flip_a_byte(next((job / "7" / "model").rglob("*.safetensors")))
    resume, got, metadata = resumed(rank0, tmp_path / "ckpt" / "7", **tier)
    assert resume.source is None and resume.folder == tmp_path / "ckpt" / "7"  # step 7, from storage
    got.pop("random"), newest.pop("random")
    assert differences(newest, got) == []
    opt = next((job / "7" / "optimizer").glob("*.safetensors"))
    opt.unlink()  # a partial copy: not even tried, and the reason said
    manifest = read_manifest(tmp_path / "ckpt" / "7")
    settings = TrainerSettings(**tier)
    assert why_not(settings, tmp_path / "ckpt" / "7", manifest, 0) == f"{opt}: No such file or directory"
    resume, _, _ = resumed(rank0, tmp_path / "ckpt" / "7", **tier)
    assert resume.source is None
    (job / "7" / ".rank-0.json").unlink()
    why = why_not(settings, tmp_path / "ckpt" / "7", manifest, 0)
    assert why is not None and why.startswith(
        f"{len(manifest['files'])} of {len(manifest['files'])} files not marked"
    )


def test_the_memory_tier_is_released_when_training_ends_and_refused_without_room(rank0, tmp_path):
    saved_checkpoint(rank0, tmp_path / "ckpt", memory_tier=True, memory_tier_path=str(tmp_path / "shm"))
    assert not list((tmp_path / "shm").iterdir())  # drain released this rank's steps, then the job's folder
    saver = saver_of(rank0, tmp_path / "ckpt2", memory_tier=True, memory_tier_path=str(tmp_path / "shm"))
    saver._nbytes = 1 << 60
    with pytest.raises(TierError, match=r"memory_tier needs .* GB in .*shm"):
        check_room(saver.tier, saver._nbytes)
    saver.close()


def test_a_second_trainer_on_the_same_checkpoints_folder_is_refused(rank0, tmp_path):
    """Two writers committing the same steps would mix one's manifest with the other's files: the rank that
    commits holds the folder's writer lock, so a second Saver there fails at its start, and the folder is
    free again once the first closes."""
    from nanotron_datastates.store.writer_lock import FolderBusy

    root = tmp_path / "ckpt"
    first = saver_of(rank0, root)
    with pytest.raises(FolderBusy, match=str(root)):
        saver_of(rank0, root)
    first.close()
    saver_of(rank0, root).close()


def test_a_checkpoint_whose_files_all_fail_raises_the_first_error_and_counts_the_rest(rank0, tmp_path):
    """A full disk fails every file of a checkpoint: the error names the first cause in full and counts the
    others, in one short line; the log keeps the whole list."""
    root = tmp_path / "ckpt"
    (root / "10").mkdir(parents=True)
    for sub in ("model", "optimizer", "lr_scheduler", "random"):
        (root / "10" / sub).write_text("not a folder")  # every file of the checkpoint fails
    saver = saver_of(rank0, root)
    ask(saver, rank0, 10)
    saver.before_step()
    with pytest.raises(CheckpointError) as e:
        saver.take(1, lambda s: None)
    message = str(e.value)
    assert re.search(r"; and \d+ more errors \(all in the log\)$", message), message
    assert len(message) < 1000 and message.count(str(root / "10")) <= 3, message
    saver.close()


def test_the_trainer_takes_a_memory_checkpoint_where_due_at_the_start_of_an_iteration(rank0, tmp_path):
    """Nanotron's real trainer class, its loop's first call of each iteration: with memory_interval 2, the
    steps 2 and 4 its metadata has counted go into the memory tier only (with their manifest and metadata),
    never twice, never a step storage just took, never the step a run resumed (before its first step)."""
    from nanotron_datastates.tier.memory import MemoryTier
    from nanotron_datastates.tier.memory_steps import read_documents

    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    t, saver = memory_trainer(rank0, tmp_path, every=2, iteration=6)
    saver.start()
    saver.after_first_step()
    t.metadata, t.datastates.stepped = training_metadata(2), False
    t._update_dataloader_based_on_training_stages(None)  # a resumed run, before its first step: nothing
    assert saver.memory_step is None
    t.datastates.stepped = True
    ask(saver, rank0, 6)  # storage's checkpoint of step 6: no memory one of the same step
    for at in (2, 3, 4, 4, 5, 6):
        # Each outcome in first: one due while two are in flight would be skipped (test_nanotron_memory_pace)
        assert wait_until(lambda: saver.committer.ready() == saver.outstanding)
        t.metadata = training_metadata(at)
        t._update_dataloader_based_on_training_stages(None)
        saver.before_step()
        saver.after_step()
    saver.take(saver.outstanding, lambda s: None)
    tier = MemoryTier(shm, ckpt, 0)
    assert [c["step"] for c in saver_commits(ckpt)] == [6, 2, 4]
    for at in (2, 4):
        docs = read_documents(tier, at)
        assert json.loads(docs[MANIFEST])["step"] == at and not (ckpt / str(at)).exists()
        assert json.loads(docs["checkpoint_metadata.json"])["metas"]["last_train_step"] == at
    saver.close()


def memory_trainer(rank0, tmp_path: Path, every: int, iteration: int) -> tuple[Any, Saver]:
    """Nanotron's real trainer class, as its loop holds it at `iteration`, around a Saver into
    `tmp_path/ckpt` with the memory tier in `tmp_path/shm` and a memory checkpoint every `every` steps."""
    from nanotron_datastates.nanotron.manager import CheckpointManager
    from nanotron_datastates.nanotron.trainer import DataStatesTrainer

    pc, c, (model, optimizer, lr_scheduler, random_states), engine = rank0
    settings = TrainerSettings(
        memory_tier=True, memory_tier_path=str(tmp_path / "shm"), memory_interval=every
    )
    t = DataStatesTrainer.__new__(DataStatesTrainer)
    t.config, t.parallel_context, t.current_dataloader = c, pc, iter(())
    c.data_stages = None
    t.optimizer, t.lr_scheduler, t.random_states = optimizer, lr_scheduler, random_states
    t.iteration_step, t.s3_mover = iteration, None  # Nanotron's post-save hooks, for storage's checkpoints
    saver = Saver(engine, settings, pc, model, optimizer, tmp_path / "ckpt")
    t.datastates = CheckpointManager(t, Resume(), saver)
    return t, saver


def saver_commits(root: Path) -> list[dict[str, Any]]:
    return [r for r in housekeeping.read_telemetry(root) if "event" not in r]


def test_checkpoints_every_few_steps_stage_into_the_memory_kept_from_the_last_one(rank0, tmp_path):
    """With memory checkpoints every few steps (`memory_interval` 2), a staged checkpoint's memory stays
    with the engine: the next one, once the last one's copies are read, stages into it. Each checkpoint
    holds the state of its own request."""
    pc, c, state, _ = rank0
    model, optimizer, lr_scheduler, random_states = state
    saver = saver_of(
        rank0,
        tmp_path / "ckpt",
        device_snapshot="always",
        memory_tier=True,
        memory_tier_path=str(tmp_path / "shm"),
        memory_interval=2,
    )
    saver.start()
    saver.after_first_step()
    asked, memory = {}, []
    for at in (5, 6, 7):
        asked[at] = snapshot(*state)
        ask(saver, rank0, at)
        saver.before_step()
        memory.append([b.data_ptr() for b in saver.engine._stager._kept.bases])
        step(model, optimizer)
        saver.after_step()
        saver.drain(lambda s: None)  # the copies read: the next checkpoint finds the memory free
    assert memory[0] == memory[1] == memory[2]
    assert saver.engine.staging_nbytes > 0
    saver.close()
    assert saver.engine.staging_nbytes == 0
    for at, want in asked.items():
        _, got, _ = resumed(rank0, tmp_path / "ckpt" / str(at))
        got.pop("random"), want.pop("random")
        assert differences(want, got) == [], at
