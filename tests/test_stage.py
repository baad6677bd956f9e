"""Staging's kept layout (save/stage.py): reused only for the very tensors it was made for, unchanged, and
holding none of them alive; every save staged with it holds the values of its own time."""

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine

from helpers import same


def _files() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "a": {"w": torch.randn(333, 7).to(torch.bfloat16), "b": torch.randn(5)},
        "b": {"m": torch.randn(17, 3), "step": torch.tensor(3.0), "t": torch.randn(40)[::2]},  # a view
        "c": {"empty": torch.zeros(0, 4), "i": torch.arange(9), "u": torch.ones(3, 5).byte()},
    }


def _places(handles) -> list[list[tuple[int, torch.Size]]]:
    return [[(t.storage_offset() * t.element_size(), t.shape) for t in h._keepalive] for h in handles]


def _staged_values(files, n: int) -> dict[str, dict[str, torch.Tensor]]:
    for state in files.values():
        for t in state.values():
            t.fill_(n) if t.numel() else None
    return {k: {name: t.clone() for name, t in v.items()} for k, v in files.items()}


def _loads_as(engine, folder, expect) -> None:
    for k, state in expect.items():
        back = engine.load(folder / f"{k}.safetensors")
        assert back.keys() == state.keys() and all(same(back[m], t) for m, t in state.items()), (folder, k)


def test_checkpoints_of_the_same_tensors_reuse_the_layout_and_each_holds_its_own_values(engine, tmp_path):
    files = _files()
    plans = [engine.plan(state) for state in files.values()]
    places, layouts = [], []
    for n in range(3):
        expect = _staged_values(files, n)
        handles = engine.save_plans(
            [(p, tmp_path / str(n) / f"{k}.safetensors") for p, k in zip(plans, files)], stage=True
        )
        layouts.append(engine._stager._last)
        places.append(_places(handles))
        for state in files.values():  # the caller may change them at once
            for t in state.values():
                t.fill_(-1) if t.numel() else None
        engine.wait_persisted()
        _loads_as(engine, tmp_path / str(n), expect)
    assert layouts[0] is layouts[1] is layouts[2]
    assert places[0] == places[1] == places[2]  # the kept layout packs the files as the first did


def test_a_tensor_resized_in_place_or_replaced_gets_a_fresh_layout(engine, tmp_path):
    x, y = torch.arange(12.0), torch.ones(4, 4)
    engine.save_plans([(engine.plan({"x": x, "y": y}), tmp_path / "0.safetensors")], stage=True)
    first = engine._stager._last
    x.resize_(3, 4)  # the same tensor, another shape
    engine.save_plans([(engine.plan({"x": x, "y": y}), tmp_path / "1.safetensors")], stage=True)
    resized = engine._stager._last
    other = torch.full((3, 4), 7.0)  # another tensor of the same shape
    engine.save_plans([(engine.plan({"x": other, "y": y}), tmp_path / "2.safetensors")], stage=True)
    assert len({id(first), id(resized), id(engine._stager._last)}) == 3
    engine.wait_persisted()
    assert same(engine.load(tmp_path / "1.safetensors")["x"], torch.arange(12.0).view(3, 4))
    assert same(engine.load(tmp_path / "2.safetensors")["x"], other)


def test_a_plan_saved_again_is_staged_without_a_second_check_unless_its_tensors_changed(engine, tmp_path):
    """The same plan staged again: its entries, checked by the save (`current`), are the ones the kept layout
    was last found to fit, so no tensor is checked again; a tensor resized in place renews the plan's
    entries, and then the layout is checked, found wrong, and made anew."""
    x, y = torch.arange(12.0), torch.ones(4, 4)
    plan = engine.plan({"x": x, "y": y})
    for n in range(2):
        engine.save_plans([(plan, tmp_path / f"{n}.safetensors")], stage=True)
    kept = engine._stager._last
    assert kept is not None and kept.checked[0] is plan.keys  # what the next fit compares, by identity
    x.resize_(3, 4)
    engine.save_plans([(plan, tmp_path / "2.safetensors")], stage=True)
    assert engine._stager._last is not kept and engine._stager._last.checked[0] is plan.keys
    engine.wait_persisted()
    assert same(engine.load(tmp_path / "1.safetensors")["x"], torch.arange(12.0))
    assert same(engine.load(tmp_path / "2.safetensors")["x"], torch.arange(12.0).view(3, 4))


def test_the_kept_layout_keeps_no_tensor_alive(engine, tmp_path):
    x = torch.randn(1000)
    gone = weakref.ref(x)
    plan = engine.plan({"x": x})
    for n in range(2):  # the second save builds the layout's reusable views
        engine.save_plans([(plan, tmp_path / f"{n}.safetensors")], stage=True)
    engine.wait_persisted()
    assert engine._stager._last is not None
    del x, plan
    gc.collect()
    assert gone() is None


def test_a_staged_save_queued_later_holds_the_values_of_its_staging(tmp_path):
    """`stage_plans` copies now and `queue` hands the copies to the engine later (a trainer queues once its
    next optimizer step is launched): changes in between do not reach the file; a staged save is queued
    once, and not by a closed engine."""
    files = _files()
    expect = {k: {name: t.clone() for name, t in v.items()} for k, v in files.items()}
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
        staged = engine.stage_plans(
            [(engine.plan(state), tmp_path / f"{k}.safetensors") for k, state in files.items()]
        )
        assert not list(tmp_path.iterdir())  # nothing handed to the engine yet
        for state in files.values():  # the step that follows the staging
            for t in state.values():
                t.fill_(-1) if t.numel() else None
        handles = staged.queue()
        assert [h.staged for h in handles] == [True] * 3
        with pytest.raises(ValueError, match="already queued"):
            staged.queue()
        engine.wait_persisted()
        _loads_as(engine, tmp_path, expect)
        late = engine.stage_plans([(engine.plan({"x": torch.ones(3)}), tmp_path / "late.safetensors")])
    with pytest.raises(ValueError, match="engine is closed"):
        late.queue()
    assert not (tmp_path / "late.safetensors").exists()


def test_a_staged_file_replanned_before_its_queuing_takes_the_new_plain_values_and_the_staged_tensors(
    tmp_path,
):
    """`StagedSave.replan`: a file's plan swapped, before the queuing, for a plan of the very tensors staged
    (a trainer plans its optimizer once the step is launched, from a copy of the state taken before it). The
    file holds the new plan's plain values and the staging's tensor values; a plan of other tensors, or of the
    same ones reshaped, is refused, naming the file, and the save can still be queued as it was."""
    m, v = torch.randn(6, 4), torch.randn(10)
    state = {"lr": 1e-3, "state": {"m": m, "v": v}}
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
        kept = engine.plan(state)
        expect = {"m": m.clone(), "v": v.clone()}
        staged = engine.stage_plans([(kept, tmp_path / "opt.safetensors")])
        m.fill_(-1)  # the step
        other = engine.plan({"lr": 1e-3, "state": {"m": m.clone(), "v": v}})
        with pytest.raises(ValueError, match=r"opt\.safetensors: the new plan does not hold the tensors"):
            staged.replan(0, other)
        v.resize_(5)  # the same tensor, another shape
        with pytest.raises(ValueError, match="does not hold the tensors staged"):
            staged.replan(0, engine.plan({"lr": 1e-3, "state": {"m": m, "v": v}}))
        v.resize_(10)
        staged.replan(0, engine.plan({"lr": 5e-4, "state": {"m": m, "v": v}}, like=kept))
        staged.queue()
        with pytest.raises(ValueError, match="already queued"):
            staged.replan(0, kept)
        engine.wait_persisted()
        back = engine.load(tmp_path / "opt.safetensors")
        assert back["lr"] == 5e-4
        assert all(same(back["state"][k], t) for k, t in expect.items())


def test_kept_buffers_take_the_next_staging_once_the_save_has_read_them(engine, tmp_path):
    """`stage(keep=True)`: once its save has read the copies, the next staging of the same tensors copies
    into the same memory, through the same views; each file holds the values of its own staging; without
    `keep` (or once released) the memory is the allocator's again."""
    files = _files()
    plans = [engine.plan(state) for state in files.values()]
    bases = []
    for n in range(3):
        expect = _staged_values(files, n)
        staged = engine.stage(plans, keep=True)
        bases.append([b.data_ptr() for b in staged._prep.bases])
        for state in files.values():  # the step after the staging
            for t in state.values():
                t.fill_(-1) if t.numel() else None
        staged.target([tmp_path / str(n) / f"{k}.safetensors" for k in files])
        staged.queue()
        engine.wait_persisted()
        _loads_as(engine, tmp_path / str(n), expect)
    assert bases[0] == bases[1] == bases[2]
    assert engine.staging_nbytes == sum(engine._stager._last.sizes)
    engine.release_staging()
    assert engine.staging_nbytes == 0 and engine._stager._kept is None
    staged = engine.stage(plans)  # not kept
    staged.target([tmp_path / "3" / f"{k}.safetensors" for k in files])
    staged.queue()
    engine.wait_persisted()
    assert engine.staging_nbytes == 0


def test_kept_buffers_lent_to_a_save_not_done_with_them_are_never_written(engine, tmp_path):
    """A staging whose save was never queued (it failed, or was dropped) still owns the kept buffers: the
    next staging takes new ones, kept in their place, and the first copies keep their values."""
    files = _files()
    plans = [engine.plan(state) for state in files.values()]
    first_values = _staged_values(files, 1)
    first = engine.stage(plans, keep=True)
    second_values = _staged_values(files, 2)
    second = engine.stage(plans, keep=True)
    second_bases = [b.data_ptr() for b in second._prep.bases]
    assert [b.data_ptr() for b in first._prep.bases] != second_bases
    assert engine._stager._kept.bases is second._prep.bases
    for staged, n in ((first, 1), (second, 2)):
        staged.target([tmp_path / str(n) / f"{k}.safetensors" for k in files])
        staged.queue()
    engine.wait_persisted()
    _loads_as(engine, tmp_path / "1", first_values)
    _loads_as(engine, tmp_path / "2", second_values)
    third = engine.stage(plans, keep=True)  # the second's buffers, kept and read by now
    assert [b.data_ptr() for b in third._prep.bases] == second_bases


def test_a_staged_saves_paths_are_made_absolute_as_abspath_makes_them(tmp_path, monkeypatch):
    """`absolute` skips abspath's normalization only where it would change nothing."""
    from nanotron_datastates.save.staged_save import absolute

    monkeypatch.chdir(tmp_path)
    parts = ["", ".", "..", "a", "b.", "..c", "...", "d/"]
    paths = {"/", "//", "///x", "/a/b/c.safetensors", str(tmp_path / "f"), "rel/x", "./x", "../x"}
    for a in parts:
        for b in parts:
            for c in parts:
                paths |= {f"/{a}/{b}/{c}", f"/{a}{b}/{c}", f"{a}/{b}/{c}", f"/{a}//{b}{c}"}
    for p in sorted(paths):
        assert absolute(p) == os.path.abspath(p), p
        assert absolute(Path(p)) == os.path.abspath(p), p
