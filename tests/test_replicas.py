"""Memory replicas on real processes: four ranks on two simulated nodes (each node its own memory tier root),
a gloo group, the engine saving into each node's tier and replicating every committed checkpoint to the other
node. A whole node is lost (every rank SIGKILLed, as torchrun stops the job, and the lost node's tier wiped);
the restarted job reads every rank's state from memory, the lost ranks' pulled from their peers' replicas,
bit for bit. A node lost while a replica is on its way never has its partial replica used."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import replica_child as child
import torch.multiprocessing as mp

from nanotron_datastates.tier.memory import REPLICAS, MemoryTier, job_folder
from nanotron_datastates.tier.replicas import placement

WORLD, NODES = 4, 2


def _node(rank: int) -> int:
    return rank // (WORLD // NODES)


def _job(ctx, target, work: Path, incarnation: str, *args) -> list:
    init = f"file://{work / ('rendezvous-' + incarnation)}"
    procs = [
        ctx.Process(target=target, args=(r, WORLD, _node(r), init, str(work), *args), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    return procs


def _wait_for(check, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _lose_node(procs: list, work: Path, node: int) -> None:
    for p in procs:  # the job stops: the lost node's ranks die, torchrun stops the others
        p.kill()
    for p in procs:
        p.join(30)
    shutil.rmtree(child.tier_root(work, node))


def _restart(ctx, work: Path, replicas: int) -> list[dict]:
    procs = _job(ctx, child.restart, work, "restart", replicas)
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"a restarted rank exited with {p.exitcode}"
    return [json.loads((work / f"restart{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture
def ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nanotron_datastates", "replica_child"])
    return ctx


def test_placement_is_a_ring_over_nodes_each_replica_on_another_node():
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert placement(nodes, 1) == [[2], [3], [4], [5], [0], [1]]
    assert placement(nodes, 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    assert placement(["a", "b", "b"], 1) == [[1], [0], [0]]  # nodes of unequal size
    with pytest.raises(ValueError, match="memory_replicas=2 needs 3 nodes"):
        placement(["a", "a", "b", "b"], 2)


@pytest.mark.slow
def test_a_lost_node_resumes_from_its_peers_memory_bit_for_bit(tmp_path, ctx):
    procs = _job(ctx, child.save, tmp_path, "save", 3, 1, 0.0, 1 << 20)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    assert "received from rank(s) 0" in (tmp_path / "replicated2-3.txt").read_text()
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 1)
    for r, o in enumerate(out):
        assert o["step"] == 3 and o["equal"] == [True, True], (r, o)
        assert o["source"] == str(job_folder(child.tier_root(tmp_path, _node(r)), tmp_path / "ckpt") / "3")
        assert not o["leftovers"]
    assert "2 file(s)" in out[2]["why"] and "pulled" in out[2]["why"]  # the lost ranks: from the peers
    assert out[0]["why"].startswith("0 file(s)")  # the others: their own node's copies


@pytest.mark.slow
def test_without_replicas_a_lost_node_resumes_from_storage(tmp_path, ctx):
    procs = _job(ctx, child.save, tmp_path, "save", 2, 0, 0.0, 1 << 20)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 0)
    for o in out:
        assert o["source"] is None and o["equal"] == [True, True], o
        assert "rank 2 reads model/w2.safetensors, which no node holds in memory" in o["why"]


@pytest.mark.slow
def test_a_node_lost_while_its_replica_is_sent_never_uses_the_partial_copy(tmp_path, ctx):
    """Replication paced slow, in 16 KiB messages: the node is lost while the newest checkpoint's replicas
    are half received (their temporaries exist). The older replica is whole and marked, but it is not the
    newest checkpoint's: the restart reads storage, and the temporaries are removed at its start."""
    procs = _job(ctx, child.save, tmp_path, "save", 2, 1, 0.0005, 16 << 10)
    root = tmp_path / "ckpt"
    area = MemoryTier(child.tier_root(tmp_path, 0), root, 0, area=REPLICAS).folder

    def receiving_the_newest() -> bool:
        latest = root / "latest.txt"
        return latest.exists() and latest.read_text() == "2" and bool(child.temporaries(area / "2"))

    _wait_for(receiving_the_newest, "the newest checkpoint's replication")
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 1)
    for o in out:
        assert o["step"] == 2 and o["source"] is None and o["equal"] == [True, True], o
        assert "which no node holds in memory" in o["why"]
        assert not o["leftovers"], o["leftovers"]
