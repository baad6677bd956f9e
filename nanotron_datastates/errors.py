"""Exceptions of nanotron_datastates. I/O failures are plain OSError (with errno and the file's path)."""


class FormatError(ValueError):
    """A file is not a valid safetensors file, or its nanotron-datastates metadata is malformed."""


class ChecksumError(FormatError):
    """A tensor's bytes do not match the checksum stored in its file's header."""
