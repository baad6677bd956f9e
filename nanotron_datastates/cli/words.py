"""Words and units for the command's output: plurals and sizes."""

from __future__ import annotations

import statistics


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
