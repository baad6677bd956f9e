"""`balance_writes`: the files the data- and context-parallel replicas of a model shard hold alike (weights;
the optimizer without ZeRO; the scheduler) shared out among them, on Nanotron's real ParallelContext, Llama,
optimizer and scheduler (gloo ranks: cpu_ranks.py, balanced_ranks.py). Each replica writes about an equal
part, the checkpoint is the one rank 0 of the replicas writes alone, file for file and byte for byte, stock
Nanotron's `load_weights` reads it, and a job that switches the setting between restarts resumes bit for
bit, from storage and from the memory tier. Runs against each Nanotron tree (see conftest.py).
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_ranks import launch
from nanotron.serialize.metadata import CheckpointMetadata

from nanotron_datastates import DataStatesEngine, state_parts
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import MANIFEST
from nanotron_datastates.checkpoint.reads import optimizer_files
from nanotron_datastates.nanotron import shards
from nanotron_datastates.nanotron.checkpoint.convert import convert
from nanotron_datastates.save import housekeeping

HAS_CP = "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}
LAYOUTS = [  # (world size, tp, dp, pp, cp, ZeRO stage)
    pytest.param((2, 1, 2, 1, 1, 0), id="dp2"),
    pytest.param((2, 1, 2, 1, 1, 1), id="dp2-zero1"),
    pytest.param((4, 2, 2, 1, 1, 1), id="tp2-dp2-zero1"),
]
if HAS_CP:
    LAYOUTS.append(pytest.param((4, 1, 2, 1, 2, 1), id="dp2-cp2-zero1"))
_runs: dict[tuple[int, ...], tuple[Path, list[dict]]] = {}


@pytest.fixture(params=LAYOUTS)
def run(request, tmp_path_factory) -> tuple[tuple[int, ...], Path, list[dict]]:
    """The layout, the folder holding `on/7` and `off/7`, and each rank's report (one launch per layout)."""
    key = request.param
    if key not in _runs:
        work = tmp_path_factory.mktemp("balanced")
        _runs[key] = (work, launch(work, *key, mode="balanced"))
    return (key, *_runs[key])


def _shared(rel: str) -> bool:
    """Whether every replica holds the file alike (not a rank's random states, nor a ZeRO shard)."""
    return not rel.startswith("random/") and "_dp-" not in rel


def test_assign_gives_the_largest_first_to_the_least_loaded_ties_to_the_lowest_rank():
    sizes = {"a": 5, "b": 5, "c": 4, "d": 1, "e": 1}
    assert shards.assign(sizes, [0, 0]) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 1}
    assert shards.assign(sizes, [0, 0, 0]) == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 0}
    assert shards.assign(sizes, [9, 0]) == {"a": 1, "b": 1, "c": 0, "d": 1, "e": 1}  # loads count
    assert shards.assign({}, [0, 0]) == {}
    w = shards.Writers({"model/x": 1}, me=1)
    assert w.mine("model/x") and w.mine(Path("model/x")) and not w.mine("lr_scheduler/y")  # others: rank 0's


def test_every_file_has_one_writer_either_way_and_the_replicas_share_the_work(run):
    (world, tp, dp, pp, cp, zero), work, ranks = run
    files = read_manifest(work / "on" / "7")["files"]
    for mode in ("on", "off"):
        writes = [f for r in ranks for f in r[mode]]
        assert len(writes) == len(set(writes)), [f for f, n in collections.Counter(writes).items() if n > 1]
        assert set(writes) == set(read_manifest(work / mode / "7")["files"]), mode
    for r in ranks:  # off: as Nanotron, replica rank 0 writes what the replicas hold alike
        assert any(map(_shared, r["off"])) == (r["replica"] == 0), r
        assert any(f.startswith("model/") for f in r["on"]), r  # on: every replica writes weights
        if not zero:  # on, without ZeRO: the optimizer state every replica holds, one part a replica
            (part,) = [f for f in r["on"] if f.startswith("optimizer/")]
            assert part.endswith(f"_part-{r['replica']}-of-{dp * cp}.safetensors"), r
    positions = collections.defaultdict(list)
    for r in ranks:
        positions[tuple(r["position"])].append(r)
    for members in positions.values():
        assert sorted(r["replica"] for r in members) == list(range(dp * cp))
        shared = {f for r in members for f in r["on"] if _shared(f)}
        largest = max(files[f]["bytes"] for f in shared)
        # What each replica writes, its own ZeRO shard included: within one file of an equal share
        loads = [sum(files[f]["bytes"] for f in r["on"] if not f.startswith("random/")) for r in members]
        assert max(loads) <= sum(loads) / len(loads) + largest, loads
        if zero and cp == 1:  # the weights alone: about 1/dp each where every replica has a ZeRO shard
            weights = [sum(files[f]["bytes"] for f in r["on"] if f.startswith("model/")) for r in members]
            biggest = max(files[f]["bytes"] for f in shared if f.startswith("model/"))
            assert max(weights) - min(weights) <= biggest, weights


def test_the_telemetry_gives_each_ranks_bytes(run):
    _, work, ranks = run
    for mode in ("on", "off"):
        files = read_manifest(work / mode / "7")["files"]
        (line,) = housekeeping.read_telemetry(work / mode)
        assert line["rank_bytes"] == [sum(files[f]["bytes"] for f in r[mode]) for r in ranks], mode
        assert sum(line["rank_bytes"]) == line["bytes"]
    on, off = (housekeeping.read_telemetry(work / m)[0]["rank_bytes"] for m in ("on", "off"))
    assert max(on) < max(off), (on, off)


def test_the_checkpoint_is_the_one_rank_0_of_the_replicas_writes_byte_for_byte(run):
    """File for file, byte for byte, but for the optimizer file without ZeRO: written in parts, which put
    together hold the state of the one file, tensor for tensor."""
    (*_, zero), work, _ = run
    on, off = work / "on" / "7", work / "off" / "7"
    names = {p.relative_to(on).as_posix() for p in on.rglob("*") if p.is_file()}
    off_names = {p.relative_to(off).as_posix() for p in off.rglob("*") if p.is_file()}
    assert MANIFEST in names and any(n.startswith("model/") for n in names)
    wholes = {n: ps for n, ps in optimizer_files(read_manifest(on)["files"]).items() if ps != [n]}
    assert bool(wholes) == (not zero), wholes
    in_parts = {p for ps in wholes.values() for p in ps}
    assert names - in_parts == off_names - set(wholes), names ^ off_names
    for name in names - in_parts - {MANIFEST}:
        assert (on / name).read_bytes() == (off / name).read_bytes(), name
    with DataStatesEngine() as engine:
        for name, parts in wholes.items():
            assert (
                len(parts) > 1 and max((on / p).stat().st_size for p in parts) < (off / name).stat().st_size
            )
            got = state_parts.merge([engine.load(on / p) for p in parts])
            assert _same(got, engine.load(off / name)), name


def test_converted_to_nanotrons_layout_the_parts_are_its_one_optimizer_file(run, tmp_path):
    """`convert` writes the parts as Nanotron's one pickled optimizer file: each optimizer file is the one
    the one-writer checkpoint converts to, tensor for tensor (ZeRO shards, never in parts, alike)."""
    _, work, _ = run
    outs = {m: convert(work / m / "7", tmp_path / m, to="torch") for m in ("on", "off")}
    pts = {m: sorted(p.name for p in (out / "optimizer").glob("*.pt")) for m, out in outs.items()}
    assert pts["on"] == pts["off"] and len(pts["on"]) >= 1 and "_part-" not in str(pts["on"])
    for name in pts["on"]:
        on, off = (torch.load(outs[m] / "optimizer" / name, weights_only=True) for m in ("on", "off"))
        assert _same(on, off), name


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return type(a) is type(b) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_stock_nanotron_loads_the_weights(run):
    for r in run[2]:
        assert r["stock_differences"] == [] and r["tensors"] > 5, r["stock_differences"][:10]


# (writes shared out when saving 7, when saving 9, memory tier copies, layout)
SWITCHES = [
    pytest.param(1, 0, 1, (2, 1, 2, 1, 1, 0), id="on-to-off-dp2-one-copy"),
    pytest.param(0, 1, 2, (4, 2, 2, 1, 1, 1), id="off-to-on-tp2-dp2-zero1"),
]


@pytest.mark.parametrize("first, then, copies, key", SWITCHES)
def test_a_restart_that_switches_balance_writes_resumes_bit_for_bit_from_the_tier_and_storage(
    first, then, copies, key, tmp_path, monkeypatch
):
    """Checkpoint 7 saved with the setting one way, the job killed; the restart, the other way, resumes 7
    from the memory tier, steps, saves 9 (its tier files taking over those of 7 with one copy) and is
    killed; 9 then resumes from storage and from the tier, every tensor the one saved."""
    monkeypatch.setenv("BALANCED_COPIES", str(copies))
    out = {}
    for phase, writes in (("save", first), ("switch", then), ("final", then)):
        monkeypatch.setenv("BALANCED_PHASE", phase)
        monkeypatch.setenv("BALANCED_WRITES", str(writes))
        out[phase] = launch(tmp_path, *key, mode="tier-switch")
    assert [r["writes"] for r in out["save"]] != [r["writes"] for r in out["switch"]]  # other writers
    for r in out["switch"]:
        assert _in_tier(r["source"], tmp_path, 7), r
        assert r["differences"] == [] and r["last_train_step"] == 7, r["differences"][:10]
    for r in out["final"]:
        storage, tier = r["storage"], r["tier"]
        assert storage["source"] is None and storage["resumed_from"] == "9"
        assert _in_tier(tier["source"], tmp_path, 9), tier
        for got in (storage, tier):
            assert got["differences"] == [] and got["last_train_step"] == 9, got["differences"][:10]


def _in_tier(source: str | None, work: Path, at: int) -> bool:
    """Whether a resume read the step `at` from the memory tier under `work/shm`."""
    return source is not None and Path(source).name == str(at) and source.startswith(str(work / "shm"))
