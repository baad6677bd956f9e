"""Reading a checkpoint ahead on resume (no Nanotron needed): the files come back whole, checked against the
manifest's checksums, and anything that cannot be read ahead is left to the ordinary path, never raised."""

import logging
import os

import pytest
import torch

from nanotron_datastates import DataStatesEngine, state_parts
from nanotron_datastates.resume.read_ahead import (
    Prefetch,
    fits_in_memory,
    warm_for_reshard,
    warm_page_cache,
)

from helpers import same, small_config


def _write(engine, tmp_path):
    weights = {tmp_path / "model" / f"w{i}.safetensors": torch.randn(300, 7) for i in range(5)}
    sums = {}
    for path, t in weights.items():
        h = engine.save({"data": t}, path, metadata={"sharded": "false"}, exact_metadata=True)
        sums[path] = h.checksums()
    optimizer = {"state": {0: {"exp_avg": torch.randn(50)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    opt_path = tmp_path / "optimizer" / "optimizer.safetensors"
    engine.save(optimizer, opt_path).wait_persisted()
    return weights, sums, optimizer, opt_path


def test_weights_and_optimizer_are_read_ahead_and_handed_over_once(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        weights, sums, optimizer, opt_path = _write(engine, tmp_path)
        ahead = Prefetch(engine, torch.device("cpu"), list(weights), [opt_path], sums.get)
        got = ahead.weights()
        assert set(got) == set(weights)
        assert all(same(got[p]["data"], t) for p, t in weights.items())
        assert ahead.weights() == {}  # handed over once: the prefetch holds no memory any more
        state = ahead.optimizer([opt_path])
        assert same(state["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])
        assert ahead.optimizer([opt_path]) is None


def test_another_optimizer_file_than_the_one_read_is_not_handed_over(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        _, _, _, opt_path = _write(engine, tmp_path)
        ahead = Prefetch(engine, torch.device("cpu"), [], [opt_path], lambda p: None)
        assert ahead.optimizer([tmp_path / "optimizer" / "other.safetensors"]) is None


def test_an_optimizer_state_in_parts_is_read_ahead_and_handed_over_put_together(tmp_path):
    optimizer = {
        "state": {i: {"exp_avg": torch.randn(50 + i), "exp_avg_sq": torch.rand(50 + i)} for i in range(4)},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}],
    }
    paths = [tmp_path / f"optimizer_part-{k}-of-3.safetensors" for k in range(3)]
    with DataStatesEngine(small_config()) as engine:
        for k, path in enumerate(paths):
            engine.save(state_parts.split(optimizer, k, 3), path).wait_persisted()
        ahead = Prefetch(engine, torch.device("cpu"), [], paths, lambda p: None)
        assert ahead.optimizer(paths[:2]) is None  # not the files read
        ahead = Prefetch(engine, torch.device("cpu"), [], paths, lambda p: None)
        state = ahead.optimizer(paths)
    assert state["param_groups"] == optimizer["param_groups"] and set(state["state"]) == {0, 1, 2, 3}
    for i, entry in optimizer["state"].items():
        assert all(same(state["state"][i][k], t) for k, t in entry.items())
    assert ahead.nbytes == sum(p.stat().st_size for p in paths)


def test_a_damaged_weight_file_is_left_to_the_ordinary_path(tmp_path, caplog):
    with DataStatesEngine(small_config()) as engine:
        weights, sums, _, opt_path = _write(engine, tmp_path)
        bad = next(iter(weights))
        with open(bad, "r+b") as f:  # flip one byte of the tensor data, after the header
            f.seek(-10, 2)
            b = f.read(1)
            f.seek(-10, 2)
            f.write(bytes([b[0] ^ 0xFF]))
        with caplog.at_level(logging.WARNING, logger="nanotron_datastates"):
            ahead = Prefetch(engine, torch.device("cpu"), list(weights), [opt_path], sums.get)
            assert ahead.weights() == {}
        assert "reading the weights ahead failed" in caplog.text and bad.name in caplog.text
        assert ahead.optimizer([opt_path]) is not None  # the optimizer is still read
        # The engine keeps working after the error.
        assert engine.load(opt_path)["param_groups"][0]["lr"] == 0.1


def test_the_report_says_when_each_read_ended_and_how_long_it_was_waited_for(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        weights, sums, _, opt_path = _write(engine, tmp_path)
        ahead = Prefetch(engine, torch.device("cpu"), list(weights), [opt_path], sums.get)
        ahead.weights()
        ahead.optimizer([opt_path])
        t = ahead.timings
        assert 0 < t["weights_read"] <= t["optimizer_read"]
        assert t["weights_waited"] >= 0 and t["optimizer_waited"] >= 0
        assert "weights read" in ahead.report() and "optimizer waited" in ahead.report()
        assert ahead.nbytes == sum(p.stat().st_size for p in [*weights, opt_path])
        assert f"{ahead.nbytes / 1e9:.2f} GB at " in ahead.report()


def _cached(path) -> bool:
    """Whether every byte of `path` is in the page cache: a read that may not wait for the disk succeeds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        try:
            return os.preadv(fd, [buf], 0, os.RWF_NOWAIT) == size
        except BlockingIOError:
            return False
    finally:
        os.close(fd)


def test_small_files_are_read_into_the_page_cache_before_the_read_ahead(tmp_path):
    # Read after the read-ahead has filled the disk's queue, the scheduler's, random states' and metadata
    # files each waited behind it on the GPU machine; read first, they come from memory.
    files = [tmp_path / f"small{i}" for i in range(3)]
    for i, path in enumerate(files):
        path.write_bytes(bytes([i]) * (20_000 + i))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        os.close(fd)
    if any(_cached(p) for p in files):
        pytest.skip("this file system keeps the pages (tmpfs?)")
    missing = tmp_path / "absent"  # skipped: read again where it is used, which raises there
    assert warm_page_cache([*files, missing]) == sum(20_000 + i for i in range(3))
    assert all(_cached(p) for p in files)


def _evicted(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_a_reshard_warms_the_checkpoint_once_per_node_its_ranks_sharing_the_files(tmp_path, monkeypatch):
    # On another layout, which saved tensors a rank needs is known once its model is built: meanwhile the
    # node's ranks read the weight and optimizer files into the page cache, each file by one rank.
    names = [f"model/w{i}.safetensors" for i in range(3)] + [f"optimizer/o{i}.safetensors" for i in range(2)]
    names.append("random/r.safetensors")  # small: read where used
    manifest = {"files": {}}
    for i, name in enumerate(names):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (100_000 + i))
        _evicted(path)
        manifest["files"][name] = {"bytes": 100_000 + i}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    warmers = []
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        warmers.append(warm_for_reshard(manifest, tmp_path, in_memory=False))
    assert all(w is not None and w.join(300) for w in warmers)
    shares = [set(w.paths) for w in warmers]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == {tmp_path / n for n in names[:-1]}
    for w in warmers:
        assert w.nbytes == sum(p.stat().st_size for p in w.paths)
    if not _cached(tmp_path / names[-1]):  # a file system that drops clean pages on request (not tmpfs)
        assert [n for n in names[:-1] if not _cached(tmp_path / n)] == []


def test_a_reshard_warms_nothing_across_nodes_from_memory_or_beyond_half_the_available_memory(
    tmp_path, monkeypatch
):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.safetensors").write_bytes(b"x" * 1000)
    manifest = {"files": {"model/w.safetensors": {"bytes": 1000}}}
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert warm_for_reshard(manifest, tmp_path, in_memory=False) is None  # each node would read it all
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert warm_for_reshard(manifest, tmp_path, in_memory=True) is None  # the memory tier's copy
    warmer = warm_for_reshard(manifest, tmp_path, in_memory=False)
    assert warmer is not None and warmer.join(300) and warmer.nbytes == 1000  # rank 0 of 4: the one file
    assert fits_in_memory(1000) and not fits_in_memory(1 << 62)
    manifest["files"]["model/w.safetensors"]["bytes"] = 1 << 62
    assert warm_for_reshard(manifest, tmp_path, in_memory=False) is None
    manifest = {"files": {"model/../../w.safetensors": {"bytes": 1000}}}  # the reads report it, not this
    assert warm_for_reshard(manifest, tmp_path, in_memory=False) is None
