"""skeleton_text.py: the skeleton's text of a state planned again, from the last one's templates, is the very
text `skeleton.encode` writes, whatever changed since: a learning rate, a value's type, a key, a float's
spelling, a tensor where there was none."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from nanotron_datastates import skeleton, skeleton_text


def _fresh(state, reuse):
    met = []

    def on_tensor(t, path):
        met.append(path)
        return path

    text = skeleton.encode(state, on_tensor, reuse=reuse)
    return None if met else text


def _state(groups: int = 4):
    """An optimizer's state as `skeleton.freeze` copies it: the per-parameter tensors reused, a param group
    a parameter."""
    per_param = {i: {"step": torch.zeros(()), "exp_avg": torch.zeros(2)} for i in range(groups)}
    param_groups = [
        {
            "lr": 1e-3 * (i + 1),
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "amsgrad": False,
            "foreach": None,
            "initial_lr": 3e-4,
            "params": [i],
            "step": 10,
        }
        for i in range(groups)
    ]
    return {"state": per_param, "param_groups": param_groups, "names": {i: f"p{i}" for i in range(groups)}}


def _reuse(state):
    kept: dict[object, object] = {}
    skeleton.encode(state, lambda t, p: p, keep=kept)
    return {"state": kept["state"]}


def _changes():
    """(name, change of a state in place): each leaves the state storable."""

    def group(key, value, i=0):
        def change(s):
            s["param_groups"][i][key] = value

        return change

    def drop(key):
        def change(s):
            s["param_groups"][1].pop(key, None)

        return change

    def reorder(s):
        g = s["param_groups"][2]
        s["param_groups"][2] = dict(reversed(list(g.items())))

    def more_groups(s):
        s["param_groups"].append(copy.deepcopy(s["param_groups"][0]))

    def fewer_groups(s):
        s["param_groups"].pop()

    def names(s):
        s["names"][0] = "renamed"

    return [
        ("nothing", lambda s: None),
        ("every lr", lambda s: [g.__setitem__("lr", g["lr"] * 0.5) for g in s["param_groups"]]),
        ("lr zero", group("lr", 0.0)),
        ("lr minus zero", group("lr", -0.0)),
        ("lr tiny", group("lr", 5e-324)),
        ("lr huge", group("lr", 1.7976931348623157e308)),
        ("lr nan", group("lr", math.nan)),
        ("lr inf", group("lr", math.inf)),
        ("lr int", group("lr", 1)),
        ("lr bool", group("lr", True)),
        ("lr str with percent", group("lr", "%r %s %%")),
        ("eps -inf", group("eps", -math.inf)),
        ("every step", lambda s: [g.__setitem__("step", g["step"] + 1) for g in s["param_groups"]]),
        ("step huge", group("step", 10**400)),
        ("step float", group("step", 11.0)),
        ("step bool", group("step", True)),
        ("flag int", group("amsgrad", 0)),
        ("none to str", group("foreach", "x")),
        ("betas minus zero", group("betas", (-0.0, 0.95))),
        ("betas list", group("betas", [0.9, 0.95])),
        ("betas ints", group("betas", (1, 0))),
        ("betas nan", group("betas", (math.nan, 0.95))),
        ("params bools", group("params", [False])),
        ("params float", group("params", [0.0])),
        ("params nested", group("params", [[0]])),
        ("new key", group("extra", 1.5)),
        ("key dropped", drop("eps")),
        ("keys reordered", reorder),
        ("group added", more_groups),
        ("group removed", fewer_groups),
        ("names", names),
        ("tensor in a group", group("extra", torch.ones(1))),
        ("float key", lambda s: s["param_groups"][0].__setitem__(1.5, 2.0)),
    ]


@pytest.mark.parametrize("name,change", _changes(), ids=[n for n, _ in _changes()])
def test_the_text_is_a_fresh_walks_after_any_change(name, change):
    state = _state()
    reuse = _reuse(state)
    texts = skeleton_text.Texts()
    assert skeleton_text.encode(state, reuse, texts) == _fresh(state, reuse)  # the templates made here
    for _ in range(2):  # from the templates, then from those made again
        change(state)
        assert skeleton_text.encode(state, reuse, texts) == _fresh(state, reuse), name


def test_learning_rates_come_from_the_templates_and_spell_as_json_does():
    state = _state(groups=50)
    reuse = _reuse(state)
    texts = skeleton_text.Texts()
    skeleton_text.encode(state, reuse, texts)
    templates = [t for t, _ in texts.groups["param_groups"]]
    assert all(t is not None for t in templates)
    for k in range(20):
        for g in state["param_groups"]:
            g["lr"] = 1e-3 / (k + 3) * (1 + g["params"][0])
            g["step"] += 1
        text = skeleton_text.encode(state, reuse, texts)
        assert text == _fresh(state, reuse)
        assert texts.groups["param_groups"][0] == (templates[0], 0)  # used, not made again
    decoded = skeleton.decode(text, {"state.0.step": 0, "state.0.exp_avg": 0} | _names(state))
    assert [g["lr"] for g in decoded["param_groups"]] == [g["lr"] for g in state["param_groups"]]
    json.loads(text)


def _names(state):
    return {f"state.{i}.{k}": 0 for i, d in state["state"].items() for k in d}


def test_a_state_it_cannot_write_goes_back_to_the_walk():
    state = _state()
    reuse = _reuse(state)
    texts = skeleton_text.Texts()
    assert skeleton_text.encode([state], reuse, texts) is None  # not a dict
    assert skeleton_text.encode({("a",): 1}, reuse, texts) is None  # a key JSON cannot spell plainly
    state["names"]["w"] = torch.zeros(1)
    assert skeleton_text.encode(state, reuse, texts) is None  # a tensor outside the reused values
    state["names"]["w"] = object()
    with pytest.raises(TypeError, match="names.w|cannot save"):
        skeleton_text.encode(state, reuse, texts)


def test_a_group_that_changes_at_every_call_is_walked_without_a_template_after_three():
    state = _state()
    reuse = _reuse(state)
    texts = skeleton_text.Texts()
    for k in range(6):
        state["param_groups"][1]["foreach"] = f"changed {k}"  # no number: the template cannot take it
        assert skeleton_text.encode(state, reuse, texts) == _fresh(state, reuse)
    template, misses = texts.groups["param_groups"][1]
    assert misses == 6 and template is not None  # the last one made, at the third miss; none since
    state["param_groups"][1]["foreach"] = "changed 2"  # that template's value again: it is used
    assert skeleton_text.encode(state, reuse, texts) == _fresh(state, reuse)
    assert texts.groups["param_groups"][1] == (template, 0)
    assert all(m == 0 for _, m in texts.groups["param_groups"][2:])
