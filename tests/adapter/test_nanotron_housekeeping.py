"""The trainer's report of each commit (rank 0): rotation by `datastates.keep_last_n` and the telemetry line,
through the mixin's own code (a bare instance holding what those methods read; building a real trainer needs
CUDA and NCCL)."""

import json
import types

import pytest
import torch.distributed as tdist

from nanotron_datastates import DataStatesConfig, DataStatesEngine  # noqa: E402
from nanotron_datastates.nanotron import (  # noqa: E402
    housekeeping,
    layout,
    mixin,  # noqa: E402
)
from nanotron_datastates.nanotron.commit import CommitResult  # noqa: E402


@pytest.fixture
def trainer(tmp_path):
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    engine = DataStatesEngine(host_cache_size=1 / 64)
    t = mixin.DataStatesTrainerMixin.__new__(mixin.DataStatesTrainerMixin)
    t.config = types.SimpleNamespace(
        checkpoints=types.SimpleNamespace(checkpoints_path=str(tmp_path / "ckpt")),
        datastates=DataStatesConfig(keep_last_n=1),
    )
    t.parallel_context = types.SimpleNamespace(world_pg=tdist.group.WORLD)
    t._ds_engine = engine
    yield t
    engine.close()
    tdist.destroy_process_group()


def test_a_commit_rotates_and_writes_a_telemetry_line(trainer, tmp_path):
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        (root / str(step)).mkdir(parents=True)
        layout.write_atomic(root / str(step) / layout.MANIFEST, json.dumps(layout.manifest(step, {}, {})))
    (root / "30" / ".w.safetensors.dstmp.1.1").write_bytes(b"x")
    layout.write_atomic(root / layout.LATEST, "30")
    trainer._ds_report(CommitResult(30, root / "30", True, [], 1000, 3, 0.01, 0.02, 0.5, 0.6))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["30"]
    assert not list((root / "30").glob(".*dstmp*"))
    trainer._ds_report(CommitResult(40, root / "40", False, ["rank 0: EIO"], 0, 0, 0.01, 0, 0, 0.7))
    first, second = housekeeping.read_telemetry(root)
    assert first["step"] == 30 and first["committed"] and first["bytes"] == 1000
    assert sorted(first["removed"]) == [str(root / "10"), str(root / "20")]
    assert "cache_high_water_bytes" in first and first["cache_bytes"] > 0
    assert second["step"] == 40 and not second["committed"] and second["errors"] == ["rank 0: EIO"]
    assert (root / "30").is_dir()  # a failed checkpoint removes nothing
