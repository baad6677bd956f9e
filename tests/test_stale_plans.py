"""A plan is made once and saved again and again; its tensors may change between saves in ways that leave the
same objects in the state (a `.data` swap, `module.half()`, an in-place resize or transpose, a dtype viewed
as another). Whatever the change, a save writes the tensors as they are when it is made (or staged), in their
dtype and shape now, or refuses naming the tensor and the file. Each file is read back by the engine and by
the safetensors package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from safetensors import safe_open

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.save.plan import SavePlan, plan_save

from helpers import random_tensor, same, small_config

SAVERS = ("save_plan", "save_plans staged", "stage_plans then queue", "plan like the last")


@pytest.fixture
def engine() -> Iterator[DataStatesEngine]:  # one backend: the check is above the core
    with DataStatesEngine(small_config()) as e:
        yield e


def _swap(t: torch.Tensor, new: torch.Tensor) -> None:
    t.data = new


def _no_grad(op: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], None]:
    def run(t: torch.Tensor) -> None:
        with torch.no_grad():
            op(t)

    return run


def _save(engine: DataStatesEngine, saver: str, plan: SavePlan, state: dict, path: Path) -> None:
    """Saves `plan` (of `state`) to `path` as `saver` does, and waits until the file is persisted. The
    staged saver changes every tensor again once it has staged: the file must hold the staged values."""
    if saver == "save_plan":
        engine.save_plan(plan, path)
    elif saver == "save_plans staged":
        engine.save_plans([(plan, path)], stage=True)
    elif saver == "stage_plans then queue":
        staged = engine.stage_plans([(plan, path)])
        for t in state.values():
            t.data = torch.full_like(t.data, 1)
        staged.queue()
    else:
        again = engine.plan(state, like=plan)
        fresh = engine.plan(state)
        # What it would write: the same dtypes, sizes and tensors, in the same layout, as a fresh plan's.
        assert again.dtypes == fresh.dtypes and again.nbytes == fresh.nbytes
        assert [(a.data_ptr(), a.shape, a.stride(), a.dtype) for a in again.arrays] == [
            (a.data_ptr(), a.shape, a.stride(), a.dtype) for a in fresh.arrays
        ]
        engine.save_plan(again, path)
    engine.wait_persisted(timeout=600)


def _check_file(engine: DataStatesEngine, path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = engine.load(path)
    assert set(loaded) == set(expected)
    for k, want in expected.items():
        assert same(loaded[k], want), f"{k}: read {loaded[k].dtype} {tuple(loaded[k].shape)} by the engine"
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for k, want in expected.items():
            got = f.get_tensor(k)
            assert same(got, want), f"{k}: read {got.dtype} {tuple(got.shape)} by safetensors"


def _run(engine: DataStatesEngine, saver: str, state: dict, change: Callable[[], None], path: Path) -> None:
    plan = engine.plan(state)
    change()
    expected = {k: t.detach().clone() for k, t in state.items()}
    _save(engine, saver, plan, state, path)
    _check_file(engine, path, expected)


def _parameter(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (4, 3)) -> torch.Tensor:
    return torch.nn.Parameter(random_tensor(dtype, shape, seed=1), requires_grad=dtype.is_floating_point)


# Each: the tensor planned, and what is done to it before the save.
STALE_VALUES: dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]] = {
    ".data swapped": (_parameter, lambda t: _swap(t, random_tensor(torch.float32, (4, 3), seed=2))),
    ".data swapped (no grad)": (
        lambda: random_tensor(torch.float32, (4, 3), seed=1),
        lambda t: _swap(t, random_tensor(torch.float32, (4, 3), seed=2)),
    ),
    "requires_grad_ after planning": (
        lambda: random_tensor(torch.float32, (4, 3), seed=1),
        lambda t: t.requires_grad_(True),
    ),
    "t_ (square)": (lambda: _parameter(shape=(4, 4)), _no_grad(torch.Tensor.t_)),
    "t_ (uint32, square)": (lambda: random_tensor(torch.uint32, (4, 4), seed=1), torch.Tensor.t_),
    "t_ (bool)": (lambda: random_tensor(torch.bool, (4, 3), seed=1), torch.Tensor.t_),
    "resize_ smaller (bool)": (lambda: random_tensor(torch.bool, (4, 3), seed=1), lambda t: t.resize_(2, 3)),
    "resize_ larger (uint16)": (
        lambda: random_tensor(torch.uint16, (4, 3), seed=1),
        lambda t: t.resize_(5, 3).__setitem__(slice(4, 5), 7),
    ),
    "resize_ (float32)": (lambda: random_tensor(torch.float32, (4, 3), seed=1), lambda t: t.resize_(2, 5)),
    **{
        f".data swapped ({str(dt).removeprefix('torch.')})": (
            lambda dt=dt: random_tensor(dt, (4, 3), seed=1),
            lambda t, dt=dt: _swap(t, random_tensor(dt, (4, 3), seed=2)),
        )
        for dt in (
            torch.bool,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.uint16,
            torch.uint32,
            torch.uint64,
        )
    },
}


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("change", list(STALE_VALUES))
def test_a_reused_plan_saves_its_tensors_as_they_are_at_the_save(engine, tmp_path, saver, change):
    make, mutate = STALE_VALUES[change]
    t = make()
    _run(engine, saver, {"w": t, "other": torch.arange(5)}, lambda: mutate(t), tmp_path / "f.safetensors")


@pytest.mark.parametrize("saver", SAVERS)
def test_a_reused_plan_of_a_module_saves_it_after_half(engine, tmp_path, saver):
    lin = torch.nn.Linear(3, 4)
    _run(engine, saver, dict(lin.named_parameters()), lin.half, tmp_path / "f.safetensors")


def _as(dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    return lambda t: _swap(t, t.data.to(dtype))


def _viewed_as(dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
    return lambda t: _swap(t, t.data.view(dtype))


# Each: the planned tensor's dtype, whether it is a Parameter, and how its dtype changes.
NEW_DTYPES = {
    "to float16": (torch.float32, False, _as(torch.float16)),
    "to bfloat16": (torch.float32, False, _as(torch.bfloat16)),
    "to float64": (torch.float32, False, _as(torch.float64)),
    "to float16 (parameter)": (torch.float32, True, _as(torch.float16)),
    "to bfloat16 (parameter)": (torch.float32, True, _as(torch.bfloat16)),
    "to float64 (parameter)": (torch.float32, True, _as(torch.float64)),
    "float32 viewed as int32": (torch.float32, False, _viewed_as(torch.int32)),
    "int32 viewed as float32": (torch.int32, False, _viewed_as(torch.float32)),
    "bool viewed as uint8": (torch.bool, False, _viewed_as(torch.uint8)),
    "float64 viewed as complex64": (torch.float64, False, _viewed_as(torch.complex64)),
}


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("change", list(NEW_DTYPES))
def test_a_reused_plan_saves_its_tensors_in_their_dtype_at_the_save(engine, tmp_path, saver, change):
    dtype, parameter, mutate = NEW_DTYPES[change]
    t = _parameter(dtype) if parameter else random_tensor(dtype, (4, 3), seed=1)
    _run(engine, saver, {"w": t}, lambda: mutate(t), tmp_path / "f.safetensors")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("saver", SAVERS[:3])
@pytest.mark.parametrize("now", ["complex128", "complex32"])
def test_a_plan_whose_tensor_can_no_longer_be_saved_is_refused_naming_it_and_the_file(
    engine, tmp_path, saver, now
):
    t = torch.nn.Parameter(torch.randn(4, 3))
    plan = engine.plan({"w": torch.zeros(2), "layer.weight": t})
    t.data = torch.zeros(4, 3, dtype=getattr(torch, now))  # which safetensors cannot hold
    path = tmp_path / "f.safetensors"
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*'layer\.weight'.*{now}"):
        _save(engine, saver, plan, {"layer.weight": t}, path)
    assert not path.exists()
    t.data = torch.ones(4, 3)  # saveable again: the same plan saves it
    _save(engine, saver, plan, {"layer.weight": t}, path)
    assert same(engine.load(path)["layer.weight"], torch.ones(4, 3))


def test_a_plan_remade_for_its_changed_tensors_is_kept_and_an_unchanged_one_is_not_remade(engine, tmp_path):
    w = torch.nn.Parameter(torch.randn(4, 3))
    plan = engine.plan({"w": w})
    exported = plan.arrays[0]
    engine.save_plan(plan, tmp_path / "a.safetensors").wait_persisted(60)
    assert plan.arrays[0] is exported  # unchanged: the plan as made
    w.data = w.data.half()
    engine.save_plan(plan, tmp_path / "b.safetensors").wait_persisted(60)
    assert plan.dtypes == ["F16"] and plan.holds([w]) and plan.arrays[0] is not exported
    exported = plan.arrays[0]
    engine.save_plan(plan, tmp_path / "c.safetensors").wait_persisted(60)
    assert plan.arrays[0] is exported  # made again once, then reused as it is
    assert same(engine.load(tmp_path / "c.safetensors")["w"], w.detach())


def test_a_staged_save_keeps_the_plan_it_staged_when_the_plan_is_remade_before_it_is_queued(engine, tmp_path):
    w = torch.nn.Parameter(torch.randn(4, 3))
    staged_values = w.detach().clone()
    plan = engine.plan({"w": w})
    staged = engine.stage_plans([(plan, tmp_path / "staged.safetensors")])
    w.data = torch.randn(4, 3, dtype=torch.float64)
    engine.save_plan(plan, tmp_path / "now.safetensors")  # remakes the plan: float64 now
    staged.queue()
    engine.wait_persisted(60)
    _check_file(engine, tmp_path / "staged.safetensors", {"w": staged_values})
    _check_file(engine, tmp_path / "now.safetensors", {"w": w.detach()})


def test_a_plan_like_one_whose_tensors_changed_takes_nothing_stale_from_it():
    w = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.zeros(3, dtype=torch.bool)
    state = {"w": w, "b": b}
    before = plan_save(state)
    with torch.no_grad():
        w.t_()
    b.resize_(2)
    again = plan_save(state, like=before)
    assert again.keys == plan_save(state).keys
    assert again.arrays[0].stride() == (1, 4) and again.arrays[1].shape == (2,)
    assert not before.holds([w, b]) and again.holds([w, b])
