"""The caller-thread part of a save: naming, aliasing, metadata rules, refusals."""

import pytest
import torch

from nanotron_datastates.save.plan import plan_save


def test_flat_dict_keeps_its_keys_as_tensor_names():
    p = plan_save({"w": torch.zeros(2), "b": torch.zeros(3, dtype=torch.bfloat16)})
    assert p.names == ["w", "b"] and p.dtypes == ["F32", "BF16"] and p.nbytes == 8 + 6


def test_nested_names_collisions_and_the_reserved_name():
    t1, t2, t3 = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    p = plan_save({"a.b": t1, "a": {"b": t2}, "__metadata__": t3})
    assert p.names == ["a.b", "a.b#1", "__metadata__#1"]


def test_the_same_tensor_twice_is_stored_once():
    w = torch.randn(4, 4)
    p = plan_save({"embed": w, "lm_head": w})
    assert p.names == ["embed"]


def test_exported_arrays_share_memory_with_the_state():
    x = torch.randn(8, 8, requires_grad=True)
    b = torch.zeros(3, dtype=torch.bool)
    p = plan_save({"x": x, "b": b, "view": x.detach().t()})
    assert p.arrays[0].data_ptr() == x.data_ptr() and not p.arrays[0].requires_grad
    assert p.arrays[1].dtype == torch.uint8 and p.arrays[1].data_ptr() == b.data_ptr()
    assert p.arrays[2].stride() == (1, 8)  # host views are gathered by the core, not copied here


def test_metadata_rules():
    md = dict(plan_save({}, metadata={"k": "v"}).metadata)
    assert md["format"] == "pt" and md["k"] == "v" and md["datastates.version"] == "1"
    assert dict(plan_save({}, metadata={"format": "np"}).metadata)["format"] == "np"
    with pytest.raises(ValueError, match="reserved"):
        plan_save({}, metadata={"datastates.x": "1"})
    with pytest.raises(TypeError, match="str to str"):
        plan_save({}, metadata={"k": 1})


def test_unsupported_tensors_are_refused_by_key():
    with pytest.raises(TypeError, match="'m.x'.*meta"):
        plan_save({"m": {"x": torch.empty(2, device="meta")}})
    with pytest.raises(TypeError, match="'s'"):
        plan_save({"s": torch.zeros(2, 2).to_sparse()})
    with pytest.raises(TypeError, match="complex128"):
        plan_save({"c": torch.zeros(2, dtype=torch.complex128)})


def _same_plan(a, b) -> bool:
    fields = ("names", "dtypes", "metadata", "nbytes", "devices", "exact_metadata")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and [x.data_ptr() for x in a.arrays] == [
        x.data_ptr() for x in b.arrays
    ]


def test_a_plan_like_the_previous_one_equals_a_fresh_plan_and_reads_plain_values_again():
    # The Nanotron saver plans the optimizer's state at every checkpoint: the same tensors, a new lr.
    m, v = torch.zeros(4), torch.ones(4, dtype=torch.bfloat16)
    state = {"state": {0: {"m": m, "v": v, "tied": m}}, "groups": [{"lr": 1e-3}]}
    before = plan_save(state)
    state["groups"][0]["lr"] = 5e-4
    again = plan_save(state, like=before)
    assert _same_plan(again, plan_save(state)) and again.names == ["state.0.m", "state.0.v"]
    assert "0.0005" in dict(again.metadata)["datastates.skeleton"]
    assert again.arrays[1] is before.arrays[1]  # the checks and the export were not done again


@pytest.mark.parametrize(
    "change",
    [
        *("new tensor", "resized", "data replaced", "dtype changed", "viewed as"),
        *("reordered", "renamed", "one more", "one less"),
    ],
)
def test_a_plan_like_the_previous_one_sees_every_change_of_its_tensors(change):
    m, v = torch.zeros(4), torch.ones(4)
    state = {"m": m, "v": v}
    before = plan_save(state)
    if change == "new tensor":
        state["m"] = torch.zeros(4)
    elif change == "resized":
        m.resize_(8)
    elif change == "data replaced":
        m.data = torch.zeros(4)
    elif change == "dtype changed":
        m.data = torch.zeros(4, dtype=torch.float16)
    elif change == "viewed as":  # the same bytes, another dtype
        m.data = m.view(torch.int32)
    elif change == "reordered":
        state = {"v": v, "m": m}
    elif change == "renamed":
        state = {"m2": m, "v": v}
    elif change == "one more":
        state["w"] = torch.zeros(2)
    else:
        del state["v"]
    assert _same_plan(plan_save(state, like=before), plan_save(state))


def test_a_plan_holds_its_tensors_only_as_it_planned_them():
    """`SavePlan.holds`: the same objects, in order, over the same memory, shapes and dtypes; each change a
    trainer's optimizer could make between two checkpoints is seen."""
    a, b = torch.zeros(6), torch.ones(2, 3)
    plan = plan_save({"a": a, "b": b})
    assert plan.holds([a, b])
    assert not plan.holds([b, a]) and not plan.holds([a]) and not plan.holds([a, b.clone()])
    a.data = torch.zeros(6)  # the same object over new memory
    assert not plan.holds([a, b])
    plan = plan_save({"a": a, "b": b})
    b.resize_(3)  # the same memory, another shape
    assert not plan.holds([a, b])
    b.resize_(2, 3)
    assert plan.holds([a, b])
    a.data = a.data.view(torch.int32)  # the same memory and shape, another dtype
    assert not plan.holds([a, b])
