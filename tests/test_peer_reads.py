"""Files served between ranks' GPUs at a restart (tier/peer_reads.py): which files go that way, and what an
exchange does with a description that does not fit, on real processes over gloo (the restarts themselves:
test_replicas.py)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanotron_datastates.tier.peer_reads import PeerReads, plan


def _rank(node: str, have: list[str], ahead: dict[str, list[str]]) -> dict:
    return {"node": node, "have": have, "ahead": ahead}


def test_a_file_goes_from_a_rank_of_another_node_that_reads_it_ahead_in_the_same_list_servers_in_turn():
    w, o = "model/w.safetensors", "optimizer/o.safetensors"
    everyone = [
        _rank("a", [w, o], {"weights": [w], "optimizer": [o]}),
        _rank("a", [w, o], {"weights": [w], "optimizer": [o]}),
        _rank("b", [], {"weights": [w], "optimizer": [o]}),
        _rank("b", [], {"weights": [w]}),
        _rank("c", [w], {"optimizer": [w]}),  # holds it, but reads it in another list
    ]
    lacking = {(2, w): "weights", (2, o): "optimizer", (3, w): "weights"}
    served = plan(everyone, lacking)
    assert served == {(2, w): 0, (2, o): 1, (3, w): 0}  # in turn over ranks 0 and 1, never rank 4
    assert plan(everyone, {(0, w): "weights"}) == {}  # no rank of another node reads it ahead


def _child(rank: int, work: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    folder = Path(work)
    data = {"data": torch.arange(1000, dtype=torch.float32)}
    # Rank 0 serves `a`; rank 1 was planned to receive `b`: the plans disagree.
    out = {"weights": {1: ["a", "c"]}} if rank == 0 else {}
    into = {"weights": {0: ["b", "c"]}} if rank == 1 else {}
    peer = PeerReads(dist.group.WORLD, folder, out, into, {"a": 1 << 20, "b": 1 << 20, "c": 1 << 20})
    got = peer.exchange("weights", {folder / "a": data, folder / "c": data}, torch.device("cpu"))
    # Then a second exchange that fits, to show that nothing of the first is left in flight.
    peer2 = PeerReads(dist.group.WORLD, folder, {"optimizer": {1: ["c"]}} if rank == 0 else {},
                      {"optimizer": {0: ["c"]}} if rank == 1 else {}, {"c": 4000})  # fmt: skip
    got2 = peer2.exchange("optimizer", {folder / "c": data}, torch.device("cpu"))
    answer = {"got": sorted(str(p) for p in got), "problems": peer.problems, "got2": sorted(got2)}
    answer["equal"] = [bool(v["data"].equal(data["data"])) for v in got2.values()]
    (folder / f"answer{rank}.json").write_text(json.dumps(answer, default=str))
    dist.destroy_process_group()


def test_a_description_that_does_not_fit_is_answered_with_no_bytes_and_nobody_waits(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_child, args=(str(tmp_path), port), nprocs=2, join=True)
    served = json.loads((tmp_path / "answer0.json").read_text())
    lacking = json.loads((tmp_path / "answer1.json").read_text())
    assert served["got"] == [] and lacking["got"] == []
    assert len(lacking["problems"]) == 1 and "not the files planned" in lacking["problems"][0]
    assert lacking["got2"] == [str(tmp_path / "c")] and lacking["equal"] == [True]


def test_a_state_of_more_bytes_than_its_file_is_not_sent(tmp_path):
    """The server refuses a state larger than its file in the manifest; the receiver is told why."""
    from nanotron_datastates.tier.peer_reads import _describe

    doc, tensors = _describe(
        {"a": {"data": torch.zeros(100)}, "b": {"data": torch.zeros(10)}}, {"a": 399, "b": 40}
    )
    files = json.loads(doc)["files"]
    assert files["a"] == {"error": "400 bytes read, 399 in the manifest"} and "skeleton" in files["b"]
    assert len(tensors) == 1 and tensors[0].numel() == 10
