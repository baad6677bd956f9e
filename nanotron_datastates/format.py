"""The file format (specified in docs/FORMAT.md): safetensors, with the engine's extras in `__metadata__`.

:func:`header_metadata` composes a file's `__metadata__` (the core lays the file out and writes it, adding
`datastates.crc32c` once the data is summed); :func:`parse_header` accepts any valid safetensors file and
rejects anything else with a FormatError naming the file: it is the only code that trusts nothing about
its input.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable

import torch

from . import trust
from .errors import FormatError

FORMAT_VERSION = 1
KEY_VERSION = "datastates.version"
KEY_SKELETON = "datastates.skeleton"
KEY_CRC = "datastates.crc32c"
KEY_BLOCK_CRC = "datastates.crc32c_blocks"
RESERVED_PREFIX = "datastates."
MAX_HEADER = 100_000_000  # the safetensors limit


def header_metadata(user: dict[str, str], skeleton: str | None) -> list[tuple[str, str]]:
    """A file's `__metadata__`, in order, but for the checksums: the caller's keys alone for an exact-
    metadata file (`skeleton` None), else `format` (unless the caller sets it), the caller's keys, the format
    version and the skeleton. Raises for a key that is not a string or is reserved."""
    for k, v in user.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str; got {k!r}: {type(v).__name__}")
        if k.startswith(RESERVED_PREFIX):
            raise ValueError(f"metadata key {k!r} is reserved (prefix {RESERVED_PREFIX!r})")
    if skeleton is None:
        return list(user.items())
    md = [] if "format" in user else [("format", "pt")]  # what safetensors' torch writer puts there
    return [*md, *user.items(), (KEY_VERSION, str(FORMAT_VERSION)), (KEY_SKELETON, skeleton)]


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling
    torch: torch.dtype
    itemsize: int


def _dtypes() -> dict[str, DType]:
    table = [
        ("F64", "float64", 8), ("F32", "float32", 4), ("F16", "float16", 2), ("BF16", "bfloat16", 2),
        ("I64", "int64", 8), ("I32", "int32", 4), ("I16", "int16", 2), ("I8", "int8", 1),
        ("U64", "uint64", 8), ("U32", "uint32", 4), ("U16", "uint16", 2), ("U8", "uint8", 1),
        ("BOOL", "bool", 1), ("C64", "complex64", 8),
        ("F8_E4M3", "float8_e4m3fn", 1), ("F8_E5M2", "float8_e5m2", 1),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1), ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
        ("F8_E8M0", "float8_e8m0fnu", 1),
    ]  # fmt: skip
    out = {}
    for name, attr, size in table:
        dt = getattr(torch, attr, None)  # older torch lacks some
        if dt is not None:
            out[name] = DType(name, dt, size)
    return out


DTYPES: dict[str, DType] = _dtypes()
_BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in DTYPES.values()}


def dtype_of(t: torch.dtype) -> DType:
    """The safetensors dtype of a torch dtype; TypeError if the format has none."""
    try:
        return _BY_TORCH[t]
    except KeyError:
        raise TypeError(f"{t} has no safetensors dtype") from None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    path: str
    tensors: tuple[TensorEntry, ...]  # file order
    metadata: dict[str, str]
    data_start: int
    file_size: int

    def checksums(self) -> dict[str, int] | None:
        """Stored CRC-32C per tensor name, or None when the file has none."""
        raw = self.metadata.get(KEY_CRC)
        if raw is None:
            return None
        return {t.name: int(raw[8 * i : 8 * i + 8], 16) for i, t in enumerate(self.tensors)}

    def block_checksums(self) -> tuple[int, dict[str, list[int]]] | None:
        """(B, stored CRC-32C of each block segment per tensor name), or None when the file has none: a
        tensor's segments are its bytes cut at the multiples of B in the data section (docs/FORMAT.md)."""
        raw = self.metadata.get(KEY_BLOCK_CRC)
        parsed = parse_blocks(raw) if raw is not None else None
        if parsed is None:
            return None
        (block, crcs), pos, out = parsed, 0, {}
        for t in self.tensors:
            n = segments(t.begin, t.nbytes, block)
            out[t.name] = crcs[pos : pos + n]
            pos += n
        return block, out

    def user_metadata(self) -> dict[str, str]:
        """`__metadata__` without the engine's own keys."""
        return {k: v for k, v in self.metadata.items() if not k.startswith(RESERVED_PREFIX)}


def read_header(path: str | os.PathLike) -> Header:
    """Reads and validates the header of the safetensors file at `path`."""
    path = os.fspath(path)
    fd = trust.open_to_read(path)  # a FIFO or folder: an error naming it, never a wait
    try:
        return read_header_fd(fd, path)
    finally:
        os.close(fd)


def read_header_fd(fd: int, path: str) -> Header:
    """Reads and validates the header of the open file `fd` (`path` names it in errors)."""
    size = os.fstat(fd).st_size
    head = _pread(fd, 8, 0)
    end = _header_end(head)
    if end is not None and end <= size:
        head += _pread(fd, end - 8, 8)
    return parse_header(head, size, path)


def header_end(fd: int) -> int | None:
    """Where the header of the file open on `fd` ends (its first 8 bytes give its length), or None where
    those bytes are missing or the length is beyond the format's limit: a file still arriving can be read
    from there once that many bytes are in."""
    return _header_end(_pread(fd, 8, 0))


def _header_end(head: bytes) -> int | None:
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    return 8 + n if n <= MAX_HEADER else None


def _pread(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n > 0:
        chunk = os.pread(fd, min(n, 1 << 30), offset)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _fail(path: str, msg: str) -> FormatError:
    return FormatError(f"{path}: not a valid safetensors file: {msg}")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return d


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(buf: bytes, file_size: int, path: str = "<buffer>") -> Header:
    """Validates `buf` (the first 8 + N bytes of a file of `file_size` bytes) as a safetensors header."""
    if file_size < 8 or len(buf) < 8:
        raise _fail(path, f"{file_size} bytes is too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER:
        raise _fail(path, f"header length {n} exceeds the format's limit of {MAX_HEADER}")
    if 8 + n > file_size or len(buf) < 8 + n:
        raise _fail(path, f"header length {n} runs past the end of the file ({file_size} bytes); truncated?")
    raw = buf[8 : 8 + n]
    if not raw.startswith(b"{"):
        raise _fail(path, "header does not start with '{'")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "header is not a JSON object")

    meta = doc.pop("__metadata__", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _fail(path, "__metadata__ must map strings to strings")

    entries = []
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise _fail(path, f"tensor {name!r}: entry is not an object")
        spelled = info.get("dtype")
        dtype = DTYPES.get(spelled) if isinstance(spelled, str) else None
        if dtype is None:
            raise _fail(path, f"tensor {name!r}: unknown dtype {info.get('dtype')!r}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise _fail(path, f"tensor {name!r}: shape must be a list of non-negative integers")
        if math.prod(max(s, 1) for s in shape) >= 2**63:
            # torch counts elements and strides in 64 bits: [2**64, 0] holds no byte but no tensor has it
            raise _fail(path, f"tensor {name!r}: shape {shape} does not fit 63 bits")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise _fail(path, f"tensor {name!r}: data_offsets must be two integers")
        begin, end = offs
        if not 0 <= begin <= end:
            raise _fail(path, f"tensor {name!r}: bad data_offsets {offs}")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise _fail(
                path, f"tensor {name!r}: {end - begin} bytes cannot hold {dtype.name} of shape {tuple(shape)}"
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), begin, end))

    entries.sort(key=lambda entry: (entry.begin, entry.end))
    pos = 0
    for entry in entries:
        if entry.begin != pos:
            what = "overlaps the previous one" if entry.begin < pos else "leaves a hole before it"
            raise _fail(path, f"tensor {entry.name!r} at offset {entry.begin} {what} (expected {pos})")
        pos = entry.end
    data_len = file_size - 8 - n
    if pos != data_len:
        raise _fail(path, f"tensors cover {pos} bytes but the data section has {data_len}; truncated?")

    version = meta.get(KEY_VERSION)
    if version is not None and (not _decimal(version) or int(version) > FORMAT_VERSION):
        raise _fail(path, f"written by a newer nanotron-datastates (format {version!r}); upgrade to read it")
    crc = meta.get(KEY_CRC)
    if crc is not None and (len(crc) != 8 * len(entries) or not all(c in "0123456789abcdef" for c in crc)):
        raise _fail(path, f"{KEY_CRC} must hold 8 lowercase hex digits per tensor")
    blocks = meta.get(KEY_BLOCK_CRC)
    if blocks is not None:
        parsed = parse_blocks(blocks)
        want = sum(segments(e.begin, e.nbytes, parsed[0]) for e in entries) if parsed else -1
        if parsed is None or len(parsed[1]) != want:
            raise _fail(
                path,
                f"{KEY_BLOCK_CRC} must hold a block size (a power of two, 4096 or more), ':', "
                "and 8 lowercase hex digits per block segment",
            )
    return Header(path, tuple(entries), meta, 8 + n, file_size)


_HEX = frozenset("0123456789abcdef")


def parse_blocks(text: str) -> tuple[int, list[int]] | None:
    """(B, the CRCs) from the spelling of block checksums (`KEY_BLOCK_CRC`, and a manifest's
    `crc32c_blocks`): B in decimal, ':', 8 lowercase hex digits per segment; None where it is malformed or B
    is not a power of two of 4096 or more."""
    size, colon, digits = text.partition(":")
    block = int(size) if _decimal(size) else 0
    if not colon or block < 4096 or block & (block - 1) or len(digits) % 8 or not _HEX.issuperset(digits):
        return None
    return block, [int(digits[i : i + 8], 16) for i in range(0, len(digits), 8)]


def spell_blocks(block: int, crcs: Iterable[int]) -> str:
    """The spelling `parse_blocks` reads."""
    return f"{block}:" + "".join(f"{c:08x}" for c in crcs)


def _decimal(text: str) -> bool:
    """ASCII digits only (str.isdigit also takes '²', which int() refuses), at most 19: int() refuses over
    4300, and no number here needs more than 63 bits."""
    return text.isascii() and text.isdigit() and len(text) <= 19


def segments(begin: int, nbytes: int, block: int) -> int:
    """How many block segments a tensor of `nbytes` at `begin` in the data section has."""
    return (begin + nbytes - 1) // block - begin // block + 1 if nbytes else 0
