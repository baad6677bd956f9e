"""The engine's Python a memory checkpoint costs, thread by thread (CPU, no GPU): Nanotron's Llama of the
adapter's tests (`tests/adapter/cpu_ranks.py`, Nanotron's real classes on a gloo world of one) with `--layers`
layers, its real Saver with the memory tier, staged, a memory checkpoint every 2 steps and `--gap` seconds
between a step's start (where Nanotron's loop asks for a memory checkpoint) and its optimizer step: the
forward and backward passes the engine's threads run beside. Over each round's
checkpoints: each thread's CPU a checkpoint (/proc: the training thread, the queuer, the committer, and the
core's threads by role), and the training thread's own time a checkpoint: its queuing as the Saver reports
it (the capture where it runs on the training thread, the hand-over) and, apart, the request (the
manager's memory checkpoint, timed around it).

    python3 benchmarks/micro/bench_saver_threads.py --out DIR [--layers 8 --steps 300 --gap 0.03 --rounds 3
        --idle-threads 0 --gil-rate 0]

`--gil-rate N` (py-spy on PATH, allowed to attach to this process: root, or ptrace_scope 0): each round is
also sampled N times a second by `py-spy record --gil`, attached for the round alone, and the milliseconds a
checkpoint each Python thread held the GIL are added (`gil_ms`): what the training thread's own Python waits
for, where the thread CPU also counts the system calls and core calls made off the GIL.

Writes DIR/bench_saver_threads.json. `--nanotron-src` (default: ../shared/nanotron/7bc99232/src beside the
checkout): the Nanotron tree, with `cpu_stand_ins.py` beside the trees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the helpers in benchmarks/
from _common import command_info, host_info  # noqa: E402
from gil_summary import summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300, help="steps a round (a checkpoint every 2)")
    ap.add_argument("--gap", type=float, default=0.03, help="seconds between steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--idle-threads",
        type=int,
        default=0,
        help="idle threads beside, as a GPU trainer's process holds (torch's, NCCL's, CUDA's: 100 or more)",
    )
    ap.add_argument("--gil-rate", type=float, default=0.0, help="py-spy --gil samples a second (0: none)")
    ap.add_argument("--nanotron-src", default=str(ROOT.parent / "shared" / "nanotron" / "7bc99232" / "src"))
    args = ap.parse_args()
    src = Path(args.nanotron_src).resolve()
    sys.path[:0] = [str(src), str(src.parents[1]), str(ROOT / "tests" / "adapter"), str(ROOT / "tests")]
    import cpu_stand_ins  # noqa: F401 - before anything imports nanotron

    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        os.environ.setdefault(k, v)
    # the tier in node memory, as a trainer's (/dev/shm), the rest in the temporary folder
    idle = threading.Event()
    for _ in range(args.idle_threads):
        threading.Thread(target=idle.wait, daemon=True).start()
    folder, prefix = tempfile.TemporaryDirectory, "ds-saver-threads-"
    with folder(prefix=prefix) as work, folder(prefix=prefix, dir="/dev/shm") as shm:
        rounds = run(Path(work), Path(shm), args)
    idle.set()
    per = {k: statistics.median(r["cpu_ms"].get(k, 0.0) for r in rounds) for k in rounds[0]["cpu_ms"]}
    gil = {k: statistics.median(r["gil_ms"].get(k, 0.0) for r in rounds) for k in rounds[0].get("gil_ms", {})}
    result = {
        "what": "CPU a memory checkpoint by thread (ms), the median of the rounds; the training thread's own "
        "time a checkpoint: its queuing (training_thread_ms) and its request (request_ms); with --gil-rate, "
        "the ms a checkpoint each Python thread held the GIL (gil_ms)",
        "command": command_info(),
        "host": host_info([tempfile.gettempdir()]),
        "settings": vars(args),
        "cpu_ms_median": dict(sorted(per.items())),
        "gil_ms_median": dict(sorted(gil.items())),
        "training_thread_ms_median": statistics.median(r["training_thread_ms"] for r in rounds),
        "request_ms_median": statistics.median(r["request_ms"] for r in rounds),
        "rounds": rounds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_saver_threads.json").write_text(json.dumps(result, indent=1) + "\n")
    keys = ("cpu_ms_median", "gil_ms_median", "training_thread_ms_median", "request_ms_median")
    print(json.dumps({k: result[k] for k in keys}, indent=1))


def run(work: Path, shm: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Saver driven as Nanotron's loop drives it; one record a round."""
    import cpu_ranks
    import torch.distributed as tdist

    from nanotron_datastates import DataStatesEngine, cpu_use
    from nanotron_datastates.nanotron.manager import CheckpointManager
    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.nanotron.save.saver import Saver
    from nanotron_datastates.nanotron.trainer import DataStatesTrainer
    from nanotron_datastates.trainer_settings import TrainerSettings

    tdist.init_process_group("gloo", init_method=f"file://{work}/init", rank=0, world_size=1)
    pc, c = cpu_ranks.parallel_context(), cpu_ranks.config()
    c.model.model_config.num_hidden_layers = args.layers
    model, optimizer, lr_scheduler, random_states = cpu_ranks.training_state(pc, c)
    engine = DataStatesEngine(host_cache_size=1 / 16, chunk_size=1)
    settings = TrainerSettings(
        memory_tier=True, memory_tier_path=str(shm), memory_interval=2, device_snapshot="always"
    )
    t = DataStatesTrainer.__new__(DataStatesTrainer)  # as Nanotron's loop holds it (the adapter's tests)
    t.config, t.parallel_context, t.current_dataloader = c, pc, iter(())
    c.data_stages = None
    t.optimizer, t.lr_scheduler, t.random_states = optimizer, lr_scheduler, random_states
    t.iteration_step, t.s3_mover = 1, None
    saver = Saver(engine, settings, pc, model, optimizer, work / "ckpt")
    t.datastates = CheckpointManager(t, Resume(), saver)
    t.datastates.stepped = True
    queued: list[float] = []  # the training thread's seconds of each checkpoint taken

    def observe(event: str, fields: dict[str, object]) -> None:
        if event == "queued":
            queued.append(float(fields["seconds"]))  # type: ignore[arg-type]

    saver.observers.append(observe)
    asked: list[float] = []  # the training thread's seconds in each memory checkpoint's request
    take = t.datastates.memory_checkpoint

    def timed_request() -> None:
        due = t.datastates.memory_due()
        t0 = time.perf_counter()
        take()
        if due is not None:
            asked.append(time.perf_counter() - t0)

    t.datastates.memory_checkpoint = timed_request  # type: ignore[method-assign]
    saver.start()
    saver.after_first_step()

    def iteration(at: int) -> None:
        t.metadata = cpu_ranks.training_metadata(at)
        t._update_dataloader_based_on_training_stages(None)  # the mixin's memory checkpoint, where due
        time.sleep(args.gap)  # the forward and backward passes, between the request and the step
        saver.before_step()
        saver.after_step()

    def python_threads() -> dict[str, float]:
        out = {}
        for th in threading.enumerate():
            if th.native_id is not None and (
                th is threading.main_thread() or th.name.startswith("datastates")
            ):
                out[th.name] = cpu_use.thread_seconds(th.native_id)
        return out

    try:  # a failure (py-spy unable to attach, say) stops the Saver's threads too
        at, rounds = 1, []
        for _ in range(20):  # the first checkpoints: the tier's files taken over from then on
            iteration(at)
            at += 1
        for _ in range(args.rounds):
            saver.take(saver.outstanding, lambda s: None)
            a0 = len(asked)
            n0, skipped0, py0, core0 = (
                len(queued),
                len(saver.memory_skipped),
                python_threads(),
                cpu_use.thread_cpu(),
            )
            sampler = GilSampler(args.gil_rate, work / f"gil-{len(rounds)}.txt") if args.gil_rate else None
            for _ in range(args.steps):
                iteration(at)
                at += 1
            saver.take(saver.outstanding, lambda s: None)  # their commits counted too
            py1, core = python_threads(), cpu_use.since(core0)
            held = sampler.stop() if sampler is not None else None
            taken = len(queued) - n0
            cpu = {k: (py1[k] - py0.get(k, 0.0)) for k in py1}
            cpu.update({f"ds-{k}": v for k, v in core.items()})
            rounds.append(
                {
                    "checkpoints": taken,
                    "skipped": len(saver.memory_skipped) - skipped0,
                    "cpu_ms": {k: round(v / taken * 1e3, 3) for k, v in sorted(cpu.items())},
                    "training_thread_ms": round(statistics.median(queued[n0:]) * 1e3, 3),
                    "request_ms": round(statistics.median(asked[a0:]) * 1e3, 3),
                }
            )
            if held is not None:
                rounds[-1]["gil_ms"] = {k: round(v / taken * 1e3, 3) for k, v in sorted(held.items())}
            print(rounds[-1], flush=True)
    finally:
        saver.close()
        engine.close()
    return rounds


class GilSampler:
    """`py-spy record --gil` attached to this process from now until `stop()`, `rate` samples a second."""

    def __init__(self, rate: float, raw: Path) -> None:
        self.rate, self.raw = rate, raw
        if shutil.which("py-spy") is None:
            raise RuntimeError("--gil-rate needs py-spy on PATH (python3 -m pip install py-spy)")
        command = ["py-spy", "record", "--gil", "--threads", "-r", f"{rate:g}", "-f", "raw", "-o", str(raw)]
        self.process = subprocess.Popen(
            [*command, "--pid", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        time.sleep(1.0)  # attached before the round starts
        if self.process.poll() is not None:
            why = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            raise RuntimeError(f"py-spy could not attach to this process: {why.strip()}")

    def stop(self) -> dict[str, float]:
        """Seconds each Python thread (by name) held the GIL while sampled."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)
        with open(self.raw) as f:
            summary = summarize(f.readlines(), self.rate, top=1)
        return {who.partition(" | ")[2]: float(s["gil_s"]) for who, s in summary.items()}  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
