"""Restart from memory on real Nanotron (GPU): a worker killed after a checkpoint, restarted by torchrun.

    python3 benchmarks/bench_restart.py all --model 180m --out DIR [--step 20] [--dp 2 --zero 1]

Each run is its own `torchrun` on one machine, in one call; the restore cost of a run is its time from the
trainer's construction to the end of its first step, minus that of the run of the same engine built from
scratch (Nanotron main's collect_env report and the restart's comparison left out):

* `none`: built from scratch, first: it takes the machine's cold start;
* `torch`, then `restore-torch`: Nanotron's own checkpoint at `--step`, resumed by a new run (its files
  evicted from the page cache first);
* `datastates`, then `restore-datastates`: the engine's, resumed from storage the same way;
* `restart-memory`: one `torchrun --max-restarts 1` with `datastates.memory_tier: true` (with several ranks,
  two `torchrun`s: the job started again, see `--dp`): the worker trains,
  takes a synchronous copy of its whole state at `--step` (weights, optimizer with fp32 master weights,
  scheduler, random states, metadata) as it asks for that checkpoint, and SIGKILLs itself once the checkpoint
  is committed; torchrun starts it again, it resumes from the memory tier, clones its whole restored state on
  the GPU (the clone's time left out), trains on, and then compares the clone with that copy, bit for bit.

With `--scratch-twice`, `datastates` and `torch` start from scratch once more at the end of the call
(`datastates.end`, `torch.end`), and each restore is taken over the median of its engine's starts from
scratch (`scratch_s` in the result): a start's first step depends on what ran on the machine before it (on
the 2x H200 VM `datastates` from scratch took 3.95 to 9.57 s in three calls of one command).

With `--repeats R`, `restart-memory` and `datastates` run R times, in turns (`restart-memory.2`,
`datastates.2` ...): `repeats` in the result gives each restart over the start from scratch next to it and
over its own first incarnation (a start from scratch in the same torchrun, with the tier on), with their
median and spread; a start's time varies by a second or more from run to run.

With `--dp N`, every run is N data-parallel workers (`--zero 1`: optimizer shards per rank); each compares its
own state with its own copy, and all must resume from memory for `restart-memory` to count as from memory.
torchrun's in-place restart of several ranks hands the new workers the dead ones' addresses (torch 2.11-2.13,
pytorch/pytorch#167288; `micro/torchrun_restart_gloo.py`), so there the job is started again instead.

With `--lose-node` (and `--dp 2`), `restart-replica` runs too: two `torchrun`s on this machine, each a node of
`--tp` GPUs (1 by default; each worker on the GPU of its rank, tensor parallelism inside a node, data
parallelism across) with a memory tier of its own, `datastates.memory_replicas: 1`. Once the
checkpoint at `--step` is committed and replicated, the worker of the second node (GROUP_RANK 1) wipes its
node's tier and SIGKILLs itself, and the first node's worker is stopped: a node lost. The job is started
again on both (as a scheduler puts it back on a replacement node; torchrun's own restart reads the first
incarnation's worker addresses when two agents restart apart), resumes every rank from memory, the lost
rank's from the replica its peer holds, and compares each state with its copy as `restart-memory` does. Its
stall with replication on, against `restart-memory`'s (off), is in `stall_s`; the bytes sent and the time in
`replicated`. With `--memory-interval M`, restart-replica takes memory checkpoints every M steps
(`memory_interval`) and its storage checkpoint at `--step` - 1: the job resumes from the memory checkpoint
at `--step`, newer than storage's.

Writes DIR/bench_restart_<model>.json: each run's first step, the restores over scratch and their ratios,
the comparison, the memory tier's size and each run's peak host memory.

This file is the command line and the runs of a call (`run_all`, `lost_node`); each rank's run is
`_restart_phase.py`, the result from the records `_restart_summary.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _nodes as nodes
from _bench_checkpoints import make_cold
from _nanotron import REPO, write_config
from _restart_phase import run_phase
from _restart_summary import summarize
from bench_nanotron import MODELS


def run_all(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tier_path = str(work / "shm") if not args.tier_path else args.tier_path
    shutil.rmtree(tier_path, ignore_errors=True)
    n = args.step

    def config(name: str, engine: str, steps: int, resume: str | None, tier: bool = False,
               node: int | None = None) -> Path:  # fmt: skip
        # `node` k of restart-replica: a tier of its own, replicas on, the run's one checkpoints folder
        # --memory-interval: restart-replica's storage checkpoint at step n - 1, the memory one at n
        every = n - 1 if node is not None and args.memory_interval else n
        ck = {"checkpoints_path": ckpt(name.split(".node")[0]), "checkpoint_interval": every,
              "resume_checkpoint_path": resume}  # fmt: skip
        at = tier_path if node is None else f"{tier_path}-node{node}"
        ds = {"memory_tier": True, "memory_tier_path": at, "memory_tier_copies": args.tier_copies}
        ds = ds if node is None else {**ds, "memory_replicas": 1}
        if node is not None and args.memory_interval:
            ds["memory_interval"] = args.memory_interval
        ds = ds if tier else None
        return write_config(work / f"{name}.yaml", engine=engine, checkpoints=ck, cache_gib=args.cache_gib,
                            steps=steps, model=MODELS[args.model], run=name, datastates=ds,
                            parallelism={"dp": args.dp, "tp": args.tp}, zero=args.zero)  # fmt: skip

    def ckpt(name: str) -> str:
        return str(work / f"ckpt_{name}")

    def repeated(base: str, r: int) -> str:  # the r-th run of `base` (from 0): base, base.2, base.3 ...
        return base if r == 0 else f"{base}.{r + 1}"

    runs = [  # (name, config, stock Nanotron, extra torchrun flags, kills itself)
        ("none", config("none", "torch", n + 2, None), True, [], False),
    ]
    for r in range(args.repeats):  # each restart from memory next to a start from scratch of the same engine
        rm, ds = repeated("restart-memory", r), repeated("datastates", r)
        runs += [
            (rm, config(rm, "datastates", n + 2, ckpt(rm), tier=True), False, ["--max-restarts", "1"], True),
            (ds, config(ds, "datastates", n, None), False, [], False),
        ]
    if args.lose_node:  # two nodes of one GPU each, a config each (lost_node starts them)
        for k in range(2):
            config(f"restart-replica.node{k}", "datastates", n + 2, ckpt("restart-replica"), True, k)
        runs.append(("restart-replica", Path(), False, [], True))
    runs += [
        ("restore-datastates", config("restore-datastates", "datastates", n + 2, ckpt("datastates")),
         False, [], False),
        ("torch", config("torch", "torch", n, None), True, [], False),
        ("restore-torch", config("restore-torch", "torch", n + 2, ckpt("torch")), True, [], False),
    ]  # fmt: skip
    if args.scratch_twice:  # each engine from scratch again, last: its baseline the median of both starts
        runs += [
            ("datastates.end", config("datastates.end", "datastates", n, None), False, [], False),
            ("torch.end", config("torch.end", "torch", n, None), True, [], False),
        ]
    only = set(args.only.split(",")) if args.only else None
    records: dict[str, Any] = {}
    for name, cfg, stock, flags, kill in runs:
        if only is not None and name.split(".")[0] not in only:
            continue
        if name.startswith("restore-"):
            records[f"{name}-cold"] = make_cold(Path(ckpt(name.split("-", 1)[1])), "checkpoint")
        record = work / f"{name}.record"
        if name == "restart-replica":
            t0 = time.perf_counter()
            rc = lost_node(args, name, work, tier_path, record, out)
            incarnations = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.record.*.json"))]
            records[name] = {"rc": rc, "seconds": time.perf_counter() - t0, "runs": incarnations}
            print(f"{name:20s} rc={rc} {records[name]['seconds']:6.1f} s", flush=True)
            shutil.rmtree(ckpt(name), ignore_errors=True)
            for k in range(2):
                shutil.rmtree(f"{tier_path}-node{k}", ignore_errors=True)
            result = summarize(args, records)
            (out / f"bench_restart_{args.model}.json").write_text(json.dumps(result, indent=1))
            continue
        # --standalone: a rendezvous per restart (the static one keeps its store's keys across restarts). With
        # several ranks, torchrun's in-place restart still hands the workers the dead ones' addresses
        # (pytorch/pytorch#167288: a gloo group fails to connect): the job is started again instead.
        again = kill and args.dp * args.tp > 1
        cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.dp * args.tp}", *([] if again else flags)]
        cmd += [__file__, "phase", "--mode", name]
        cmd += ["--config", str(cfg), "--record", str(record), "--work", str(work), "--step", str(n)]
        cmd += ["--tier-path", tier_path] + (["--kill"] if kill else [])
        env = {**os.environ, **({"NANOTRON_DATASTATES_AUTOLOAD": "0"} if stock else {})}
        t0 = time.perf_counter()
        with open(out / f"{name}.log", "w") as f:
            # Started again: the first start kills itself, the second's status is the run's.
            starts = [["--incarnation", "0"], ["--incarnation", "1"]] if again else [[]]
            for more in starts:
                run = subprocess.run(cmd + more, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
                rc = run.returncode
        incarnations = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.record.*.json"))]
        records[name] = {"rc": rc, "seconds": time.perf_counter() - t0, "runs": incarnations}
        print(f"{name:20s} rc={rc} {records[name]['seconds']:6.1f} s", flush=True)
        # What no later run reads goes at once: a whole 1.1B call then fits a 64 GiB disk (restores read
        # the first run of each engine; its repeats and the restarts' own checkpoints are read by none).
        done = name.split("-", 1)[1] if name.startswith("restore-") else name if kill or "." in name else None
        if done is not None:
            shutil.rmtree(ckpt(done), ignore_errors=True)
        if kill:
            shutil.rmtree(tier_path, ignore_errors=True)
        result = summarize(args, records)  # after each run: what ran is kept if the rest is cut short
        (out / f"bench_restart_{args.model}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("restore_over_scratch_s", "ratios", "compared")}, indent=1))
    return 0 if all(r.get("rc") == 0 for r in records.values() if "rc" in r) and result["bitwise"] else 1


def lost_node(
    args: argparse.Namespace, name: str, work: Path, tier_path: str, record: Path, out: Path
) -> int:
    """`restart-replica`: the job on two simulated nodes (a torchrun of `--tp` GPUs each, `_nodes.py`), the
    second node lost once the checkpoint is replicated, then the job started again on both; the worst exit
    status."""
    rcs = []
    for incarnation in range(2):
        scripts = [
            [__file__, "phase", "--mode", name, "--config", str(work / f"{name}.node{k}.yaml"),
             "--record", str(record), "--work", str(work), "--step", str(args.step),
             "--tier-path", f"{tier_path}-node{k}", "--lose-node", "--incarnation", str(incarnation)]
            for k in range(2)
        ]  # fmt: skip
        logs = [out / f"{name}.{incarnation}.node{k}.log" for k in range(2)]
        agents = nodes.start(scripts, 2, args.tp, f"{name}-{incarnation}", logs, REPO, dict(os.environ))
        if incarnation == 0:  # the lost node's worker kills itself; the other's collectives then fail or hang
            nodes.stop(agents)
        else:
            rcs += nodes.wait(agents)
    return max(rcs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("all")
    a.add_argument("--model", choices=sorted(MODELS), default="180m")
    a.add_argument("--step", type=int, default=20, help="the checkpoint's step (default %(default)s)")
    a.add_argument("--cache-gib", type=float, default=8.0, help="host cache, GiB (default %(default)s)")
    a.add_argument("--dp", type=int, default=1, help="data-parallel GPUs (default %(default)s)")
    a.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel GPUs, a simulated node's with --lose-node"
    )
    a.add_argument("--tier-copies", type=int, default=2, help="memory_tier_copies (default %(default)s)")
    a.add_argument("--zero", type=int, default=0, help="ZeRO stage (default %(default)s)")
    a.add_argument("--out", required=True)
    a.add_argument("--work", default="/tmp/ds_restart")
    a.add_argument("--tier-path", default="/dev/shm/nanotron-datastates-{uid}", help="(default %(default)s)")
    a.add_argument("--only", default="", help="these runs only, comma-separated (restores need their save)")
    a.add_argument("--repeats", type=int, default=1, help="restart-memory and datastates runs (default 1)")
    a.add_argument("--lose-node", action="store_true", help="also restart-replica (--dp 2): a node lost")
    a.add_argument(
        "--scratch-twice", action="store_true",
        help="datastates and torch from scratch again at the end: each baseline the median of its starts",
    )  # fmt: skip
    a.add_argument(
        "--memory-interval", type=int, default=0,
        help="restart-replica: memory checkpoints every N steps (N divides --step; storage at step - 1)",
    )  # fmt: skip
    sm = sub.add_parser("summarize", help="recompute a result file's summary from its records")
    sm.add_argument("file")
    ph = sub.add_parser("phase")
    for flag in ("--mode", "--config", "--record", "--work", "--tier-path"):
        ph.add_argument(flag, required=True)
    ph.add_argument("--step", type=int, required=True)
    ph.add_argument("--kill", action="store_true")
    ph.add_argument("--lose-node", action="store_true")
    ph.add_argument("--incarnation", type=int, help="the job's start (default: torchrun's restart count)")
    args = p.parse_args()
    if getattr(args, "memory_interval", 0) and (args.step % args.memory_interval or args.step < 3):
        p.error(f"--memory-interval {args.memory_interval} must divide --step {args.step} (at least 3)")
    if getattr(args, "tier_path", None):
        args.tier_path = args.tier_path.replace("{uid}", str(os.geteuid()))
    if args.what == "summarize":
        path = Path(args.file)
        old = json.loads(path.read_text())
        args.model, args.step = old["model"], old["step"]
        args.dp, args.tp, args.zero = old.get("dp", 1), old.get("tp", 1), old.get("zero_stage", 0)
        args.memory_interval = old.get("memory_interval")  # None where the call had no such option
        args.repeats = sum(1 for k in old["records"] if k.split(".")[0] == "restart-memory")
        result = {**summarize(args, old["records"]), "command": old["command"]}
        path.write_text(json.dumps(result, indent=1))
        return 0
    return run_all(args) if args.what == "all" else (run_phase(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
