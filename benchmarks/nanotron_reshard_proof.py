"""Resume on another parallel layout, on real Nanotron (GPU machine, two GPUs): every element compared.

    python3 benchmarks/nanotron_reshard_proof.py all --out DIR [--work DIR] [--cases a-to-b,...]

Layouts: `single` (1 GPU), `tp2`, `dp2-zero1`, `pp2` (2 GPUs), and with `--cases 4gpu` `dp4-zero1`,
`tp2-dp2`, `pp2-dp2` (4 GPUs); the global batch is 8 sequences on each
(micro-batches accumulated where dp is 1), so that the runs see the same number of samples per step. Each
run is its own `torchrun` of Nanotron's trainer with the datastates engine (the example's 180M Llama):

1. `save-<L>` trains on L to step 9 with a checkpoint at step 6; at that step every rank also writes its
   part of the state (parameters, Adam moments and step counts, fp32 master weights, each with where it sits
   in the full tensor: tensor-parallel slices, ZeRO-1 flat ranges), the scheduler, the step and the training
   metadata; it records the losses of steps 7 to 9: the uninterrupted run.
2. `<L>-to-<M>` resumes L's checkpoint 6 on layout M, writes its parts the same way before its first step,
   trains steps 7 to 9 and records their losses.

Every run trains on the same samples at the same steps, whatever its layout (`by_sample`).

The driver assembles the full tensors from each run's parts (on the CPU, from Nanotron's own sharding
metadata and ZeRO offsets, not from the engine's files) and compares each resumed state with the saved one,
bit for bit. A resume is timed two ways, its files evicted from the page cache first: the adapter's
restore on the training's path (reading and placing the state, the ranks' agreement, the wait for what was
read ahead), and the time from the trainer's construction to the end of its first step.
`dp2-zero1-to-dp2-zero1` is the same-layout resume of the checkpoint that `dp2-zero1-to-tp2` and
`dp2-zero1-to-single` reshard. Writes DIR/summary.json.

On one GPU, `single-to-single-zero1` reshards (the ZeRO stage changes); a case ending in `-nowarm` runs
without the page-cache read-ahead of a reshard, for comparison.

Nanotron main cannot train ZeRO-1 with fp32 gradient accumulation on more than one dp rank (its DDP hook
raises NotImplementedError): there, `--no-fp32-grads` (no fp32 master weights to compare).

This file is the command line and the runs of the cases (`config`, `launch`, `run_all`); each rank's run is
`_reshard_phase.py`, the states put together and compared `_reshard_compare.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _bench_checkpoints import make_cold
from _nanotron import REPO, write_config
from _reshard_compare import KINDS, assemble, compare_states
from _reshard_phase import SAVE_AT, STEPS, run_phase

# name: (GPUs, parallelism, ZeRO stage, micro-batches accumulated per replica)
LAYOUTS = {
    "single": (1, {"tp": 1, "dp": 1, "pp": 1}, 0, 2),
    "tp2": (2, {"tp": 2, "dp": 1, "pp": 1}, 0, 2),
    "dp2-zero1": (2, {"tp": 1, "dp": 2, "pp": 1}, 1, 1),
    "pp2": (2, {"tp": 1, "dp": 1, "pp": 2}, 0, 2),
    "single-zero1": (1, {"tp": 1, "dp": 1, "pp": 1}, 1, 2),  # another layout on one GPU: the ZeRO stage
    # Four GPUs (`--cases` names them): 8 sequences a step too, dp4 in micro-batches of 2 (MICRO_BATCH)
    "dp4-zero1": (4, {"tp": 1, "dp": 4, "pp": 1}, 1, 1),
    "tp2-dp2": (4, {"tp": 2, "dp": 2, "pp": 1}, 0, 1),
    "pp2-dp2": (4, {"tp": 1, "dp": 2, "pp": 2}, 0, 1),
}
MICRO_BATCH = {"dp4-zero1": 2}  # sequences per micro-batch where not the example's 4
CASES_4GPU = [
    "dp4-zero1-to-tp2-dp2",
    "tp2-dp2-to-pp2-dp2",
    "pp2-dp2-to-single",
    "single-to-dp4-zero1",
    "tp2-dp2-to-dp4-zero1",
]
CASES = [
    "dp2-zero1-to-dp2-zero1",  # the same layout: the restore time the others are measured against
    "dp2-zero1-to-tp2",
    "dp2-zero1-to-single",
    "tp2-to-single",
    "pp2-to-single",
    "single-to-tp2",
    "single-to-dp2-zero1",
    "single-to-pp2",
]


def config(args: argparse.Namespace, name: str, layout: str, resume: Path | None) -> Path:
    _, parallelism, zero, accumulate = LAYOUTS[layout]
    tokens = {"batch_accumulation_per_replica": accumulate, "micro_batch_size": MICRO_BATCH.get(layout, 4)}
    checkpoints = {
        "checkpoints_path": str(args.work / f"ckpt_{name}"),
        "checkpoint_interval": SAVE_AT,
        "resume_checkpoint_path": str(resume) if resume else None,
    }
    return write_config(args.work / f"{name}.yaml", engine="datastates", checkpoints=checkpoints,
                        cache_gib=args.cache_gib, steps=STEPS, parallelism=parallelism, zero=zero, run=name,
                        tokens=tokens,
                        fp32_grads=not args.no_fp32_grads)  # fmt: skip


def launch(args: argparse.Namespace, name: str, layout: str, cfg: Path, warm: bool = True) -> dict[str, Any]:
    gpus = LAYOUTS[layout][0]
    cmd = ["torchrun", f"--nproc_per_node={gpus}", __file__, "phase", "--name", name]
    cmd += ["--config", str(cfg), "--work", str(args.work)] + ([] if warm else ["--no-warm"])
    t0 = time.perf_counter()
    with open(Path(args.out) / f"{name}.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    recs = [json.loads(p.read_text()) for p in sorted(args.work.glob(f"record_{name}_rank*.json"))]
    losses: dict[str, float] = {}
    for r in recs:
        losses.update(r["losses"])
    return {
        "rc": rc,
        "seconds": time.perf_counter() - t0,
        "layout": layout,
        "init_s": max((r["init_s"] for r in recs), default=None),
        "first_step_s": max((r.get("first_step_s", 0.0) for r in recs), default=None),
        "restore_s": max((r["restore_s"] for r in recs), default=None),
        "losses": {k: losses[k] for k in sorted(losses, key=int)},
    }


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    cases = CASES_4GPU if args.cases == "4gpu" else args.cases.split(",") if args.cases else CASES
    summary: dict[str, Any] = {"command": " ".join(sys.argv), "save_at": SAVE_AT, "steps": STEPS,
                               "fp32_grads": not args.no_fp32_grads, "layouts": LAYOUTS, "saves": {},
                               "cases": {}}  # fmt: skip
    saved: dict[str, Any] = {}
    ok = True
    for case in cases:
        src, dst = case.split("-to-")
        warm = not dst.endswith("-nowarm")  # `-nowarm`: without reading the files into the page cache ahead
        dst = dst.removesuffix("-nowarm")
        if src not in summary["saves"]:
            info = launch(args, f"save-{src}", src, config(args, f"save-{src}", src, None))
            summary["saves"][src] = info
            if info["rc"] == 0 and any(args.work.glob(f"parts_save-{src}_rank*.pt")):
                saved[src] = assemble(f"save-{src}", args.work)
            ok &= info["rc"] == 0
            print(f"save-{src:24s} rc={info['rc']} {info['seconds']:6.1f} s", flush=True)
        if src not in saved:  # its save failed (its log says why): the cases from it are not run
            summary["cases"][case] = {"rc": None, "skipped": f"save-{src} failed"}
            print(f"{case:30s} skipped: save-{src} failed", flush=True)
            ok = False
            continue
        folder = args.work / f"ckpt_save-{src}" / str(SAVE_AT)
        cold = make_cold(folder, "checkpoint")
        info = launch(args, case, dst, config(args, case, dst, folder), warm)
        info["cold"] = cold
        resumed = assemble(case, args.work)
        info["compared"] = compared = compare_states(saved[src], resumed)
        info["uninterrupted_losses"] = {src: summary["saves"][src]["losses"]}
        if dst in summary["saves"]:
            info["uninterrupted_losses"][dst] = summary["saves"][dst]["losses"]
        for p in args.work.glob(f"parts_{case}_rank*.pt"):
            p.unlink()
        shutil.rmtree(args.work / f"ckpt_{case}", ignore_errors=True)
        diffs = sum(c["differences"] for k, c in compared.items() if k in KINDS)
        equal = all(compared[k]["equal"] for k in ("lr_scheduler", "lrs", "iteration_step", "metadata"))
        good = info["rc"] == 0 and diffs == 0 and equal and not compared["holes"]
        ok &= good
        summary["cases"][case] = info
        tensors = sum(c["tensors"] for k, c in compared.items() if k in KINDS)
        restore = info["restore_s"] or 0.0
        first = info["first_step_s"] or 0.0
        print(f"{case:30s} rc={info['rc']} {info['seconds']:6.1f} s  restore {restore:.2f} s  "
              f"first step {first:.2f} s  "
              f"{tensors} tensors compared, {diffs} differ, schedule/step/metadata "
              f"{'equal' if equal else 'DIFFER'}  {'OK' if good else 'FAILED'}", flush=True)  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for key in ("restore_s", "first_step_s"):  # each resume against the same-layout one of its checkpoint
        ratios = {}
        for src in summary["saves"]:
            same = summary["cases"].get(f"{src}-to-{src}", {}).get(key)
            for c, i in summary["cases"].items():
                if same and c.startswith(f"{src}-to-") and i.get(key):
                    ratios[c] = i[key] / same
        if ratios:
            summary[f"{key}_over_same_layout"] = ratios
            print(f"{key} over the same-layout resume:", json.dumps(ratios))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("all")
    a.add_argument("--out", required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/nanotron_reshard"))
    a.add_argument("--cache-gib", type=float, default=4.0)
    a.add_argument("--no-fp32-grads", action="store_true", help="accumulate_grad_in_fp32: false")
    a.add_argument(
        "--cases",
        default="",
        help=f"comma-separated, or 4gpu: {','.join(CASES_4GPU)} (default: {','.join(CASES)})",
    )
    ph = sub.add_parser("phase")
    for flag in ("--name", "--config", "--work"):
        ph.add_argument(flag, required=True)
    ph.add_argument("--no-warm", action="store_true")
    args = p.parse_args()
    return run_all(args) if args.what == "all" else (run_phase(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
