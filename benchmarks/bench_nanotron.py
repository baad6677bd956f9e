"""Checkpoint cost on real Nanotron: its native save, DCP async_save and datastates side by side (GPU).

    python3 benchmarks/bench_nanotron.py all --model 180m --out DIR [--steps 100 --interval 20]

Each mode trains the same model for the same steps in its own torchrun, on the same machine, in one call:

* `none`: no checkpoint, the reference iteration time;
* `torch`: Nanotron's own `save_checkpoint` every `--interval` steps (Nanotron without the adapter);
* `dcp`: `torch.distributed.checkpoint.async_save` (default stager) of the same tensors: weights, optimizer
  states and fp32 master weights; the previous save's future is awaited before the next one;
* `dcp-zo`: DCP's zero-overhead configuration (torch >= 2.9, as torchtitan uses it): one
  `DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
  use_non_blocking_copy=True))` reused for every save, `async_checkpointer_type=PROCESS`, and the save's
  `staging_completion` awaited before the next optimizer step;
* `datastates`: `checkpointing_engine: datastates`;
* `stress`: datastates at every step, where backpressure must bound the stall;
* `datastates-idle`: datastates set up and never asked for a checkpoint (what its presence alone costs);
* `copy-only`, `copy-paced`: stock Nanotron without checkpoints, where the benchmark itself copies as many
  bytes as a checkpoint holds from the GPU to pinned host memory at the optimizer step after every
  `--interval` steps (where datastates queues its staged copies): one copy on a side stream, or pieces of 64
  MiB with GPU sleeps between them that spread it over `--copy-pace-s`. What the copy to the host alone
  costs the steps it runs beside, and whether spreading it changes that cost; `copy-h2d`: the same bytes
  the other way (is it the direction?); `copy-host`: the same bytes copied between two host buffers by a
  thread on 4 cores, no GPU involved (is it the host memory's traffic?); `copy-engine`: the same bytes into
  a file in /dev/shm by the engine's core alone, as a memory checkpoint's copy goes (what any memory
  checkpoint of the state at that interval costs, before the trainer's Python; `copy-engine-files`,
  `-files-stage`, `-files-stage-checksums` add a memory checkpoint's parts: its files, staging, checksums);
* `datastates-NAME` (`--variant NAME:key=value,...`): datastates with other `datastates:` settings, for
  ablations (`p1:parser_threads=1`); a NAME starting with `idle` asks for no checkpoint; `checkpoint_interval`
  sets storage's (memory checkpoints: `mem:checkpoint_interval=1000,memory_tier=true,memory_interval=10`),
  `switch_interval_ms` the interpreter's switch interval in that run (`sys.setswitchinterval`);
* `restore-torch`, `restore-datastates`: new runs that resume from the last checkpoint of `torch` /
  `datastates` with the checkpoint's files evicted from the page cache (`--cold system`: the whole page
  cache, libraries included); restore cost = their time from constructing the trainer to the end
  of the first step, minus the median of the same time over the runs that build the model from scratch.
  `--restore-repeats N` runs the two restores N times in turn after every training run (`restore-torch-2`,
  `restore-datastates-2`, ...), keeping both checkpoints on the disk: the disk's read speed drifts between
  minutes by more than the ratio's margin, so each pair is taken side by side and the speedup is their median.

The whole run's cost (`overhead_vs_none` of each mode): its training time over that of `none` over the same
steps, minus 1, and the same by the iterations' place after a checkpoint: the stall's iterations, those
while it is persisted (to half the interval), those far from it. `--rounds N` runs the set N times in turn
and writes `rounds_summary.md`, the median and spread of each over the rounds: the headline figure.
`--blocks N` takes memory checkpoints and the `copy-*` copies only in every other block of N steps (from
the second on), and reports each run's mean iteration in those blocks over that in the others
(`blocks_on_vs_off`, each block's first 2 iterations left out): a cost measured within one run, which the
machine's drift from run to run (10 to 20% on one H200 host) does not move.

An iteration is timed from the end of one step to the end of the next, once the GPU has run the step's work,
so a checkpoint's cost lands in the iterations after it. `--sync stream` (the default) waits for the training
stream (`torch.cuda.current_stream().synchronize()`), as Nanotron's own iteration timer does (an event on
that stream); `--sync device` waits for every stream (`torch.cuda.synchronize()`), and so also for copies
that an engine runs on streams of its own beside the steps, which Nanotron's loop never waits for: with a
copy of a checkpoint's bytes to the host on a side stream (`copy-only`), the iteration after it took the
whole copy's 40 ms more that way (`results/h100/copy_cost_device_sync/`). Results before the option were
timed with `device`. Stall of a checkpoint = the sum, over the 3 iterations
after it, of their excess over the median iteration of `none`. Each run also records its host memory (its
peak resident set; at its last step, the proportional set size of the process and of those it starts, such
as DCP's checkpoint process; the peak of what `/dev/shm` gained: DCP's shared-memory staging, the memory
tier) and its peak GPU memory; `--pss-every S` also reads the PSS every S seconds in the background (a load
on the run: see `MemorySampler`). `--nodes N` splits the layout's GPUs over N simulated nodes (`_nodes.py`;
memory replicas go to other nodes). Writes DIR/bench_nanotron_<model>.json, a markdown table (.md) and a
plot of the iteration times around checkpoints (.png). Nanotron main's trainer runs `torch.utils.collect_env`
while it is constructed (2 to 5 s of subprocesses, in every mode alike): the time to the first step leaves
that report's own time out.

This file is the driver (the CLI, the runs of a call and of its rounds); each rank of a run is this file's
`phase` under torchrun (`_bench_phase.py`), what the compared modes run beside it is `_bench_baselines.py`,
its measurements `_bench_measure.py`, the checkpoints' folders `_bench_checkpoints.py`; the figures of a
record are `_bench_figures.py`, a call's result `_bench_summary.py`, and the rounds' `_bench_rounds.py`.
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
from _bench_baselines import dcp_zero_overhead_stager
from _bench_checkpoints import make_cold
from _bench_measure import MemorySampler
from _bench_phase import rank_record, run_phase
from _bench_rounds import aggregate_rounds, overhead_table
from _bench_summary import plot, resummarize, summarize, table
from _nanotron import REPO, write_config
from _ranks import merge

# What other benchmarks import from here (bench_restart.py, bench_engine.py, nanotron_reshard_proof.py,
# micro/bench_staging.py), whichever module now holds it.
__all__ = ["MODELS", "MemorySampler", "dcp_zero_overhead_stager", "make_cold"]

MODELS: dict[str, dict[str, Any]] = {
    "180m": {},  # the example config's model
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },  # TinyLlama-1.1B's shape
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
    },  # Llama-3.2-3B's shape with the example's 32k vocabulary: 3.0B parameters
}
# Layouts of several GPUs: parallelism, ZeRO stage (one GPU when none is named)
LAYOUTS: dict[str, dict[str, Any]] = {
    "1gpu": {"parallelism": {}, "zero": 0},
    "dp4-zero1": {"parallelism": {"dp": 4}, "zero": 1},
    "dp4": {"parallelism": {"dp": 4}, "zero": 0},
    "tp2-dp2": {"parallelism": {"tp": 2, "dp": 2}, "zero": 0},
    "dp2": {"parallelism": {"dp": 2}, "zero": 0},
}


def run_all(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = MODELS[args.model]
    layout = LAYOUTS[args.layout]
    gpus = 1
    for v in layout["parallelism"].values():
        gpus *= v

    def config(
        name: str,
        engine: str,
        steps: int,
        interval: int,
        resume: str | None = None,
        datastates: dict[str, Any] | None = None,
    ) -> Path:
        ck = {
            "checkpoints_path": str(work / f"ckpt_{name}"),
            "checkpoint_interval": interval,
            "resume_checkpoint_path": resume,
        }
        return write_config(
            work / f"{name}.yaml",
            engine=engine,
            checkpoints=ck,
            cache_gib=args.cache_gib,
            steps=steps,
            model=model,
            run=name,
            datastates=datastates,
            parallelism=layout["parallelism"],
            zero=layout["zero"],
            fp32_grads=not args.no_fp32_grads,
            tokens={"micro_batch_size": args.micro_batch} if args.micro_batch else None,
        )

    never = args.steps + 1
    last = args.steps // args.interval * args.interval
    # Each restore right after the run it resumes, whose checkpoints are then deleted: at most two
    # checkpoints of the 1B model (15 GB each) are on the disk at once.
    runs = [
        ("none", config("none", "torch", args.steps, never), True),
        ("torch", config("torch", "torch", args.steps, args.interval), True),
        ("restore-torch", config("restore-torch", "torch", last + 2, never, str(work / "ckpt_torch")), True),
        ("dcp", config("dcp", "torch", args.steps, args.interval), True),
        ("dcp-zo", config("dcp-zo", "torch", args.steps, args.interval), True),
        ("copy-only", config("copy-only", "torch", args.steps, never), True),
        ("copy-paced", config("copy-paced", "torch", args.steps, never), True),
        ("copy-h2d", config("copy-h2d", "torch", args.steps, never), True),
        ("copy-host", config("copy-host", "torch", args.steps, never), True),
        ("copy-engine", config("copy-engine", "torch", args.steps, never), True),
        *[  # copy-engine-PART-...: the engine's copy with a memory checkpoint's parts (_bench_baselines.py)
            (m, config(m, "torch", args.steps, never), True)
            for m in (args.modes or "").split(",")
            if m.startswith("copy-engine-")
        ],
        ("datastates", config("datastates", "datastates", args.steps, args.interval), False),
        (
            "restore-datastates",
            config("restore-datastates", "datastates", last + 2, never, str(work / "ckpt_datastates")),
            False,
        ),
        ("stress", config("stress", "datastates", args.stress_steps, 1), False),
        # the engine on and never asked for a checkpoint: what its presence alone costs
        ("datastates-idle", config("datastates-idle", "datastates", args.steps, never), False),
    ]
    switch_ms: dict[str, float] = {}  # a variant's `switch_interval_ms`: the interpreter's, in its run
    for name, settings in variants(args.variant):
        idle = name.startswith("datastates-idle")
        every = settings.pop("checkpoint_interval", never if idle else args.interval)
        own = run_settings(settings)
        if "switch_interval_ms" in own:
            switch_ms[name] = float(own["switch_interval_ms"])
        runs.append((name, config(name, "datastates", args.steps, every, datastates=settings), False))
    if args.modes:
        wanted = set(args.modes.split(",")) | {"none"} | {n for n, _ in variants(args.variant)}
        runs = [r for r in runs if r[0] in wanted]
    if args.restore_repeats > 1:  # the restores last, in pairs, each pair one after the other
        restores = [r for r in runs if r[0].startswith("restore-")]
        runs = [r for r in runs if not r[0].startswith("restore-")]
        for k in range(args.restore_repeats):
            runs += [(name if k == 0 else f"{name}-{k + 1}", cfg, stock) for name, cfg, stock in restores]
    if getattr(args, "rotation", 0):  # round k of --rounds: training runs start k further on, restores last
        plain = [r for r in runs if not r[0].startswith("restore-")]
        k = args.rotation % len(plain)
        runs = plain[k:] + plain[:k] + [r for r in runs if r[0].startswith("restore-")]
    records: dict[str, Any] = {}
    cold: dict[str, Any] = {}
    for i, (name, cfg, stock) in enumerate(runs):
        if name.startswith("restore"):
            cold[name] = make_cold(work / f"ckpt_{resumed_from(name)}", args.cold)
            shutil.rmtree(work / f"ckpt_restore-{resumed_from(name)}", ignore_errors=True)  # a repeat's save
        record = work / f"{name}.json"
        for old in work.glob(f"{name}.rank*.json"):
            old.unlink()
        os.sync()  # no write-back of the previous run's files left to compete with this one
        cmd = ["torchrun", f"--nproc_per_node={gpus}", __file__, "phase", "--mode", name]
        cmd += ["--config", str(cfg)]
        cmd += ["--record", str(record)] + (["--profile"] if args.profile else [])
        cmd += ["--pss-every", str(args.pss_every), "--copy-pace-s", str(args.copy_pace_s)]
        cmd += ["--interval", str(args.interval), "--sync", args.sync, "--blocks", str(args.blocks)]
        cmd += ["--switch-interval-ms", str(switch_ms.get(name, 0.0))]
        env = {**os.environ, **({"NANOTRON_DATASTATES_AUTOLOAD": "0"} if stock else {})}
        t0 = time.perf_counter()
        if args.nodes > 1:  # simulated nodes: a torchrun and a config each (_nodes.py)
            rc = nodes.run(cmd[2:], cfg, args.nodes, gpus, name, out / f"{name}.log", cwd=REPO, env=env)
        else:
            with open(out / f"{name}.log", "w") as f:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
        ranks = [rank_record(record, r) for r in range(gpus)]
        rec = merge([json.loads(p.read_text()) for p in ranks]) if all(p.exists() for p in ranks) else {}
        records[name] = {"rc": rc, "seconds": time.perf_counter() - t0, **rec}
        print(f"{name:20s} rc={rc} {records[name]['seconds']:6.1f} s", flush=True)
        if name == "none" and rc != 0:  # every figure is taken against it
            print(f"none failed: see {out / 'none.log'}", flush=True)
            return 1
        for prof in work.glob(f"{name}.*.prof.txt"):
            shutil.copy(prof, out / prof.name)
        later = {resumed_from(r[0]) for r in runs[i + 1 :] if r[0].startswith("restore-")}
        if name.startswith("restore"):
            if resumed_from(name) not in later:
                shutil.rmtree(work / f"ckpt_{resumed_from(name)}", ignore_errors=True)
        elif name not in later:  # kept for the restores that come next
            shutil.rmtree(work / f"ckpt_{name}", ignore_errors=True)
        (out / f"records_{args.model}.json").write_text(json.dumps(records))  # iteration times, for plots
        stem = out / f"bench_nanotron_{args.model}"
        if "none" not in records:  # a rotated round runs its reference later: summarized from then on
            continue
        result = summarize(args, records)  # after every run: a call cut short keeps what it measured
        result["cold_cache"] = cold
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(table(result))
    plot(records, args, stem.with_suffix(".png"))
    print(table(result))
    return 0 if all(r["rc"] == 0 for r in records.values()) else 1


def resumed_from(restore: str) -> str:  # the training run a restore resumes: `restore-torch-2` -> `torch`
    return restore.split("-")[1]


def run_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A variant's settings that are its run's, not its `datastates:` section's: taken out of `settings`."""
    return {k: settings.pop(k) for k in ("switch_interval_ms",) if k in settings}


def variants(specs: list[str] | None) -> list[tuple[str, dict[str, Any]]]:
    """`NAME:key=value,key=value` -> ("datastates-NAME", {key: value}); values parsed as YAML."""
    import yaml

    out = []
    for spec in specs or []:
        name, _, rest = spec.partition(":")
        pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
        if not name or any(len(kv) != 2 for kv in pairs):
            raise SystemExit(f"--variant {spec!r}: expected NAME:key=value[,key=value]")
        out.append((f"datastates-{name}", {k: yaml.safe_load(v) for k, v in pairs}))
    return out


def run_rounds(args: argparse.Namespace) -> int:
    """`--rounds N`: the whole set of runs N times in turn (none, datastates, none, datastates, ...), each
    round in `out/round<k>/`, then `rounds_summary.json`: per mode, every round's figures and their median.
    The machine's iteration time drifts between runs by more than the 2% being measured; interleaving puts
    each run next to its own reference. Round k starts k runs further along the list (restores stay last), so
    that no mode always runs in the same place."""
    rc, per_round = 0, []
    for k in range(args.rounds):
        one = argparse.Namespace(**{**vars(args), "out": str(Path(args.out) / f"round{k}"), "rotation": k})
        rc |= run_all(one)
        per_round.append(json.loads((Path(one.out) / f"bench_nanotron_{args.model}.json").read_text()))
        summary = aggregate_rounds(per_round)
        (Path(args.out) / "rounds_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["modes"], indent=1))
    print(overhead_table(summary))
    (Path(args.out) / "rounds_summary.md").write_text(overhead_table(summary) + "\n")
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("all")
    a.add_argument("--model", choices=sorted(MODELS), default="180m")
    a.add_argument("--out", required=True)
    a.add_argument("--work", default="/tmp/bench_nanotron")
    a.add_argument("--steps", type=int, default=100)
    a.add_argument("--interval", type=int, default=20)
    a.add_argument("--stress-steps", type=int, default=30)
    a.add_argument("--cache-gib", type=float, default=8.0)
    a.add_argument("--layout", choices=sorted(LAYOUTS), default="1gpu", help="GPUs and parallelism")
    a.add_argument("--nodes", type=int, default=1, help="simulated nodes the layout's GPUs are split over")
    a.add_argument("--micro-batch", type=int, help="micro_batch_size (the example config's 4 by default)")
    a.add_argument(
        "--no-fp32-grads",
        action="store_true",
        help="gradients accumulated in bf16 (Nanotron main has no fp32 accumulation with ZeRO-1 on dp > 1)",
    )
    a.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the second save, the step that queues it (datastates) and the restores' init",
    )
    a.add_argument(
        "--cold",
        choices=("checkpoint", "system"),
        default="checkpoint",
        help="before a restore, evict the checkpoint's files, or all the page cache",
    )
    a.add_argument("--modes", help="comma-separated subset of the runs (none always runs)")
    a.add_argument("--variant", action="append", help="NAME:key=value,...: one more datastates run")
    a.add_argument("--rounds", type=int, default=1, help="repeat every run this many times, interleaved")
    a.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="memory checkpoints and copy-* copies only in every other block of N steps: each run's cost is "
        "then also its blocks with over its blocks without (blocks_on_vs_off), within the run",
    )
    a.add_argument("--pss-every", type=float, default=0.0, help="also read PSS every S s (0: never)")
    a.add_argument("--copy-pace-s", type=float, default=0.3, help="copy-paced: seconds its copy takes")
    a.add_argument(
        "--sync",
        choices=("stream", "device"),
        default="stream",
        help="what an iteration's end waits for: the training stream, or every stream",
    )
    a.add_argument(
        "--restore-repeats",
        type=int,
        default=1,
        help="run the two restores this many times in turn, after the training runs",
    )
    rs = sub.add_parser("resummarize", help="recompute DIR's JSON and table from its records")
    rs.add_argument("dir")
    ph = sub.add_parser("phase")
    for flag in ("--mode", "--config", "--record"):
        ph.add_argument(flag, required=True)
    ph.add_argument("--profile", action="store_true")
    ph.add_argument("--pss-every", type=float, default=0.0)
    ph.add_argument("--copy-pace-s", type=float, default=0.3)
    ph.add_argument("--interval", type=int, default=0, help="copy-*: the steps between copies")
    ph.add_argument("--blocks", type=int, default=0, help="checkpoints only in every other block of N steps")
    ph.add_argument("--switch-interval-ms", type=float, default=0.0, help="0: Python's")
    ph.add_argument("--sync", choices=("stream", "device"), default="stream")
    args = p.parse_args()
    if args.what == "phase":
        run_phase(args)
        return 0
    if args.what == "resummarize":
        return resummarize(Path(args.dir))
    return run_rounds(args) if args.rounds > 1 else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
