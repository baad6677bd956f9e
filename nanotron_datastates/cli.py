"""The `nanotron-datastates` command: inspect, verify, convert, bench, plot. Works on CPU-only machines.

Exit status: 0 when all is well, 1 when `verify` finds problems (or a command fails), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .nanotron import checkpoint


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as e:  # our errors name the file or setting at fault
        print(f"nanotron-datastates {args.command}: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanotron-datastates", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("inspect", help="files, tensors, dtypes, shapes, bytes, engine, step, topology")
    c.add_argument("path", help="a checkpoints folder, one checkpoint folder, or one safetensors file")
    c.add_argument("--json", action="store_true", help="print JSON instead of text")
    c.add_argument("--tensors", action="store_true", help="list every tensor of a folder's files too")
    c.set_defaults(func=cmd_inspect)

    c = sub.add_parser("verify", help="checksums, every rank's files, headers; exit 0 only if all is well")
    c.add_argument("path", help="a checkpoints folder, one checkpoint folder, or one safetensors file")
    c.add_argument("--json", action="store_true", help="print JSON instead of text")
    c.set_defaults(func=cmd_verify)

    c = sub.add_parser("convert", help="a checkpoint folder to Nanotron's stock layout, or from it")
    c.add_argument("src", help="a checkpoint folder")
    c.add_argument("out", help="the folder to write (must not exist, or be empty)")
    c.add_argument("--to", required=True, choices=["torch", "datastates"], help="the layout to write")
    c.set_defaults(func=cmd_convert)

    c = sub.add_parser("bench", help="the engine against torch.save + fsync on this machine")
    c.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024)")
    c.add_argument("--repeat", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    c.add_argument("--dir", help="where to write (default: the temporary folder)")
    c.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    c.add_argument("--no-baseline", action="store_true", help="skip torch.save")
    c.add_argument("--json", help="also write the results to this file")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_bench)

    c = sub.add_parser("plot", help="draw the telemetry of a checkpoints folder (PNG)")
    c.add_argument("path", help="a checkpoints folder or its datastates_telemetry.jsonl")
    c.add_argument("-o", "--out", default="datastates_telemetry.png", help="the PNG to write")
    c.set_defaults(func=cmd_plot)
    return p


# -- inspect ------------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    kind = checkpoint.kind_of(path)
    if kind == "file":
        info: dict[str, Any] = checkpoint.describe_file(path)
    elif kind == "checkpoint":
        info = checkpoint.describe_checkpoint(path)
    elif kind == "root":
        info = checkpoint.describe_root(path)
    else:
        raise ValueError(f"{path}: neither a safetensors file nor a checkpoint folder")
    if args.json:
        print(json.dumps(info, indent=1))
    elif kind == "file":
        print(_file_text(info))
    elif kind == "checkpoint":
        print(_checkpoint_text(info, args.tensors))
    else:
        latest = info["latest"]
        print(f"{info['path']}: {len(info['checkpoints'])} checkpoints, latest.txt names {latest}")
        for ck in info["checkpoints"]:
            print(_checkpoint_line(ck))
    return 0


def _checkpoint_line(ck: dict[str, Any]) -> str:
    topo = ", ".join(f"{k}={v}" for k, v in ck["topology"].items() if v is not None) or "?"
    state = "committed" if ck["committed"] else "NOT committed"
    latest = ", latest" if ck["latest"] else ""
    return (
        f"  {Path(ck['path']).name}: step {ck['step']}, {ck['engine'] or 'unknown engine'}, {state}{latest}; "
        f"{len(ck['files'])} files, {ck['tensors']} tensors, {ck['bytes'] / 1e9:.3f} GB; {topo}"
    )


def _checkpoint_text(ck: dict[str, Any], tensors: bool) -> str:
    lines = [f"{ck['path']}:", _checkpoint_line(ck)]
    for f in ck["files"]:
        extra = f", {f['tensors']} tensors {'/'.join(f['dtypes'])}" if "tensors" in f else ""
        error = f"  ERROR {f['error']}" if "error" in f else ""
        lines.append(f"    {f['file']}: {f['bytes']} bytes{extra}{error}")
        if tensors and f["file"].endswith(".safetensors") and "error" not in f:
            for t in checkpoint.describe_file(Path(ck["path"]) / f["file"])["tensors"]:
                lines.append(f"      {t['name']}: {t['dtype']} {t['shape']} ({t['bytes']} bytes)")
    if ck["temporaries"]:
        lines.append(f"  {len(ck['temporaries'])} temporaries left by a process that died mid-save")
    return "\n".join(lines)


def _file_text(info: dict[str, Any]) -> str:
    checks = "CRC-32C per tensor" if info["checksums"] else "no checksums"
    count = len(info["tensors"])
    lines = [f"{info['path']}: {info['bytes']} bytes, {count} tensors, {info['engine']}, {checks}"]
    for t in info["tensors"]:
        lines.append(f"  {t['name']}: {t['dtype']} {t['shape']} ({t['bytes']} bytes)")
    for k, v in info["metadata"].items():
        lines.append(f"  metadata {k} = {v[:100]}")
    return "\n".join(lines)


# -- verify -------------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    report = checkpoint.verify(args.path)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(report.path),
                    "ok": report.ok,
                    "problems": report.problems,
                    "notes": report.notes,
                    "files_checked": report.files_checked,
                    "tensors_checksummed": report.tensors_checksummed,
                },
                indent=1,
            )
        )
    else:
        for n in report.notes:
            print(f"note: {n}")
        for p in report.problems:
            print(f"PROBLEM: {p}")
        verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
        print(
            f"{report.path}: {verdict}; {report.files_checked} files checked, "
            f"{report.tensors_checksummed} tensors checksummed"
        )
    return 0 if report.ok else 1


# -- convert, bench, plot -----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from .nanotron.convert import convert

    out = convert(args.src, args.out, to=args.to)
    print(f"{args.src} -> {out} ({args.to} layout)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.size_mib < 1 or args.repeat < 1:
        raise ValueError("--size-mib and --repeat must be at least 1")
    result = bench.run(
        args.size_mib,
        args.repeat,
        args.dir,
        args.device,
        baseline=not args.no_baseline,
        progress=not args.quiet,
    )
    print(bench.table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .nanotron.housekeeping import read_telemetry

    records = read_telemetry(args.path)
    if not records:
        raise ValueError(f"{args.path}: no telemetry records")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plot needs matplotlib: pip install matplotlib") from None
    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(steps, [1e3 * r["stall_s"] for r in records], marker="o", label="training stall")
    top.plot(steps, [1e3 * r["snapshot_s"] for r in records], marker=".", label="snapshot")
    top.set_ylabel("ms")
    top.legend()
    bottom.plot(steps, [r["persisted_s"] for r in records], marker="o", label="persisted")
    bottom.plot(steps, [r["committed_s"] for r in records], marker=".", label="committed")
    bottom.plot(steps, [r["cache_wait_s"] for r in records], marker="x", label="waiting for free cache")
    bottom.set_ylabel("s")
    bottom.set_xlabel("step")
    bottom.legend()
    failed = [r["step"] for r in records if not r["committed"]]
    for s in failed:
        top.axvline(s, color="red", linestyle=":")
    top.set_title(
        f"checkpoints: {len(records)} ({len(failed)} failed), {_median_gb(records):.2f} GB each (median)"
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"{args.out}: {len(records)} checkpoints")
    return 0


def _median_gb(records: list[dict[str, Any]]) -> float:
    import statistics

    return statistics.median(r["bytes"] for r in records) / 1e9


if __name__ == "__main__":
    sys.exit(main())
