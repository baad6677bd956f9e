"""Committing across ranks, for real: two processes, a gloo group, the engine writing each rank's files.
latest.txt and the manifest name a checkpoint only once both ranks' files are persisted; a failure on one rank
means no commit, reported identically on both; earlier checkpoints stay committed."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.checkpoint.checksums import file_checksums
from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST, name_in
from nanotron_datastates.save.commit import Committer, PendingCheckpoint


def _worker(rank: int, world: int, init: str, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    root_p = Path(root)
    results = []
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        committer = Committer(group)
        for step in (1, 2, 3):
            folder = root_p / str(step)
            # Checkpoint 2 fails on rank 1: a file stands where its folder should be.
            sub = "blocked/x" if (step == 2 and rank == 1) else f"model/rank{rank}"
            handles = [
                engine.save(
                    {"w": torch.full((300_000,), float(step * 10 + rank))}, folder / sub / "w.safetensors"
                )
            ]

            def finalize(files, folder=folder, step=step):
                write_atomic(folder / MANIFEST, json.dumps(make_manifest(step, {}, files)))
                write_atomic(root_p / LATEST, str(step))

            committer.submit(PendingCheckpoint(step, folder, handles, finalize if rank == 0 else None))
            if step == 2:  # latest.txt is still 1 whatever happens to checkpoint 2
                results += [(r.step, r.committed) for r in committer.take(1)]
        results += [(r.step, r.committed, len(r.errors), r.files) for r in committer.take(2)]
        committer.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_commit_only_when_both_persisted(tmp_path):
    root = tmp_path / "ckpt"
    (root / "2").mkdir(parents=True)
    (root / "2" / "blocked").write_text("a file, not a folder")
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(2, init, str(root), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == r1  # both ranks saw the same outcomes
    assert r0[0] == [1, True]
    assert r0[1][:3] == [2, False, 1] and r0[2] == [3, True, 0, 2]
    assert (root / LATEST).read_text() == "3"
    assert not (root / "2" / MANIFEST).exists()  # the failed checkpoint is not marked committed
    doc = read_manifest(root / "3")
    assert set(doc["files"]) == {"model/rank0/w.safetensors", "model/rank1/w.safetensors"}
    for rank in (0, 1):
        back = DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1))
        sums = file_checksums(doc, root / "3", root / "3" / f"model/rank{rank}" / "w.safetensors")
        assert bool(
            (
                back.load(root / "3" / f"model/rank{rank}" / "w.safetensors", checksums=sums)["w"]
                == 30 + rank
            ).all()
        )
        back.close()


def test_a_checkpoint_that_could_not_be_queued_is_reported_failed_and_the_next_commits(tmp_path):
    """The trainer hands the committer a checkpoint whose files it could not queue (its error, no handles):
    every rank then agrees it failed (here one rank), latest.txt stays, and the next checkpoint commits."""
    root = tmp_path / "ckpt"
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        committer = Committer(None)

        def finalize(step):
            def commit(files):
                write_atomic(root / str(step) / MANIFEST, json.dumps(make_manifest(step, {}, files)))
                write_atomic(root / LATEST, str(step))

            return commit

        failed = PendingCheckpoint(
            1, root / "1", [], finalize(1), errors=["queuing its files failed: TypeError()"]
        )
        committer.submit(failed)
        h = engine.save({"w": torch.ones(1000)}, root / "2" / "w.safetensors")
        committer.submit(PendingCheckpoint(2, root / "2", [h], finalize(2)))
        first, second = committer.take(2)
        committer.close()
    assert not first.committed and first.errors == ["rank 0: queuing its files failed: TypeError()"]
    assert second.committed and (root / LATEST).read_text() == "2"
    assert not (root / "1").exists()


@given(
    folder=st.lists(st.sampled_from(["a", "10", ".", "..", "", "b.c"]), max_size=4),
    rest=st.lists(st.sampled_from(["x.safetensors", "m", ".", "..", "", "..x"]), min_size=1, max_size=4),
    absolute=st.booleans(),
)
def test_a_files_name_in_its_folder_is_what_relpath_says(folder, rest, absolute):
    """The manifest names each file by its path in the checkpoint folder: the fast tail where the path lies
    below the folder as given, relpath's answer in every case."""
    base = ("/" if absolute else "") + "/".join(folder)
    path = "/".join([base, *rest]) if base else "/".join(rest)
    if not path or not base:
        return
    assert name_in(path, base) == Path(os.path.relpath(path, base)).as_posix()
