"""Memory replicas on real processes: four ranks on two simulated nodes (each node its own memory tier root),
a gloo group, the engine saving into each node's tier and replicating every committed checkpoint to the other
node. A whole node is lost (every rank SIGKILLed, as torchrun stops the job, and the lost node's tier wiped);
the restarted job reads every rank's state from memory, the lost ranks' pulled from their peers' replicas,
bit for bit. A node lost while a replica is on its way never has its partial replica used."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import replica_child as child
import torch
import torch.multiprocessing as mp

from nanotron_datastates.tier.memory import REPLICAS, MemoryTier, job_folder
from nanotron_datastates.tier.replicas import Replicator, placement

from helpers import wait_until

WORLD, NODES = 4, 2


def _node(rank: int, world: int = WORLD) -> int:
    return rank // (world // NODES)


def _job(ctx, target, work: Path, incarnation: str, *args, world: int = WORLD, daemon: bool = True) -> list:
    init = f"file://{work / ('rendezvous-' + incarnation)}"
    procs = [
        ctx.Process(target=target, args=(r, world, _node(r, world), init, str(work), *args), daemon=daemon)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def _wait_for(check, what: str, timeout: float = 600) -> None:
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


def _restart(ctx, work: Path, replicas: int, transport: str = "gloo", world: int = WORLD) -> list[dict]:
    procs = _job(ctx, child.restart, work, "restart", replicas, transport, world=world)
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"a restarted rank exited with {p.exitcode}"
    return [json.loads((work / f"restart{r}.json").read_text()) for r in range(world)]


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
    inodes = [json.loads((tmp_path / f"inodes2-{step}.json").read_text()) for step in (1, 2, 3)]
    assert inodes[2] == inodes[0] != inodes[1]  # the third replica received into the first one's files
    area = MemoryTier(child.tier_root(tmp_path, 1), tmp_path / "ckpt", 0, area=REPLICAS)
    assert area.steps() == [2, 3]  # the spare and the newest
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 1)
    for r, o in enumerate(out):
        assert o["step"] == 3 and o["equal"] == [True, True], (r, o)
        assert o["source"] == str(job_folder(child.tier_root(tmp_path, _node(r)), tmp_path / "ckpt") / "3")
        assert not o["leftovers"]
        assert o["held"] == [3], (r, o)  # the pulled files marked held too, as a save marks them
    assert "2 file(s)" in out[2]["why"] and "pulled" in out[2]["why"]  # the lost ranks: from the peers
    assert out[0]["why"].startswith("0 file(s)")  # the others: their own node's copies


def test_the_first_two_replicas_are_received_into_files_made_ahead_and_a_lost_node_resumes_from_them(
    tmp_path, ctx
):
    """Files made ahead for the first two replicas (as the Saver does after the first step, where training
    would otherwise wait on new pages while a replica is received): replicas 1 and 2 take them over, the
    third takes the first's, and the lost node resumes step 3 bit for bit."""
    procs = _job(ctx, child.save, tmp_path, "save", 3, 1, 0.0, 1 << 20, "gloo", True)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    for r in range(WORLD):
        ahead = json.loads((tmp_path / f"ahead{r}.json").read_text())
        inodes = [json.loads((tmp_path / f"inodes{r}-{step}.json").read_text()) for step in (1, 2, 3)]
        assert inodes[0] == ahead[0] and inodes[1] == ahead[1] and inodes[2] == inodes[0], r
    area = MemoryTier(child.tier_root(tmp_path, 1), tmp_path / "ckpt", 0, area=REPLICAS)
    assert area.steps() == [2, 3] and not [n for n in os.listdir(area.folder) if n.startswith(".warm")]
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 1)
    assert all(o["step"] == 3 and o["equal"] == [True, True] and not o["leftovers"] for o in out), out


@pytest.mark.slow
def test_replicas_sent_by_a_process_of_each_ranks_own_are_made_ahead_received_and_a_lost_node_resumes(
    tmp_path, ctx
):
    """`memory_replica_process`: each rank's replicas moved by a spawned process of its own, the processes
    meeting through the job's store. The first two replicas go into files made ahead by the processes, the
    training processes keep the step being sent busy meanwhile, and the lost node resumes step 3 bit for bit
    from what the processes placed."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    # not daemonic, as torchrun's ranks: they start processes of their own
    procs = _job(ctx, child.save, tmp_path, "save", 3, 1, 0.0, 1 << 20, "gloo", True, address, daemon=False)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    assert "received from rank(s) 0" in (tmp_path / "replicated2-3.txt").read_text()
    for r in range(WORLD):
        ahead = json.loads((tmp_path / f"ahead{r}.json").read_text())
        inodes = [json.loads((tmp_path / f"inodes{r}-{step}.json").read_text()) for step in (1, 2, 3)]
        assert inodes[0] == ahead[0] and inodes[1] == ahead[1] and inodes[2] == inodes[0], r
    pids = [int((tmp_path / f"replica-process{r}").read_text()) for r in range(WORLD)]
    # each runs 3 steps below its rank (ProcessSpec.nice), which runs at this test's priority
    assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [
        os.getpriority(os.PRIO_PROCESS, 0) + 3
    ] * WORLD
    _lose_node(procs, tmp_path, 1)
    _wait_for(lambda: not [p for p in pids if _alive(p)], "the replica processes to end with their ranks", 30)
    out = _restart(ctx, tmp_path, 1)
    assert all(o["step"] == 3 and o["equal"] == [True, True] and not o["leftovers"] for o in out), out
    assert "2 file(s)" in out[2]["why"] and "pulled" in out[2]["why"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie is gone
    except FileNotFoundError:
        return False


def test_files_made_ahead_that_do_not_fit_are_removed_and_named(small_tmpfs):
    """A tier without room for a set (here 2 x 3 MiB into a 4 MiB tmpfs): the first set is made and handed
    to the replicas, the second removed whole, and the error names its file."""
    from nanotron_datastates.tier.replica_ahead import make_ahead

    tier = MemoryTier(small_tmpfs / "tier", small_tmpfs / "ckpt", 0)
    area = MemoryTier(small_tmpfs / "tier", small_tmpfs / "ckpt", 1, copies=2, area=REPLICAS)
    with pytest.raises(
        OSError, match=r"reserving the memory of a replica file.*\.warm-1-1/optimizer/o\.safetensors"
    ) as e:
        make_ahead({1: area}, {1: [("optimizer/o.safetensors", 2 << 20), ("model/w.safetensors", 1 << 20)]})
    assert e.value.errno == errno.ENOSPC
    assert sorted(n for n in os.listdir(area.folder) if n.startswith(".warm")) == [".warm-1-0"]
    assert os.stat(area.warm(0, "optimizer/o.safetensors")).st_blocks * 512 >= 2 << 20  # memory, not a hole
    donors = area.recycle(1, ["optimizer/o.safetensors", "model/w.safetensors", "model/other.safetensors"])
    assert donors == [
        str(area.warm(0, "optimizer/o.safetensors")),
        str(area.warm(0, "model/w.safetensors")),
        None,
    ]
    assert tier.folder == area.folder.parent


def test_a_link_planted_where_a_set_is_made_ahead_is_never_followed(tmp_path):
    """A link to another folder in place of the first set's folder: nothing is made through it, the error
    names it, and the second set is made and handed to the replicas."""
    from nanotron_datastates.errors import UntrustedPath
    from nanotron_datastates.tier.replica_ahead import make_ahead

    area = MemoryTier(tmp_path / "tier", tmp_path / "ckpt", 1, copies=2, area=REPLICAS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (area.folder / ".warm-1-0").symlink_to(elsewhere)
    with pytest.raises(UntrustedPath, match=r"\.warm-1-0.*a link"):
        make_ahead({1: area}, {1: [("model/w.safetensors", 4096)]})
    assert not list(elsewhere.iterdir())
    assert area.recycle(1, ["model/w.safetensors"]) == [str(area.warm(1, "model/w.safetensors"))]


@pytest.mark.slow
def test_checkpoints_that_come_faster_than_replication_send_the_newest_and_skip_the_rest(tmp_path, ctx):
    """Paced to 0.5 MB/s, the first checkpoint's replicas take about a second; the second and third are
    committed meanwhile. Every rank agrees to skip the second and send the third, which a lost node then
    resumes."""
    procs = _job(ctx, child.save, tmp_path, "save", 3, 1, 0.0005, 1 << 20)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    for r in range(WORLD):
        assert "not sent, checkpoint 3 goes instead" in (tmp_path / f"replicated{r}-2.txt").read_text()
        assert "received from rank(s)" in (tmp_path / f"replicated{r}-3.txt").read_text()
    area = MemoryTier(child.tier_root(tmp_path, 1), tmp_path / "ckpt", 0, area=REPLICAS)
    assert area.steps() == [1, 3]
    _lose_node(procs, tmp_path, 1)
    assert all(o["step"] == 3 and o["equal"] == [True, True] for o in _restart(ctx, tmp_path, 1))


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


def test_the_link_is_nccl_where_every_rank_has_a_gpu_else_gloo_and_a_forced_nccl_names_the_setting(
    tmp_path, ctx
):
    """`auto`: a restart's pull over NCCL where every rank has a GPU, replicas sent while training runs
    over gloo; `nccl` where a rank has none fails naming the setting and the rank."""
    if torch.cuda.device_count() == 1:  # both ranks would take that GPU, which NCCL refuses
        pytest.skip("needs no GPU or two: NCCL refuses two ranks on one GPU (Duplicate GPU detected)")
    for p in _job(ctx, child.links, tmp_path, "links", world=2):
        p.join(600)
        assert p.exitcode == 0
    for r in range(2):
        got = json.loads((tmp_path / f"links{r}.json").read_text())
        assert got["gloo"] == got["gloo-training"] == got["auto-training"] == "gloo"
        if torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available():
            assert got["auto"] == got["nccl"] == got["nccl-training"] == "nccl"
        else:
            assert got["auto"] == "gloo"
            for key in ("nccl", "nccl-training"):
                assert got[key].startswith("ReplicaError: datastates.memory_replica_transport=nccl: rank 0")


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 16, (1 << 20) + 3, 5 << 20])
def test_a_gloo_chunk_is_split_over_the_streams_in_aligned_pieces_that_cover_it_once(n):
    """Each chunk of a gloo link travels as pieces on its streams: the pieces cover [lo, lo + n) end to
    end, one a stream at most, each but the last a multiple of 64 KiB, none for an empty chunk."""
    from nanotron_datastates.tier.replica_transfer import pieces

    lo, groups = 7 << 20, ["a", "b", "c"]
    got = pieces(groups, lo, n)
    assert [a for _, a, _ in got] == ([lo] + [b for _, _, b in got[:-1]] if n else [])
    assert (got[-1][2] if got else lo) == lo + n
    assert len(got) <= len(groups) and [g for g, _, _ in got] == groups[: len(got)]
    assert all((b - a) % (1 << 16) == 0 and b > a for _, a, b in got[:-1])


def test_nccl_streams_lay_each_peers_files_end_to_end_in_chunks_that_cross_files(monkeypatch):
    """The NCCL link's waves (on the host: the slots a wave fills and empties): every byte of every file
    reaches its place at the other end, with chunks that straddle files and files of no bytes."""
    from nanotron_datastates.tier import link_nccl
    from nanotron_datastates.tier.link_nccl import _Stream
    from nanotron_datastates.tier.replica_transfer import Transfer

    monkeypatch.setattr(link_nccl, "PIECE", 1000)  # pieces of a thread each that straddle files too
    sizes, chunk = [5000, 0, 70001, 1, 12345], 4096
    sends = [Transfer(1 + i % 2, f"f{i}", n, torch.randint(0, 256, (n,), dtype=torch.uint8)) for i, n in
             enumerate(sizes)]  # fmt: skip
    recvs = [Transfer(t.peer, t.rel, t.nbytes, torch.zeros(t.nbytes, dtype=torch.uint8)) for t in sends]
    outs, ins = _Stream.of(sends), _Stream.of(recvs)
    assert [s.peer for s in outs] == [1, 2] and [len(s.files) for s in outs] == [3, 2]
    slot = torch.empty(chunk, dtype=torch.uint8)
    for a, b in zip(outs, ins):
        assert a.total == b.total
        for wave in range(-(-a.total // chunk)):
            n = a.size(wave, chunk)
            assert 0 < n <= chunk and n == b.size(wave, chunk)
            for part in a.parts(wave, chunk):
                a.copy(wave, chunk, slot, True, part)
            for part in b.parts(wave, chunk):
                b.copy(wave, chunk, slot, False, part)
    for s, r in zip(sends, recvs):
        assert torch.equal(s.buf, r.buf), s.rel


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CUDA: NCCL between two GPUs")
def test_a_lost_node_resumes_bit_for_bit_from_replicas_sent_through_nccl(tmp_path, ctx):
    """Two nodes of one GPU: replicas and the restart's pull over NCCL, in chunks smaller than a file."""
    procs = _job(ctx, child.save, tmp_path, "save", 3, 1, 0.0, 100 << 10, "nccl", world=2)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(2)), "the saves")
    assert "over nccl" in (tmp_path / "replicated1-3.txt").read_text()
    _lose_node(procs, tmp_path, 1)
    out = _restart(ctx, tmp_path, 1, "nccl", world=2)
    for r, o in enumerate(out):
        assert o["step"] == 3 and o["equal"] == [True, True], (r, o)
        assert not o["leftovers"]
    assert "2 file(s)" in out[1]["why"] and "over nccl" in out[1]["why"]


def test_only_the_newest_queued_step_and_the_one_being_sent_are_kept_from_the_saves(tmp_path):
    """While a replication is under way, each step committed in its place frees the older queued ones for the
    saves to recycle (they would be skipped for it); the newest stays kept until sent."""
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
        release, done = threading.Event(), []

        def on_done(r) -> None:  # the replicator's thread, after step 1: held until the test lets it go
            done.append((r.step, r.skipped_for))
            release.wait(30)

        replicator = Replicator(tier, [[]], dist.new_group(backend="gloo"), None, on_done=on_done)
        replicator.submit(1, {})
        assert wait_until(lambda: done == [(1, None)])
        replicator.submit(2, {})
        assert tier.busy == {2}
        replicator.submit(3, {})
        assert tier.busy == {3}  # 2 left to the saves: 3 goes in its place
        release.set()
        replicator.close()
        assert done == [(1, None), (2, 3), (3, None)] and tier.busy == set()
    finally:
        dist.destroy_process_group()


TRAINING_SCRIPT = """
import os, sys
from pathlib import Path
with open(sys.argv[1], "a") as f:  # at the top level, no main guard: each run of the script leaves a line
    f.write(f"{os.getpid()}\\n")
import torch.distributed as dist
from nanotron_datastates.tier.memory import MemoryTier
from nanotron_datastates.tier.replica_process import ProcessSpec, ReplicaProcess
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
tier = MemoryTier(sys.argv[2], sys.argv[3], 0)
spec = ProcessSpec(("127.0.0.1", store.port), "t/", 0, 1, [[]], (sys.argv[2], sys.argv[3], 2, 1), 0.0, 1)
ended = []
process = ReplicaProcess(tier, spec, ended.append)
process.close(60)
print("errors:", [r.error for r in ended if r.error])
"""


def test_the_replica_process_never_runs_the_training_script_again(tmp_path):
    """Hostile: a training script without a main guard. A spawned process runs its parent's main script
    again; the replica process must not (it would train again), and it starts and ends cleanly."""
    script, runs = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(TRAINING_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(runs), str(tmp_path / "shm"), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(runs.read_text().split()) == 1, runs.read_text()
    assert "errors: []" in out.stdout, out.stdout + out.stderr


def test_files_asked_ahead_of_a_replica_process_that_dies_are_answered_not_waited_for(tmp_path):
    """Hostile: the replica process is killed (here while it waits for a peer that never comes). What was
    asked of it without waiting is answered with the error; asked after, the error comes at once, where a
    caller waiting would otherwise sit out its whole timeout."""
    import torch.distributed as dist

    from nanotron_datastates.tier.replica_process import ProcessSpec, ReplicaProcess
    from nanotron_datastates.tier.replica_transfer import ReplicaError

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shm, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    spec = ProcessSpec(("127.0.0.1", store.port), "t/", 0, 2, [[1], [0]], (shm, ckpt, 2, 1), 0.0, 1)
    process = ReplicaProcess(MemoryTier(shm, ckpt, 0), spec, lambda r: None)
    told: list = []
    files = {1: [("model/w.safetensors", 4096)]}
    assert process.make_ahead(files, then=lambda *a: told.append(a)) == 0
    os.kill(process.pid, 9)
    assert wait_until(lambda: len(told) == 1, 300), told
    assert told[0][0] == 0 and "the replica process ended" in str(told[0][1])
    with pytest.raises(ReplicaError, match="the replica process ended"):  # not "made no files ahead in 5 s"
        process.make_ahead(files, timeout=5)
    process.make_ahead(files, then=lambda *a: told.append(a))
    assert len(told) == 2 and "ended" in str(told[1][1])
    process.close(10)


def _restart_shared(ctx, work: Path, damage: str = "", transport: str = "gloo", world: int = WORLD) -> list:
    procs = _job(ctx, child.restart_shared, work, "restart-shared", damage, transport, world=world)
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"a restarted rank exited with {p.exitcode}"
    return [json.loads((work / f"shared{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_lost_nodes_files_that_a_rank_of_another_node_reads_come_from_that_ranks_read_not_its_memory(
    tmp_path, ctx
):
    """Ranks r and r + 2 read the same files (replicas without ZeRO). The lost node's ranks get them from
    the read-ahead of the rank reading them on the other node, bit for bit; nothing is pulled into the lost
    node's tier, and nothing of them is marked held there."""
    procs = _job(ctx, child.save, tmp_path, "save", 2, 1, 0.0, 1 << 20)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    _lose_node(procs, tmp_path, 1)
    out = _restart_shared(ctx, tmp_path)
    for r, o in enumerate(out):
        assert o["equal"] == [True, True], (r, o)
        assert o["why"].startswith("0 file(s), 0.000 GB, pulled"), o["why"]
        assert o["why"].endswith(
            "4 file(s), 0.001 GB, to go from the GPU of a rank reading them to ranks lacking them"
        )
    nbytes = 2 * child.SIZE * 4  # each lost rank's two tensors
    assert [o["received"] for o in out] == [0, 0, nbytes, nbytes]
    assert [o["in_tier"] for o in out] == [[True, True]] * 2 + [[False, False]] * 2
    assert "GB from other ranks' GPUs" in out[2]["report"]
    tier = MemoryTier(child.tier_root(tmp_path, 1), tmp_path / "ckpt", 2)
    assert tier.marked(2, 2) in (None, {}), tier.marked(2, 2)


@pytest.mark.slow
def test_a_file_its_server_cannot_read_is_not_handed_over_and_nobody_waits_for_it(tmp_path, ctx):
    """Node 0's copy of rank 0's weights damaged: rank 0's read fails its checksum; rank 2, which was to
    get that file from it, gets no state for it (its ordinary read then fails, and a resume falls back),
    the description names why, and the optimizer state still comes over whole."""
    procs = _job(ctx, child.save, tmp_path, "save", 2, 1, 0.0, 1 << 20)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(WORLD)), "the saves")
    _lose_node(procs, tmp_path, 1)
    out = _restart_shared(ctx, tmp_path, child.files(0)[0])
    assert out[0]["equal"] == [False, True] and out[2]["equal"] == [False, True], out
    assert out[2]["problems"] == ["model/w0.safetensors from rank 0: its server could not read it"]
    assert out[1]["equal"] == out[3]["equal"] == [True, True] and not out[3]["problems"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CUDA: NCCL between two GPUs")
def test_a_lost_nodes_files_come_from_the_other_nodes_gpu_over_nccl(tmp_path, ctx):
    """Two nodes of one GPU, both reading rank 0's files: the lost node's come from rank 0's GPU over NCCL
    into its own GPU's memory, bit for bit, and nothing is pulled into its tier."""
    procs = _job(ctx, child.save, tmp_path, "save", 2, 1, 0.0, 100 << 10, "nccl", world=2)
    _wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(2)), "the saves")
    _lose_node(procs, tmp_path, 1)
    out = _restart_shared(ctx, tmp_path, "", "nccl", world=2)
    assert all(o["equal"] == [True, True] for o in out), json.dumps(out, indent=1)
    assert [o["received"] for o in out] == [0, 2 * child.SIZE * 4] and out[1]["in_tier"] == [False, False]
    assert "over nccl" in out[1]["why"] and out[1]["why"].endswith("ranks lacking them")
