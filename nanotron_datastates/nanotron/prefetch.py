"""Resume, read ahead: this rank's weight files and optimizer shard are read onto its GPU on a thread of their
own, started before Nanotron builds the model, so that the disk works while the model is built.

A prefetch is only an optimization: whatever it could not read (no memory, a damaged file, another file than
the one wanted) the trainer reads again the ordinary way, which raises the error where there is one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..engine import DataStatesEngine

log = logging.getLogger("nanotron_datastates")


def warm_page_cache(paths: Iterable[Path]) -> int:
    """Reads these (small) files through the page cache now; returns the bytes read. Read after the read-ahead
    has filled the disk's queue, as the trainer reads the scheduler's, the random states' and the metadata
    files, each waits behind it (0 to 0.6 s in all on an H100); read before, they come from memory then. A
    file that cannot be read is skipped: it is read again where it is used, which raises its error."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += len(Path(path).read_bytes())
    return total


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:  # read again where it is used, which raises the error
        return 0


class Prefetch:
    """Reads `weights` (files, each a flat dict of tensors), then `optimizer` (one file), onto `device`;
    `checksums(path)` gives the CRC-32C a weight file is checked against (None: those in the file)."""

    def __init__(
        self,
        engine: DataStatesEngine,
        device: torch.device,
        weights: list[Path],
        optimizer: Path | None,
        checksums: Callable[[Path], dict[str, int] | None],
    ) -> None:
        self._engine, self._device, self._checksums = engine, device, checksums
        self._t0 = time.perf_counter()
        self.timings: dict[str, float] = {}  # seconds after the start: each read's end, each wait
        self.nbytes = sum(_size(p) for p in [*weights, *([optimizer] if optimizer is not None else [])])
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datastates-prefetch")
        # One thread, so the weights (needed first, once the model is built) are read before the optimizer.
        self._weights = pool.submit(self._read_weights, weights) if weights else None
        self._optimizer = pool.submit(self._read_optimizer, optimizer) if optimizer is not None else None
        pool.shutdown(wait=False)

    @property
    def reads_optimizer(self) -> bool:
        """Whether the optimizer state is being read (and not yet handed over)."""
        return self._optimizer is not None

    def weights(self) -> dict[Path, dict[str, torch.Tensor]]:
        """The weight files read, by path (empty where they could not be read); waits for them. Once only:
        the prefetch lets go of them, so that their memory goes back once the caller is done with them."""
        future, self._weights = self._weights, None
        t = time.perf_counter()
        out = self._result(future, "weights") or {}
        self.timings["weights_waited"] = time.perf_counter() - t
        return out

    def optimizer(self, path: Path) -> Any | None:
        """The optimizer state, if the file read is `path`; waits for it. Once only, as :meth:`weights`."""
        future, self._optimizer = self._optimizer, None
        t = time.perf_counter()
        got = self._result(future, "optimizer state")
        self.timings["optimizer_waited"] = time.perf_counter() - t
        return got[1] if got is not None and got[0] == path else None

    def _result(self, future: concurrent.futures.Future | None, what: str) -> Any:
        if future is None:
            return None
        try:
            return future.result()
        except Exception as e:  # read again the ordinary way, which reports the error if there is one
            log.warning("reading the %s ahead failed (%s); reading it again", what, e)
            return None

    def _read_weights(self, paths: list[Path]) -> dict[Path, dict[str, torch.Tensor]]:
        def read(path: Path) -> dict[str, torch.Tensor]:
            self._on_device()
            return self._engine.load(path, self._device, checksums=self._checksums(path))

        workers = max(1, self._engine.config.parser_threads)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="datastates-prefetch") as pool:
            out = dict(zip(paths, pool.map(read, paths)))
        self._synchronize()
        self.timings["weights_read"] = time.perf_counter() - self._t0
        return out

    def _read_optimizer(self, path: Path) -> tuple[Path, Any]:
        self._on_device()
        state = self._engine.load(path, self._device)
        self._synchronize()
        self.timings["optimizer_read"] = time.perf_counter() - self._t0
        return path, state

    def report(self) -> str:
        """When each read ended and how long the trainer waited for it, in seconds after the start, and the
        rate of the reads (bytes of all the files over the time until the last read ended): where that rate is
        the disk's, a resume cannot start sooner."""
        text = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in self.timings.items())
        ends = [v for k, v in self.timings.items() if k.endswith("_read")]
        if ends and max(ends) > 0:
            text += f"; {self.nbytes / 1e9:.2f} GB at {self.nbytes / max(ends) / 1e9:.2f} GB/s"
        return text

    def _on_device(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def _synchronize(self) -> None:
        if self._device.type == "cuda":  # the main thread's stream uses them next
            torch.cuda.current_stream(self._device).synchronize()


def fill(
    targets: list[tuple[torch.Tensor, Path]],
    ahead: dict[Path, dict[str, torch.Tensor]],
    engine: DataStatesEngine,
    checksums: Callable[[Path], dict[str, int] | None],
) -> None:
    """Fills each tensor with the `data` of its file: from what was read ahead (a copy on the device), else
    read now, several files at once. `ahead` is emptied (its memory goes back once the copies are done)."""

    def read(target: tuple[torch.Tensor, Path]) -> None:
        tensor, path = target
        got = ahead.get(path, {}).get("data")
        with torch.no_grad():
            if got is not None and got.shape == tensor.shape and got.dtype == tensor.dtype:
                tensor.copy_(got)
                return
            engine.load_into(path, {"data": tensor}, checksums=checksums(path))

    workers = max(1, engine.config.parser_threads)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="datastates-load") as pool:
        list(pool.map(read, targets))
    ahead.clear()
