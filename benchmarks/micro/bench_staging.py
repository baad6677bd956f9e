"""What staging a checkpoint costs the training thread (GPU): its files staged one by one (a clone per
tensor, as the trainer did until NOTES step 19) against all together (`engine.save_plans`: one allocation per
dtype, one multi-tensor copy), with the layout made anew (a first checkpoint) and kept from the call before
(every later checkpoint of the same tensors: save/stage.py); and what a trainer's staging alone costs
(`engine.stage`), its buffers allocated each time or kept (`keep=True`).

    python3 benchmarks/bench_staging.py --model 180m --out DIR [--repeat 7 --dir /dev/shm/stage]

The state has the shapes of the trainer's checkpoint of Nanotron's Llama (`bench_nanotron.MODELS`): one file
per bf16 weight and one optimizer file (Adam's two moments, the step and fp32 master weights). For each way,
`--repeat` times, alternating: the time until the save calls return (what the training thread spends) and
until the GPU has run the copies too (synchronize). Plain torch, without the engine, is timed the same way:
a clone per tensor, against one allocation per dtype and `torch._foreach_copy_`. The files go to `--dir`
(/dev/shm by default: the disk is not what is measured), each save persisted and removed before the next.
Writes DIR/bench_staging_<model>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402
from _nanotron import BASE_CONFIG  # noqa: E402
from bench_nanotron import MODELS  # noqa: E402


def model_config(model: str) -> dict[str, Any]:
    """The model's shape as the benchmarks train it: the example config's, with `MODELS[model]` over it."""
    base = yaml.safe_load(BASE_CONFIG.read_text())["model"]["model_config"]
    return {**base, **MODELS[model]}


def llama_files(model: str, device: str) -> dict[str, Any]:
    """File name -> state, with the shapes of the trainer's checkpoint of the model."""
    c = model_config(model)
    h, inter, heads, kv = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
    )
    shapes = {"token_embedding": (c["vocab_size"], h), "final_layer_norm": (h,)}
    for i in range(c["num_hidden_layers"]):
        layer = {
            "qkv_proj": (h + 2 * kv * (h // heads), h),
            "o_proj": (h, h),
            "gate_up_proj": (2 * inter, h),
            "down_proj": (h, inter),
            "input_layernorm": (h,),
            "post_attention_layernorm": (h,),
        }
        shapes |= {f"decoder.{i}.{n}": s for n, s in layer.items()}
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    files: dict[str, Any] = {
        f"model/{n}.safetensors": {"data": rand(s, torch.bfloat16)} for n, s in shapes.items()
    }
    files["optimizer/optimizer.safetensors"] = {
        "state": {
            i: {
                "step": torch.tensor(400.0, device=device),
                "exp_avg": rand(s, torch.float32),
                "exp_avg_sq": rand(s, torch.float32).abs(),
            }
            for i, s in enumerate(shapes.values())
        },
        "master": {n: rand(s, torch.float32) for n, s in shapes.items()},
    }
    return files


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds until `fn` returns, until the GPU is done too, its result)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    sync()
    return t1 - t0, time.perf_counter() - t0, out


def clone_each(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def copy_grouped(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
        dsts = [d.view(t.shape) for d, t in zip(flat.split([t.numel() for t in group]), group)]
        torch._foreach_copy_(dsts, group)
        out += dsts
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--model", choices=sorted(MODELS), default="180m")
    a.add_argument("--out", required=True)
    a.add_argument("--dir", default="/dev/shm/ds_stage")
    a.add_argument("--repeat", type=int, default=7)
    a.add_argument("--cache-gib", type=float, default=4.0)
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = a.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (--device cpu: a smoke test of this script)", file=sys.stderr)
        return 2
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    from nanotron_datastates.save.stage import Stager
    from nanotron_datastates.save.staged_save import StagedSave

    files = llama_files(args.model, args.device)
    tensors = [t for s in files.values() for t in _tensors(s)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    folder = Path(args.dir)
    times: dict[str, dict[str, list[float]]] = {}

    def record(way: str, call_s: float, done_s: float) -> None:
        t = times.setdefault(way, {"call_s": [], "done_s": []})
        t["call_s"].append(call_s)
        t["done_s"].append(done_s)

    config = DataStatesConfig(host_cache_size=args.cache_gib)
    with DataStatesEngine(config) as engine, DataStatesEngine(config) as kept:
        for e in (engine, kept):
            e.prepare_cache(wait=True, nbytes=nbytes + len(files) * e.cache_stats()["chunk_bytes"])
        plans = [(engine.plan(state), folder / name) for name, state in files.items()]

        def together_new_layout() -> Any:
            engine._stager = Stager()  # as the first checkpoint of these tensors: the layout made anew
            return engine.save_plans(plans, stage=True)

        ways = {
            "one_by_one": lambda: [engine.save_plan(p, path, stage=True) for p, path in plans],
            "together_new_layout": together_new_layout,
            "together": lambda: engine.save_plans(plans, stage=True),  # the layout just made, kept
            # What a trainer's checkpoint stages before its step (the rest queued later, untimed here): the
            # buffers allocated and viewed each time, or kept from the last staging (`stage(keep=True)`).
            "stage": lambda: engine.stage([p for p, _ in plans]),
            # an engine of its own: another way's staging would let go of the kept memory
            "stage_kept_buffers": lambda: kept.stage([p for p, _ in plans], keep=True),
        }
        for k in range(args.repeat + 1):  # the first round warms up (allocator, pinning): left out
            for way, save in ways.items():
                (folder / "model").mkdir(parents=True, exist_ok=True)
                (folder / "optimizer").mkdir(parents=True, exist_ok=True)
                call_s, done_s, out = timed(save)
                if isinstance(out, StagedSave):
                    out.target([path for _, path in plans])
                    out.queue()
                engine.wait_persisted()
                kept.wait_persisted()
                shutil.rmtree(folder)
                if k:
                    record(way, call_s, done_s)
            for way, fn in (("torch_clone_each", clone_each), ("torch_copy_grouped", copy_grouped)):
                call_s, done_s, copies = timed(functools.partial(fn, tensors))
                del copies
                if k:
                    record(way, call_s, done_s)
    med = {w: {k: statistics.median(v) for k, v in t.items()} for w, t in times.items()}
    result = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__,
        "model": args.model,
        "files": len(files),
        "tensors": len(tensors),
        "bytes": nbytes,
        "median": med,
        "times": times,
        "speedup_call": med["one_by_one"]["call_s"] / med["together"]["call_s"],
        "speedup_call_kept_layout": med["together_new_layout"]["call_s"] / med["together"]["call_s"],
        "speedup_stage_kept_buffers": med["stage"]["call_s"] / med["stage_kept_buffers"]["call_s"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_staging_{args.model}.json").write_text(json.dumps(result, indent=1))
    for way, m in med.items():
        print(f"{way:20s} call {1e3 * m['call_s']:7.2f} ms   done {1e3 * m['done_s']:7.2f} ms")
    return 0


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


if __name__ == "__main__":
    sys.exit(main())
