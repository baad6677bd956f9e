"""Exceptions of nanotron_datastates. Every exception the package defines derives from DataStatesError,
beside the built-in class it has always been (ValueError, RuntimeError, OSError, ImportError), so that callers
catch either. I/O failures of the system are plain OSError (with errno and the file's path)."""


class DataStatesError(Exception):
    """The base of every exception nanotron_datastates defines."""


class FormatError(DataStatesError, ValueError):
    """A file is not a valid safetensors file, or its nanotron-datastates metadata is malformed."""


class ChecksumError(FormatError):
    """A tensor's bytes do not match the checksum stored in its file's header."""


class CheckpointError(DataStatesError, RuntimeError):
    """A checkpoint could not be committed (earlier checkpoints, and `latest.txt`, are untouched), or no
    committed checkpoint could be read whole on resume."""


class UntrustedPath(DataStatesError, OSError):
    """A path that is not what the package wrote: a link, a name leaving its folder, a file of another user,
    a folder others can write to. The message names the path and what is wrong with it (raised by
    `trust`, the one module that checks paths)."""
