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
  thread on 4 cores, no GPU involved (is it the host memory's traffic?);
* `datastates-NAME` (`--variant NAME:key=value,...`): datastates with other `datastates:` settings, for
  ablations (e.g. `p1:parser_threads=1`); a NAME that starts with `idle` asks for no checkpoint, as
  `datastates-idle` (e.g. `idle-nopin:pin_host_cache=false`);
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
on the run: see `MemorySampler`). Writes
DIR/bench_nanotron_<model>.json, a markdown table (.md) and a plot of the iteration times around
checkpoints (.png).

Nanotron main's trainer runs `torch.utils.collect_env` while it is constructed (its library report: 2 to 5
s of subprocesses, varying from run to run, in every mode alike); the time to the first step leaves that
report's own time out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import evict, resident_bytes
from _nanotron import REPO, book_dummy_tokens, load_run_train, time_library_report, write_config
from _ranks import merge

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
WARMUP = 3  # iterations left out of every statistic
WINDOW = 3  # iterations after a checkpoint that carry its cost
BEFORE = 10  # iterations before a checkpoint that its local reference is taken over
AFTER = 8  # iterations after a checkpoint whose excess is also reported one by one


# -- one run, under torchrun -------------------------------------------------------------------------------


def run_phase(args: argparse.Namespace) -> None:
    import torch

    run_train = load_run_train()
    from nanotron.trainer import DistributedTrainer

    t_start = time.perf_counter()
    rec: dict[str, Any] = {"mode": args.mode, "trainer": DistributedTrainer.__name__, "ends": [], "saves": []}
    rec["commits"], rec["dcp"], rec["losses"], rec["queues"] = [], [], [], []
    rec["marks"] = {}  # seconds after t_start at which the set-up's phases ended
    memory = MemorySampler(pss_every=args.pss_every)
    time_library_report(rec["marks"])

    engine_time = [0.0]  # seconds in the engine's plan, save and save_plan (planning + queuing), summed
    split = {"plan": 0.0, "prepare": 0.0, "core": 0.0}  # seconds planning, staging, in the core: summed
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

        for name in ("save", "plan", "save_plan", "save_plans", "stage_plans"):
            setattr(DataStatesEngine, name, timed(getattr(DataStatesEngine, name)))
        from nanotron_datastates.engine import StagedSave

        # A staged checkpoint's files, queued once the step is launched
        StagedSave.queue = timed(StagedSave.queue)  # type: ignore[method-assign]

        # Where a checkpoint's queuing goes: planning, staging on the GPU (prepare_all), the core's calls.
        from nanotron_datastates import engine as engine_module

        def adds_to(key: str, plain: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return plain(*a, **k)
                finally:
                    split[key] += time.perf_counter() - t

            return call

        DataStatesEngine.plan = adds_to("plan", DataStatesEngine.plan)
        engine_module.prepare_all = adds_to("prepare", engine_module.prepare_all)
        start_core = engine_module.start_core

        class TimedCore:  # the core's queuing call, timed; everything else passed through
            def __init__(self, core: Any) -> None:
                self._core = core
                self.save_many = adds_to("core", core.save_many)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._core, name)

        engine_module.start_core = lambda *a, **k: TimedCore(start_core(*a, **k))

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
                with Profiled(Path(args.record).with_suffix(".queue.prof.txt") if queuing else None):
                    out = step(*a, **k)
                if first:
                    torch.cuda.synchronize()
                    rec["marks"]["optimizer_step_end_s"] = time.perf_counter() - t_start
                    if args.mode.startswith("copy-"):
                        way = {"copy-h2d": "h2d", "copy-host": "host"}.get(args.mode, "d2h")
                        pace = args.copy_pace_s if args.mode == "copy-paced" else 0.0
                        self._raw_copy = RawCopy(checkpoint_bytes(self), way, pace)
                return out

            self.optimizer.step = first_step
            if getattr(self, "datastates", None) is not None:  # datastates: the saver's public observers
                self.datastates.observers.append(self._observe)
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
            if self._raw_copy is not None and args.interval and step % args.interval == 0 and step < last:
                rec["saves"].append({"step": step, "call_s": 0.0, "bytes": self._raw_copy.host.numel()})
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
                    "plan": split["plan"],
                    "prepare": split["prepare"],
                    "core": split["core"],
                    "engine": engine_time[0],
                }
            elif event == "queued":
                s0 = self._queue_start
                allocs = device_allocs() - s0["allocs"] if args.profile else None  # cudaMallocs
                rec["queues"].append(
                    {
                        "step": fields["step"],
                        "deferred": fields["deferred"],
                        "total_s": fields["seconds"],
                        "captured_s": fields.get("captured"),
                        "plan_s": split["plan"] - s0["plan"],
                        "prepare_s": split["prepare"] - s0["prepare"],
                        "core_s": split["core"] - s0["core"],
                        "engine_s": engine_time[0] - s0["engine"],
                        "cuda_mallocs": allocs,
                        "cache": self.datastates.engine.cache_stats() if args.profile else None,
                    }
                )
            elif event == "committed":  # on the committer's thread
                r = fields["result"]
                if r.committed and RANK == 0:
                    prune_before(Path(self.config.checkpoints.checkpoints_path), r.step)
                keys = ("step", "bytes", "stall_s", "queued_s", "snapshot_s", "persisted_s", "committed_s")
                keys += ("rank_bytes",)
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
    rec["memory"] = {**memory.stop(), "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved(),
                     "gpu_max_allocated_bytes": torch.cuda.max_memory_allocated()}  # fmt: skip
    rank_record(args.record, RANK).write_text(json.dumps(rec))


RANK = int(os.environ.get("RANK", "0"))


def rank_record(record: str | Path, rank: int) -> Path:
    """Where rank `rank` of a run writes its record (`run_all` merges them, `_ranks.merge`)."""
    return Path(record).with_suffix(f".rank{rank}.json")


def dcp_key_prefixes(pc: Any, zero_stage: int) -> tuple[str, str]:
    """Prefixes that keep DCP's keys apart where ranks hold different tensors under the same name: the
    model's by tensor- and pipeline-parallel rank (replicas share theirs, and DCP writes each once, spread
    over the ranks that hold it), the optimizer's also by data-parallel rank under ZeRO (its states are keyed
    by a parameter's index on the rank)."""
    import torch.distributed as dist

    tp, pp = dist.get_rank(pc.tp_pg), dist.get_rank(pc.pp_pg)
    shard = f"pp{pp}-tp{tp}/"
    return shard, shard + (f"dp{dist.get_rank(pc.dp_pg)}/" if zero_stage > 0 else "")


class RawCopy:
    """The `copy-*` modes' copy of `nbytes`, started by `issue()`:

    * `d2h`: from a GPU buffer to pinned host memory on a side stream, in one copy or (`pace_s` > 0) in 64 MiB
      pieces with GPU sleeps between them, so that it takes about `pace_s`;
    * `h2d`: the other way, in one copy;
    * `host`: between two host buffers, by a thread of its own (torch's copy on 4 threads: about the rate of
      the copy engine's writes), the GPU not involved: what the memory traffic alone costs."""

    PIECE = 64 << 20

    def __init__(self, nbytes: int, way: str = "d2h", pace_s: float = 0.0) -> None:
        import torch

        self.way = way
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=way != "host")
        if way == "host":
            torch.set_num_threads(4)  # the training runs on the GPU: its own CPU ops are few
            self.other = torch.empty(nbytes, dtype=torch.uint8)
            self.host.fill_(1)
            self.other.fill_(2)
        else:
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()
        self.pieces = [(lo, min(lo + self.PIECE, nbytes)) for lo in range(0, nbytes, self.PIECE)]
        self.sleep_cycles = 0
        self.timed: list[Any] = []  # (begin, end) CUDA events of each copy, or its seconds on the host
        self.thread: threading.Thread | None = None
        if pace_s > 0:
            self._issue(paced=False)
            torch.cuda.synchronize()
            plain_s = self.seconds()[-1]
            probe = 10_000_000
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                begin.record(self.stream)
                torch.cuda._sleep(probe)
                end.record(self.stream)
            torch.cuda.synchronize()
            gap_s = max(pace_s - plain_s, 0.0) / len(self.pieces)
            self.sleep_cycles = int(probe * gap_s / (begin.elapsed_time(end) / 1e3))
            self.timed.clear()

    def _issue(self, paced: bool) -> None:
        import torch

        if self.way == "host":
            self._join()

            def copy() -> None:
                t0 = time.perf_counter()
                self.other.copy_(self.host)  # releases the GIL
                self.timed.append(time.perf_counter() - t0)

            self.thread = threading.Thread(target=copy, daemon=True)
            self.thread.start()
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            if self.way == "h2d":
                self.dev.copy_(self.host, non_blocking=True)
            elif not paced:
                self.host.copy_(self.dev, non_blocking=True)
            else:
                for lo, hi in self.pieces:
                    self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                    torch.cuda._sleep(self.sleep_cycles)
            end.record(self.stream)
        self.timed.append((begin, end))

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def issue(self) -> None:
        self._issue(paced=self.sleep_cycles > 0)

    def seconds(self) -> list[float]:
        """Each copy's time (waits for them): on the GPU, or the host thread's."""
        if self.way == "host":
            self._join()
            return list(self.timed)
        self.stream.synchronize()
        return [b.elapsed_time(e) / 1e3 for b, e in self.timed]


def checkpoint_bytes(trainer: Any) -> int:
    """The bytes of a checkpoint's tensors: the model's and the optimizer state's (moments, master
    weights)."""
    import torch

    def tensors(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for v in x.values() for t in tensors(v)]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in tensors(v)]
        return []

    every = tensors(dict(trainer.unwrapped_model.state_dict())) + tensors(trainer.optimizer.state_dict())
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in every}.values())


def dcp_zero_overhead_stager(pinned: bool = True) -> Any:
    """DCP's stager in its zero-overhead configuration, made once and reused for every save (`pinned`:
    page-locked staging and non-blocking copies, for GPU state; host state is staged into shared memory only).

    torch 2.11's `DefaultStager._stage` closes its StateDictStager after each staging (pytorch/pytorch#183413,
    a fix of a leak): `close` empties the copier table, so the second save fails with `KeyError: <class
    'type'>` and every save would pin its host memory anew. As later releases do, the stager stays open
    until the run ends (`close` at the end of training).

    The checkpoint process joins the job's own store (`DCP_USE_PREFIX_STORE=1`) instead of a port it probes
    for and binds later: among Nanotron's many process groups, another socket took that port in between
    (EADDRINUSE) in the first save."""
    os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
    import inspect

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=pinned, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=pinned
    )
    stager = DefaultStager(options)
    if "_state_dict_stager.close()" in inspect.getsource(DefaultStager._stage):
        inner = stager._state_dict_stager
        final_close = inner.close
        inner.close = lambda: None  # the call at the end of each staging
        plain_close = stager.close

        def close() -> None:
            plain_close()
            final_close()

        stager.close = close
    return stager


class MemorySampler:
    """Host memory of a run, measured without loading the run: the peak resident set from the kernel's own
    high-water mark (`VmHWM`), what `/dev/shm` gained (statvfs every 50 ms, constant time), and the
    proportional set size (PSS: shared pages split among the processes mapping them) summed over the process
    and every process it started (DCP's checkpoint process), which counts pinned and shared-memory staging
    once, read when the caller asks (`sample_pss`) and at `stop` if never.

    PSS is not sampled in the background by default: reading `smaps_rollup` walks every page table entry of
    the process holding its mmap lock, 10 ms for 1.8 GB in 4 KiB pages and 45 ms for 7.2 GB on a 2-core
    machine, so a read every 50 ms was a load of its own on the run, and a larger one on the modes that hold
    more memory. `pss_every` > 0 brings that sampling back (to measure what it costs)."""

    def __init__(self, every_s: float = 0.05, pss_every: float = 0.0) -> None:
        self.peak_pss = self.peak_shm = 0
        self.pss_reads: list[float] = []  # seconds each PSS reading of the process tree took
        self._shm0 = self._shm_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s, pss_every), daemon=True)
        self._thread.start()

    @staticmethod
    def _shm_used() -> int:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    @staticmethod
    def _tree(pid: int) -> list[int]:
        """`pid` and its descendants."""
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                with contextlib.suppress(OSError):  # the task ended meanwhile
                    todo += [int(c) for c in task.read_text().split()]
        return out

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
        except OSError:
            pass
        return 0

    @staticmethod
    def _hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        return 0

    def sample_pss(self) -> None:
        """Reads the PSS of the process tree now (tens of milliseconds for a process of several GB)."""
        t = time.perf_counter()
        self.peak_pss = max(self.peak_pss, sum(self._pss(p) for p in self._tree(os.getpid())))
        self.pss_reads.append(time.perf_counter() - t)

    def _run(self, every_s: float, pss_every: float) -> None:
        last_pss = time.perf_counter()
        while not self._stop.wait(every_s):
            self.peak_shm = max(self.peak_shm, self._shm_used() - self._shm0)
            if pss_every > 0 and time.perf_counter() - last_pss >= pss_every:
                self.sample_pss()
                last_pss = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        if not self.pss_reads:
            self.sample_pss()
        return {
            "host_peak_rss_bytes": self._hwm(),
            "host_pss_tree_bytes": self.peak_pss,
            "pss_reads": len(self.pss_reads),
            "pss_read_max_s": max(self.pss_reads),
            "shm_peak_bytes": self.peak_shm,
        }


def device_allocs() -> int:
    """cudaMallocs so far: read from the allocator's table as it comes (`memory_stats` also flattens it, 160
    Python calls, inside the queuing this benchmark times)."""
    import torch

    return int(torch.cuda.memory_stats_as_nested_dict().get("num_device_alloc", 0))


class Profiled:
    """cProfile of a block, written as text to `path` (the 60 costliest calls, cumulative, then the 30
    costliest by their own time); None: no-op."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __enter__(self) -> None:
        if self.path is not None:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()

    def __exit__(self, *exc: Any) -> None:
        if self.path is None:
            return
        import io
        import pstats

        self.prof.disable()
        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("cumulative").print_stats(60)
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(30)
        self.path.write_text(text.getvalue())


# -- all runs ----------------------------------------------------------------------------------------------


def make_cold(folder: Path, scope: str) -> dict[str, Any]:
    """Evicts `folder`'s files from the page cache and returns how many of their bytes stay resident.

    `scope` "checkpoint" (the default) evicts those files only (fadvise, after a sync): the restore then reads
    the checkpoint from the disk, while the libraries stay as warm as for the scratch runs its cost is taken
    over. "system" empties the whole page cache (drop_caches, root): the restore then also reloads CUDA's and
    torch's libraries from the disk, a cost the warm scratch runs do not pay (what earlier results measured).
    """
    os.sync()
    method = "fadvise"
    if scope == "system":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            method = "drop_caches+fadvise"
        except OSError:
            pass
    files = [p for p in folder.rglob("*") if p.is_file()]
    evict(files)
    return {
        "method": method,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "resident_bytes": resident_bytes(files),
    }


def prune_before(folder: Path, step: int) -> None:
    """Removes the checkpoints under `folder` older than the durable one of `step` (the disk holds few
    checkpoints of the 1B model: 15 GB each)."""
    for p in folder.iterdir() if folder.is_dir() else ():
        name = p.name.removeprefix("dcp_")
        if p.is_dir() and name.isdigit() and int(name) < step:
            shutil.rmtree(p, ignore_errors=True)


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
    for name, settings in variants(args.variant):
        every = never if name.startswith("datastates-idle") else args.interval
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
        cmd += ["--interval", str(args.interval), "--sync", args.sync]
        env = {**os.environ, **({"NANOTRON_DATASTATES_AUTOLOAD": "0"} if stock else {})}
        t0 = time.perf_counter()
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


def resumed_from(restore: str) -> str:
    """The training run a restore run resumes: `restore-torch-2` -> `torch`."""
    return restore.split("-")[1]


def resummarize(out: Path) -> int:
    """Recomputes a results folder's figures from its raw records, keeping the command that ran them; a
    folder of `--rounds` (round0/, round1/ ...): each round's, then the rounds' summary."""
    rounds = sorted(out.glob("round[0-9]*/"), key=lambda p: int(p.name[len("round") :]))
    if rounds:
        for r in rounds:
            resummarize(r)
        per_round = [json.loads(next(r.glob("bench_nanotron_*.json")).read_text()) for r in rounds]
        old = json.loads((out / "rounds_summary.json").read_text())
        summary = {
            **aggregate_rounds(per_round),
            "command": old["command"],
            "resummarized": " ".join(sys.argv),
        }
        (out / "rounds_summary.json").write_text(json.dumps(summary, indent=1))
        (out / "rounds_summary.md").write_text(overhead_table(summary) + "\n")
        return 0
    (stem,) = out.glob("bench_nanotron_*.json")
    old = json.loads(stem.read_text())
    records = json.loads((out / f"records_{old['model']}.json").read_text())
    args = argparse.Namespace(
        model=old["model"],
        steps=old["steps"],
        interval=old["interval"],
        layout=old.get("layout", "1gpu"),
        micro_batch=old.get("micro_batch"),
        no_fp32_grads=not old.get("fp32_grads", True),
    )
    result = summarize(args, records)
    for key in ("command", "gpu", "cold_cache"):
        if key in old:
            result[key] = old[key]
    result["resummarized"] = " ".join(sys.argv)
    stem.write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(table(result))
    return 0


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


def overhead_table(summary: dict[str, Any]) -> str:
    """The headline: each mode's training time over the run without checkpoints, median [min, max] over the
    rounds, and the same by the iterations' place after a checkpoint; its median stall."""

    def pct(figures: dict[str, Any], key: str) -> str:
        f = figures.get(key)
        if f is None:
            return "-"
        return f"{100 * f['median']:+.1f}% [{100 * f['min']:+.1f}, {100 * f['max']:+.1f}]"

    lines = [
        f"{summary['rounds']} rounds; training time over the run without checkpoints in the same round, "
        "median [min, max]",
        "",
        "| mode | whole run | stall iterations | while persisting | far from a checkpoint | median stall "
        "ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in summary["modes"].items():
        if name == "none":
            continue
        stall = m.get("stall_median_s")
        cells = [name] + [pct(m, f"overhead_{k}") for k in ("total", "stall", "flush", "far")]
        cells.append("-" if stall is None else f"{1e3 * stall['median']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    excess = summary.get("excess_after_s", {})
    if excess:
        lines += [
            "",
            f"Excess of each of the {AFTER} iterations after a checkpoint over the median of the {BEFORE} "
            "before it, ms (mean over the checkpoints and rounds; none's at the same steps)",
            "",
            "| mode | " + " | ".join(f"+{j}" for j in range(1, AFTER + 1)) + f" | first {WINDOW} | all |",
            "| --- " * (AFTER + 3) + "|",
        ]
        for name, row in excess.items():
            cells = [name] + [f"{1e3 * x:.1f}" for x in row]
            cells += [f"{1e3 * sum(row[:WINDOW]):.1f}", f"{1e3 * sum(row):.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ROUND_FIGURES = (
    "stall_median_s",
    "stall_share_of_interval",
    "throughput_loss",
    "mean_iteration_s",
    "overhead_total",
    "overhead_stall",
    "overhead_flush",
    "overhead_far",
)


def aggregate_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and figure (ROUND_FIGURES), the value of every round and their median; the ratios too."""
    modes: dict[str, Any] = {}
    for r in results:
        for name, m in r["modes"].items():
            for key in ROUND_FIGURES:
                if m.get(key) is not None:
                    modes.setdefault(name, {}).setdefault(key, []).append(m[key])
    excess: dict[str, list[float]] = {}  # after a checkpoint, iteration by iteration: the rounds' mean
    for name in modes:
        rows = [r["modes"][name].get("excess_after_s") for r in results if name in r["modes"]]
        rows = [row for row in rows if row]
        if rows:
            excess[name] = [statistics.fmean(col) for col in zip(*rows)]
    ratios: dict[str, list[float]] = {}
    for r in results:
        for key, v in r.get("ratios", {}).items():
            ratios.setdefault(key, []).append(v)
    med = statistics.median
    return {
        "command": " ".join(sys.argv),
        "rounds": len(results),
        "modes": {
            n: {k: {"rounds": v, "median": med(v), "min": min(v), "max": max(v)} for k, v in m.items()}
            for n, m in modes.items()
        },
        "ratios": {k: {"rounds": v, "median": med(v)} for k, v in ratios.items()},
        "excess_after_s": excess,
    }


def iteration_times(rec: dict[str, Any]) -> dict[int, float]:
    ends = rec.get("ends", [])
    return {step: t - ends[i - 1][1] for i, (step, t) in enumerate(ends) if i > 0}


def stall_figures(rec: dict[str, Any], fallback_median: float) -> dict[str, Any]:
    """Per checkpoint, the excess of the WINDOW iterations after it over the run's own median iteration
    (iterations outside every window and past WARMUP). Where there are none (the stress run checkpoints at
    every step), the excess of the one iteration after it over `fallback_median`."""
    it = iteration_times(rec)
    every = [x["step"] for x in rec.get("saves", [])]
    saves = [s for s in every if s > WARMUP]
    windows = {s + j for s in every for j in range(1, WINDOW + 1)}
    quiet = [t for s, t in it.items() if s > WARMUP and s not in windows]
    median = statistics.median(quiet) if quiet else fallback_median
    window = WINDOW if quiet else 1  # a checkpoint at every step: each iteration carries one
    excess = [[it[s + j] - median for j in range(1, window + 1) if s + j in it] for s in saves]
    excess = [e for e in excess if e]  # the last step's checkpoint has no iteration after it
    stalls = [sum(e) for e in excess]
    # Local stall: the same excess over the median of the quiet iterations among the BEFORE just before each
    # checkpoint. The iteration time drifts by 10-20% over tens of steps (in every mode), and the run's
    # median puts that drift into the stall of a checkpoint that falls in a slow or fast stretch.
    local = []
    for s in saves:
        before = [it[k] for k in range(s - BEFORE + 1, s + 1) if k in it and k > WARMUP and k not in windows]
        after = [it[s + j] for j in range(1, window + 1) if s + j in it]
        if before and after and quiet:
            local.append(sum(after) - len(after) * statistics.median(before))
    return {
        "median_quiet_iteration_s": median,
        "window_excess_s": excess,
        "stall_s": stalls,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_local_s": local,
        "stall_local_median_s": statistics.median(local) if local else None,
    }


def excess_after(rec: dict[str, Any], interval: int) -> list[float] | None:
    """Where a checkpoint's cost lands: the mean excess of the i-th iteration after each checkpoint step
    (every `interval` steps, in every mode: none's is the placebo), i = 1..AFTER, over the median of the
    BEFORE iterations just before it."""
    it = iteration_times(rec)
    rows = []
    for c in range(interval, max(it, default=0) - AFTER + 1, interval):
        before = [it[k] for k in range(c - BEFORE + 1, c + 1) if k in it and k > WARMUP]
        if before and all(c + j in it for j in range(1, AFTER + 1)):
            ref = statistics.median(before)
            rows.append([it[c + j] - ref for j in range(1, AFTER + 1)])
    return [statistics.fmean(col) for col in zip(*rows)] if rows else None


def flush_phase_slowdown(rec: dict[str, Any], interval: int) -> float | None:
    """Within one run, the median iteration of the first half of each interval after its checkpoint's
    window (while that checkpoint is flushed) over that of the second half, minus 1. Iteration times drift
    between runs by more than the 2% the end-to-end goal allows; within a run, this shows what background
    flushing costs the steps it overlaps."""
    if not rec.get("saves") or interval < 2 * (WINDOW + 1):
        return None
    it = iteration_times(rec)
    offset = {s: (s - 1) % interval + 1 for s in it if s > WARMUP}  # 1: the iteration after a checkpoint
    early = [it[s] for s, o in offset.items() if WINDOW < o <= interval // 2]
    late = [it[s] for s, o in offset.items() if o > interval // 2]
    if not early or not late:
        return None
    return statistics.median(early) / statistics.median(late) - 1


def overhead_vs_none(rec: dict[str, Any], none: dict[str, Any], interval: int) -> dict[str, Any] | None:
    """What checkpointing cost the whole run against the run without checkpoints (the same steps, the same
    data), and where: `total`, the training time of every measured iteration over none's, minus 1; then the
    iterations apart, by their place after the last checkpoint, each set's median over none's median of the
    same steps, minus 1: `stall` (the WINDOW iterations after a checkpoint; `stall_s`, their summed excess
    per checkpoint), `flush` (from there to half the interval, while the checkpoint is persisted) and `far`
    (the second half, the engine idle)."""
    mine, base = iteration_times(rec), iteration_times(none)
    steps = [s for s in mine if s > WARMUP and s in base]
    if not steps:
        return None
    med = statistics.median
    out: dict[str, Any] = {"total": sum(mine[s] for s in steps) / sum(base[s] for s in steps) - 1}
    saves = {x["step"] for x in rec.get("saves", [])}
    if not saves or interval < 2 * (WINDOW + 1):
        return out
    since: dict[int, int] = {}
    for s in steps:  # iterations since the newest checkpoint at or before the step before
        last = max((c for c in saves if c < s), default=None)
        if last is not None:
            since[s] = s - last
    parts = {
        "stall": [s for s, k in since.items() if k <= WINDOW],
        "flush": [s for s, k in since.items() if WINDOW < k <= interval // 2],
        "far": [s for s, k in since.items() if k > interval // 2],
    }
    for name, part in parts.items():
        if part:
            out[name] = med(mine[s] for s in part) / med(base[s] for s in part) - 1
    stalled = [c for c in saves if all(c + j in mine and c + j in base for j in range(1, WINDOW + 1))]
    if stalled:
        out["stall_s"] = med(sum(mine[c + j] - base[c + j] for j in range(1, WINDOW + 1)) for c in stalled)
    return out


def queue_split(rec: dict[str, Any]) -> dict[str, float] | None:
    """Median seconds of a checkpoint's queuing (datastates, past the first): in all, planning (the
    optimizer state), staging on the GPU, the core's call (`core_s`, where recorded), the rest of the
    engine's save calls (paths, handles), and the part before the optimizer step (`before_step`)."""
    qs = rec.get("queues", [])[1:]
    if not qs:
        return None
    med = statistics.median
    out = {
        "total": med(q["total_s"] for q in qs),
        "plan": med(q["plan_s"] for q in qs),
        "stage": med(q["prepare_s"] for q in qs),
        "core": med(q["engine_s"] - q["plan_s"] - q["prepare_s"] for q in qs),
    }
    if all("core_s" in q for q in qs):
        out["core"] = med(q["core_s"] for q in qs)
        out["rest"] = med(q["engine_s"] - q["plan_s"] - q["prepare_s"] - q["core_s"] for q in qs)
    if all(q.get("captured_s") is not None for q in qs):  # before the optimizer step, where deferred
        out["before_step"] = med(q["captured_s"] for q in qs)
    return out


def loss_match(run: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Losses of two runs at the steps both ran (bitwise is the bar)."""
    mine, theirs = dict(run.get("losses", [])), dict(other.get("losses", []))
    common = sorted(set(mine) & set(theirs))
    diffs = [abs(mine[s] - theirs[s]) for s in common]
    return {
        "steps": common,
        "bitwise": bool(common) and all(d == 0 for d in diffs),
        "max_abs_diff": max(diffs, default=None),
    }


def summarize(args: argparse.Namespace, records: dict[str, Any]) -> dict[str, Any]:
    base = iteration_times(records["none"])
    steady = [t for s, t in base.items() if s > WARMUP]
    median = statistics.median(steady) if steady else float("nan")
    modes: dict[str, Any] = {}
    names = ["none", "torch", "dcp", "dcp-zo", "datastates", "stress"]
    names += [n for n in records if n.startswith(("datastates-", "copy-"))]
    for name in names:
        rec = records.get(name, {})
        it = iteration_times(rec)
        measured = [t for s, t in it.items() if s > WARMUP]
        modes[name] = {
            "iterations": len(measured),
            "mean_iteration_s": statistics.fmean(measured) if measured else None,
            "checkpoints": len(rec.get("saves", [])),
            **stall_figures(rec, median),
            "save_call_s": [x["call_s"] for x in rec.get("saves", [])],
            "engine_save_s": [x.get("engine_save_s", 0.0) for x in rec.get("saves", [])],
            "staged_files": [x.get("staged_files", 0) for x in rec.get("saves", [])],
            "persisted_s": [c["persisted_s"] for c in rec.get("commits", [])]
            or [d["persisted_s"] for d in rec.get("dcp", [])],
            "committed_s": [c["committed_s"] for c in rec.get("commits", [])],
            "engine_stall_s": [c["stall_s"] for c in rec.get("commits", [])],
            "engine_queued_at_step_s": [c["queued_s"] for c in rec.get("commits", []) if "queued_s" in c],
            "engine_cpu_s": [c.get("engine_cpu_s", {}) for c in rec.get("commits", [])],
            "queue_split_median_s": queue_split(rec),
            "checkpoint_bytes": max((c["bytes"] for c in rec.get("commits", [])), default=None),
            # the bytes of the rank that wrote most, at each checkpoint (several ranks: balance_writes)
            "slowest_rank_bytes": [
                max(c["rank_bytes"]) for c in rec.get("commits", []) if c.get("rank_bytes")
            ],
            "memory": rec.get("memory"),
            "dcp_staging_waits_s": rec.get("dcp_staging_waits_s"),
            "raw_copy_s": rec.get("raw_copy_s"),
        }
        m = modes[name]
        if m["stall_median_s"] is not None and name != "stress":  # share of training time lost to checkpoints
            interval_s = args.interval * m["median_quiet_iteration_s"]
            m["stall_share_of_interval"] = m["stall_median_s"] / interval_s
        m["flush_phase_slowdown"] = flush_phase_slowdown(rec, args.interval)
        m["excess_after_s"] = excess_after(rec, args.interval)
        overhead = overhead_vs_none(rec, records["none"], args.interval) if name != "none" else None
        m["overhead_vs_none"] = overhead
        for part in ("total", "stall", "flush", "far"):
            if overhead is not None and part in overhead:
                m[f"overhead_{part}"] = overhead[part]
        if modes["none"]["mean_iteration_s"] and modes[name]["mean_iteration_s"]:
            modes[name]["throughput_loss"] = (
                modes[name]["mean_iteration_s"] / modes["none"]["mean_iteration_s"] - 1
            )
    first = {name: _first_step_s(rec) for name, rec in records.items() if name != "stress"}
    # The scratch start: the median over every run that builds the model from scratch (the first run of a
    # call, cold, may take a second more than the others; a single run as the baseline swung the ratio).
    scratch = [v for k, v in first.items() if not k.startswith("restore") and v is not None]
    first["scratch_median"] = statistics.median(scratch) if scratch else None
    restore = {
        name: v - first["scratch_median"]
        for name, v in first.items()
        if name.startswith("restore-") and v is not None and scratch
    }
    if modes["stress"]["mean_iteration_s"]:  # every iteration carries one checkpoint: its cost, on average
        modes["stress"]["cost_per_checkpoint_s"] = modes["stress"]["mean_iteration_s"] - median
    ratios = {}
    ds = modes["datastates"]["stall_median_s"]
    for key, other in (("stall_vs_native", "torch"), ("stall_vs_dcp", "dcp"), ("stall_vs_dcp_zo", "dcp-zo")):
        if modes[other]["stall_median_s"] and ds is not None:
            ratios[key] = ds / modes[other]["stall_median_s"]
        local = modes["datastates"]["stall_local_median_s"], modes[other]["stall_local_median_s"]
        if local[0] is not None and local[1]:
            ratios[f"{key}_local"] = local[0] / local[1]
    one = modes.get("datastates-onewriter", {}).get("persisted_s")
    if one and modes["datastates"]["persisted_s"]:  # balanced writes against rank 0 of the replicas writing
        ratios["persisted_vs_one_writer"] = statistics.median(modes["datastates"]["persisted_s"]) / (
            statistics.median(one)
        )
    pairs = restore_pairs(restore)
    if pairs:
        ratios["restore_speedup_vs_native"] = statistics.median(pairs)
        if len(pairs) > 1:
            ratios["restore_speedup_by_pair"] = pairs
    # When each run's set-up phases ended (seconds after the trainer's construction began).
    marks = {k: {"init_s": v["init_s"], **v.get("marks", {})} for k, v in records.items() if "init_s" in v}
    return {
        "command": " ".join(sys.argv),
        "gpu": _gpu_name(),
        "model": args.model,
        "layout": getattr(args, "layout", "1gpu"),
        "micro_batch": getattr(args, "micro_batch", None),
        "fp32_grads": not getattr(args, "no_fp32_grads", False),
        "steps": args.steps,
        "interval": args.interval,
        "sync": getattr(args, "sync", "device"),  # results before --sync were timed with device
        "median_iteration_s": median,
        "modes": modes,
        "restore_to_first_step_s": restore,
        "first_step_end_s": first,
        "setup_marks_s": marks,
        # Nanotron's dummy data restarts from its seed on resume, so a resumed run is compared with the run
        # resumed from the other engine's checkpoint of the same step (same data), and the two training
        # runs with each other (the same seed: equal if training is deterministic).
        "resume_losses": {
            "restore-datastates vs restore-torch": loss_match(
                records.get("restore-datastates", {}), records.get("restore-torch", {})
            ),
            "datastates vs torch": loss_match(records.get("datastates", {}), records.get("torch", {})),
        },
        "ratios": ratios,
        "runs": {k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in records.items()},
    }


def restore_pairs(restore: dict[str, float]) -> list[float]:
    """Native's restore time over datastates', for each pair of restores run one after the other."""
    out = []
    for name, native in restore.items():
        if name.startswith("restore-torch"):
            ours = restore.get(name.replace("restore-torch", "restore-datastates"))
            if ours is not None and ours > 0:
                out.append(native / ours)
    return out


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _first_step_s(rec: dict[str, Any]) -> float | None:
    """When the first step ended, after the trainer's construction began, Nanotron main's library report
    (collect_env: subprocesses, the same work in every mode) left out."""
    ends = rec.get("ends")
    return ends[0][1] - rec.get("marks", {}).get("library_report_s", 0.0) if ends else None


def table(r: dict[str, Any]) -> str:
    def ms(x: Any) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    lines = [
        f"model {r['model']} on {r.get('layout', '1gpu')}, {r['steps']} steps, checkpoint every "
        f"{r['interval']}; median iteration {ms(r['median_iteration_s'])} ms",
        "",
        "| mode | checkpoints | median stall ms | local stall ms | stall / interval | flushing vs idle | "
        "mean iteration ms | mean vs none | persisted s | host GB: PSS (shm peak) | GPU peak GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in r["modes"].items():
        loss = m.get("throughput_loss")
        persisted = ", ".join(f"{p:.2f}" for p in m["persisted_s"][:6]) or "-"
        stall, mean = ms(m["stall_median_s"]), ms(m["mean_iteration_s"])
        loss_text = "-" if loss is None else f"{100 * loss:+.1f}%"
        share = m.get("stall_share_of_interval")
        share_text = "-" if share is None else f"{100 * share:.2f}%"
        flush = m.get("flush_phase_slowdown")
        flush_text = "-" if flush is None else f"{100 * flush:+.1f}%"
        local = ms(m.get("stall_local_median_s"))
        mem = m.get("memory") or {}
        # results written when PSS was sampled in the background name it by its peak
        old = mem.get("host_peak_pss_tree_bytes", mem.get("host_peak_rss_bytes", 0))
        pss = mem.get("host_pss_tree_bytes", old)
        host = f"{pss / 1e9:.1f} ({mem['shm_peak_bytes'] / 1e9:.1f})" if mem else "-"
        gpu = f"{mem['gpu_max_reserved_bytes'] / 1e9:.1f}" if mem else "-"
        cells = [name, m["checkpoints"], stall, local, share_text, flush_text, mean, loss_text, persisted]
        cells += [host, gpu]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "restore to the first step, over the median scratch start: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["restore_to_first_step_s"].items()),
        "first step ends, after the trainer's construction began: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["first_step_end_s"].items() if v is not None),
        "losses equal, bit for bit (training is not deterministic here, so False is expected: "
        "nanotron_proof.py compares the restored state itself): "
        + ", ".join(
            f"{k} {v['bitwise']} ({len(v['steps'])} steps, largest difference {v['max_abs_diff']})"
            for k, v in r["resume_losses"].items()
        ),
        "ratios: " + ", ".join(f"{k} {_figure(v)}" for k, v in r["ratios"].items()),
        "bytes of the rank that wrote most, GB: "
        + ", ".join(
            f"{k} {', '.join(f'{b / 1e9:.2f}' for b in m['slowest_rank_bytes'])}"
            for k, m in r["modes"].items()
            if m.get("slowest_rank_bytes")
        ),
        "",
    ]
    return "\n".join(lines)


def _figure(v: float | list[float]) -> str:
    return f"[{', '.join(f'{x:.2f}' for x in v)}]" if isinstance(v, list) else f"{v:.4f}"


def plot(records: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name in ("none", "torch", "dcp", "datastates"):
        it = iteration_times(records.get(name, {}))
        steps = [s for s in it if s > WARMUP]
        ax.plot(steps, [1e3 * it[s] for s in steps], label=name, marker=".", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("iteration time (ms, log)")
    ax.set_title(f"Nanotron {args.model}: iteration time, checkpoint every {args.interval} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
