"""The `nanotron-datastates` command: inspect, verify, convert, bench, plot, tier. Works on CPU-only machines.

`inspect` and `verify` take any checkpoint the engine writes: one safetensors file, a folder of files written
by `DataStatesEngine.save` (searched recursively), one Nanotron checkpoint folder (with `datastates.json`, or
Nanotron's own with `checkpoint_metadata.json`), or a checkpoints folder (with `latest.txt` and step folders).

Exit status: 0 when all is well, 1 when `verify` finds problems or a command fails (also when the reader of
its output goes away first, as `| head` does: then quietly), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .nanotron.checkpoint import folder as checkpoint
from .nanotron.checkpoint import verify

EXIT_STATUS = "exit status: 0 all is well, 1 problems found or the command failed, 2 bad usage"
TELEMETRY = "datastates_telemetry.jsonl"  # telemetry.FILE, without importing it for --help


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader of our output is gone (`... | head -1`): as Python's documentation recommends, point
        # stdout at /dev/null so that the flush at exit does not fail again, and exit quietly.
        _stdout_to_devnull()
        return 1


def _run(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit:  # --help, or bad usage: what argparse printed must reach a closed pipe here
        sys.stdout.flush()
        raise
    try:
        rc = args.func(args)
    except BrokenPipeError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # our errors name the file or setting at fault
        sys.stdout.flush()
        print(f"nanotron-datastates {args.command}: {e}", file=sys.stderr)
        return 1
    sys.stdout.flush()  # inside the try: a closed pipe is noticed here, not at exit
    return rc


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanotron-datastates", description=__doc__.split("\n\n")[0], epilog=EXIT_STATUS
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    what = (
        "a safetensors file, a folder of files written by DataStatesEngine.save (searched recursively), "
        "a Nanotron checkpoint folder, or a checkpoints folder (holding latest.txt and step folders)"
    )

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, epilog=EXIT_STATUS)

    c = command(
        "inspect",
        "files, tensors, dtypes, shapes, sizes, engine, step, topology",
        "Describes a checkpoint: its files with their tensors, dtypes and sizes; for a Nanotron checkpoint "
        "also its engine, step, topology and whether it is committed. Reads headers only.",
    )
    c.add_argument("path", help=what)
    c.add_argument("--json", action="store_true", help="print JSON instead of text (default: text)")
    c.add_argument(
        "--tensors",
        action="store_true",
        help="list every tensor (name, dtype, shape, size) of every file; with --json, as each file's "
        "tensor_list (default: off: files with their tensor counts and dtypes)",
    )
    c.set_defaults(func=cmd_inspect)

    c = command(
        "verify",
        "headers, sizes, every tensor's checksum, every rank's files; exit 0 only if all is well",
        "Reads every file of a checkpoint whole: its header, its size (against the manifest where there is "
        "one) and every tensor's CRC-32C (stored in the file, or in datastates.json); for a Nanotron "
        "checkpoint also that every rank's files and Nanotron's own files are there, and for a checkpoints "
        "folder that latest.txt names a committed checkpoint. Exits 0 only if no problem is found.",
    )
    c.add_argument("path", help=what)
    c.add_argument(
        "--json",
        action="store_true",
        help="print the report (problems, notes and counts) as JSON instead of text (default: text)",
    )
    c.set_defaults(func=cmd_verify)

    c = command(
        "convert",
        "a checkpoint folder to Nanotron's stock layout, or from it",
        "Writes a checkpoint folder in another layout: 'torch' (the folder Nanotron's own save() writes, "
        "optimizer, LR scheduler and random states as pickles) or 'datastates' (this engine's safetensors "
        "files, with their checksums and the manifest). A datastates checkpoint's files are checked against "
        "its manifest on the way. Nothing is unpickled without --allow-pickle: Nanotron's .pt files are read "
        "with torch.load(weights_only=True).",
    )
    c.add_argument("src", help="the checkpoint folder to read (one step folder, not a checkpoints folder)")
    c.add_argument("out", help="the folder to write (must not exist, or be empty)")
    c.add_argument(
        "--to",
        required=True,
        choices=["torch", "datastates"],
        help="the layout to write: torch or datastates (required, no default)",
    )
    c.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle what the source holds (Nanotron's .pt files with torch.load(weights_only=False)), "
        "which runs any code they name: only for a checkpoint you trust (default: off: only tensors, plain "
        "containers and the classes of Nanotron's random states are read, anything else is refused)",
    )
    c.set_defaults(func=cmd_convert)

    c = command(
        "bench",
        "the engine against torch.save + fsync on this machine",
        "Saves and loads a synthetic state with the engine, and with torch.save + fsync, and prints the "
        "median times and throughputs.",
    )
    c.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default: 1024)")
    c.add_argument("--repeat", type=int, default=3, help="timed rounds after one warm-up (default: 3)")
    c.add_argument(
        "--dir", help="where to write; the files are removed after (default: the temporary folder)"
    )
    c.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda[:N] (default: cpu)")
    c.add_argument(
        "--no-baseline", action="store_true", help="skip torch.save + fsync (default: it is measured too)"
    )
    c.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON (default: none)")
    c.add_argument("--quiet", action="store_true", help="no progress bar (default: a progress bar on stderr)")
    c.set_defaults(func=cmd_bench)

    c = command(
        "plot",
        "draw the telemetry of a checkpoints folder (PNG)",
        f"Draws one point per checkpoint from a telemetry file ({TELEMETRY}): the training stall and "
        "snapshot time, the times to persisted and committed, and the time spent waiting for free cache. "
        "The Nanotron trainer writes that file into its checkpoints folder when its config sets "
        "`datastates.telemetry: true`; the plain engine writes the same lines when given a telemetry path "
        "(DataStatesEngine(..., telemetry_path=...)).",
    )
    c.add_argument("path", help=f"a checkpoints folder holding {TELEMETRY}, or a telemetry file")
    c.add_argument(
        "-o", "--out", default="datastates_telemetry.png", help="the PNG to write (default: %(default)s)"
    )
    c.set_defaults(func=cmd_plot)

    c = command(
        "tier",
        "list or clear the memory tier (checkpoints kept in node-local shared memory)",
        "The Nanotron trainer, with `datastates.memory_tier: true`, keeps each rank's newest committed "
        "checkpoint in a tmpfs too, so that a restart on the same node reads it from memory; it removes it "
        "when training ends normally. After a crash it stays: `tier list` shows what each job holds there, "
        "`tier clear` removes it (all jobs' folders, or the one of a checkpoints folder).",
    )
    c.add_argument("action", choices=["list", "clear"], help="list the jobs' folders, or remove them")
    c.add_argument(
        "checkpoints", nargs="?", help="clear only the job of this checkpoints folder (default: every job)"
    )
    c.add_argument(
        "--path",
        default="/dev/shm/nanotron-datastates-{uid}",
        help="the memory tier's folder, as `datastates.memory_tier_path` sets it ({uid}: this user's id; "
        "default: %(default)s)",
    )
    c.add_argument(
        "--json", action="store_true", help="with list: print JSON instead of text (default: text)"
    )
    c.set_defaults(func=cmd_tier)
    return p


# -- words and units ----------------------------------------------------------------------------------------


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 tensor', '2 tensors', '0 tensors' (`many` where adding an s does not make the plural)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def human_bytes(n: int | float) -> str:
    """A size in decimal units, three significant digits: '512 B', '12.3 kB', '2.16 GB' (1 kB = 1000 B)."""
    if n < 1000:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        text = f"{value:.3g}"
        if float(text) < 1000:
            return f"{text} {unit}"
    return f"{value:.3g} PB"


# -- inspect ------------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    info = checkpoint.describe(args.path, tensors=args.tensors)
    if args.json:
        text = json.dumps(info, indent=1)
    elif info["kind"] == "file":
        text = _file_text(info, args.tensors)
    elif info["kind"] == "folder":
        text = _folder_text(info)
    elif info["kind"] == "checkpoint":
        text = _checkpoint_text(info)
    else:
        text = _root_text(info, args.tensors)
    print(text)
    return 0


def _root_text(info: dict[str, Any], tensors: bool) -> str:
    latest = info["latest"]
    named = f"latest.txt names {latest}" if latest is not None else "no readable latest.txt"
    lines = [f"{info['path']}: {plural(len(info['checkpoints']), 'checkpoint')}, {named}"]
    for ck in info["checkpoints"]:
        lines.append(_checkpoint_line(ck))
        if tensors:
            lines.extend(_files_lines(ck["files"], "    "))
    return "\n".join(lines)


def _checkpoint_line(ck: dict[str, Any]) -> str:
    topo = ", ".join(f"{k}={v}" for k, v in ck["topology"].items() if v is not None) or "?"
    state = "committed" if ck["committed"] else "NOT committed"
    latest = ", latest" if ck["latest"] else ""
    step = "?" if ck["step"] is None else ck["step"]
    return (
        f"  {Path(ck['path']).name}: step {step}, {ck['engine'] or 'unknown engine'}, {state}{latest}; "
        f"{plural(len(ck['files']), 'file')}, {plural(ck['tensors'], 'tensor')}, {human_bytes(ck['bytes'])}; "
        f"{topo}"
    )


def _checkpoint_text(ck: dict[str, Any]) -> str:
    lines = [f"{ck['path']}:", _checkpoint_line(ck), *_files_lines(ck["files"], "    ")]
    lines.extend(_temporaries_lines(ck["temporaries"]))
    return "\n".join(lines)


def _folder_text(info: dict[str, Any]) -> str:
    files = info["files"]
    lines = [
        f"{info['path']}: {plural(len(files), 'safetensors file')}, {plural(info['tensors'], 'tensor')}, "
        f"{human_bytes(info['bytes'])}"
    ]
    lines.extend(_files_lines(files, "  "))
    lines.extend(_temporaries_lines(info["temporaries"]))
    return "\n".join(lines)


def _files_lines(files: list[dict[str, Any]], indent: str) -> list[str]:
    """One line per file; under a safetensors file read with its tensors, one line per tensor."""
    lines = []
    for f in files:
        desc = [human_bytes(f["bytes"])]
        if "tensors" in f:
            desc.append(f"{plural(f['tensors'], 'tensor')} {'/'.join(f['dtypes'])}".rstrip())
            desc.append(_writer_text(f["engine"], f["checksums"], f.get("checksums_in_manifest", False)))
        error = f"  ERROR {f['error']}" if "error" in f else ""
        lines.append(f"{indent}{f['file']}: {', '.join(desc)}{error}")
        lines.extend(_tensor_lines(f.get("tensor_list", []), indent + "  "))
    return lines


def _tensor_lines(tensors: list[dict[str, Any]], indent: str) -> list[str]:
    return [f"{indent}{t['name']}: {t['dtype']} {t['shape']} ({human_bytes(t['bytes'])})" for t in tensors]


def _temporaries_lines(temporaries: list[str]) -> list[str]:
    if not temporaries:
        return []
    n = plural(len(temporaries), "temporary", "temporaries")
    return [f"  {n} left by a process that died mid-save: {', '.join(temporaries)}"]


def _writer_text(engine: str, checksums: bool, in_manifest: bool = False) -> str:
    if checksums:
        return f"{engine}, CRC-32C per tensor"
    return f"{engine}, {'CRC-32C per tensor in datastates.json' if in_manifest else 'no checksums'}"


def _file_text(info: dict[str, Any], tensors: bool) -> str:
    listed = info["tensors"]
    dtypes = "/".join(sorted({t["dtype"] for t in listed}))
    size = sum(t["bytes"] for t in listed)
    count = f"{plural(len(listed), 'tensor')} {dtypes}".rstrip()
    lines = [
        f"{info['path']}: {human_bytes(info['bytes'])}, {count} ({human_bytes(size)} of data), "
        f"{_writer_text(info['engine'], info['checksums'])}"
    ]
    if tensors:
        lines.extend(_tensor_lines(listed, "  "))
    for k, v in info["metadata"].items():
        lines.append(f"  metadata {k} = {v[:100]}{'...' if len(v) > 100 else ''}")
    return "\n".join(lines)


# -- verify -------------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    if checkpoint.kind_of(args.path) not in checkpoint.KINDS:
        raise checkpoint.NotACheckpoint(checkpoint.explain(args.path))
    report = verify.verify(args.path)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        for n in report.notes:
            print(f"note: {n}")
        for p in report.problems:
            print(f"PROBLEM: {p}")
        print(_verify_summary(report))
    return 0 if report.ok else 1


def _verify_summary(r: verify.Report) -> str:
    verdict = "OK" if r.ok else f"FAILED ({plural(len(r.problems), 'problem')})"
    files = plural(r.files_checked, "file") + " checked"
    if r.files_failed:
        files += f" ({r.files_failed} failed)"
    tensors = plural(r.tensors_checksummed, "tensor") + " checksummed"
    if r.tensors_failed:
        tensors += f" ({r.tensors_failed} failed)"
    parts = [files, tensors]
    if r.files_without_checksums:
        parts.append(f"{plural(r.files_without_checksums, 'file')} without checksums (structure checked)")
    return f"{r.path}: {verdict}; {', '.join(parts)}"


# -- convert, bench, plot -----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from .nanotron.checkpoint.convert import convert

    out = convert(args.src, args.out, to=args.to, allow_pickle=args.allow_pickle)
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


HOW_TO_GET_TELEMETRY = (
    f"the Nanotron trainer writes {TELEMETRY} into its checkpoints folder when its config sets "
    "`datastates.telemetry: true`; the plain engine writes the same lines when given a telemetry path, "
    "DataStatesEngine(..., telemetry_path=...)"
)


def telemetry_records(path: str | os.PathLike) -> tuple[Path, list[dict[str, Any]]]:
    """The telemetry file `path` names (itself, or the one in the folder) and its records; ValueError or
    FileNotFoundError say what was looked for and how to get one."""
    from . import format as fmt
    from .telemetry import read as read_telemetry

    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no such file or folder: {path}")
    if path.is_dir():
        file = path / TELEMETRY
        if not file.is_file():
            hint = ""
            if (path.parent / TELEMETRY).is_file():
                hint = f" ({path.parent} holds one: plot that folder)"
            raise FileNotFoundError(
                f"{file}: no such file (plot looks for {TELEMETRY} in the folder it is given){hint}; "
                f"{HOW_TO_GET_TELEMETRY}"
            )
    else:
        file = path
        try:
            fmt.read_header(file)
        except (OSError, ValueError):
            pass
        else:
            raise ValueError(
                f"{file}: a safetensors file, not telemetry; plot needs a telemetry file ({TELEMETRY}) "
                f"or the checkpoints folder holding one: {HOW_TO_GET_TELEMETRY}"
            )
    try:
        records = read_telemetry(file)
    except UnicodeDecodeError:
        records = []
    records = [r for r in records if isinstance(r, dict)]
    if not records:
        raise ValueError(
            f"{file}: no telemetry records (JSON lines as in {TELEMETRY}); plot needs a telemetry file "
            f"or the checkpoints folder holding one: {HOW_TO_GET_TELEMETRY}"
        )
    return file, records


def cmd_plot(args: argparse.Namespace) -> int:
    file, records = telemetry_records(args.path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plot needs matplotlib: pip install matplotlib") from None

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [scale * r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in records]

    have_steps = all(isinstance(r.get("step"), int) for r in records)
    xs = [r["step"] for r in records] if have_steps else list(range(1, len(records) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(xs, series("stall_s", 1e3), marker="o", label="training stall")
    top.plot(xs, series("snapshot_s", 1e3), marker=".", label="snapshot")
    top.set_ylabel("ms")
    top.legend()
    bottom.plot(xs, series("persisted_s"), marker="o", label="persisted")
    bottom.plot(xs, series("committed_s"), marker=".", label="committed")
    bottom.plot(xs, series("cache_wait_s"), marker="x", label="waiting for free cache")
    bottom.set_ylabel("s")
    bottom.set_xlabel("step" if have_steps else "checkpoint")
    bottom.legend()
    failed = [x for x, r in zip(xs, records) if r.get("committed") is False]
    for x in failed:
        top.axvline(x, color="red", linestyle=":")
    sizes = [r["bytes"] for r in records if isinstance(r.get("bytes"), (int, float))]
    each = f", {_median_size(sizes)} each (median)" if sizes else ""
    top.set_title(f"{plural(len(records), 'checkpoint')} ({len(failed)} failed){each}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"{args.out}: {plural(len(records), 'checkpoint')} from {file}")
    return 0


def cmd_tier(args: argparse.Namespace) -> int:
    from .nanotron import memory_tier as tier

    args.path = args.path.replace("{uid}", str(os.geteuid()))
    if args.action == "list":
        jobs = tier.jobs(args.path)
        if args.json:
            print(json.dumps(jobs, indent=1))
            return 0
        if not jobs:
            print(f"{args.path}: no checkpoint held in memory")
        for j in jobs:
            steps = ", ".join(map(str, j["steps"])) or "none"
            print(
                f"{j['folder']}: {j['checkpoints'] or '(checkpoints folder unknown)'}, "
                f"{plural(len(j['steps']), 'step')} ({steps}), {human_bytes(j['bytes'])}"
            )
        return 0
    folders = [tier.job_folder(args.path, args.checkpoints)] if args.checkpoints else None
    removed = tier.clear_jobs(args.path, folders)
    print(f"{args.path}: removed {plural(len(removed), 'job folder')}")
    return 0


def _median_size(sizes: list[int | float]) -> str:
    import statistics

    return human_bytes(statistics.median(sizes))


if __name__ == "__main__":
    sys.exit(main())
