"""The optimizer state of a resume, loaded at the first step (no Nanotron needed): real AdamW, real files read
ahead by the engine. The first step must run on the restored state, as if it had been loaded at once."""

import copy

import pytest
import torch

from nanotron_datastates import ChecksumError, DataStatesEngine
from nanotron_datastates.nanotron.deferred import DeferredLoad
from nanotron_datastates.nanotron.prefetch import Prefetch

from helpers import same, small_config


def _trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for i in range(steps):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    return model, opt


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _resumed(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A new run: the weights restored, the optimizer built afresh (no state yet)."""
    twin = copy.deepcopy(model)
    return twin, torch.optim.AdamW(twin.parameters(), lr=0.05)


@pytest.fixture
def saved(tmp_path):
    """(model, opt, path, engine): a trained model and optimizer, the state saved by the engine at path."""
    model, opt = _trained()
    path = tmp_path / "optimizer.safetensors"
    with DataStatesEngine(small_config()) as engine:
        engine.save(opt.state_dict(), path).wait_persisted()
        yield model, opt, path, engine


def test_the_first_step_runs_on_the_state_read_ahead(saved):
    model, opt, path, engine = saved
    twin, twin_opt = _resumed(model)
    ahead = Prefetch(engine, torch.device("cpu"), [], path, lambda p: None)
    deferred = DeferredLoad(twin_opt, lambda: twin_opt.load_state_dict(ahead.optimizer(path)))
    assert deferred.pending and not twin_opt.state  # nothing loaded before the step
    _backward(model, 3)
    _backward(twin, 3)  # the forward and backward passes overlap the read
    opt.step()
    twin_opt.step()
    assert not deferred.pending
    for a, b in zip(model.parameters(), twin.parameters()):
        assert same(a, b)  # loaded after the step, or not at all, the update would differ
    assert twin_opt.state_dict()["state"][0]["step"].item() == 4


def test_state_dict_before_the_first_step_is_the_restored_one(saved):
    model, opt, path, engine = saved
    _, twin_opt = _resumed(model)
    DeferredLoad(twin_opt, lambda: twin_opt.load_state_dict(engine.load(path)))
    got, want = twin_opt.state_dict()["state"], opt.state_dict()["state"]
    assert set(got) == set(want)
    for i in want:
        assert all(same(got[i][k], want[i][k]) for k in want[i])


def test_a_failed_load_stays_pending_and_no_step_runs_before_it_succeeds(saved):
    model, opt, path, engine = saved
    with open(path, "r+b") as f:  # flip one byte of the tensor data
        f.seek(-12, 2)
        b = f.read(1)
        f.seek(-12, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    twin, twin_opt = _resumed(model)
    before = [p.detach().clone() for p in twin.parameters()]
    deferred = DeferredLoad(twin_opt, lambda: twin_opt.load_state_dict(engine.load(path)))
    _backward(twin, 3)
    with pytest.raises(ChecksumError, match="optimizer.safetensors"):
        twin_opt.step()
    assert deferred.pending
    assert all(same(a, b) for a, b in zip(before, twin.parameters()))  # the step did not run
    engine.save(opt.state_dict(), path).wait_persisted()  # repaired: the engine keeps working
    _backward(model, 3)
    opt.step()
    twin_opt.step()  # and the next step loads it
    assert not deferred.pending
    assert all(same(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_load_that_reads_the_state_itself_does_not_recurse(tmp_path):
    _, opt = _trained()
    calls = []

    def load() -> None:
        calls.append(len(opt.state_dict()["state"]))  # through the wrapper, while the load runs

    deferred = DeferredLoad(opt, load)
    opt.state_dict()
    opt.state_dict()
    assert calls == [2] and not deferred.pending
