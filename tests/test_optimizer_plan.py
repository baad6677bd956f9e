"""save/optimizer_plan.py and plan.plan_again: the optimizer's file planned at each checkpoint like the last,
its per-parameter state's encoding reused where the tensors are the kept plan's, gives the very plan (the same
skeleton text, names, entries) that planning the state afresh gives, and falls back to that wherever the state
changed shape."""

from __future__ import annotations

import pytest
import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine, skeleton
from nanotron_datastates.save.optimizer_plan import OptimizerPlans
from nanotron_datastates.save.plan import plan_again, plan_save


def _same(a, b) -> bool:
    fields = ("names", "dtypes", "metadata", "nbytes", "devices", "exact_metadata")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and all(
        x is y for x, y in zip(a.sources, b.sources)
    )


class _Accumulated(torch.optim.AdamW):
    """An AdamW whose state holds fp32 weights by name beside, as Nanotron's optimizer over an fp32 gradient
    accumulator does (`OptimizerFromGradientAccumulator.state_dict`: a dict of tensors only)."""

    def state_dict(self):
        state = super().state_dict()
        if not hasattr(self, "fp32"):  # made once, as the accumulator's are
            weights = [p for g in self.param_groups for p in g["params"]]
            self.fp32 = {f"model.w{i}": p.detach().clone() for i, p in enumerate(weights)}
        state["gradient_accumulator"] = dict(self.fp32)
        return state


def _trained(groups: int = 5, accumulator: bool = False):
    """An AdamW over `groups` parameters, one param group each (as Nanotron makes them), stepped once, with
    a schedule that moves the learning rate at every step; with `accumulator`, fp32 weights in its state."""
    params = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(groups)]
    kind = _Accumulated if accumulator else torch.optim.AdamW
    opt = kind([{"params": [p]} for p in params], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

    def step() -> None:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()

    step()
    return params, opt, step


@pytest.fixture
def engine():
    with DataStatesEngine(DataStatesConfig(host_cache_size=0.0625)) as e:
        yield e


@pytest.mark.parametrize("accumulator", [False, True], ids=["adamw", "fp32 accumulator"])
def test_a_held_state_is_planned_as_afresh_at_every_checkpoint_without_walking_its_tensors(
    engine, accumulator
):
    params, opt, step = _trained(accumulator=accumulator)
    plans = OptimizerPlans(engine, opt)
    plans.first()
    for k in range(4):
        kept, frozen = plans.for_checkpoint(staged_before_step=True)
        assert frozen is not None and kept is plans.kept
        step()  # the optimizer's own containers move on; the frozen copy keeps the values of the request
        plan = plans.replan_held(frozen)
        assert _same(plan, plan_save(frozen)), k
        # the kept plan's own list of tensors: its per-parameter state was not walked (a walk lists anew)
        assert k == 0 or plan.sources is kept.sources
    lr = frozen["param_groups"][0]["lr"]
    assert json_value(plan, "lr") == lr and lr != opt.param_groups[0]["lr"]


def json_value(plan, key: str) -> object:
    import json

    text = dict(plan.metadata)["datastates.skeleton"]
    state = skeleton.decode(text, {n: torch.zeros(0) for n in plan.names})
    assert json.loads(text)  # valid JSON
    return state["param_groups"][0][key]


def test_the_reused_encoding_is_the_one_a_fresh_walk_writes(engine):
    params, opt, step = _trained(groups=3)
    state, _ = skeleton.freeze(opt.state_dict())
    kept: dict[object, object] = {}
    first = plan_save(state, keep=kept)
    assert set(kept) == {"state", "param_groups"}
    step()
    again, _ = skeleton.freeze(opt.state_dict())
    plan = plan_again(again, first, {"state": kept["state"]})
    assert plan is not None and _same(plan, plan_save(again))
    # a tensor outside the reused values: no plan (the caller plans afresh)
    again["param_groups"][0]["extra"] = torch.zeros(1)
    assert plan_again(again, first, {"state": kept["state"]}) is None


@pytest.mark.parametrize(
    "change", ["new tensor", "new parameter", "key renamed", "keys reordered", "plain value"]
)
def test_a_state_that_changed_shape_is_planned_afresh(engine, change):
    params, opt, step = _trained()
    plans = OptimizerPlans(engine, opt)
    plans.first()
    _, frozen = plans.for_checkpoint(staged_before_step=True)
    plans.replan_held(frozen)  # the encoding kept from here
    _, frozen = plans.for_checkpoint(staged_before_step=True)
    assert frozen is not None
    per_param = frozen["state"]
    first = next(iter(per_param))
    if change == "new tensor":
        per_param[first] = {**per_param[first], "exp_avg": torch.zeros(3, 2)}
    elif change == "new parameter":
        per_param[99] = {"step": torch.zeros(()), "exp_avg": torch.zeros(1)}
    elif change == "key renamed":
        per_param[first] = {("m" if k == "exp_avg" else k): v for k, v in per_param[first].items()}
    elif change == "keys reordered":
        frozen = {"param_groups": frozen["param_groups"], "state": per_param}
    else:  # a plain value among the tensors: not a dict of tensors only
        per_param[first] = {**per_param[first], "step": 3}
    kept = plans.kept
    plan = plans.replan_held(frozen)
    assert _same(plan, plan_save(frozen))
    assert plans.kept is plan and plan.sources is not kept.sources  # walked again


@pytest.mark.parametrize("change", ["data swapped", "resized", "dtype"])
def test_a_held_tensor_changed_in_place_is_staged_and_saved_as_it_is_now(engine, tmp_path, change):
    """The capture checks only that the optimizer still holds the kept plan's tensor objects; what the plan
    says of them (memory, shape, dtype) is checked and renewed by the staging, as for every file."""
    params, opt, step = _trained()
    plans = OptimizerPlans(engine, opt)
    plans.first()
    plans.replan_held(plans.for_checkpoint(staged_before_step=True)[1])
    exp_avg = opt.state[params[1]]["exp_avg"]
    if change == "data swapped":
        exp_avg.data = torch.randn(4, 5)
    elif change == "resized":
        exp_avg.resize_(7)
        exp_avg.copy_(torch.arange(7.0))
    else:
        exp_avg.data = exp_avg.data.to(torch.float64)
    kept, frozen = plans.for_checkpoint(staged_before_step=True)
    assert kept is plans.kept and frozen is not None  # the same objects: held
    staged = engine.stage([kept])
    want = {k: v.clone() for k, v in frozen["state"][1].items()}
    for v in opt.state[params[1]].values():  # the live state moves on after the staging
        v.add_(1)
    path = tmp_path / "optimizer.safetensors"
    staged.target([path])
    staged.replan(0, plans.replan_held(frozen))
    (handle,) = staged.queue()
    handle.wait_persisted()
    loaded = engine.load(path)
    for k, v in want.items():
        got = loaded["state"][1][k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), (change, k)
