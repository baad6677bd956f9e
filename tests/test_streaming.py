"""States larger than the cache stream through it; many saves in flight; a burst of 1,000 files; the caller's
tensors may change right after wait_snapshot. These rule out the published engines' ring-buffer defects (lost
wrap-around gaps, abort on a tensor larger than the cache) and their early-returning wait()."""

import gc
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine

from helpers import BACKENDS, no_temporaries, same, small_config


def test_state_five_times_the_cache_with_one_tensor_larger_than_it(tmp_path):
    # 4 MiB cache of 1 MiB chunks; 20 MiB state; one tensor of 6 MiB; odd sizes so pieces straddle tensors.
    cfg = DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)
    g = torch.Generator().manual_seed(0)
    state = {
        "huge": torch.randn(6 * 2**18 + 3, generator=g),
        "odd": [torch.randn(12345 + i, generator=g).bfloat16() for i in range(40)],
        "bytes": torch.randint(0, 255, (3 * 2**20 + 1,), dtype=torch.uint8, generator=g),
        "rest": torch.randn(9 * 2**18, generator=g).double(),
    }
    for backend in BACKENDS:
        with DataStatesEngine(cfg, io_backend=backend) as e:
            p = tmp_path / f"{backend}.safetensors"
            h = e.save(state, p)
            h.wait_persisted()
            assert h.stats["file_bytes"] > 5 * cfg.cache_bytes
            assert e.cache_stats()["high_water"] == 4
            back = e.load(p)
        assert same(back["huge"], state["huge"]) and same(back["rest"], state["rest"])
        assert same(back["bytes"], state["bytes"])
        assert all(same(a, b) for a, b in zip(back["odd"], state["odd"]))


def test_mutation_after_wait_snapshot_does_not_change_the_file(engine, tmp_path):
    tensors = [torch.full((300_000,), float(i)) for i in range(40)]  # 48 MB through a 16 MiB cache
    views = {"t": tensors[3].view(600, 500).t()}  # a view: its base must stay alive until copied
    h = engine.save({"list": tensors, **views}, tmp_path / "m.safetensors")
    h.wait_snapshot()
    for t in tensors:
        t.zero_()
    del tensors, views
    gc.collect()
    junk = [torch.full((300_000,), -1.0) for _ in range(10)]  # reuse freed memory
    h.wait_persisted()
    back = engine.load(tmp_path / "m.safetensors")
    assert all(bool((t == i).all()) for i, t in enumerate(back["list"]))
    assert bool((back["t"] == 3.0).all()) and back["t"].shape == (500, 600)
    del junk


def test_final_path_holds_the_old_file_until_the_new_one_is_persisted(tmp_path):
    p = tmp_path / "ckpt.safetensors"
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as e:
        e.save({"v": torch.zeros(10)}, p).wait_persisted()
        old = p.read_bytes()
        h = e.save({"v": torch.ones(8 << 20)}, p)  # 32 MiB through a 1 MiB cache
        assert p.read_bytes() == old  # the new file is written under a temporary name
        h.wait_snapshot()
        assert p.read_bytes() == old or h.done()
        h.wait_persisted()
        assert same(e.load(p)["v"], torch.ones(8 << 20))
    assert no_temporaries(tmp_path)


def test_many_saves_in_flight(engine, tmp_path):
    handles = []
    for i in range(24):
        state = {"w": torch.full((100_000 + i,), float(i)), "i": i, "nested": {"b": torch.arange(i)}}
        handles.append(engine.save(state, tmp_path / f"f{i}.safetensors"))
    engine.wait_persisted()
    for i in range(24):
        back = engine.load(tmp_path / f"f{i}.safetensors")
        assert back["i"] == i and bool((back["w"] == i).all()) and same(back["nested"]["b"], torch.arange(i))
    assert no_temporaries(tmp_path)


def test_a_burst_of_one_thousand_small_files(tmp_path):
    with DataStatesEngine(DataStatesConfig(host_cache_size=64 / 1024, chunk_size=1)) as e:
        for i in range(1000):
            e.save({"x": torch.full((i % 7 + 1,), float(i)), "id": i}, tmp_path / f"{i:04d}.safetensors")
        e.wait_persisted()
        names = sorted(os.listdir(tmp_path))
        assert names == [f"{i:04d}.safetensors" for i in range(1000)]
        for i in range(0, 1000, 37):
            back = e.load(tmp_path / f"{i:04d}.safetensors")
            assert back["id"] == i and same(back["x"], torch.full((i % 7 + 1,), float(i)))


@pytest.mark.parametrize("seed", range(5))
def test_close_at_a_random_moment_while_threads_save(tmp_path, seed):
    # Four threads save in a loop through a tiny cache; close() comes at a random moment. Every save that
    # returned a handle is persisted whole; every save after close() is refused with ValueError.
    rng = random.Random(seed)
    engine = DataStatesEngine(small_config(host_cache_size=2 / 1024))
    saved: list[tuple[Path, float]] = []
    refused = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(10_000):
            path, value = tmp_path / f"w{w}_{i}.safetensors", float(w * 100_000 + i)
            try:
                h = engine.save({"x": torch.full((rng.randint(1, 300_000),), value)}, path)
            except ValueError as e:
                refused.append(str(e))
                return
            with lock:
                saved.append((path, value))
            h.wait_snapshot()  # as a training loop would, before changing its tensors

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.05, 0.5))
    engine.close()
    for t in threads:
        t.join(300)
    assert len(refused) == 4 and all("closed" in r for r in refused)
    assert saved
    with DataStatesEngine(small_config()) as reader:
        for path, value in saved:
            x = reader.load(path)["x"]
            assert x.numel() >= 1 and bool((x == value).all()), path
    assert no_temporaries(tmp_path)
