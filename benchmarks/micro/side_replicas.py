"""Memory replicas moved between two processes of their own, over and over, as a load beside a training job
(CPU only): does a replica over gloo cost the steps beside it from inside the training process, or from
the host as a whole?

Two ranks over gloo (`node 0`, `node 1`), each with a memory tier in /dev/shm: each round, every rank saves
`--gb` GB in `--files` files into its tier (memory only, as a memory checkpoint), commits it, and the
package's `Replicator` sends it to the other rank over the job's gloo link (4 streams), each received file
checked as in training; the next round starts once both are replicated, until `--seconds` have passed or
`--stop FILE` exists. `gpu.sh side-replicas` runs it beside a training job of `none` (no checkpoint) and the
same job alone.

    python3 benchmarks/micro/side_replicas.py --out DIR [--gb 1.08 --files 8 --seconds 120]

Writes DIR/side_replicas.json: every replication's seconds and GB/s, and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info, host_info  # noqa: E402


def _rank(rank: int, args: argparse.Namespace, init: str, shm: str) -> None:
    os.environ["GROUP_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    from nanotron_datastates.save.commit import Committer, PendingCheckpoint
    from nanotron_datastates.tier import replicas as rep
    from nanotron_datastates.tier.links import gloo_link
    from nanotron_datastates.tier.memory import MemoryTier

    engine = DataStatesEngine(DataStatesConfig(host_cache_size=0.25, chunk_size=64, parser_threads=4))
    tier = MemoryTier(Path(shm) / f"node{rank}", Path(shm) / "ckpt", rank, copies=2)
    committer_group = dist.new_group(backend="gloo")
    group = dist.new_group(backend="gloo")
    done: list[Any] = []
    holders = rep.placement(["node 0", "node 1"], 1)
    replicator = rep.Replicator(tier, holders, group, engine, link=gloo_link(group), on_done=done.append)

    def mark(result: Any) -> None:  # on the committer's thread, as the trainer's Saver reports
        if result.committed:
            tier.commit(result.step, result.mirrored)
            engine.keep_mirrors(tier.files())
            replicator.submit(result.step, result.mirrored)

    committer = Committer(committer_group, on_result=mark)
    names = [f"model/f{rank}_{i}.safetensors" for i in range(args.files)]
    per = int(args.gb * 1e9) // args.files // 4
    state = [{"data": torch.randn(per)} for _ in names]
    t_end, step = time.monotonic() + args.seconds, 0
    while True:
        stop = time.monotonic() > t_end or bool(args.stop and os.path.exists(args.stop))
        stop_all = torch.tensor([int(stop)])
        dist.all_reduce(stop_all)
        if stop_all.item():
            break
        step += 1
        plans = [engine.plan(s) for s in state]
        mirrors = [tier.path(step, n) for n in names]
        handles = engine.save_plans(
            [(p, str(m)) for p, m in zip(plans, mirrors)], mirrors=mirrors, recycle=tier.recycle(step, names)
        )
        committer.submit(PendingCheckpoint(step, tier.folder / str(step), handles, None, memory=True))
        committer.take(1)
        while len(done) < step:
            time.sleep(0.01)
    replicator.close()
    committer.close()
    engine.close()
    runs = [
        {"step": r.step, "seconds": r.seconds, "sent_gb": r.sent_bytes / 1e9, "error": r.error} for r in done
    ]
    if rank == 0:
        out = {
            "command": command_info(),
            "host": host_info([shm]),
            "gb_a_rank": args.gb,
            "files": args.files,
            "replications": runs,
            "gbps_a_rank": [r["sent_gb"] / r["seconds"] for r in runs if r["seconds"] and not r["error"]],
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "side_replicas.json").write_text(json.dumps(out, indent=1))
        print(f"{len(runs)} replications of {args.gb} GB a rank each way", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--gb", type=float, default=1.08, help="GB each rank replicates a round (180M: 1.08)")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--stop", help="a file whose existence ends the rounds")
    args = p.parse_args()
    shm = tempfile.mkdtemp(prefix="side-replicas-", dir="/dev/shm")
    try:
        init = f"file://{shm}/init"
        mp.spawn(_rank, args=(args, init, shm), nprocs=2)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
