"""SIGKILL crash trials of real Nanotron training with `checkpointing_engine: datastates` (GPU machine).

    python3 benchmarks/nanotron_crash.py --trials 3 --out DIR [--work /tmp/nanotron_crash]

Each trial starts Nanotron's own `run_train.py` (the adapter loaded by its import hook) checkpointing every
`--interval` steps, so that saves are always in flight; once the first checkpoint folder appears it waits a
random 0.5-6 s and kills torchrun and its workers with SIGKILL. Then:

* `verify.verify` of the checkpoints folder: `latest.txt` names a committed checkpoint, and every
  committed checkpoint is whole (every file of every rank present, sizes and CRC-32C as in its manifest);
* every `.safetensors` file at a final path is a whole file (half-written ones only exist as temporaries);
* a new run resumes from it (`resume_checkpoint_path` = the checkpoints folder) and trains 2 more steps.

Writes DIR/crash_trials.json; exit status 0 only if every trial passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _nanotron import REPO, write_config

from nanotron_datastates import format as fmt
from nanotron_datastates.checkpoint import folder as checkpoint
from nanotron_datastates.checkpoint import verify


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children of children too), deepest last."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def trial(i: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    work = Path(args.work) / f"trial{i}"
    ckpts = work / "ckpt"
    cfg = write_config(
        work / "train.yaml",
        engine="datastates",
        steps=100_000,
        cache_gib=args.cache_gib,
        checkpoints={"checkpoints_path": str(ckpts), "checkpoint_interval": args.interval},
        run=f"crash{i}",
    )
    cmd = ["torchrun", "--nproc_per_node=1", os.environ["NANOTRON_RUN_TRAIN"], "--config-file", str(cfg)]
    with open(Path(args.out) / f"trial{i}_train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while not any(checkpoint.step_folders(ckpts)) and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        delay = rng.uniform(0.5, 6.0)
        time.sleep(delay)
        alive = proc.poll() is None
        # torchrun starts its workers in sessions of their own: kill the whole tree, workers first.
        tree = [*descendants(proc.pid), proc.pid]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        while any(running(pid) for pid in tree):  # a worker in the middle of a write dies when it returns
            time.sleep(0.05)
    out: dict[str, Any] = {"trial": i, "killed_after_first_checkpoint_s": delay, "alive_when_killed": alive}
    out["folders"] = [p.name for p in checkpoint.step_folders(ckpts)]
    out["temporaries"] = len(checkpoint.temporaries(ckpts))
    report = verify.verify(ckpts)
    out["latest"] = checkpoint.latest_step(ckpts)
    out["verify"] = {
        "ok": report.ok,
        "problems": report.problems,
        "files": report.files_checked,
        "tensors_checksummed": report.tensors_checksummed,
    }
    partial = []
    for p in ckpts.rglob("*.safetensors"):
        if not p.name.startswith("."):
            try:
                fmt.read_header(p)  # the header's sizes must match the file's
            except (OSError, ValueError) as e:
                partial.append(str(e))
    out["partial_files_at_final_paths"] = partial
    if out["latest"] is not None:
        ck = {
            "checkpoints_path": str(work / "ckpt_resume"),
            "checkpoint_interval": 1000,
            "resume_checkpoint_path": str(ckpts),
        }
        resume = write_config(
            work / "resume.yaml",
            engine="datastates",
            steps=out["latest"] + 2,
            cache_gib=args.cache_gib,
            run=f"resume{i}",
            checkpoints=ck,
        )
        cmd[-1] = str(resume)
        with open(Path(args.out) / f"trial{i}_resume.log", "w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
        text = (Path(args.out) / f"trial{i}_resume.log").read_text()
        out["resume"] = {"rc": rc, "resumed_by_engine": "[datastates] loaded" in text}
    shutil.rmtree(work, ignore_errors=True)  # 2 GB per checkpoint: the disk holds few trials' worth
    out["passed"] = bool(
        report.ok
        and out["latest"] is not None
        and not partial
        and out.get("resume", {}).get("rc") == 0
        and out["resume"]["resumed_by_engine"]
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--cache-gib", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/nanotron_crash")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        results.append(trial(i, args, rng))
        r = results[-1]
        print(
            f"trial {i}: killed {r['killed_after_first_checkpoint_s']:.1f} s after the first checkpoint; "
            f"folders {r['folders']}, latest {r['latest']}, {r['temporaries']} temporaries, verify "
            f"{'ok' if r['verify']['ok'] else r['verify']['problems']}, resume {r.get('resume')} -> "
            f"{'PASSED' if r['passed'] else 'FAILED'}",
            flush=True,
        )
        passed = sum(x["passed"] for x in results)
        summary = {"command": " ".join(sys.argv), "trials": results, "passed": passed}
        (Path(args.out) / "crash_trials.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
