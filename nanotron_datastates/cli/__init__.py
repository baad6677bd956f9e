"""The `nanotron-datastates` command: inspect, verify, convert, bench, plot, tier. Works on CPU-only machines.

`inspect` and `verify` take any checkpoint the engine writes: one safetensors file, a folder of files written
by `DataStatesEngine.save` (searched recursively), one Nanotron checkpoint folder (with `datastates.json`, or
Nanotron's own with `checkpoint_metadata.json`), or a checkpoints folder (with `latest.txt` and step folders).

Exit status: 0 when all is well, 1 when `verify` finds problems or a command fails (also when the reader of
its output goes away first, as `| head` does: then quietly), 2 on bad usage.

`parser` holds the grammar; each group of subcommands has its module: `checkpoints` (inspect, verify,
convert), `measure` (bench, plot), `tier`; `words` spells sizes and plurals.
"""

from __future__ import annotations

import os
import sys

from .parser import build_parser
from .words import printable

__all__ = ["main"]


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
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, or bad usage: what argparse printed must reach a closed pipe here
        sys.stdout.flush()
        raise
    try:
        rc = args.func(args)
    except BrokenPipeError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # our errors name the file or setting at fault
        sys.stdout.flush()
        print(printable(f"nanotron-datastates {args.command}: {_reason(e)}"), file=sys.stderr)
        return 1
    sys.stdout.flush()  # inside the try: a closed pipe is noticed here, not at exit
    return rc


def _reason(e: BaseException) -> str:
    """The error in words: an OSError as `path: what` (never a bare `[Errno N]`), anything else as is."""
    if isinstance(e, OSError) and e.strerror:
        where = ", ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        return f"{where}: {e.strerror}" if where else e.strerror
    return str(e)


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
