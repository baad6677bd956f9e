"""`convert --to datastates` reads Nanotron's stock `.pt` files without unpickling arbitrary objects: a
crafted pickle in `optimizer/` or `lr_scheduler/` is refused, naming the file, and its payload never runs;
with the opt-in (`allow_pickle=True`, `--allow-pickle`) it is unpickled as before, and its payload runs,
which is what makes these tests able to fail. The random states, which need Nanotron, are in
adapter/test_nanotron_convert.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from test_convert import LR_SCHEDULER, OPTIMIZER, stock_checkpoint

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.checkpoint.checksums import file_entry
from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import is_datastates_checkpoint, read_manifest
from nanotron_datastates.checkpoint.names import MANIFEST, as_safetensors
from nanotron_datastates.cli import main
from nanotron_datastates.nanotron.checkpoint.convert import UnpicklingRefused, convert


class Payload:
    """Unpickles as `os.system("touch <marker>")`: the marker file says the code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path: Path, marker: Path) -> None:
    """Rewrites the stock file `path` as its own state with a payload under one more key: a file Nanotron's
    loaders would take, as an attacker would make it."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, path)


@pytest.mark.parametrize("rel", [LR_SCHEDULER, OPTIMIZER])
def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path: Path, rel: str) -> None:
    stock, marker = tmp_path / "stock", tmp_path / "ran"
    stock_checkpoint(stock, with_random=False)
    plant(stock / rel, marker)
    out = tmp_path / "datastates"
    with pytest.raises(UnpicklingRefused, match=re.escape(str(stock / rel))) as e:
        convert(stock, out, "datastates")
    message = str(e.value)
    assert "allow_pickle=True" in message and "--allow-pickle" in message and "trusted" in message
    assert isinstance(e.value, ValueError) and isinstance(e.value, pickle.UnpicklingError)
    assert not marker.exists()
    assert not out.exists()

    # The opt-in unpickles it as Nanotron does: the payload runs (os.system's 0 takes its place).
    ours = convert(stock, out, "datastates", allow_pickle=True)
    assert marker.exists()
    assert as_safetensors(rel) in read_manifest(ours)["files"]


def test_the_command_refuses_it_naming_the_file_and_the_flag(tmp_path: Path, capsys) -> None:
    stock, marker = tmp_path / "stock", tmp_path / "ran"
    stock_checkpoint(stock, with_random=False)
    plant(stock / LR_SCHEDULER, marker)
    out = tmp_path / "datastates"
    assert main(["convert", str(stock), str(out), "--to", "datastates"]) == 1
    err = capsys.readouterr().err
    assert str(stock / LR_SCHEDULER) in err and "--allow-pickle" in err and "Traceback" not in err
    assert not marker.exists() and not out.exists()

    assert main(["convert", str(stock), str(out), "--to", "datastates", "--allow-pickle"]) == 0
    assert marker.exists() and is_datastates_checkpoint(out)


def test_stock_files_are_read_with_weights_only(tmp_path: Path, monkeypatch) -> None:
    """Optimizer and scheduler state dicts are tensors and plain containers: weights_only reads them all."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    calls: list[Any] = []
    load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    convert(stock, tmp_path / "datastates", "datastates")
    assert calls == [True, True]


def test_a_datastates_pickled_leaf_needs_the_opt_in_too(tmp_path: Path) -> None:
    """The other way: a datastates checkpoint whose file holds a pickled leaf is unpickled only with it."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    ours = convert(stock, tmp_path / "datastates", "datastates")
    rel = as_safetensors(LR_SCHEDULER)
    with DataStatesEngine(host_cache_size=1 / 64, pin_host_cache=False) as engine:
        state = engine.load(ours / rel)
        state["extra"] = complex(1, 2)  # no JSON form: a pickled leaf
        (ours / rel).unlink()
        h = engine.save(state, ours / rel, allow_pickle=True)
        h.wait_persisted()
    doc = read_manifest(ours)
    doc["files"][rel] = file_entry((ours / rel).stat().st_size, h)
    write_atomic(ours / MANIFEST, json.dumps(doc))

    with pytest.raises(ValueError, match="allow_pickle=True"):
        convert(ours, tmp_path / "torch", "torch")
    assert not (tmp_path / "torch").exists()
    back = convert(ours, tmp_path / "torch", "torch", allow_pickle=True)
    assert torch.load(back / LR_SCHEDULER, weights_only=False)["extra"] == complex(1, 2)
