"""The Nanotron adapter's pieces that need no Nanotron: file names, the manifest, atomic writes, the
process-wide random states stored through the engine."""

import json
import random

import numpy as np
import pytest
import torch

from nanotron_datastates.checkpoint.checksums import file_checksums
from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import is_datastates_checkpoint, read_manifest
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.names import (
    MANIFEST,
    as_safetensors,
    random_states_name,
    stock_random_states,
)
from nanotron_datastates.checkpoint.topology import topology as make_topology
from nanotron_datastates.checkpoint.topology import topology_changes
from nanotron_datastates.nanotron import rng_states as states


def test_names_follow_nanotron():
    assert as_safetensors("optimizer_pp-0-of-1_tp-0-of-2_exp-0-of-1.pt") == (
        "optimizer_pp-0-of-1_tp-0-of-2_exp-0-of-1.safetensors"
    )
    assert random_states_name((1, 2), (0, 4), (0, 1)) == "tp-1-of-2_dp-0-of-4_pp-0-of-1.safetensors"


def test_write_atomic_replaces_whole_files(tmp_path):
    p = tmp_path / "d" / "latest.txt"
    write_atomic(p, "10")
    write_atomic(p, "20")
    assert p.read_text() == "20"
    assert sorted(x.name for x in p.parent.iterdir()) == ["latest.txt"]  # no temporaries left


def test_manifest_round_trip_and_checks(tmp_path):
    files = {"model/w.safetensors": {"bytes": 4100, "crc32c": {"data": "0000abcd"}}}
    write_atomic(tmp_path / MANIFEST, json.dumps(make_manifest(5, {"tp": 1}, files)))
    assert is_datastates_checkpoint(tmp_path)
    doc = read_manifest(tmp_path)
    assert doc["step"] == 5 and doc["files"] == files
    assert file_checksums(doc, tmp_path, tmp_path / "model" / "w.safetensors") == {"data": 0xABCD}
    assert file_checksums(doc, tmp_path, tmp_path / "other.safetensors") is None
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(ValueError, match="not a nanotron-datastates manifest"):
        read_manifest(tmp_path)


def test_global_random_states_round_trip_through_the_engine(engine, tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = states.global_rng_state()
    engine.save(saved, tmp_path / "r.safetensors").wait_persisted()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    states.set_global_rng_state(engine.load(tmp_path / "r.safetensors"))
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])


def test_random_states_name_with_context_parallelism():
    """Nanotron main names one file for all context-parallel ranks; each of ours has its own."""
    assert (
        random_states_name((0, 1), (1, 2), (0, 1), (1, 2))
        == "tp-0-of-1_dp-1-of-2_pp-0-of-1_cp-1-of-2.safetensors"
    )
    assert random_states_name((0, 1), (1, 2), (0, 1), (0, 1)) == "tp-0-of-1_dp-1-of-2_pp-0-of-1.safetensors"
    assert stock_random_states("tp-0-of-1_dp-1-of-2_pp-0-of-1_cp-1-of-2.safetensors") == (
        "tp-0-of-1_dp-1-of-2_pp-0-of-1.pt",
        False,
    )
    assert stock_random_states("tp-0-of-1_dp-1-of-2_pp-0-of-1_cp-0-of-2.safetensors") == (
        "tp-0-of-1_dp-1-of-2_pp-0-of-1.pt",
        True,
    )
    assert stock_random_states("tp-0-of-1_dp-1-of-2_pp-0-of-1.safetensors") == (
        "tp-0-of-1_dp-1-of-2_pp-0-of-1.pt",
        True,
    )
    assert stock_random_states("notes.safetensors") is None


def test_topology_changes_default_cp_to_one():
    """Manifests written before context parallelism have no cp: they were written with cp=1."""
    here = make_topology(tp=1, pp=1, dp=2, cp=1, expert=1, zero_stage=1)
    old = {"tp": 1, "pp": 1, "dp": 2, "expert": 1, "zero_stage": 1}
    assert topology_changes(old, here) == {}
    assert topology_changes(old, {**here, "cp": 2}) == {"cp": (1, 2)}
    assert topology_changes({**old, "dp": 4}, here) == {"dp": (4, 2)}
