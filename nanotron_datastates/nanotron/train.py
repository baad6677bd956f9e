"""`python -m nanotron_datastates.nanotron.train --config-file CONFIG [--run-train PATH]`

Runs Nanotron's own run_train.py with the datastates engine registered (as the post-import hook does, also
when NANOTRON_DATASTATES_AUTOLOAD=0). run_train.py is found with --run-train, else $NANOTRON_RUN_TRAIN, else
next to a source checkout of Nanotron (`<checkout>/run_train.py`).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def find_run_train(explicit: str | None) -> Path:
    candidates = [explicit, os.environ.get("NANOTRON_RUN_TRAIN")]
    try:
        import nanotron

        if getattr(nanotron, "__file__", None):  # not a namespace package named nanotron
            candidates.append(str(Path(nanotron.__file__).resolve().parents[2] / "run_train.py"))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise SystemExit(
        "cannot find Nanotron's run_train.py: pass --run-train PATH or set NANOTRON_RUN_TRAIN "
        "(it is at the root of a Nanotron checkout)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-train", help="path of Nanotron's run_train.py")
    args, rest = parser.parse_known_args(argv)
    from . import trainer

    trainer.install(sys.modules["nanotron.trainer"])
    path = find_run_train(args.run_train)
    sys.argv = [str(path), *rest]
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main()
