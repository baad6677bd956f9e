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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _nanotron import REPO, LossOnEveryStage, book_dummy_tokens, load_run_train, write_config
from bench_nanotron import make_cold

SAVE_AT, STEPS = 6, 9
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
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq", "step")


# -- inside a run ------------------------------------------------------------------------------------------


def parts_of(trainer: Any) -> dict[str, Any]:
    """This rank's part of the state: each tensor with the place it takes in the full one."""
    import torch
    import torch.distributed as dist

    model, optimizer = trainer.unwrapped_model, trainer.optimizer
    where: dict[str, Any] = {}  # name -> (full shape, this rank's shape, [(local slices, global slices)])
    parts: list[tuple[str, str, Any, Any]] = []  # (kind, name, tensor, ZeRO flat range or None)
    for name, p in model.get_named_params_with_correct_tied():
        pairs = None
        full = tuple(p.shape)
        if p.is_sharded:
            info = p.get_sharded_info()
            full = tuple(info.unsharded_shape)
            pairs = [(x.local_slices, x.global_slices) for x in info.local_global_slices_pairs]
        where[name] = (full, tuple(p.shape), pairs)
        parts.append(("weight", name, p.detach().cpu().clone(), None))
    zero, opt = None, optimizer
    while opt is not None and zero is None:  # Nanotron's optimizers wrap one another
        zero = getattr(opt, "param_name_to_dp_rank_offsets", None)
        opt = getattr(opt, "optimizer", None)
    dp_rank = dist.get_rank(trainer.parallel_context.dp_pg)

    def flat_range(name: str, t: Any) -> Any:
        if zero is None or t.numel() == torch.Size(where[name][1]).numel():
            return None
        start, end = zero[name][dp_rank]
        return (int(start), int(end))

    sd = optimizer.state_dict()
    for idx, st in sd["state"].items():
        name = sd["names"][idx]
        for kind in ("exp_avg", "exp_avg_sq"):
            parts.append((kind, name, st[kind].detach().cpu().clone(), flat_range(name, st[kind])))
        parts.append(("step", name, torch.as_tensor(st["step"]).detach().cpu().clone(), None))
    for name, t in sd.get("gradient_accumulator", {}).items():
        # With ZeRO-1, Nanotron keeps the fp32 masters of this rank's ranges only (2cde8f6); were a whole one
        # kept, the range this rank's optimizer updates is the one that counts.
        rng = None
        if zero is not None:
            if dp_rank not in zero[name]:
                continue
            rng = tuple(int(x) for x in zero[name][dp_rank])
            if t.numel() != rng[1] - rng[0]:
                t = t.reshape(-1)[rng[0] : rng[1]]
        parts.append(("master", name, t.detach().cpu().clone(), rng))
    return {
        "where": where,
        "parts": parts,
        "lr_scheduler": schedule(trainer.lr_scheduler.state_dict()),
        "lrs": sorted({g["lr"] for g in optimizer.param_groups}),
        "iteration_step": trainer.iteration_step,
        "metadata": dataclasses.asdict(trainer.metadata),
    }


def schedule(sd: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's state without its per-group lists, whose length follows the parameters a rank holds
    (pipeline stages hold different ones): the step and the distinct rates."""
    lists = {k: sorted(set(v)) for k, v in sd.items() if isinstance(v, list) and k != "lr_lambdas"}
    return {**{k: v for k, v in sd.items() if not isinstance(v, list)}, **lists}


def sample_rows(
    k: int, start: int, micro: int, acc: int, dp: tuple[int, int], cp: tuple[int, int], salt: int, shape: Any,
    vocab: int, dtype: Any,
) -> Any:  # fmt: skip
    """The `micro` rows of `shape` (a rank's part of a sequence) that the rank at data-parallel place `dp` and
    context-parallel place `cp` (rank, size) trains on in its k-th micro-batch of a run whose first step
    follows `start` samples (micro-batches of `micro` sequences, `acc` of them a step); salt 0: inputs, 1:
    labels. Each sequence is drawn whole from its index in the run alone. Context-parallel ranks are replicas
    for the samples, like data-parallel ones without ZeRO for the state: those of one data-parallel rank take
    the same samples, each its own slice of every sequence (`shape` is the slice: the sequence is `cp[1]`
    times as long), as Nanotron main's dummy data slices them (data/dataloader.py), so that put together
    they are the sequences a layout without context parallelism trains on."""
    import torch

    step, j = divmod(k, acc)
    first = start + step * dp[1] * micro * acc + (j * dp[1] + dp[0]) * micro
    *lead, length = tuple(shape)
    whole = (*lead, length * cp[1])
    rows = torch.stack([
        torch.randint(0, vocab, whole, dtype=dtype,
                      generator=torch.Generator().manual_seed(2 * (first + i) + salt))
        for i in range(micro)
    ])  # fmt: skip
    return rows[..., cp[0] * length : (cp[0] + 1) * length].contiguous()


def by_sample(trainer: Any, dataloaders: dict[str, Any]) -> dict[str, Any]:
    """Nanotron's dummy data with each sequence drawn from its index in the run (`sample_rows`), so that a
    resumed run, on any layout, trains on the samples that the uninterrupted one does at the same steps
    (Nanotron's dummy stream starts over at each launch and follows the dp and pp ranks). The first stage's
    stream keeps Nanotron's batches for their keys and placement (tensors or TensorPointers)."""
    import torch
    import torch.distributed as dist

    from nanotron_datastates.nanotron import groups

    pc = trainer.parallel_context
    dp = (dist.get_rank(pc.dp_pg), pc.dp_pg.size())
    cp = (groups.cp_rank(pc), groups.cp_size(pc))
    m, acc = trainer.micro_batch_size, trainer.n_micro_batches_per_batch
    start = trainer.metadata.consumed_train_samples
    vocab = trainer.model_config.vocab_size

    def stream(inner: Any) -> Any:
        for k, batch in enumerate(inner):
            batch = dict(batch)
            for salt, key in enumerate(("input_ids", "label_ids")):
                t = batch[key]
                if isinstance(t, torch.Tensor):
                    rows = sample_rows(k, start, m, acc, dp, cp, salt, t.shape[1:], vocab, t.dtype)
                    batch[key] = rows.to(t.device)
            yield batch

    first_stage = next(iter(dataloaders))
    return {k: stream(v) if k == first_stage else v for k, v in dataloaders.items()}


def run_phase(args: argparse.Namespace) -> None:
    import torch

    from nanotron_datastates.nanotron.resume import resume
    from nanotron_datastates.nanotron.resume.resume import Resume

    if args.no_warm:  # the comparison: a reshard without its files read into the page cache ahead
        resume.warm_for_reshard = lambda *a, **k: None

    run_train = load_run_train()
    from nanotron.trainer import DistributedTrainer

    rank = int(os.environ.get("RANK", "0"))
    work = Path(args.work)
    rec: dict[str, Any] = {"name": args.name, "rank": rank, "losses": {}, "restore_s": 0.0}
    # The adapter's restore on the training's path: reading and placing the state, the ranks' agreement,
    # and the wait, before the first optimizer step, for what was read ahead.
    for method in ("load_weights", "load_rest", "confirm", "before_step"):
        original = getattr(Resume, method)

        def timed(self: Any, *a: Any, _original: Any = original, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                rec["restore_s"] += time.perf_counter() - t

        setattr(Resume, method, timed)

    def dump(trainer: Any) -> None:
        torch.cuda.synchronize()
        torch.save(parts_of(trainer), work / f"parts_{args.name}_rank{rank}.pt")

    class Trainer(LossOnEveryStage, DistributedTrainer):
        def save_checkpoint(self) -> Path:
            book_dummy_tokens(self.metadata)
            if args.name.startswith("save-") and self.iteration_step == SAVE_AT:
                dump(self)
            return super().save_checkpoint()

        def training_step(self, dataloader: Any) -> Any:
            out = super().training_step(dataloader)  # (outputs, loss, ...): main adds two more
            if out[1] is not None:
                rec["losses"][self.iteration_step] = float(out[1])
            if "first_step_s" not in rec:
                torch.cuda.synchronize()
                rec["first_step_s"] = time.perf_counter() - t0 - rec.get("dump_s", 0.0)
            return out

    t0 = time.perf_counter()
    trainer = Trainer(args.config)
    rec["init_s"] = time.perf_counter() - t0
    if not args.name.startswith("save-"):
        t = time.perf_counter()
        dump(trainer)
        rec["dump_s"] = time.perf_counter() - t  # left out of the time to the first step
    trainer.train(by_sample(trainer, run_train.get_dataloader(trainer)))
    rec["last_step"] = trainer.iteration_step
    (work / f"record_{args.name}_rank{rank}.json").write_text(json.dumps(rec))


# -- the driver --------------------------------------------------------------------------------------------


def assemble(name: str, work: Path) -> dict[str, Any]:
    """The full tensors of run `name` from every rank's parts, and which elements no rank held."""
    import torch

    ranks = [torch.load(p, weights_only=False) for p in sorted(work.glob(f"parts_{name}_rank*.pt"))]
    # First each tensor-parallel piece from its ZeRO ranges, then the full tensor from its pieces.
    pieces: dict[tuple[str, str, str], Any] = {}  # (kind, name, tp place) -> (piece, filled, place)
    steps: dict[str, Any] = {}
    wrong: list[str] = []
    for r in ranks:
        for kind, pname, t, rng in r["parts"]:
            full_shape, shape, pairs = r["where"][pname]
            if kind == "step":
                steps[pname] = t
                continue
            key = (kind, pname, repr(pairs))
            if key not in pieces:
                blank = torch.zeros(shape, dtype=t.dtype), torch.zeros(shape, dtype=torch.bool)
                pieces[key] = (*blank, full_shape, pairs)
            piece, filled, _, _ = pieces[key]
            size = piece.numel() if rng is None else rng[1] - rng[0]
            if t.numel() != size:
                wrong.append(f"{kind} {pname}: {t.numel()} elements for a place of {size}")
                continue
            if rng is None:
                piece.copy_(t.reshape(shape))
                filled.fill_(True)
            else:
                piece.view(-1)[rng[0] : rng[1]] = t.reshape(-1)
                filled.view(-1)[rng[0] : rng[1]] = True
    full: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    held: dict[tuple[str, str], Any] = {}
    for (kind, pname, _), (piece, filled, full_shape, pairs) in pieces.items():
        if pname not in full[kind]:
            full[kind][pname] = torch.zeros(full_shape, dtype=piece.dtype)
            held[kind, pname] = torch.zeros(full_shape, dtype=torch.bool)
        for local_slices, global_slices in pairs or [(..., ...)]:
            full[kind][pname][global_slices] = piece[local_slices]
            held[kind, pname][global_slices] = filled[local_slices]
    full["step"] = steps
    holes = [f"{k} {n}: {int((~h).sum())} elements held by no rank" for (k, n), h in held.items()]
    holes = wrong + [h for h, (_, m) in zip(holes, held.items()) if not m.all()]
    head = ranks[0]
    return {
        "tensors": full,
        "holes": holes,
        "lr_scheduler": head["lr_scheduler"],
        "lrs": head["lrs"],
        "iteration_step": head["iteration_step"],
        "metadata": head["metadata"],
    }


def compare_states(saved: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for kind in KINDS:
        a, b = saved["tensors"][kind], resumed["tensors"][kind]
        diffs = [f"{kind} {n}: missing" for n in sorted(set(a) ^ set(b))]
        for n in sorted(set(a) & set(b)):
            x, y = a[n], b[n]
            same = x.dtype == y.dtype and x.shape == y.shape
            same = same and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            if not same:
                diffs.append(f"{kind} {n}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)} differ")
        elements = sum(t.numel() for t in a.values())
        out[kind] = {"tensors": len(a), "elements": elements, "differences": len(diffs), "first": diffs[:5]}
    for key in ("lr_scheduler", "lrs", "iteration_step", "metadata"):
        a, b = repr(saved[key]), repr(resumed[key])
        out[key] = {"equal": a == b, **({} if a == b else {"saved": a, "resumed": b})}
    out["holes"] = saved["holes"] + resumed["holes"]
    return out


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
