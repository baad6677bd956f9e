"""Who holds the GIL, from py-spy's raw output (`py-spy record --gil --threads --subprocesses -f raw`): per
process and thread (by name: the engine's threads are named `datastates-*`), the seconds it held the GIL and
the functions it held it in, inclusive, most first, and the innermost (leaves). The raw output of a run is
tens of MB; this summary is what comes back from the GPU machine (`gpu.sh gil-180m`).

    python3 micro/gil_summary.py RAW --rate 100 [--out summary.json] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

THREAD = re.compile(r"^thread \(\d+\): ?(.*)$")
PROCESS = re.compile(r'^process \d+:"(.*)"$')
LINE = re.compile(r":\d+\)$")  # a frame's line number: a function counts once, whatever line it was at


def summarize(lines: list[str], rate: float, top: int = 15) -> dict[str, dict[str, object]]:
    """{"<process> | <thread>": {"gil_s", "samples", "functions": [[function, seconds], ...]}} from raw
    lines (`frame;frame;... count`), `rate` samples a second."""
    samples: collections.Counter[str] = collections.Counter()
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # With --subprocesses, a child's stack starts with each process above it, then its thread: the
        # innermost process and thread name who held the GIL.
        process = thread = ""
        start = 0
        while start < len(frames):
            if m := PROCESS.match(frames[start]):
                process = m.group(1)
            elif m := THREAD.match(frames[start]):
                thread = m.group(1) or "unnamed"
            else:
                break
            start += 1
        who = f"{_short(process) if process else '?'} | {thread or '?'}"
        n = int(count)
        samples[who] += n
        calls = [LINE.sub(")", f) for f in frames[start:]]
        for f in set(calls):  # inclusive: once a stack
            functions[who][f] += n
        if calls:
            leaves[who][calls[-1]] += n
    return {
        who: {
            "gil_s": round(n / rate, 3),
            "samples": n,
            "functions": [[f, round(k / rate, 3)] for f, k in functions[who].most_common(top)],
            "leaves": [[f, round(k / rate, 3)] for f, k in leaves[who].most_common(top)],
        }
        for who, n in samples.most_common()
    }


def _short(command: str) -> str:
    """A process by what tells it apart: bench_nanotron's `--mode`, else its command's last word."""
    words = command.split()
    if "--mode" in words[:-1]:
        return words[words.index("--mode") + 1]
    return words[-1] if words else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path)
    ap.add_argument("--rate", type=float, required=True, help="py-spy's --rate: samples a second")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with open(args.raw) as f:
        summary = summarize(f.readlines(), args.rate, args.top)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    for who, s in list(summary.items())[:12]:
        print(f"{s['gil_s']:8.2f} s  {who}")
        for f, sec in s["functions"][:6]:  # type: ignore[index]
            print(f"{'':12}{sec:7.2f} s  {f}")


if __name__ == "__main__":
    main()
