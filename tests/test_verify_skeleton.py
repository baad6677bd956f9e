"""`verify` runs the checks `load` runs, the skeleton included: a file whose skeleton `load` refuses is a
problem for `verify` too, naming the file."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from nanotron_datastates import DataStatesEngine, FormatError
from nanotron_datastates.checkpoint.verify import verify

SKELETONS = {
    "not-json": "{not json",
    "unknown-tag": json.dumps({"d": [["a", {"q": 1}]]}),
    "bad-base64": json.dumps({"b": "***"}),
    "missing-tensor": json.dumps({"d": [["a", {"t": "nope"}]]}),
    "deep": "[" * 50_000 + "]" * 50_000,
    "unhashable-key": json.dumps({"d": [[{"l": [1]}, 1]]}),
}


@pytest.mark.parametrize("name", sorted(SKELETONS))
def test_verify_refuses_what_load_refuses(tmp_path, name):
    path = tmp_path / f"{name}.safetensors"
    metadata = {"datastates.version": "1", "datastates.skeleton": SKELETONS[name]}
    save_file({"w": torch.arange(4.0)}, str(path), metadata=metadata)
    with DataStatesEngine(host_cache_size=1 / 64) as engine:
        with pytest.raises(FormatError, match=str(path)):
            engine.load(path)
        report = verify(path, engine)
    assert not report.ok and str(path) in report.problems[0], report.problems


def test_verify_checks_a_pickled_leaf_without_unpickling_it(tmp_path):
    """A pickled leaf: `verify` checks its base64 but never unpickles (nothing runs); `load` refuses it
    without the opt-in."""
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(_Payload(str(marker)))).decode()
    path = tmp_path / "pickled.safetensors"
    metadata = {"datastates.version": "1", "datastates.skeleton": json.dumps({"d": [["x", {"p": payload}]]})}
    save_file({"w": torch.arange(4.0)}, str(path), metadata=metadata)
    with DataStatesEngine(host_cache_size=1 / 64) as engine:
        assert verify(path, engine).ok
        with pytest.raises(FormatError, match="allow_pickle"):
            engine.load(path)
    assert not marker.exists()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))
