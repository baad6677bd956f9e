"""What a resharding resume reads from storage, per rank: the optimizer state of the 180M Llama (Nanotron's
example config: hidden 1024, 8 layers, vocabulary 32000, tied embeddings; 154,420,224 elements per kind),
saved as ZeRO-1 shards over `--saved-dp` ranks, each shard holding Adam's two moments and the fp32 master
weights of its flat range of every parameter. Each rank of each new layout rebuilds its own part through
the reshard's own plan and reader (`reshard_plan.plan`, `reshard._read`), from a cold page cache, once
reading only the ranges that hold its part (`ranged`) and once each saved tensor it touches whole
(`whole`, how the reshard read before block checksums). Before each read the checkpoint's files are evicted
from the page cache; what the read brought back is counted from the page cache (`resident_bytes`: mincore),
so that it is these files' bytes alone (the process's `read_bytes` is kept beside it: it also counts code
pages and readahead). Both modes check every byte they read against its checksum.

The same for the weights (bf16, one file per parameter and tensor-parallel rank, saved as Nanotron's are:
its metadata alone in the header, the checksums per tensor and per block in the manifest's entry), from
one tensor-parallel size to another (`--weights`, SAVEDxNEW).

    python3 benchmarks/bench_reshard_reads.py --dir /work/bench --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from _common import command_info, evict, host_info, resident_bytes, summarize, write_json

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.checkpoint.checksums import file_entry
from nanotron_datastates.nanotron.resume import reshard
from nanotron_datastates.nanotron.resume.saved_layout import zero_ranges
from nanotron_datastates.resume import reshard_plan
from nanotron_datastates.resume.reshard_plan import Need, Piece, Source

KINDS = ("exp_avg", "exp_avg_sq", "master")
# The 180M model's parameters: (name, shape, tensor-parallel split dim or None, contiguous chunks on it).
LAYER = [
    ("input_layernorm", (1024,), None, None),
    ("qkv_proj", (1536, 1024), 0, (1024, 256, 256)),
    ("o_proj", (1024, 1024), 1, None),
    ("post_attention_layernorm", (1024,), None, None),
    ("gate_up_proj", (8192, 1024), 0, (4096, 4096)),
    ("down_proj", (1024, 4096), 1, None),
]
PARAMS = [("token_embedding", (32000, 1024), 0, None)]
PARAMS += [(f"layers.{i}.{n}", s, d, c) for i in range(8) for n, s, d, c in LAYER]
PARAMS += [("final_layer_norm", (1024,), None, None)]


@dataclasses.dataclass(frozen=True)
class Pair:  # the two attributes of Nanotron's SlicesPair that a plan reads
    local_slices: tuple[slice, ...]
    global_slices: tuple[slice, ...]


def pieces_of(shape: tuple[int, ...], tp: int, split: int | None, chunks: Any) -> dict[int, Piece]:
    """{tp rank: Piece} as Nanotron slices a parameter (rank -1: not sharded)."""
    every = tuple(slice(None) for _ in shape)
    if split is None or tp == 1:
        return {-1 if split is None else 0: Piece(shape, (Pair(every, every),))}
    out = {}
    for rank in range(tp):
        local = tuple(n // tp if d == split else n for d, n in enumerate(shape))
        pick = lambda s: tuple(s if d == split else slice(None) for d in range(len(shape)))  # noqa: E731
        pairs, lo, g0 = [], 0, 0
        for c in chunks or (shape[split],):
            size = c // tp
            pairs.append(
                Pair(pick(slice(lo, lo + size)), pick(slice(g0 + rank * size, g0 + (rank + 1) * size)))
            )
            lo, g0 = lo + size, g0 + c
        out[rank] = Piece(local, tuple(pairs))
    return out


def save(engine: DataStatesEngine, folder: Path, dp: int) -> None:
    """One file per dp rank, each the ZeRO-1 flat ranges of every parameter, three kinds each."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(dp):
        state = {}
        for name, shape, _, _ in PARAMS:
            numel = torch.Size(shape).numel()
            a, b = zero_ranges(numel, dp).get(rank, (0, 0))
            for kind in KINDS:
                state[f"{name}/{kind}"] = torch.full((b - a,), float(rank + 1))
        engine.save(state, folder / f"dp-{rank}.safetensors").wait_persisted()  # one file's state at a time


def rank_reads(folder: Path, saved_dp: int, tp: int, dp: int, t: int, d: int, ranged: bool) -> list:
    """(file, tensor, elements) of everything rank (t, d) of the new layout reads."""
    out = []
    for name, shape, split, chunks in PARAMS:
        numel = torch.Size(shape).numel()
        saved_piece = pieces_of(shape, 1, split, chunks)
        (key,) = saved_piece
        mine = pieces_of(shape, tp, split, chunks)
        piece = mine.get(t, mine.get(-1))
        local = torch.Size(piece.local_shape).numel()
        zero = zero_ranges(local, dp).get(d, (0, 0))
        for kind in KINDS:
            sources = []
            for r, (a, b) in zero_ranges(numel, saved_dp).items():
                sources.append(Source(folder / f"dp-{r}.safetensors", f"{name}/{kind}", (a, b)))
            if not ranged:  # every saved tensor of the parameter, whole
                out += [(s.path, s.tensor, (0, s.flat[1] - s.flat[0])) for s in sources]
                continue
            need = Need(0, (zero[1] - zero[0],), shape, piece, zero)
            out += reshard_plan.plan(name, need, {key: (saved_piece[key], sources)}).ranges()
    return out


def save_weights(engine: DataStatesEngine, folder: Path, tp: int) -> dict[str, Any]:
    """Each parameter's pieces over `tp` ranks, one file each; the manifest that keeps their checksums."""
    files = {}
    for name, shape, split, chunks in PARAMS:
        for t, piece in pieces_of(shape, tp, split, chunks).items():
            rel = f"model/{name}_tp-{t}.safetensors"
            h = engine.save(
                {"data": torch.full(piece.local_shape, float(t + 2), dtype=torch.bfloat16)},
                folder / rel,
                exact_metadata=True,
            )
            h.wait_persisted()
            files[rel] = file_entry((folder / rel).stat().st_size, h)
    return {"files": files}


def weight_reads(folder: Path, saved_tp: int, tp: int, t: int, ranged: bool) -> list:
    """(file, tensor, elements) of the weights rank t of tensor-parallel size `tp` reads."""
    out = []
    for name, shape, split, chunks in PARAMS:
        saved = {}
        for r, piece in pieces_of(shape, saved_tp, split, chunks).items():
            path = folder / f"model/{name}_tp-{r}.safetensors"
            saved[r] = (piece, [Source(path, "data", (0, torch.Size(piece.local_shape).numel()))])
        mine = pieces_of(shape, tp, split, chunks)
        piece = mine.get(t, mine.get(-1))
        need = Need(-1, piece.local_shape, shape, piece, None)
        ranges = list(reshard_plan.plan(name, need, saved).ranges())
        if not ranged:  # each file the plan touches, whole
            sizes = {src.path: src.flat[1] for _, sources in saved.values() for src in sources}
            touched = dict.fromkeys((p, x) for p, x, _ in ranges)
            ranges = [(p, x, (0, sizes[p])) for p, x in touched]
        out += ranges
    return out


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def measure(engine: DataStatesEngine, files: list[Path], ranges: list, sums: Any = None) -> dict[str, Any]:
    """One cold read of `ranges` through the reshard's reader: seconds, bytes brought into the page cache
    from `files`, the process's read_bytes, and the bytes of the tensors returned."""
    os.sync()
    evict(files)
    before, t0 = read_bytes(), time.perf_counter()
    got = reshard._read(engine, ranges, sums)
    seconds = time.perf_counter() - t0
    return {
        "s": seconds,
        "bytes": resident_bytes(files),
        "process_read_bytes": read_bytes() - before,
        "tensor_bytes": sum(x.numel() * x.element_size() for x in got.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="scratch folder on the storage to measure")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--saved-dp", type=int, default=2)
    ap.add_argument("--layouts", default="1x4,1x8,2x2,2x4", help="new layouts, TPxDP (ZeRO-1)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks measured per layout (the first ones)")
    ap.add_argument("--weights", default="1x2,1x4,2x4", help="weights: saved TP x new TP")
    args = ap.parse_args()
    folder = args.dir / "reshard_reads"
    shutil.rmtree(folder, ignore_errors=True)
    config = DataStatesConfig(host_cache_size=2.0, parser_threads=2)
    rows = []
    with DataStatesEngine(config) as engine:
        save(engine, folder, args.saved_dp)
        files = sorted(folder.iterdir())
        for layout in args.layouts.split(","):
            tp, dp = (int(x) for x in layout.split("x"))
            for rank in range(min(args.ranks, tp * dp)):
                t, d = divmod(rank, dp)
                row: dict[str, Any] = {"tp": tp, "dp": dp, "tp_rank": t, "dp_rank": d}
                for mode in ("whole", "ranged"):
                    ranges = rank_reads(folder, args.saved_dp, tp, dp, t, d, mode == "ranged")
                    row.update({f"{mode}_{k}": v for k, v in measure(engine, files, ranges).items()})
                print(json.dumps(row), flush=True)
                rows.append(row)
        total = sum(f.stat().st_size for f in files)
        shutil.rmtree(folder, ignore_errors=True)
        weight_rows = measure_weights(engine, args.dir / "reshard_weights", args.weights, args.ranks)
    result = {
        "command": command_info(),
        "host": host_info([str(args.dir)]),
        "cache_drop": "the files evicted (POSIX_FADV_DONTNEED) before each read",
        "saved_dp": args.saved_dp,
        "checkpoint_bytes": total,
        "rows": rows,
        "ranged_over_whole_bytes": summarize([r["ranged_bytes"] / r["whole_bytes"] for r in rows]),
        "ranged_over_whole_time": summarize([r["ranged_s"] / r["whole_s"] for r in rows]),
        "weight_rows": weight_rows,
        "weights_ranged_over_whole_bytes": summarize(
            [r["ranged_bytes"] / r["whole_bytes"] for r in weight_rows]
        ),
    }
    write_json(args.out / "reshard_reads.json", result)


def measure_weights(engine: DataStatesEngine, folder: Path, cases: str, ranks: int) -> list:
    """Per case SAVEDxNEW and per measured rank, as for the optimizer state."""
    rows = []
    for case in cases.split(","):
        saved_tp, tp = (int(x) for x in case.split("x"))
        shutil.rmtree(folder, ignore_errors=True)
        doc = save_weights(engine, folder, saved_tp)
        files = [folder / rel for rel in doc["files"]]
        sums = functools.partial(reshard._manifest_sums, doc, folder)
        for t in range(min(ranks, tp)):
            row: dict[str, Any] = {"saved_tp": saved_tp, "tp": tp, "tp_rank": t}
            row["saved_bytes"] = sum(f.stat().st_size for f in files)
            for mode in ("whole", "ranged"):
                ranges = weight_reads(folder, saved_tp, tp, t, mode == "ranged")
                row.update({f"{mode}_{k}": v for k, v in measure(engine, files, ranges, sums).items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    shutil.rmtree(folder, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
