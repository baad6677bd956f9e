"""What planning an optimizer's file costs the training thread at each checkpoint (CPU): `plan_save` of a
state shaped like Nanotron's optimizer state (per parameter `exp_avg`, `exp_avg_sq`, `step`, and the fp32
master copy of the gradient accumulator; a param group per parameter, with the learning rate; `names`), fresh
and `like` the previous checkpoint's plan, the learning rate changed before each; and `freeze` (the copy of
the state's containers and the check that it holds the plan's tensors, which is all a checkpoint staged on
the GPU does before the optimizer step: its plan is made once the step is launched).

    python3 benchmarks/micro/bench_plan.py --out DIR [--params 51 --repeat 200]

Writes DIR/bench_plan.json with every time and the medians. 51 parameters: the 180M model of
benchmarks/bench_nanotron.py on one GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402

from nanotron_datastates.save.plan import plan_save  # noqa: E402
from nanotron_datastates.skeleton import freeze  # noqa: E402


def optimizer_state(params: int) -> dict[str, Any]:
    """Nanotron's optimizer state dict: one param group per parameter (torch's AdamW's keys), per parameter
    `exp_avg`, `exp_avg_sq` and `step`, the names, and the fp32 master weights of its gradient accumulator."""
    names = {i: f"model.decoder.{i // 9}.pp_block.w{i % 9}" for i in range(params)}
    return {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16), "exp_avg_sq": torch.zeros(16)}
            for i in range(params)
        },
        "param_groups": [
            {
                "lr": 3e-4,
                "weight_decay": 0.01,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "initial_lr": 3e-4,
                "params": [i],
            }
            for i in range(params)
        ],
        "names": names,
        "gradient_accumulator": {name: torch.zeros(16) for name in names.values()},
    }


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--params", type=int, default=51)
    a.add_argument("--repeat", type=int, default=200)
    args = a.parse_args()
    state = optimizer_state(args.params)
    times: dict[str, list[float]] = {"fresh": [], "like": [], "freeze": []}
    last = plan_save(state)
    for k in range(args.repeat):  # alternating, so that all see the same machine
        for group in state["param_groups"]:
            group["lr"] = 3e-4 * (1 - k / (2 * args.repeat))
        for mode in ("fresh", "like", "freeze"):
            t = time.perf_counter()
            if mode == "freeze":  # what a staged checkpoint does before the step; it plans after it
                _, tensors = freeze(state)  # and the Saver's check that the kept plan still holds them
                assert last.holds(tensors)
            else:
                plan = plan_save(state, like=last if mode == "like" else None)
            times[mode].append(time.perf_counter() - t)
            if mode == "like":
                last = plan
    result = {
        "command": command_info(),
        "tensors": len(last.arrays),
        "median_ms": {m: statistics.median(v) * 1e3 for m, v in times.items()},
        "times_s": times,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_plan.json").write_text(json.dumps(result, indent=1))
    print(f"{result['tensors']} tensors: fresh {result['median_ms']['fresh']:.2f} ms, "
          f"like the last {result['median_ms']['like']:.2f} ms, freeze and check "
          f"{result['median_ms']['freeze']:.2f} ms (medians of {args.repeat})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
