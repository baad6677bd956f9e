"""The trainer's step deferral against a real torch optimizer: `step` waits for the snapshot of the
checkpoint just queued, so the file holds the state from before the step, and the step proceeds after."""

import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.nanotron.gate import SnapshotGate


def test_step_waits_for_the_snapshot_then_mutates(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()  # optimizer state exists
    gate = SnapshotGate()
    gate.guard(opt)
    # A 1 MiB cache: the ~12 MB state streams through it, so the snapshot takes a while.
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as engine:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        before = {k: v.clone() for k, v in model.state_dict().items()}
        avg_before = opt.state_dict()["state"][0]["exp_avg"].clone()
        h = engine.save(state, tmp_path / "c.safetensors")
        waited = []
        gate.add([h], on_wait=waited.append)
        model(torch.randn(8, 1024)).sum().backward()  # forward and backward overlap the copies
        assert not h.snapshot_done()
        opt.step()  # waits for the snapshot first
        assert h.snapshot_done() and waited and waited[0] > 0
        assert not torch.equal(model.weight, before["weight"])  # then the step did happen
        h.wait_persisted()
        back = engine.load(tmp_path / "c.safetensors")
    assert all(torch.equal(back["model"][k], before[k]) for k in before)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], avg_before)
    assert gate.wait() == 0.0  # nothing pending: the next step does not wait


def test_failed_save_does_not_block_the_step(tmp_path):
    (tmp_path / "blocker").write_text("")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    gate = SnapshotGate()
    gate.guard(opt)
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as engine:
        h = engine.save({"x": torch.ones(3)}, tmp_path / "blocker" / "x.safetensors")
        gate.add([h])
        opt.step()
        assert h.exception() is not None
