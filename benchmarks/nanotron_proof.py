"""Proof on real Nanotron (GPU machine): train, checkpoint, resume, and read checkpoints across engines.

    python3 benchmarks/nanotron_proof.py all --gpus 1 --out DIR [--tp 1 --dp 1 --pp 1 --cp 1 --zero 0]

runs each phase below as its own `torchrun` (fresh processes, as a restart is) and writes DIR/summary.json:

1. `nanotron`: Nanotron's own run_train.py on examples/config_tiny_llama_datastates.yaml (the engine through
   the post-import hook);
2. `ds-train`: trains with the datastates engine and, at the reference step, also takes a synchronous copy of
   every tensor of the state (weights, optimizer with master weights, scheduler, random states, metadata);
3. `ds-resume`: a new run resumes from that checkpoint, compares the whole restored state with the copy, bit
   for bit, then trains on and checkpoints again;
4. `stock-load`: Nanotron without the adapter (NANOTRON_DATASTATES_AUTOLOAD=0, checkpointing_engine: torch)
   loads the datastates checkpoint's weights with its own load_weights, compares them, trains a few steps;
5. `stock-train` then `ds-from-stock`: Nanotron's own checkpoint, resumed with the datastates engine on
   (weights, optimizer and metadata compared), then trained on and checkpointed by the engine.

With `--cp 2` every run that resumes nothing starts from the weights of `init`, one step of Nanotron on one
GPU, through `resume_checkpoint_path` without the optimizer (Nanotron main starts no run with context
parallelism from random weights, and reads no `init_method.path` then); a checkpoint of one GPU holds what a
cp=2 run loads, since context-parallel ranks hold the same weights.

A phase (`python3 benchmarks/nanotron_proof.py phase --phase NAME ...`) runs under torchrun.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _nanotron import REPO, LossOnEveryStage, book_dummy_tokens, load_run_train, write_config

TRAIN_STEPS, INTERVAL, RESUME_STEPS = 6, 3, 9  # checkpoints at 3 and 6; the reference is taken at 6
# ds-train runs one step more: the engine queues a checkpoint's files at the next step (`queue_at_step`), so
# the reference checkpoint is queued after step 7's forward and backward passes, as in a long run.
DS_TRAIN_STEPS = TRAIN_STEPS + 1


# -- configs -----------------------------------------------------------------------------------------------


def make_config(
    args: argparse.Namespace,
    name: str,
    *,
    engine: str,
    steps: int,
    resume: str | None = None,
    load_optimizer: bool = True,
    interval: int = INTERVAL,
) -> Path:
    if args.cp > 1 and resume is None:
        # Nanotron main starts a run with context parallelism only from `resume_checkpoint_path` (its
        # `_load_model_checkpoint` refuses random weights and reads no `init_method.path` then): from the
        # weights of `init`, without its optimizer, schedule or step, a run that starts at step 1.
        resume, load_optimizer = str(args.work / "ckpt_init"), False
    checkpoints = {
        "checkpoints_path": str(args.work / f"ckpt_{name}"),
        "checkpoint_interval": interval,
        "resume_checkpoint_path": resume,
        "load_optimizer": load_optimizer,
        "load_lr_scheduler": load_optimizer,
    }
    parallelism = {"tp": args.tp, "dp": args.dp, "pp": args.pp}
    if args.cp > 1:  # Nanotron main only
        parallelism["context_parallel_size"] = args.cp
    path = args.work / f"{name}.yaml"
    return write_config(
        path,
        engine=engine,
        checkpoints=checkpoints,
        cache_gib=args.cache_gib,
        steps=steps,
        parallelism=parallelism,
        zero=args.zero,
        run=name,
        fp32_grads=not args.no_fp32_grads,
    )


# -- state capture and comparison (inside a phase) -------------------------------------------------------


def capture(trainer: Any, on_device: bool = False) -> dict[str, Any]:
    """The trainer's whole state, its tensors copied to the host (`on_device`: cloned where they are, a quick
    copy that leaves the host alone; `to_host` later)."""
    import torch

    from nanotron_datastates.nanotron import rng_states as states

    def host(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone() if on_device else x.detach().cpu().clone()
        if isinstance(x, dict):
            return {k: host(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(host(v) for v in x)
        return copy.deepcopy(x)

    return {
        "weights": host(dict(trainer.unwrapped_model.state_dict())),
        "optimizer": host(trainer.optimizer.state_dict()),
        "lr_scheduler": host(trainer.lr_scheduler.state_dict()),
        "random": {k: host(states.random_state_to_plain(v)) for k, v in trainer.random_states.items()},
        "global_rng": host(states.global_rng_state()),
        "metadata": dataclasses.asdict(trainer.metadata),
        "iteration_step": trainer.iteration_step,
    }


def to_host(x: Any) -> Any:
    """A captured state with its tensors on the host."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: to_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_host(v) for v in x)
    return x


def compare(a: Any, b: Any, path: str = "") -> tuple[int, list[str]]:
    """(tensors compared, differences) between two captured states, tensors bit for bit."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return 0, [f"{path}: tensor vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return 1, [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        same = torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
        return 1, [] if same else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return 0, [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} differ"]
        n, diffs = 0, []
        for k in a:
            m, d = compare(a[k], b[k], f"{path}.{k}")
            n, diffs = n + m, diffs + d
        return n, diffs
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return 0, [f"{path}: lengths {len(a)} vs {len(b)}"]
        n, diffs = 0, []
        for i, (x, y) in enumerate(zip(a, b)):
            m, d = compare(x, y, f"{path}[{i}]")
            n, diffs = n + m, diffs + d
        return n, diffs
    return 0, [] if a == b else [f"{path}: {a!r} vs {b!r}"]


# -- one phase, under torchrun -----------------------------------------------------------------------------


def run_phase(args: argparse.Namespace) -> None:
    import torch

    run_train = load_run_train()
    from nanotron.trainer import DistributedTrainer  # ours when the hook is on, Nanotron's when it is off

    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    result: dict[str, Any] = {"phase": args.phase, "rank": rank, "trainer": DistributedTrainer.__name__}

    class Trainer(LossOnEveryStage, DistributedTrainer):
        def save_checkpoint(self) -> Path:
            book_dummy_tokens(self.metadata)
            if args.reference_step and self.iteration_step == args.reference_step:
                torch.cuda.synchronize()
                torch.save(capture(self), Path(args.refs) / f"reference_{args.name}_rank{rank}.pt")
            return super().save_checkpoint()

    t0 = time.perf_counter()
    trainer = Trainer(args.config)
    result["init_s"] = time.perf_counter() - t0
    if args.compare:
        ref = torch.load(Path(args.refs) / f"reference_{args.compare}_rank{rank}.pt", weights_only=False)
        now = capture(trainer)
        result["compared"] = {}
        for part in args.parts.split(","):  # a key of the captured state, or a dotted path into it
            a, b = ref, now
            for key in part.split("."):
                a, b = a[key], b[key]
            n, diffs = compare(a, b, part)
            result["compared"][part] = {"tensors": n, "differences": len(diffs), "first": diffs[:10]}
    t0 = time.perf_counter()
    trainer.train(run_train.get_dataloader(trainer))
    result["train_s"] = time.perf_counter() - t0
    result["last_step"] = trainer.iteration_step
    (out / f"{args.name}_rank{rank}.json").write_text(json.dumps(result, indent=1))


# -- all phases --------------------------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ds_ckpt, stock_ckpt = args.work / "ckpt_ds-train", args.work / "ckpt_stock-train"
    everything = "weights,optimizer,lr_scheduler,random,global_rng,metadata,iteration_step"
    stock = {"NANOTRON_DATASTATES_AUTOLOAD": "0"}  # Nanotron without the adapter

    def cfg(name: str, engine: str, steps: int, **kw: Any) -> Path:
        return make_config(args, name, engine=engine, steps=steps, **kw)

    # (name, config, environment, reference step, compared with the reference of, parts compared)
    phases = [
        ("ds-train", cfg("ds-train", "datastates", DS_TRAIN_STEPS), {}, TRAIN_STEPS, None, ""),
        (
            "ds-resume",
            cfg("ds-resume", "datastates", RESUME_STEPS, resume=str(ds_ckpt)),
            {},
            0,
            "ds-train",
            everything,
        ),
        (
            "stock-load",
            cfg("stock-load", "torch", 2, resume=str(ds_ckpt), load_optimizer=False, interval=100),
            stock,
            0,
            "ds-train",
            "weights",
        ),
        ("stock-train", cfg("stock-train", "torch", TRAIN_STEPS), stock, TRAIN_STEPS, None, ""),
        # Nanotron's own loaders resume its checkpoints; they step the LR schedule once more on resume
        # (`_initial_step()`), so the param groups' learning rates differ by design and are left out here.
        (
            "ds-from-stock",
            cfg("ds-from-stock", "datastates", RESUME_STEPS, resume=str(stock_ckpt)),
            {},
            0,
            "stock-train",
            "weights,optimizer.state,optimizer.gradient_accumulator,optimizer.names,metadata"
            if not args.no_fp32_grads
            else "weights,optimizer.state,optimizer.names,metadata",
        ),
    ]
    summary: dict[str, Any] = {"command": " ".join(sys.argv), "gpus": args.gpus, "phases": {}}
    if args.cp > 1:  # the weights the runs start from: one step of Nanotron on one GPU, its own checkpoint
        one = argparse.Namespace(**{**vars(args), "tp": 1, "dp": 1, "pp": 1, "cp": 1, "zero": 0})
        config = make_config(one, "init", engine="torch", steps=1, interval=1)
        cmd = ["torchrun", "--nproc_per_node=1", os.environ["NANOTRON_RUN_TRAIN"]]
        cmd += ["--config-file", str(config)]
        summary["phases"]["init"] = launch(cmd, stock, out / "init.log")
    if args.with_run_train:
        config = cfg("nanotron", "datastates", TRAIN_STEPS)
        cmd = ["torchrun", f"--nproc_per_node={args.gpus}", os.environ["NANOTRON_RUN_TRAIN"]]
        cmd += ["--config-file", str(config)]
        summary["phases"]["nanotron"] = launch(cmd, {}, out / "nanotron.log")
        latest = args.work / "ckpt_nanotron" / "latest.txt"
        summary["phases"]["nanotron"]["latest"] = latest.read_text().strip() if latest.exists() else None
    wanted = set(args.phases.split(",")) if args.phases else None
    phases = [p for p in phases if wanted is None or p[0] in wanted]
    for name, config, env, ref_step, compare_with, parts in phases:
        cmd = [
            "torchrun",
            f"--nproc_per_node={args.gpus}",
            __file__,
            "phase",
            "--phase",
            name,
            "--name",
            name,
        ]
        cmd += ["--config", str(config), "--out", str(out), "--refs", str(args.work)]
        cmd += ["--reference-step", str(ref_step), "--parts", parts]
        if compare_with:
            cmd += ["--compare", compare_with]
        info = launch(cmd, env, out / f"{name}.log")
        info["ranks"] = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}_rank*.json"))]
        summary["phases"][name] = info
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    ok = True
    for name, info in summary["phases"].items():
        diffs = sum(c["differences"] for r in info.get("ranks", []) for c in r.get("compared", {}).values())
        tensors = sum(c["tensors"] for r in info.get("ranks", []) for c in r.get("compared", {}).values())
        good = info["rc"] == 0 and diffs == 0
        ok &= good
        verdict = "OK" if good else "FAILED"
        rc, seconds = info["rc"], info["seconds"]
        print(f"{name:14s} rc={rc} {seconds:6.1f} s  {tensors} tensors compared, {diffs} differ  {verdict}")
    return 0 if ok else 1


def launch(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(
            cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        ).returncode
    return {"cmd": " ".join(cmd), "env": env, "rc": rc, "seconds": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("all")
    a.add_argument("--gpus", type=int, default=1)
    a.add_argument("--out", required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/nanotron_proof"))
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--dp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--cp", type=int, default=1, help="context parallelism (Nanotron main)")
    a.add_argument("--zero", type=int, default=0)
    a.add_argument("--cache-gib", type=float, default=4.0)
    a.add_argument("--no-fp32-grads", action="store_true", help="accumulate_grad_in_fp32: false")
    a.add_argument("--with-run-train", action="store_true", help="also run Nanotron's run_train.py first")
    a.add_argument("--phases", default="", help="comma-separated subset (default: all)")
    ph = sub.add_parser("phase")
    for flag in ("--phase", "--name", "--config", "--out", "--refs"):
        ph.add_argument(flag, required=True)
    ph.add_argument("--reference-step", type=int, default=0)
    ph.add_argument("--compare", default="")
    ph.add_argument("--parts", default="")
    args = p.parse_args()
    if args.what == "phase":
        run_phase(args)
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
