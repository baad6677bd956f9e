"""One run of nanotron_reshard_proof.py, as each rank of its torchrun runs it (its `phase`): Nanotron's
trainer on the samples every layout shares (`by_sample`, `sample_rows`), its restore timed, each rank's part
of the state written with where it sits in the full tensors (`parts_of`), at the checkpoint of a `save-<L>`
run or before the first step of a resume, and the losses of the steps after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from _nanotron import LossOnEveryStage, book_dummy_tokens, load_run_train

SAVE_AT, STEPS = 6, 9


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
