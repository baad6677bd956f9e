"""The ranks of test_replicas.py's jobs: processes on simulated nodes (each node its own memory tier root, its
number in GROUP_RANK as torchrun sets it), a gloo group over all. `save` commits checkpoints as the Nanotron
trainer does (engine files into the tier, the manifest and latest.txt by rank 0) and replicates each to the
next node, then waits to be killed; `restart` resumes the newest checkpoint through
`replicas.restart_source` and reports where each rank read from and whether every byte is the saved one.
`transport`: the replicas' link (tier/links.py), 'nccl' on one GPU a rank. Not a test."""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

SIZE = 64 << 10  # elements per tensor


def tensors(step: int, rank: int) -> dict[str, Any]:
    import torch

    base = torch.arange(SIZE, dtype=torch.float32)
    return {"w": base * step + rank, "m": base - step * 100 - rank}


def files(rank: int) -> tuple[str, str]:
    return f"model/w{rank}.safetensors", f"optimizer/optimizer_{rank}.safetensors"


def tier_root(work: Path, node: int) -> Path:
    return work / f"node{node}-shm"


def _start(rank: int, world: int, node: int, init: str, transport: str = "gloo") -> Any:
    import torch
    import torch.distributed as dist

    os.environ["GROUP_RANK"] = str(node)
    if transport != "gloo":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return dist


def _engine() -> Any:
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    return DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1, parser_threads=2))


def save(
    rank: int,
    world: int,
    node: int,
    init: str,
    work: str,
    steps: int,
    replicas: int,
    gbps: float,
    chunk: int,
    transport: str = "gloo",
    ahead: bool = False,
    store: str = "",
) -> None:
    from nanotron_datastates.checkpoint.file_io import write_atomic
    from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
    from nanotron_datastates.checkpoint.names import LATEST, MANIFEST
    from nanotron_datastates.save.commit import Committer, PendingCheckpoint
    from nanotron_datastates.tier import replicas as rep
    from nanotron_datastates.tier.links import open_link
    from nanotron_datastates.tier.memory import MemoryTier

    dist = _start(rank, world, node, init, transport)
    root, out = Path(work) / "ckpt", Path(work)
    engine = _engine()
    tier = MemoryTier(tier_root(out, node), root, rank, copies=2)
    commit_group = dist.new_group(backend="gloo")
    replicator = None
    if replicas:
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, rep.node_key())
        group = dist.new_group(backend="gloo")
        link = open_link(group, transport, chunk)
        holders = rep.placement(nodes, replicas)

        def done(r: Any) -> None:  # the log line, and the inode of each replica file received
            (out / f"replicated{rank}-{r.step}.txt").write_text(rep.describe(r))
            inodes = {
                f"{s}/{rel}": os.stat(rep.replica_area(tier, s).path(r.step, rel)).st_ino
                for s in [s for s, hs in enumerate(holders) if rank in hs]
                for rel in files(s)
            }
            (out / f"inodes{rank}-{r.step}.json").write_text(json.dumps(inodes))

        if store:  # a process of the rank's own moves them (tier/replica_process.py), meeting at `store`
            from nanotron_datastates.tier.replica_process import ProcessSpec, ReplicaProcess

            host, port = store.split(":")
            opened = (str(tier.base), str(root), 2, 1)
            spec = ProcessSpec((host, int(port)), "test/", rank, world, holders, opened, gbps, 2, nice=3)
            replicator = ReplicaProcess(tier, spec, done)
            (out / f"replica-process{rank}").write_text(str(replicator.pid))
        else:
            replicator = rep.Replicator(tier, holders, group, engine, gbps=gbps, link=link, on_done=done)
        if ahead:  # the first two replicas' files made ahead, as the Saver does after the first step
            _make_ahead(dist, engine, replicator, out, rank, world)

    def mark(result: Any) -> None:  # on the committer's thread, as the trainer's Saver reports
        if result.committed:
            tier.commit(result.step, result.mirrored)
            engine.keep_mirrors()
            if replicator is not None:
                replicator.submit(result.step, result.mirrored)

    committer = Committer(commit_group, on_result=mark)
    for step in range(1, steps + 1):
        folder = root / str(step)
        names = files(rank)
        t = tensors(step, rank)
        plans = [
            engine.plan({"data": t["w"]}, metadata={"step": str(step)}, exact_metadata=True),
            engine.plan({"step": step, "m": t["m"]}),
        ]
        handles = engine.save_plans(
            [(plan, folder / rel) for plan, rel in zip(plans, names)],
            mirrors=[tier.path(step, rel) for rel in names],
            recycle=tier.recycle(step, list(names)),
        )

        def finalize(all_files: dict[str, Any], folder: Path = folder, step: int = step) -> None:
            write_atomic(folder / MANIFEST, json.dumps(make_manifest(step, {}, all_files)))
            write_atomic(root / LATEST, str(step))

        committer.submit(PendingCheckpoint(step, folder, handles, finalize if rank == 0 else None))
        (result,) = committer.take(1)
        assert result.committed, result.errors
        if replicator is not None and store:  # each step sent before the next is saved: none skipped for it
            while not (out / f"replicated{rank}-{step}.txt").exists():
                time.sleep(0.01)
    if replicator is not None and not store:  # the replica process stays, as while training goes on
        replicator.close()
    (out / f"done{rank}").write_text("")
    time.sleep(3600)  # training goes on until the node is lost


def _make_ahead(dist: Any, engine: Any, replicator: Any, out: Path, rank: int, world: int) -> None:
    """Every rank's file sizes gathered, the replicas' files made ahead; their inodes, by set, to a file."""
    from nanotron_datastates.tier import replicas as rep

    t = tensors(1, rank)
    plans = [engine.plan({"data": t["w"]}, metadata={"step": "1"}, exact_metadata=True), engine.plan(
        {"step": 1, "m": t["m"]})]  # fmt: skip
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, [(rel, p.nbytes) for rel, p in zip(files(rank), plans)])
    wanted = {s: everyone[s] for s in replicator.sources}
    told: list[Any] = []  # as the Saver asks: a process answers from another thread, the threads' at once
    answered = threading.Event()
    returned = replicator.make_ahead(wanted, then=lambda *a: (told.append(a), answered.set()))
    assert answered.wait(120) and returned == 0, (returned, told)
    made, error = told[0]
    assert error is None and made == 2 * sum(n for s in wanted for _, n in wanted[s]), told
    area = {s: rep.replica_area(replicator.tier, s) for s in replicator.sources}
    inodes = [
        {f"{s}/{rel}": os.stat(area[s].warm(i, rel)).st_ino for s in replicator.sources for rel in files(s)}
        for i in range(2)
    ]  # fmt: skip
    (out / f"ahead{rank}.json").write_text(json.dumps(inodes))


def restart(
    rank: int, world: int, node: int, init: str, work: str, replicas: int, transport: str = "gloo"
) -> None:
    from nanotron_datastates.checkpoint.checksums import file_checksums
    from nanotron_datastates.checkpoint.manifest import read_manifest
    from nanotron_datastates.checkpoint.names import LATEST
    from nanotron_datastates.tier import replicas as rep
    from nanotron_datastates.tier.links import open_link
    from nanotron_datastates.tier.memory import MemoryTier
    from nanotron_datastates.tier.replica_restore import restart_source

    dist = _start(rank, world, node, init, transport)
    root, out = Path(work) / "ckpt", Path(work)
    step = int((root / LATEST).read_text())
    folder = root / str(step)
    manifest = read_manifest(folder)
    engine = _engine()
    tier = MemoryTier(tier_root(out, node), root, rank, copies=2)
    group = dist.new_group(backend="gloo")
    link = open_link(group, transport)
    source, why, _ = restart_source(tier, manifest, set(files(rank)), group, engine, link)
    link.close()
    if replicas:
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, rep.node_key())
        holders = rep.placement(nodes, replicas)
        rep.prune(tier, [s for s, hs in enumerate(holders) if rank in hs], step)
    want = tensors(step, rank)
    equal = []
    for rel, key in zip(files(rank), ("data", "m")):
        path = (source or folder) / rel
        sums = file_checksums(manifest, folder, folder / rel)
        got = engine.load(path, checksums=sums)[key]
        equal.append(bool(got.equal(want["w" if key == "data" else "m"])))
    leftovers = temporaries(tier.folder.parent)
    report = {"source": str(source) if source else None, "why": why, "equal": equal, "step": step}
    report["held"] = tier.held_steps()
    (out / f"restart{rank}.json").write_text(json.dumps({**report, "leftovers": leftovers}))
    engine.close()
    dist.destroy_process_group()


def restart_shared(
    rank: int, world: int, node: int, init: str, work: str, damage: str = "", transport: str = "gloo"
) -> None:
    """A restart where ranks r and r + 2 read the same files, rank r % 2's (data-parallel replicas without
    ZeRO; on two ranks, both read rank 0's), each reading them ahead: what the lost node lacks comes from
    the rank reading them on the other node, through the read-ahead (`Prefetch`): over gloo onto the CPU,
    or over NCCL from GPU to GPU (`transport`). `damage`: a file of node 0's tier whose last byte is
    flipped first."""
    import torch

    from nanotron_datastates.checkpoint.checksums import file_checksums
    from nanotron_datastates.checkpoint.manifest import read_manifest
    from nanotron_datastates.checkpoint.names import LATEST
    from nanotron_datastates.resume.read_ahead import Prefetch
    from nanotron_datastates.tier.links import open_link
    from nanotron_datastates.tier.memory import MemoryTier
    from nanotron_datastates.tier.replica_restore import restart_source

    dist = _start(rank, world, node, init, transport)
    root, out = Path(work) / "ckpt", Path(work)
    step = int((root / LATEST).read_text())
    folder = root / str(step)
    manifest, engine = read_manifest(folder), _engine()
    tier = MemoryTier(tier_root(out, node), root, rank, copies=2)
    if damage and rank == 0:
        with open(tier.path(step, damage), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()
    weights, optimizer = files(rank % (world // 2))
    ahead = {"weights": [weights], "optimizer": [optimizer]}
    group = dist.new_group(backend="gloo")
    link = open_link(group, transport)
    gpu = transport == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    peers = getattr(link, "group", None) if gpu else group
    source, why, peer = restart_source(
        tier, manifest, {weights, optimizer}, group, engine, link, ahead, peers
    )
    link.close()
    assert source is not None, why
    sums = functools.partial(file_checksums, manifest, source)
    prefetch = Prefetch(engine, device, [source / weights], [source / optimizer], sums, None, peer)
    got = prefetch.weights().get(source / weights, {}).get("data")
    state = prefetch.optimizer([source / optimizer])
    want = {k: v.to(device) for k, v in tensors(step, rank % (world // 2)).items()}
    report = {
        "why": why,
        "equal": [
            got is not None and bool(got.equal(want["w"])),
            state is not None and bool(state["m"].equal(want["m"])),
        ],
        "in_tier": [(source / rel).exists() for rel in (weights, optimizer)],
        "received": peer.received_bytes if peer else 0,
        "problems": peer.problems if peer else [],
        "report": prefetch.report(),
    }
    (out / f"shared{rank}.json").write_text(json.dumps(report))
    engine.close()
    dist.destroy_process_group()


def temporaries(root: Path) -> list[str]:
    """The temporaries under `root`, the node's memory tier. The node's other ranks prune their own areas
    meanwhile: a folder that vanishes during the walk is skipped (os.walk ignores it), where rglob raises."""
    found = []
    for folder, dirs, names in os.walk(root):
        found += [os.path.join(folder, n) for n in dirs + names if fnmatch.fnmatch(n, "*.dstmp.*")]
    return found


def links(rank: int, world: int, node: int, init: str, work: str) -> None:
    """The link each transport setting gives this rank: its name, or the error's message."""
    import torch

    from nanotron_datastates.tier.links import open_link

    dist = _start(rank, world, node, init, "nccl" if torch.cuda.is_available() else "gloo")
    group = dist.new_group(backend="gloo")
    got = {}
    for transport in ("auto", "gloo", "nccl"):
        for training in (False, True):  # a restart's pull; replicas sent while training runs
            key = transport + ("-training" if training else "")
            try:
                got[key] = open_link(group, transport, at_steps=training).name
            except Exception as e:  # noqa: BLE001 - the test reads the message
                got[key] = f"{type(e).__name__}: {e}"
    (Path(work) / f"links{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
