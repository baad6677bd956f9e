"""Words and units for the command's output: plurals, sizes, and names made safe to print."""

from __future__ import annotations

import statistics
import unicodedata


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


def median_size(sizes: list[int | float]) -> str:
    return human_bytes(statistics.median(sizes))


def printable(text: str) -> str:
    """`text` with every control, format or separator character escaped (`\\n`, `\\x1b`, `\\u202e`): a name
    read from disk then cannot start a line of its own (a forged `PROBLEM:`), move the cursor or reorder
    what follows."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch == " " or unicodedata.category(ch)[0] not in "CZ":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def print_lines(lines: list[str]) -> None:
    """Prints each line with `printable`: one line of output per line given, whatever the names hold."""
    print("\n".join(printable(line) for line in lines))
