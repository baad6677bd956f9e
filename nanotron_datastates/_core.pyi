"""
nanotron_datastates core: host cache, copy, io_uring flush, restore (private; use the package API)
"""

from collections.abc import Sequence

import torch


class EngineOptions:
    def __init__(self, cache_bytes: int, chunk_bytes: int, pin_device: int, huge_pages: bool, copy_threads: int, host_copy_threads: int, checksum_threads: int, device_copy_bytes: int, device_copy_bytes_per_s: float, flush_threads: int, flush_nice: int, flush_depth: int, io_backend: str, direct_io: bool, fsync: bool, checksums: bool, memory_checksums: bool, parser_threads: int, queue_depth: int, read_bytes: int, read_direct_io: bool, map_memory_files: bool) -> None:
        """
        Every setting by keyword, none defaulted here: DataStatesConfig owns the defaults
        """

    @property
    def cache_bytes(self) -> int: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def pin_device(self) -> int: ...

    @property
    def huge_pages(self) -> bool: ...

    @property
    def copy_threads(self) -> int: ...

    @property
    def host_copy_threads(self) -> int: ...

    @property
    def checksum_threads(self) -> int: ...

    @property
    def device_copy_bytes(self) -> int: ...

    @property
    def device_copy_bytes_per_s(self) -> float: ...

    @property
    def flush_threads(self) -> int: ...

    @property
    def flush_nice(self) -> int: ...

    @property
    def flush_depth(self) -> int: ...

    @property
    def io_backend(self) -> str: ...

    @property
    def direct_io(self) -> bool: ...

    @property
    def fsync(self) -> bool: ...

    @property
    def checksums(self) -> bool: ...

    @property
    def memory_checksums(self) -> bool: ...

    @property
    def parser_threads(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def read_bytes(self) -> int: ...

    @property
    def read_direct_io(self) -> bool: ...

    @property
    def map_memory_files(self) -> bool: ...

def remove_tree(root: str, parts: Sequence[str]) -> bool:
    """
    Removes root/parts... and all in it without following a link; False where it was not removed whole
    """

def takeable(root: str, files: Sequence[Sequence[str]]) -> list[int]:
    """
    For each file (its parts below root), whether it is a regular file of this user's with one name, reached without following a link
    """

def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data`, continuing from `crc`"""

def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int: ...

def crc32c_copy(data: bytes, offset: int = 0) -> tuple:
    """
    (CRC-32C, the bytes) of `data` copied `offset` bytes into a new buffer, summed as they are stored
    """

def copy_streaming(dst: int, src: int, n: int) -> None:
    """
    Copies `n` bytes from address `src` to `dst` (memory the caller holds, not overlapping) with non-temporal stores: no read of dst's lines first
    """

def encode_header(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], itemsizes: Sequence[int], metadata: Sequence[tuple[str, str]], checksums: bool, block_bytes: int = 0) -> bytes:
    """
    The header bytes the engine writes for these tensors (checksums as zeros): for tests and tools
    """

class StagedView:
    def __init__(self, *, base: int, offset: int, itemsize: int, shape: Sequence[int]) -> None:
        """
        A staged tensor: bytes [offset, offset + itemsize * prod(shape)) of the save's buffer `base` (a uint8 buffer), C-contiguous
        """

    @property
    def base(self) -> int: ...

    @base.setter
    def base(self, arg: int, /) -> None: ...

    @property
    def offset(self) -> int: ...

    @offset.setter
    def offset(self, arg: int, /) -> None: ...

    @property
    def itemsize(self) -> int: ...

    @itemsize.setter
    def itemsize(self, arg: int, /) -> None: ...

    @property
    def shape(self) -> list[int]: ...

    @shape.setter
    def shape(self, arg: Sequence[int], /) -> None: ...

class FileSave:
    def __init__(self, *, path: str, names: Sequence[str], dtypes: Sequence[str], metadata: Sequence[tuple[str, str]], embed_checksums: bool, arrays: Sequence[torch.Tensor] = [], views: Sequence[StagedView] = [], mirror: str = '', recycle: str = '') -> None:
        """
        A file to save at `path`: its tensors' names and safetensors dtypes, and the tensors (`arrays`) or their places in the save's buffers (`views`); `mirror`: a second copy's path, the save's staging memory (empty: none); `recycle`: an earlier save's mirror file to take this one's bytes (empty: none)
        """

    @property
    def path(self) -> str: ...

    @path.setter
    def path(self, arg: str, /) -> None: ...

    @property
    def names(self) -> list[str]: ...

    @names.setter
    def names(self, arg: Sequence[str], /) -> None: ...

    @property
    def dtypes(self) -> list[str]: ...

    @dtypes.setter
    def dtypes(self, arg: Sequence[str], /) -> None: ...

    @property
    def metadata(self) -> list[tuple[str, str]]: ...

    @metadata.setter
    def metadata(self, arg: Sequence[tuple[str, str]], /) -> None: ...

    @property
    def embed_checksums(self) -> bool: ...

    @embed_checksums.setter
    def embed_checksums(self, arg: bool, /) -> None: ...

    @property
    def arrays(self) -> list[torch.Tensor]: ...

    @arrays.setter
    def arrays(self, arg: Sequence[torch.Tensor], /) -> None: ...

    @property
    def views(self) -> list[StagedView]: ...

    @views.setter
    def views(self, arg: Sequence[StagedView], /) -> None: ...

    @property
    def mirror(self) -> str: ...

    @mirror.setter
    def mirror(self, arg: str, /) -> None: ...

    @property
    def recycle(self) -> str: ...

    @recycle.setter
    def recycle(self, arg: str, /) -> None: ...

class MirrorLayout:
    def __init__(self, *, path: str, names: Sequence[str], dtypes: Sequence[str], itemsizes: Sequence[int], shapes: Sequence[Sequence[int]], metadata: Sequence[tuple[str, str]], embed_checksums: bool) -> None:
        """
        A mirror file to make at `path`, laid out as a save of tensors of these names, dtypes, item sizes and shapes with this metadata lays out its file
        """

    @property
    def path(self) -> str: ...

    @path.setter
    def path(self, arg: str, /) -> None: ...

    @property
    def names(self) -> list[str]: ...

    @names.setter
    def names(self, arg: Sequence[str], /) -> None: ...

    @property
    def dtypes(self) -> list[str]: ...

    @dtypes.setter
    def dtypes(self, arg: Sequence[str], /) -> None: ...

    @property
    def itemsizes(self) -> list[int]: ...

    @itemsizes.setter
    def itemsizes(self, arg: Sequence[int], /) -> None: ...

    @property
    def shapes(self) -> list[list[int]]: ...

    @shapes.setter
    def shapes(self, arg: Sequence[Sequence[int]], /) -> None: ...

    @property
    def metadata(self) -> list[tuple[str, str]]: ...

    @metadata.setter
    def metadata(self, arg: Sequence[tuple[str, str]], /) -> None: ...

    @property
    def embed_checksums(self) -> bool: ...

    @embed_checksums.setter
    def embed_checksums(self, arg: bool, /) -> None: ...

built_with_io_uring: bool = True

io_uring_absent_why: str = ''

class Job:
    @property
    def path(self) -> str: ...

    def wait_snapshot(self, timeout: float = -1.0) -> bool:
        """False on timeout"""

    def wait_persisted(self, timeout: float = -1.0) -> bool:
        """False on timeout"""

    def snapshot_done(self) -> bool: ...

    def persisted_done(self) -> bool: ...

    def failed(self) -> bool: ...

    def raise_error(self) -> None:
        """Raises the job's error (OSError, ValueError or RuntimeError), if any"""

    def stats(self) -> dict: ...

    def mirror_error(self) -> str:
        """Why the mirror copy was dropped (empty: it was not)"""

    def summed(self) -> bool:
        """Whether its tensors are summed (checksums() once persisted)"""

    def checksums(self) -> list[tuple[str, int]]:
        """[(tensor name, CRC-32C)] in file order, once persisted"""

    def block_checksums(self) -> tuple[int, list[tuple[str, list[int]]]]:
        """
        (block size, [(tensor name, [CRC-32C per block segment])]) in file order, once persisted
        """

def wait_jobs(jobs: Sequence[Job], persisted: bool, timeout: float = -1.0) -> bool:
    """Waits for every job; False on timeout"""

class Engine:
    def __init__(self, options: EngineOptions) -> None:
        """
        The core's engine, started with `options` (an EngineOptions: core_setup.core_options)
        """

    @property
    def options(self) -> EngineOptions:
        """The settings it was started with"""

    def save_many(self, files: Sequence[FileSave], bases: Sequence[torch.Tensor], streams: Sequence[tuple[int, int]]) -> list[Job]:
        """
        Queues the files (FileSave each; their views' bytes in `bases`), their device copies after an event recorded on each of `streams` [(device, stream)]; one Job each
        """

    def prepare_mirrors(self, files: Sequence[MirrorLayout]) -> int:
        """
        Makes, maps and pins a mirror file for each MirrorLayout, laid out as a save of such tensors; kept mapped for a save to recycle
        """

    def keep_mirrors(self, paths: Sequence[str] | None) -> int:
        """
        Keeps these mirror files (None: those still there) mapped; unmaps the others
        """

    def restore_host(self, path: str, data_start: int, data_len: int, begins: Sequence[int], ends: Sequence[int], verify: bool, fd: int = -1) -> tuple:
        """
        Maps the file (`fd`, an open descriptor of `path`, where >= 0) and reads its data section in parallel: ([uint8 tensor per span], crcs)
        """

    def restore_device(self, path: str, data_start: int, data_len: int, begins: Sequence[int], dests: Sequence[torch.Tensor], verify: bool, fd: int = -1, page_cache: bool = False) -> list[int]:
        """
        Reads the data section (of `fd`, an open descriptor of `path`, where >= 0) into CUDA tensors through pinned chunks (host destinations take the same path, memcpy for the upload; `page_cache`: never with O_DIRECT); returns the crcs
        """

    def prepare_cache(self, wait: bool, chunks: int) -> None: ...

    def wait_idle(self, timeout: float = -1.0) -> bool: ...

    def close(self) -> None: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def backend(self) -> str: ...

    @property
    def fallback_reason(self) -> str: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def pin_error(self) -> str: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def num_chunks(self) -> int: ...

    def cache_stats(self, reset: bool = False) -> dict: ...

def cuda_available() -> bool: ...

def cuda_unavailable_reason() -> str: ...
