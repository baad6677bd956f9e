"""A restart reads ahead while it pulls (tier/pulled.py): each pulled file is renamed into place as soon as
its check passes and told then, a read-ahead waiting on it reads it while the rest still arrive, and a file
that fails its check is never placed, never told, and never read ahead (the ordinary read names the
error)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from nanotron_datastates import ChecksumError, DataStatesEngine
from nanotron_datastates.checkpoint.checksums import file_entry
from nanotron_datastates.resume.read_ahead import Prefetch
from nanotron_datastates.tier.pulled import Placed
from nanotron_datastates.tier.replica_check import Checks
from nanotron_datastates.tier.replica_transfer import Transfer, _temporary

from helpers import same, small_config


def _waiter(placed: Placed, path) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(placed.wait(path)), daemon=True)
    thread.start()
    return thread, got


def _released(thread: threading.Thread, got: list) -> bool:
    thread.join(5)
    return not thread.is_alive() and len(got) == 1


def test_a_read_waits_for_its_file_and_is_released_by_its_placing_or_by_the_end(tmp_path):
    folder = tmp_path / "7"
    placed = Placed(folder)
    early = _waiter(placed, folder / "model" / "a.safetensors")  # before the pull says what it brings
    time.sleep(0.05)
    assert early[0].is_alive()
    placed.expect(["model/a.safetensors", "model/b.safetensors", "optimizer/o.safetensors"])
    assert placed.wait(folder / "random" / "r.safetensors")  # held already: not brought, there at once
    assert not placed.wait(tmp_path / "elsewhere.safetensors")  # not a file of this pull's folder
    b = _waiter(placed, folder / "model" / "b.safetensors")
    placed.place("model/a.safetensors")
    assert _released(*early) and early[1] == [True]
    time.sleep(0.05)
    assert b[0].is_alive()  # still on its way
    placed.finish(False)  # the pull failed: what it did not place never comes
    assert _released(*b) and b[1] == [False]
    assert placed.wait(folder / "model" / "a.safetensors")  # placed before the failure: there
    assert not placed.wait(folder / "optimizer" / "o.safetensors")
    placed.finish(True)  # only the first end counts
    assert not placed.wait(folder / "optimizer" / "o.safetensors")


def test_a_pull_that_ends_well_has_every_file_there_a_node_mates_included(tmp_path):
    placed = Placed(tmp_path)
    placed.expect(["model/pulled-by-a-node-mate.safetensors"])
    waiting = _waiter(placed, tmp_path / "model" / "pulled-by-a-node-mate.safetensors")
    placed.finish(True)
    assert _released(*waiting) and waiting[1] == [True]
    failed = Placed(tmp_path)  # ended before it knew what it brings: nothing is there
    failed.finish(True)
    assert not failed.wait(tmp_path / "model" / "x.safetensors")


def _saved(engine: DataStatesEngine, tmp_path, n: int) -> tuple[bytes, dict]:
    src = tmp_path / "src.safetensors"
    handle = engine.save({"data": torch.arange(n, dtype=torch.float32)}, src)
    handle.wait_persisted()
    data = src.read_bytes()
    return data, file_entry(len(data), handle)


def test_each_pulled_file_is_placed_as_soon_as_it_passes_and_a_damaged_one_never(tmp_path):
    into = tmp_path / "tier" / "7"
    into.mkdir(parents=True, mode=0o700)
    placed = Placed(into)
    placed.expect(["model/a.safetensors", "model/b.safetensors"])
    with DataStatesEngine(small_config()) as engine:
        data, entry = _saved(engine, tmp_path, 50_000)
        ts = [Transfer(0, "model/a.safetensors", len(data)), Transfer(0, "model/b.safetensors", len(data))]
        with contextlib.ExitStack() as stack:
            for t in ts:
                stack.enter_context(_temporary(into, t))
            checks = stack.enter_context(Checks(engine, ts, lambda t: entry, lambda t: placed.place(t.rel)))
            assert ts[0].buf is not None and ts[1].buf is not None
            ts[0].buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            checks.landed(ts[0])
            a = _waiter(placed, into / "model" / "a.safetensors")
            assert _released(*a) and a[1] == [True]  # while b's bytes are still to come
            assert (into / "model" / "a.safetensors").read_bytes() == data
            damaged = bytearray(data)
            damaged[-5] ^= 0xFF
            ts[1].buf.copy_(torch.frombuffer(damaged, dtype=torch.uint8))
            b = _waiter(placed, into / "model" / "b.safetensors")
            with pytest.raises(ChecksumError, match=r"b\.safetensors\.dstmp"):
                checks.place()
            time.sleep(0.05)
            assert b[0].is_alive()  # never told placed
            placed.finish(False)
            assert _released(*b) and b[1] == [False]
    assert sorted(p.name for p in (into / "model").iterdir()) == ["a.safetensors"]  # b's temporary gone


def test_a_read_ahead_reads_each_file_once_placed_and_leaves_one_never_placed_to_the_ordinary_read(tmp_path):
    folder = tmp_path / "7"
    weights = {folder / "model" / f"w{i}.safetensors": torch.randn(300, 7) for i in range(3)}
    optimizer = {"state": {0: {"exp_avg": torch.randn(50)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    opt = folder / "optimizer" / "optimizer.safetensors"
    placed = Placed(folder)
    with DataStatesEngine(small_config()) as engine:
        ahead = Prefetch(engine, torch.device("cpu"), list(weights), [opt], lambda p: None, gate=placed.wait)
        placed.expect(f"model/w{i}.safetensors" for i in range(3))  # the optimizer file is held already
        engine.save(optimizer, opt).wait_persisted()
        for path, t in weights.items():  # each as a pull places it, one after another
            meta = {"sharded": "false"}
            engine.save({"data": t}, path, metadata=meta, exact_metadata=True).wait_persisted()
            placed.place(path.relative_to(folder).as_posix())
        got = ahead.weights()
        assert set(got) == set(weights) and all(same(got[p]["data"], t) for p, t in weights.items())
        assert same(ahead.optimizer([opt])["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])

        failed = Placed(folder)
        ahead = Prefetch(engine, torch.device("cpu"), list(weights), [], lambda p: None, gate=failed.wait)
        failed.expect(["model/w0.safetensors"])
        failed.finish(False)  # the pull failed before it placed w0: the read-ahead gives up on it
        assert ahead.weights() == {}  # read again the ordinary way, which reports what is wrong
