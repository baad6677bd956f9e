"""How long the memory tier takes to check the files a save takes over (no GPU): `MemoryTier.recycle` asks,
on the training thread, which files of a donor folder are regular single-named files of this user's, no
link on the way. A tree shaped like a rank's checkpoint of Nanotron's Llama (a weight file per parameter
eight folders deep, and the optimizer's file) in a tmpfs, checked by `folders.ours` (one pass, each folder
opened once) and one file at a time, walking from the donor's folder down to each (as before `ours`).

    python3 benchmarks/micro/bench_take_over_check.py --out DIR [--layers 22 --repeat 30]

Writes DIR/bench_take_over_check.json (medians in ms).
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nanotron_datastates import trust
from nanotron_datastates.tier.folders import ours

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info, write_json  # noqa: E402

MODULES = ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj", "input_layernorm")
MODULES += ("post_attention_layernorm",)


def one_by_one(folder: Path, rels: list[str]) -> set[str]:
    out = set()
    for rel in rels:
        parts = trust.relative_name(rel, str(folder)).parts
        try:
            with trust.walk_dir(folder, parts[:-1]) as fd:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
            out.add(rel)
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--out", required=True)
    a.add_argument("--layers", type=int, default=22, help="decoder layers (22: the 1.1B, 8: the 180M)")
    a.add_argument("--repeat", type=int, default=30)
    a.add_argument("--folder", default="/dev/shm")
    args = a.parse_args()
    rels = [
        f"model/model/decoder/{layer}/pp_block/{m}/model_weight.safetensors"
        for layer in range(args.layers)
        for m in MODULES
    ]
    rels += [
        "model/model/token_position_embeddings/pp_block/token_embedding/model_weight.safetensors",
        "model/model/final_layer_norm/pp_block/model_weight.safetensors",
        "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors",
    ]
    top = Path(tempfile.mkdtemp(dir=args.folder))
    try:
        for rel in rels:
            (top / rel).parent.mkdir(parents=True, exist_ok=True)
            (top / rel).write_bytes(b"x")
        result: dict[str, object] = {"command": command_info()}
        result["files"] = len(rels)
        for name, check in (("one_by_one_ms", one_by_one), ("one_pass_ms", ours)):
            assert check(top, rels) == set(rels)
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                check(top, rels)
                times.append(time.perf_counter() - t)
            result[name] = statistics.median(times) * 1e3
            print(f"{name}: {result[name]:.2f} ms for {len(rels)} files")
    finally:
        shutil.rmtree(top)
    write_json(Path(args.out) / "bench_take_over_check.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
