"""The command line's grammar: each subcommand, its arguments with their defaults, and what runs it."""

from __future__ import annotations

import argparse
import os

from .checkpoints import cmd_convert, cmd_inspect, cmd_verify
from .measure import TELEMETRY, cmd_bench, cmd_plot
from .tier import cmd_tier

DESCRIPTION = (
    "The `nanotron-datastates` command: inspect, verify, convert, bench, plot, tier. "
    "Works on CPU-only machines."
)
EXIT_STATUS = "exit status: 0 all is well, 1 problems found or the command failed, 2 bad usage"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanotron-datastates", description=DESCRIPTION, epilog=EXIT_STATUS)
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
    c.add_argument("--size-mib", type=_at_least_one, default=1024, help="state size in MiB (default: 1024)")
    c.add_argument(
        "--repeat", type=_at_least_one, default=3, help="timed rounds after one warm-up (default: 3)"
    )
    c.add_argument(
        "--dir",
        type=_existing_folder,
        help="where to write; the files are removed after (default: the temporary folder)",
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
        "-o",
        "--out",
        help="the PNG to write, in a folder that exists (default: datastates_telemetry.png beside the "
        "telemetry file drawn)",
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


def _at_least_one(text: str) -> int:
    """An integer of at least 1; anything else is bad usage (exit 2, the message naming the value)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def _existing_folder(text: str) -> str:
    if not os.path.isdir(text):
        why = "is not a folder" if os.path.lexists(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {why}")
    return text
