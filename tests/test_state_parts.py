"""A state written in parts (state_parts.py): each part keeps its own leaves, the parts together are the
state, tensor for tensor; the parts' bytes are about equal; every part saved and loaded by the engine puts
the state back together; names of the parts, and a manifest missing one of them."""

from __future__ import annotations

import collections

import pytest
import torch

from nanotron_datastates import DataStatesEngine, state_parts
from nanotron_datastates.checkpoint.manifest import ManifestError
from nanotron_datastates.checkpoint.names import part_name, whole_name
from nanotron_datastates.checkpoint.reads import optimizer_files
from nanotron_datastates.errors import FormatError


def optimizer_state(params: int = 12) -> dict:
    """An optimizer's state_dict as Nanotron's (torch Adam's, its names, its fp32 master weights)."""
    g = torch.Generator().manual_seed(0)
    return {
        "state": {
            i: {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(64 * (i % 5 + 1), generator=g),
                "exp_avg_sq": torch.rand(64 * (i % 5 + 1), generator=g),
            }
            for i in range(params)
        },
        "param_groups": [{"params": list(range(params)), "lr": 3e-4, "betas": (0.9, 0.95)}],
        "names": {i: f"model.layer{i}.weight" for i in range(params)},
        "gradient_accumulator": collections.OrderedDict(
            (f"model.layer{i}.weight", torch.randn(32, generator=g)) for i in range(params)
        ),
        "empty": {},
    }


def leaves(state: dict) -> dict:
    return dict(state_parts._leaves(state))


def same(a, b) -> bool:
    if isinstance(a, dict):
        return type(a) is type(b) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8, 40])
def test_the_parts_hold_each_leaf_once_and_put_together_are_the_state(count):
    state = optimizer_state()
    parts = [state_parts.split(state, k, count) for k in range(count)]
    seen = collections.Counter(path for p in parts for path in leaves(p) if p)
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1]
    merged = state_parts.merge(parts)
    assert same(merged, state)
    assert list(merged) == list(state)[:3] + ["empty", "gradient_accumulator"] or count == 1
    assert type(merged["gradient_accumulator"]) is collections.OrderedDict
    for path, value in leaves(merged).items():  # the very tensors, not copies
        assert value is leaves(state)[path] or not isinstance(value, torch.Tensor)


def test_plain_values_and_empty_containers_go_to_part_0_and_the_bytes_are_about_equal():
    state = optimizer_state(params=64)
    parts = [state_parts.split(state, k, 4) for k in range(4)]
    assert parts[0]["param_groups"] == state["param_groups"] and parts[0]["empty"] == {}
    assert all("param_groups" not in p and "names" not in p for p in parts[1:])
    sizes = [sum(state_parts._nbytes(v) for v in leaves(p).values()) for p in parts]
    largest = max(state_parts._nbytes(v) for v in leaves(state).values())
    assert max(sizes) - min(sizes) <= 2 * largest, sizes
    owners = state_parts.owners(state, 4)
    assert state_parts.owners(optimizer_state(params=64), 4) == owners  # the same on every replica


def test_a_state_without_tensors_is_all_part_0_and_bad_arguments_are_refused():
    state = {"a": 1, "b": {"c": "x"}}
    assert state_parts.split(state, 0, 3) == state
    assert state_parts.split(state, 1, 3) == {} == state_parts.split(state, 2, 3)
    with pytest.raises(ValueError, match="1 part or more"):
        state_parts.owners(state, 0)
    with pytest.raises(TypeError, match="only a dict"):
        state_parts.split([torch.ones(2)], 0, 2)


def test_two_parts_holding_the_same_leaf_are_refused_naming_it():
    with pytest.raises(FormatError, match="part 1 of the state holds state/0/exp_avg again"):
        state_parts.merge([{"state": {0: {"exp_avg": torch.ones(1)}}}, {"state": {0: {"exp_avg": 2}}}])
    with pytest.raises(FormatError, match="no part"):
        state_parts.merge([])


def test_the_parts_saved_and_loaded_by_the_engine_are_the_state(tmp_path):
    state = optimizer_state()
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
        for k in range(3):
            engine.save(
                state_parts.split(state, k, 3), tmp_path / part_name("opt.safetensors", k, 3)
            ).wait_persisted()
        loaded = [engine.load(tmp_path / part_name("opt.safetensors", k, 3)) for k in range(3)]
    assert same(state_parts.merge(loaded), state)


def test_part_names_and_the_manifest_of_an_optimizer_file_in_parts():
    name = "optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.safetensors"
    parts = [f"optimizer/{part_name(name, k, 3)}" for k in range(3)]
    assert parts[1] == "optimizer/optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1_part-1-of-3.safetensors"
    assert whole_name(parts[2].split("/")[1]) == (name, 2, 3) and whole_name(name) is None
    files = {"model/x.safetensors": {}, "optimizer/optimizer_config.json": {}, **dict.fromkeys(parts[::-1])}
    assert optimizer_files(files) == {f"optimizer/{name}": parts}
    whole = {f"optimizer/{name}": {}, **dict.fromkeys(parts)}  # written whole: the parts are not read
    assert optimizer_files(whole) == {f"optimizer/{name}": [f"optimizer/{name}"]}
    with pytest.raises(ManifestError, match=r"lists parts \[0, 2\] of it, named as parts of \[3\]"):
        optimizer_files(dict.fromkeys([parts[0], parts[2]]))
    other = f"optimizer/{part_name(name, 1, 2)}"
    with pytest.raises(ManifestError, match=r"named as parts of \[2, 3\]"):
        optimizer_files(dict.fromkeys([*parts, other]))
