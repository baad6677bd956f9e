"""The snapshot gate against a real torch optimizer: a `step` that waits on the gate first (as the trainer's
one wrapper does) waits for the snapshot of the checkpoint just queued, so the file holds the state from
before the step, and the step proceeds after."""

import pytest
import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.save.gate import SnapshotGate


def guarded(optimizer: torch.optim.Optimizer, before_step=None) -> SnapshotGate:
    """A gate that `optimizer.step` waits on first; `before_step()` runs between the wait and the step."""
    gate, original = SnapshotGate(), optimizer.step

    def step(*args, **kwargs):
        gate.wait()
        if before_step is not None:
            before_step()
        return original(*args, **kwargs)

    optimizer.step = step
    return gate


def test_step_waits_for_the_snapshot_then_mutates(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()  # optimizer state exists
    at_step: list[bool] = []  # whether the snapshot was done when the step itself began
    gate = guarded(opt, before_step=lambda: at_step.append(h.snapshot_done()))
    # A 1 MiB cache: the ~12 MB state streams through it, so the snapshot takes a while.
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as engine:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        before = {k: v.clone() for k, v in model.state_dict().items()}
        avg_before = opt.state_dict()["state"][0]["exp_avg"].clone()
        h = engine.save(state, tmp_path / "c.safetensors")
        waited = []
        gate.add([h], on_wait=waited.append)
        model(torch.randn(8, 1024)).sum().backward()  # forward and backward overlap the copies
        copying = not h.snapshot_done()  # mostly; on a loaded machine the copies may be done by now
        opt.step()  # waits for the snapshot first
        assert at_step == [True] and waited and (waited[0] > 0 or not copying)
        assert not torch.equal(model.weight, before["weight"])  # then the step did happen
        h.wait_persisted()
        back = engine.load(tmp_path / "c.safetensors")
    assert all(torch.equal(back["model"][k], before[k]) for k in before)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], avg_before)
    assert gate.wait() == 0.0  # nothing pending: the next step does not wait


def test_failed_save_does_not_block_the_step(tmp_path):
    (tmp_path / "blocker").write_text("")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    gate = guarded(opt)
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as engine:
        h = engine.save({"x": torch.ones(3)}, tmp_path / "blocker" / "x.safetensors")
        gate.add([h])
        opt.step()
        assert h.exception() is not None


def test_work_deferred_to_the_step_runs_before_it_and_its_save_holds_the_state_of_the_request(tmp_path):
    """`queue_at_step`: a checkpoint asked for after step N is queued at the start of step N+1, after that
    step's forward and backward passes: the file holds the state of step N all the same, and step N+1 waits
    for the copies it queued before it changes anything."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
    gate = guarded(opt)
    asked = {k: v.clone() for k, v in model.state_dict().items()}
    avg_asked = opt.state_dict()["state"][0]["exp_avg"].clone()
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as engine:
        handles, order = [], []

        def queue():
            order.append("queued")
            handles.append(
                engine.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.safetensors"
                )
            )
            gate.add(handles)

        gate.defer(queue)
        assert gate.deferred == 1 and not handles  # nothing queued by the request itself
        model(torch.randn(8, 512)).sum().backward()  # the next step's passes: grads change, not the state
        order.append("passes")
        opt.step()  # queues, waits for the snapshot, then steps
        assert order == ["passes", "queued"] and gate.deferred == 0
        assert handles[0].snapshot_done()
        assert not torch.equal(model.weight, asked["weight"])
        handles[0].wait_persisted()
        back = engine.load(handles[0].path)
    assert all(torch.equal(back["model"][k], asked[k]) for k in asked)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], avg_asked)


def test_deferred_work_runs_once_in_order_even_when_one_piece_raises():
    gate = SnapshotGate()
    ran = []

    def broken():
        ran.append("broken")
        raise OSError("no room")

    gate.defer(lambda: ran.append("first"))
    gate.defer(broken)
    gate.defer(lambda: ran.append("third"))
    with pytest.raises(OSError, match="no room"):
        gate.run_deferred()
    assert ran == ["first", "broken"] and gate.deferred == 1  # the one after the failure is still due
    assert gate.wait() == 0.0  # the step runs it, then has nothing to wait for
    assert ran == ["first", "broken", "third"] and gate.deferred == 0


def test_work_for_after_the_step_runs_once_the_step_is_launched_and_with_the_rest_when_no_step_comes():
    """`defer(work, after=...)`: `work` before the step's wait, `after` only at `run_after` (the trainer's
    wrapper, once the step is launched); `run_deferred` (no step to come: the next request, the end) runs
    both, in order."""
    gate, ran = SnapshotGate(), []
    gate.defer(lambda: ran.append("capture 1"), after=lambda: ran.append("queue 1"))
    assert gate.deferred == 2
    gate.wait()
    assert ran == ["capture 1"] and gate.deferred == 1
    ran.append("step")
    gate.run_after()
    assert ran == ["capture 1", "step", "queue 1"] and gate.deferred == 0
    gate.defer(lambda: ran.append("capture 2"), after=lambda: ran.append("queue 2"))
    gate.run_deferred()
    assert ran[-2:] == ["capture 2", "queue 2"] and gate.deferred == 0
