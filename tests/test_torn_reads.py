"""Readers racing a writer: another process saves the same path again and again (each save a temporary
renamed over it) while this one loads it. A load reads the header and the data through one open file, so
every load gives one whole version: never a checksum error on an intact file, never a header of one
version with bytes of another."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from nanotron_datastates import DataStatesEngine

N = 64 * 1024  # elements per tensor: several chunks of the writer's and reader's engines
SECONDS = 6.0


def _versions() -> list[dict]:
    """Versions that differ in every tensor and in a plain value, and in their header's length (the third
    tensor's shape): a torn read shows as a mix."""
    return [
        {"a": torch.full((N,), float(k)), "b": torch.full((N + 1024 * k,), float(k)), "n": k}
        for k in range(3)
    ]


def _writer(path: str, ready, stop) -> None:
    versions = _versions()
    with DataStatesEngine(host_cache_size=1 / 32, chunk_size=1) as engine:
        k = 0
        while not stop.is_set():
            engine.save(versions[k % len(versions)], path).wait_persisted()
            ready.set()
            k += 1


def _consistent(got: dict) -> bool:
    k = got["n"]
    return torch.equal(got["a"], torch.full((N,), float(k))) and torch.equal(
        got["b"], torch.full((N + 1024 * k,), float(k))
    )


@pytest.mark.slow
def test_loads_racing_a_writer_each_see_one_whole_version(tmp_path):
    path = tmp_path / "state.safetensors"
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_writer, args=(str(path), ready, stop))
    writer.start()
    counts = {"load": 0, "load_unverified": 0, "tensors": 0, "ranges": 0}
    failures: list[str] = []
    try:
        assert ready.wait(120)
        with DataStatesEngine(host_cache_size=1 / 32, chunk_size=1, parser_threads=2) as engine:
            end = time.monotonic() + SECONDS
            while time.monotonic() < end:
                try:
                    got = engine.load(path)
                    counts["load"] += 1
                    if not _consistent(got):
                        failures.append(f"load: mixed versions (n={got['n']})")
                    got = engine.load(path, verify=False)
                    counts["load_unverified"] += 1
                    if not _consistent(got):
                        failures.append(f"load(verify=False): mixed versions (n={got['n']})")
                    t = engine.load_tensors(path, ["a", "b"])  # one version: its two tensors agree
                    counts["tensors"] += 1
                    if t["a"][0].item() != t["b"][-1].item() or t["b"].numel() != N + 1024 * int(t["a"][0]):
                        failures.append("load_tensors: mixed versions")
                    r = engine.load_ranges(path, {"a": (10, 20), "b": (N - 5, N)})
                    counts["ranges"] += 1
                    if r["a"][0].item() != r["b"][0].item():
                        failures.append("load_ranges: mixed versions")
                except Exception as e:  # noqa: BLE001 - every failure of a load of an intact file counts
                    failures.append(repr(e))
    finally:
        stop.set()
        writer.join(60)
    assert min(counts.values()) >= 20, counts  # the race ran
    assert not failures, f"{len(failures)} torn of {sum(counts.values())} reads {counts}: {failures[:3]}"
