"""One run of bench_restart.py, as each rank of its torchrun runs it (`bench_restart.py phase`): Nanotron's
trainer that copies its whole state at the checkpoint it then dies after (`--kill`, `--lose-node`), resumes
when started again, compares what it restored with that copy bit for bit, and writes its incarnation's record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from _bench_measure import MemorySampler
from _nanotron import book_dummy_tokens, load_run_train, time_library_report
from _nodes import take_gpu_of_rank
from nanotron_proof import capture, compare, to_host

from nanotron_datastates import telemetry

EVERYTHING = ("weights", "optimizer", "lr_scheduler", "random", "global_rng", "metadata", "iteration_step")


def run_phase(args: argparse.Namespace) -> None:
    import torch

    run_train = load_run_train()
    from nanotron.trainer import DistributedTrainer

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.incarnation is not None:  # --lose-node: the job started again, not restarted by torchrun
        restart = args.incarnation
    take_gpu_of_rank()  # --lose-node: a worker of a simulated node (_nodes.py)
    killing = (args.kill or args.lose_node) and restart == 0
    replicated = threading.Event()  # --lose-node: this rank's replication of the checkpoint at --step is done
    t_start = time.perf_counter()
    rec: dict[str, Any] = {"mode": args.mode, "restart": restart, "marks": {}}
    if restart > 0:  # what the memory tier holds as the worker starts again
        rec["tier_at_restart"] = sorted(
            str(p.relative_to(args.tier_path)) for p in Path(args.tier_path).rglob(".rank-*.json")
        )
    memory = MemorySampler()
    time_library_report(rec["marks"])
    rank = int(os.environ.get("RANK", "0"))
    reference = Path(args.work) / f"reference_{args.mode}_rank{rank}.pt"

    class Trainer(DistributedTrainer):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            manager = getattr(self, "datastates", None)  # the CheckpointManager (stock Nanotron: none)
            if manager is not None and manager.saver is not None:
                manager.saver.observers.append(self._observe)
                manager.memory_checkpoint = self._reference_at_memory_checkpoint(manager.memory_checkpoint)

        def save_checkpoint(self) -> Path:
            book_dummy_tokens(self.metadata)
            if killing and self.iteration_step == args.step:
                torch.cuda.synchronize()
                torch.save(capture(self), reference)  # the state this checkpoint must bring back
            return super().save_checkpoint()

        def _reference_at_memory_checkpoint(self, take: Callable[[], None]) -> Callable[[], None]:
            """The manager's memory checkpoint, the state it must bring back kept first at --step."""
            manager = self.datastates

            def keep_then_take() -> None:
                step = manager.memory_due()
                if step is not None:
                    book_dummy_tokens(self.metadata)
                    if killing and step == args.step:
                        torch.cuda.synchronize()
                        state = capture(self)  # the state this memory checkpoint must bring back
                        state["iteration_step"] = step  # Nanotron's loop is at the next iteration already
                        torch.save(state, reference)
                take()

            return keep_then_take

        def _observe(self, event: str, fields: dict[str, Any]) -> None:
            r = fields.get("result")
            if event == "committed" and rank == 0:
                rec.setdefault("stall_s", []).append(r.stall_s)
            if event == "replicated" and rank == 0 and r.job is not None:
                rec.setdefault("replicated", []).append(telemetry.replication(r.step, r.job))
            if killing and r is not None and r.step == args.step:
                if args.kill and event == "committed":
                    keep_record()
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash, once the checkpoint is committed
                if args.lose_node and event == "replicated":
                    replicated.set()

        def training_step(self, dataloader: Any) -> Any:
            out = super().training_step(dataloader)
            # The memory checkpoint of --step, asked for next, is never skipped (memory_pace.py): none is
            # left in flight before it (stock Nanotron's trainer, `none` and `torch`, has no `datastates`)
            manager = getattr(self, "datastates", None)
            saver = manager.saver if manager is not None else None
            memory = args.lose_node and killing and self.iteration_step == args.step
            if memory and saver is not None and saver.settings.memory_interval:
                saver.take(saver.outstanding, manager.post_save)
            # After the step that follows the checkpoint: a checkpoint staged on the GPU is queued at that
            # step's optimizer step, so waiting before it for the replication would wait forever.
            if args.lose_node and killing and self.iteration_step == args.step + 1:
                # Training stops here on every rank: the replicas' NCCL calls, made by the training thread at
                # its optimizer steps while it trains (step_order.py), are made by the replicas' thread now.
                order = saver.replication.order if saver is not None else None
                if order is not None:
                    order.finish()
                replicated.wait(timeout=600)  # the node is lost once its checkpoint is in the peer too
                keep_record()
                if os.environ.get("GROUP_RANK") == "1":
                    shutil.rmtree(args.tier_path, ignore_errors=True)  # the node's memory, gone with it
                    os.kill(os.getpid(), signal.SIGKILL)
            if "first_step_end_s" not in rec["marks"]:
                torch.cuda.synchronize()
                # Every rank's first step done: the job's, not rank 0's alone (a rank still busy after its
                # step holds the next one at Nanotron's barrier).
                torch.distributed.barrier()
                rec["marks"]["first_step_end_s"] = time.perf_counter() - t_start
            return out

    def keep_record() -> None:
        if rank == 0:  # this incarnation's memory peaks, kept for the summary
            rec["memory"] = memory.stop()
            Path(f"{args.record}.{restart}.json").write_text(json.dumps(rec))

    trainer = Trainer(args.config)
    rec["init_s"] = time.perf_counter() - t_start
    resume = trainer.datastates.resume if hasattr(trainer, "datastates") else None
    here = bool(resume is not None and resume.source is not None)
    from_memory = [here] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(from_memory, here)
    rec["resumed_from_memory"] = all(from_memory)
    rec["ranks_from_memory"] = sum(from_memory)
    sources: list[Any] = [None] * torch.distributed.get_world_size()  # where each rank's files were read
    source = str(resume.source) if resume is not None and resume.source is not None else None
    torch.distributed.all_gather_object(sources, [os.environ.get("GROUP_RANK"), source])
    rec["sources"] = sources
    restored = None
    if (args.kill or args.lose_node) and restart > 0:
        # The restored state cloned on the GPU (left out of the time to the first step, as the report above),
        # compared with the synchronous copy once training is over: the host stays as a restart leaves it.
        t_clone = time.perf_counter()
        restored = capture(trainer, on_device=True)
        torch.cuda.synchronize()
        from nanotron_datastates.tier.jobs import jobs

        rec["tier"] = jobs(args.tier_path)
        rec["marks"]["compare_s"] = time.perf_counter() - t_clone
    trainer.train(run_train.get_dataloader(trainer))
    rec["memory"] = {**memory.stop(), "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved()}
    if restored is not None:
        ref, now = torch.load(reference, weights_only=False), to_host(restored)
        rec["compared"] = {}
        for part in EVERYTHING:
            n, diffs = compare(ref[part], now[part], part)
            rec["compared"][part] = {"tensors": n, "differences": len(diffs), "first": diffs[:10]}
        rec["compared"] = every_rank(rec["compared"])
    if rank == 0:
        Path(f"{args.record}.{restart}.json").write_text(json.dumps(rec))


def every_rank(compared: dict[str, Any]) -> dict[str, Any]:
    """Each part's comparison summed over the ranks (each compares its own state with its own copy)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compared
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, compared)
    return {
        part: {
            "tensors": sum(e[part]["tensors"] for e in everyone),
            "differences": sum(e[part]["differences"] for e in everyone),
            "first": [d for e in everyone for d in e[part]["first"]][:10],
        }
        for part in compared
    }
