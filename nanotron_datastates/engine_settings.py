"""DataStatesConfig: every knob of the engine, validated, with defaults that suit a laptop and an 8-GPU node.

The Nanotron trainer's settings (`trainer_settings.TrainerSettings`) extend it with its own keys (rotation,
staging, telemetry, the memory tier): Nanotron's YAML `datastates:` section holds both (`Settings.from_dict`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping, TypeVar

ENV_PREFIX = "DATASTATES_"
S = TypeVar("S", bound="Settings")


class Settings:
    """Validation and parsing shared by the settings dataclasses: every message names the key (as
    `datastates.<key>`) and what it accepts, for a wrong type as for a value out of range."""

    RANGES: ClassVar[dict[str, tuple[float, float, str]]] = {}  # number fields: (low, high, rule)
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}  # str fields with a set of values (others: paths)

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = _kind(f)
            if kind == "bool":
                ok, rule = isinstance(value, bool), "expected true or false"
            elif kind == "str" and f.name in self.CHOICES:
                choices = self.CHOICES[f.name]
                ok, rule = value in choices, f"expected one of {', '.join(choices)}"
            elif kind == "str":  # a path; "" where the default is "" (the feature off)
                ok = isinstance(value, str) and (bool(value) or f.default == "")
                rule = "expected a path" + (' (or "" for none)' if f.default == "" else "")
            else:
                lo, hi, rule = self.RANGES[f.name]
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
                ok = ok and (kind == "float" or isinstance(value, int))
            if not ok:
                raise ValueError(f"datastates.{f.name}={value!r} is invalid: {rule}")

    @classmethod
    def from_dict(cls: type[S], d: Mapping[str, Any] | None = None, *, env: bool = True) -> S:
        """Builds the settings from a mapping (e.g. Nanotron's `datastates:` YAML section).

        Unknown keys raise ValueError naming them. With `env`, variables `DATASTATES_<KEY>` (e.g.
        `DATASTATES_HOST_CACHE_SIZE=8`) override the mapping: one job can be tuned without editing its YAML.
        """
        d = dict(d or {})
        known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(
                f"unknown datastates key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
            )
        from_env = {}
        if env:
            for name, f in known.items():
                raw = os.environ.get(ENV_PREFIX + name.upper())
                if raw is not None:
                    d[name], from_env[name] = _parse_env(name, _kind(f), raw), raw
        try:
            return cls(**d)
        except ValueError as e:  # a value the environment set: the variable named, not only the key
            key = next((n for n in from_env if f"datastates.{n}=" in str(e)), None)
            if key is None:
                raise
            raise ValueError(f"{e} (set by {ENV_PREFIX}{key.upper()}={from_env[key]!r})") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    # Read by key too, as Nanotron's sections are (`config.datastates["keep_last_n"]`).
    def __getitem__(self, key: str) -> object:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]


def _kind(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


@dataclass(frozen=True)
class DataStatesConfig(Settings):
    """Configuration of a :class:`DataStatesEngine`.

    Sizes are in GiB (cache) and MiB (chunks, reads), as users write them in YAML.
    """

    RANGES = {
        "host_cache_size": (1 / 1024, 1 << 20, "expected GiB in [1/1024, 2**20]"),
        "parser_threads": (0, 256, "expected an integer in [0, 256] (0: automatic)"),
        "copy_threads": (0, 256, "expected an integer in [0, 256] (0: automatic)"),
        "checksum_threads": (0, 256, "expected an integer in [0, 256] (0: automatic)"),
        "flush_threads": (1, 64, "expected an integer in [1, 64]"),
        "flush_nice": (0, 19, "expected an integer in [0, 19]"),
        "flush_depth": (1, 1024, "expected an integer in [1, 1024]"),
        "queue_depth": (1, 1024, "expected an integer in [1, 1024]"),
        "chunk_size": (1, 4096, "expected MiB in [1, 4096] (an integer)"),
        "device_copy_size": (0, 4096, "expected MiB in [0, 4096] (an integer; 0: one copy a chunk)"),
        "device_copy_gbps": (0, 1e4, "expected GB/s in [0, 10000] (0: the link's speed)"),
        "read_size": (1, 4096, "expected MiB in [1, 4096] (an integer)"),
    }
    CHOICES = {"io_backend": ("auto", "io_uring", "pwrite")}

    host_cache_size: float = 2.0
    """GiB of host memory for the cache, reserved at engine start and faulted in (and pinned) on first use or
    in the background from the first save on. A checkpoint smaller than this is captured without waiting for
    the disk; a larger one streams through with backpressure."""
    parser_threads: int = 0
    """Threads that read, parse and verify on restore. 0 (automatic): one per CPU of this rank's share of the
    node (torchrun's LOCAL_WORLD_SIZE), at least 4 and at most 16 (`parser_thread_count`): one rank reading
    the memory tier into GPU memory copies faster with more (H100: 15-19 GB/s with 8, 20-24 with 16) until
    the node's memory bounds it; a read of a disk waits on it, so more threads than cores still help (on 2
    cores: 4 beat 2)."""
    copy_threads: int = 0
    """Threads that serialize on save: plan each file and copy its tensors into the cache. 0 (automatic):
    one for a file with GPU tensors, whose bytes the copy engine moves (on the H100, four threads issuing
    copies slowed the training steps around a checkpoint: benchmarks/NOTES.md), and up to 4 (one per core)
    for a file of host tensors, whose bytes the threads move themselves. N: N for both."""
    checksum_threads: int = 0
    """Threads that sum (CRC-32C) the pieces of a file kept in memory only (a memory checkpoint, with
    `memory_checksums`) once they are copied, so that the copy threads go on copying at the link's speed;
    they run `flush_nice` below training. 0 (automatic): a quarter of this rank's share of the node's CPUs,
    from 1 to 4 (`checksum_thread_count`). Without `memory_checksums` (or with `checksums: false`) none is
    started. A file written to storage is summed by its flush worker as it is written."""
    pin_host_cache: bool = True
    """Page-lock the cache for DMA from GPUs (fast device-to-host copies). Ignored without a GPU."""
    huge_pages: bool = True
    """Back the cache with transparent huge pages where the kernel allows (not set to 'never'): faulting in
    and pinning many GiB then walk 2 MiB pages instead of 4 KiB ones."""
    flush_threads: int = 1
    """Flush workers; each owns an io_uring with `flush_depth` writes in flight (and sums what it writes)."""
    flush_nice: int = 10
    """Nice steps the flush workers' threads, which write and checksum in the background, run below the
    training's threads: where both want a core, the one feeding the GPU gets it (at 10, about 9 in 10 of
    its time), and a checkpoint takes longer to persist. A replica process (`memory_replica_process`) runs
    as far below its trainer. 0 runs them at the training's priority."""
    flush_depth: int = 4
    """Writes in flight per flush worker, each a cache chunk's piece (64 MiB by default): four keep a disk
    busy. A deeper queue hands the disk a whole checkpoint at once: on H100 machines, with two workers 16
    deep the steps just after a checkpoint lost 1.5 to 3 times as much as with one worker 4 deep, and the
    checkpoint persisted no faster (benchmarks/results/h100/overhead_180m_flush_depth/)."""
    queue_depth: int = 16
    """Reads in flight per parser thread on restore. Virtual and NVMe disks reach their bandwidth only with
    many requests in flight."""
    chunk_size: int = 64
    """MiB per cache chunk: the unit of copy and of write. Clamped to a quarter of the cache."""
    device_copy_size: int = 4
    """MiB per copy from a GPU to the cache: a chunk's bytes go in copies of this size, two in flight. A
    training step's own reads from the GPU (Nanotron reads the loss and the gradients' norm at every step)
    wait on the copy engine behind whatever copies to the host are queued there, from any stream: behind two
    of these, not a whole chunk (a 64 MiB copy takes about 1.2 ms on an H100's link). 0: a chunk's bytes in
    one copy."""
    device_copy_gbps: float = 16.0
    """GB/s at most for the copies to the host of a save staged on the GPU (`stage=True`; Nanotron's
    `device_snapshot`), which no step waits for. At the link's full speed (about 45 GB/s on an H100) a 2.16
    GB checkpoint crowded the two steps after it (+3 and +7 ms); at 16 GB/s its cost is spread over about
    four steps, none of which loses more than about 3 ms, and the checkpoint persists as fast, the disk being
    slower than either (benchmarks/results/h100/pace_rates_interval40/). The staged copy holds its GPU memory
    that much longer (here 0.14 s instead of 0.05 s). 0: as fast as the link goes. Saves not staged are
    copied at full speed (the caller waits for them), and so is a file kept in memory only (a memory
    checkpoint), whose copy's speed bounds how often one can be taken."""
    read_size: int = 16
    """MiB per read request on restore."""
    direct_io: bool = True
    """Write with O_DIRECT (bypasses the page cache); file systems without it (tmpfs) are written buffered."""
    read_direct_io: bool = True
    """Read into GPU memory with O_DIRECT (through pinned chunks, bypassing the page cache); file systems
    without it are read buffered, and files other ranks of the node read too always are (`page_cache`)."""
    fsync: bool = True
    """fsync each file and its directory before a save counts as persisted. Turn off only for scratch data."""
    checksums: bool = True
    """Store a CRC-32C per tensor in the header."""
    memory_checksums: bool = False
    """Sum a file kept in memory only (a memory checkpoint's, `save(..., mirror=path)` with its own path) too.
    Summing reads every byte back from host memory beside training (14.5 GB a checkpoint of a 1.1B model),
    which slows the steps around it; without, its restart checks each file's structure and sizes, not its
    bytes: the copy lives in the node's memory, as the training state it copies does, in files private to
    the user. Files written to storage (and their copies in memory) are summed as `checksums` says."""
    verify_checksums: bool = True
    """Verify stored checksums on load."""
    map_memory_files: bool = True
    """Read a file in memory (tmpfs: the memory tier) to a GPU through a mapping: each byte is copied once
    into pinned memory, summed there and uploaded while the next piece is copied. Off: read(2) into the
    cache's chunks, as any other file."""
    io_backend: str = "auto"
    """'auto' (io_uring, else pwrite with a warning), 'io_uring' (error if refused) or 'pwrite'."""
    telemetry_path: str = ""
    """Append one JSON line per saved file to this file, once it is persisted or failed: bytes, the caller's
    stall, the times to snapshot and to persisted, the host cache's waits (`nanotron-datastates plot` draws
    it). "" writes none. The Nanotron trainer writes its own, per checkpoint (`telemetry`)."""

    @property
    def parser_thread_count(self) -> int:
        """The parser threads the engine runs: `parser_threads`, or where 0 the automatic count."""
        return self.parser_threads or auto_parser_threads()

    @property
    def checksum_thread_count(self) -> int:
        """The checksum threads the engine runs where memory-only files are summed: `checksum_threads`, or
        where 0 the automatic count."""
        return self.checksum_threads or auto_checksum_threads()

    # Derived sizes, in bytes, as the core takes them.
    @property
    def cache_bytes(self) -> int:
        return int(self.host_cache_size * (1 << 30))

    @property
    def chunk_bytes(self) -> int:
        # At least two chunks must fit; 4096-aligned for O_DIRECT.
        chunk = min(self.chunk_size << 20, self.cache_bytes // 4)
        return max(4096, chunk // 4096 * 4096)

    @property
    def device_copy_bytes(self) -> int:
        return self.device_copy_size << 20

    @property
    def read_bytes(self) -> int:
        return self.read_size << 20


MIN_PARSER_THREADS = 4  # the fewest `parser_threads: 0` gives, also what reads beside training use


def rank_share(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """The CPUs of a rank's share of the node: `cpus` (this process's) over `local_ranks` (torchrun's
    LOCAL_WORLD_SIZE, or none: one rank)."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return cpus // max(1, local_ranks if local_ranks is not None else node_ranks())


def node_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; none: one)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, int(raw)) if raw.isdigit() else 1


def auto_parser_threads(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """`parser_threads: 0`: one per CPU of a rank's share of the node, from 4 to 16. A restore runs before
    training does: it has the share to itself."""
    return max(MIN_PARSER_THREADS, min(16, rank_share(cpus, local_ranks)))


def auto_checksum_threads(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """`checksum_threads: 0`: a quarter of a rank's share of the node, from 1 to 4. They run beside training,
    whose threads keep the rest. On an H200 host four summed 30 GB/s behind a copy of 49 GB/s (one: 9,
    eight: 39): a memory checkpoint commits a little after its copy ends, and no copy waits for them."""
    return max(1, min(4, rank_share(cpus, local_ranks) // 4))


def _parse_env(name: str, kind: str, raw: str) -> Any:
    var = ENV_PREFIX + name.upper()
    try:
        if kind == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except ValueError:
        allowed = " (1, true, yes, on or 0, false, no, off)" if kind == "bool" else ""
        raise ValueError(f"environment variable {var}={raw!r} is not a valid {kind}{allowed}") from None
