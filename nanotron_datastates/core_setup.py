"""Starting the C++ core from the engine's settings: the memory check, the pinning device, the warnings
about what this machine refuses (io_uring, page-locking)."""

from __future__ import annotations

import logging
import os

import torch

from . import _core
from .engine_settings import DataStatesConfig, node_ranks

log = logging.getLogger("nanotron_datastates")
_warned: set[str] = set()


def core_options(config: DataStatesConfig, pin_device: int) -> _core.EngineOptions:
    """The core's settings, every one from `config` (the core defaults none), in bytes and counts as the
    core takes them; `pin_device`: the CUDA device whose context pins the cache (-1: none)."""
    return _core.EngineOptions(
        # The cache
        cache_bytes=config.cache_bytes,
        chunk_bytes=config.chunk_bytes,
        pin_device=pin_device,
        huge_pages=config.huge_pages,
        # Saves: copy, flush, commit
        copy_threads=config.copy_threads or 1,
        host_copy_threads=config.copy_threads or min(4, os.cpu_count() or 1),
        checksum_threads=config.checksum_thread_count,
        device_copy_bytes=config.device_copy_bytes,
        device_copy_bytes_per_s=config.device_copy_gbps * 1e9,
        flush_threads=config.flush_threads,
        flush_nice=config.flush_nice,
        flush_depth=config.flush_depth,
        io_backend=config.io_backend,
        direct_io=config.direct_io,
        fsync=config.fsync,
        checksums=config.checksums,
        memory_checksums=config.memory_checksums,
        # Restores
        parser_threads=config.parser_thread_count,
        queue_depth=config.queue_depth,
        read_bytes=config.read_bytes,
        read_direct_io=config.read_direct_io,
        map_memory_files=config.map_memory_files,
    )


def start_core(config: DataStatesConfig) -> _core.Engine:
    """The core's engine (threads, host cache, flush workers) for `config`; ValueError naming the setting
    when the host cache cannot fit in this machine's memory."""
    check_memory(config)
    pin_device = -1
    if config.pin_host_cache and torch.cuda.is_available():
        pin_device = torch.cuda.current_device()
    core = _core.Engine(core_options(config, pin_device))
    if core.fallback_reason:
        _warn_once(f"io_uring is refused here ({core.fallback_reason}); flushing with a pwrite thread pool")
    if pin_device >= 0 and not core.pinned:
        _warn_once(f"could not page-lock the host cache ({core.pin_error}); GPU copies will be slower")
    return core


def check_memory(config: DataStatesConfig) -> None:
    """ValueError when the host caches of this node's ranks (each its own) ask for more than 90% of this
    machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    ranks = node_ranks()
    if config.cache_bytes * ranks > 0.9 * total:
        each = f" per rank, for {ranks} ranks on this node (LOCAL_WORLD_SIZE)," if ranks > 1 else ""
        raise ValueError(
            f"datastates.host_cache_size={config.host_cache_size} GiB{each} does not fit in this machine's "
            f"{total / 2**30:.1f} GiB of memory; use at most {0.9 * total / ranks / 2**30:.1f}"
        )


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)
