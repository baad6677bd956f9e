"""One mode's training run, as each rank of its torchrun runs it (`bench_nanotron.py phase`).

Nanotron's trainer, subclassed: every iteration's end timed once the GPU has run it, each checkpoint taken
the mode's way (Nanotron's own save, DCP's async_save, datastates, or the raw copies of the `copy-*` modes),
the engine's calls and a datastates queuing's parts timed, the losses, host and GPU memory recorded; the rank
writes its record where `rank_record` says, and the driver merges the ranks' records (`_ranks.merge`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from _bench_baselines import (
    RawCopy,
    checkpoint_bytes,
    dcp_key_prefixes,
    dcp_zero_overhead_stager,
    trainer_files,
)
from _bench_checkpoints import prune_before
from _bench_figures import block_on
from _bench_measure import MemorySampler, Profiled, ProfileSum, device_allocs, threads_cpu
from _nanotron import book_dummy_tokens, load_run_train, time_library_report
from _nodes import take_gpu_of_rank


def run_phase(args: argparse.Namespace) -> None:
    import torch

    take_gpu_of_rank()  # a worker of a simulated node (bench_nanotron.py --nodes)
    if args.switch_interval_ms:  # how long a thread waiting for the GIL lets the holder run (Python: 5 ms)
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    run_train = load_run_train()
    from nanotron.trainer import DistributedTrainer

    t_start = time.perf_counter()
    rec: dict[str, Any] = {"mode": args.mode, "trainer": DistributedTrainer.__name__, "ends": [], "saves": []}
    rec["commits"], rec["dcp"], rec["losses"], rec["queues"] = [], [], [], []
    rec["marks"] = {}  # seconds after t_start at which the set-up's phases ended
    memory = MemorySampler(pss_every=args.pss_every)
    # --profile: the memory checkpoints from the second on, each request and the step that queues it, summed
    memory_prof = ProfileSum() if args.profile else None
    time_library_report(rec["marks"])

    engine_time = [0.0]  # seconds in the engine's plan, save and save_plan (planning + queuing), summed
    # Seconds planning, staging, in the core: summed; and of those, or beside them, the optimizer's plan
    # afresh (`replan`) or like the last from the copy taken before the step (`held`), that copy (`state`),
    # the tier's targets (`targets`)
    split = {
        "plan": 0.0,
        "prepare": 0.0,
        "core": 0.0,
        "replan": 0.0,
        "held": 0.0,
        "state": 0.0,
        "targets": 0.0,
    }
    # The same on the training thread's CPU clock: where it reads less than the wall clock, the thread
    # waited (for the GIL, or in a driver call), rather than ran
    split_cpu = dict.fromkeys(split, 0.0)
    staged = [0]  # files staged on the GPU
    if args.mode.startswith("datastates") or args.mode == "stress":
        from nanotron_datastates import DataStatesEngine

        depth = [0]  # save calls plan: only the outermost call counts

        def timed(plain: Any) -> Any:
            def call(self: Any, *a: Any, **k: Any) -> Any:
                if depth[0]:
                    return plain(self, *a, **k)
                depth[0] += 1
                t = time.perf_counter()
                try:
                    out = plain(self, *a, **k)
                    staged[0] += bool(getattr(out, "staged", False))
                    return out
                finally:
                    depth[0] -= 1
                    engine_time[0] += time.perf_counter() - t

            return call

        for name in ("save", "plan", "save_plan", "save_plans", "stage_plans", "stage"):
            setattr(DataStatesEngine, name, timed(getattr(DataStatesEngine, name)))
        from nanotron_datastates.save.staged_save import StagedSave

        # A staged checkpoint's files, queued once the step is launched
        StagedSave.queue = timed(StagedSave.queue)  # type: ignore[method-assign]

        # Where a checkpoint's queuing goes: planning, staging on the GPU (prepare_all), the core's calls.
        from nanotron_datastates import engine as engine_module

        def adds_to(key: str, plain: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return plain(*a, **k)
                finally:
                    split[key] += time.perf_counter() - t
                    split_cpu[key] += time.thread_time() - c

            return call

        DataStatesEngine.plan = adds_to("plan", DataStatesEngine.plan)
        from nanotron_datastates.nanotron.save import queuing as queuing_module
        from nanotron_datastates.save.optimizer_plan import OptimizerPlans

        OptimizerPlans.replan = adds_to("replan", OptimizerPlans.replan)  # type: ignore[method-assign]
        OptimizerPlans.replan_held = adds_to("held", OptimizerPlans.replan_held)  # type: ignore[method-assign]
        OptimizerPlans.for_checkpoint = adds_to("state", OptimizerPlans.for_checkpoint)  # type: ignore
        queuing_module.targets = adds_to("targets", queuing_module.targets)
        engine_module.prepare_all = adds_to("prepare", engine_module.prepare_all)
        start_core = engine_module.start_core

        class TimedCore:  # the core's queuing call, timed; everything else passed through
            def __init__(self, core: Any) -> None:
                self._core = core
                self.save_many = adds_to("core", core.save_many)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._core, name)

        engine_module.start_core = lambda *a, **k: TimedCore(start_core(*a, **k))

        # The committer thread's CPU per outcome: its Python holds the GIL that the training thread needs
        from nanotron_datastates.nanotron.save.report import Reporter

        committed = Reporter.committed

        def committed_timed(self: Any, r: Any) -> None:
            t = time.thread_time()
            try:
                committed(self, r)
            finally:
                rec.setdefault("committer_cpu_s", []).append(time.thread_time() - t)

        Reporter.committed = committed_timed  # type: ignore[method-assign]

    dcp_mode = args.mode in ("dcp", "dcp-zo")

    class Trainer(DistributedTrainer):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self._dcp_future: Any = None
            self._dcp_staging: Any = None  # dcp-zo: the last save's staging, awaited before the next step
            self._gloo = torch.distributed.new_group(backend="gloo") if dcp_mode else None
            self._stager = dcp_zero_overhead_stager() if args.mode == "dcp-zo" else None
            self._raw_copy: RawCopy | None = None  # copy-*: made after the first step, when the state exists
            self._raw_copy_due = False
            step = self.optimizer.step  # the first step's phases: forward and backward, then the update

            def first_step(*a: Any, **k: Any) -> Any:
                if self._dcp_staging is not None:  # dcp-zo: the step may change what is being staged
                    t = time.perf_counter()
                    self._dcp_staging.result()
                    self._dcp_staging = None
                    rec["dcp_staging_waits_s"] = rec.get("dcp_staging_waits_s", []) + [
                        time.perf_counter() - t
                    ]
                first = "optimizer_step_start_s" not in rec["marks"]
                if first:
                    torch.cuda.synchronize()
                    rec["marks"]["optimizer_step_start_s"] = time.perf_counter() - t_start
                saver = getattr(self, "datastates", None)
                # The second checkpoint's queuing at the step after it (the first's pays one-time costs).
                queuing = args.profile and saver is not None and saver.gate.deferred
                queuing = queuing and len(rec["saves"]) == 2
                if self._raw_copy is not None and self._raw_copy_due:  # copy-*: where datastates queues
                    self._raw_copy.issue()
                    self._raw_copy_due = False
                summed = memory_prof is not None and saver is not None and saver.gate.deferred
                summed = summed and len(rec["saves"]) >= 2 and bool(rec["saves"][-1].get("memory"))
                queuing = queuing and not summed  # one profiler at a time
                if summed:
                    memory_prof.on()
                with Profiled(Path(args.record).with_suffix(".queue.prof.txt") if queuing else None):
                    out = step(*a, **k)
                if summed:
                    memory_prof.off()
                if first:
                    torch.cuda.synchronize()
                    rec["marks"]["optimizer_step_end_s"] = time.perf_counter() - t_start
                    if args.mode.startswith("copy-"):
                        way = {"copy-h2d": "h2d", "copy-host": "host"}.get(args.mode, "d2h")
                        way = "engine" if args.mode.startswith("copy-engine") else way
                        pace = args.copy_pace_s if args.mode == "copy-paced" else 0.0
                        parts = args.mode.split("-")[2:]  # copy-engine-files-stage: ["files", "stage"]
                        files = trainer_files(self) if "files" in parts else None
                        self._raw_copy = RawCopy(checkpoint_bytes(self), way, pace, files, parts)
                return out

            self.optimizer.step = first_step
            manager = getattr(self, "datastates", None)  # the CheckpointManager (stock Nanotron: none)
            if manager is not None and manager.saver is not None:  # datastates: the saver's public observers
                manager.saver.observers.append(self._observe)
                manager.memory_checkpoint = self._timed_memory_checkpoint(manager.memory_checkpoint)
            self._queue_start: dict[str, Any] = {}

        def pre_init(self) -> None:  # the read-ahead of a datastates resume starts here
            rec["marks"]["pre_init_s"] = time.perf_counter() - t_start
            super().pre_init()
            rec["marks"]["pre_init_end_s"] = time.perf_counter() - t_start

        def _load_model_checkpoint(self, model: Any) -> Any:  # when the model was built, its weights set
            rec["marks"]["model_built_s"] = time.perf_counter() - t_start
            out = super()._load_model_checkpoint(model)
            rec["marks"]["weights_loaded_s"] = time.perf_counter() - t_start
            return out

        def training_step(self, dataloader: Any) -> Any:
            rec["marks"].setdefault("first_step_start_s", time.perf_counter() - t_start)
            out = super().training_step(dataloader)
            if args.sync == "device":
                torch.cuda.synchronize()
            else:
                torch.cuda.current_stream().synchronize()
            step, last = self.iteration_step, self.config.tokens.train_steps
            rec["ends"].append([step, time.perf_counter() - t_start])
            if step == last:  # no iteration after it to slow down
                memory.sample_pss()
            rec.setdefault("gc2", []).append([step, gc.get_stats()[2]["collections"]])
            if args.blocks and step % args.blocks == 0:  # each thread's CPU by block: which ones a block adds
                rec.setdefault("threads", []).append([step, threads_cpu()])
            due = args.interval and step % args.interval == 0 and block_on(step + 1, args.blocks)
            if self._raw_copy is not None and due and step < last:
                rec["saves"].append({"step": step, "call_s": 0.0, "bytes": self._raw_copy.nbytes})
                self._raw_copy_due = True
            loss = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if isinstance(loss, torch.Tensor):
                rec["losses"].append([self.iteration_step, loss.item()])
            return out

        def save_checkpoint(self) -> Path:
            book_dummy_tokens(self.metadata)
            engine_s0, staged0 = engine_time[0], staged[0]
            t0 = time.perf_counter()
            profile = args.profile and len(rec["saves"]) == 1  # the second save: the engine is warm
            with Profiled(Path(args.record).with_suffix(".save.prof.txt") if profile else None):
                path = self._dcp_save() if dcp_mode else super().save_checkpoint()
            rec["saves"].append(
                {
                    "step": self.iteration_step,
                    "call_s": time.perf_counter() - t0,
                    "engine_save_s": engine_time[0] - engine_s0,
                    "staged_files": staged[0] - staged0,
                }
            )
            if args.mode == "torch" and RANK == 0:  # durable when the call returns
                prune_before(path.parent, self.iteration_step)
            return path

        def _timed_memory_checkpoint(self, take: Callable[[], None]) -> Callable[[], None]:
            """The manager's memory checkpoint (memory_interval), recorded as a save where one is due."""
            manager = self.datastates

            def timed() -> None:
                step = manager.memory_due()
                if step is None:
                    return take()
                if not block_on(step + 1, args.blocks):  # --blocks: none in this block
                    return None
                book_dummy_tokens(self.metadata)
                engine_s0, staged0 = engine_time[0], staged[0]
                t0 = time.perf_counter()
                if memory_prof is not None and rec["saves"]:
                    memory_prof.on()
                take()
                if memory_prof is not None and rec["saves"]:
                    memory_prof.off()
                rec["saves"].append(
                    {
                        "step": step,
                        "call_s": time.perf_counter() - t0,
                        "engine_save_s": engine_time[0] - engine_s0,
                        "staged_files": staged[0] - staged0,
                        "memory": True,
                    }
                )

            return timed

        def _dcp_save(self) -> Path:
            import torch.distributed.checkpoint as dcp

            if self._dcp_future is not None:
                self._dcp_future.result()
                if RANK == 0:
                    prune_before(Path(self.config.checkpoints.checkpoints_path), self._dcp_step)
            opt = self.optimizer.state_dict()
            shard, own = dcp_key_prefixes(self.parallel_context, self.config.optimizer.zero_stage)
            state = {
                "model": {shard + k: v for k, v in self.unwrapped_model.state_dict().items()},
                "optimizer": {f"{own}{i}/{k}": v for i, s in opt["state"].items() for k, v in s.items()},
                "master": {own + k: v for k, v in opt.get("gradient_accumulator", {}).items()},
            }
            step, t0 = self.iteration_step, time.perf_counter()
            self._dcp_step = step
            path = Path(self.config.checkpoints.checkpoints_path) / f"dcp_{step}"
            if self._stager is None:
                self._dcp_future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._gloo)
            else:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                response = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    process_group=self._gloo,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self._stager,
                )
                self._dcp_staging, self._dcp_future = response.staging_completion, response.upload_completion
            self._dcp_future.add_done_callback(
                lambda _: rec["dcp"].append({"step": step, "persisted_s": time.perf_counter() - t0})
            )
            return path

        def post_training(self) -> None:
            if self._dcp_future is not None:
                self._dcp_future.result()
            if self._stager is not None:
                self._stager.close()
            super().post_training()

        def _observe(self, event: str, fields: dict[str, Any]) -> None:
            """datastates: each queuing's time taken apart, and the committer's figures. The cudaMalloc count
            and the cache's figures only with --profile: reading them takes a few hundred microseconds inside
            the queuing timed, which the stall would count as the engine's."""
            if event == "queue_start":
                self._queue_start = {
                    "allocs": device_allocs() if args.profile else 0,
                    **split,
                    **{f"{k}_cpu": v for k, v in split_cpu.items()},
                    "engine": engine_time[0],
                }
            elif event == "queued":
                s0 = self._queue_start
                allocs = device_allocs() - s0["allocs"] if args.profile else None  # cudaMallocs
                rec["queues"].append(
                    {
                        "step": fields["step"],
                        "deferred": fields["deferred"],
                        "total_s": fields["seconds"],  # on the training thread
                        "captured_s": fields.get("captured"),
                        "background_s": fields.get("background"),  # on the saver's queuer thread
                        **{f"{k}_s": v - s0[k] for k, v in split.items()},
                        **{f"{k}_cpu_s": v - s0[f"{k}_cpu"] for k, v in split_cpu.items()},
                        "engine_s": engine_time[0] - s0["engine"],
                        "cuda_mallocs": allocs,
                        "cache": self.datastates.saver.engine.cache_stats() if args.profile else None,
                    }
                )
            elif event == "committed":  # on the committer's thread
                r = fields["result"]
                if r.committed and RANK == 0:
                    prune_before(Path(self.config.checkpoints.checkpoints_path), r.step)
                keys = ("step", "bytes", "stall_s", "queued_s", "snapshot_s", "persisted_s", "committed_s")
                keys += ("rank_bytes", "memory")
                rec["commits"].append({**{k: getattr(r, k) for k in keys}, "engine_cpu_s": r.engine_cpu_s})

    restoring = args.profile and args.mode.startswith("restore")
    with Profiled(Path(args.record).with_suffix(".init.prof.txt") if restoring else None):
        trainer = Trainer(args.config)
    rec["init_s"] = time.perf_counter() - t_start
    dataloader = run_train.get_dataloader(trainer)
    rec["marks"]["dataloader_s"] = time.perf_counter() - t_start
    trainer.train(dataloader)
    if trainer._raw_copy is not None:
        rec["raw_copy_s"] = trainer._raw_copy.seconds()
        rec["raw_copy_skipped"] = getattr(trainer._raw_copy, "skipped", 0)
    rec["memory"] = {**memory.stop(), "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved(),
                     "gpu_max_allocated_bytes": torch.cuda.max_memory_allocated()}  # fmt: skip
    if memory_prof is not None and memory_prof.blocks:
        memory_prof.write(Path(args.record).with_suffix(".memory.prof.txt"))
    rank_record(args.record, RANK).write_text(json.dumps(rec))


RANK = int(os.environ.get("RANK", "0"))


def rank_record(record: str | Path, rank: int) -> Path:
    """Where rank `rank` of a run writes its record (`run_all` merges them, `_ranks.merge`)."""
    return Path(record).with_suffix(f".rank{rank}.json")
