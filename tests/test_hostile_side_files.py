"""Nanotron's own files beside a checkpoint (its metadata, `config.yaml`), written by someone else: `inspect`,
`verify` and `convert`, and the stock layout's reading, read them to a bound, take a value of the wrong type
for a missing one or fail naming the file, and never end in a traceback (an AttributeError, a RecursionError,
an OverflowError, a MemoryError) or read a file of any size whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_convert import stock_checkpoint
from test_hostile_files import run

from nanotron_datastates.checkpoint.file_io import MAX_SIDE_FILE
from nanotron_datastates.checkpoint.names import NANOTRON_METADATA
from nanotron_datastates.checkpoint.topology import stock_topology

CONFIG = "config.yaml"
DEEP = 5000  # deeper than Python's recursion limit


def _meta(folder: Path, **changes: object) -> None:
    doc = json.loads((folder / NANOTRON_METADATA).read_text())
    doc.update(changes)
    (folder / NANOTRON_METADATA).write_text(json.dumps(doc))


def _damage(folder: Path, how: str) -> Path:
    """The stock checkpoint `folder` with one of its side files made hostile; that file."""
    if how == "metas-list":
        _meta(folder, metas=[1])
        return folder / NANOTRON_METADATA
    if how == "metadata-deep":
        (folder / NANOTRON_METADATA).write_text("[" * DEEP + "]" * DEEP)
        return folder / NANOTRON_METADATA
    path = folder / CONFIG
    if how == "parallelism-list":
        path.write_text("parallelism: [1]\n")
    elif how == "pp-infinite":
        path.write_text("parallelism: {pp: .inf, tp: 1, dp: 1}\n")
    elif how == "pp-text":
        path.write_text("parallelism: {pp: two, tp: 1, dp: 1}\n")
    elif how == "optimizer-list":
        path.write_text("parallelism: {pp: 1}\noptimizer: [0]\n")
    elif how == "config-deep":
        path.write_text("a: " + "[" * DEEP + "]" * DEEP + "\n")
    elif how == "config-huge":
        with open(path, "r+b") as f:
            f.truncate(MAX_SIDE_FILE + 1)  # sparse: no disk, a read of it whole would take the memory
    else:
        raise AssertionError(how)
    return path


HOW = [
    "metas-list", "metadata-deep", "parallelism-list", "pp-infinite", "pp-text", "optimizer-list",
    "config-deep", "config-huge",
]  # fmt: skip


@pytest.fixture
def stock(tmp_path) -> Path:
    folder = tmp_path / "ckpt" / "10"
    folder.mkdir(parents=True)
    stock_checkpoint(folder, with_random=False)
    return folder


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_describe_or_name_a_hostile_side_file(stock, capsys, how, command):
    path = _damage(stock, how)
    for where in (stock, stock.parent):
        rc, out = run(capsys, command, str(where))  # returned: no exception left the command
        assert rc in (0, 1), out
        if how == "config-huge" and command == "inspect":  # verify reads no config
            assert rc == 1 and str(path) in out, out


@pytest.mark.parametrize("how", HOW)
def test_convert_names_a_hostile_side_file_and_writes_nothing(stock, tmp_path, capsys, how):
    path = _damage(stock, how)
    out = tmp_path / "out"
    rc, text = run(capsys, "convert", str(stock), str(out), "--to", "datastates")
    assert rc == 1 and str(path) in text, text
    assert not out.exists()


@pytest.mark.parametrize("how", [h for h in HOW if h != "config-huge"])
def test_the_stock_layout_is_read_without_what_a_hostile_side_file_says(stock, how):
    _damage(stock, how)
    topology = stock_topology(stock)
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in topology.values()), topology


def test_the_stock_layout_refuses_a_side_file_over_its_bound_naming_it(stock):
    path = _damage(stock, "config-huge")
    with pytest.raises(OSError, match="more than"):
        stock_topology(stock)
    assert str(path) in str(pytest.raises(OSError, stock_topology, stock).value)
