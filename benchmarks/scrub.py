"""Rewrites the paths of the machine a benchmark ran on in its result files, before they are kept:

    python3 benchmarks/scrub.py DIR [DIR ...]

In every text file under each DIR (JSON, Markdown, logs), the repository's root becomes `<repo>`, the
results folder `<out>`, work folders (under /tmp, /work) `<work>`, site-packages `<site-packages>`, a Python
interpreter's path its name, and a home folder `~`. The figures are untouched.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = {".json", ".md", ".txt", ".log", ".jsonl", ".yaml"}
RULES = [
    (re.compile(r"/[\w./+-]*/bin/(python3?(?:\.\d+)?)\b"), r"\1"),
    (re.compile(r"/[\w./+-]*?/(?:site|dist)-packages"), "<site-packages>"),
    (re.compile(re.escape(str(REPO)) + r"(?=[/\s\"',:)]|$)"), "<repo>"),
    (re.compile(r"/(?:work|home)/[\w.+-]+/main(?=[/\s\"',:)]|$)"), "<repo>"),
    (re.compile(r"/root/out(?=[/\s\"',:)]|$)"), "<out>"),
    (re.compile(r"/(?:tmp|work)/[\w.+-]+"), "<work>"),
    (re.compile(r"/(?:root|home/[\w.+-]+)(?=/)"), "~"),
]


def scrub_text(text: str) -> str:
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    changed = 0
    for top in map(Path, argv):
        for path in sorted(p for p in top.rglob("*") if p.is_file() and p.suffix in TEXT):
            text = path.read_text(errors="replace")
            clean = scrub_text(text)
            if clean != text:
                path.write_text(clean)
                changed += 1
    print(f"{changed} files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
