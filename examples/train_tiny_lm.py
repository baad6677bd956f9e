"""Train a tiny language model with asynchronous checkpoints, then prove that resuming from one is exact.

What this shows:

* **The overlap pattern.** ``engine.save(state, path)`` is called right after ``optimizer.step()`` and returns
  at once; the next forward and backward run while the engine copies the tensors in background threads;
  ``handle.wait_snapshot()`` is called right before the next ``optimizer.step()``, the first moment the saved
  tensors are modified. The training loop only stalls for the time spent inside those two calls, which is
  printed per checkpoint next to what ``torch.save`` + ``fsync`` of the same state costs.
* **Exact resume.** The state holds the model, AdamW, the LR scheduler, the step, the data sampler's generator
  and the global RNG (dropout). After training, this script relaunches itself in a new process
  (``--phase resume``) that builds everything fresh, loads the checkpoint at ``--resume-at`` (by default the
  last one at or before two thirds of the run, so that there are steps left to compare) and trains to the end.
  The parent then checks that every loss after the resume point is bit-for-bit the one of the first run, and
  that both runs' final checkpoints hold identical tensors; it exits with status 1 if not.

Run from the repository root, once the package is installed (``bash .ci/install``)::

    python3 examples/train_tiny_lm.py            # 300 steps, a checkpoint every 50, into out/tiny_lm/
    python3 examples/train_tiny_lm.py --steps 100 --ckpt-every 25 --out /tmp/tiny_lm

Writes, under ``--out``: ``ckpt/step_000050.safetensors``, ... (one file per checkpoint) with
``ckpt/datastates_telemetry.jsonl`` (one line per checkpoint: ``nanotron-datastates plot`` draws it), the
resumed run's checkpoints in ``resume/``, and both runs' losses as JSON.

The data is synthetic but learnable: each sequence is drawn from one of a few fixed sparse bigram "languages",
so the model must learn the tables and infer from the context which one it is reading.

Beside this file: ``tiny_lm.py`` (the model, the data and the training state) and ``tiny_lm_checks.py`` (the
timing of each checkpoint, the comparisons of the two runs and the summary).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine

# The model and the checks live beside this file: importable however the script is launched.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_lm import (
    ModelConfig,
    Trainer,
    build_trainer,
    capture_state,
    entropy_floor,
    restore_state,
    train_step,
)
from tiny_lm_checks import (
    CheckpointRecord,
    Pending,
    checkpoint_path,
    clear_outputs,
    compare_losses,
    default_resume_step,
    finish_checkpoint,
    print_summary,
    read_losses,
    same_state,
    write_losses,
)

# -- the loop ---------------------------------------------------------------------------------------------


def train(
    tr: Trainer, engine: DataStatesEngine, first_step: int, last_step: int, ckpt_every: int, ckpt_dir: Path
) -> tuple[dict[int, float], list[CheckpointRecord]]:
    """Runs steps first_step..last_step; returns the loss of each step and one record per checkpoint."""
    losses: dict[int, float] = {}
    records: list[CheckpointRecord] = []
    pending: Pending | None = None
    for step in range(first_step, last_step + 1):
        loss = train_step(tr)  # overlaps the copy of the checkpoint saved after the previous step
        if pending is not None:  # optimizer.step() below mutates the saved tensors
            records.append(finish_checkpoint(pending, ckpt_dir))
            pending = None
        tr.optimizer.step()
        tr.scheduler.step()
        losses[step] = loss.item()
        if step % 25 == 0 or step == first_step:
            print(f"step {step:4d}  loss {losses[step]:.4f}  lr {tr.scheduler.get_last_lr()[0]:.2e}")
        if step % ckpt_every == 0 or step == last_step:  # the final state is saved too, as a real job would
            state = capture_state(tr, step)
            t0 = time.perf_counter()
            handle = engine.save(state, checkpoint_path(ckpt_dir, step))
            pending = Pending(handle, state, step, (time.perf_counter() - t0) * 1e3)
    if pending is not None:  # the last checkpoint has no next step to overlap with
        records.append(finish_checkpoint(pending, ckpt_dir))
    return losses, records


# -- phases -----------------------------------------------------------------------------------------------


def make_engine(args: argparse.Namespace, telemetry: Path | None = None) -> DataStatesEngine:
    """The engine; with `telemetry`, a JSON line per checkpoint there (`nanotron-datastates plot`)."""
    config = DataStatesConfig(
        host_cache_size=args.host_cache_gib, parser_threads=2, telemetry_path=str(telemetry or "")
    )
    return DataStatesEngine(config)


def run_resume_phase(args: argparse.Namespace, cfg: ModelConfig) -> None:
    """Child process: fresh trainer, load the checkpoint, train to the end, write the losses."""
    tr = build_trainer(args, cfg)
    out = Path(args.out)
    ckpt_dir = out / "resume"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with make_engine(args) as engine:
        t0 = time.perf_counter()
        step = restore_state(tr, engine.load(args.resume_from))
        print(f"loaded {args.resume_from} (step {step}) in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        losses, _ = train(tr, engine, step + 1, args.steps, args.ckpt_every, ckpt_dir)
    write_losses(out / "resume_losses.json", losses)


def launch_resume(args: argparse.Namespace, resume_from: Path) -> None:
    """Runs the resume phase in a new process (nothing carried over in memory), echoing its output."""
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", "resume", "--resume-from", str(resume_from)]
    for flag in ("steps", "ckpt_every", "out", "host_cache_gib", "threads", "batch", "seed"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    print(f"\nrelaunching in a new process: resume from {resume_from}")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            print(f"  [resume] {line}", end="")
    if child.returncode != 0:
        raise SystemExit(f"the resume process failed with status {child.returncode}")


def compare_final_checkpoints(args: argparse.Namespace, out: Path) -> bool:
    with make_engine(args) as engine:
        first = engine.load(checkpoint_path(out / "ckpt", args.steps))
        resumed = engine.load(checkpoint_path(out / "resume", args.steps))
    ok = same_state(first, resumed)
    print(f"final checkpoints of both runs at step {args.steps}: {'identical' if ok else 'DIFFERENT'}")
    return ok


def run_train_phase(args: argparse.Namespace, cfg: ModelConfig, out: Path) -> list[CheckpointRecord]:
    """The first run: trains from scratch, checkpointing as it goes, and writes its losses."""
    t0 = time.perf_counter()
    tr = build_trainer(args, cfg)
    n_params = sum(p.numel() for p in tr.model.parameters()) / 1e6
    start, floor = math.log(cfg.vocab), entropy_floor(tr.tables)
    print(f"{n_params:.2f} M parameters; loss starts near {start:.2f}, entropy floor {floor:.2f}")
    with make_engine(args, out / "ckpt" / "datastates_telemetry.jsonl") as engine:
        losses, records = train(tr, engine, 1, args.steps, args.ckpt_every, out / "ckpt")
    write_losses(out / "train_losses.json", losses)
    print(f"training: {time.perf_counter() - t0:.1f} s")
    return records


def run_all(args: argparse.Namespace, cfg: ModelConfig) -> int:
    """Train, resume in a new process, compare; 0 if the resumed run is bit-for-bit the first one."""
    out = Path(args.out)
    resume_step = args.resume_at
    if resume_step is None:
        resume_step = default_resume_step(args.steps, args.ckpt_every)
    if resume_step % args.ckpt_every or not 0 < resume_step < args.steps:
        raise SystemExit(f"--resume-at {resume_step}: no checkpoint is saved there before the end")
    clear_outputs(out)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    print(f"model {asdict(cfg)}, batch {args.batch}, {args.steps} steps, torch threads {args.threads}")

    records = run_train_phase(args, cfg, out)
    launch_resume(args, checkpoint_path(out / "ckpt", resume_step))
    first, resumed = read_losses(out / "train_losses.json"), read_losses(out / "resume_losses.json")
    ok = compare_losses(first, resumed, resume_step)
    ok = compare_final_checkpoints(args, out) and ok
    print_summary(records)
    return 0 if ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument(
        "--ckpt-every", type=int, default=50, help="steps between checkpoints (default %(default)s)"
    )
    p.add_argument(
        "--out",
        default="out/tiny_lm",
        help="output folder; earlier outputs there are removed (default %(default)s)",
    )
    p.add_argument(
        "--host-cache-gib", type=float, default=0.5, help="the engine's host cache, GiB (default %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads, the same in both processes (default %(default)s)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the model, data and dropout (default %(default)s)"
    )
    p.add_argument(
        "--resume-at",
        type=int,
        default=None,
        help="the checkpoint step to resume from (default: the last at or before two thirds of the run)",
    )
    p.add_argument("--phase", choices=("all", "resume"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows live, also through the parent's pipe
    torch.set_num_threads(args.threads)  # reductions split by thread count: keep it fixed for bitwise results
    cfg = ModelConfig()
    if args.phase == "resume":
        run_resume_phase(args, cfg)
        return 0
    return run_all(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
