"""The skeleton codec: every supported plain value and container round-trips exactly; anything else is a
TypeError naming its key; malformed skeletons are FormatErrors."""

import collections
import math

import pytest
import torch

from nanotron_datastates import FormatError, skeleton


def roundtrip(state, allow_pickle=False):
    tensors = {}

    def on_tensor(t, path):
        tensors[path] = t
        return path

    text = skeleton.encode(state, on_tensor, allow_pickle=allow_pickle)
    return skeleton.decode(text, tensors, allow_pickle=allow_pickle), text


def test_plain_values_and_containers():
    state = {
        "none": None,
        "bools": [True, False],
        "ints": (0, -1, 2**70),
        "floats": [0.1, -2.5e-300, 1.0],
        "special": [math.inf, -math.inf],
        "str": 'h\u00e9llo "quoted"\n',
        "bytes": b"\x00\xffbin",
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
        "int_keys": {0: "a", 1: "b", (2, 3): "tuple key", None: "none key"},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": [[], {}, ()],
    }
    back, _ = roundtrip(state)
    assert back == state
    assert type(back["ordered"]) is collections.OrderedDict and type(back["ints"]) is tuple
    assert type(back["size"]) is torch.Size and type(back["floats"][2]) is float
    assert list(back["ordered"]) == ["z", "a"]
    nan, _ = roundtrip(math.nan)
    assert math.isnan(nan)
    # Plain items, finite floats among them, stand for themselves; a container holding one NaN spells it.
    back, text = roundtrip(
        {"betas": (0.9, 0.95), "mixed": [1, 0.5, "s", None, False], "odd": (0.9, math.nan)}
    )
    assert (
        back["betas"] == (0.9, 0.95)
        and type(back["betas"]) is tuple
        and back["mixed"] == [1, 0.5, "s", None, False]
    )
    assert back["odd"][0] == 0.9 and math.isnan(back["odd"][1])
    assert '{"u":[0.9,0.95]}' in text and '{"u":[0.9,{"f":"nan"}]}' in text


def test_tensors_are_referenced_by_name():
    t = torch.arange(3)
    back, text = roundtrip({"w": t, "l": [t]})
    assert back["w"] is t and back["l"][0] is t
    assert '"t":"w"' in text


class Opaque:
    def __eq__(self, other):
        return isinstance(other, Opaque)


@pytest.mark.parametrize(
    "state,where",
    [
        ({"a": {"b": [1, Opaque()]}}, "a.b.1"),
        ({"opt": {"fn": print}}, "opt.fn"),
        ({"s": {1, 2}}, "'s'"),
        ({torch.zeros(1): 1}, "[key]"),
    ],
)
def test_other_objects_are_refused_with_their_key(state, where):
    with pytest.raises(TypeError, match="allow_pickle") as e:
        roundtrip(state)
    assert where in str(e.value)


def test_pickle_only_when_asked():
    back, text = roundtrip({"x": Opaque()}, allow_pickle=True)
    assert back == {"x": Opaque()}
    assert skeleton.uses_pickle(text)
    with pytest.raises(FormatError, match="allow_pickle"):
        skeleton.decode(text, {})


@pytest.mark.parametrize(
    "text",
    [
        "{",
        '{"t":"missing"}',
        '{"q":1}',
        '{"d":[[1]]}',
        '{"d":[[{"l":[]},1]]}',
        '{"f":"huge"}',
        '{"f":[]}',
        '{"b":"!!"}',
        '{"y":"not_a_dtype"}',
        '{"s":["a"]}',
        '{"s":[18446744073709551616]}',
        '{"s":[-9223372036854775809]}',
        '{"l":1}',
        '{"a":1,"b":2}',
        "[" * 50000 + "]" * 50000,
    ],
)
def test_malformed_skeletons_are_format_errors(text):
    with pytest.raises(FormatError):
        skeleton.decode(text, {}, path="f")


def test_freeze_copies_every_container_and_lists_the_tensors_in_the_plans_order():
    """`freeze`: a copy whose containers the original's later changes do not reach, and the tensors in the
    order a plan of it holds them, each once (a tied tensor, an OrderedDict, tuples and plain lists in
    between): a trainer checks the copy against the plan kept from the last checkpoint by that order."""
    from nanotron_datastates.save.plan import plan_save

    w, m, tied = torch.zeros(3), torch.ones(2, 2), torch.arange(4)
    own = {"step": 3, "m": m}  # an optimizer's own per-parameter state
    state = {
        "state": {0: own, 1: {"step": 3, "m": tied}},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}],
        "nested": collections.OrderedDict(a=(w, [tied, 1.5]), b=None),
    }
    frozen, tensors = skeleton.freeze(state)
    assert all(a is b for a, b in zip(tensors, plan_save(state).sources))
    assert len(tensors) == len(plan_save(state).sources) == 3
    own["step"] += 1  # the step
    state["groups"][0]["lr"] = 0.2
    state["groups"][0]["params"].append(2)
    assert frozen["state"][0] == {"step": 3, "m": m} and frozen["state"][0]["m"] is m
    assert frozen["groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]
    assert type(frozen["nested"]) is collections.OrderedDict and frozen["nested"]["a"][0] is w
