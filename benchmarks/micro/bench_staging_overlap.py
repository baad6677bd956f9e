"""What staging a checkpoint on the GPU costs GPU-bound steps, by the stream it runs on (GPU).

A memory checkpoint of the 1.1B copies its 14.5 GB of state into GPU memory before the next optimizer step
changes it (`device_snapshot`), and the copies to the host read that copy. The staging reads and writes
29 GB of GPU memory, about 9 ms at an H100's bandwidth, and runs on the training stream, in series with the
forward pass. This benchmark asks whether another stream hides it behind the forward and backward passes,
whose matrix products leave the memory bandwidth mostly unused.

Each step emulates a GPU-bound training step: a chain of bf16 matrix products (`--n` products of `--size`,
kept a few batches ahead of the GPU, as a training loop is), then an "optimizer step" that reads and writes
every tensor of the state (`_foreach_add_`), then a synchronization (as the benchmarks' training loop has).
The state is shaped like the 1.1B's on one GPU: `--bf16-gb` of bf16 in 134 tensors, `--fp32-gb` of fp32 in
536. Ways, each staging the whole state at every step:

* `none`: no staging, the reference;
* `same`: one multi-tensor copy per dtype on the training stream, queued before the step's products (the
  package's way: a memory checkpoint's capture queues it in order after the step just taken);
* `side`: the same copies queued by another thread on a stream of their own, which waits for the end of the
  last optimizer step; the optimizer step waits for their end;
* `side-memcpy`: as `side`, a `copy_` per tensor (the driver's memcpy, done by the copy engines).

    CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/micro/bench_staging_overlap.py --out DIR

Per way: the step's median time and its excess over `none` (rounds interleaved), and the staging's own
time on an idle GPU. Writes DIR/bench_staging_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_one_queue, beside this one
from bench_one_queue import header, products  # noqa: E402

WAYS = ("none", "same", "side", "side-memcpy")


class State:
    """The state and its staging buffers: `copy` queues one staging of it on the current stream,
    `stage_beside` on the side stream from another thread."""

    def __init__(self, bf16_gb: float, fp32_gb: float) -> None:
        def tensors(gb: float, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
            numel = int(gb * 1e9 / n / torch.empty((), dtype=dtype).element_size())
            return [torch.randn(numel, device="cuda").to(dtype) for _ in range(n)]

        self.src = tensors(bf16_gb, 134, torch.bfloat16) + tensors(fp32_gb, 536, torch.float32)
        self.dst = [torch.empty_like(t) for t in self.src]
        self.by_dtype = {
            d: ([t for t in self.dst if t.dtype == d], [t for t in self.src if t.dtype == d])
            for d in (torch.bfloat16, torch.float32)
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)
        self.side = torch.cuda.Stream()

    def copy(self, memcpy: bool) -> None:
        if memcpy:
            for d, s in zip(self.dst, self.src):
                d.copy_(s)
        else:
            for dsts, srcs in self.by_dtype.values():
                torch._foreach_copy_(dsts, srcs)

    def stage_beside(self, memcpy: bool) -> tuple[threading.Thread, list[torch.cuda.Event]]:
        """The staging queued by a thread on the side stream after what the training stream holds now."""
        ready = torch.cuda.Event()
        ready.record()
        done: list[torch.cuda.Event] = []

        def run() -> None:
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                self.copy(memcpy)
                ev = torch.cuda.Event()
                ev.record(self.side)
                done.append(ev)

        t = threading.Thread(target=run)
        t.start()
        return t, done

    def optimizer_step(self) -> None:
        for _, srcs in self.by_dtype.values():
            torch._foreach_add_(srcs, 1e-3)


def step(
    state: State, way: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, ahead: int
) -> float:
    """One emulated training step with the staging of `way`; seconds from its start to its end on the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    beside = None
    if way == "same":
        state.copy(memcpy=False)
    elif way.startswith("side"):
        beside = state.stage_beside(memcpy=way == "side-memcpy")
    products(a, b, c, n, ahead)
    if beside is not None:  # the gate: the optimizer step waits for the staging
        thread, done = beside
        thread.join()
        torch.cuda.current_stream().wait_event(done[0])
    state.optimizer_step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def staging_alone(state: State, memcpy: bool, repeats: int = 5) -> float:
    """Seconds one staging takes on an idle GPU (median)."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        state.copy(memcpy)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4, help="steps of each way a round")
    ap.add_argument("--size", type=int, default=4096, help="the products' square size")
    ap.add_argument("--n", type=int, default=600, help="products in a step")
    ap.add_argument("--ahead", type=int, default=3, help="batches of 20 products queued ahead of the GPU")
    ap.add_argument("--bf16-gb", type=float, default=2.2)
    ap.add_argument("--fp32-gb", type=float, default=12.3)
    ap.add_argument("--ways", default=",".join(WAYS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        ap.error(f"unknown ways {sorted(unknown)}: expected some of {','.join(WAYS)}")
    state = State(args.bf16_gb, args.fp32_gb)
    a, b, c = (torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for w in ways:  # warm every way up: kernels loaded, streams made
        step(state, w, a, b, c, args.n, args.ahead)
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for w in ways:
            times[w].extend(step(state, w, a, b, c, args.n, args.ahead) for _ in range(args.steps))
    base = statistics.median(times["none"]) if "none" in times else None
    alone = {"same": staging_alone(state, False), "side-memcpy": staging_alone(state, True)}
    med = {
        w: {
            "step_s": statistics.median(t),
            "excess_ms": 1e3 * (statistics.median(t) - base) if base else None,
            "excess": statistics.median(t) / base - 1 if base else None,
        }
        for w, t in times.items()
    }
    result = {
        **header(args),
        "state_bytes": state.nbytes,
        "staging_alone_s": {"foreach": alone["same"], "memcpy": alone["side-memcpy"]},
        "median": med,
        "raw": {"step_s": times},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_staging_overlap.json").write_text(json.dumps(result, indent=1))
    conn = result["cuda_device_max_connections"]
    print(
        f"connections={conn} state {state.nbytes / 1e9:.2f} GB, staging alone: foreach "
        f"{1e3 * alone['same']:.1f} ms, memcpy {1e3 * alone['side-memcpy']:.1f} ms"
    )
    for w, m in med.items():
        excess = "" if m["excess"] is None else f"  {m['excess_ms']:+6.1f} ms ({100 * m['excess']:+.1f}%)"
        print(f"connections={conn} {w:12s} step {1e3 * m['step_s']:7.1f} ms{excess}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
