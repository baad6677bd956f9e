"""Converting a stock checkpoint that holds Nanotron's pickled RandomStates, and back (the helpers are
test_convert.py's); the random states read without unpickling, a crafted one refused (test_convert_pickles.py
has the other pickles)."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import nanotron.random as nanotron_random
import pytest
import torch
from test_convert import RANDOM, check_datastates, check_torch, stock_checkpoint
from test_convert_pickles import Payload
from torch.torch_version import TorchVersion

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.checkpoint.names import as_safetensors
from nanotron_datastates.nanotron.checkpoint.convert import UnpicklingRefused, convert


def test_round_trip(tmp_path: Path) -> None:
    stock = tmp_path / "stock"
    original = stock_checkpoint(stock, with_random=True)
    dstates = convert(stock, tmp_path / "datastates", "datastates")
    assert dstates == tmp_path / "datastates"
    check_datastates(dstates, original, with_random=True)
    with DataStatesEngine(host_cache_size=1 / 64, pin_host_cache=False) as engine:
        saved = engine.load(dstates / as_safetensors(RANDOM))
    assert set(saved) == {"nanotron"}  # no process-wide states: the stock layout never kept them

    back = convert(dstates, tmp_path / "torch", "torch")
    check_torch(back, dstates, original)
    random_states = torch.load(back / RANDOM, map_location="cpu", weights_only=False)
    assert isinstance(random_states, nanotron_random.RandomStates)
    assert random_states == original["random"]


def test_random_states_are_read_without_unpickling(tmp_path: Path, monkeypatch) -> None:
    """Nanotron's RandomStates load with weights_only and the allow-list of what they hold: no opt-in."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=True)
    calls: list[Any] = []
    load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    before = _user_safe_globals()
    convert(stock, tmp_path / "datastates", "datastates")
    assert calls == [True, True, True]
    assert _user_safe_globals() == before  # allowed while loading only


def test_a_crafted_random_states_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    stock, marker = tmp_path / "stock", tmp_path / "ran"
    original = stock_checkpoint(stock, with_random=True)
    state = original["random"]["tp_synced"]
    # The payload where Python's generator state ends (None there): Nanotron's loader would run it.
    state.random = (*state.random[:2], Payload(marker))
    torch.save(original["random"], stock / RANDOM)
    out = tmp_path / "datastates"
    with pytest.raises(UnpicklingRefused, match=re.escape(str(stock / RANDOM))) as e:
        convert(stock, out, "datastates")
    assert "--allow-pickle" in str(e.value) and "allow_pickle=True" in str(e.value)
    assert not marker.exists() and not out.exists()

    convert(stock, out, "datastates", allow_pickle=True)
    assert marker.exists()


def test_allowed_classes_holding_something_else_are_refused(tmp_path: Path) -> None:
    """Only Nanotron's classes are allowed, but what they hold is checked too: no RandomState, no convert."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=True)
    odd = nanotron_random.RandomStates.__new__(nanotron_random.RandomStates)
    odd._dict = {"tp_synced": torch.zeros(3)}
    torch.save(odd, stock / RANDOM)
    with pytest.raises(ValueError, match=re.escape(str(stock / RANDOM))):
        convert(stock, tmp_path / "datastates", "datastates")
    assert not (tmp_path / "datastates").exists()


def test_a_torch_without_safe_globals(tmp_path: Path, monkeypatch) -> None:
    """torch 2.4 has add_safe_globals only: used, and undone after; older ones have neither: refused, saying
    what to do, unless opted in."""
    stock = tmp_path / "stock"
    original = stock_checkpoint(stock, with_random=True)
    monkeypatch.delattr(torch.serialization, "safe_globals")
    before = _user_safe_globals()
    dstates = convert(stock, tmp_path / "one", "datastates")
    check_datastates(dstates, original, with_random=True)
    assert _user_safe_globals() == before

    monkeypatch.delattr(torch.serialization, "add_safe_globals")
    with pytest.raises(UnpicklingRefused, match=re.escape(str(stock / RANDOM))) as e:
        convert(stock, tmp_path / "two", "datastates")
    assert f"torch {torch.__version__} cannot allow" in str(e.value) and "--allow-pickle" in str(e.value)
    assert "refused by torch.load" not in str(e.value)  # said once, not wrapped in the load's refusal
    assert not (tmp_path / "two").exists()
    check_datastates(convert(stock, tmp_path / "two", "datastates", allow_pickle=True), original, True)


def test_random_states_written_under_the_other_numpy_major_version(tmp_path: Path) -> None:
    """NumPy 2 moved the array's rebuilder from numpy.core to numpy._core: a stock file names the module of
    the NumPy that wrote it. torch >= 2.6 allows both names; an older torch refuses the other one."""
    stock = tmp_path / "stock"
    original = stock_checkpoint(stock, with_random=True)
    path = stock / RANDOM
    names = (b"numpy._core.multiarray\n_reconstruct", b"numpy.core.multiarray\n_reconstruct")
    with zipfile.ZipFile(path) as z:
        members = [(info.filename, z.read(info)) for info in z.infolist()]
    swapped = []
    for name, data in members:
        if name.endswith("/data.pkl"):
            ours, other = names if names[0] in data else names[::-1]
            assert ours in data
            data = data.replace(ours, other)
        swapped.append((name, data))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in swapped:
            z.writestr(name, data)
    if TorchVersion(torch.__version__) >= "2.6":
        check_datastates(convert(stock, tmp_path / "datastates", "datastates"), original, with_random=True)
    else:
        with pytest.raises(UnpicklingRefused, match="--allow-pickle"):
            convert(stock, tmp_path / "datastates", "datastates")


def _user_safe_globals() -> set[Any]:
    """What torch allows this process beyond its defaults (kept in a set: no order)."""
    return set(torch.serialization.get_safe_globals())
